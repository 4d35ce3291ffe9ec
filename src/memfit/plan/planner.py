"""``memfit.plan``: choose what to recompute so the step fits a budget at the least extra compute.

1. Profile the step (or take a profile): the ledger and measured module times.
2. Build candidates (every module called once; full or selective recompute) and the MILP.
3. ``P_min``: solve for the lowest model peak, then run that plan for the
   exact figure. ``P_none`` is the profile's peak. A fractional budget resolves between them.
4. Solve for the cheapest plan under the budget and verify it by running it
   (:class:`~memfit.measure.verify.Verifier`: on fake tensors when planning from a fake
   profile, else on the real model, whose state is restored); if the verified peak is
   over, tighten the bound by the overshoot and solve again.
5. A module whose recompute fails while verifying (different saved tensors, an error) is
   excluded with the reason, and planning starts over without it. Modules whose forward
   changes Python state (:mod:`memfit.recompute.stateful`) are excluded before the first round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.cuda.allocator import AllocatorSettings
from memfit.errors import BudgetInfeasibleError, PlanError
from memfit.measure.cache_check import real_switch_check
from memfit.measure.checked import Step, checked_step
from memfit.measure.inputs import input_bytes
from memfit.measure.ledger import Category
from memfit.measure.profile import Profile, Progress, model_cuda_memory, profile_step
from memfit.measure.step import StepOptions
from memfit.measure.timing import NOISY_STEPS, selective_overhead_s
from memfit.measure.verify import RecomputeFailed, Run, Verifier, step_verifier
from memfit.plan.baselines import blocks
from memfit.plan.budget import Budget, parse_budget
from memfit.plan.candidates import DeviceRates, Option, build_candidates, leaf_samples, pooled_times
from memfit.plan.result import Choice, Plan, fingerprint
from memfit.plan.solver import Problem, Solution
from memfit.recompute import cache
from memfit.recompute.checkpoint import applied_choices
from memfit.units import format_bytes
from memfit.workload import Where

__all__ = [
    "plan",
    "profile_candidates",
    # the seam plans of other steps (plan.distributed) are made through
    "Search",
    "Found",
    "search",
    "make_plan",
    "check_objective",
]

_MAX_EXCLUSIONS = 16
_OBJECTIVES: dict[str, Callable[[Option], float]] = {
    "time": lambda o: o.cost_s,
    # 1 ms of estimated time weighs like 1 MFLOP: it only separates options of equal FLOPs
    "flops": lambda o: o.cost_flops + 1e9 * o.cost_s,
}
_MAX_TIGHTENING = 6
_MiB = 2**20

Costing = tuple[dict[str, float | None], dict[str, int], DeviceRates, str]
"""What candidates are costed with (:func:`_costing`): forward times, calls, rates, a timing note."""


# Seconds a fake-tensor verification run costs per forward op of the step (the ledger's
# ``ops``; backward and optimizer ops scale with them), twice what was measured: zoo gpt's
# recorded fake step, 2586 forward ops, took a quarter of its unrecorded real step (6.6 s
# against 25.2 s on a loaded host, whose quiet step is 0.9 s): about 0.1 ms an op quiet. On
# zoo heavy (~100k tiny ops, a 5 s step) the fake step was slower than the real one.
_FAKE_S_PER_OP = 2e-4


def _input_bytes(prof: Profile) -> int:
    return sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.INPUT)


def _step_input_bytes(prof: Profile, args: tuple, kwargs: dict, targets: Any) -> int:
    """Bytes of the step's input tensors as ``prof``'s ledger would count them: each storage
    once (``{"input_ids": ids, "labels": ids}`` is one), on fake CUDA as the copies there."""
    copied_to = torch.device("cuda") if prof.device.startswith("fake:cuda") else None
    return input_bytes((args, kwargs, targets), copied_to=copied_to)


def _fake_is_faster(prof: Profile) -> bool:
    """Whether a real profile's plans are verified faster on fake copies of the step than on
    the real one. A fake run costs per op (dispatch, the recorder), a real one its kernels
    too: on zoo gpt a recorded fake step took an eighth of a real one; on a step of 100k tiny
    scalar ops it is the other way. Only CPU steps: a GPU's kernels are fast, and fake CUDA's
    allocator model is verified on its own."""
    if prof.fake or prof.step_time_s is None or not prof.device.startswith("cpu"):
        return False
    return len(prof.ledger.ops) * _FAKE_S_PER_OP < prof.step_time_s


def _timed_like(prof: Profile, timed: Profile) -> Profile:
    """``prof`` (a fake profile of the same step) with ``timed``'s measured times: the
    step's and every module's the two share."""
    modules = {}
    for name, m in prof.modules.items():
        t = timed.modules.get(name)
        modules[name] = replace(m, forward_time_s=t.forward_time_s, backward_time_s=t.backward_time_s) if t else m
    return replace(
        prof,
        modules=modules,
        time_source=timed.time_source,
        step_time_s=timed.step_time_s,
        step_times_s=timed.step_times_s,
        device=timed.device,
    )


def plan(
    model: nn.Module,
    inputs: Any,
    budget: int | float | str,
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
) -> Plan:
    """Choose what to recompute so one training step peaks within ``budget``.

    Args:
        model, inputs, loss_fn, optimizer, targets: the step, as for :func:`memfit.profile`.
        budget: bytes bounding the whole step's peak (``6 * 2**30``, ``"6GiB"``,
            ``"800MB"``), or a fraction ``f`` in [0, 1] (``0.5``, ``"50%"``) meaning
            ``P_min + f * (P_none - P_min)``. On CUDA (real or fake) the peaks are the
            caching allocator's reserved peaks (memfit's model of it replaying each planned
            step; :attr:`Plan.allocated_peak_bytes` beside).
        fake: profile on fake tensors (no times: costs are estimated from FLOPs and bytes);
            ``"cuda"``: on fake CUDA, as for :func:`memfit.profile`.
        profile: a profile of this step to plan from, instead of measuring a new one.
        objective: what extra compute to minimise: ``"time"`` (recompute time estimated from
            the module times measured on this device, including selective recompute's
            per-op overhead) or ``"flops"`` (recomputed FLOPs, ties broken by time; a
            device-independent proxy, e.g. when planning a GPU run on a CPU).
        step: how the step runs (:class:`StepOptions`); default the profile's, else the
            usual step. Plans are verified on this very step. A module called once per
            micro-batch is called more than once per step, so it is not planned: plan
            one micro-batch's step instead (what :func:`memfit.fit` does).
        op_overhead_s: seconds selective recompute's dispatch mode adds per op on this
            host; default measured on the model (two forwards) when the profile has times.
            :func:`memfit.fit` measures it once and plans many steps with it.
        on_profile: called with the profile the plan is made from, before the search (the
            step as the plans run it: with transformers' KV cache off where they turn it
            off). Saved with ``to_json``, it is a ``profile=`` that plans this step again
            without measuring it (``memfit plan --profile PATH`` writes it when PATH is new).
        on_planned: called with the step with the plan applied, as the run that verified
            the plan recorded it (its peak is the plan's predicted peak; no times): what
            ``memfit plan --plot`` draws beside ``on_profile``'s, without profiling again.

    Returns:
        A :class:`Plan`; nothing about the model, its gradients, buffers, the optimizer
        or the RNG is changed. Apply it with :func:`memfit.apply`.

    Raises:
        BudgetInfeasibleError: the budget is below ``P_min`` (stated in the message).
    """
    started = time.perf_counter()
    spec = parse_budget(budget)
    check_objective(objective)
    # Before anything runs: fake CUDA unavailable, inputs on another device (with a profile
    # given, nothing else would check them), no trainable parameters. A compiled or
    # DDP-wrapped model is planned as the module inside: the plan names its modules, and
    # memfit.apply accepts the wrapper or the module alike.
    where = profile.where if profile is not None else Where.of(fake)
    the = checked_step(
        model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=where, options=step, targets=targets, unwrapped=True
    )
    model, args, kwargs, optimizer = the.model, the.args, the.kwargs, the.optimizer
    options = _planned_step(the, profile, step, targets)
    report = progress or (lambda desc, done, total: None)
    with ExitStack() as closing:
        opener = _Opener(closing, model, args, kwargs, optimizer, loss_fn, options, targets, report)
        # The verifier's first step creates the optimizer's state (its warm-up); a real
        # profile runs inside that sandbox and needs no warm-up of its own: a step less.
        found, use_cache_off, verify_note = _plan_search(
            opener, the, profile, where, spec, objective, op_overhead_s, progress, on_profile, on_planned
        )
    report("done", 2, 2)
    return make_plan(found, use_cache_off=use_cache_off, budget=budget, started=started, verify_note=verify_note)


def _plan_search(
    opener: _Opener,
    the: Step,
    profile: Profile | None,
    where: Where,
    spec: Budget,
    objective: str,
    op_overhead_s: float | None,
    progress: Progress | None,
    on_profile: Callable[[Profile], None] | None,
    on_planned: Callable[[Profile], None] | None,
) -> tuple[Found, tuple[str, ...], str]:
    """:func:`plan`'s stages once its step is checked: the first step (modules never to offer,
    KV caches off), the profile plans are made from, the verifier (on fake copies when they
    are faster), and the search; returns what it found, the caches off and the verify note."""
    model, report = opener.model, opener.report
    excluded: dict[str, str] = {}
    verifier, stateful, use_cache_off, verify_note = _first_verifier(opener, profile, where)
    excluded.update(stateful)
    if use_cache_off and verifier.box.model is not model:  # a copy: profiles copy the model too
        opener.closing.enter_context(cache.switched_off(model, use_cache_off))
    prof = _plan_profile(the, profile, verifier, use_cache_off, where, opener.options, progress)
    if on_profile is not None:
        on_profile(prof)
    if where is Where.REAL and verifier.box.fake_mode is None and _fake_is_faster(prof):
        # Plans are verified on fake copies from here on: the same ledger (kernel
        # workspaces taken from what the real profile measured) at a fraction of a real
        # step's time when the step's ops are large.
        fake_verifier = opener.verifier(Where.FAKE)
        try:
            verifier = fake_verifier.instead_of(verifier, use_cache_off)
        except Exception as exc:  # noqa: BLE001 - the real step ran: the fake copy is what failed
            fake_verifier.close()
            verify_note = _fake_refused(exc)
    costing = _costing(prof)
    # On CUDA the budget bounds what the caching allocator reserves: every verified run
    # is replayed through the allocator model, and P_none is the same model's figure for
    # the unplanned step (on a real GPU too, where the profile measured it beside: plans
    # and P_none are then judged alike).
    verifier.settings = prof.cuda_memory.settings if prof.cuda_memory is not None else None
    overhead = _op_overhead(prof, op_overhead_s)
    found = search(Search(prof, verifier, model, spec, objective, excluded, overhead=overhead, costing=costing), report)
    if on_planned is not None:
        on_planned(planned_profile(prof, found.run, verifier.settings))
    return found, use_cache_off, verify_note


def _planned_step(the: Step, profile: Profile | None, step: StepOptions | None, targets: Any) -> StepOptions:
    """The step plans are made for (``step``, else the profile's, else the usual one), once the
    model has no plan on it and the profile given fits it; an inference step is refused."""
    if applied_choices(the.model) is not None:
        raise PlanError("this model already has a plan applied; call memfit.remove(model) before planning again")
    if profile is not None:
        _check_profile(profile, the.model, the.args, the.kwargs, targets, step)
    options = step or (profile.step if profile is not None else StepOptions())
    if options.inference:
        raise PlanError(
            "an inference step saves nothing for backward, so recomputing frees nothing: plan the training step "
            "(a profile without StepOptions(inference=True))"
        )
    return options


def _check_profile(profile: Profile, model: nn.Module, args: tuple, kwargs: dict, targets: Any, step: StepOptions | None) -> None:
    """Refuse a ``profile=`` made of another model, other inputs or another step than the one planned."""
    if not set(profile.modules) <= {name for name, _ in model.named_modules()}:
        raise PlanError(
            f"the profile was made for another model ({profile.model_type}, module names that this "
            f"{type(model).__name__} does not have); profile this model, or plan without profile="
        )
    # (a step that casts its inputs, StepOptions(param_dtype=...), holds them in another size)
    if profile.step.cast_dtype is None and _input_bytes(profile) != _step_input_bytes(profile, args, kwargs, targets):
        raise PlanError(
            f"the profile was made with other inputs ({_input_bytes(profile)} bytes of them, this step has "
            f"{_step_input_bytes(profile, args, kwargs, targets)}: another batch?); profile these inputs, or plan without profile="
        )
    if step is not None and profile.step != step:
        raise PlanError(f"the profile measured another step ({profile.step}) than step= asks ({step}); pass one of them")


@dataclass
class _Opener:
    """Opens the verifiers of :func:`plan`'s step (closed with its ``closing`` stack), and checks
    on real tensors that turning transformers' KV cache off changes no number."""

    closing: ExitStack
    model: nn.Module
    args: tuple
    kwargs: dict
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor] | None
    options: StepOptions
    targets: Any
    report: Progress

    def verifier(self, where: Where) -> Verifier:
        opened = step_verifier(
            where, self.model, self.args, self.kwargs, self.optimizer, self.loss_fn, step=self.options, targets=self.targets
        )
        self.closing.callback(opened.close)
        return opened

    def real_check(self, off: tuple[str, ...]) -> str | None:
        # a real forward and backward twice: the longest stage of a large model's fake plan
        self.report("checking on real tensors that the KV cache switch changes no number", 0, 0)
        return real_switch_check(
            self.model, self.args, self.kwargs, self.optimizer, self.loss_fn, off, step=self.options, targets=self.targets
        )


