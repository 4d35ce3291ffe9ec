"""``memfit plan``: what to recompute so a training step fits a budget; per rank with
``--world-size``, or the smallest world size that fits with ``--min-world-size``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit.cli.common import FAKE, on_device, require_device, run_compiled, where_of, workload, write_pictures
from memfit.cli.options import (
    budget_arg,
    compile_args,
    device_arg,
    gpu_options,
    int_list,
    json_arg,
    picture_args,
    positive,
    rank_budget,
    ranks_arg,
    read_budget,
    read_memory_budgets,
    read_ranks,
    step_args,
    step_label,
    step_options,
    target_args,
    world_size_arg,
)
from memfit.errors import MemfitError, TargetError
from memfit.workload import Where

_SLOW_PLAN_S = 10.0
"""A plan that measured its own profile for longer than this says how to skip that next time."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="choose what to recompute so a training step fits a memory budget")
    target_args(p)
    budget_arg(p, "bytes for the whole step ('6GiB', '800MB') or a fraction ('50%%', 0.5); or give --gpu/--capacity")
    device_arg(p, "fake: plan on fake tensors; fake-cuda: on fake tensors of a simulated CUDA GPU")
    p.add_argument(
        "--objective", choices=["time", "flops"], default="time", help="minimise estimated recompute time (default) or FLOPs"
    )
    gpu_options(p)
    json_arg(p, "also write the plan as JSON (memfit.Plan.from_json reads it)")
    p.add_argument(
        "--profile",
        metavar="PATH",
        help="plan from this target's profile saved by `memfit profile TARGET --json PATH` (same batch and device) "
        "instead of measuring one: no profiling steps; a PATH that does not exist yet is measured and written",
    )
    world_size_arg(p, "plan one rank of N of the target's distributed step (--device fake, or fake-cuda: reserved peaks)")
    ranks_arg(
        p,
        "with --world-size: the ranks to verify the plan on (default 0); with --min-world-size: the ranks that must "
        "fit, negative from the last (default 0,-1)",
    )
    p.add_argument(
        "--min-world-size",
        action="store_true",
        help="the smallest world size (1, 2, 4, ...; or --world-sizes, --node-size) at which the worst of --ranks "
        "(default 0,-1: the first and the last) fits --budget, with and without recompute",
    )
    p.add_argument("--max-world-size", type=positive, metavar="N", help="with --min-world-size: the largest to try (1024)")
    p.add_argument(
        "--world-sizes", metavar="N,N", help="with --min-world-size: the world sizes to try (8,16,24,32), any the mesh allows"
    )
    p.add_argument(
        "--node-size",
        type=positive,
        metavar="K",
        help="with --min-world-size: try the multiples of K (a node's GPUs) up to --max-world-size, not powers of two",
    )
    picture_args(p, "the step without and with the plan (as the run that verified the plan recorded it)")
    step_args(p)
    compile_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import progress_bar, render_plan

    read_memory_budgets(ns)  # --memory-budget alone, or a bad value: refused before any work
    raw, label = read_budget(ns)
    if ns.compile:
        return run_compiled(ns, console, _compile_budget(raw))
    step = step_options(ns)
    if ns.world_size is not None or ns.min_world_size:
        memfit.parse_budget(raw)  # bad budgets fail before any work
        if step is not None:
            raise TargetError("plans per rank do not take step options (--micro-batches, --accumulate, ...) yet; drop them")
        return _run_ranks(ns, console, raw, label)
    if any(v is not None for v in (ns.ranks, ns.max_world_size, ns.world_sizes, ns.node_size)):
        raise TargetError(
            "--ranks, --max-world-size, --world-sizes and --node-size plan a distributed step: "
            "give --world-size N or --min-world-size"
        )
    budget = memfit.parse_budget(raw)  # bad budgets fail before any work
    require_device(ns.device)
    # --profile PATH that does not exist yet: measured here and written there, so the next
    # plan of this step (another budget) runs no profiling steps
    missing = bool(ns.profile) and not Path(ns.profile).exists()
    if missing and not Path(ns.profile).parent.is_dir():
        raise TargetError(f"--profile: cannot write {ns.profile}: no directory {Path(ns.profile).parent}; give an existing one")
    saved = _saved_profile(ns.profile, ns.device) if ns.profile and not missing else None
    work = workload(ns)
    fake = where_of(ns.device)
    model, inputs = on_device(work, "cpu" if fake.fake else ns.device)
    pictures = bool(ns.plot or ns.html)
    started = time.perf_counter()
    # The pictures show the profile the plan was made from, as the plan hands it over
    # (on_profile): measuring one first for them cost a whole profile more, and for a model
    # with transformers' KV cache the plan measured again anyway (its step runs the cache off).
    before = saved
    measured: list[memfit.Profile] = []
    planned: list[memfit.Profile] = []
    with progress_bar(console, f"planning {work.name}") as progress:
        plan = memfit.plan(
            model,
            inputs,
            budget,
            loss_fn=work.loss_fn,
            targets=work.targets,
            optimizer=work.make_optimizer(),
            fake=fake,
            objective=ns.objective,
            progress=progress,
            profile=before,
            step=step,
            # the profile the plan was made from: the step as its plans run it (KV cache off)
            on_profile=measured.append,
            # the step with the plan applied, as the run that verified it recorded it: what the
            # pictures draw beside it (profiling it again doubled a large step's planning time)
            on_planned=planned.append,
        )
    before = measured[0] if measured else before
    if missing:
        Path(ns.profile).write_text(before.to_json())
        console.print(f"wrote {ns.profile}: `--profile {ns.profile}` plans this step again without measuring it")
    plan.budget = label
    console.print(f"[bold]{work.name}[/]{step_label(step)} on [bold]{plan.device}[/]", highlight=False)
    render_plan(plan, console)
    _notes(ns, plan, fake, started, console)
    if ns.json:
        Path(ns.json).write_text(plan.to_json())
        console.print(f"wrote {ns.json}")
    if pictures:
        from memfit.plan.planner import profile_candidates
        from memfit.report.timeline import plan_timeline

        title = f"memfit plan {ns.target}, budget {label}, on {plan.device}"
        write_pictures(ns, console, plan_timeline(before, planned[0], plan, profile_candidates(before, plan.excluded), title))
    return 0


