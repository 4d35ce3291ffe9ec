"""The ``memfit`` command: a thin layer over the public API.

    memfit profile gpt                       # where the memory of a step goes
    memfit profile gpt --batch-size 64 --device fake   # a step too big for this machine
    memfit profile gpt --device fake-cuda    # the same step as a CUDA GPU runs it, on a CPU build of torch
    memfit profile path/to/train.py:workload --json profile.json
    memfit plan gpt --budget 50%             # what to recompute to fit a budget
    memfit plan gpt --budget 400MiB --json plan.json
    memfit fit gpt --budget 400MiB --allow amp,bf16   # the fastest memory levers that fit
    memfit fit llama --size preset=8b --world-size 8 --device fake --budget 40GiB   # per rank: recompute, reshard_after_forward
    memfit bench gpt --budgets 0.25,0.5,0.75 --plot bench.png --html bench.html --json bench.json
    memfit estimate llama --size num_hidden_layers=16 --batch-size 4 --seq-len 2048   # accelerate estimate-memory, activations included
    memfit snapshot memory_snapshot.pickle   # a GPU's recorded trace: peaks, and what other allocator settings would reserve
    memfit zoo                               # the built-in models
    memfit demo                              # end to end on the default model

Errors memfit raises for bad input print as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit import zoo
from memfit.errors import MemfitError, TargetError

_SLOW_PLAN_S = 10.0
"""A plan that measured its own profile for longer than this says how to skip that next time."""

__all__ = ["main"]

EXIT_ERROR = 2


def _workload(ns: argparse.Namespace, *, per_rank: bool = False) -> memfit.Workload:
    """The target's workload; unless measured per rank, refused in one line when it is built on
    meta to be parallelized (Llama-3-8B: too big to build in this process)."""
    work = memfit.load_target(ns.target, batch_size=ns.batch_size, sizes=zoo.parse_sizes(ns.size))
    if not per_rank and work.parallel is not None and any(p.device.type == "meta" for p in work.model.parameters()):
        raise TargetError(
            f"{ns.target} is built on the meta device to be parallelized (too big to build in this process): "
            "measure, plan or fit it per rank with `memfit profile|plan|fit ... --world-size N --device fake`"
        )
    return work


FAKE = {"fake": True, "fake-cuda": "cuda"}
"""``--device`` values that run on fake tensors, and the ``fake=`` each passes."""


def _workload_at(ns: argparse.Namespace, batch_size: int) -> memfit.Workload:
    return memfit.load_target(ns.target, batch_size=batch_size, sizes=zoo.parse_sizes(ns.size))


def _require_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("--device cuda: this torch build sees no CUDA device; use --device cpu, fake or fake-cuda")
    if device == "fake-cuda":
        from memfit.cuda import fake as fake_cuda

        fake_cuda.require()  # loaded before torch when this is the command (main); else says why not


def _on_device(work: memfit.Workload, device: str) -> tuple[Any, Any]:
    """The model and inputs on ``device``; the workload's targets are moved with them."""
    from memfit.measure.inputs import map_shared
    from memfit.workload import check_not_meta

    _require_device(device)
    check_not_meta(work.model, work.inputs, work.targets)  # torch cannot move a meta tensor anywhere
    model = work.model.to(device)
    # together: inputs and targets that share storage (labels=ids) stay one tensor there
    inputs, work.targets = map_shared(lambda x: x.to(device), (work.inputs, work.targets))
    return model, inputs


def _gpu_args(ns: argparse.Namespace) -> tuple[Any, int | None]:
    """``--gpu`` and ``--capacity``, checked before any work: the GPU spec (None) and bytes (None)."""
    from memfit.cuda.gpu import GpuError, find_gpu

    spec = find_gpu(ns.gpu) if getattr(ns, "gpu", None) else None
    if spec is not None and ns.device != "fake-cuda":
        raise GpuError(
            f"--gpu {ns.gpu} is the GPU fake CUDA simulates: add --device fake-cuda (on --device {ns.device}, "
            "give --capacity BYTES to judge the step against a memory size)"
        )
    capacity = getattr(ns, "capacity", None)
    return spec, None if capacity is None else memfit.parse_bytes(capacity)


def _budget(ns: argparse.Namespace) -> tuple[Any, str]:
    """``--budget``, or the (simulated) GPU's memory less the CUDA context estimate: the budget
    and how to print it. Sets the GPU fake CUDA simulates."""
    from memfit.cuda.gpu import CUDA_CONTEXT

    spec, capacity = _gpu_args(ns)
    if spec is not None:
        from memfit.cuda import fake as fake_cuda

        fake_cuda.set_gpu(spec)
    if ns.budget is not None:
        if spec is not None or capacity is not None:
            raise MemfitError("give --budget, or --gpu/--capacity to take the budget from the GPU's memory, not both")
        return ns.budget, ns.budget
    if capacity is None and spec is None:
        raise MemfitError(
            "give --budget BYTES, or --gpu NAME / --capacity BYTES (the budget is then that memory less "
            "the CUDA context estimate)"
        )
    total = capacity if capacity is not None else spec.total_memory
    cuda = ns.device in ("cuda", "fake-cuda")
    budget = total - (CUDA_CONTEXT.bytes if cuda else 0)
    label = f"{memfit.format_bytes(total)}" + (f" {spec.key}" if spec is not None and capacity is None else "")
    if cuda:
        label += f" - {memfit.format_bytes(CUDA_CONTEXT.bytes)} CUDA context estimate"
    return budget, label