def _first_verifier(
    opener: _Opener, profile: Profile | None, where: Where
) -> tuple[Verifier, dict[str, str], tuple[str, ...], str]:
    """The verifier plans start on, after a first step that finds the modules never to offer and
    the KV caches to turn off: (verifier, those modules with why, the caches off, the verify note)."""
    # Modules that change Python state in forward (a counter, a list): a recompute would
    # change it again, silently in some cases, so they are never offered. transformers'
    # KV cache goes off while the model trains, as its own gradient checkpointing does
    # (memfit.recompute.cache): the step measured and planned from here on is the one the
    # plan trains.
    verifier = None
    verify_note = ""
    opener.report("a first step: which modules change state, which keep a KV cache", 0, 0)
    if profile is not None and where is Where.REAL and _fake_is_faster(profile):
        # A real profile given (saved, say) whose plans verify on fake copies: the modules
        # are checked on a fake copy too, and the real step runs only if a run needs it.
        fake_verifier = opener.verifier(Where.FAKE)
        try:
            stateful, use_cache_off = fake_verifier.stateful(opener.real_check)
            verifier = fake_verifier.falling_back(lambda: opener.verifier(Where.REAL).warmed(use_cache_off))
        except Exception as exc:  # noqa: BLE001 - the real step below says so if it fails too
            fake_verifier.close()
            verify_note = _fake_refused(exc)
    if verifier is None:
        verifier = opener.verifier(where)
        stateful, use_cache_off = verifier.stateful(opener.real_check)
    return verifier, stateful, use_cache_off, verify_note


