"""Plans per rank for a distributed step, and the smallest world size at which it fits.

:func:`plan_ranks` plans recompute on the parallelized step of one rank (FSDP2's
``fully_shard`` blocks, or the model inside DDP's wrapper), from that rank's ledger on
torch's fake process group: the planner's usual search, with every candidate plan verified
by running the rank's step with it applied, on the same fake group. The plan names modules
as the unparallelized model does and is applied before parallelizing (``memfit.apply(model,
plan)`` then ``fully_shard``, or ``DistributedDataParallel(model)``: torch's non-reentrant
checkpoint, which memfit applies, runs under DDP's reducer as a plain forward does); every
asked-for rank is then profiled afresh that way, with the plan applied to the model before
``parallelize``, and its peak is the plan's verified figure.

:func:`min_world_size` answers "how many ranks": the smallest world size among the
candidates (given, multiples of a node's size, or powers of two) at which the worst rank's
step fits a per-rank budget, without recompute and with memfit's plan.

Policy only: the process group is what :mod:`memfit.measure.distributed` is given.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from memfit.cuda.allocator import AllocatorSettings
from memfit.errors import BudgetInfeasibleError, PlanError, WorkloadError
from memfit.measure.distributed import (
    FakeGroup,
    RankProfiles,
    RankState,
    StartOverLimit,
    box_rank,
    box_state,
    held_at_start,
    layered_profile,
    layered_rank,
    profile_rank,
    profile_ranks,
    rank_device,
    rank_state,
    with_recompute,
    world_size_of,
)
from memfit.measure.pipeline import own_pipeline, refuse_pipelined
from memfit.measure.profile import Profile, Progress
from memfit.measure.rank_layers import EXTRAPOLATE_FROM
from memfit.measure.rank_layers import refused as layered_refused
from memfit.measure.scope import Scope
from memfit.measure.step import OwnPasses
from memfit.measure.verify import Run, Verifier, rank_verifier, record_rank_on
from memfit.plan.budget import parse_budget
from memfit.plan.planner import Search, check_objective, make_plan, search
from memfit.plan.result import Plan
from memfit.recompute.checkpoint import applied_choices
from memfit.units import format_bytes
from memfit.workload import Where, Workload, asked_ranks

__all__ = ["plan_ranks", "min_world_size", "world_size_candidates", "WorldSizeFit"]


def plan_ranks(
    workload: Workload,
    budget: int | float | str,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] = (0,),
    objective: str = "time",
    progress: Progress | None = None,
    unplanned: RankProfiles | None = None,
    fake: bool | str | Where = True,
    afresh: bool = False,
    settings: AllocatorSettings | None = None,
    verify_min: bool = False,
) -> Plan:
    """Choose what to recompute so each of ``ranks`` of the distributed step peaks within
    ``budget`` (bytes per rank, or a fraction as for :func:`memfit.plan`, of the planned
    rank's figures). The planned rank is the one of ``ranks`` with the highest unplanned peak;
    under memfit's own pipeline parallelism (``parallel=pp``) every one of ``ranks`` is planned on
    its own stage step and the plan holds all their modules (:func:`_stage_plans`).

    Returns a :class:`Plan` whose :attr:`~Plan.rank_peak_bytes` holds each asked-for rank's
    verified peak: that rank profiled again on the fake group, the plan applied to the model
    before ``parallelize``. Apply it the same way: ``memfit.apply(model, plan)`` before
    ``fully_shard`` (or after: the same forwards) or before wrapping in DDP (a DDP-wrapped
    model takes it too: :func:`memfit.apply` unwraps). Nothing of the workload is changed.

    ``unplanned``: :func:`~memfit.measure.distributed.profile_ranks` of this workload at this world
    size, holding ``ranks``: the planned rank's recorded step is taken from it (the same ledger: tested).

    ``fake="cuda"``: each rank on fake CUDA (as :func:`~memfit.measure.distributed.profile_ranks`);
    the budget then bounds each rank's reserved peak (the caching-allocator model replaying
    every verified run, as :func:`memfit.plan` does on CUDA), and :attr:`~Plan.rank_peak_bytes`
    holds reserved peaks, judged under the allocator ``settings`` (default the process's).
    ``afresh=True`` profiles the planned rank afresh too (see :func:`_verified`). A budget in bytes:
    ``P_min`` is priced on the ledger unless the answer needs it run (:attr:`Search.price_min`;
    ``verify_min=True``: always run, as :func:`memfit.plan` does)."""
    started = time.perf_counter()
    spec = parse_budget(budget)
    check_objective(objective)
    n = _world_size(workload, world_size)
    if applied_choices(workload.model) is not None:
        raise PlanError("this model already has a plan applied; call memfit.remove(model) before planning again")
    ranks = list(dict.fromkeys(ranks))
    if not ranks:
        raise WorkloadError("ranks is empty: give the ranks to plan for, e.g. (0,)")
    device = rank_device(fake)
    for r in ranks:
        FakeGroup(n, r, device)  # a rank outside the world: refused before any work
    report = progress or (lambda desc, done, total: None)
    if unplanned is not None and (unplanned.world_size != n or not set(ranks) <= set(unplanned.profiles)):
        raise PlanError(f"unplanned holds ranks {sorted(unplanned.profiles)} of {unplanned.world_size}, not {ranks} of {n}")
    how = _How(spec, budget, objective, settings, verify_min, afresh, started)
    if own_pipeline(workload):
        return _stage_plans(workload, n, ranks, device, how, report, unplanned)
    planned_rank = ranks[0]
    if len(ranks) > 1:
        measured = unplanned or profile_ranks(workload, world_size=n, ranks=ranks, fake=fake)
        planned_rank = max(ranks, key=lambda r: (measured.profiles[r].budget_peak_bytes, -r))
    with ExitStack() as closing:
        verifier = rank_verifier(workload, FakeGroup(n, planned_rank, device))
        closing.callback(verifier.close)
        wrapped = _forwards_wrapped(workload.model, verifier.model)
        report(f"rank {planned_rank} of {n}: warm-up and recorded step", 0, 3)
        recorded = _checked_and_recorded(verifier, workload, unplanned.profiles[planned_rank] if unplanned else None)
        searched = _searched_on(verifier, recorded, workload, how, report)
    return _verified_plan(workload, searched, wrapped, FakeGroup(n, planned_rank, device), ranks, how, report)


def _stage_plans(
    workload: Workload, n: int, ranks: list[int], device: str, how: _How, report: Progress, unplanned: RankProfiles | None
) -> Plan:
    """:func:`plan_ranks` under memfit's own pipeline parallelism: each stage rank holds other
    modules, so each is planned on its own step (its modules the candidates, each call of one
    per microbatch counted where the schedule holds that microbatch: ``per_pass``), and the
    plan is the stage plans together (their modules are disjoint: each names its own stage's).
    Every rank is then profiled afresh with that plan applied before ``parallelize``, as it
    trains, and must peak within its own budget (a fraction is of each stage's own figures).
    ``unplanned`` is not read (see below): it was only checked to hold the ranks."""
    plans: dict[int, Plan] = {}
    settings: dict[int, AllocatorSettings | None] = {}
    for r in ranks:
        with ExitStack() as closing:
            verifier = rank_verifier(workload, FakeGroup(n, r, device))
            closing.callback(verifier.close)
            report(f"stage rank {r} of {n}: warm-up and recorded step", 0, 3)
            # The stateful check's second forward is a whole step here (a stage's forward is its
            # schedule's): the recorded step, even where ``unplanned`` holds the rank's already.
            recorded = _checked_and_recorded(verifier, workload, None)
            try:
                plans[r], _, _, settings[r] = _searched_on(verifier, recorded, workload, how, report)
            except BudgetInfeasibleError as exc:  # which stage cannot fit: its own modules are what it could recompute
                raise BudgetInfeasibleError(
                    f"stage rank {r} of {n}: {exc}", min_peak_bytes=exc.min_peak_bytes, budget_bytes=exc.budget_bytes
                ) from exc
    worst = max(ranks, key=lambda r: (plans[r].none_peak_bytes, -r))
    plan = dataclasses.replace(
        plans[worst],
        checkpointed={k: c for r in ranks for k, c in plans[r].checkpointed.items()},
        excluded={k: why for r in ranks for k, why in plans[r].excluded.items()},
        use_cache_off=tuple(dict.fromkeys(m for r in ranks for m in plans[r].use_cache_off)),
        min_peak_bytes=max(p.min_peak_bytes for p in plans.values()),
        min_peak_verified=all(p.min_peak_verified for p in plans.values()),
        # the stages run at once: the step waits for the stage that recomputes the most
        extra_compute_s=max((p.extra_compute_s for p in plans.values() if p.extra_compute_s is not None), default=None),
        extra_flops=max(p.extra_flops for p in plans.values()),
        rank_modules={r: tuple(plans[r].checkpointed) for r in ranks},
    )
    peaks, allocated = {}, {}
    for i, r in enumerate(ranks):
        report(f"stage rank {r} of {n}: verifying the plan", i, len(ranks))
        own = dataclasses.replace(plan, budget_bytes=plans[r].budget_bytes)
        got = _verified(workload, own, [FakeGroup(n, r, device)], r, lambda *a: None, settings=settings[r])
        peaks[r], allocated[r] = got[0][r], got[1][r]
    return _with_rank_figures(plan, n, peaks, allocated, how.started)


@dataclass(frozen=True)
class _How:
    """What :func:`plan_ranks` was asked, as its parts take it."""

    spec: Any
    budget: Any
    objective: str
    settings: AllocatorSettings | None
    verify_min: bool
    afresh: bool
    started: float


def _searched_on(
    verifier: Verifier,
    recorded: tuple[Profile, dict[str, str], tuple[str, ...]],
    workload: Workload,
    how: _How,
    report: Progress,
) -> tuple[Plan, Any, Profile, AllocatorSettings | None]:
    """The plan searched on an open verifier of the planned rank, checked and with its
    unplanned step ``recorded`` (:func:`_checked_and_recorded`): the plan, the search's
    answer, the unplanned profile it was made from, the settings its runs were judged under."""
    _resharded(verifier.model)
    excluded = dict(recorded[1])
    prof = recorded[0].under(how.settings)
    # on fake CUDA every verified run is replayed through the allocator model (reserved peaks)
    verifier.settings = prof.cuda_memory.settings if prof.cuda_memory is not None else None
    # a pipeline rank's step is its microbatches' passes (OwnPasses): modules called once a pass are candidates
    passes = isinstance(verifier.box.model, OwnPasses)
    found = search(
        Search(prof, verifier, workload.model, how.spec, how.objective, excluded, per_pass=passes, price_min=not how.verify_min), report
    )
    plan = make_plan(found, use_cache_off=recorded[2], budget=how.budget, started=how.started)
    return plan, found, prof, verifier.settings


def _verified_plan(
    workload: Workload, searched: tuple, wrapped: set[str], planned: FakeGroup, ranks: list[int], how: _How, report: Progress
) -> Plan:
    """The searched plan with each of ``ranks``' verified figure (the planned rank's group
    ``planned``; its verifier closed: each other rank opens a group of its own)."""
    plan, found, prof, settings = searched
    n, device = planned.world_size, planned.device
    # The planned rank's step has run with the plan already (the search's verified run, or the
    # unplanned step itself): profiling it afresh repeats that step (checked equal to the byte),
    # unless its parallelize wrapped a planned module's forward (:func:`_verified`).
    reordered = sorted(wrapped & set(plan.checkpointed))
    done = {} if how.afresh or reordered else {planned.rank: _run_peaks(found.run, prof)}
    groups = [FakeGroup(n, r, device) for r in ranks if r not in done]
    peaks, allocated = _verified(workload, plan, groups, planned.rank, report, done, settings, reordered)
    return _with_rank_figures(plan, n, {r: peaks[r] for r in ranks}, allocated, how.started)


def _with_rank_figures(plan: Plan, n: int, peaks: dict[int, int], allocated: dict[int, int], started: float) -> Plan:
    """``plan`` with each asked-for rank's verified peak, the highest as its predicted one."""
    plan.world_size = n
    plan.rank_peak_bytes = peaks
    plan.predicted_peak_bytes = max(peaks.values())
    if plan.allocated_peak_bytes is not None:  # fake CUDA: the reserved peaks' allocated beside
        plan.allocated_peak_bytes = max(allocated.values())
    plan.planning_time_s = time.perf_counter() - started
    return plan


def _checked_and_recorded(
    verifier: Verifier, workload: Workload, recorded: Profile | None, start_limit: int | None = None
) -> tuple[Profile, dict[str, str], tuple[str, ...]]:
    """The stateful check on the planned rank (:meth:`Verifier.stateful`: its first forward is
    the warm-up step, which makes the optimizer's state) and the rank's recorded step, unless
    ``recorded`` (an unplanned profile given) is it: the unplanned profile, the modules a
    recompute could not repeat, the modules whose KV cache goes off. The recorded step is the
    check's second forward (hooked as that forward would be: hooks that read attributes
    and allocate nothing), not a forward more. ``start_limit``: as :func:`profile_rank`'s
    (:class:`StartOverLimit` instead of the recorded step)."""
    if recorded is not None:
        return (recorded, *verifier.stateful())
    got: list[Profile] = []

    def second(scope: Scope) -> None:
        if start_limit is not None:  # as profile_rank's: the warm-up step has run, the recorded one not yet
            start = held_at_start(verifier.box, scope)
            if start > start_limit:
                raise StartOverLimit(box_rank(verifier.box)[1], start, start_limit)
        got.append(record_rank_on(verifier, workload, scope))

    stateful, use_cache_off = verifier.stateful(second=second)
    return got[0], stateful, use_cache_off


def _world_size(workload: Workload, world_size: int | None) -> int:
    """The world size :func:`plan_ranks` plans at (another's pipelined workload refused in one line)."""
    refuse_pipelined(workload, "plan", own_ok=True)
    return world_size_of(workload, world_size)


def _asked_ranks(ranks: Sequence[int] | str) -> Callable[[int], list[int]]:
    """The ranks to measure at each world size: ``"all"``, or integers (negative ones count
    from the last); the spelling checked once, before any work."""
    asked_ranks(ranks, None, from_last=True)
    return lambda n: asked_ranks(ranks, n, from_last=True)


def _forwards_wrapped(before: Any, after: Any) -> set[str]:
    """Modules whose instance-level ``forward`` parallelizing set or replaced (``before``: the
    workload's model, ``after``: the rank's parallelized one; names as plans give them)."""
    own = {name: m.__dict__.get("forward") for name, m in before.named_modules()}
    return {
        name
        for name, m in after.named_modules()
        if "forward" in m.__dict__ and (name not in own or own[name] is None or type(own[name]) is not type(m.__dict__["forward"]))
    }


def _resharded(model: Any) -> None:
    """FSDP2 modules resharded after the stateful check's second forward, which ran no
    backward: a module kept unsharded after forward (``reshard_after_forward=False``) would
    start the next step unsharded, all-gathering nothing, which no training step does (each
    backward reshards)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _run_peaks(run: Run, prof: Profile) -> tuple[int, int]:
    """(budget peak, tensor peak) of the run that verified a plan on the planned rank, as
    :func:`_verified` reads them off a fresh profile: the run's ledger (the unplanned
    profile's when the plan is empty)."""
    return run.peak_bytes, (run.ledger if run.ledger is not None else prof.ledger).peak_bytes


def _verified(
    workload: Workload,
    plan: Plan,
    groups: list[FakeGroup],
    planned_rank: int,
    report: Progress,
    done: dict[int, tuple[int, int]] | None = None,
    settings: AllocatorSettings | None = None,
    reordered: Sequence[str] = (),
) -> tuple[dict[int, int], dict[int, int]]:
    """Every rank of ``groups`` profiled afresh with the plan applied before parallelizing, as
    it trains, beside the ranks ``done`` already measured it: each rank's budget peak (fake CUDA:
    reserved) and tensor peak; refused in one line when one is over the budget. ``done`` holds
    the planned rank, from the run that verified the plan on its step (the plan applied to the
    parallelized model: the same ledger as applied before ``parallelize``, tested), unless
    ``plan_ranks(afresh=True)`` (a ``parallelize`` and two steps more, the same figures).

    ``reordered``: planned modules whose forward the parallelize wrapped (torchtitan's modules
    wrap theirs in a redistribution). Applied before parallelizing, as the user applies it, the
    plan's checkpoint runs inside that wrapper; applied to the parallelized model (the search's
    runs), around it (an all-gather then recomputed in backward): two different steps, of which
    the user's is the figure, so the planned rank is profiled afresh too."""
    peaks = {r: p for r, (p, _) in (done or {}).items()}
    allocated = {r: a for r, (_, a) in (done or {}).items()}
    for i, group in enumerate(groups):
        r = group.rank
        report(f"rank {r} of {group.world_size}: verifying the plan", i, len(groups))
        checked = profile_rank(planned(workload, plan), group).under(settings)  # as the planned rank was
        peaks[r], allocated[r] = checked.budget_peak_bytes, checked.peak_bytes
    over = {r: b for r, b in peaks.items() if b > plan.budget_bytes}
    if over:
        r = max(over, key=over.__getitem__)
        raise PlanError(
            f"the plan made on rank {planned_rank} peaks at {format_bytes(over[r])} on rank {r}, over the budget "
            f"{format_bytes(plan.budget_bytes)}: plan for rank {r} (ranks=({r},)) or give a lower budget"
            + (
                f" (the parallelize wraps the forward of {reordered[0]!r} and {len(reordered) - 1} more planned modules: the "
                "search ran their checkpoints around that wrapper, the training step runs them inside it)"
                if reordered
                else ""
            )
        )
    return peaks, allocated


def planned(workload: Workload, plan: Plan) -> Workload:
    """A copy of ``workload`` whose model (still on meta, unparallelized) has ``plan`` applied."""
    return with_recompute(workload, {k: (c.mode, c.save_ops) for k, c in plan.checkpointed.items()}, plan.use_cache_off)


@dataclass
class WorldSizeFit:
    """The smallest world size at which a distributed step fits a per-rank budget."""

    budget_bytes: int
    without_recompute: int | None
    """Smallest world size tried whose unplanned per-rank peak is within the budget; None: none."""
    with_recompute: int | None
    """Smallest world size tried at which memfit's plan fits; None: none."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Per world size tried: ``world_size``; ``budget_bytes`` (the budget there: less what a
    rank holds outside the allocator at that size, where that was given); ``ranks``: the ranks profiled (one per distinct
    parallelized layout) and ``worst_rank``; ``none_peak_bytes`` (unplanned, the worst rank's;
    each profiled rank's in ``rank_none_peak_bytes``),
    ``min_peak_bytes`` (lowest reachable with recompute; where a plan is made, priced on the
    ledger when its ``min_peak_verified`` is False), ``plan_peak_bytes``: None where not
    needed or not run; ``lower_bound_bytes`` and ``skipped`` where a bound showed, without
    running that step, that it cannot fit (``"profile"``: the ranks' parameters, buffers and
    inputs alone exceed the budget; ``"plan"``: the unplanned step's start does, those and
    the optimizer's state, which no recompute changes: counted after the warm-up step, when
    its recorded step is not run and ``none_peak_bytes`` is None, or the recorded step's)."""
    plan: Plan | None = None
    """The plan at :attr:`with_recompute` (empty when the step fits there without one)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "memfit.world_size_fit/1",
            "budget_bytes": self.budget_bytes,
            "without_recompute": self.without_recompute,
            "with_recompute": self.with_recompute,
            "rows": self.rows,
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }


class _Bounded(Exception):
    """A lower bound, read off the first rank's parallelized step, shows the size cannot fit."""


def _unplanned(
    workload: Workload,
    n: int,
    asked: list[int],
    budget: int,
    row: dict[str, Any],
    fake: bool | str | Where,
    states: dict[int, RankState] | None = None,
) -> RankProfiles | None:
    """The unplanned profiles at world size ``n`` of the ``asked`` ranks, one per layout (ranks
    of equal layouts take the same step; each rank's :func:`~memfit.measure.distributed.rank_state`
    says its layout); None where a lower bound shows the step cannot fit ``budget``, said in
    ``row`` (``skipped``, ``lower_bound_bytes``). The first rank's state is read off its own
    profile's parallelized step, before its warm-up (one ``parallelize`` less a size), unless
    ``states`` holds every asked rank's already (then ``row`` has its ranks)."""
    device = rank_device(fake)
    first = asked[0]
    if states is None:
        layered = _layered(workload, n, asked, budget, row, device)
        if not isinstance(layered, str):
            return layered[0]
        states = {r: rank_state(workload, FakeGroup(n, r, device)) for r in asked[1:]}
    given = first in states

    def judged(state: RankState) -> None:  # the first rank parallelized, no step run yet
        _judged(first, state, states, budget, row)

    try:
        # a rank holding more than the budget after its warm-up step (its parameters,
        # gradients and optimizer state, which no recompute changes) peaks over it with or
        # without a plan: its recorded step is not run (half its profile)
        hook = None if given else judged
        out = profile_ranks(workload, world_size=n, ranks=[first], fake=fake, start_limit=budget, on_state=hook)
        rest = [r for r in row["ranks"] if r != first]
        if rest:
            out.profiles.update(profile_ranks(workload, world_size=n, ranks=rest, fake=fake, start_limit=budget).profiles)
    except _Bounded:
        return None
    except StartOverLimit as over:
        row.update(lower_bound_bytes=over.start_bytes, skipped="plan")
        return None
    return out


def _judged(first: int, state: RankState, others: dict[int, RankState], budget: int, row: dict[str, Any]) -> None:
    """The size's ranks judged by their states (``state``: the first rank's): :class:`_Bounded`
    when one's parameters, buffers and inputs alone exceed ``budget``; else ``row``'s
    ``ranks``, one per layout."""
    every = {first: state, **{r: st for r, st in others.items() if r != first}}
    others[first] = state
    resident = max(st.resident_bytes for st in every.values())
    if resident > budget:
        row.update(lower_bound_bytes=resident, skipped="profile")
        raise _Bounded
    layouts: dict[tuple, int] = {}
    for r, st in every.items():
        layouts.setdefault(st.layout, r)
    row["ranks"] = list(layouts.values())


def _size(
    workload: Workload, n: int, asked: list[int], budget: int, row: dict[str, Any], fake: bool | str | Where
) -> tuple[RankProfiles | None, Plan | BudgetInfeasibleError | None]:
    """The unplanned profiles at world size ``n`` (as :func:`_unplanned`) and, where the step
    does not fit but may with recompute, :func:`plan_ranks`'s plan or why there is none.
    With one layout, the first rank's unplanned step is recorded on the verifier the plan
    then runs on (the stateful check's warm-up and second forward, as :func:`plan_ranks`
    records it): one ``parallelize`` and one warm-up step for both, not two."""
    if _pipelined(workload) or applied_choices(workload.model) is not None:
        # plan_ranks refuses these, after the unplanned profiles (which may fit: an answer)
        return _planned_apart(workload, n, asked, budget, row, fake, None)
    device = rank_device(fake)
    first = asked[0]
    # Not from fewer layers (:func:`_layered`): until a plan is found, a size is mostly one
    # that starts over the budget (the whole model's warm-up step alone tells, 8.4 CPU s on
    # Llama-3-8B, where the 4-, 5- and 6-layer steps take 10.5) or one that needs a plan, whose
    # candidates run on the whole model's step after its warm-up and recorded steps anyway.
    states = {r: rank_state(workload, FakeGroup(n, r, device)) for r in asked[1:]}
    how = _How(parse_budget(budget), budget, "time", None, False, False, time.perf_counter())
    with ExitStack() as closing:
        verifier = rank_verifier(workload, FakeGroup(n, first, device))
        closing.callback(verifier.close)
        wrapped = _forwards_wrapped(workload.model, verifier.model)
        try:
            _judged(first, box_state(verifier.box), states, budget, row)
        except _Bounded:
            return None, None
        if len(row["ranks"]) == 1:
            try:
                recorded = _checked_and_recorded(verifier, workload, None, start_limit=budget)
            except StartOverLimit as over:
                row.update(lower_bound_bytes=over.start_bytes, skipped="plan")
                return None, None
            measured = RankProfiles(n, workload.parallel.name, {first: recorded[0]})  # type: ignore[union-attr]
            if not _plan_needed(measured, budget, row):
                return measured, None
            try:
                searched = _searched_on(verifier, recorded, workload, how, lambda desc, done, total: None)
            except BudgetInfeasibleError as exc:
                return measured, exc
    if len(row["ranks"]) == 1:
        return measured, _verified_plan(workload, searched, wrapped, FakeGroup(n, first, device), [first], how, lambda *a: None)
    # uneven shards: each layout profiled on its own, the plan made for the worst (plan_ranks)
    return _planned_apart(workload, n, asked, budget, row, fake, states)


def _layered(
    workload: Workload, n: int, asked: list[int], budget: int, row: dict[str, Any], device: str
) -> tuple[RankProfiles | None, Profile | None] | str:
    """:func:`_unplanned`'s answer at world size ``n`` from steps of fewer layers
    (:func:`~memfit.measure.distributed.layered_rank`), where every asked rank holds the first
    one's shards and the first one's step is synthesized and checked: the profiles (None where
    a bound skips the size, said in ``row``) and, where a plan is needed, the first rank's
    unplanned profile; else why not (then the whole model's steps run)."""
    why = layered_refused(workload) if device != "cuda" else "fake CUDA (see layered_rank)"
    if why is not None:
        return why
    first = asked[0]
    small = dataclasses.replace(workload, model=workload.layers.rebuild(EXTRAPOLATE_FROM + 2), layers=None)  # type: ignore[union-attr]
    layouts = {rank_state(small, FakeGroup(n, r, device)).layout for r in asked}
    if len(layouts) > 1:
        return "the ranks hold different shards"
    got = layered_rank(workload, FakeGroup(n, first, device))
    if isinstance(got, str):
        return got
    row["ranks"] = [first]
    if got.resident_bytes > budget:
        row.update(lower_bound_bytes=got.resident_bytes, skipped="profile")
        return None, None
    try:
        prof = layered_profile(workload, FakeGroup(n, first, device), got, start_limit=budget)
    except StartOverLimit as over:
        row.update(lower_bound_bytes=over.start_bytes, skipped="plan")
        return None, None
    measured = RankProfiles(n, workload.parallel.name, {first: prof}, {first: None})  # type: ignore[union-attr]
    return measured, (prof if _plan_needed(measured, budget, dict(row)) else None)


def _pipelined(workload: Workload) -> bool:
    try:
        refuse_pipelined(workload, "plan")
    except PlanError:
        return True
    return False


def _planned_apart(
    workload: Workload,
    n: int,
    asked: list[int],
    budget: int,
    row: dict[str, Any],
    fake: bool | str | Where,
    states: dict[int, RankState] | None,
) -> tuple[RankProfiles | None, Plan | BudgetInfeasibleError | None]:
    """:func:`_size` as two steps: the unplanned profiles (:func:`_unplanned`), then, where
    needed, :func:`plan_ranks` from them on a verifier of its own."""
    measured = _unplanned(workload, n, asked, budget, row, fake, states)
    if measured is None or not _plan_needed(measured, budget, row):
        return measured, None
    try:
        return measured, plan_ranks(workload, budget, world_size=n, ranks=row["ranks"], unplanned=measured, fake=fake)
    except BudgetInfeasibleError as exc:
        return measured, exc


def _plan_needed(measured: RankProfiles, budget: int, row: dict[str, Any]) -> bool:
    """Whether the unplanned step over ``budget`` may fit with a plan: not where it fits, nor
    where it starts over the budget (said in ``row``: no recompute changes its start)."""
    if measured.budget_peak_bytes <= budget:
        return False
    start = max(p.ledger.start_bytes for p in measured.profiles.values())
    if start > budget:
        row.update(lower_bound_bytes=start, skipped="plan")
        return False
    return True


def world_size_candidates(
    workload: Workload,
    *,
    world_sizes: Sequence[int] | None = None,
    node_size: int | None = None,
    max_world_size: int = 1024,
) -> list[int]:
    """The world sizes :func:`min_world_size` tries, ascending: ``world_sizes`` as given (each
    must suit the workload's mesh), else the multiples of ``node_size`` (a node's GPUs)
    up to ``max_world_size``, else the powers of two up to it; generated sizes the mesh
    refuses are left out."""
    for name, v in (("max_world_size", max_world_size), ("node_size", node_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise WorkloadError(f"{name} must be a positive integer, got {v!r}")
    if world_sizes is not None:
        sizes = list(world_sizes)
        bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n < 1]
        if bad or not sizes:
            raise WorkloadError(f"world_sizes must be positive integers (8, 16, 24), got {bad[0] if bad else 'none'}")
        for n in sizes:
            world_size_of(workload, n)  # a size the mesh refuses: said now, before any work
        return sorted(set(sizes))
    if node_size is not None:
        sizes = list(range(node_size, max_world_size + 1, node_size))
        if not sizes:
            raise WorkloadError(f"no multiple of {node_size} is at most max_world_size {max_world_size}")
    else:
        sizes = [2**k for k in range(max_world_size.bit_length())]
    out = []
    for n in sizes:
        try:
            world_size_of(workload, n)
        except WorkloadError:
            continue
        out.append(n)
    if not out:
        world_size_of(workload, sizes[0])  # none suits the mesh: the first one's reason
    return out


def min_world_size(
    workload: Workload,
    budget: int | str,
    *,
    world_sizes: Sequence[int] | None = None,
    node_size: int | None = None,
    max_world_size: int = 1024,
    ranks: Sequence[int] | str = (0, -1),
    progress: Progress | None = None,
    fake: bool | str | Where = True,
    outside: Callable[[int], int] | None = None,
) -> WorldSizeFit:
    """The smallest world size at which every one of ``ranks`` of the step peaks within
    ``budget`` bytes per rank: without recompute (the unplanned profile) and with memfit's plan
    (:func:`plan_ranks`, verified per rank). A rank's batch stays the workload's: more ranks
    shrink its share of parameters, gradients and optimizer state, not its activations.

    Sizes tried (:func:`world_size_candidates`): ``world_sizes`` as given (any size the mesh
    allows: FSDP2 shards unevenly), else multiples of ``node_size``, else powers of two, up
    to ``max_world_size``; every candidate, in ascending order, until the unplanned step fits
    (a per-rank peak need not fall as ranks are added: uneven shards pad collective buffers,
    so no size is skipped by interpolating between others). ``ranks``: negative ones count
    from the last (default: the first and the last rank, which hold the most and the least
    with uneven shards), or ``"all"`` (each rank parallelized: a few seconds a rank at 70B). At each size every such rank is parallelized (no step) and ranks
    whose parameters and buffers have the same local shapes are profiled once, as one: their
    steps are the same. The answer is the worst rank's.

    Work is skipped only where a lower bound proves the step cannot fit: a rank's
    parameters, buffers and inputs (alive at its step's start, with or without a plan) over
    the budget skip that size's profile and plan; what a rank holds after its warm-up step
    (those plus the optimizer state, which no recompute changes) over the budget skips its
    recorded step and the plan. The
    plan reuses the unplanned profile of the rank it is made for. ``fake="cuda"``: on fake CUDA,
    every peak judged the budget's way there (reserved; :func:`plan_ranks`). ``outside(n)``: bytes a
    rank holds outside the allocator at world size ``n`` (NCCL's buffers, whose communicators
    grow with it), taken off the budget at that size (each row's ``budget_bytes``)."""
    spec = parse_budget(budget)
    if spec.fraction is not None:
        raise PlanError(f"how many ranks needs a budget in bytes per rank ('40GiB'), not a fraction ({budget!r})")
    # more ranks make more pipeline stages, each another split of the model: not this search's question
    refuse_pipelined(workload, "--min-world-size")
    sizes = world_size_candidates(workload, world_sizes=world_sizes, node_size=node_size, max_world_size=max_world_size)
    asked_at = _asked_ranks(ranks)
    report = progress or (lambda desc, done, total: None)
    out = WorldSizeFit(spec.bytes, None, None)
    for i, n in enumerate(sizes):
        report(f"world size {n}", i, len(sizes))
        budget_n = spec.bytes - (outside(n) if outside is not None else 0)
        row: dict[str, Any] = {"world_size": n, "budget_bytes": budget_n, "ranks": [], "worst_rank": None}
        row.update(none_peak_bytes=None, min_peak_bytes=None, plan_peak_bytes=None, lower_bound_bytes=None, skipped=None)
        out.rows.append(row)
        if out.with_recompute is None:
            measured, p = _size(workload, n, asked_at(n), budget_n, row, fake)
        else:
            measured, p = _unplanned(workload, n, asked_at(n), budget_n, row, fake), None
        if measured is None:
            continue
        none = measured.budget_peak_bytes
        row.update(worst_rank=measured.worst_rank, none_peak_bytes=none)
        row["rank_none_peak_bytes"] = {r: p.budget_peak_bytes for r, p in measured.profiles.items()}
        if none <= budget_n:
            out.without_recompute = n
            if out.with_recompute is None:
                out.with_recompute = n
            break
        if isinstance(p, BudgetInfeasibleError):
            row["min_peak_bytes"] = p.min_peak_bytes
        elif p is not None:
            row.update(min_peak_bytes=p.min_peak_bytes, min_peak_verified=p.min_peak_verified, plan_peak_bytes=p.predicted_peak_bytes)
            out.with_recompute, out.plan = n, p
    return out
