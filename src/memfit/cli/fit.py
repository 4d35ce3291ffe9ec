"""``memfit fit``: the fastest combination of memory levers that fits a budget; the largest
batch that fits with ``--max-batch``; per rank with ``--world-size``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit.cli.common import (
    FAKE,
    applied_profile,
    on_device,
    require_device,
    where_of,
    workload,
    workload_at,
    write_pictures,
)
from memfit.cli.options import (
    budget_arg,
    device_arg,
    gpu_options,
    json_arg,
    picture_args,
    rank_budget,
    ranks_arg,
    read_budget,
    read_ranks,
    target_args,
    world_size_arg,
)
from memfit.errors import MemfitError, TargetError
from memfit.workload import Where


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fit", help="the fastest combination of memory levers (recompute, micro-batches, ...) that fits a budget")
    target_args(p)
    budget_arg(p, "bytes for the whole step's peak ('6GiB', '800MB'); or give --gpu/--capacity")
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
    device_arg(
        p,
        "fake-cuda: exact peaks on a simulated CUDA GPU, step times predicted by the cost model (nothing timed); "
        "with --world-size, each rank on torch's fake process group: fake, or fake-cuda (reserved peaks per rank)",
    )
    world_size_arg(
        p,
        "fit one rank of N of the target's distributed step (--device fake or fake-cuda): recompute, FSDP2's "
        "reshard_after_forward, on fake-cuda expandable_segments and, with --allow reduce_bf16, a bfloat16 reduce "
        "dtype; budget per rank (--gpu: its memory less the CUDA context and NCCL's buffers)",
    )
    ranks_arg(p, "with --world-size: the ranks to fit (default 0)")
    gpu_options(p)
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="find the largest batch that fits (from how the peak grows with the batch, on fake tensors) and its fastest recipe",
    )
    p.add_argument(
        "--multiple-of", type=int, default=1, metavar="N", help="with --max-batch: batch sizes that are multiples of N"
    )
    json_arg(p, "also write the recipe as JSON (memfit.Recipe.from_json reads it)")
    picture_args(p, "the step as it is and with the recipe (each profiled again)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.levers.fit import fit_budget, parse_allow
    from memfit.report.console import progress_bar, render_fit

    raw, label = read_budget(ns)
    budget = fit_budget(raw)  # bad budgets and lever names fail before any work
    if ns.multiple_of < 1:
        raise MemfitError(f"--multiple-of takes a positive integer, got {ns.multiple_of}")
    if ns.world_size is not None:
        return _run_ranks(ns, console, raw, label)
    if ns.ranks is not None:
        raise TargetError("--ranks picks ranks of a distributed step: give --world-size N too")
    if ns.device == "fake":
        raise TargetError(
            "fit weighs its peaks on fake tensors already: --device fake is for a distributed step (--world-size N); "
            "on one device give cpu, cuda or fake-cuda"
        )
    parse_allow(ns.allow)
    fake = where_of(ns.device)
    require_device(ns.device)
    work = workload(ns)
    model, inputs = on_device(work, "cpu" if fake.fake else ns.device)
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
        after_work = work if recipe.batch_size in (None, work.meta.get("batch_size")) else workload_at(ns, recipe.batch_size)
        after_model, after_inputs = (model, inputs) if after_work is work else on_device(after_work, ns.device)
        title = f"memfit fit {ns.target}, budget {label}, on {recipe.device}"

        def both(progress: Any) -> tuple[memfit.Profile, memfit.Profile]:
            before = applied_profile(
                work, model, inputs, None, Where.REAL, memfit.StepOptions(set_to_none=not ns.keep_grads), progress
            )
            return before, applied_profile(after_work, after_model, after_inputs, recipe.plan, Where.REAL, recipe.step, progress)

        write_pictures(ns, console, lambda pair: recipe_timeline(*pair, recipe, title), profile=both)
    return 0


def _run_ranks(ns: argparse.Namespace, console: Console, raw: Any, label: str) -> int:
    """``fit --world-size N``: the fastest configuration of one rank's step (recompute,
    FSDP2's reshard_after_forward, expandable segments on fake CUDA, opt-in reduce dtype) on
    the fake process group; with ``--max-batch``, the largest per-rank batch first."""
    from memfit.levers.fit import fit_budget
    from memfit.levers.rank_fit import fit_ranks, max_batch_ranks, parse_rank_allow
    from memfit.report.console import progress_bar, render_max_batch, render_rank_fit

    if ns.device not in FAKE:
        raise TargetError(
            f"fit per rank runs each rank on torch's fake process group: give --device fake or fake-cuda, not {ns.device}"
        )
    require_device(ns.device)
    if ns.plot or ns.html or ns.keep_grads:
        raise TargetError("fit per rank does not take --plot, --html or --keep-grads yet; drop them")
    parse_rank_allow(ns.allow)
    ranks = read_ranks(ns.ranks, ns.world_size)
    work = workload(ns, per_rank=True)
    raw, label = rank_budget(ns, work, raw, label)
    budget = fit_budget(raw)
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
                fake=FAKE[ns.device],
            )
        render_max_batch(found, console, title=work.name)
        recipe = found.recipe
        assert recipe is not None
    else:
        with progress_bar(console, f"fitting {work.name} per rank") as progress:
            recipe = fit_ranks(
                work, budget, world_size=ns.world_size, ranks=ranks, allow=ns.allow, progress=progress, fake=FAKE[ns.device]
            )
    recipe.budget = label
    render_rank_fit(recipe, console, title=work.name, path=ns.json)  # type: ignore[arg-type]
    if ns.json:
        Path(ns.json).write_text(recipe.to_json())
        console.print(f"wrote {ns.json}")
    return 0