def _plan_profile(
    the: Step,
    profile: Profile | None,
    verifier: Verifier,
    use_cache_off: tuple[str, ...],
    where: Where,
    options: StepOptions,
    progress: Progress | None,
) -> Profile:
    """The profile plans are made from: the one given when it measured the step the plans run
    (the KV caches as they turn them off), else that step measured."""
    if profile is not None and profile.use_cache_off == use_cache_off:
        return profile
    if profile is not None and verifier.box.fake_mode is not None and where is Where.REAL:
        # A saved real profile of the step as it is (memfit.profile keeps transformers'
        # KV cache on) while the plans' step runs with the cache off: that step on a fake
        # copy (kernel workspaces from the saved profile), timed by the saved profile's
        # measurements: the cache changes what the step keeps, not what it computes.
        fake_prof = profile_step(the.on(Where.FAKE, options), progress=progress)
        return _timed_like(fake_prof, profile)
    # (a profile given was measured with the cache on: memfit.profile measures the
    # step as it is; the plan's step runs with it off, and is measured so)
    return profile_step(the.on(where, options), progress=progress, warm=True)


def _op_overhead(prof: Profile, given: float | None) -> float:
    """What selective recompute's dispatch mode costs per op here (measured on this host;
    fake tensors have no time, and their plans weigh FLOPs and bytes only)."""
    if given is not None:
        return given
    if prof.time_source == "measured":
        return selective_overhead_s(prof.device)
    return 0.0


