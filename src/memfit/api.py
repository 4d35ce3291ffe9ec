"""The four questions, each asked one way, for one device or for every rank of a world.

``memfit.profile``, ``plan``, ``fit`` and ``max_batch`` take the step as a training script holds
it (model, inputs, loss, optimizer, targets) or as a :class:`~memfit.workload.Workload`, and
where it runs as ``parallel=`` (a :class:`~memfit.workload.Parallel`), ``world_size=`` and
``ranks=``. A single device is a world of one: without a ``Parallel`` the step is measured as
it is (real tensors, or fake ones with ``fake=``); with one, each asked-for rank's step is
parallelized and measured on torch's fake process group and fake tensors, and the answer has a
row per rank. The mechanisms differ (a rank's step is built, sharded and run on a fake group);
the question and its arguments are one, and the answers read alike: a single device's
:class:`~memfit.measure.profile.Profile` is rank 0 of a world of one (``profiles``,
``worst_rank``), and both recipes are a :class:`~memfit.levers.recipe.FitRecipe`.

Each function here is that dispatch and nothing else: the single-device functions
(:mod:`memfit.measure.profile`, :mod:`memfit.plan.planner`, :mod:`memfit.levers.fit`,
:mod:`memfit.levers.max_batch`) and the per-rank ones (:mod:`memfit.measure.distributed`,
:mod:`memfit.plan.distributed`, :mod:`memfit.levers.rank_fit`) do the work. Arguments only one
of the two takes are refused in one line for the other, never ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from memfit.cuda import gpu as gpus
from memfit.errors import WorkloadError
from memfit.levers import fit as single_fit
from memfit.levers import max_batch as single_max_batch
from memfit.levers.max_batch import MaxBatch
from memfit.levers.rank_fit import fit_ranks, max_batch_ranks
from memfit.levers.recipe import RankRecipe, Recipe
from memfit.measure import profile as single_profile
from memfit.measure.distributed import RankProfiles, profile_ranks, world_size_of
from memfit.measure.profile import Profile, Progress
from memfit.measure.step import StepOptions
from memfit.plan import planner
from memfit.plan.distributed import plan_ranks
from memfit.plan.result import Plan, fingerprint
from memfit.workload import Parallel, Ranks, Where, Workload, asked_ranks

__all__ = ["profile", "plan", "fit", "max_batch", "World"]


@dataclasses.dataclass(frozen=True)
class World:
    """Where a question is asked: one device (the loose parts go to the single-device
    function), or ``ranks`` of ``size`` ranks of ``workload``'s parallel step. ``workload``:
    the one given or built (None: loose parts on one device)."""

    workload: Workload | None
    size: int = 1
    ranks: tuple[int, ...] = (0,)

    @property
    def one_device(self) -> bool:
        return self.workload is None or self.workload.parallel is None

    def per_rank(self, fake: bool | str | Where, progress: Progress | None) -> dict[str, Any]:
        """What every per-rank function takes besides the workload and its own arguments: the
        world's size and asked-for ranks, the progress callback, and where a rank's step runs
        (fake tensors: on the CPU unless fake CUDA is asked for)."""
        where = Where.of(fake)
        return {
            "world_size": self.size,
            "ranks": self.ranks,
            "progress": progress,
            "fake": Where.FAKE if where is Where.REAL else where,
        }

    def as_held(self, plan: Plan | None) -> Plan | None:
        """``plan`` for the model the training script holds: a target that wraps it
        (:attr:`Workload.plan_root`) is planned whole, the plan handed over re-rooted."""
        work = self.workload
        if plan is None or work is None or not work.plan_root:
            return plan
        return plan.under(work.plan_root, work.model.get_submodule(work.plan_root))

    def recipe_as_held(self, recipe: Any) -> Any:
        """A recipe's plan (and a single device's recipe's fingerprint) for the model held, as :meth:`as_held`."""
        work = self.workload
        if recipe is None or work is None or not work.plan_root:
            return recipe
        recipe.plan = self.as_held(recipe.plan)
        if "fingerprint" in recipe.WHERE:  # a Recipe is checked against the model it is applied to
            held = work.model.get_submodule(work.plan_root)
            recipe.fingerprint, recipe.model_type = fingerprint(held), type(held).__name__
        return recipe


