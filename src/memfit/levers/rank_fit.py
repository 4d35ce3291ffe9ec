"""``fit`` and ``max_batch`` per rank of a distributed (FSDP2) step, on the fake process group.

:func:`fit_ranks` weighs, for one rank's step, the levers that leave what training computes
as it was: recompute (:func:`memfit.plan.distributed.plan_ranks`) and FSDP2's
``reshard_after_forward`` (``False`` keeps a module's unsharded parameters from its forward
to its backward: one all-gather fewer per step, for the memory of those parameters); and,
only when allowed, the reduce dtype of FSDP's ``MixedPrecisionPolicy`` (bfloat16
reduce-scatters: other numerics).

``reshard_after_forward`` settings are ordered by the memory they hold: 0, every module
reshards; 1, the root keeps its parameters (torch's own default for the root: backward
all-gathers them again at once); ``1 + k``, the root and the last ``k`` blocks (torchtitan
keeps the last block so). Peaks grow with the setting, so the largest setting that fits
without recompute is searched for (a guess on the line through the ends, galloped and
bisected), each probe an exact fake-group profile. Where the
step as it is is over the budget, recompute is planned (and verified per rank) at the most
kept whose unplanned peak is no higher than the workload's own setting's (bisected alike);
and, unless every block fits kept, with every block kept.

Peaks are never predicted: each is an exact fake-tensor profile of that rank's step, or a
plan verified by running it. Step times are: fake tensors run no kernel, so each
candidate's time is the cost model's (FLOPs, bytes and op count at the device's round
rates, :class:`~memfit.plan.candidates.DeviceRates`, as ``fit`` on fake CUDA) plus its
plan's recompute share plus its collectives' bytes at a nominal link rate
(:data:`LINK_BYTES_PER_S`, none of it hidden behind compute: an upper bound on what
communication adds). The fastest predicted wins; ties go to fewer levers.

:func:`max_batch_ranks`: the largest per-rank batch whose rank step fits a per-rank budget,
with and without recompute (the single-device search of :mod:`memfit.levers.max_batch` with
per-rank peaks), then :func:`fit_ranks` at that batch for its recipe.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.cuda.allocator import AllocatorSettings
from memfit.errors import BudgetInfeasibleError, PlanError, WorkloadError
from memfit.levers.catalog.base import Reason, Why
from memfit.levers.catalog.base import opt_in as opt_in_reason
from memfit.levers.fit import fit_budget
from memfit.levers.max_batch import BatchLimit, MaxBatch, _largest, largest_of
from memfit.levers.recipe import RANK_LEVERS, RankRecipe, WhatIf, describe_reshards
from memfit.levers.ties import Candidate, choose, infeasible, what_if_order
from memfit.measure.distributed import FSDP2, FakeGroup, RankProfiles, profile_ranks, rank_device, world_size_of
from memfit.measure.ledger import Category, Ledger
from memfit.measure.pipeline import own_pipeline, refuse_pipelined
from memfit.measure.profile import Progress, allocator_settings_from_env
from memfit.plan.candidates import DeviceRates
from memfit.plan.distributed import plan_ranks
from memfit.plan.result import Plan
from memfit.units import format_bytes
from memfit.workload import Where, Workload, batch_size_of, resize_batch, resize_targets, split_inputs

__all__ = ["fit_ranks", "max_batch_ranks", "RankRecipe", "RANK_LEVERS", "parse_rank_allow", "LINK_BYTES_PER_S"]

OPT_IN_RANK_LEVERS = ("reduce_bf16",)
EXACT_RANK_LEVERS = ("recompute", "reshard_after_forward", "expandable_segments")

LINK_BYTES_PER_S = {"cuda": 100e9, "cpu": 5e9}
"""Nominal bytes per second each rank sends in a ring collective: NVLink-class GPUs (NCCL's
bus bandwidth within a node is 100-400 GB/s), and gloo on a CPU host. Round figures, not
measured: they rank all-gathers saved against recompute added."""


def parse_rank_allow(allow: str | Iterable[str] | None) -> set[str]:
    """Opt-in lever names for :func:`fit_ranks`; any other name raises PlanError in one line."""
    if allow is None:
        return set()
    items = allow.split(",") if isinstance(allow, str) else list(allow)
    names = {str(a).strip() for a in items if str(a).strip()}
    for name in sorted(names):
        if name not in OPT_IN_RANK_LEVERS:
            raise PlanError(
                f"--allow {name}: a per-rank fit weighs recompute and reshard_after_forward always, and opts in to "
                f"{', '.join(OPT_IN_RANK_LEVERS)} only (amp, bf16, foreach and 8bit are weighed by fit on one device, "
                "not per rank yet)"
            )
    return names


# -- the settings weighed ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Setting:
    """One FSDP2 configuration: ``keep`` is the index in the family of the module docstring
    (None: the workload's own reshard_after_forward), ``reduce_bf16`` the opt-in dtype."""

    keep: int | None = None
    reduce_bf16: bool = False
    expandable: bool = False
    """Judged under ``expandable_segments:True`` (fake CUDA): the same tensors, other segments."""


def _fsdp_of(workload: Workload) -> FSDP2 | None:
    parallel = workload.parallel
    return parallel.parallelize if parallel is not None and isinstance(parallel.parallelize, FSDP2) else None


def _variant(fsdp: FSDP2, s: _Setting) -> FSDP2:
    out = fsdp
    if s.keep is not None:
        out = dataclasses.replace(
            out, reshard_after_forward=True, root_reshard_after_forward=s.keep == 0, keep_last=max(0, s.keep - 1)
        )
    if s.reduce_bf16:
        out = dataclasses.replace(out, reduce_dtype=torch.bfloat16)
    return out


def _with_fsdp(workload: Workload, fsdp: FSDP2) -> Workload:
    assert workload.parallel is not None
    return dataclasses.replace(workload, parallel=dataclasses.replace(workload.parallel, parallelize=fsdp))


def _reduce_dtype(fsdp: FSDP2) -> torch.dtype:
    """The dtype FSDP reduce-scatters gradients in: the reduce dtype, else the parameters'
    compute dtype, else float32 (memfit's zoo models train in it)."""
    return fsdp.reduce_dtype or fsdp.param_dtype or torch.float32


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _block_names(workload: Workload, fsdp: FSDP2) -> list[str]:
    names = {id(m): n for n, m in workload.model.named_modules()}
    try:
        blocks = list(fsdp.blocks(workload.model))
    except Exception as exc:
        raise WorkloadError(f"fsdp2: blocks(model) raised {type(exc).__name__}: {str(exc)[:200]}") from exc
    missing = [b for b in blocks if id(b) not in names]
    if missing:
        raise WorkloadError(f"fsdp2: blocks(model) returned a {type(missing[0]).__name__} that is not a module of the model")
    return [names[id(b)] for b in blocks]


def _reshards(fsdp: FSDP2, n_blocks: int) -> tuple[bool, tuple[bool, ...]]:
    """(root, blocks) reshard_after_forward: what the all-gathers depend on."""
    return fsdp.root_reshards, tuple(fsdp.block_reshards(n_blocks))


def _describe_reshards(fsdp: FSDP2, n_blocks: int) -> str:
    root, blocks = _reshards(fsdp, n_blocks)
    return describe_reshards(root, blocks)


# -- the search ------------------------------------------------------------------------------------


class _RankSearch:
    """Exact per-rank peaks, plans and predicted times of FSDP2 settings, each made once."""

    def __init__(
        self,
        workload: Workload,
        fsdp: FSDP2 | None,
        world_size: int,
        ranks: Sequence[int],
        budget: int,
        report: Progress,
        where: Where,
    ) -> None:
        self.workload = workload
        self.where = where
        # on fake CUDA the budget bounds reserved peaks, judged under the process's allocator settings
        self.settings = allocator_settings_from_env() if where is Where.FAKE_CUDA else None
        self.fsdp = fsdp
        self.n = world_size
        self.ranks = list(ranks)
        self.budget = budget
        self.report = report
        self.blocks = _block_names(workload, fsdp) if fsdp is not None else []
        self.profiles: dict[_Setting, RankProfiles] = {}
        self.plans: dict[_Setting, Plan | int] = {}
        self.rates: DeviceRates | None = None

    @property
    def top(self) -> int:
        """The family's last setting: the root and every block keep their parameters."""
        return 1 + len(self.blocks)

    def fsdp_at(self, s: _Setting) -> FSDP2 | None:
        return _variant(self.fsdp, s) if self.fsdp is not None else None

    def canon(self, s: _Setting) -> _Setting:
        """``s``, or the workload's own setting when ``s`` is the same FSDP2 configuration
        (a family member the workload already uses is weighed once)."""
        if s.keep is None or self.fsdp is None:
            return s
        own = _Setting(None, s.reduce_bf16, s.expandable)
        mine, theirs = self.fsdp_at(s), self.fsdp_at(own)
        assert mine is not None and theirs is not None
        same = _reshards(mine, len(self.blocks)) == _reshards(theirs, len(self.blocks))
        return own if same and mine.reduce_dtype == theirs.reduce_dtype else s

    def work(self, s: _Setting) -> Workload:
        fsdp = self.fsdp_at(s)
        return self.workload if fsdp is None or fsdp == self.fsdp else _with_fsdp(self.workload, fsdp)

    def label(self, s: _Setting, plan: Plan | None = None) -> str:
        words = ["as it is" if s.keep is None or self.fsdp is None else _describe_reshards(self.fsdp_at(s), len(self.blocks))]
        if s.reduce_bf16:
            words.append("reduce in bfloat16")
        if s.expandable:
            words.append("expandable segments")
        if plan is not None and plan.checkpointed:
            words.append(f"recompute ({len(plan.checkpointed)} modules)")
        return " + ".join(words)

    def levers(self, s: _Setting, plan: Plan | None) -> tuple[str, ...]:
        used = set()
        if plan is not None and plan.checkpointed:
            used.add("recompute")
        if self.fsdp is not None and _reshards(self.fsdp_at(s), len(self.blocks)) != _reshards(self.fsdp, len(self.blocks)):
            used.add("reshard_after_forward")
        if s.reduce_bf16:
            used.add("reduce_bf16")
        if s.expandable:
            used.add("expandable_segments")
        return tuple(lever for lever in RANK_LEVERS if lever in used)

    @property
    def expandable_settings(self) -> AllocatorSettings:
        assert self.settings is not None
        return dataclasses.replace(self.settings, expandable_segments=True)

    def profiled(self, s: _Setting) -> RankProfiles:
        s = self.canon(s)
        if s not in self.profiles:
            if s.expandable:  # the same ranks' ledgers, replayed: no step runs
                self.profiles[s] = self.profiled(dataclasses.replace(s, expandable=False)).under(self.expandable_settings)
            else:
                self.report(f"rank step: {self.label(s)}", 0, 0)
                self.profiles[s] = profile_ranks(self.work(s), world_size=self.n, ranks=self.ranks, fake=self.where)
        return self.profiles[s]

    def peak(self, s: _Setting) -> int:
        """The peak the budget bounds: on fake CUDA each rank's reserved peak, else its tensor peak."""
        return self.profiled(s).budget_peak_bytes

    def planned(self, s: _Setting) -> Plan | int:
        """A plan at the budget for setting ``s`` (verified on every rank), or the lowest peak recompute reaches."""
        s = self.canon(s)
        if s not in self.plans:
            self.report(f"recompute plan: {self.label(s)}", 0, 0)
            settings = self.expandable_settings if s.expandable else None
            try:
                self.plans[s] = plan_ranks(
                    self.work(s), self.budget, world_size=self.n, ranks=self.ranks, fake=self.where, settings=settings
                )
            except BudgetInfeasibleError as exc:
                self.plans[s] = exc.min_peak_bytes
        return self.plans[s]

    def all_gathers(self, s: _Setting) -> int:
        ledger = self.profiled(s).profiles[self.profiled(s).worst_rank].ledger
        return sum(1 for b in ledger.blocks if b.category is Category.ALL_GATHER and b.born >= 0)

    def seconds(self, s: _Setting, plan: Plan | None) -> float:
        """Predicted step time (module docstring): compute + recompute + collectives."""
        prof = self.profiled(s).profiles[self.profiled(s).worst_rank]
        if self.rates is None:
            self.rates = DeviceRates.for_device(prof.device)
        ledger = prof.ledger
        nbytes = sum(b.nbytes for b in ledger.blocks if b.born >= 0)
        compute = self.rates.estimate(prof.step_flops, nbytes, 3 * len(ledger.ops))
        recompute = compute * plan.extra_flops / max(1, prof.step_flops) if plan is not None else 0.0
        link = LINK_BYTES_PER_S["cuda" if "cuda" in prof.device else "cpu"]
        return compute + recompute + collective_bytes(ledger, self.n) / link

    def candidate(self, s: _Setting, plan: Plan | None = None) -> Candidate[_Setting]:
        s = self.canon(s)
        peak = max(plan.rank_peak_bytes.values()) if plan is not None and plan.rank_peak_bytes else self.peak(s)
        return Candidate(s, plan, peak, self.seconds(s, plan), self.levers(s, plan))

    def largest_within(self, variant: _Setting, bound: int) -> int | None:
        """The largest family setting whose step peaks within ``bound`` without recompute
        (None: not even 0). Peaks grow with the setting, nearly by a block's parameters a
        block: a guess on the line through the two ends, galloped from to a bracket, then
        bisected; each probe an exact profile."""

        def peak(i: int) -> int:
            return self.peak(dataclasses.replace(variant, keep=i))

        if peak(self.top) <= bound:
            return self.top
        if peak(0) > bound:
            return None
        lo, hi = 0, self.top  # lo fits, hi does not
        guess = lo + int((bound - peak(lo)) / max(1, peak(hi) - peak(lo)) * (hi - lo))
        guess, step = min(max(guess, lo), hi - 1), 1
        if peak(guess) <= bound:
            lo = guess
            while lo + step < hi and peak(lo + step) <= bound:
                lo, step = lo + step, step * 2
            hi = min(hi, lo + step)
        else:
            hi = guess
            while hi - step > lo and peak(hi - step) > bound:
                hi, step = hi - step, step * 2
            lo = max(lo, hi - step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(mid) <= bound:
                lo = mid
            else:
                hi = mid
        return lo


def collective_bytes(ledger: Ledger, world_size: int) -> float:
    """Bytes one rank sends in the step's collectives, in a ring: ``(n - 1) / n`` of each
    all-gather's output and each reduce-scatter's input (FSDP's buffers in the ledger)."""
    moved = sum(b.nbytes for b in ledger.blocks if b.born >= 0 and b.category in (Category.ALL_GATHER, Category.REDUCE_SCATTER))
    return moved * (world_size - 1) / world_size


def _check_allowed(workload: Workload, allowed: set[str]) -> None:
    """Refuse, in one line, an opt-in lever this workload cannot use."""
    if "reduce_bf16" not in allowed:
        return
    fsdp = _fsdp_of(workload)
    if fsdp is None:
        scheme = workload.parallel.name if workload.parallel is not None else workload.name
        raise PlanError(
            f"--allow reduce_bf16: {scheme}'s parallelize is not memfit's FSDP2 (memfit.measure.distributed.fsdp2), "
            "so fit cannot set its reduce dtype; build the workload's Parallel with fsdp2(...) or drop the lever"
        )
    if _reduce_dtype(fsdp) == torch.bfloat16:
        raise PlanError(
            "--allow reduce_bf16: this FSDP2 already reduce-scatters in bfloat16 "
            f"(reduce_dtype={_dtype_name(fsdp.reduce_dtype)}, param_dtype={_dtype_name(fsdp.param_dtype)}); drop the lever"
        )


def _unused(best: Candidate[_Setting]) -> dict[str, Reason]:
    """Why each per-rank lever the chosen configuration does not use was not chosen."""
    return {
        "recompute": Reason(Why.NOT_NEEDED, "not needed: the chosen configuration fits without it"),
        "reshard_after_forward": Reason(
            Why.NOT_CHOSEN,
            "keeping more parameters unsharded from forward to backward does not fit the budget"
            if best.plan is None
            else "the chosen recipe is predicted faster (the settings weighed are the what-if rows)",
        ),
    }


def fit_ranks(
    workload: Workload,
    budget: int | str,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] = (0,),
    allow: str | Iterable[str] | None = None,
    exclude: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    fake: bool | str | Where = True,
) -> RankRecipe:
    """The fastest (predicted) configuration of each rank of ``workload``'s distributed step
    whose peak fits ``budget`` bytes per rank: recompute, FSDP2's reshard_after_forward and,
    with ``allow="reduce_bf16"``, a bfloat16 reduce dtype (module docstring). ``exclude``:
    exact levers the training script cannot use (``"recompute"``, ``"reshard_after_forward"``,
    ``"expandable_segments"``), each with the reason ``left_out`` then gives. The workload's
    model, its parallelize and the process group are left as they were.

    ``fake``: ``True`` (or ``"cpu"``) runs each rank on fake CPU tensors; ``"cuda"`` on fake
    CUDA, where the budget bounds each rank's reserved peak (the caching-allocator model, as
    :func:`~memfit.plan.distributed.plan_ranks`) and ``expandable_segments`` is a lever too
    (each rank's ledger replayed under it: the same tensors, other segments).

    The ``reshard_after_forward`` lever needs the workload's parallelize to be memfit's
    FSDP2 (:func:`memfit.measure.distributed.fsdp2`), whose arguments are data fit can vary;
    with another, recompute alone is weighed (``left_out`` says so).

    Raises:
        BudgetInfeasibleError: nothing weighed fits; the message states the lowest peak reached.
        PlanError: an ``allow`` name that is not an opt-in lever here, or one this workload cannot use.
    """
    refuse_pipelined(workload, "fit", own_ok=True)
    started = time.perf_counter()
    target = fit_budget(budget)
    allowed = parse_rank_allow(allow)
    n = world_size_of(workload, world_size)
    ranks = list(dict.fromkeys(ranks))
    if not ranks:
        raise WorkloadError("ranks is empty: give the ranks to fit, e.g. (0,)")
    where = Where.of(fake)
    device = rank_device(where)
    for r in ranks:
        FakeGroup(n, r, device)  # a rank outside the world: refused before any work
    report = progress or (lambda desc, done, total: None)
    # reduce_bf16 varies the workload's FSDP2 even where its reshard settings are held fixed
    search = _RankSearch(workload, _fsdp_of(workload), n, ranks, target, report, where)
    left_out, family = _left_out(workload, search, allowed, exclude)
    weighing = _Weighing(search, family, recompute="recompute" not in left_out)
    for reduce in [False] + ([True] if "reduce_bf16" in allowed else []):
        bound = weighing.variant(_Setting(None, reduce))
        if "expandable_segments" not in left_out and bound:
            # the budget bound the variant: the same steps under other segments may keep more
            weighing.variant(_Setting(None, reduce, expandable=True))
    if not weighing.cands:
        raise _infeasible(search, weighing, allowed, left_out)
    best = choose(weighing.unique(), _simpler)
    for lever, why in _unused(best).items():
        if lever not in best.levers and lever not in left_out:
            left_out[lever] = why
    recipe = _rank_recipe(search, weighing, best, left_out)
    recipe.budget, recipe.fit_time_s = str(budget), time.perf_counter() - started
    return recipe


def _left_out(
    workload: Workload, search: _RankSearch, allowed: set[str], exclude: Mapping[str, str] | None
) -> tuple[dict[str, Reason], bool]:
    """Why each per-rank lever is not weighed here (the caller's exclusions first), and whether
    the reshard_after_forward family is searched (the workload's parallelize is memfit's FSDP2)."""
    assert workload.parallel is not None  # world_size_of refuses a workload without one
    scheme = workload.parallel.name
    left_out: dict[str, Reason] = {lever: Reason(Why.EXCLUDED, why) for lever, why in (exclude or {}).items()}
    unknown = sorted(set(left_out) - set(EXACT_RANK_LEVERS))
    if unknown:
        raise PlanError(
            f"fit per rank can exclude the levers {', '.join(map(repr, EXACT_RANK_LEVERS))}, not {', '.join(map(repr, unknown))}"
        )
    fsdp = search.fsdp
    if "reshard_after_forward" not in left_out and fsdp is None:
        left_out["reshard_after_forward"] = Reason(
            Why.NOT_APPLICABLE,
            f"{scheme}: its parallelize is not memfit's FSDP2 (memfit.measure.distributed.fsdp2), whose fully_shard "
            "arguments fit can vary",
        )
    _check_allowed(workload, allowed)
    if "reduce_bf16" not in allowed and fsdp is not None:
        left_out["reduce_bf16"] = opt_in_reason("reduce_bf16", "")
    if "expandable_segments" not in left_out:
        if search.settings is None:
            left_out["expandable_segments"] = Reason(
                Why.NOT_APPLICABLE, "a CUDA allocator setting: weighed on fake CUDA ranks (--device fake-cuda)"
            )
        elif search.settings.expandable_segments:
            left_out["expandable_segments"] = Reason(Why.NOT_NEEDED, "on already in this process's allocator settings")
    return left_out, fsdp is not None and "reshard_after_forward" not in left_out


class _Weighing:
    """The candidates that fit, and the lowest peak reached where none does, as each variant
    (reduce dtype, allocator settings) of the step is weighed."""

    def __init__(self, search: _RankSearch, family: bool, recompute: bool) -> None:
        self.search, self.family, self.recompute = search, family, recompute
        self.cands: list[Candidate[_Setting]] = []
        self.lowest: tuple[int, str] | None = None

    def over(self, peak: int, label: str) -> None:
        if self.lowest is None or peak < self.lowest[0]:
            self.lowest = (peak, label)

    def plan(self, s: _Setting) -> bool:
        if not self.recompute:
            return False
        got = self.search.planned(s)
        if isinstance(got, Plan):
            self.cands.append(self.search.candidate(s, got))
            return True
        self.over(got, self.search.label(s) + " + recompute")
        return False

    def variant(self, own: _Setting) -> bool:
        """Weigh the workload's own setting of this variant and, for memfit's FSDP2, the family
        (module docstring); True when the budget bound it (not every block kept without recompute)."""
        search = self.search
        at = lambda keep: dataclasses.replace(own, keep=keep)  # noqa: E731
        if search.peak(own) <= search.budget:
            self.cands.append(search.candidate(own))
        else:
            self.over(search.peak(own), search.label(own))
        if not self.family:
            if search.peak(own) > search.budget:
                self.plan(own)
            return search.peak(own) > search.budget
        best = search.largest_within(own, search.budget)
        if best is not None:
            self.cands.append(search.candidate(at(best)))
        else:
            # Over the budget as it is: recompute at the most kept that costs no more peak than
            # the workload's own setting (the root, the last block: backward all-gathers them
            # at once anyway); failing that at its own, failing that at the lowest.
            free = search.largest_within(own, search.peak(own))
            if free is None or not self.plan(at(free)):
                if not self.plan(own) and search.peak(at(0)) < search.peak(own):
                    self.plan(at(0))
            self.over(search.peak(at(0)), search.label(at(0)))
        if best != search.top:
            # Recompute that makes room for every block's parameters, against the all-gathers saved.
            self.plan(at(search.top))
        return best != search.top

    def unique(self) -> list[Candidate[_Setting]]:
        """A setting reached twice (the workload's own is a family member) counts once."""
        out: dict[tuple[_Setting, bool], Candidate[_Setting]] = {}
        for c in self.cands:
            out.setdefault((c.choice, c.plan is not None), c)
        return list(out.values())


def _infeasible(
    search: _RankSearch, weighing: _Weighing, allowed: set[str], left_out: dict[str, Reason]
) -> BudgetInfeasibleError:
    assert weighing.lowest is not None
    (peak, label), base = weighing.lowest, _Setting()
    return infeasible(
        search.budget,
        peak,
        label,
        f"as it is rank {search.profiled(base).worst_rank} peaks at {format_bytes(search.peak(base))}",
        per=" per rank",
        reach=f"reaches at {search.n} ranks",
        hints=["more ranks shard more"],
        opt_in=[lever for lever in OPT_IN_RANK_LEVERS if lever not in allowed and lever in left_out],
    )


def _rank_recipe(search: _RankSearch, weighing: _Weighing, best: Candidate[_Setting], left_out: dict[str, Reason]) -> RankRecipe:
    """The RankRecipe of the chosen candidate: its peaks per rank, the step as it is beside,
    every setting weighed as a what-if row."""
    if best.plan is not None and best.plan.rank_peak_bytes:
        rank_peaks = dict(best.plan.rank_peak_bytes)
    else:
        rank_peaks = {r: p.budget_peak_bytes for r, p in search.profiled(best.choice).profiles.items()}
    chosen_fsdp = search.fsdp_at(best.choice)
    base = _Setting()
    as_is = search.profiled(base)
    device = as_is.profiles[as_is.worst_rank].device
    notes = [
        "fake process group: peaks are exact per rank on fake tensors; step times are predicted (the cost model's round "
        f"rates for {device}, collectives at a nominal {LINK_BYTES_PER_S['cuda' if 'cuda' in device else 'cpu'] / 1e9:g} "
        "GB/s, not overlapped) and chose the recipe: time it on the cluster",
    ]
    settings = search.expandable_settings if best.choice.expandable else search.settings
    if settings is not None:
        notes.append(
            "fake CUDA: each rank's peak is its reserved memory (memfit's caching-allocator model under "
            f"{settings.assignment() or 'the default settings'}); NCCL's buffers and the CUDA context are not in it"
        )
    fsdp = search.fsdp
    if fsdp is not None and search.blocks and fsdp.reshard_after_forward is False:
        notes.append("the workload keeps every block unsharded already; reshard_after_forward=True frees them as a lever")
    return RankRecipe(
        budget_bytes=search.budget,
        world_size=search.n,
        parallel=search.workload.parallel.name if search.workload.parallel is not None else search.workload.name,
        levers=best.levers,
        fsdp=_fsdp_args(chosen_fsdp, search.blocks) if chosen_fsdp is not None else None,
        plan=best.plan if best.plan is not None and best.plan.checkpointed else None,
        predicted_peak_bytes=max(rank_peaks.values()),
        rank_peak_bytes=rank_peaks,
        predicted_step_time_s=best.time_s,
        base_peak_bytes=search.peak(base),
        base_step_time_s=search.seconds(base, None),
        all_gathers=search.all_gathers(best.choice),
        base_all_gathers=search.all_gathers(base),
        what_if=_what_if(search, weighing.unique(), best),
        left_out={lever: left_out[lever] for lever in RANK_LEVERS if lever in left_out and lever not in best.levers},
        notes=notes,
        device=device,
        batch_size=batch_size_of(*split_inputs(search.workload.inputs)),
        search={"profiles": len(search.profiles), "plans": len(search.plans)},
        allocated_peak_bytes=_allocated(search, best),
        allocator_conf=settings.describe() if settings is not None else None,
    )


def _allocated(search: _RankSearch, best: Candidate[_Setting]) -> int | None:
    """On fake CUDA, the chosen configuration's allocated peak beside its reserved one."""
    if search.settings is None:
        return None
    if best.plan is not None and best.plan.allocated_peak_bytes is not None:
        return best.plan.allocated_peak_bytes
    return max(p.peak_bytes for p in search.profiled(best.choice).profiles.values())


def _simpler(c: Candidate[_Setting]) -> tuple:
    """The fastest predicted; a lever that changes the numerics only when it is more than
    :data:`~memfit.levers.ties.TIE` faster than the fastest without one (as fit chooses among near-ties);
    at the same time, fewer levers and the lower peak."""
    return (sum(lev in OPT_IN_RANK_LEVERS for lev in c.levers), c.time_s, len(c.levers), c.peak_bytes)


def _fsdp_args(fsdp: FSDP2, blocks: list[str]) -> dict[str, Any]:
    return {
        "blocks": blocks,
        "block_reshard_after_forward": fsdp.block_reshards(len(blocks)),
        "root_reshard_after_forward": fsdp.root_reshards,
        "param_dtype": _dtype_name(fsdp.param_dtype),
        "reduce_dtype": _dtype_name(fsdp.reduce_dtype),
    }


def _what_if(search: _RankSearch, cands: list[Candidate[_Setting]], best: Candidate[_Setting]) -> list[WhatIf]:
    """Every setting weighed: those that fit (fastest first), then those over the budget."""
    rows = [c.row(search.label(c.choice, c.plan), chosen=c is best) for c in cands]
    shown = {(c.choice, c.plan is not None) for c in cands}
    over = []
    for s, prof in search.profiles.items():
        peak = prof.budget_peak_bytes  # on fake CUDA the reserved peak the budget bounds
        if (s, False) not in shown and peak > search.budget:
            over.append(WhatIf(search.label(s), search.levers(s, None), peak, search.seconds(s, None), False))
    for s, got in search.plans.items():
        if isinstance(got, int):
            note = f"lowest reachable with recompute {format_bytes(got)}"
            over.append(
                WhatIf(search.label(s) + " + recompute", search.levers(s, None) + ("recompute",), got, None, False, note=note)
            )
    return what_if_order(rows + over)


# -- the largest batch per rank ----------------------------------------------------------------------


def _at_batch(workload: Workload, batch: int) -> Workload:
    inputs = resize_batch(workload.inputs, batch)
    targets = resize_targets(workload.targets, workload.inputs, batch)
    meta = {**workload.meta, "batch_size": batch} if "batch_size" in workload.meta else workload.meta
    return dataclasses.replace(workload, inputs=inputs, targets=targets, meta=meta)


def max_batch_ranks(
    workload: Workload,
    budget: int | str,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] = (0,),
    multiple_of: int = 1,
    allow: str | Iterable[str] | None = None,
    recompute: bool = True,
    recipe: bool = True,
    progress: Progress | None = None,
    fake: bool | str | Where = True,
) -> MaxBatch:
    """The largest per-rank batch (a multiple of ``multiple_of``) whose distributed step
    peaks within ``budget`` bytes on each of ``ranks``: for each lever set (as it is;
    reshard_after_forward=True everywhere, where the workload keeps any parameters unsharded;
    with ``allow``, a bfloat16 reduce dtype), without and with recompute (its lowest
    reachable peak), the search of :func:`memfit.max_batch` on exact fake-group peaks.
    Then (``recipe``) :func:`fit_ranks` at that batch: the fastest recipe there.
    ``recompute=False`` leaves the recompute limits out (each batch tried is then one
    profile, not a plan: minutes less on an 8B model). ``fake="cuda"``: each rank on fake CUDA,
    the budget bounding its reserved peak (as :func:`fit_ranks`)."""
    refuse_pipelined(workload, "--max-batch", own_ok=True)
    started = time.perf_counter()
    target = fit_budget(budget)
    allowed = parse_rank_allow(allow)
    n = world_size_of(workload, world_size)
    multiple_of = _batch_multiple(workload, n, multiple_of)
    ranks = list(dict.fromkeys(ranks)) or [0]
    where = Where.of(fake)
    device = rank_device(where)
    for r in ranks:
        FakeGroup(n, r, device)
    example = batch_size_of(*split_inputs(workload.inputs))
    if example is None:
        raise WorkloadError("no input tensor has a batch dimension: there is no batch size to grow")
    report = progress or (lambda desc, done, total: None)
    _check_allowed(workload, allowed)
    variants = _batch_variants(workload, allowed)

    def plain(work: Workload) -> Callable[[int], int]:
        def peak(b: int) -> int:
            report(f"rank step at batch {b}", 0, 0)
            return profile_ranks(_at_batch(work, b), world_size=n, ranks=ranks, fake=where).budget_peak_bytes

        return peak

    def recomputed(work: Workload) -> Callable[[int], int]:
        def peak(b: int) -> int:
            report(f"lowest recompute peak at batch {b}", 0, 0)
            # (a pipeline's stages each hold their own modules: every one planned, the worst stage's lowest peak)
            planned = ranks if own_pipeline(work) else ranks[:1]
            return plan_ranks(_at_batch(work, b), 0.0, world_size=n, ranks=planned, fake=where).min_peak_bytes

        return peak

    limits: list[BatchLimit] = []
    for name, work in variants.items():
        for planned in (False, True) if recompute else (False,):
            levers = (("recompute",) if planned else ()) + ((name,) if name else ())
            limits.append(_largest((recomputed if planned else plain)(work), target, example, multiple_of, levers))
    batch = largest_of(limits, target, multiple_of, n)
    found = None
    if recipe:
        excluded = None if recompute else {"recompute": "left out of the search (recompute=False)"}
        fit = dict(world_size=n, ranks=ranks, allow=allowed, progress=progress, fake=where, exclude=excluded)
        batch, found = _recipe_at(workload, batch, target, multiple_of, fit=fit)
        found.budget = str(budget)
    return MaxBatch(
        budget_bytes=target,
        batch_size=batch,
        example_batch=example,
        limits=limits,
        recipe=found,
        search_time_s=time.perf_counter() - started,
        multiple_of=multiple_of,
        model_type=type(workload.model).__name__,
        device=f"fake:{device}",
        world_size=n,
    )