def planned_profile(prof: Profile, run: Run, settings: AllocatorSettings | None) -> Profile:
    """``prof``'s step with a plan applied, as ``run`` (the run that verified the plan)
    recorded it: its ledger and FLOPs, on CUDA its allocator replay, and no times (a
    verification run is not timed). The unplanned step's run is ``prof`` itself."""
    if run.ledger is None:
        return prof
    return replace(
        prof,
        ledger=run.ledger,
        step_flops=run.step_flops,
        fake=run.fake,
        device=f"fake:{prof.device}" if run.fake and not prof.fake else prof.device,
        time_source="omitted",
        step_time_s=None,
        step_times_s=(),
        cuda_memory=model_cuda_memory(run.ledger, settings) if settings is not None else None,
        meta={**prof.meta, "recorded_by": "the run that verified the plan"},
    )


def _fake_refused(exc: BaseException) -> str:
    """The one line a plan carries when fake copies of a step that runs for real could not
    run it (a fake kernel refusing what the real op runs): plans are verified on the real step."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"fake tensors could not run this step ({type(exc).__name__}: {first}): plans verified on the real step"


def check_objective(objective: str) -> None:
    """Refuse an unknown planning objective, naming the known ones."""
    if objective not in _OBJECTIVES:
        raise PlanError(f"objective must be one of {', '.join(_OBJECTIVES)}, got {objective!r}")


@dataclass
class Search:
    """What a plan's search runs on: a profile of the step and the verifier that runs plans on
    that step (:func:`plan`'s sandbox, or one rank's: :func:`memfit.plan.distributed.plan_ranks`)."""

    prof: Profile
    verifier: Verifier
    model: nn.Module
    """The model the plan names modules of (unparallelized, unwrapped)."""
    spec: Budget
    objective: str
    excluded: dict[str, str]
    """Modules not offered, with why; modules whose recompute fails while verifying join it."""
    overhead: float = 0.0
    """Seconds selective recompute's dispatch mode adds per op (0 on fake tensors)."""
    costing: Costing | None = None
    """The profile's costing when the caller has made it (for its timing note); else made here."""
    per_pass: bool = False
    """The step is a pipeline stage's microbatches, each a forward and backward pass: modules
    called once a pass are candidates (:func:`~memfit.plan.candidates.build_candidates`)."""
    price_min: bool = False
    """With a budget in bytes, run the cheapest plan first and verify ``P_min`` only when the
    answer needs it (the plan does not verify within the budget: the budget may be infeasible);
    otherwise ``P_min`` is the ledger's price of the lowest plans (:attr:`Plan.min_peak_verified`
    False). Two steps fewer where a step is dear (a rank's). Off: ``P_min`` is run first, as
    :func:`plan` does (a fractional budget needs it)."""