def world_of(
    model: Any,
    inputs: Any,
    parts: Mapping[str, Any],
    parallel: Parallel | None,
    world_size: int | None,
    ranks: Ranks | None,
) -> tuple[World, nn.Module, Any, dict[str, Any]]:
    """Read where the step runs, once: the :class:`World`, and the single-device function's
    model, inputs and loose ``parts`` (loss_fn, optimizer, targets: a Workload's own when one
    is given)."""
    if isinstance(model, Workload):
        given = [k for k, v in {"inputs": inputs, **parts}.items() if v is not None]
        if given:
            raise WorkloadError(
                f"a memfit.Workload carries its inputs, loss, optimizer and targets: drop {', '.join(given)}= "
                "or pass the model instead of the Workload"
            )
        work = model if parallel is None else dataclasses.replace(model, parallel=parallel)
        model, inputs = work.model, work.inputs
    elif inputs is None:
        raise WorkloadError(
            "no inputs given: pass what the model is called with (a tensor, a tuple or a dict), or a memfit.Workload"
        )
    elif parallel is not None:
        work = Workload(
            model, inputs, parts["loss_fn"], _factory(parts["optimizer"]), targets=parts["targets"], parallel=parallel
        )
    else:
        work = None
    if work is None or work.parallel is None:
        if world_size not in (None, 1) or ranks not in (None, "all", (0,), [0]):
            raise WorkloadError(
                "world_size and ranks ask about ranks of a distributed step: give parallel=memfit.Parallel(parallelize) "
                "(or a memfit.Workload with one); without it the step is one device, a world of one"
            )
        if work is not None:  # made here, for one device only: a rank's optimizer is made over its shards
            parts = {"loss_fn": work.loss_fn, "targets": work.targets, "optimizer": _made(work)}
        return World(work), model, inputs, dict(parts)
    n = world_size_of(work, world_size)
    return World(work, n, tuple(asked_ranks(ranks, n))), model, inputs, dict(parts)


def _made(work: Workload) -> torch.optim.Optimizer | None:
    """A Workload's optimizer for a single-device step (None: the function's default, AdamW)."""
    return work.make_optimizer() if work.optimizer is not None else None


