"""``memfit.fit``: the fastest combination of memory levers whose step fits a budget.

Levers (:data:`~memfit.levers.recipe.LEVERS`): recompute (:func:`memfit.plan`),
micro-batching, ``zero_grad(set_to_none=True)``, activation offload to host memory (a CUDA
step only: ``save_on_cpu``; not combined with recompute, whose checkpointed regions keep
their own saved tensors), and, opt-in because they change what training computes,
autocast (``amp``), bfloat16 parameters (``bf16``), the optimizer's other implementation
(``foreach``) and 8-bit optimizer state (``8bit``: bitsandbytes' AdamW8bit or Adam8bit in
place of torch's AdamW or Adam).

Peaks are never predicted: every peak fit reports is an exact fake-tensor profile of that
very step, or a plan verified by running it. Step times are predicted from a few
measurements, and only the few combinations predicted fastest are timed for real.

1. What each lever may do here: micro-batching is left out for a model that normalises
   with batch statistics (BatchNorm) and for a loss that is neither the mean nor the sum
   of its micro-batches' losses (probed on the real model, in evaluation mode, restored;
   at the largest micro-batch count, which the others follow).
2. Measurements (real steps, in sandboxes), from which every combination's time follows:
   the step as it is (median of 3 after a warm-up, split at the optimizer phase, every
   module's time from one of them); one micro-batch of the most micro-batches ``K`` (its
   forward and backward against the whole batch's give the fixed cost a micro-batch adds,
   the per-op and launch part of the fitted cost model: FLOPs and bytes scale with the
   batch, op counts do not); autocast and bfloat16 parameters, one step each (a warm-up
   and 2), stopped once past twice the step as it is (a CPU without native bfloat16 runs
   it 30x slower: the lever is then known to be at least that slow), and one micro-batch
   of ``K`` in each (its kernels' fixed costs are its own); the optimizer phase
   alone, on zero gradients, for each optimizer the combinations use (foreach flag, 8-bit
   state, bfloat16 parameters, gradients kept); offload, one step. A combination with
   ``k`` micro-batches is predicted at its precision's forward and backward plus ``k - 1``
   fixed costs, plus its optimizer phase, plus its plan's recompute time.
3. Every combination, in order of predicted time: its exact peak on fake tensors; over
   the budget, a recompute plan at the budget (planned on one micro-batch's step when there
   are several: a module called once per micro-batch is called several times per step,
   which the planner does not plan; that step starts with the gradients of the
   micro-batches before it, and its peak is the whole step's), verified on fake tensors and
   costed with the module times measured in 2 (for ``k`` micro-batches, each module's time
   ``a/k + c`` through the whole batch's and the ``K``-th's). The search stops once the
   next prediction is over :data:`_MARGIN` slower than the fastest fitting one.
4. The fitting combinations predicted within :data:`_MARGIN` of the fastest (at most
   :data:`_MAX_TIMED`) run for real, each with its plan applied: median of 3 steps after a
   warm-up (3 more when they spread by over 20%), and the recorder's ledger peak of one
   more step. The fastest measured wins; within 5% (timing noise on a busy host), the one
   with the fewest levers, then the fewest micro-batches. If the timings still spread by
   over 30%, the predictions rank them instead. The Recipe's notes say so, and say when
   the chosen recipe's predicted and measured step times part by more than 15%.

Everything runs in sandboxes, so the model, its gradients and buffers, the optimizer and
the RNG are as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from memfit.cuda.allocator import AllocatorSettings
from memfit.errors import BudgetError, BudgetInfeasibleError, MemfitError, PlanError, WorkloadError
from memfit.levers import catalog
from memfit.levers.catalog import Combo, Reason, Situation, Why, microbatch
from memfit.levers.recipe import LEVERS, Decision, Measurement, Prediction, Provenance, Recipe, WhatIf, describe
from memfit.levers.ties import TIE, Candidate, choose, infeasible, what_if_order
from memfit.measure.checked import checked_step
from memfit.measure.ledger import Phase
from memfit.measure.profile import Profile, Progress, allocator_settings_from_env, run_step
from memfit.measure.profile import profile as measure_profile
from memfit.measure.sandbox import fake_device, real_sandbox
from memfit.measure.scope import Scope
from memfit.measure.step import StepOptions, first_micro_batches
from memfit.measure.timing import StepTimes, optimizer_step_time, selective_overhead_s, time_steps
from memfit.plan.budget import parse_budget
from memfit.plan.candidates import DeviceRates
from memfit.plan.planner import plan as make_plan
from memfit.plan.result import Plan, fingerprint
from memfit.recompute.cache import switched_off
from memfit.recompute.checkpoint import applied_choices, apply_choices, remove
from memfit.units import format_bytes
from memfit.workload import (
    Where,
    batch_size_of,
    join_inputs,
    split_batch,
)

__all__ = ["fit", "parse_allow", "fit_budget", "EXACT_LEVERS", "OPT_IN_LEVERS"]

EXACT_LEVERS = catalog.EXACT
"""Levers that leave what training computes as it was: always considered."""
OPT_IN_LEVERS = catalog.OPT_IN
"""Levers that change the numerics: considered only when ``allow`` names them."""

_TIMED_STEPS = 3
_SLOW = 2.0  # a probe step running past this many times the base step's is stopped
_SLOW_WARMUP = 4.0  # the same for its warm-up step (one-time costs), forgiven once
_MARGIN = 0.15  # combinations predicted within 15% of the fastest are timed for real
_MAX_TIMED = 3  # at most this many
_SPREAD = 0.2  # timed steps spread wider than this (max - min over median) are timed again
_NOISY = 0.3  # still wider: the timings cannot rank candidates; the predictions do
_PARTED = 0.15  # predicted and measured step time further apart than this: said in the notes


def fit_budget(budget: object) -> int:
    """The budget in bytes; fractions are refused (what they are a fraction of moves with the levers)."""
    spec = parse_budget(budget)
    if spec.bytes is None:
        raise BudgetError(
            f"fit takes a budget in bytes ('6GiB', 6442450944), got {budget!r}: a fraction of the way from P_min "
            "to P_none (memfit plan's budgets) means nothing across levers that move both"
        )
    return spec.bytes


def parse_allow(allow: str | Iterable[str] | None) -> set[str]:
    """Lever names from ``"amp,bf16"`` or a list; unknown names raise PlanError."""
    if allow is None:
        return set()
    items = allow.split(",") if isinstance(allow, str) else list(allow)
    names = {str(a).strip() for a in items if str(a).strip()}
    unknown = sorted(n for n in names if n not in LEVERS)
    if unknown:
        raise PlanError(f"unknown lever {unknown[0]!r} in allow; levers are {', '.join(LEVERS)}")
    return names


class _Stages:
    """Progress: ``progress(description, stage, stages)`` through fit's stages."""

    NAMES = ("which levers apply", "timing probes", "exact peaks and plans", "timing the candidates")

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.stage = 0

    def start(self, stage: int, detail: str = "") -> None:
        self.stage = stage
        self(detail)

    def __call__(self, detail: str = "") -> None:
        if self.progress is not None:
            name = self.NAMES[self.stage]
            self.progress(f"{name}: {detail}" if detail else name, self.stage, len(self.NAMES))


