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
    applied_profile,
    check_world,
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
    planned_ranks,
    rank_budget,
    ranks_arg,
    read_budget,
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
    ranks_arg(p, "with --world-size: the ranks to fit (default 0; under --size parallel=pp every stage rank, each planned on its own)")
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
    """One path for one device and for ranks of a world (``--world-size``): the budget read,
    ``memfit.fit`` (or ``memfit.max_batch``) asked, the recipe drawn and written."""
    from memfit.levers.fit import fit_budget, parse_allow
    from memfit.levers.rank_fit import parse_rank_allow
    from memfit.report.console import progress_bar, render_fit, render_max_batch

    raw, label = read_budget(ns)
    budget = fit_budget(raw)  # bad budgets and lever names fail before any work
    if ns.multiple_of < 1:
        raise MemfitError(f"--multiple-of takes a positive integer, got {ns.multiple_of}")
    per_rank = ns.world_size is not None
    _check_world(ns)
    (parse_rank_allow if per_rank else parse_allow)(ns.allow)
    fake = where_of(ns.device)
    require_device(ns.device)
    work = workload(ns, per_rank=per_rank)
    if per_rank:
        raw, label = rank_budget(ns, work, raw, label)
        budget = fit_budget(raw)
        ranks = planned_ranks(ns.ranks, work, ns.world_size)
        model, inputs, asked = work, None, dict(world_size=ns.world_size, ranks=ranks)
    else:
        model, inputs = on_device(work, "cpu" if fake.fake else ns.device)
        optimizer = work.make_optimizer()
        asked = dict(loss_fn=work.loss_fn, targets=work.targets, optimizer=optimizer, set_to_none=not ns.keep_grads)
    common = dict(budget=budget, allow=ns.allow, fake=fake, **asked)
    per = " per rank" if per_rank else ""
    if ns.max_batch:
        with progress_bar(console, f"largest batch{per} of {work.name}") as progress:
            found = memfit.max_batch(model, inputs, multiple_of=ns.multiple_of, progress=progress, **common)
        render_max_batch(found, console, title=work.name)
        if found.recipe is None:  # fake CUDA: predicted peaks, no recipe timed
            if ns.json:
                Path(ns.json).write_text(json.dumps({**found.to_dict(), "budget": label}))
                console.print(f"wrote {ns.json}")
            return 0
        recipe = found.recipe
    else:
        with progress_bar(console, f"fitting {work.name}{per}") as progress:
            recipe = memfit.fit(model, inputs, progress=progress, **common)
    recipe.budget = label
    render_fit(recipe, console, title=work.name, path=ns.json)
    if ns.json:
        Path(ns.json).write_text(recipe.to_json())
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        _pictures(ns, console, work, model, inputs, recipe, label)
    return 0


def _check_world(ns: argparse.Namespace) -> None:
    """What a fit on one device, or per rank, cannot take: refused before any work."""
    if not check_world(ns, "fit per rank"):
        if ns.device == "fake":
            raise TargetError(
                "fit weighs its peaks on fake tensors already: --device fake is for a distributed step (--world-size N); "
                "on one device give cpu, cuda or fake-cuda"
            )
        return
    if ns.plot or ns.html or ns.keep_grads:
        raise TargetError("fit per rank does not take --plot, --html or --keep-grads yet; drop them")


def _pictures(ns: argparse.Namespace, console: Console, work: Any, model: Any, inputs: Any, recipe: Any, label: str) -> None:
    """``--plot``/``--html``: the step as it is and with the recipe, each profiled again for real."""
    from memfit.report.timeline import recipe_timeline

    # the recipe's batch (--max-batch) is the workload rebuilt at that size
    after_work = work if recipe.batch_size in (None, work.meta.get("batch_size")) else workload_at(ns, recipe.batch_size)
    after_model, after_inputs = (model, inputs) if after_work is work else on_device(after_work, ns.device)
    title = f"memfit fit {ns.target}, budget {label}, on {recipe.device}"

    def both(progress: Any) -> tuple[memfit.Profile, memfit.Profile]:
        before = applied_profile(work, model, inputs, None, Where.REAL, memfit.StepOptions(set_to_none=not ns.keep_grads), progress)
        return before, applied_profile(after_work, after_model, after_inputs, recipe.plan, Where.REAL, recipe.step, progress)

    write_pictures(ns, console, lambda pair: recipe_timeline(*pair, recipe, title), profile=both)