def _factory(optimizer: Any) -> Callable[..., torch.optim.Optimizer] | None:
    """A per-rank step's optimizer is made over that rank's parallelized parameters, so it is
    given as a factory ``params -> optimizer``; an optimizer already made over the whole
    model's parameters cannot be."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise WorkloadError(
            "with parallel=, the optimizer is made over each rank's parallelized parameters: give optimizer=None "
            "(AdamW) or a factory, optimizer=lambda params: torch.optim.AdamW(params, ...)"
        )
    return optimizer


def _one_device_only(**given: tuple[Any, Any]) -> None:
    """Refuse the arguments the per-rank answer does not take (each ``name=(value, default)``)."""
    set_ = [k for k, (v, default) in given.items() if v is not default and v != default]
    if set_:
        raise WorkloadError(f"per rank (parallel=), {', '.join(set_)}= is not modelled yet: drop it, or ask about one device")


def profile(
    model: nn.Module | Workload,
    inputs: Any = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    fake: bool | str | Where = False,
    progress: Progress | None = None,
    step: StepOptions | None = None,
    targets: Any = None,
    gpu: str | gpus.GpuSpec | None = None,
    capacity: int | str | None = None,
    parallel: Parallel | None = None,
    world_size: int | None = None,
    ranks: Ranks | None = None,
) -> Profile | RankProfiles:
    parts = {"loss_fn": loss_fn, "optimizer": optimizer, "targets": targets}
    world, model, inputs, parts = world_of(model, inputs, parts, parallel, world_size, ranks)
    if world.one_device:
        options = dict(fake=fake, progress=progress, step=step, gpu=gpu, capacity=capacity)
        return single_profile.profile(model, inputs, **parts, **options)
    _one_device_only(step=(step, None))
    return profile_ranks(world.workload, gpu=gpu, capacity=capacity, **world.per_rank(fake, progress))  # type: ignore[arg-type]


def plan(
    model: nn.Module | Workload,
    inputs: Any = None,
    budget: int | float | str | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    fake: bool | str | Where = False,
    profile: Profile | None = None,
    objective: str = "time",
    progress: Progress | None = None,
    step: StepOptions | None = None,
    targets: Any = None,
    op_overhead_s: float | None = None,
    on_profile: Callable[[Profile], None] | None = None,
    on_planned: Callable[[Profile], None] | None = None,
    parallel: Parallel | None = None,
    world_size: int | None = None,
    ranks: Ranks | None = None,
) -> Plan:
    parts = {"loss_fn": loss_fn, "optimizer": optimizer, "targets": targets}
    world, model, inputs, parts = world_of(model, inputs, parts, parallel, world_size, ranks)
    if world.one_device:
        return world.as_held(
            planner.plan(
                model,
                inputs,
                budget,
                **parts,
                fake=fake,
                profile=profile,
                objective=objective,
                progress=progress,
                step=step,
                op_overhead_s=op_overhead_s,
                on_profile=on_profile,
                on_planned=on_planned,
            )
        )
    _one_device_only(
        profile=(profile, None), step=(step, None), op_overhead_s=(op_overhead_s, None),
        on_profile=(on_profile, None), on_planned=(on_planned, None),
    )  # fmt: skip
    planned = plan_ranks(world.workload, budget, objective=objective, **world.per_rank(fake, progress))  # type: ignore[arg-type]
    return world.as_held(planned)  # type: ignore[return-value]


def fit(
    model: nn.Module | Workload,
    inputs: Any = None,
    budget: int | str | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    allow: str | Iterable[str] | None = None,
    set_to_none: bool = True,
    progress: Progress | None = None,
    targets: Any = None,
    exclude: Mapping[str, str] | None = None,
    fake: bool | str | Where = False,
    parallel: Parallel | None = None,
    world_size: int | None = None,
    ranks: Ranks | None = None,
) -> Recipe | RankRecipe:
    parts = {"loss_fn": loss_fn, "optimizer": optimizer, "targets": targets}
    world, model, inputs, parts = world_of(model, inputs, parts, parallel, world_size, ranks)
    if world.one_device:
        options = dict(allow=allow, set_to_none=set_to_none, progress=progress, exclude=exclude, fake=fake)
        return world.recipe_as_held(single_fit.fit(model, inputs, budget, **parts, **options))
    _one_device_only(set_to_none=(set_to_none, True))
    recipe = fit_ranks(world.workload, budget, allow=allow, exclude=exclude, **world.per_rank(fake, progress))  # type: ignore[arg-type]
    return world.recipe_as_held(recipe)


def max_batch(
    model: nn.Module | Workload,
    inputs: Any = None,
    budget: int | str | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    allow: str | Iterable[str] | None = None,
    set_to_none: bool = True,
    multiple_of: int = 1,
    progress: Progress | None = None,
    targets: Any = None,
    fake: bool | str | Where = False,
    parallel: Parallel | None = None,
    world_size: int | None = None,
    ranks: Ranks | None = None,
) -> MaxBatch:
    parts = {"loss_fn": loss_fn, "optimizer": optimizer, "targets": targets}
    world, model, inputs, parts = world_of(model, inputs, parts, parallel, world_size, ranks)
    if world.one_device:
        options = dict(allow=allow, set_to_none=set_to_none, multiple_of=multiple_of, progress=progress, fake=fake)
        found = single_max_batch.max_batch(model, inputs, budget, **parts, **options)
        world.recipe_as_held(found.recipe)
        return found
    _one_device_only(set_to_none=(set_to_none, True))
    found = max_batch_ranks(
        world.workload, budget, multiple_of=multiple_of, allow=allow, **world.per_rank(fake, progress)  # type: ignore[arg-type]
    )
    world.recipe_as_held(found.recipe)
    return found


_WORLD_DOC = """
    Where it runs (a single device is a world of one):
        parallel: how the step is parallelized over ranks (:class:`memfit.Parallel`; a
            :class:`memfit.Workload` may carry it). With it, each of ``ranks`` is measured
            as its own parallelized step on torch's fake process group and fake tensors (fake
            CPU, or ``fake="cuda"``), and the answer has a row per rank; ``optimizer`` is then
            ``None`` or a factory ``params -> optimizer`` (made over each rank's shards).
        world_size: the number of ranks (default the ``Parallel``'s own).
        ranks: the ranks to answer for: integers or ``"all"`` (default rank 0).

    The step may also be given as one :class:`memfit.Workload` in place of ``model``
    (without ``inputs``, ``loss_fn``, ``optimizer`` or ``targets``: it carries them).
"""

_RETURNS = {
    "profile": "A :class:`~memfit.measure.distributed.RankProfiles` (each asked-for rank's profile) with ``parallel``",
    "plan": "The :class:`Plan`'s :attr:`~Plan.rank_peak_bytes` hold each asked-for rank's verified peak with ``parallel``",
    "fit": "A :class:`~memfit.levers.recipe.RankRecipe` (reshard_after_forward and recompute, per rank) with ``parallel``",
    "max_batch": "The largest batch per rank (:attr:`MaxBatch.world_size` set) with ``parallel``",
}

for _fn, _single in (
    (profile, single_profile.profile),
    (plan, planner.plan),
    (fit, single_fit.fit),
    (max_batch, single_max_batch.max_batch),
):
    # One text per question: the single-device function's, and what the world adds.
    _fn.__doc__ = f"{_single.__doc__.rstrip()}\n{_WORLD_DOC}\n    {_RETURNS[_fn.__name__]}.\n"