def _module_seconds(times: dict[tuple[Phase, str], float]) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for (phase, name), seconds in times.items():
        pair = out.setdefault(name, [0.0, 0.0])
        pair[0 if phase is Phase.FORWARD else 1] += seconds
    return {name: (f, b) for name, (f, b) in out.items()}


class _Times:
    """Step times of every combination, predicted from a few measurements (module
    docstring, step 2). Times only: peaks are always measured."""

    def __init__(self) -> None:
        self.base: StepTimes | None = None
        """The step as it is (None: it does not run on the device)."""
        self.micro: dict[str, StepTimes] = {}
        """One micro-batch of :attr:`micro_k`, per precision."""
        self.micro_k = 1
        self.precision: dict[str, StepTimes] = {}
        self.optimizer: dict[tuple, float] = {}
        self.offload: StepTimes | None = None
        self.overhead_s: float | None = None
        """What selective recompute's dispatch mode adds per op (one figure for the host)."""
        self.fallback: DeviceRates | None = None
        self.probes = 0
        """Configurations run for real to measure these."""

    # -- what was measured --------------------------------------------------------------------

    def full(self, precision: str) -> StepTimes | None:
        """The whole batch's probe in ``precision`` (None: not measured, or stopped)."""
        probe = self.base if precision == "fp32" else self.precision.get(precision)
        return probe if probe is not None and probe.seconds else None

    def per_micro_batch_s(self, precision: str) -> float:
        """The fixed cost each micro-batch adds in ``precision``: ``K * t(B/K) = A + K*c``
        and ``t(B) = A + c`` (forward and backward); fp32's where that precision has no
        micro-batch probe."""
        full, part = self.full(precision), self.micro.get(precision)
        if full is None or part is None or not part.seconds:
            if precision != "fp32":
                return self.per_micro_batch_s("fp32")
            return 0.0
        k = self.micro_k
        return (k * part.forward_backward_median - full.forward_backward_median) / (k - 1)

    def forward_backward(self, precision: str) -> tuple[float, bool]:
        """The whole batch's forward and backward in ``precision``, and whether that is only
        a lower bound (its probe was stopped)."""
        assert self.base is not None
        if precision == "fp32" or precision not in self.precision:
            return self.base.forward_backward_median, False
        probe = self.precision[precision]
        if probe.seconds:
            return probe.forward_backward_median, False
        return max(probe.median, self.base.forward_backward_median), True

    def seconds(self, combo: Combo, base: Combo) -> tuple[float, bool]:
        """Predicted step time of ``combo`` without recompute, and whether it is a lower bound."""
        if self.base is None:
            return math.inf, False
        fb, lower = self.forward_backward(combo.precision)
        t = fb + (combo.micro_batches - 1) * self.per_micro_batch_s(combo.precision)
        t += self.base.median - self.base.forward_backward_median  # the optimizer phase as it is
        key, base_key = _optimizer_key(combo), _optimizer_key(base)
        if key in self.optimizer and base_key in self.optimizer:
            t += self.optimizer[key] - self.optimizer[base_key]
        if combo.offload and self.offload is not None:
            t += self.offload.median - self.base.median
        return max(t, 0.0), lower

    def module_times(self, combo: Combo) -> dict[str, tuple[float, float]] | None:
        """(forward, backward) seconds of every module in one micro-batch's step of
        ``combo``: measured for the whole batch in its precision, and for ``k``
        micro-batches per module ``a/k + c`` through the whole batch's and the ``K``-th's.
        A precision whose probe was stopped: fp32's times, scaled by its lower bound."""
        if self.base is None or not self.base.module_times:
            return None
        k, p = combo.micro_batches, combo.precision
        full = self.full(p)
        own = p if full is not None and full.module_times else "fp32"
        whole = _module_seconds((full if own == p else self.base).module_times)  # type: ignore[union-attr]
        part = self.micro.get(own)
        if k > 1 and part is not None and part.module_times:
            small = _module_seconds(part.module_times)
            kk = self.micro_k

            def at(t1: float, tk: float) -> float:
                a = (t1 - tk) / (1 - 1 / kk)
                return max(0.0, a / k + (t1 - a))

            whole = {n: (at(f, small.get(n, (f, b))[0]), at(b, small.get(n, (f, b))[1])) for n, (f, b) in whole.items()}
        elif k > 1:
            whole = {n: (f / k, b / k) for n, (f, b) in whole.items()}
        if own != p:
            fb, _ = self.forward_backward(p)
            ratio = fb / max(self.base.forward_backward_median, 1e-12)
            whole = {n: (f * ratio, b * ratio) for n, (f, b) in whole.items()}
        return whole


def _optimizer_key(combo: Combo) -> tuple:
    """What the optimizer phase depends on: the parameters' dtype, the implementation and
    whether gradients are kept."""
    return (combo.precision == "bf16", combo.foreach, combo.eight_bit, combo.set_to_none)