def _notes(ns: argparse.Namespace, plan: memfit.Plan, fake: Where, started: float, console: Console) -> None:
    """What the plan's table does not say: a step of several passes is planned as one, and a
    slow plan can skip its profile next time."""
    passes = plan.step.micro_batches * plan.step.accumulate
    if passes > 1:
        console.print(
            f"note: this step runs every module {passes} times (a forward per pass) and memfit plans modules called "
            "once: plan one pass with --keep-grads (the passes after the first start with gradients), or let "
            "`memfit fit` weigh micro-batches"
        )
    if not ns.profile and not fake.fake and time.perf_counter() - started > _SLOW_PLAN_S:
        console.print(
            "tip: most of that was measuring the step (four steps); `--profile PATH` keeps the profile, "
            "and planning again from it (any budget) runs no step"
        )


def _run_ranks(ns: argparse.Namespace, console: Console, raw: Any, label: str) -> int:
    """``plan --world-size N`` (one rank's parallelized step, planned on the fake process group)
    or ``plan --min-world-size`` (the smallest world size fitting the per-rank budget)."""
    from memfit.api import World
    from memfit.plan.distributed import min_world_size
    from memfit.report.console import progress_bar, render_plan, render_world_size_fit

    if ns.device not in FAKE:
        raise TargetError(
            f"plans per rank run each rank on torch's fake process group: give --device fake or fake-cuda, not {ns.device}"
        )
    require_device(ns.device)
    if ns.plot or ns.html:
        raise TargetError("plans per rank do not take --plot or --html yet; drop them")
    if ns.min_world_size and ns.world_size is not None:
        raise TargetError("give --world-size N (plan for N ranks) or --min-world-size (find N), not both")
    for flag, value in (
        ("--max-world-size", ns.max_world_size),
        ("--world-sizes", ns.world_sizes),
        ("--node-size", ns.node_size),
    ):
        if value is not None and not ns.min_world_size:
            raise TargetError(f"{flag} shapes --min-world-size's search: give --min-world-size too")
    if ns.world_sizes is not None and (ns.node_size is not None or ns.max_world_size is not None):
        raise TargetError("--world-sizes lists the sizes to try: drop --node-size and --max-world-size")
    if ns.min_world_size:
        sizes = int_list("--world-sizes", ns.world_sizes, "8,16,24,32") if ns.world_sizes is not None else None
        ranks: Any = (0, -1) if ns.ranks is None else "all" if ns.ranks == "all" else int_list("--ranks", ns.ranks, "0,-1")
    work = workload(ns, per_rank=True)
    outside = None
    if ns.world_size is not None:
        raw, label = rank_budget(ns, work, raw, label)
    elif ns.device == "fake-cuda" and ns.budget is None:
        # the GPU's memory: NCCL's buffers come off it at each size tried (its communicators grow)
        from memfit.measure.distributed import nccl_outside

        outside, label = (lambda n: nccl_outside(work.parallel, n).bytes), f"{label} - NCCL estimate at each size"
    if ns.min_world_size:
        with progress_bar(console, f"world sizes for {work.name}") as progress:
            found = min_world_size(
                work,
                raw,
                world_sizes=sizes,
                node_size=ns.node_size,
                max_world_size=ns.max_world_size or 1024,
                ranks=ranks,
                progress=progress,
                fake=FAKE[ns.device],
                outside=outside,
            )
        found.plan = World(work).as_held(found.plan)
        render_world_size_fit(found, console, title=f"{work.name}, {label} per rank")
        result: Any = found
    else:
        with progress_bar(console, f"planning {work.name} per rank") as progress:
            result = memfit.plan(
                work,
                budget=raw,
                world_size=ns.world_size,
                ranks=read_ranks(ns.ranks, ns.world_size),
                objective=ns.objective,
                progress=progress,
                fake=FAKE[ns.device],
            )
        result.budget = label
        ranks_seen = ", ".join(str(r) for r in sorted(result.rank_peak_bytes or {}))
        what = f"rank {ranks_seen}" if len(result.rank_peak_bytes or {}) == 1 else f"ranks {ranks_seen}"
        console.print(f"[bold]{work.name}[/], {what} of {result.world_size} on [bold]{result.device}[/]")
        render_plan(result, console)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result.to_dict(), indent=1))
        console.print(f"wrote {ns.json}")
    return 0