@dataclass(frozen=True)
class Found:
    """A finished :func:`search`: the cheapest verified plan within the budget."""

    search: Search
    chosen: list[Option]
    run: Run
    min_peak: int
    target: int
    cands: Any
    timing_note: str
    min_verified: bool = True
    """Whether ``min_peak`` was run (else priced on the ledger: :attr:`Search.price_min`)."""


def search(s: Search, report: Progress) -> Found:
    """The cheapest verified plan within ``s.spec`` on ``s.prof``'s step, whose runs
    ``s.verifier`` makes, with ``P_min`` and the budget in bytes. Modules whose recompute fails
    while verifying join ``s.excluded`` (in place) and planning starts over."""
    prof, excluded = s.prof, s.excluded
    ledger = prof.ledger
    timed = prof.time_source == "measured"
    # (plan() has costed the profile already for its note; a rank's plan has not)
    forward_time, calls, rates, timing_note = s.costing if s.costing is not None else _costing(prof)
    none_peak = _none_peak(prof)
    none_run = Run(none_peak, _none_allocated(prof), prof.step_flops)
    for _ in range(_MAX_EXCLUSIONS):
        cands = build_candidates(
            ledger, forward_time, rates=rates, calls=calls, exclude=excluded, op_overhead_s=s.overhead, per_pass=s.per_pass
        )
        # Measured costs move by a few percent from run to run: within 5% of the cheapest,
        # the simplest plan (see Problem.min_cost).
        near = _NEAR if timed and not timing_note else 0.0
        problem = Problem(ledger.curve(), ledger.start_bytes, cands.options, _OBJECTIVES[s.objective], near=near)
        lowest = _Lowest(s, problem, cands.options, none_run, report)
        try:
            if s.price_min and s.spec.bytes is not None:
                chosen, run, min_peak, target, verified = _fit_priced(problem, s.verifier, s.spec.bytes, none_run, lowest)
            else:
                min_peak, low = lowest.verified()
                target = lowest.feasible(min_peak)
                report("cheapest plan within the budget", 1, 2)
                chosen, run = _fit(problem, s.verifier, target, none_run, lambda low=low: low)
                verified = True
        except RecomputeFailed as failed:
            excluded[failed.module] = failed.reason
            continue
        break
    else:
        raise PlanError(f"too many modules failed to recompute ({len(excluded)}); last: {list(excluded.items())[-1]}")
    # the note only when plan() costed the profile (its plans say so); a rank's profile has no times
    note = s.costing[3] if s.costing is not None else ""
    return Found(s, chosen, run, min_peak, target, cands, note, min_verified=verified)