class _Search:
    """Profiles, predicts, plans and times combinations, each once."""

    def __init__(self, inputs: Any, budget: int, situation: Situation, report: _Stages) -> None:
        self.situation = situation
        self.inputs = inputs
        self.use_cache_off: tuple[str, ...] = ()
        """Modules whose KV cache the plans turn off (learnt from the first plan made)."""
        self.budget = budget
        self.base = Combo(set_to_none=situation.set_to_none)
        self.scales = microbatch.scales(situation)[0]
        self.report = report
        self.times = _Times()
        self.profiles: dict[tuple[StepOptions, int], Profile] = {}
        self.warm = bool(self.optimizer.state)
        """The optimizer has its state (fit's own first step): the step as it is runs warm."""
        self.peaks: dict[Combo, int] = {}
        self.host_peaks: dict[Combo, int] = {}
        self.allocated: dict[Combo, int | None] = {}
        """On CUDA: each combination's allocated peak, beside the reserved one it is judged by."""
        self.plans: dict[Combo, Plan | int] = {}
        self.fake_profiles = 0
        self.chosen_by = "the measured times"

    # the step and its settings, from the situation fit judged the levers in
    model = property(lambda self: self.situation.model)
    optimizer = property(lambda self: self.situation.optimizer)
    args = property(lambda self: self.situation.args)
    kwargs = property(lambda self: self.situation.kwargs)
    loss_fn = property(lambda self: self.situation.loss_fn)
    targets = property(lambda self: self.situation.targets)
    device = property(lambda self: self.situation.device)
    fake_cuda = property(lambda self: self.situation.fake_cuda)
    """The step runs on fake CUDA: peaks from fake-CUDA profiles, times from the cost model only."""
    settings = property(lambda self: self.situation.settings)
    """On CUDA: the process's allocator settings, which peaks are judged under."""

    def options(self, combo: Combo) -> StepOptions:
        """The step a combination runs: each lever sets its fields of the step options."""
        return StepOptions(**{k: v for lever in catalog.ALL for k, v in lever.step(combo, self.situation).items()})

    def levers(self, combo: Combo, plan: Plan | None) -> tuple[str, ...]:
        return tuple(lever.name for lever in catalog.ALL if lever.used(combo, plan, self.situation))

    def label(self, combo: Combo, plan: Plan | None = None) -> str:
        levers = self.levers(combo, plan)
        return describe(levers, self.options(combo), plan, optimizer_type=type(self.optimizer).__name__) or "as it is"

    # -- measurements ---------------------------------------------------------------------------

    def _timed(self, what: str, inputs: Any, options: StepOptions, targets: Any, **kw: Any) -> StepTimes | None:
        """Real steps of one configuration (see :func:`time_steps`); None when it does not
        fit on the device."""
        if what:
            self.report(what)
        try:
            return time_steps(self.model, inputs, self.loss_fn, self.optimizer, step=options, targets=targets, **kw)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    def probe(self, ks: list[int], precisions: list[str], combos: list[Combo]) -> None:
        """The measurements every prediction rests on (module docstring, step 2)."""
        t = self.times
        base = self.base
        t.base = self._timed(
            "the step as it is",
            self.inputs,
            self.options(base),
            self.targets,
            steps=_TIMED_STEPS,
            warmup=0 if self.warm and base == Combo() else 1,  # fit's first step was this one
            clock=True,
            retry_spread=_SPREAD,
        )
        if t.base is None:
            return  # predictions then come from the cost model alone (see seconds())
        slow, slow_warmup = _SLOW * t.base.median, _SLOW_WARMUP * t.base.median
        if len(ks) > 1:
            k = ks[-1]
            part, part_targets = self.micro(k)
            # a micro-batch after the first: gradients exist and accumulate
            options = replace(self.options(base), loss_scale=self.scales[k], set_to_none=False)
            got = self._timed(
                f"one micro-batch of {k}", part, options, part_targets, steps=_TIMED_STEPS, clock=True, retry_spread=_SPREAD
            )
            if got is not None:
                t.micro["fp32"], t.micro_k = got, k
        for p in precisions[1:]:
            combo = replace(base, precision=p)
            got = self._timed(
                self.label(combo),
                self.inputs,
                self.options(combo),
                self.targets,
                steps=2,
                clock=True,
                give_up_over=slow,
                warmup_give_up_over=slow_warmup,
            )
            if got is not None:
                t.precision[p] = got
            if got is not None and got.seconds and t.micro_k > 1:
                # micro-batches in this precision: their fixed cost is its own (kernels, casts)
                k = t.micro_k
                options = replace(self.options(combo), loss_scale=self.scales[k], set_to_none=False)
                part, part_targets = self.micro(k)
                small = self._timed(
                    f"one micro-batch of {k}, {self.label(combo)}", part, options, part_targets, steps=_TIMED_STEPS, clock=True
                )
                if small is not None:
                    t.micro[p] = small
        keys: dict[tuple, Combo] = {}
        for combo in combos:
            keys.setdefault(_optimizer_key(combo), replace(combo, micro_batches=1, offload=False))
        if len(keys) > 1:
            for i, (key, combo) in enumerate(keys.items()):
                self.report(f"optimizer step alone {i + 1}/{len(keys)}: {self.label(combo)}")
                try:
                    t.optimizer[key] = optimizer_step_time(
                        self.model, self.inputs, self.optimizer, step=self.options(combo), steps=2
                    )
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
        if any(c.offload for c in combos):
            combo = replace(base, offload=True)
            t.offload = self._timed(self.label(combo), self.inputs, self.options(combo), self.targets, steps=_TIMED_STEPS)
        t.probes = 1 + len(t.micro) + len(precisions) - 1 + (len(keys) if len(keys) > 1 else 0) + any(c.offload for c in combos)

    def predict(self, combo: Combo) -> tuple[float, bool]:
        """Predicted step time without recompute, and whether it is only a lower bound."""
        if self.times.base is not None:
            return self.times.seconds(combo, self.base)
        # The step does not run on the device: the cost model's round figures, from FLOPs,
        # output bytes and op count of its exact fake-tensor profile.
        # The whole batch in one: a fake profile of k micro-batches runs only the first
        # three (first_micro_batches), so its FLOPs are not the step's; k micro-batches do
        # the whole batch's FLOPs and bytes, and launch every op k times.
        prof = self.profile(replace(self.options(combo), micro_batches=1, loss_scale=None))
        if self.times.fallback is None:  # the (simulated) GPU's rates: the profile names it
            self.times.fallback = DeviceRates.for_device("cuda" if self.fake_cuda else str(self.device), prof.gpu)
        ops = len(prof.ledger.ops) * combo.micro_batches
        nbytes = sum(b.nbytes for b in prof.ledger.blocks if b.born >= 0)
        flops = prof.step_flops
        if combo.precision == "fp32" and (self.device.type == "cuda" or self.fake_cuda):
            flops *= self.times.fallback.fp32_slower  # the CUDA rates are tensor-core figures
        return self.times.fallback.estimate(flops, nbytes, 3 * ops), False

    # -- peaks and plans ------------------------------------------------------------------------

    def micro(self, k: int) -> tuple[Any, Any]:
        """The first of ``k`` micro-batches (views of the whole batch): inputs and targets."""
        args, kwargs, targets = split_batch(self.args, self.kwargs, self.targets, k)[0]
        return (args[0] if isinstance(self.inputs, torch.Tensor) else join_inputs(args, kwargs)), targets

    def profile(self, options: StepOptions, micro_of: int = 1) -> Profile:
        """The exact fake-tensor profile of a step (of the first of ``micro_of``
        micro-batches, default the whole batch), once. Of many micro-batches, the first three
        run (:func:`first_micro_batches`): the peak is the whole step's, and fake tensors
        cost per op dispatched."""
        key = (options, micro_of)
        if key not in self.profiles:
            self.fake_profiles += 1
            inputs, targets = (self.inputs, self.targets) if micro_of == 1 else self.micro(micro_of)
            # With transformers' KV cache off where a plan turned it off: the step the plan trains.
            with first_micro_batches(3), switched_off(self.model, self.use_cache_off):
                self.profiles[key] = measure_profile(
                    self.model,
                    inputs,
                    loss_fn=self.loss_fn,
                    optimizer=self.optimizer,
                    fake=Where.FAKE_CUDA if self.fake_cuda else Where.FAKE,
                    step=options,
                    targets=targets,
                )
        return self.profiles[key]

    def peak(self, combo: Combo) -> int:
        """The exact peak the budget bounds: on CUDA (real or fake) the caching allocator's
        reserved peak (memfit's model of it), else the tensor peak."""
        if combo not in self.peaks:
            self.report(f"fake-tensor profile: {self.label(combo)}")
            prof = self.judged(self.profile(self.options(combo)), combo)
            self.peaks[combo] = prof.budget_peak_bytes
            self.allocated[combo] = prof.allocated_peak_bytes
            self.host_peaks[combo] = prof.ledger.host_peak_bytes
        return self.peaks[combo]

    def judged(self, prof: Profile, combo: Combo) -> Profile:
        """``prof`` with its allocator figures under ``combo``'s allocator settings (with
        ``expandable_segments``, the same ledger replayed under them)."""
        if not combo.expandable or self.settings is None:
            return prof
        return prof.under(self.expandable_settings)

    @property
    def expandable_settings(self) -> AllocatorSettings:
        assert self.settings is not None
        return replace(self.settings, expandable_segments=True)

    def host_note(self, combo: Combo) -> str:
        """What an offloading step holds in host memory, for its what-if row."""
        return f"host memory {format_bytes(self.host_peaks[combo])}" if combo.offload else ""

    def overhead(self, combo: Combo) -> float:
        """Seconds selective recompute's dispatch mode adds per op on this host, measured once
        (a per-op-call cost: the same under autocast or another dtype)."""
        if self.times.overhead_s is None:
            self.times.overhead_s = selective_overhead_s(self.device)
        return self.times.overhead_s

    def plan(self, combo: Combo) -> Plan | int:
        """A recompute plan for ``combo`` at the budget, or ``P_min`` when none fits."""
        if combo in self.plans:
            return self.plans[combo]
        self.report(f"planning recompute: {self.label(combo)}")
        k = combo.micro_batches
        options = self.options(combo)
        inputs, targets = self.inputs, self.targets
        if k > 1:
            # One micro-batch's step, starting with the gradients the ones before it left
            # (views of the whole batch, so the inputs alive are the same).
            inputs, targets = self.micro(k)
            options = replace(options, micro_batches=1, loss_scale=self.scales[k], set_to_none=False)
        # The exact step on fake tensors (verified there too), its modules' times those
        # measured by the probes: the recompute time is predicted, the peak is exact.
        prof = self.judged(self.profile(options, k), combo)
        seconds = self.times.module_times(combo)
        overhead = None
        if seconds is not None:
            modules = {
                name: replace(
                    m, forward_time_s=seconds.get(name, (0.0, 0.0))[0], backward_time_s=seconds.get(name, (0.0, 0.0))[1]
                )
                for name, m in prof.modules.items()
            }
            predicted, _ = self.predict(combo)
            prof = replace(prof, modules=modules, time_source="measured", step_time_s=predicted / k, device=str(self.device))
            overhead = self.overhead(combo)
        # The accumulated step holds a few scalars more than one micro-batch's (the loss sum).
        slack = max(0, self.peak(combo) - prof.budget_peak_bytes) if k > 1 else 0
        try:
            result: Plan | int = make_plan(
                self.model,
                inputs,
                self.budget - slack,
                loss_fn=self.loss_fn,
                optimizer=self.optimizer,
                profile=prof,
                op_overhead_s=overhead,
                targets=targets,
            )
        except BudgetInfeasibleError as exc:
            result = exc.min_peak_bytes + slack
        self.plans[combo] = result
        if isinstance(result, Plan):
            self.use_cache_off = result.use_cache_off
        return result

    def candidate(self, combo: Combo) -> Candidate[Combo] | int:
        """``combo`` within the budget (with a plan if needed), or the lowest peak it reaches."""
        peak = self.peak(combo)
        plan = None
        if peak > self.budget:
            if combo.offload:
                # Checkpointed regions keep their own saved tensors (save_on_cpu does not
                # see them), which the planner does not model: no recompute with offload.
                return peak
            result = self.plan(combo)
            if isinstance(result, int):
                return result
            plan = result
            peak = plan.predicted_peak_bytes + max(0, self.peak(combo) - plan.none_peak_bytes)
        seconds = self.predict(combo)[0] + (self.recompute_s(combo, plan) if plan is not None else 0.0)
        return Candidate(combo, plan, peak, seconds, self.levers(combo, plan))

    def recompute_s(self, combo: Combo, plan: Plan) -> float:
        """The plan's predicted recompute time per step (a plan per micro-batch)."""
        if plan.extra_compute_s is not None:
            return combo.micro_batches * plan.extra_compute_s
        # No module times (the step did not run on the device): the recompute's share of
        # the step's FLOPs, of the step's time.
        prof = self.profile(self.options(combo))
        return self.predict(combo)[0] * combo.micro_batches * plan.extra_flops / max(1, prof.step_flops)

    def host_drift(self) -> float | None:
        """The step as it is, timed again: its median over the probe's (how much slower the
        host runs now than when the predictions were made)."""
        base = self.times.base
        if base is None or not base.seconds:
            return None
        again = self._timed(
            "", self.inputs, self.options(self.base), self.targets, steps=_TIMED_STEPS, warmup=0 if self.warm else 1
        )
        if again is None or not again.seconds:
            return None
        return again.median / base.median

    def run(self, cand: Candidate[Combo], steps: int, *, record: bool = True, stop_above: float | None = None) -> StepTimes | None:
        """``cand`` for real, its plan applied: step times and (``record``) the ledger's peak."""
        plan = cand.plan
        if plan is not None and plan.checkpointed:
            apply_choices(self.model, {name: (c.mode, c.save_ops) for name, c in plan.checkpointed.items()}, plan.use_cache_off)
        try:
            return self._timed(
                "",
                self.inputs,
                self.options(cand.choice),
                self.targets,
                steps=steps,
                warmup=0 if record or steps == 0 else 1,  # the recorded step warms up
                retry_spread=_SPREAD if steps > 1 else None,
                record=record,
                stop_above=stop_above,
            )
        finally:
            if plan is not None and plan.checkpointed:
                remove(self.model)


