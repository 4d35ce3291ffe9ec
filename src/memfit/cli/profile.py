"""``memfit profile``: where the memory of one training step goes (per rank with ``--world-size``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from memfit.cli.common import check_world, profile_work, require_device, run_compiled, workload, write_pictures
from memfit.cli.options import (
    compile_args,
    device_arg,
    gpu_args,
    gpu_options,
    json_arg,
    picture_args,
    ranks_arg,
    read_memory_budgets,
    read_ranks,
    step_args,
    step_label,
    step_options,
    target_args,
    world_size_arg,
)
from memfit.errors import TargetError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure where the memory of one training step goes")
    target_args(p)
    device_arg(
        p,
        "fake: fake tensors, no memory used; fake-cuda: fake tensors on a simulated CUDA GPU (CUDA's autocast, "
        "attention kernels and optimizer defaults), on a CPU build of torch (builds a small C++ shim with g++ once)",
    )
    json_arg(p, "also write the profile as JSON")
    picture_args(p)
    p.add_argument("--top", type=int, default=12, help="modules to list (default 12)")
    p.add_argument(
        "--eval", action="store_true", help="an evaluation step: eval mode, forward and loss under torch.inference_mode()"
    )
    world_size_arg(
        p,
        "measure the target's distributed step (its Workload.parallel; zoo llama: --size parallel=fsdp2|ddp|tp|fsdp2+tp|hsdp|pp) as "
        "one rank of N on torch's fake process group (with --device fake, or fake-cuda: allocated and reserved peaks per rank)",
    )
    ranks_arg(p, "with --world-size: the ranks to measure (default 0)")
    gpu_options(p)
    step_args(p)
    compile_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    """One path for one device and for ranks of a world (``--world-size``): the target built,
    ``memfit.profile`` asked, its answer drawn and written."""
    from memfit.report.console import render_profile

    read_memory_budgets(ns)  # --memory-budget alone, or a bad value: refused before any work
    if ns.compile:
        return run_compiled(ns, console, None)
    _check_world(ns)
    step = step_options(ns)
    gpu, capacity = gpu_args(ns)
    require_device(ns.device)  # before building the model
    per_rank = ns.world_size is not None
    work = workload(ns, per_rank=per_rank)
    ranks = read_ranks(ns.ranks, ns.world_size) if per_rank else None
    result = profile_work(work, ns.device, console, step=step, gpu=gpu, capacity=capacity, world_size=ns.world_size, ranks=ranks)
    # one device is rank 0 of a world of one (Profile.profiles): the same reading for both
    shown = result.profiles[result.worst_rank]
    for prof in result.profiles.values():
        prof.meta.update({"target": ns.target, **({} if per_rank else work.meta)})
    title = work.name + step_label(step)
    render_profile(result, console, title=title, top=ns.top)
    _layers_note(result, work, console)
    if per_rank:  # the pictures show the worst rank's step
        title = f"{work.name}, rank {result.worst_rank} of {ns.world_size}"
    if ns.json:
        Path(ns.json).write_text(result.to_json())
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.report.timeline import profile_timeline

        write_pictures(ns, console, profile_timeline(shown, f"memfit profile {ns.target}: {title} on {shown.device}"))
    return 0


def _layers_note(result: Any, work: Any, console: Console) -> None:
    """A line on how each rank's step was measured: synthesized from fewer layers, or whole and why."""
    from memfit.measure.rank_layers import EXTRAPOLATE_FROM as k

    layers = getattr(result, "layers", {})
    synthesized = sorted(r for r, why in layers.items() if why is None)
    if synthesized and work.layers is not None:
        console.print(
            f"rank {', '.join(map(str, synthesized))}: the {work.layers.count}-layer step's ledger synthesized from {k}-, {k + 1}- "
            f"and {k + 2}-layer steps on the same ranks, checked at {k + 2} layers",
            highlight=False,
        )
    for r, why in sorted(layers.items()):
        if why is not None and work.layers is not None:
            console.print(f"rank {r}: the whole model's step recorded ({why})", highlight=False)


def _check_world(ns: argparse.Namespace) -> None:
    """What a profile per rank cannot take, refused before any work."""
    if not check_world(ns, "--world-size"):
        return
    if ns.eval or step_options(ns) is not None:
        raise TargetError("--world-size does not take --eval or step options yet; drop them")
