"""What the commands share when they run: the target's workload, the device it runs on, a
profile with a progress bar, and the pictures (``--plot``, ``--html``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit import zoo
from memfit.errors import MemfitError, TargetError
from memfit.workload import Where

FAKE = {"fake": Where.FAKE, "fake-cuda": Where.FAKE_CUDA}
"""``--device`` values that run on fake tensors, and the tensors each names."""


def check_world(ns: argparse.Namespace, what: str) -> bool:
    """Read ``--world-size`` once for a command: whether the step is measured per rank. Refused
    before any work: ``--ranks`` without it, and with it a real ``--device`` (``what``: the
    command's words for a per-rank run), since each rank runs on the fake process group."""
    if ns.world_size is None:
        if ns.ranks is not None:
            raise TargetError("--ranks picks ranks of a distributed step: give --world-size N too")
        return False
    fake_ranks(ns, what)
    return True


def fake_ranks(ns: argparse.Namespace, what: str) -> None:
    """Each rank runs on the fake process group and fake tensors: a real ``--device`` is refused."""
    if ns.device not in FAKE:
        raise TargetError(
            f"{what} runs each rank on torch's fake process group and fake tensors: give --device fake or fake-cuda, "
            f"not {ns.device}"
        )


def where_of(device: str) -> Where:
    """The tensors ``--device`` names: fake ones for fake and fake-cuda, real ones for cpu and cuda."""
    return FAKE.get(device, Where.REAL)


def workload(ns: argparse.Namespace, *, per_rank: bool = False) -> memfit.Workload:
    """The target's workload; unless measured per rank, refused in one line when it is built on
    meta to be parallelized (Llama-3-8B: too big to build in this process)."""
    work = memfit.load_target(ns.target, batch_size=ns.batch_size, sizes=zoo.parse_sizes(ns.size))
    if not per_rank and work.parallel is not None and any(p.device.type == "meta" for p in work.model.parameters()):
        raise TargetError(
            f"{ns.target} is built on the meta device to be parallelized (too big to build in this process): "
            "measure, plan or fit it per rank with `memfit profile|plan|fit ... --world-size N --device fake`"
        )
    return work


def workload_at(ns: argparse.Namespace, batch_size: int) -> memfit.Workload:
    return memfit.load_target(ns.target, batch_size=batch_size, sizes=zoo.parse_sizes(ns.size))


def require_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("--device cuda: this torch build sees no CUDA device; use --device cpu, fake or fake-cuda")
    if device == "fake-cuda":
        from memfit.cuda import fake as fake_cuda

        fake_cuda.require()  # loaded before torch when this is the command (main); else says why not


def on_device(work: memfit.Workload, device: str) -> tuple[Any, Any]:
    """The model and inputs on ``device``; the workload's targets are moved with them."""
    from memfit.measure.inputs import map_shared
    from memfit.workload import check_not_meta

    require_device(device)
    check_not_meta(work.model, work.inputs, work.targets)  # torch cannot move a meta tensor anywhere
    model = work.model.to(device)
    # together: inputs and targets that share storage (labels=ids) stay one tensor there
    inputs, work.targets = map_shared(lambda x: x.to(device), (work.inputs, work.targets))
    return model, inputs


def profile_work(
    work: memfit.Workload,
    device: str,
    console: Console,
    *,
    step: memfit.StepOptions | None = None,
    gpu: Any = None,
    capacity: int | None = None,
    world_size: int | None = None,
    ranks: list[int] | None = None,
) -> Any:
    """``memfit.profile`` of the target's step on ``device``: one device's
    :class:`~memfit.Profile`, or with ``world_size`` each of ``ranks``'
    (:class:`~memfit.measure.distributed.RankProfiles`; the workload, built on meta to be
    parallelized, stays where it is)."""
    from memfit.report.console import progress_bar

    require_device(device)
    fake = where_of(device)
    if world_size is None:
        model, inputs = on_device(work, "cpu" if fake.fake else device)
        work = dataclasses.replace(work, model=model, inputs=inputs)
    what = f"profiling {work.name}" + (" per rank" if world_size is not None else "")
    with progress_bar(console, what) as progress:
        return memfit.profile(
            work, fake=fake, progress=progress, step=step, gpu=gpu, capacity=capacity, world_size=world_size, ranks=ranks
        )


def write_pictures(ns: argparse.Namespace, console: Console, timeline: Any, *, profile: Callable[[Any], Any] | None = None) -> None:
    """``--plot`` and ``--html``: the timeline as a PNG and as a self-contained page, with
    progress lines on stderr while they are made (a large step's profile and drawing took
    minutes with no sign of life, issue 24). ``timeline`` is the Timeline, or a function of
    ``profile``'s result (a profile measured first, given the progress callback) making it."""
    from memfit.report.console import progress_bar
    from memfit.report.timeline import timeline_html, timeline_png

    wrote = []
    with progress_bar(console, "drawing the pictures") as progress:
        if profile is not None:
            timeline = timeline(profile(progress))
        stages = [s for s in ("png", "html") if getattr(ns, "plot" if s == "png" else "html")]
        if ns.plot:
            progress("drawing the PNG", stages.index("png"), len(stages))
            Path(ns.plot).write_bytes(timeline_png(timeline))
            wrote.append(ns.plot)
        if ns.html:
            progress("writing the HTML page", stages.index("html"), len(stages))
            Path(ns.html).write_text(timeline_html(timeline))
            wrote.append(ns.html)
    for path in wrote:
        console.print(f"wrote {path}")


def applied_profile(
    work: memfit.Workload,
    model: Any,
    inputs: Any,
    plan: memfit.Plan | None,
    fake: Where,
    step: memfit.StepOptions | None = None,
    progress: Any = None,
) -> memfit.Profile:
    """The step profiled with ``plan`` applied (and ``step``'s options); the model left as it was."""
    if plan is not None and plan.checkpointed:
        memfit.apply(model, plan)
    try:
        optimizer = work.make_optimizer()
        return memfit.profile(
            model,
            inputs,
            loss_fn=work.loss_fn,
            optimizer=optimizer,
            fake=fake,
            step=step,
            targets=work.targets,
            progress=progress,
        )
    finally:
        if plan is not None and plan.checkpointed:
            memfit.remove(model)


def run_compiled(ns: argparse.Namespace, console: Console, budget: int | None) -> int:
    """``profile --compile`` (``budget`` None) and ``plan --compile --budget BYTES``: the compiled
    step at each ``--memory-budget`` value, and with a byte budget the value that fits it."""
    from memfit.cli.options import read_memory_budgets, step_options
    from memfit.measure.compiled import DEFAULT_SWEEP, fit_memory_budget, unavailable_on_fake
    from memfit.report.console import render_compiled, status

    if getattr(ns, "world_size", None) is not None:
        raise TargetError("--compile measures one process's step: drop --world-size")
    if step_options(ns) is not None or getattr(ns, "eval", False):
        raise TargetError("--compile measures the usual training step: drop the step options (--eval, --micro-batches, ...)")
    why = unavailable_on_fake() if ns.device == "fake" else None
    if why:
        raise TargetError(f"--compile on --device fake needs what this torch lacks ({why}): use --device cpu or fake-cuda")
    if getattr(ns, "plot", None) or getattr(ns, "html", None):
        raise TargetError("--compile draws no timeline yet: drop --plot/--html")
    values = read_memory_budgets(ns)
    require_device(ns.device)
    work = workload(ns)
    fake = where_of(ns.device)
    model, inputs = on_device(work, "cpu" if fake.fake else ns.device)
    parts = dict(loss_fn=work.loss_fn, optimizer=work.make_optimizer(), targets=work.targets, fake=fake, backend=ns.compile)
    title = f"{work.name}: torch.compile (backend {ns.compile}) on {ns.device}"
    with status(console, f"compiling and measuring {work.name}"):
        if budget is not None:
            chosen, tried = fit_memory_budget(model, inputs, budget, values=values or DEFAULT_SWEEP, **parts)
        else:
            chosen, tried = None, [memfit.profile_compiled(model, inputs, memory_budget=v, **parts) for v in values or [None]]
    render_compiled(tried, console, title=title, chosen=chosen, budget=budget)
    if getattr(ns, "json", None):
        import json

        chosen_value = None if chosen is None else chosen.memory_budget
        Path(ns.json).write_text(json.dumps({"chosen": chosen_value, "profiles": [p.to_dict() for p in tried]}, indent=1))
        console.print(f"wrote {ns.json}")
    return 0 if budget is None or chosen is not None else 1