def _simpler(c: Candidate[Combo]) -> tuple:
    # then fewer micro-batches: bigger ones keep the device busier, which noise can hide
    return (len(c.levers), c.choice.micro_batches)


def fit(
    model: nn.Module,
    inputs: Any,
    budget: int | str,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    allow: str | Iterable[str] | None = None,
    set_to_none: bool = True,
    progress: Progress | None = None,
    targets: Any = None,
    exclude: Mapping[str, str] | None = None,
    fake: bool | str | Where = False,
) -> Recipe:
    """The fastest combination of memory levers whose training step peaks within ``budget``.

    Args:
        model, inputs, loss_fn, optimizer, targets: the step, as for :func:`memfit.profile`
            (micro-batches cut the targets with the inputs).
        budget: bytes bounding the whole step's peak (``6 * 2**30``, ``"6GiB"``); on CUDA (real or fake)
            the caching allocator's reserved peak (what runs out; memfit's model of it).
        allow: opt-in levers that change the numerics (``"amp"``, ``"bf16"``, ``"foreach"``,
            ``"8bit"``; a list or ``"amp,bf16"``). The exact levers (recompute,
            micro-batching, ``zero_grad(set_to_none=True)``, offload) are always weighed.
        set_to_none: what the training loop calls now, ``zero_grad(set_to_none=...)``;
            with False its gradients stay allocated between steps, and switching is a lever.
        progress: optional ``progress(description, stage, stages)`` callback, called as
            each stage (which levers apply, timing probes, exact peaks and plans, timing
            the candidates) advances.
        exclude: exact levers the caller's training loop has no way to use (``"microbatch"``,
            ``"offload"``, ``"set_to_none"``), each with the reason, which ``recipe.left_out``
            then gives: a framework's loop (transformers' Trainer) has no switch for
            activation offload; Lightning's zeroes the gradients where it chooses.
        fake: ``"cuda"``: the step as a CUDA GPU runs it, on fake CUDA (a model on the CPU,
            as for :func:`memfit.profile`): peaks exact on fake tensors (reserved, from the
            allocator model), step times only predicted by the cost model from FLOPs, bytes
            and op counts (nothing can be timed), so the recipe is chosen by predicted times
            and nothing is measured (``measured_*`` None; the notes say so). Activation
            offload is not weighed there.

    Returns:
        A :class:`Recipe`: the levers, the predicted and the measured peak and step time,
        the what-if rows (peaks exact; step times predicted, measured beside for the few
        candidates that ran), why each other lever was left out, ``notes`` (prediction
        and measurement that part, noisy timings) and ``search`` (how many combinations
        were considered, weighed, planned and timed). ``recipe.snippet()`` is
        code for a training loop; ``memfit.apply_recipe(recipe, model, optimizer)`` applies it. The model,
        its gradients and buffers, the optimizer and the RNG are left as they were.

    Raises:
        BudgetInfeasibleError: no allowed combination fits; the message states the lowest
            peak they reach.
    """
    started = time.perf_counter()
    target = fit_budget(budget)
    s = _situation(model, inputs, loss_fn, optimizer, targets, allow, exclude, set_to_none, fake)
    report = _Stages(progress)

    # 1. What each lever may do here (micro-batching probes the loss on the real model).
    report.start(0)
    offers, left_out = _offers(s)

    # One real step in a sandbox that stays open for the whole search: the optimizer has its
    # state from here on, so no fake-tensor profile, plan or timed run needs a warm-up step
    # of its own to create it. Closing it restores the model and the optimizer.
    # (On fake CUDA no real step runs: each fake profile creates the state it needs.)
    real_state = (
        contextlib.nullcontext()
        if s.fake_cuda
        else _optimizer_state(s.model, s.args, s.kwargs, s.loss_fn, s.optimizer, s.targets)
    )
    with real_state:
        search = _Search(inputs, target, s, report)
        if "offload" in offers:
            _measure_offload(search, offers, left_out)
        axes, singles, combos = _combinations(search.base, offers)
        notes = _measurements(search, axes, combos)  # 2
        queue = _weigh(search, singles, combos, left_out)  # 3
        best = _choose_best(search, queue, notes)  # 4
        return _recipe(search, best, queue, singles, combos, left_out, notes, budget=budget, started=started)