def _profile(
    work: memfit.Workload,
    device: str,
    console: Console,
    *,
    step: memfit.StepOptions | None = None,
    gpu: Any = None,
    capacity: int | None = None,
) -> memfit.Profile:
    from memfit.report.console import progress_bar

    _require_device(device)
    fake = FAKE.get(device, False)
    model, inputs = _on_device(work, "cpu" if fake else device)
    optimizer = work.make_optimizer()
    with progress_bar(console, f"profiling {work.name}") as progress:
        return memfit.profile(
            model,
            inputs,
            loss_fn=work.loss_fn,
            optimizer=optimizer,
            fake=fake,
            progress=progress,
            step=step,
            targets=work.targets,
            gpu=gpu,
            capacity=capacity,
        )

_DTYPE_CHOICES = ("bfloat16", "float16")


def _count_flag(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise MemfitError(f"{flag} takes a positive integer, got {text!r}")
    return n


def _choice_flag(flag: str, text: str | None, choices: tuple[str, ...]) -> str | None:
    if text is not None and text not in choices:
        raise MemfitError(f"{flag} takes one of {', '.join(choices)}, got {text!r}")
    return text


def _step_options(ns: argparse.Namespace) -> memfit.StepOptions | None:
    """The step options the command line gives (:func:`_step_args`), checked before any work:
    None when it gives none (the usual step, or a saved profile's). Bad values are one line."""
    loss_scale = None
    if ns.loss_scale is not None:
        try:
            loss_scale = float(ns.loss_scale)
        except ValueError:
            loss_scale = float("nan")
        if not (loss_scale > 0 and loss_scale != float("inf")):
            raise MemfitError(f"--loss-scale takes a positive number (0.25), got {ns.loss_scale!r}")
    foreach = _choice_flag("--foreach", ns.foreach, ("on", "off"))
    given = dict(
        micro_batches=_count_flag("--micro-batches", ns.micro_batches),
        accumulate=_count_flag("--accumulate", ns.accumulate),
        loss_scale=loss_scale,
        autocast=_choice_flag("--autocast", ns.autocast, _DTYPE_CHOICES),
        grad_scaler=ns.grad_scaler or None,
        set_to_none=False if ns.keep_grads else None,
        param_dtype=_choice_flag("--param-dtype", ns.param_dtype, _DTYPE_CHOICES),
        foreach=None if foreach is None else foreach == "on",
        optimizer_8bit=ns.optimizer_8bit or None,
        offload=ns.offload or None,
        inference=getattr(ns, "eval", False) or None,
        forward_before_loop=ns.forward_before_loop or None,
        holds_output=ns.holds_output or None,
    )
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    try:
        return memfit.StepOptions(**given)
    except MemfitError as exc:  # the options' own checks, said in the flags' names
        text = str(exc).replace("an inference step", "--eval (an inference step)")
        for field, flag in _STEP_FLAGS.items():
            text = re.sub(rf"(?<![(\w-]){re.escape(field)}\b", flag, text)  # not StepOptions(offload=...)
        raise MemfitError(text) from None


_STEP_FLAGS = {
    "set_to_none=False": "--keep-grads",
    "micro_batches": "--micro-batches",
    "grad_scaler": "--grad-scaler",
    "optimizer_8bit": "--optimizer-8bit",
    "param_dtype": "--param-dtype",
    "loss_scale": "--loss-scale",
    "accumulate": "--accumulate",
    "foreach": "--foreach",
    "offload": "--offload",
    "forward_before_loop": "--forward-before-loop",
    "holds_output": "--holds-output",
}
"""StepOptions' field names as the command line spells them, for its errors."""


def _step_label(step: memfit.StepOptions | None) -> str:
    """What the command line asked of the step, for titles: ``" (accumulate 4, keep grads)"``."""
    if step is None:
        return ""
    default = memfit.StepOptions()
    said = [
        f"{name.replace('_', ' ')} {value}" if not isinstance(value, bool) else name.replace("_", " ")
        for name, value in step.to_dict().items()
        if value != getattr(default, name) and name not in ("set_to_none", "inference", "foreach")
    ]
    said += ["zero_grad(set_to_none=False)"] if not step.set_to_none else []
    said += [f"foreach {'on' if step.foreach else 'off'}"] if step.foreach is not None else []
    said += ["evaluation"] if step.inference else []
    return f" ({', '.join(said)})" if said else ""


def _write_pictures(ns: argparse.Namespace, console: Console, timeline: Any, *, profile: Callable[[Any], Any] | None = None) -> None:
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


def _applied_profile(
    work: memfit.Workload,
    model: Any,
    inputs: Any,
    plan: memfit.Plan | None,
    fake: bool,
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


def _cmd_profile_ranks(ns: argparse.Namespace, console: Console) -> int:
    """``profile --world-size N``: each asked-for rank of the parallelized step on the fake process group."""
    from memfit.measure.distributed import profile_ranks
    from memfit.report.console import progress_bar, render_ranks

    if ns.device != "fake":
        raise TargetError(
            f"--world-size runs each rank on torch's fake process group and fake tensors: give --device fake, not {ns.device}"
        )
    if ns.eval or ns.gpu or ns.capacity or _step_options(ns) is not None:
        raise TargetError("--world-size does not take --eval, --gpu, --capacity or step options yet; drop them")
    ranks = _ranks(ns.ranks, ns.world_size)
    work = _workload(ns, per_rank=True)
    with progress_bar(console, f"profiling {work.name} per rank") as progress:
        result = profile_ranks(work, world_size=ns.world_size, ranks=ranks, progress=progress)
    for prof in result.profiles.values():
        prof.meta["target"] = ns.target
    render_ranks(result, console, title=work.name, top=ns.top)
    if ns.json:
        Path(ns.json).write_text(result.to_json())
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.report.timeline import profile_timeline

        worst = result.profiles[result.worst_rank]
        title = f"memfit profile {ns.target}: {work.name}, rank {result.worst_rank} of {ns.world_size} on {worst.device}"
        _write_pictures(ns, console, profile_timeline(worst, title))
    return 0


def _ranks(text: str | None, world_size: int) -> list[int]:
    if text is None:
        return [0]
    if text == "all":
        return list(range(world_size))
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise TargetError(f"--ranks takes ranks separated by commas (0,3) or 'all', got {text!r}") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise TargetError(f"--ranks: {bad[0]} is not a rank of a world of {world_size}; give 0 to {world_size - 1}")
    return ranks


def _int_list(flag: str, text: str, example: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise TargetError(f"{flag} takes integers separated by commas ({example}), got {text!r}") from None


def _cmd_profile(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import render_profile

    if ns.world_size is not None:
        return _cmd_profile_ranks(ns, console)
    if ns.ranks is not None:
        raise TargetError("--ranks picks ranks of a distributed step: give --world-size N too")
    step = _step_options(ns)
    gpu, capacity = _gpu_args(ns)
    _require_device(ns.device)  # before building the model
    work = _workload(ns)
    prof = _profile(work, ns.device, console, step=step, gpu=gpu, capacity=capacity)
    prof.meta.update({"target": ns.target, **work.meta})
    title = work.name + _step_label(step)
    render_profile(prof, console, title=title, top=ns.top)
    if ns.json:
        Path(ns.json).write_text(prof.to_json())
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.report.timeline import profile_timeline

        _write_pictures(ns, console, profile_timeline(prof, f"memfit profile {ns.target}: {title} on {prof.device}"))
    return 0


def _cmd_plan_ranks(ns: argparse.Namespace, console: Console, raw: Any, label: str) -> int:
    """``plan --world-size N`` (one rank's parallelized step, planned on the fake process group)
    or ``plan --min-world-size`` (the smallest world size fitting the per-rank budget)."""
    from memfit.plan.distributed import min_world_size, plan_ranks
    from memfit.report.console import progress_bar, render_plan, render_world_size_fit

    if ns.device != "fake":
        raise TargetError(f"plans per rank run each rank on torch's fake process group: give --device fake, not {ns.device}")
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
        sizes = _int_list("--world-sizes", ns.world_sizes, "8,16,24,32") if ns.world_sizes is not None else None
        ranks: Any = (0, -1) if ns.ranks is None else "all" if ns.ranks == "all" else _int_list("--ranks", ns.ranks, "0,-1")
    work = _workload(ns, per_rank=True)
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
            )
        render_world_size_fit(found, console, title=f"{work.name}, {label} per rank")
        result: Any = found
    else:
        with progress_bar(console, f"planning {work.name} per rank") as progress:
            result = plan_ranks(
                work,
                raw,
                world_size=ns.world_size,
                ranks=_ranks(ns.ranks, ns.world_size),
                objective=ns.objective,
                progress=progress,
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


def _cmd_plan(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import progress_bar, render_plan

    raw, label = _budget(ns)
    step = _step_options(ns)
    if ns.world_size is not None or ns.min_world_size:
        memfit.parse_budget(raw)  # bad budgets fail before any work
        if step is not None:
            raise TargetError("plans per rank do not take step options (--micro-batches, --accumulate, ...) yet; drop them")
        return _cmd_plan_ranks(ns, console, raw, label)
    if any(v is not None for v in (ns.ranks, ns.max_world_size, ns.world_sizes, ns.node_size)):
        raise TargetError(
            "--ranks, --max-world-size, --world-sizes and --node-size plan a distributed step: "
            "give --world-size N or --min-world-size"
        )
    budget = memfit.parse_budget(raw)  # bad budgets fail before any work
    _require_device(ns.device)
    # --profile PATH that does not exist yet: measured here and written there, so the next
    # plan of this step (another budget) runs no profiling steps
    missing = bool(ns.profile) and not Path(ns.profile).exists()
    if missing and not Path(ns.profile).parent.is_dir():
        raise TargetError(f"--profile: cannot write {ns.profile}: no directory {Path(ns.profile).parent}; give an existing one")
    saved = _saved_profile(ns.profile, ns.device) if ns.profile and not missing else None
    work = _workload(ns)
    fake = FAKE.get(ns.device, False)
    model, inputs = _on_device(work, "cpu" if fake else ns.device)
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
    console.print(f"[bold]{work.name}[/]{_step_label(step)} on [bold]{plan.device}[/]", highlight=False)
    render_plan(plan, console)
    passes = plan.step.micro_batches * plan.step.accumulate
    if passes > 1:
        console.print(
            f"note: this step runs every module {passes} times (a forward per pass) and memfit plans modules called "
            "once: plan one pass with --keep-grads (the passes after the first start with gradients), or let "
            "`memfit fit` weigh micro-batches"
        )
    if not ns.profile and not fake and time.perf_counter() - started > _SLOW_PLAN_S:
        console.print(
            "tip: most of that was measuring the step (four steps); `--profile PATH` keeps the profile, "
            "and planning again from it (any budget) runs no step"
        )
    if ns.json:
        Path(ns.json).write_text(plan.to_json())
        console.print(f"wrote {ns.json}")
    if pictures:
        from memfit.plan.planner import profile_candidates
        from memfit.report.timeline import plan_timeline

        title = f"memfit plan {ns.target}, budget {label}, on {plan.device}"
        _write_pictures(ns, console, plan_timeline(before, planned[0], plan, profile_candidates(before, plan.excluded), title))
    return 0


def _cmd_fit_ranks(ns: argparse.Namespace, console: Console, budget: int, label: str) -> int:
    """``fit --world-size N``: the fastest configuration of one rank's step (recompute,
    FSDP2's reshard_after_forward, opt-in reduce dtype) on the fake process group; with
    ``--max-batch``, the largest per-rank batch first."""
    from memfit.levers.rank_fit import fit_ranks, max_batch_ranks, parse_rank_allow
    from memfit.report.console import progress_bar, render_max_batch, render_rank_fit

    if ns.device != "fake":
        raise TargetError(f"fit per rank runs each rank on torch's fake process group: give --device fake, not {ns.device}")
    if ns.plot or ns.html or ns.keep_grads:
        raise TargetError("fit per rank does not take --plot, --html or --keep-grads yet; drop them")
    parse_rank_allow(ns.allow)
    ranks = _ranks(ns.ranks, ns.world_size)
    work = _workload(ns, per_rank=True)
    if ns.max_batch:
        with progress_bar(console, f"largest batch per rank of {work.name}") as progress:
            found = max_batch_ranks(
                work,
                budget,
                world_size=ns.world_size,
                ranks=ranks,
                multiple_of=ns.multiple_of,
                allow=ns.allow,
                progress=progress,
            )
        render_max_batch(found, console, title=work.name)
        recipe = found.recipe
        assert recipe is not None
    else:
        with progress_bar(console, f"fitting {work.name} per rank") as progress:
            recipe = fit_ranks(work, budget, world_size=ns.world_size, ranks=ranks, allow=ns.allow, progress=progress)
    recipe.budget = label
    render_rank_fit(recipe, console, title=work.name, path=ns.json)  # type: ignore[arg-type]
    if ns.json:
        Path(ns.json).write_text(recipe.to_json())
        console.print(f"wrote {ns.json}")
    return 0


def _cmd_fit(ns: argparse.Namespace, console: Console) -> int:
    from memfit.levers.fit import fit_budget, parse_allow
    from memfit.report.console import progress_bar, render_fit

    raw, label = _budget(ns)
    budget = fit_budget(raw)  # bad budgets and lever names fail before any work
    if ns.multiple_of < 1:
        raise MemfitError(f"--multiple-of takes a positive integer, got {ns.multiple_of}")
    if ns.world_size is not None:
        return _cmd_fit_ranks(ns, console, budget, label)
    if ns.ranks is not None:
        raise TargetError("--ranks picks ranks of a distributed step: give --world-size N too")
    if ns.device == "fake":
        raise TargetError(
            "fit weighs its peaks on fake tensors already: --device fake is for a distributed step (--world-size N); "
            "on one device give cpu, cuda or fake-cuda"
        )
    parse_allow(ns.allow)
    fake = FAKE.get(ns.device, False)
    _require_device(ns.device)
    work = _workload(ns)
    model, inputs = _on_device(work, "cpu" if fake else ns.device)
    common = dict(
        loss_fn=work.loss_fn, targets=work.targets, optimizer=work.make_optimizer(), allow=ns.allow, set_to_none=not ns.keep_grads
    )
    if ns.max_batch:
        from memfit.report.console import render_max_batch

        with progress_bar(console, f"largest batch of {work.name}") as progress:
            found = memfit.max_batch(model, inputs, budget, multiple_of=ns.multiple_of, progress=progress, fake=fake, **common)
        render_max_batch(found, console, title=work.name)
        if found.recipe is None:  # fake CUDA: predicted peaks, no recipe timed
            if ns.json:
                Path(ns.json).write_text(json.dumps({**found.to_dict(), "budget": label}))
                console.print(f"wrote {ns.json}")
            return 0
        found.recipe.budget = label
        recipe = found.recipe
    else:
        with progress_bar(console, f"fitting {work.name}") as progress:
            recipe = memfit.fit(model, inputs, budget, progress=progress, fake=fake, **common)
        recipe.budget = label
    render_fit(recipe, console, title=work.name, path=ns.json)
    if ns.json:
        Path(ns.json).write_text(recipe.to_json())
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.report.timeline import recipe_timeline

        # the recipe's batch (--max-batch) is the workload rebuilt at that size
        after_work = work if recipe.batch_size in (None, work.meta.get("batch_size")) else _workload_at(ns, recipe.batch_size)
        after_model, after_inputs = (model, inputs) if after_work is work else _on_device(after_work, ns.device)
        title = f"memfit fit {ns.target}, budget {label}, on {recipe.device}"

        def both(progress: Any) -> tuple[memfit.Profile, memfit.Profile]:
            before = _applied_profile(
                work, model, inputs, None, False, memfit.StepOptions(set_to_none=not ns.keep_grads), progress
            )
            return before, _applied_profile(after_work, after_model, after_inputs, recipe.plan, False, recipe.step, progress)

        _write_pictures(ns, console, lambda pair: recipe_timeline(*pair, recipe, title), profile=both)
    return 0


def _cmd_bench(ns: argparse.Namespace, console: Console) -> int:
    from memfit.bench.runner import run_bench
    from memfit.report.chart import bench_html, pareto_png
    from memfit.report.console import progress_bar, render_bench

    try:
        budgets = [float(b) for b in ns.budgets.split(",") if b.strip()]
    except ValueError:
        raise MemfitError(f"--budgets takes fractions separated by commas (e.g. 0.25,0.5,0.75), got {ns.budgets!r}") from None
    for b in budgets:
        memfit.parse_budget(b)
    _require_device(ns.device)
    if ns.scenario:
        from memfit.bench.methods import SCENARIOS

        if ns.scenario not in SCENARIOS:
            raise MemfitError(f"unknown scenario {ns.scenario!r}; choose one of {', '.join(SCENARIOS)}")
        expected = SCENARIOS[ns.scenario][0]
        if ns.target != expected:
            raise MemfitError(f"scenario {ns.scenario!r} runs on zoo model {expected!r}, not {ns.target!r}")
    with progress_bar(console, f"bench {ns.target}") as progress:
        rows, context = run_bench(
            ns.target,
            budgets,
            batch_size=ns.batch_size,
            sizes=zoo.parse_sizes(ns.size),
            device=ns.device,
            steps=ns.steps,
            compile=not ns.no_compile,
            scenario=ns.scenario,
            progress=progress,
        )
    render_bench(rows, context, console)
    if ns.json:
        Path(ns.json).write_text(json.dumps({**context, "rows": [r.to_dict() for r in rows]}, indent=1))
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        png = pareto_png(rows, context)
        if ns.plot:
            Path(ns.plot).write_bytes(png)
            console.print(f"wrote {ns.plot}")
        if ns.html:
            Path(ns.html).write_text(bench_html(rows, context, png))
            console.print(f"wrote {ns.html}")
    return 0


def _cmd_snapshot(ns: argparse.Namespace, console: Console) -> int:
    from memfit.cuda.allocator import MiB
    from memfit.cuda.snapshot import summarize
    from memfit.report.console import render_snapshot

    if ns.max_split_size_mb is not None and ns.max_split_size_mb < 20:
        raise MemfitError(f"--max-split-size-mb must be >= 20 (torch refuses smaller), got {ns.max_split_size_mb}")
    if ns.top < 0:
        raise MemfitError(f"--top takes a count >= 0, got {ns.top}")
    # Over the trace's recorded settings (its rounding, the other option): only what is asked changes.
    changes = {"expandable_segments": True} if ns.expandable_segments else {}
    if ns.max_split_size_mb is not None:
        changes["max_split_size"] = ns.max_split_size_mb * MiB
    what_if = [changes] if changes else None
    capacity = memfit.parse_bytes(ns.capacity) if ns.capacity is not None else None
    if ns.device_index is not None and ns.device_index < 0:
        raise MemfitError(f"--device-index takes a GPU index >= 0, got {ns.device_index}")
    summary = summarize(ns.path, what_if=what_if, top=ns.top, capacity=capacity, device=ns.device_index)
    render_snapshot(summary, console, top=ns.top)
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary.to_dict(), indent=1))
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.cuda.snapshot import load_snapshot, trace_timeline
        from memfit.report.timeline import snapshot_timeline

        tt = trace_timeline(load_snapshot(ns.path), summary.recorded.device)
        _write_pictures(ns, console, snapshot_timeline(tt, f"memfit snapshot {Path(ns.path).name}", ns.path))
    return 0


def _cmd_estimate(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import status
    from memfit.report.estimate import render_estimate

    _require_device(ns.device)
    try:
        from memfit.integrations.accelerate import estimate_memory
    except ImportError as exc:
        raise TargetError(
            f"memfit estimate needs transformers and accelerate ({exc.name} is missing): pip install 'memfit[hf]'"
        ) from exc
    with status(console, f"building {ns.config} from its config and profiling on fake tensors"):
        est = estimate_memory(
            ns.config,
            dtypes=ns.dtypes,
            batch_size=ns.batch_size,
            seq_len=ns.seq_len,
            sizes=zoo.parse_sizes(ns.size),
            fake=FAKE[ns.device],
        )
    render_estimate(est, console)
    if ns.json:
        Path(ns.json).write_text(json.dumps(est.to_dict()))
        console.print(f"wrote {ns.json}")
    return 0


def _cmd_zoo(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import render_zoo

    render_zoo(zoo.describe(), zoo.DEFAULT, console)
    return 0


class _DemoTiming:
    """The demo's step times, shown while the host is steady enough to time them. Once two
    timings of the same step disagree by more than :data:`~memfit.measure.timing.NOISY_STEPS`
    (a loaded machine: 15.4 s in one section, 53.0 s in the next), no time is shown from
    there on, and why is said once, plainly, where the first would have been."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.seen: list[float] = []
        self.noisy = False
        self.said = False

    def judge(self, seconds: Any, note: str = "") -> bool:
        """Take more timings of the unplanned step (and the planner's own verdict, ``note``):
        True while times may be shown."""
        from memfit.measure.timing import too_noisy

        self.seen += [s for s in seconds if s]
        self.noisy = self.noisy or bool(note) or too_noisy(self.seen)
        return not self.noisy

    def say(self) -> None:
        from memfit.report.console import render_untimed

        if self.noisy and not self.said and self.seen:
            render_untimed(self.console, self.seen)
            self.said = True


def _cmd_demo(ns: argparse.Namespace, console: Console) -> int:
    import tempfile

    from memfit.bench.child import measure_step_peak
    from memfit.report.console import (
        progress_bar,
        render_before_after,
        render_groundtruth,
        render_plan,
        render_profile,
        status,
    )

    timing = _DemoTiming(console)
    console.rule(f"[bold]1. Where the memory of a training step goes: zoo '{zoo.DEFAULT}' on cpu")
    work = zoo.build(zoo.DEFAULT)
    optimizer = work.make_optimizer()
    with progress_bar(console, f"profiling {work.name}") as progress:
        prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=optimizer, progress=progress)
    shown = timing.judge(prof.step_times_s)
    render_profile(prof, console, title=f"{work.name} (batch {work.meta['batch_size']})", times=shown)
    timing.say()
    with status(console, "measuring the same step in a fresh process (RSS high-water mark)"):
        measured = measure_step_peak(zoo.DEFAULT)
    render_groundtruth(prof, measured, console)

    console.rule("[bold]2. Fit it in 50% of the way from the lowest reachable peak to no plan")
    with progress_bar(console, "planning") as progress:
        plan = memfit.plan(
            work.model, work.inputs, "50%", loss_fn=work.loss_fn, optimizer=optimizer, profile=prof, progress=progress
        )
    render_plan(plan, console, top=8, times=timing.judge((), plan.timing_note))
    timing.say()

    console.rule("[bold]3. Applied to the model, measured")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(plan.to_json())
        with status(console, "measuring the planned step in a fresh process"):
            planned = measure_step_peak(zoo.DEFAULT, plan_path=str(path))
    before_s, after_s, shown = _demo_step_times(work, optimizer, plan, console, timing)
    render_before_after(
        [
            ("no plan", prof.peak_bytes, prof.start_bytes + measured["step_peak_bytes"], before_s),
            (
                f"plan at 50% ({memfit.format_bytes(plan.budget_bytes)})",
                plan.predicted_peak_bytes,
                plan.start_bytes + planned["step_peak_bytes"],
                after_s,
            ),
        ],
        console,
        times=shown,
    )
    timing.say()
    console.print("measured peak = tensors alive at the start + the step's RSS rise over it (fresh process)")
    _demo_big_batch(work, console)
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {
                    "profile": prof.to_dict(ledger=False),
                    "measured": measured,
                    "plan": plan.to_dict(),
                    "planned_measured": planned,
                    "step_time_s": {"no_plan": before_s, "plan": after_s},
                    "timing_too_noisy": timing.noisy,
                }
            )
        )
    return 0


def _demo_step_times(
    work: memfit.Workload, optimizer: Any, plan: memfit.Plan, console: Console, timing: _DemoTiming
) -> tuple[float, float, bool]:
    """Steps timed without and with the plan: their medians, and whether times may be shown
    (the unplanned steps agree with each other and with the profile's, the planned ones too:
    else a "+x%" would be the host's load, not the plan's cost)."""
    import statistics

    from memfit.measure.timing import time_steps, too_noisy
    from memfit.report.console import status

    with status(console, "timing steps without and with the plan"):
        before = time_steps(work.model, work.inputs, work.loss_fn, optimizer, steps=3).seconds
        memfit.apply(work.model, plan)
        try:
            after = time_steps(work.model, work.inputs, work.loss_fn, optimizer, steps=3).seconds
        finally:
            memfit.remove(work.model)
    shown = timing.judge(before)
    if too_noisy(after):
        timing.noisy, shown = True, False
    return statistics.median(before), statistics.median(after), shown


def _demo_big_batch(work: memfit.Workload, console: Console) -> None:
    """The demo's last section: a batch too big to try, profiled on fake tensors."""
    big = 8 * work.meta["batch_size"]
    console.rule(f"[bold]4. A step too big to try: batch {big} on fake tensors (no memory used)")
    big_work = zoo.build(zoo.DEFAULT, batch_size=big)
    big_prof = _profile(big_work, "fake", console)
    console.print(
        f"batch {big}: step peak [bold]{memfit.format_bytes(big_prof.peak_bytes)}[/] "
        f"({memfit.format_bytes(big_prof.step_peak_bytes)} above the start), peak during {big_prof.peak['phase']}; "
        f"activations at the peak {memfit.format_bytes(big_prof.breakdown['activations'])}"
    )


def _gpu_options(p: argparse.ArgumentParser, *, capacity: bool = True) -> None:
    from memfit.cuda.gpu import GPUS

    p.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"with --device fake-cuda: the GPU to simulate and judge the step against ({', '.join(GPUS)}; default H100-80GB)",
    )
    if capacity:
        p.add_argument("--capacity", metavar="BYTES", help="device memory to judge the step against ('24GiB'); default the GPU's")


def _step_args(p: argparse.ArgumentParser) -> None:
    """A flag for every :class:`memfit.StepOptions` field that changes the step's memory, so a
    step written by hand (gradient accumulation, autocast, ...) is measured as it runs."""
    g = p.add_argument_group("the training step (memfit.StepOptions; default: one pass, zero_grad(set_to_none=True))")
    g.add_argument(
        "--accumulate",
        metavar="K",
        help="gradient accumulation as a loop writes it: K forward+backward passes over the whole batch, no zero_grad "
        "between them, then one optimizer step (each pass holds the whole batch's activations)",
    )
    g.add_argument(
        "--micro-batches",
        metavar="K",
        help="split the batch into K micro-batches, forward+backward each (gradients accumulate), then one optimizer step",
    )
    g.add_argument(
        "--loss-scale",
        metavar="X",
        help="factor on each pass's loss (default 1/(micro-batches x accumulate), none for a single pass)",
    )
    g.add_argument(
        "--keep-grads",
        action="store_true",
        help="the loop calls zero_grad(set_to_none=False): gradients stay allocated between steps (the step starts with them)",
    )
    g.add_argument("--autocast", metavar="DTYPE", help="forward and loss under torch.autocast: bfloat16 or float16")
    g.add_argument("--grad-scaler", action="store_true", help="backward and optimizer step through torch.amp.GradScaler")
    g.add_argument(
        "--param-dtype", metavar="DTYPE", help="parameters, optimizer state and inputs cast to bfloat16 or float16 (a copy)"
    )
    g.add_argument("--foreach", metavar="on|off", help="set the optimizer's foreach flag (default: as it is)")
    g.add_argument(
        "--optimizer-8bit", action="store_true", help="the optimizer replaced by its bitsandbytes 8-bit counterpart"
    )
    g.add_argument(
        "--offload",
        action="store_true",
        help="tensors saved for backward go to pinned host memory (save_on_cpu; a CUDA step)",
    )
    g.add_argument(
        "--forward-before-loop",
        action="store_true",
        help="the program runs the model's forward once before its loop (a target computed with the model, a check): "
        "the forward's cuBLAS workspace exists before the first step (where a CUDA step's blocks are placed)",
    )
    g.add_argument(
        "--holds-output",
        action="store_true",
        help="the loop binds the model's output to a name (output = model(x)) and does not del it: the previous "
        "step's output stays alive until the next step's forward returns (the whole output object; with micro-batches "
        "or --accumulate, each pass's until the next pass's forward returns)",
    )


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description="Fit a PyTorch training step in a memory budget.")
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    traceback_help = "on an error, print the whole traceback (your own setup code's included) instead of one line"
    parser.add_argument("--traceback", action="store_true", help=traceback_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def target_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("target", help="zoo model name (see `memfit zoo`) or path/to/file.py:function returning a memfit.Workload")
        p.add_argument("--batch-size", type=int, help="batch size of the example inputs")
        p.add_argument(
            "--size",
            action="append",  # several after one --size too: main() hands argparse one per --size=
            default=[],
            metavar="KEY=VALUE",
            help="zoo model size, e.g. n_layer=24 (several after one --size, or --size again)",
        )

    def picture_args(p: argparse.ArgumentParser, what: str = "the step") -> None:
        p.add_argument("--plot", metavar="PATH.png", help=f"write a PNG of memory over the step's ticks by category: {what}")
        p.add_argument("--html", metavar="PATH.html", help="write the same as one self-contained page (hover, largest blocks)")

    p = sub.add_parser("profile", help="measure where the memory of one training step goes")
    target_args(p)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "fake", "fake-cuda"],
        default="cpu",
        help="fake: fake tensors, no memory used; fake-cuda: fake tensors on a simulated CUDA GPU (CUDA's autocast, "
        "attention kernels and optimizer defaults), on a CPU build of torch (builds a small C++ shim with g++ once)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the profile as JSON")
    picture_args(p)
    p.add_argument("--top", type=int, default=12, help="modules to list (default 12)")
    p.add_argument(
        "--eval", action="store_true", help="an evaluation step: eval mode, forward and loss under torch.inference_mode()"
    )
    p.add_argument(
        "--world-size",
        type=_positive,
        metavar="N",
        help="measure the target's distributed step (its Workload.parallel; zoo llama: --size parallel=fsdp2|ddp|tp|fsdp2+tp|hsdp) as "
        "one rank of N on torch's fake process group (with --device fake)",
    )
    p.add_argument("--ranks", metavar="R,R|all", help="with --world-size: the ranks to measure (default 0)")
    _gpu_options(p)
    _step_args(p)
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="choose what to recompute so a training step fits a memory budget")
    target_args(p)
    p.add_argument(
        "--budget", help="bytes for the whole step ('6GiB', '800MB') or a fraction ('50%%', 0.5); or give --gpu/--capacity"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "fake", "fake-cuda"],
        default="cpu",
        help="fake: plan on fake tensors; fake-cuda: on fake tensors of a simulated CUDA GPU",
    )
    p.add_argument(
        "--objective", choices=["time", "flops"], default="time", help="minimise estimated recompute time (default) or FLOPs"
    )
    _gpu_options(p)
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON (memfit.Plan.from_json reads it)")
    p.add_argument(
        "--profile",
        metavar="PATH",
        help="plan from this target's profile saved by `memfit profile TARGET --json PATH` (same batch and device) "
        "instead of measuring one: no profiling steps; a PATH that does not exist yet is measured and written",
    )
    p.add_argument(
        "--world-size", type=_positive, metavar="N", help="plan one rank of N of the target's distributed step (--device fake)"
    )
    p.add_argument(
        "--ranks",
        metavar="R,R|all",
        help="with --world-size: the ranks to verify the plan on (default 0); with --min-world-size: the ranks that must "
        "fit, negative from the last (default 0,-1)",
    )
    p.add_argument(
        "--min-world-size",
        action="store_true",
        help="the smallest world size (1, 2, 4, ...; or --world-sizes, --node-size) at which the worst of --ranks "
        "(default 0,-1: the first and the last) fits --budget, with and without recompute",
    )
    p.add_argument("--max-world-size", type=_positive, metavar="N", help="with --min-world-size: the largest to try (1024)")
    p.add_argument(
        "--world-sizes", metavar="N,N", help="with --min-world-size: the world sizes to try (8,16,24,32), any the mesh allows"
    )
    p.add_argument(
        "--node-size",
        type=_positive,
        metavar="K",
        help="with --min-world-size: try the multiples of K (a node's GPUs) up to --max-world-size, not powers of two",
    )
    picture_args(p, "the step without and with the plan (as the run that verified the plan recorded it)")
    _step_args(p)
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("fit", help="the fastest combination of memory levers (recompute, micro-batches, ...) that fits a budget")
    target_args(p)
    p.add_argument("--budget", help="bytes for the whole step's peak ('6GiB', '800MB'); or give --gpu/--capacity")
    p.add_argument(
        "--allow",
        default="",
        metavar="LEVERS",
        help="levers that change the numerics, comma-separated: amp, bf16, foreach, 8bit; per rank (--world-size): "
        "reduce_bf16 (default: exact levers only)",
    )
    p.add_argument(
        "--keep-grads", action="store_true", help="the training loop calls zero_grad(set_to_none=False) (weigh switching)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "fake", "fake-cuda"],
        default="cpu",
        help="fake-cuda: exact peaks on a simulated CUDA GPU, step times predicted by the cost model (nothing timed); "
        "fake: with --world-size, each rank on torch's fake process group",
    )
    p.add_argument(
        "--world-size",
        type=_positive,
        metavar="N",
        help="fit one rank of N of the target's distributed step (--device fake): recompute, FSDP2's "
        "reshard_after_forward and, with --allow reduce_bf16, a bfloat16 reduce dtype; budget per rank",
    )
    p.add_argument("--ranks", metavar="R,R|all", help="with --world-size: the ranks to fit (default 0)")
    _gpu_options(p)
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="find the largest batch that fits (from how the peak grows with the batch, on fake tensors) and its fastest recipe",
    )
    p.add_argument(
        "--multiple-of", type=int, default=1, metavar="N", help="with --max-batch: batch sizes that are multiples of N"
    )
    p.add_argument("--json", metavar="PATH", help="also write the recipe as JSON (memfit.Recipe.from_json reads it)")
    picture_args(p, "the step as it is and with the recipe (each profiled again)")
    p.set_defaults(func=_cmd_fit)

    p = sub.add_parser("bench", help="memfit's plans against the baselines, each measured in fresh processes")
    target_args(p)
    p.add_argument(
        "--budgets", default="0.25,0.5,0.75", help="budget fractions for memfit and torch.compile (default 0.25,0.5,0.75)"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median; default 5)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument(
        "--scenario", help="a named worked example: resnet152-layer1-layer2 (TARGET resnet152) or bert-per-layer (bert-base)"
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write the memory-vs-throughput chart")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "snapshot", help="a GPU memory snapshot (torch.cuda.memory._dump_snapshot): peaks, largest allocations, other settings"
    )
    p.add_argument("path", metavar="PATH.pickle", help="a snapshot pickle, read without running code from it")
    p.add_argument("--json", metavar="OUT", help="also write allocated_peak_bytes, reserved_peak_bytes and the rest as JSON")
    p.add_argument(
        "--expandable-segments", action="store_true", help="compare with expandable_segments:True (the default comparison)"
    )
    p.add_argument("--max-split-size-mb", type=int, metavar="N", help="compare with max_split_size_mb:N (with the above: both)")
    p.add_argument(
        "--capacity", metavar="BYTES", help="the GPU's memory ('80GB'): the comparison releases cached segments and retries there"
    )
    p.add_argument("--device-index", type=int, metavar="N", help="which GPU's trace (default: the one with the most events)")
    p.add_argument("--top", type=int, default=10, help="largest allocations to list (default 10)")
    p.add_argument(
        "--plot", metavar="PATH.png", help="write a PNG of allocated and reserved over the trace's events, segments below"
    )
    p.add_argument(
        "--html",
        metavar="PATH.html",
        help="write the same as one self-contained page (hover: a block's frames; the peak's blocks)",
    )
    p.set_defaults(func=_cmd_snapshot)

    p = sub.add_parser(
        "estimate",
        help="accelerate estimate-memory's numbers for a transformers config, beside memfit's step peak with activations",
    )
    p.add_argument(
        "config",
        help="a transformers model type (llama, gpt2, t5, ...: its config's default sizes) or a local config.json (or its "
        "folder); nothing is downloaded and no weights are made",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16", "int8", "int4"],
        choices=["float32", "float16", "bfloat16", "int8", "int4"],
        help="as accelerate estimate-memory's (default: float32 float16 int8 int4); memfit trains float16 / bfloat16 as "
        "mixed precision, and not int8 / int4",
    )
    p.add_argument("--batch-size", type=int, default=1, help="sequences in the step (default 1)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--size", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. num_hidden_layers=16")
    p.add_argument(
        "--device",
        choices=["fake", "fake-cuda"],
        default="fake",
        help="fake: fake CPU tensors; fake-cuda: fake tensors on a simulated CUDA GPU (CUDA's autocast and kernels)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("zoo", help="list the built-in models")
    p.set_defaults(func=_cmd_zoo)

    p = sub.add_parser("demo", help="end to end on the default model, on the CPU")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.set_defaults(func=_cmd_demo)

    # --traceback after the command too (where one adds it to a command that failed);
    # SUPPRESS keeps the command from resetting it when it was given before
    for p in sub.choices.values():
        p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback_help)
    return parser


def _end_size_lists(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` with each KEY=VALUE after ``--size`` passed as ``--size=KEY=VALUE``, and the values
    without '=' that ended a --size list. argparse's ``nargs='+'`` would swallow the target after
    the sizes (``--size n_layer=2 gpt``); one value per ``--size=`` (``action='append'``) leaves
    it a positional."""
    out: list[str] = []
    ended: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--":  # the rest is positional
            return out + argv[i:], ended
        j = i + 1
        if argv[i] == "--size":
            while j < len(argv) and "=" in argv[j] and not argv[j].startswith("-"):
                j += 1
        if j == i + 1:  # not --size, or no KEY=VALUE after it: argparse's own reading (and error)
            out.append(argv[i])
            i = j
            continue
        out += [f"--size={item}" for item in argv[i + 1 : j]]
        if j < len(argv) and not argv[j].startswith("-"):
            ended.append(argv[j])
        i = j
    return out, ended


def main(argv: list[str] | None = None) -> int:
    from memfit.cuda import fake as fake_cuda

    if argv is None:  # this process's own command line: `--device fake-cuda` loads the shim before torch
        fake_cuda.relaunch_for_command(sys.orig_argv)
    parser = _parser()
    args, ended = _end_size_lists(sys.argv[1:] if argv is None else list(argv))
    ns, extra = parser.parse_known_args(args)
    console = Console()
    err = Console(stderr=True)
    if extra:
        # a value without '=' after --size that was not needed as the target: a size typo
        bad = next((item for item in extra if item in ended), None)
        if bad is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        err.print(
            f"memfit: error: --size takes KEY=VALUE (e.g. n_layer=24), got {bad!r} (the target is given already)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_ERROR
    simulated = fake_cuda.gpu()  # --gpu sets it for this command, not for what the process does next
    try:
        return ns.func(ns, console)
    except MemfitError as exc:
        if ns.traceback:
            import traceback

            # the chain too: a TargetError's cause is the user's own code failing
            err.print("".join(traceback.format_exception(exc)), markup=False, highlight=False, soft_wrap=True, end="")
        err.print(f"memfit: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_ERROR
    finally:
        fake_cuda.set_gpu(simulated)


if __name__ == "__main__":
    sys.exit(main())