@dataclass
class _Lowest:
    """``P_min`` of one round of :func:`search`: the lowest-peak plan of the ledger's model and
    the recipe of recomputing every repeated block, verified by running both (two steps) only
    when asked: :meth:`verified`; :meth:`priced` is the same two plans' peaks on the ledger."""

    s: Search
    problem: Problem
    options: list[Option]
    none_run: Run
    report: Progress

    def __post_init__(self) -> None:
        self.report("lowest reachable peak", 0, 2)
        # With P_min priced first (a budget in bytes), the solve's plan is only priced unless
        # the answer then needs it run: :meth:`verified` solves again as for a run.
        self.priced_only = self.s.price_min and self.s.spec.bytes is not None
        self._solve()

    def _solve(self) -> None:
        self.lowest = self.problem.min_peak(priced=self.priced_only)
        # The model of the step is conservative (it keeps a checkpointed module's
        # activations alive through its whole forward), so its minimum can miss the
        # plain recipe of recomputing every repeated block: try that too.
        recipe = _every_block(self.s.model, self.options)
        self.recipe = recipe if recipe and {o.module for o in recipe} != {o.module for o in self.lowest.chosen} else []

    def priced(self) -> int:
        """The lower of the two plans' peaks as the ledger's model prices them (with P_none);
        on CUDA plus the unplanned step's reserved-over-allocated gap, as :func:`_fit` bounds them."""
        none = self.none_run
        peaks = [self.lowest.model_peak_bytes] + ([self.problem.model_peak(self.recipe)] if self.recipe else [])
        return min(min(peaks) + none.peak_bytes - none.tensor_bytes, none.peak_bytes)

    def verified(self) -> tuple[int, tuple[list[Option], Run]]:
        """``P_min`` as both plans ran, and the lower plan with its run (the unplanned step if neither is lower)."""
        if self.priced_only:  # the plans are run now: solved as a plan to run is
            self.priced_only = False
            self._solve()
        lowest, none_run = self.lowest, self.none_run
        low_run = self.s.verifier.run(lowest.chosen) if lowest.chosen else none_run
        if self.recipe:
            recipe_run = self.s.verifier.run(self.recipe)
            if recipe_run.peak_bytes < low_run.peak_bytes:
                recipe = self.recipe
                lowest, low_run = Solution(recipe, self.problem.model_peak(recipe), sum(o.cost_s for o in recipe)), recipe_run
        min_peak = min(low_run.peak_bytes, none_run.peak_bytes)
        low = (lowest.chosen, low_run) if low_run.peak_bytes <= none_run.peak_bytes else ([], none_run)
        return min_peak, low

    def feasible(self, min_peak: int) -> int:
        """The budget in bytes, refused in one line when it is below ``min_peak``."""
        none_peak = self.none_run.peak_bytes
        target = self.s.spec.resolve(min_peak, none_peak)
        if target < min_peak:
            raise BudgetInfeasibleError(
                f"budget {format_bytes(target)} is below the lowest peak memfit can reach for this step, "
                f"P_min = {format_bytes(min_peak)} ({min_peak} bytes); P_none = {format_bytes(none_peak)}",
                min_peak_bytes=min_peak,
                budget_bytes=target,
            )
        return target