def _situation(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer | None,
    targets: Any,
    allow: str | Iterable[str] | None,
    exclude: Mapping[str, str] | None,
    set_to_none: bool,
    fake: bool | str | Where,
) -> Situation:
    """fit's arguments checked, once, into the :class:`Situation` its levers are judged in."""
    allowed = parse_allow(allow)
    where = fake_device(fake)
    if where is Where.FAKE:
        raise WorkloadError("fit weighs its peaks on fake tensors already: fake takes only 'cuda' (a simulated GPU)")
    exclude = dict(exclude or {})
    unknown = sorted(set(exclude) - {"microbatch", "offload", "set_to_none"})
    if unknown:
        raise PlanError(
            f"fit can exclude the levers 'microbatch', 'offload' and 'set_to_none', not {', '.join(map(repr, unknown))}"
        )
    the = checked_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=where, targets=targets, unwrapped=True)
    if applied_choices(the.model) is not None:
        raise PlanError("this model already has a plan applied; call memfit.remove(model) before fitting it")
    return Situation(
        step=the,
        allowed=allowed,
        exclude=exclude,
        set_to_none=set_to_none,
        settings=allocator_settings_from_env() if the.cuda else None,
    )


def _measurements(search: _Search, axes: dict[str, list], combos: list[Combo]) -> list[str]:
    """2. The few measurements every combination's time is predicted from; the notes they call for."""
    search.report.start(1)
    if search.fake_cuda:
        return [
            "fake CUDA: peaks are exact on fake tensors (reserved, from memfit's model of the caching allocator); step "
            "times are predicted by the cost model (FLOPs, bytes, op counts at fixed GPU rates), not measured, and "
            "chose the recipe: time it on the GPU"
        ]
    search.probe(axes["micro_batches"], axes["precision"], combos)
    if search.times.base is None:
        return [
            "the step as it is did not run on the device (out of memory): step times are the cost model's round "
            "figures for this device until the candidates are timed"
        ]
    return []


