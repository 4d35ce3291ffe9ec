"""``memfit bench``: memfit's plans beside every baseline, each measured in fresh processes.

For one TARGET: a real-tensor profile (start bytes, the no-plan peak), then for each
configuration three children (:mod:`memfit.bench.child`): peak memory (RSS or CUDA
allocator), step time (median after warm-up) and FLOPs (FlopCounterMode counts the
recompute). memfit rows add the plan's predicted peak and planning time.

A row's ``measured_peak_bytes`` is the tensors alive at the step's start (from the ledger)
plus the measured rise over the start, so rows compare with budgets and predictions, which
count tensor bytes; the interpreter and libraries are left out.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import memfit
from memfit.bench.child import run_child
from memfit.bench.methods import BASELINES, SCENARIOS, applicable, describe, setup
from memfit.target import load_target

__all__ = ["Row", "run_bench", "BENCH_FORMAT"]

BENCH_FORMAT = "memfit.bench/1"


@dataclass
class Row:
    """One configuration, measured."""

    method: str
    """``none``, ``every``, ``every-other``, ``sequential``, ``compile``, ``recipe``, ``memfit``
    or ``memfit+compile`` (the memfit plan of the same budget, then ``torch.compile``)."""
    budget: float | int | None
    """The budget: a fraction (compile and memfit rows) or bytes (memfit in a scenario)."""
    label: str
    measured_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    step_time_s: float | None = None
    recompute_flops: int | None = None
    plan_time_s: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_bench(
    target: str,
    budgets: list[float],
    *,
    batch_size: int | None = None,
    sizes: Mapping[str, Any] | None = None,
    device: str = "cpu",
    steps: int = 5,
    compile: bool = True,
    scenario: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[list[Row], dict[str, Any]]:
    """Measure every configuration of ``target``; returns the rows and context (peaks,
    device, torch version) for reports.

    With ``scenario`` (a key of :data:`~memfit.bench.methods.SCENARIOS`) the rows are
    no checkpointing, the scenario's hand-picked recipe, and memfit planned for the
    recipe's exact peak (from a fake-tensor run of it): the same memory, compared."""
    import torch

    report = progress or (lambda desc, done, total: None)
    work = load_target(target, batch_size=batch_size, sizes=sizes)
    model = work.model.to(device)
    inputs, targets = torch.utils._pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (work.inputs, work.targets)
    )
    optimizer = work.make_optimizer()
    report("profiling", 0, 1)
    t0 = time.perf_counter()
    prof = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=optimizer, targets=targets)
    profile_s = time.perf_counter() - t0  # every plan is charged the profile it starts from

    configs: list[tuple[str, float | int | None, str, str]] = []  # (method, budget, label, child method)
    if scenario is not None:
        _, recipe, label = SCENARIOS[scenario]
        same = _recipe_peak(target, recipe, batch_size, sizes, work)
        configs += [("none", None, describe("none"), "none"), ("recipe", None, f"recipe: {label}", recipe)]
        configs += [("memfit", same, f"memfit at {memfit.format_bytes(same)}", "")]
    else:
        for m in BASELINES:
            if applicable(m, model) is None:
                configs.append((m, None, describe(m), m))
        if compile:
            configs += [("compile", b, f"torch.compile {b:g}", f"compile:{b}") for b in budgets]
        configs += [("memfit", b, f"memfit {b:.0%}", "") for b in budgets]
        if compile:
            configs += [("memfit+compile", b, f"memfit {b:.0%} + compile", "") for b in budgets]

    rows: list[Row] = []
    common = dict(batch_size=batch_size, sizes=sizes, device=device)
    base_flops: int | None = None
    plans: dict[Any, Path] = {}  # budget -> the memfit row's plan, which memfit+compile rows reuse
    with tempfile.TemporaryDirectory() as tmp:
        for i, (method, budget, label, child_method) in enumerate(configs):
            report(label, i, len(configs))
            row = Row(method, budget, label)
            if method == "memfit+compile":
                if budget not in plans:
                    row.error = "no memfit plan at this budget"
                    rows.append(row)
                    continue
                child_method = f"plan+compile:{plans[budget]}"
            if method == "memfit":
                t0 = time.perf_counter()
                try:
                    plan = memfit.plan(
                        model, inputs, budget, loss_fn=work.loss_fn, optimizer=optimizer, profile=prof, targets=targets
                    )
                except memfit.MemfitError as exc:
                    row.error = str(exc)
                    rows.append(row)
                    continue
                row.plan_time_s = profile_s + time.perf_counter() - t0
                # measured below as max_memory_allocated on CUDA: the plan's allocated peak, not
                # the reserved one its budget bounds there
                row.predicted_peak_bytes = (
                    plan.allocated_peak_bytes if plan.allocated_peak_bytes is not None else plan.predicted_peak_bytes
                )
                path = Path(tmp) / f"plan-{i}.json"
                path.write_text(plan.to_json())
                plans[budget] = path
                child_method = f"plan:{path}"
            mem = run_child(target, method=child_method, measure="memory", **common)
            if "error" in mem:
                row.error = mem["error"]
                rows.append(row)
                continue
            row.measured_peak_bytes = prof.start_bytes + mem["step_peak_bytes"]
            counted = "compile" not in method  # compiled kernels run below FlopCounterMode's dispatch
            timing = run_child(target, method=child_method, measure="time+flops" if counted else "time", steps=steps, **common)
            row.step_time_s, row.error, flops = timing.get("step_time_s"), timing.get("error"), timing.get("step_flops")
            if counted:
                if method == "none":
                    base_flops = flops
                if flops is not None and base_flops is not None:
                    row.recompute_flops = flops - base_flops
            rows.append(row)
    report("done", len(configs), len(configs))
    context = {
        "format": BENCH_FORMAT,
        "target": target,
        "device": device,
        "torch": torch.__version__,
        "start_bytes": prof.start_bytes,
        "none_peak_bytes": prof.peak_bytes,
        "meta": work.meta,
    }
    return rows, context


def _recipe_peak(target: str, recipe: str, batch_size: int | None, sizes: Mapping[str, Any] | None, work: Any) -> int:
    """Exact peak of the step with a hand-picked recipe applied (fake tensors, a fresh copy)."""
    fresh = load_target(target, batch_size=batch_size, sizes=sizes)
    model = setup(recipe, fresh.model)
    return memfit.profile(
        model, fresh.inputs, loss_fn=fresh.loss_fn, optimizer=fresh.make_optimizer(), fake=True, targets=fresh.targets
    ).peak_bytes
