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
from dataclasses import asdict, dataclass, field
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
    common = dict(batch_size=batch_size, sizes=sizes, device=device)
    if scenario is not None:
        configs = _scenario_configs(target, scenario, batch_size, sizes, work)
    else:
        configs = _configs(budgets, model, compile)
    bench = _Bench(target, work, model, inputs, targets, optimizer, prof, profile_s, common, steps)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (method, budget, label, child_method) in enumerate(configs):
            report(label, i, len(configs))
            rows.append(bench.row(Row(method, budget, label), child_method, Path(tmp) / f"plan-{i}.json"))
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


_Config = tuple[str, "float | int | None", str, str]
"""(method, budget, label, the child's method)."""


def _configs(budgets: list[float], model: Any, compile: bool) -> list[_Config]:
    """The baselines that apply to ``model``, then torch.compile, memfit and memfit+compile at each budget."""
    configs: list[_Config] = [(m, None, describe(m), m) for m in BASELINES if applicable(m, model) is None]
    if compile:
        configs += [("compile", b, f"torch.compile {b:g}", f"compile:{b}") for b in budgets]
    configs += [("memfit", b, f"memfit {b:.0%}", "") for b in budgets]
    if compile:
        configs += [("memfit+compile", b, f"memfit {b:.0%} + compile", "") for b in budgets]
    return configs


def _scenario_configs(
    target: str, scenario: str, batch_size: int | None, sizes: Mapping[str, Any] | None, work: Any
) -> list[_Config]:
    """No checkpointing, the scenario's hand-picked recipe, and memfit at that recipe's exact peak."""
    _, recipe, label = SCENARIOS[scenario]
    same = _recipe_peak(target, recipe, batch_size, sizes, work)
    return [
        ("none", None, describe("none"), "none"),
        ("recipe", None, f"recipe: {label}", recipe),
        ("memfit", same, f"memfit at {memfit.format_bytes(same)}", ""),
    ]


@dataclass
class _Bench:
    """What every row of one bench shares: the step, its real profile, and what earlier rows
    left for later ones (the memfit plan per budget, the FLOPs of the step as it is)."""

    target: str
    work: Any
    model: Any
    inputs: Any
    targets: Any
    optimizer: Any
    prof: Any
    profile_s: float
    common: dict[str, Any]
    steps: int
    plans: dict[Any, Path] = field(default_factory=dict)
    """budget -> the memfit row's plan, which memfit+compile rows reuse."""
    base_flops: int | None = None

    def row(self, row: Row, child_method: str, plan_path: Path) -> Row:
        """``row`` measured in fresh processes (planned first for a memfit row); an error stops it where it happened."""
        if row.method == "memfit+compile":
            if row.budget not in self.plans:
                row.error = "no memfit plan at this budget"
                return row
            child_method = f"plan+compile:{self.plans[row.budget]}"
        if row.method == "memfit":
            if not self.plan(row, plan_path):
                return row
            child_method = f"plan:{plan_path}"
        mem = run_child(self.target, method=child_method, measure="memory", **self.common)
        if "error" in mem:
            row.error = mem["error"]
            return row
        row.measured_peak_bytes = self.prof.start_bytes + mem["step_peak_bytes"]
        counted = "compile" not in row.method  # compiled kernels run below FlopCounterMode's dispatch
        measure = "time+flops" if counted else "time"
        timing = run_child(self.target, method=child_method, measure=measure, steps=self.steps, **self.common)
        row.step_time_s, row.error, flops = timing.get("step_time_s"), timing.get("error"), timing.get("step_flops")
        if counted:
            if row.method == "none":
                self.base_flops = flops
            if flops is not None and self.base_flops is not None:
                row.recompute_flops = flops - self.base_flops
        return row

    def plan(self, row: Row, path: Path) -> bool:
        """memfit's plan at the row's budget, written to ``path`` for the children; False (the row's error set) when none."""
        t0 = time.perf_counter()
        try:
            plan = memfit.plan(
                self.model,
                self.inputs,
                row.budget,
                loss_fn=self.work.loss_fn,
                optimizer=self.optimizer,
                profile=self.prof,
                targets=self.targets,
            )
        except memfit.MemfitError as exc:
            row.error = str(exc)
            return False
        row.plan_time_s = self.profile_s + time.perf_counter() - t0
        # measured as max_memory_allocated on CUDA: the plan's allocated peak, not the
        # reserved one its budget bounds there
        row.predicted_peak_bytes = (
            plan.allocated_peak_bytes if plan.allocated_peak_bytes is not None else plan.predicted_peak_bytes
        )
        path.write_text(plan.to_json())
        self.plans[row.budget] = path
        return True


def _recipe_peak(target: str, recipe: str, batch_size: int | None, sizes: Mapping[str, Any] | None, work: Any) -> int:
    """Exact peak of the step with a hand-picked recipe applied (fake tensors, a fresh copy)."""
    fresh = load_target(target, batch_size=batch_size, sizes=sizes)
    model = setup(recipe, fresh.model)
    return memfit.profile(
        model, fresh.inputs, loss_fn=fresh.loss_fn, optimizer=fresh.make_optimizer(), fake=True, targets=fresh.targets
    ).peak_bytes