def _weigh(search: _Search, singles: list[Combo], combos: list[Combo], left_out: dict[str, Reason]) -> _Queue:
    """3. Exact peaks (each lever alone for the table), then every combination in order of
    predicted time, planned where it is over, until the next is clearly slower. None fitting
    is the one-line error that says how low the levers reach."""
    search.report.start(2)
    for combo in singles:
        search.peak(combo)
    queue = _Queue(search, combos)
    queue.weigh()
    if not queue.cands:
        assert queue.lowest is not None
        raise _infeasible(search, *queue.lowest, left_out)
    base = search.base
    if search.peaks[base] > search.budget and base not in search.plans:
        search.plan(base)  # recompute alone, for the what-if table
    return queue


def _infeasible(search: _Search, peak: int, combo: Combo, left_out: dict[str, Reason]) -> BudgetInfeasibleError:
    # the one line a refused budget prints: say why micro-batches were not weighed
    left = [f"micro-batching left out: {left_out['microbatch']}"] if "microbatch" in left_out else []
    return infeasible(
        search.budget,
        peak,
        search.label(combo) + ("" if combo.offload else " and recompute"),  # offload is not combined with recompute
        f"as it is the step peaks at {format_bytes(search.peaks[search.base])}",
        hints=left,
        opt_in=[lever for lever in OPT_IN_LEVERS if lever not in search.situation.allowed],
    )


def _choose_best(search: _Search, queue: _Queue, notes: list[str]) -> Candidate[Combo]:
    """4. The few predicted fastest, for real (on fake CUDA, by their predicted times)."""
    search.report.start(3)
    if search.fake_cuda:
        best = choose(queue.cands, _simpler)  # by predicted time: nothing runs on fake tensors
        search.chosen_by = "the predictions"
    else:
        best = _time_candidates(search, queue, notes)
    target = search.budget
    if best.measured is not None and best.measured.peak_bytes is not None and best.measured.peak_bytes > target:
        notes.append(
            f"the recorder measured a peak of {best.measured.peak_bytes} bytes, {best.measured.peak_bytes - target} over "
            f"the budget that fake tensors met ({best.peak_bytes} bytes): lower the budget by that much"
        )
    if best.choice.expandable and not search.fake_cuda:
        notes.append(
            "expandable_segments:True cannot be switched on in a process whose CUDA allocator has started: the recipe "
            "was timed without it (the setting moves segments, not kernels); its peak is the allocator model's"
        )
    return best