def _fit_priced(
    problem: Problem, verifier: Verifier, target: int, none: Run, lowest: _Lowest
) -> tuple[list[Option], Run, int, int, bool]:
    """:func:`_fit` with ``P_min`` verified only when the answer needs it (a budget in bytes):
    the cheapest plan is solved and run first; when it verifies within the budget (or none is
    needed) that run is the answer and ``P_min`` is priced on the ledger (``False`` last);
    otherwise the lowest plans run as :func:`search` runs them first, and the budget is refused
    below them or their lower plan is the answer, as there (``True`` last)."""
    verified: list[int] = []

    def low() -> tuple[list[Option], Run]:
        min_peak, found = lowest.verified()
        lowest.feasible(min_peak)
        verified.append(min_peak)
        return found

    lowest.report("cheapest plan within the budget", 1, 2)
    chosen, run = _fit(problem, verifier, target, none, low)
    if verified:
        return chosen, run, verified[0], target, True
    return chosen, run, lowest.priced(), target, False


def make_plan(found: Found, *, use_cache_off: tuple[str, ...], budget: Any, started: float, verify_note: str = "") -> Plan:
    """The :class:`Plan` of a finished :func:`search`; ``budget`` as the user gave it,
    ``started`` the ``time.perf_counter()`` planning began at, ``verify_note`` why its runs
    were made on the real step (:attr:`Plan.verify_note`)."""
    s = found.search
    prof, run, settings = s.prof, found.run, s.verifier.settings
    timed = prof.time_source == "measured"
    s.excluded.update({k: v for k, v in found.cands.excluded.items() if k not in s.excluded})
    return Plan(
        budget_bytes=found.target,
        predicted_peak_bytes=run.peak_bytes,
        allocated_peak_bytes=run.tensor_bytes if settings is not None else None,
        peak_basis="reserved_peak_bytes" if settings is not None else "peak_bytes",
        start_bytes=prof.start_bytes,
        none_peak_bytes=_none_peak(prof),
        min_peak_bytes=found.min_peak,
        min_peak_verified=found.min_verified,
        checkpointed={o.module: Choice(o.mode, o.save_ops) for o in sorted(found.chosen, key=lambda o: o.fwd_end)},
        extra_compute_s=sum(o.cost_s for o in found.chosen) if timed else None,
        extra_flops=max(0, run.step_flops - prof.step_flops),
        step_time_s=prof.step_time_s,
        excluded=s.excluded,
        use_cache_off=use_cache_off,
        model_type=type(s.model).__name__,
        fingerprint=fingerprint(s.model),
        device=prof.device,
        budget=str(budget),
        objective=s.objective,
        timing_note=found.timing_note,
        reproducibility_note=prof.reproducibility_note,
        verify_note=verify_note,
        planning_time_s=time.perf_counter() - started,
        step=prof.step,
    )


# Two timed steps further apart than _NOISY_STEPS (relative to the faster), or a block's
# identical repeats further apart than _NOISY_REPEATS: the host was too busy for measured
# times to rank options (zoo gpt on a quiet 2-core CPU: 0.05 and 0.08; beside a busy
# neighbour up to 2.7 and 0.4; ViT-S/16 up to 1.6 and 1.9).
_NOISY_STEPS = NOISY_STEPS
_NEAR = 0.05
_NOISY_REPEATS = 0.5