def _batch_multiple(workload: Workload, n: int, multiple_of: int) -> int:
    """``multiple_of`` checked; under memfit's own pipeline at ``n`` ranks raised to a multiple of
    its microbatches' count (the schedule cuts each batch into them: another batch is refused)."""
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise WorkloadError(f"multiple_of must be a positive integer, got {multiple_of!r}")
    if own_pipeline(workload):
        return math.lcm(multiple_of, workload.parallel.parallelize.microbatches or n)  # type: ignore[union-attr]
    return multiple_of


def _batch_variants(workload: Workload, allowed: set[str]) -> dict[str, Workload]:
    """The lever sets whose largest batch :func:`max_batch_ranks` searches, by lever name: the
    workload as it is (``""``); reshard_after_forward=True everywhere, where the workload keeps
    any parameters unsharded; with ``allowed``, a bfloat16 reduce dtype."""
    variants: dict[str, Workload] = {"": workload}
    fsdp = _fsdp_of(workload)
    if fsdp is not None:
        lowest = _variant(fsdp, _Setting(0))
        blocks = len(_block_names(workload, fsdp))
        if _reshards(lowest, blocks) != _reshards(fsdp, blocks):
            variants["reshard_after_forward"] = _with_fsdp(workload, lowest)
        if "reduce_bf16" in allowed:
            variants["reduce_bf16"] = _with_fsdp(workload, _variant(fsdp, _Setting(None, True)))
    return variants


def _recipe_at(workload: Workload, batch: int, target: int, multiple_of: int, fit: dict[str, Any]) -> tuple[int, RankRecipe]:
    """The fastest recipe at ``batch`` (:func:`fit_ranks` with ``fit``'s keywords). The recompute
    limits are the planned rank's lowest peaks; a plan verified on every rank may need a step down."""
    for _ in range(3):
        if fit["progress"] is not None:
            fit["progress"](f"fastest recipe at batch {batch}", 0, 0)
        try:
            return batch, fit_ranks(_at_batch(workload, batch), target, **fit)
        except (BudgetInfeasibleError, PlanError):
            if batch <= multiple_of:
                raise
            batch -= multiple_of
    # never a batch without the recipe that was asked for (max_batch refuses alike)
    raise BudgetInfeasibleError(
        f"no per-rank recipe fits batch {batch + multiple_of} or the two below it when verified on every rank, "
        "though the lowest peaks said so",
        min_peak_bytes=target + 1,
        budget_bytes=target,
    )