def _parted(search: _Search, best: Candidate[Combo], cands: list[Candidate[Combo]], measured_time: float, now: float) -> str:
    """The note for a recipe whose measured time parted from its prediction (at the host's speed then)."""
    text = (
        f"predicted {now:.3f} s/step but measured {measured_time:.3f} s ({measured_time / now - 1:+.0%}): "
        "prediction and measurement part by more than 15%"
    )
    # Every recipe that ran parting alike (a shared host whose load changed since the
    # probes) moves the times, not their order.
    ratios = sorted(c.measured_s / c.time_s for c in cands if c.measured is not None and len(c.measured.seconds) >= _TIMED_STEPS)
    if len(ratios) >= 2 and abs(measured_time / best.time_s / ratios[len(ratios) // 2] - 1) <= _PARTED:
        text += (
            f"; all {len(ratios)} recipes timed in full ran {ratios[len(ratios) // 2] - 1:+.0%} against their "
            "predictions: the host's speed changed since the probes, not the predictions' order"
        )
    else:
        text += f"; {search.chosen_by} chose"
    if best.measured is not None and best.measured.spread > _NOISY:
        text += " (timings on this host were noisy)"
    return text


def _recipe(
    search: _Search,
    best: Candidate[Combo],
    queue: _Queue,
    singles: list[Combo],
    combos: list[Combo],
    left_out: dict[str, Reason],
    notes: list[str],
    *,
    budget: int | str,
    started: float,
) -> Recipe:
    """The :class:`Recipe` of the chosen candidate: what was measured beside what was predicted,
    every lever not used with its reason, and how much the search ran."""
    cands, base, target, s = queue.cands, search.base, search.budget, search.situation
    measured_time = best.measured.median if best.measured is not None else None
    host_speed, measured_time = _host_speed(search, best, measured_time, notes)
    now = best.time_s * (host_speed or 1.0)  # the prediction at the host's speed when the recipe was measured
    if measured_time is not None and best.time_s > 0 and abs(measured_time / now - 1) > _PARTED:
        notes.append(_parted(search, best, cands, measured_time, now))
    what_if = _what_if(search, singles, base, best, cands)
    unused = (
        Reason(Why.NOT_NEEDED, "not needed: the step fits as it is")
        if search.peaks[base] <= target
        else Reason(Why.NOT_CHOSEN, "the chosen recipe fits faster (see the what-if rows)")
    )
    for lever in catalog.ALL:
        if (s.cuda or not lever.cuda_only) and lever.name not in best.levers and lever.name not in left_out:
            left_out[lever.name] = unused
    base_time = search.times.base.median if search.times.base is not None else None
    if s.fake_cuda:
        base_time = search.predict(base)[0]  # predicted, as every time of this recipe (times_predicted)
    settings = search.expandable_settings if best.choice.expandable else search.settings
    decision = Decision(
        budget_bytes=target,
        levers=best.levers,
        step=search.options(best.choice),
        plan=best.plan if best.plan is not None and best.plan.checkpointed else None,
        left_out={lever: left_out[lever] for lever in LEVERS if lever in left_out and lever not in best.levers},
        precision=best.choice.precision,
        budget=str(budget),
        allocator_conf=settings.describe() if settings is not None else "",
    )
    prediction = Prediction(
        predicted_peak_bytes=best.peak_bytes,
        predicted_step_time_s=best.time_s,
        base_peak_bytes=search.peaks[base],
        allocated_peak_bytes=best.plan.allocated_peak_bytes if best.plan is not None else search.allocated[best.choice],
        what_if=what_if,
    )
    measurement = Measurement(
        measured_peak_bytes=best.measured.peak_bytes if best.measured is not None else None,
        measured_step_time_s=measured_time,
        base_step_time_s=base_time,
        times_predicted=s.fake_cuda,
        host_speed=host_speed,
    )
    return Recipe(decision, prediction, measurement, _provenance(search, queue, combos, notes, started))


def _provenance(search: _Search, queue: _Queue, combos: list[Combo], notes: list[str], started: float) -> Provenance:
    """What the recipe was fit for (the step's model, inputs, loss, optimizer, device) and how much the search ran."""
    s = search.situation
    return Provenance(
        batch_size=batch_size_of(s.args, s.kwargs),
        inputs_kind="tensor" if isinstance(search.inputs, torch.Tensor) else ("kwargs" if s.kwargs else "args"),
        default_loss=s.loss_fn is None,
        targets=s.targets is not None,
        model_type=type(s.model).__name__,
        fingerprint=fingerprint(s.model),
        optimizer_type=type(s.optimizer).__name__,
        device="fake:cuda:0" if s.fake_cuda else str(s.device),
        fit_time_s=time.perf_counter() - started,
        notes=notes,
        search={
            "combinations": len(combos),
            "weighed": len(search.peaks),
            "planned": len(search.plans),
            "timed": sum(1 for c in queue.cands if c.measured is not None),
            "probes": search.times.probes,
            "fake_profiles": search.fake_profiles,
        },
    )


def _host_speed(
    search: _Search, best: Candidate[Combo], measured_time: float | None, notes: list[str]
) -> tuple[float | None, float | None]:
    """The chosen recipe measured more than 15% off its prediction: tell a host whose speed
    changed since the probes (a 2-core CPU's step moves 15% from one minute to the next, and
    a whole run of steps with it, even when nothing else runs here) from a prediction that
    failed. The recipe is timed again between two timings of the step as it is, so both see
    the same host. Returns (the step as it is then over its probe's time, the recipe's
    median then); (None, ``measured_time``) when nothing was timed again."""
    if measured_time is None or best.time_s <= 0 or abs(measured_time / best.time_s - 1) <= _PARTED:
        return None, measured_time
    search.report("the recipe measured off its prediction: it again, between two steps as it is")
    before = search.host_drift()
    again = search.run(best, _TIMED_STEPS, record=False)
    after = search.host_drift()
    if before is None or after is None or again is None or not again.seconds or math.isinf(again.median):
        return None, measured_time
    drift = (before + after) / 2
    now = best.time_s * drift
    base = search.times.base
    then = f" ({base.median:.3f} s then)" if base is not None else ""
    notes.append(
        f"measured {measured_time:.3f} s/step against {best.time_s:.3f} s predicted, so timed again between two runs of "
        f"the step as it is, which ran {before - 1:+.0%} and {after - 1:+.0%} against fit's probe{then}: at the host's "
        f"speed then the recipe is predicted {now:.3f} s/step and measured {again.median:.3f} s ({again.median / now - 1:+.0%})"
    )
    return drift, again.median


@contextlib.contextmanager
def _optimizer_state(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, optimizer: torch.optim.Optimizer, targets: Any
) -> Iterator[None]:
    """Inside, the optimizer has its state (one real step, in a sandbox restored on exit)."""
    with real_sandbox(model, args, kwargs, optimizer, targets=targets) as box:
        if not optimizer.state:
            try:
                with Scope(box.model) as scope:
                    run_step(box, scope, loss_fn)  # a failing forward is named as the profile names it
            except torch.OutOfMemoryError:
                # The step does not fit the device: each measurement creates the state as it needs.
                optimizer.state.clear()
                torch.cuda.empty_cache()
        yield


def _offers(situation: Situation) -> tuple[dict[str, tuple], dict[str, Reason]]:
    """Each lever's settings to weigh on this step, or the reason it is left out."""
    offers: dict[str, tuple] = {}
    left_out: dict[str, Reason] = {}
    for lever in catalog.ALL:
        got = lever.settings(situation)
        if isinstance(got, Reason):
            left_out[lever.name] = got
        else:
            offers[lever.name] = got
    return offers, left_out


def _measure_offload(search: _Search, offers: dict[str, tuple], left_out: dict[str, Reason]) -> None:
    """Offload's peak, measured before it is weighed: a lever that cannot be measured here
    must not stop the search, so it is left out with the reason."""
    try:
        search.peak(replace(search.base, offload=True))
    except MemfitError:
        raise
    except Exception as exc:
        del offers["offload"]
        why = f"could not be measured here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        left_out["offload"] = Reason(Why.UNAVAILABLE, why)


def _combinations(base: Combo, offers: dict[str, tuple]) -> tuple[dict[str, list], list[Combo], list[Combo]]:
    """The settings of each :class:`Combo` field (the step's own first), each lever alone
    (the what-if table's rows), and every combination the levers allow together."""
    axes: dict[str, list] = {f.name: [getattr(base, f.name)] for f in dataclasses.fields(Combo)}
    for lever in catalog.ALL:
        if lever.field:
            axes[lever.field] += offers.get(lever.name, ())
    singles = [base] + [replace(base, **{name: value}) for name, values in axes.items() for value in values[1:]]
    combos = [
        combo
        for combo in (Combo(*values) for values in itertools.product(*axes.values()))
        if all(lever.allows(combo) for lever in catalog.ALL)
    ]
    return axes, singles, combos


class _Queue:
    """The combinations in order of predicted time, weighed (exact peak, a plan where it is
    over) as far as needed: those that fit are :attr:`cands`."""

    def __init__(self, search: _Search, combos: list[Combo]) -> None:
        self.search = search
        self.order = sorted(combos, key=lambda c: (search.predict(c)[0], len(search.levers(c, None))))
        self.cands: list[Candidate[Combo]] = []
        self.lowest: tuple[int, Combo] | None = None
        """The lowest peak reached by a combination that does not fit, and which."""

    def bound(self) -> float | None:
        """No combination predicted slower than this (without recompute, which only adds)
        can change which candidates :func:`_time_candidates` runs: they are the one
        :func:`~memfit.levers.ties.choose` picks among those within :data:`~memfit.levers.ties.TIE` of the fastest, and the
        fastest others within :data:`_MARGIN`, :data:`_MAX_TIMED` in all."""
        if not self.cands:
            return None
        times = sorted(c.time_s for c in self.cands)
        fastest = times[0]
        if len(times) >= _MAX_TIMED:
            return min(fastest * (1 + _MARGIN), max(fastest * (1 + TIE), times[_MAX_TIMED - 1]))
        return fastest * (1 + _MARGIN)

    def weigh(self, up_to: float | None = None) -> None:
        """Weigh combinations until the next is predicted slower than ``up_to`` (default
        :meth:`bound`)."""
        while self.order:
            bound = up_to if up_to is not None else self.bound()
            if bound is not None and self.search.predict(self.order[0])[0] > bound:
                return
            combo = self.order.pop(0)
            result = self.search.candidate(combo)
            if isinstance(result, int):
                if self.lowest is None or result < self.lowest[0]:
                    self.lowest = (result, combo)
            else:
                self.cands.append(result)


def _time_candidates(search: _Search, queue: _Queue, notes: list[str]) -> Candidate[Combo]:
    """Run for real the candidate the predictions choose and those predicted within
    :data:`_MARGIN` of the fastest (at most :data:`_MAX_TIMED` in all), and choose by the
    measured times; by the predictions when those are too noisy to rank.

    The predictions' choice runs first, its recorded step as the warm-up (its ledger peak
    is the recipe's measured peak). Each other one races it: a warm-up, then its steps
    until most of them are over the first's median plus :data:`~memfit.levers.ties.TIE` (it cannot be chosen
    then). One that wins has its peak recorded after."""
    cands = queue.cands
    fastest = min(c.time_s for c in cands)
    pool = sorted((c for c in cands if c.time_s <= fastest * (1 + _MARGIN)), key=lambda c: c.time_s)
    pick = choose(pool, _simpler)
    finalists = [pick] + [c for c in pool if c is not pick][: _MAX_TIMED - 1]
    base = search.times.base
    threshold = None

    def race(group: list[Candidate[Combo]]) -> None:
        nonlocal threshold
        for cand in group:
            search.report(f"{len(timed) + 1}/{len(finalists)}: {search.label(cand.choice, cand.plan)}")
            slow = base is not None and cand.time_s > _SLOW * base.median  # a slow step is timed once, as before
            cand.measured = search.run(cand, 1 if slow else _TIMED_STEPS, record=cand is pick, stop_above=threshold)
            timed.append(cand)
            if cand is pick and cand.measured is not None and not math.isinf(cand.measured.median):
                threshold = cand.measured.median * (1 + TIE)

    timed: list[Candidate[Combo]] = []
    race(finalists)
    # The predictions' choice measured far slower than predicted (a probe that misled, a
    # kernel that is slow only in this combination): what was predicted faster than that
    # measurement runs too, before anything is chosen on a prediction that did not hold.
    drift = None
    trusted = pick.measured is not None and pick.measured.spread <= _NOISY  # else noise explains it
    if trusted and pick.measured_s > pick.time_s * (1 + _PARTED):
        # First, whether the host itself slowed down since the probes ran (a shared
        # machine): the step as it is, again. Then the predictions still rank correctly.
        search.report("the first candidate measured slower than predicted: the step as it is, again")
        drift = search.host_drift()
    if trusted and pick.measured_s > pick.time_s * (drift or 1.0) * (1 + _PARTED):
        search.report("the first candidate measured slower than predicted: weighing more")
        queue.weigh(up_to=pick.measured_s)
        more = sorted((c for c in cands if c not in finalists and c.time_s < pick.measured_s), key=lambda c: c.time_s)
        more = more[: _MAX_TIMED - 1]
        if more:
            finalists += more
            notes.append(
                f"{search.label(pick.choice, pick.plan)} measured {pick.measured_s:.3f} s/step against "
                f"{pick.time_s:.3f} s predicted: {len(more)} more recipe{'s' if len(more) > 1 else ''} predicted faster "
                "than that measurement ran too"
            )
            race(more)
    ran = [c for c in finalists if c.measured is not None and not math.isinf(c.measured.median)]
    if not ran:
        raise MemfitError(
            "the chosen recipe ran out of device memory when measured; memory the ledger does not see (allocator "
            "fragmentation, kernel workspaces) needs headroom: lower the budget"
        )
    noisy = [c for c in ran if c.measured is not None and c.measured.spread > _NOISY]
    if len(ran) > 1 and noisy:
        worst = max(c.measured.spread for c in noisy if c.measured is not None)
        notes.append(
            f"step times on this host spread by {worst:.0%} while fit measured them (after a retry): too noisy to rank "
            f"{len(ran)} recipes predicted within {_MARGIN:.0%} of each other, so the cost model's predictions chose"
        )
        best = choose(ran, _simpler)
        search.chosen_by = "the predictions"
    else:
        best = choose(ran, _simpler, measured=True)
    if best.measured is not None and best.measured.peak_bytes is None:
        search.report(f"recording the peak of {search.label(best.choice, best.plan)}")
        got = search.run(best, 0)
        best.measured.peak_bytes = got.peak_bytes if got is not None else None
    return best


def _what_if(search: _Search, singles: list[Combo], base: Combo, best: Candidate[Combo], cands: list[Candidate[Combo]]) -> list[WhatIf]:
    """Each lever alone and recompute alone (predicted times), every candidate that ran for
    real (measured beside), the chosen one marked."""
    rows: list[WhatIf] = []
    timed = {(c.choice, c.recomputes): c for c in cands if c.measured is not None}
    base_time = search.times.base.median if search.times.base is not None else None

    def row(combo: Combo, plan: Plan | None, peak: int, seconds: float | None, fits: bool, note: str = "") -> WhatIf:
        cand = timed.pop((combo, plan is not None and bool(plan.checkpointed)), None)
        if cand is None:
            return WhatIf(search.label(combo, plan), search.levers(combo, plan), peak, seconds, fits, note=note)
        return cand.row(search.label(cand.choice, cand.plan), chosen=cand is best, note=note)

    for combo in singles:
        peak = search.peaks[combo]
        seconds, lower = search.predict(combo)
        note = search.host_note(combo)
        probe = search.times.precision.get(combo.precision) if combo.precision != "fp32" else None
        if lower and probe is not None and probe.stopped_after is not None and base_time:
            note = f"stopped after {probe.stopped_after:.1f} s: at least {seconds / base_time:.1f}x the step as it is" + (
                f"; {note}" if note else ""
            )
        fits = peak <= search.budget
        if fits and combo in [c.choice for c in cands if not c.recomputes]:
            rows.append(row(combo, None, peak, seconds, fits, note))
        else:
            rows.append(WhatIf(search.label(combo), search.levers(combo, None), peak, seconds, fits, note=note))
    plan = search.plans.get(base)
    if search.peaks[base] <= search.budget:
        rows.append(WhatIf("recompute", ("recompute",), None, None, True, note="not needed: the step fits as it is"))
    elif isinstance(plan, Plan):
        seconds = search.predict(base)[0] + search.recompute_s(base, plan)
        rows.append(row(base, plan, plan.predicted_peak_bytes, seconds, True))
    elif isinstance(plan, int):
        rows.append(WhatIf("recompute", ("recompute",), plan, None, False, note=f"lowest reachable peak {format_bytes(plan)}"))
    for cand in list(timed.values()):  # timed combinations that are no row yet
        rows.append(row(cand.choice, cand.plan, cand.peak_bytes, cand.time_s, True))
    return what_if_order(rows)
