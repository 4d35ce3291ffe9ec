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

:func:`min_world_size` answers "how many ranks": the smallest power of two at which the
step fits a per-rank budget, without recompute and with memfit's plan.

Policy only: the process group is what :mod:`memfit.measure.distributed` is given.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from memfit.apply.checkpoint import applied_choices, apply_choices
from memfit.errors import BudgetInfeasibleError, PlanError, WorkloadError
from memfit.measure.distributed import (
    FakeGroup,
    profile_rank,
    profile_ranks,
    rank_sandbox,
    record_rank,
    world_size_of,
)
from memfit.measure.profile import Progress
from memfit.measure.scope import Scope
from memfit.plan.budget import parse_budget
from memfit.plan.planner import Search, Verifier, check_objective, make_plan, search
from memfit.plan.result import Plan
from memfit.units import format_bytes
from memfit.workload import Workload

__all__ = ["plan_ranks", "min_world_size", "WorldSizeFit"]


def plan_ranks(
    workload: Workload,
    budget: int | float | str,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] = (0,),
    objective: str = "time",
    progress: Progress | None = None,
) -> Plan:
    """Choose what to recompute so each of ``ranks`` of the distributed step peaks within
    ``budget`` (bytes per rank, or a fraction as for :func:`memfit.plan`, of the planned
    rank's figures). The planned rank is the one of ``ranks`` with the highest unplanned
    peak (profiled first when more than one is asked for).

    Returns a :class:`Plan` whose :attr:`~Plan.rank_peak_bytes` holds each asked-for rank's
    verified peak: that rank profiled again on the fake group, the plan applied to the model
    before ``parallelize``. Apply it the same way: ``memfit.apply(model, plan)`` before
    ``fully_shard`` (or after: the same forwards) or before wrapping in DDP (a DDP-wrapped
    model takes it too: :func:`memfit.apply` unwraps). Nothing of the workload is changed."""
    started = time.perf_counter()
    spec = parse_budget(budget)
    check_objective(objective)
    n = world_size_of(workload, world_size)
    if applied_choices(workload.model) is not None:
        raise PlanError("this model already has a plan applied; call memfit.remove(model) before planning again")
    ranks = list(dict.fromkeys(ranks))
    if not ranks:
        raise WorkloadError("ranks is empty: give the ranks to plan for, e.g. (0,)")
    for r in ranks:
        FakeGroup(n, r)  # a rank outside the world: refused before any work
    report = progress or (lambda desc, done, total: None)
    planned_rank = ranks[0]
    if len(ranks) > 1:
        planned_rank = profile_ranks(workload, world_size=n, ranks=ranks).worst_rank
    excluded: dict[str, str] = {}
    with ExitStack() as closing:
        verifier = Verifier(rank_sandbox(workload, FakeGroup(n, planned_rank)), workload.loss_fn)
        closing.callback(verifier.close)
        # The first forward of the check is the warm-up step (the optimizer's state).
        stateful, use_cache_off = verifier.stateful()
        excluded.update(stateful)
        report(f"rank {planned_rank} of {n}: recorded step", 0, 3)
        with Scope(verifier.model) as scope:
            prof = record_rank(workload, verifier.box, scope)
        found = search(Search(prof, verifier, workload.model, spec, objective, excluded), report)
        plan = make_plan(found, use_cache_off=use_cache_off, budget=budget, started=started)
    # Every asked-for rank, profiled afresh with the plan applied before parallelizing, as it trains.
    peaks = {}
    for i, r in enumerate(ranks):
        report(f"rank {r} of {n}: verifying the plan", i, len(ranks))
        peaks[r] = profile_rank(planned(workload, plan), FakeGroup(n, r)).peak_bytes
    over = {r: b for r, b in peaks.items() if b > plan.budget_bytes}
    if over:
        r = max(over, key=over.__getitem__)
        raise PlanError(
            f"the plan made on rank {planned_rank} peaks at {format_bytes(over[r])} on rank {r}, over the budget "
            f"{format_bytes(plan.budget_bytes)}: plan for rank {r} (ranks=({r},)) or give a lower budget"
        )
    plan.world_size = n
    plan.rank_peak_bytes = peaks
    plan.predicted_peak_bytes = max(peaks.values())
    plan.planning_time_s = time.perf_counter() - started
    return plan


def planned(workload: Workload, plan: Plan) -> Workload:
    """A copy of ``workload`` whose model (still on meta, unparallelized) has ``plan`` applied."""
    model = copy.deepcopy(workload.model)
    apply_choices(model, {k: (c.mode, c.save_ops) for k, c in plan.checkpointed.items()}, plan.use_cache_off)
    return dataclasses.replace(workload, model=model)


@dataclass
class WorldSizeFit:
    """The smallest world size at which a distributed step fits a per-rank budget."""

    budget_bytes: int
    without_recompute: int | None
    """Smallest world size tried whose unplanned per-rank peak is within the budget; None: none."""
    with_recompute: int | None
    """Smallest world size tried at which memfit's plan fits; None: none."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Per world size tried: ``world_size``, ``none_peak_bytes`` (unplanned), ``min_peak_bytes``
    (lowest reachable with recompute; None where not needed), ``plan_peak_bytes``."""
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


def min_world_size(
    workload: Workload,
    budget: int | str,
    *,
    max_world_size: int = 1024,
    ranks: Sequence[int] = (0,),
    progress: Progress | None = None,
) -> WorldSizeFit:
    """The smallest world size (1, 2, 4, ... up to ``max_world_size``) at which each of
    ``ranks`` of the step peaks within ``budget`` bytes per rank: without recompute (the
    unplanned profile) and with memfit's plan (:func:`plan_ranks`, verified per rank). A
    rank's batch stays the workload's: more ranks shrink its share of parameters, gradients
    and optimizer state, not its activations."""
    spec = parse_budget(budget)
    if spec.fraction is not None:
        raise PlanError(f"how many ranks needs a budget in bytes per rank ('40GiB'), not a fraction ({budget!r})")
    if isinstance(max_world_size, bool) or not isinstance(max_world_size, int) or max_world_size < 1:
        raise WorkloadError(f"max_world_size must be a positive integer, got {max_world_size!r}")
    report = progress or (lambda desc, done, total: None)
    out = WorldSizeFit(spec.bytes, None, None)
    sizes = [2**k for k in range(max_world_size.bit_length()) if 2**k <= max_world_size]
    for i, n in enumerate(sizes):
        report(f"world size {n}", i, len(sizes))
        usable = [r for r in ranks if r < n] or [0]
        none = profile_ranks(workload, world_size=n, ranks=usable).peak_bytes
        row: dict[str, Any] = {"world_size": n, "none_peak_bytes": none, "min_peak_bytes": None, "plan_peak_bytes": None}
        out.rows.append(row)
        if none <= spec.bytes:
            out.without_recompute = n
            if out.with_recompute is None:
                out.with_recompute = n
            break
        if out.with_recompute is None:
            try:
                p = plan_ranks(workload, spec.bytes, world_size=n, ranks=usable)
            except BudgetInfeasibleError as exc:
                row["min_peak_bytes"] = exc.min_peak_bytes
                continue
            row["min_peak_bytes"], row["plan_peak_bytes"] = p.min_peak_bytes, p.predicted_peak_bytes
            out.with_recompute, out.plan = n, p
    return out
