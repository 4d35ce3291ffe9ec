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
from memfit.cli.common import FAKE, fake_ranks, on_device, require_device, run_compiled, where_of, workload, write_pictures
from memfit.cli.options import (
    budget_arg,
    compile_args,
    device_arg,
    gpu_args,
    gpu_options,
    int_list,
    json_arg,
    picture_args,
    planned_ranks,
    positive,
    rank_budget,
    ranks_arg,
    read_budget,
    read_memory_budgets,
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
        "with --world-size: the ranks to verify the plan on (default 0; under --size parallel=pp every stage rank, each "
        "planned on its own); with --min-world-size: the ranks that must fit, negative from the last (default 0,-1)",
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
    """One path for one device and for ranks of a world (``--world-size``): the budget read,
    ``memfit.plan`` asked, the plan drawn and written. ``--min-world-size`` asks another
    question (how many ranks), :func:`_run_min_world_size`."""
    from memfit.report.console import progress_bar, render_plan

    read_memory_budgets(ns)  # --memory-budget alone, or a bad value: refused before any work
    raw, label = read_budget(ns)
    if ns.compile:
        return run_compiled(ns, console, _compile_budget(raw))
    step = step_options(ns)
    _check_world(ns, step)
    budget = memfit.parse_budget(raw)  # bad budgets fail before any work
    require_device(ns.device)
    if ns.min_world_size:
        return _run_min_world_size(ns, console, raw, label)
    per_rank = ns.world_size is not None
    missing, saved = _profile_file(ns) if not per_rank else (False, None)
    work = workload(ns, per_rank=per_rank)
    fake = where_of(ns.device)
    # The pictures show the profile the plan was made from, as the plan hands it over
    # (on_profile), and the step with the plan applied as the run that verified it recorded it
    # (on_planned): profiling either again cost a whole profile more.
    measured: list[memfit.Profile] = []
    planned: list[memfit.Profile] = []
    if per_rank:
        raw, label = rank_budget(ns, work, raw, label)
        ranks = planned_ranks(ns.ranks, work, ns.world_size)
        model, inputs, asked = work, None, dict(budget=raw, world_size=ns.world_size, ranks=ranks)
    else:
        model, inputs = on_device(work, "cpu" if fake.fake else ns.device)
        asked = dict(budget=budget, loss_fn=work.loss_fn, targets=work.targets, optimizer=work.make_optimizer(), profile=saved,
                     step=step, on_profile=measured.append, on_planned=planned.append)  # fmt: skip
    started = time.perf_counter()
    with progress_bar(console, f"planning {work.name}" + (" per rank" if per_rank else "")) as progress:
        plan = memfit.plan(model, inputs, fake=fake, objective=ns.objective, progress=progress, **asked)
    before = measured[0] if measured else saved
    if missing:
        Path(ns.profile).write_text(before.to_json())
        console.print(f"wrote {ns.profile}: `--profile {ns.profile}` plans this step again without measuring it")
    plan.budget = label
    console.print(f"[bold]{work.name}[/]{_where_words(plan, step)} on [bold]{plan.device}[/]", highlight=False)
    render_plan(plan, console)
    if not per_rank:
        _notes(ns, plan, fake, started, console)
    if ns.json:
        Path(ns.json).write_text(plan.to_json())
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.plan.planner import profile_candidates
        from memfit.report.timeline import plan_timeline

        title = f"memfit plan {ns.target}, budget {label}, on {plan.device}"
        write_pictures(ns, console, plan_timeline(before, planned[0], plan, profile_candidates(before, plan.excluded), title))
    return 0


def _where_words(plan: memfit.Plan, step: memfit.StepOptions | None) -> str:
    """What the plan is for, after the target's name: its step options, or the ranks it was verified on."""
    if plan.rank_peak_bytes is None:
        return step_label(step)
    seen = ", ".join(str(r) for r in sorted(plan.rank_peak_bytes))
    return f", {'rank' if len(plan.rank_peak_bytes) == 1 else 'ranks'} {seen} of {plan.world_size}"


def _profile_file(ns: argparse.Namespace) -> tuple[bool, memfit.Profile | None]:
    """``--profile PATH``: (whether PATH is to be written, the profile it holds). A PATH that
    does not exist yet is measured and written there, so the next plan of this step (another
    budget) runs no profiling steps."""
    if not ns.profile:
        return False, None
    if not Path(ns.profile).exists():
        if not Path(ns.profile).parent.is_dir():
            raise TargetError(f"--profile: cannot write {ns.profile}: no directory {Path(ns.profile).parent}; give an existing one")
        return True, None
    return False, _saved_profile(ns.profile, ns.device)


def _check_world(ns: argparse.Namespace, step: memfit.StepOptions | None) -> None:
    """What a plan on one device, per rank, or for the smallest world size cannot take: refused before any work."""
    if ns.world_size is None and not ns.min_world_size:
        if any(v is not None for v in (ns.ranks, ns.max_world_size, ns.world_sizes, ns.node_size)):
            raise TargetError(
                "--ranks, --max-world-size, --world-sizes and --node-size plan a distributed step: "
                "give --world-size N or --min-world-size"
            )
        return
    if step is not None:
        raise TargetError("plans per rank do not take step options (--micro-batches, --accumulate, ...) yet; drop them")
    fake_ranks(ns, "a plan per rank")
    if ns.plot or ns.html:
        raise TargetError("plans per rank do not take --plot or --html yet; drop them")
    if ns.profile:
        raise TargetError("plans per rank measure each rank's step: drop --profile")
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


def _run_min_world_size(ns: argparse.Namespace, console: Console, raw: Any, label: str) -> int:
    """``plan --min-world-size``: the smallest world size at which the worst of ``--ranks`` fits the per-rank budget."""
    from memfit.api import World
    from memfit.plan.distributed import min_world_size
    from memfit.report.console import progress_bar, render_world_size_fit

    sizes = int_list("--world-sizes", ns.world_sizes, "8,16,24,32") if ns.world_sizes is not None else None
    ranks: Any = (0, -1) if ns.ranks is None else "all" if ns.ranks == "all" else int_list("--ranks", ns.ranks, "0,-1")
    work = workload(ns, per_rank=True)
    outside = None
    if ns.device == "fake-cuda" and ns.budget is None:
        # the GPU's memory: NCCL's buffers come off it at each size tried (its communicators grow)
        from memfit.cuda.nccl import settings_from_env
        from memfit.measure.distributed import NODE_SIZE, nccl_outside

        spec, _ = gpu_args(ns)
        env, node = settings_from_env(), ns.node_size or NODE_SIZE

        def nccl_at(n: int) -> int:
            return nccl_outside(work.parallel, n, spec, env, node).bytes

        outside, label = nccl_at, f"{label} - NCCL estimate at each size"
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
    if ns.json:
        Path(ns.json).write_text(json.dumps(found.to_dict(), indent=1))
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