def _saved_profile(path: str, device: str) -> memfit.Profile:
    """``plan --profile PATH``: the profile ``memfit profile --json PATH`` wrote, made on the
    device ``--device`` names (the plan's runs are verified where the profile was measured)."""
    try:
        prof = memfit.Profile.from_dict(json.loads(Path(path).read_text()))
    except OSError as exc:
        raise TargetError(
            f"--profile: cannot read {path} ({exc.strerror or exc}); give a file `memfit profile --json` wrote"
        ) from None
    except MemfitError as exc:
        raise TargetError(f"--profile: {path}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise TargetError(f"--profile: {path} is not a profile `memfit profile --json` wrote ({exc})") from exc
    where = {"cpu": "cpu", "cuda": "cuda", "fake": "fake:cpu", "fake-cuda": "fake:cuda"}[device]
    if not prof.device.startswith(where):
        raise TargetError(
            f"--profile: {path} was measured on {prof.device}; plan it with the --device it was made on, not {device}"
        )
    return prof


def _compile_budget(raw: Any) -> int:
    """``plan --compile``'s budget: bytes (a fraction of the way between peaks is an eager plan's notion)."""
    budget = memfit.parse_budget(raw)
    if budget.bytes is None:
        raise TargetError(f"--compile picks activation_memory_budget for a byte budget: give --budget in bytes (6GiB), not {raw}")
    return budget.bytes