def _costing(prof: Profile) -> Costing:
    """What candidates are costed with: module forward times (None on fake tensors), calls,
    the device's rates (fitted to the measured leaf modules where there are times), and a
    note when measured times were set aside as too noisy.

    Noisy times would make the plan whatever the host's load made it, different in every
    run: then the plan is costed by the device's fixed rates (FLOPs, bytes, ops), the same
    in every run, and says so."""
    timed = prof.time_source == "measured"
    measured = {n: (m.forward_time_s if timed else None) for n, m in prof.modules.items()}
    forward_time, repeats_spread = pooled_times(prof.ledger, measured)
    calls = {n: m.calls for n, m in prof.modules.items()}
    rates = DeviceRates.for_device(prof.device, prof.gpu)  # on (fake) CUDA, the GPU the step was judged against
    if not timed:
        return forward_time, calls, rates, ""
    steps = prof.step_times_s
    # Only a profile's own timed steps are judged here: memfit.fit hands in module times from
    # its probes, weighed against the steps it times itself (it says when they part).
    noisy = len(steps) > 1 and min(steps) > 0
    noisy = noisy and ((max(steps) - min(steps)) / min(steps) > _NOISY_STEPS or repeats_spread > _NOISY_REPEATS)
    if noisy:
        note = (
            f"step times too noisy to rank options (steps {min(steps):.3f}-{max(steps):.3f} s, identical blocks "
            f"{repeats_spread:.0%} apart): recompute costed from FLOPs, bytes and ops at fixed {prof.device.split(':')[0]} rates"
        )
        return {n: None for n in forward_time}, calls, rates, note
    rates = DeviceRates.fit(leaf_samples(prof.ledger, forward_time), rates)
    return forward_time, calls, rates, ""


def profile_candidates(prof: Profile, exclude: dict[str, str] | None = None) -> list[Option]:
    """Every recompute option the planner weighs on ``prof``'s step: what each frees and costs
    (the per-op overhead of selective recompute left out: it is measured only while planning)."""
    forward_time, calls, rates, _ = _costing(prof)
    return build_candidates(prof.ledger, forward_time, rates=rates, calls=calls, exclude=exclude).options


def _every_block(model: nn.Module, options: list[Option]) -> list[Option]:
    """Full recompute of every repeated block, as candidate options (empty if any block
    is not a candidate)."""
    full = {o.module: o for o in options if o.mode == "full"}
    names = blocks(model)
    return [full[n] for n in names] if names and all(n in full for n in names) else []


def _none_peak(prof: Profile, key: str = "reserved_peak_bytes") -> int:
    """``P_none`` as plans are judged: the allocator model's reserved peak on CUDA (measured
    figures, on a real GPU, are the profile's own), else the tensor peak."""
    memory = prof.cuda_memory
    if memory is None:
        return prof.peak_bytes
    return memory.model[key] if memory.model else getattr(memory, key)


def _none_allocated(prof: Profile) -> int:
    """The unplanned step's tensor peak, as :attr:`Run.tensor_bytes` counts it."""
    return _none_peak(prof, "allocated_peak_bytes")


def _fit(
    problem: Problem, verifier: Verifier, target: int, none: Run, low: Callable[[], tuple[list[Option], Run]]
) -> tuple[list[Option], Run]:
    """Cheapest verified plan within ``target``: solve, run it, tighten. The model of the
    step counts tensor bytes; on CUDA the target bounds reserved bytes, so the first bound
    leaves the unplanned step's reserved-over-allocated gap, and each run's overshoot
    (replayed through the allocator model) tightens it further."""
    if target >= none.peak_bytes:
        return [], none
    bound = target - target // 400 - (none.peak_bytes - none.tensor_bytes)  # a 0.25% margin saves most second rounds
    for _ in range(_MAX_TIGHTENING):
        sol = problem.min_cost(bound)
        if sol is None:
            break
        run = verifier.run(sol.chosen)
        if run.peak_bytes <= target:
            return sol.chosen, run
        bound -= run.peak_bytes - target + _MiB // 4  # the model under-estimated by this much
    return low()  # the lowest-peak plan, which verified within P_min <= target
