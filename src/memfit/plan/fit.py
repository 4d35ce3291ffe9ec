"""``memfit.fit``: the fastest combination of memory levers whose step fits a budget.

Levers (:data:`~memfit.plan.recipe.LEVERS`): recompute (:func:`memfit.plan`),
micro-batching, ``zero_grad(set_to_none=True)``, activation offload to host memory (a CUDA
step only: ``save_on_cpu``; not combined with recompute, whose checkpointed regions keep
their own saved tensors), and, opt-in because they change what training computes,
autocast (``amp``), bfloat16 parameters (``bf16``), the optimizer's other implementation
(``foreach``) and 8-bit optimizer state (``8bit``: bitsandbytes' AdamW8bit or Adam8bit in
place of torch's AdamW or Adam).

1. What each lever may do here: micro-batching is left out for a model that normalises
   with batch statistics (BatchNorm) and for a loss that is neither the mean nor the sum
   of its micro-batches' losses (probed on the real model, in evaluation mode, restored).
2. Each lever alone: the exact peak of its step on fake tensors (:func:`memfit.profile`
   with :class:`~memfit.measure.step.StepOptions`: nothing estimated by subtraction) and
   its measured step time (median of 3 real steps after a warm-up, in a sandbox; one
   step when that one is over twice the base step's).
3. Every combination, in order of estimated time (the base time plus each lever's
   measured change): its exact peak on fake tensors; over the budget, a recompute plan
   at the budget (planned on one micro-batch's step when there are several: a module
   called once per micro-batch is called several times per step, which the planner does
   not plan; that step starts with the gradients of the micro-batches before it, and its
   peak is the whole step's). A combination's time is measured (median of 3) when it
   fits, plus the plan's predicted recompute time per micro-batch. The search stops once
   the next estimate is slower than the best found.
4. The fastest fitting combination wins; within 5% of it (timing noise on a busy
   host), the one with the fewest levers, then the fewest micro-batches. It is then run for real: its peak from the
   recorder's ledger and its step time (median of 3) go in the Recipe beside the
   predictions.

Everything runs in sandboxes, so the model, its gradients and buffers, the optimizer and
the RNG are as they were.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.apply.cache import switched_off
from memfit.apply.checkpoint import applied_choices, apply_choices, remove, unwrap
from memfit.errors import BudgetError, BudgetInfeasibleError, LossError, MemfitError, PlanError
from memfit.measure import _optim8bit, _torch_compat
from memfit.measure.profile import Progress, check_step
from memfit.measure.profile import profile as measure_profile
from memfit.measure.sandbox import real_sandbox
from memfit.measure.step import StepOptions, eval_mode
from memfit.measure.timing import median_step_time
from memfit.plan.budget import parse_budget
from memfit.plan.planner import plan as make_plan
from memfit.plan.recipe import LEVERS, Recipe, WhatIf, describe
from memfit.plan.result import Plan, fingerprint
from memfit.units import format_bytes
from memfit.workload import (
    batch_size_of,
    call_loss,
    check_arguments,
    default_optimizer,
    join_inputs,
    split_batch,
    split_inputs,
)

__all__ = ["fit", "parse_allow", "fit_budget", "EXACT_LEVERS", "OPT_IN_LEVERS"]

EXACT_LEVERS = ("recompute", "microbatch", "set_to_none", "offload")
"""Levers that leave what training computes as it was: always considered."""
OPT_IN_LEVERS = ("amp", "bf16", "foreach", "8bit")
"""Levers that change the numerics: considered only when ``allow`` names them."""

_MICRO_BATCHES = (2, 4, 8)
_TIMED_STEPS = 3
_TIE = 0.05  # times within 5% are a tie on a busy host: the simpler recipe wins
_SLOW = 2.0  # a lever's step this many times the base step's is timed once, not 3 times
_LOSS_RTOL = 1e-4


@dataclass(frozen=True)
class _Combo:
    """One combination of levers (recompute aside, which is planned per combination)."""

    micro_batches: int = 1
    precision: str = "fp32"
    foreach: bool | None = None
    set_to_none: bool = True
    eight_bit: bool = False
    offload: bool = False


@dataclass
class _Candidate:
    combo: _Combo
    plan: Plan | None
    peak_bytes: int
    time_s: float
    levers: tuple[str, ...]


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


def _loss_scales(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, optimizer: torch.optim.Optimizer, ks: list[int], targets: Any
) -> tuple[dict[int, float], str | None]:
    """Per micro-batch count, the factor on each micro-batch's loss that makes the
    accumulated gradient the full batch's: ``1/k`` for a mean over samples, 1 for a sum.
    Found by comparing the full batch's loss with its micro-batches' (real tensors,
    evaluation mode so dropout does not blur it, no grad, all restored). A loss that is
    neither couples the samples (a mean over the valid tokens of the whole batch, a
    contrastive loss): micro-batches would change the gradient, so that count is left out."""
    scales: dict[int, float] = {}
    why = None
    with real_sandbox(model, args, kwargs, optimizer, targets=targets) as box, torch.no_grad(), eval_mode(box.model):
        try:
            full = float(call_loss(loss_fn, box.model(*box.args, **box.kwargs), box.targets))
        except Exception as exc:  # the training step itself is checked elsewhere; this only probes
            return {}, f"the loss could not be probed in evaluation mode ({type(exc).__name__}: {str(exc)[:120]})"
        for k in ks:
            try:
                parts = [
                    float(call_loss(loss_fn, box.model(*a, **kw), t))
                    for a, kw, t in split_batch(box.args, box.kwargs, box.targets, k)
                ]
            except Exception as exc:
                cause = exc.__cause__ if isinstance(exc, LossError) and exc.__cause__ is not None else exc
                why = (
                    f"the loss of a micro-batch cannot be computed ({type(cause).__name__}: {str(cause)[:120]}); "
                    "a loss_fn that holds the whole batch's targets sees only a micro-batch's outputs: pass the targets "
                    "as targets= and take them as loss_fn(output, targets)"
                )
                break
            mean, total = sum(parts) / k, sum(parts)
            tol = _LOSS_RTOL * max(abs(full), 1e-6)
            if abs(full - mean) <= tol:
                scales[k] = 1.0 / k
            elif abs(full - total) <= tol:
                scales[k] = 1.0
            else:
                why = (
                    f"the batch's loss ({full:.6g}) is neither the mean ({mean:.6g}) nor the sum ({total:.6g}) of its {k} "
                    "micro-batches' losses: the loss couples samples, so micro-batches would change the gradient"
                )
    return scales, why


def _micro_batching(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, optimizer: torch.optim.Optimizer, targets: Any = None
) -> tuple[dict[int, float], str | None]:
    norms = [name for name, m in model.named_modules() if _torch_compat.uses_batch_statistics(m)]
    if norms:
        return {}, (
            f"the model normalises with batch statistics ({type(model.get_submodule(norms[0])).__name__} {norms[0]!r}"
            + (f" and {len(norms) - 1} more" if len(norms) > 1 else "")
            + "): each micro-batch would be normalised with its own, so training would differ"
        )
    batch = batch_size_of(args, kwargs)
    if batch is None:
        return {}, "no input tensor has a batch dimension to split"
    ks = [k for k in _MICRO_BATCHES if batch % k == 0]
    if not ks:
        return {}, f"a batch of {batch} does not split into {', '.join(map(str, _MICRO_BATCHES))} equal micro-batches"
    scales, why = _loss_scales(model, args, kwargs, loss_fn, optimizer, ks, targets)
    return scales, (why if not scales else None)


def _offload_unavailable(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return "activations offloaded to host memory (save_on_cpu) save nothing when the step runs on the host already"
    return f"activation offload to host memory is modelled for CUDA steps; this one runs on {device.type}"


class _Search:
    """Profiles, times and plans combinations, each once."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        loss_fn: Any,
        optimizer: torch.optim.Optimizer,
        budget: int,
        device: torch.device,
        base_set_to_none: bool,
        scales: dict[int, float],
        report: Progress,
        targets: Any,
    ) -> None:
        self.model = model
        self.inputs = inputs
        self.args, self.kwargs = split_inputs(inputs)
        self.loss_fn = loss_fn
        self.targets = targets
        self.optimizer = optimizer
        self.budget = budget
        self.device = device
        self.base_set_to_none = base_set_to_none
        self.scales = scales
        self.report = report
        self.peaks: dict[_Combo, int] = {}
        self.host_peaks: dict[_Combo, int] = {}
        self.times: dict[_Combo, float] = {}
        self.plans: dict[_Combo, Plan | int] = {}
        self.use_cache_off: tuple[str, ...] = ()
        """Modules whose KV cache the plans turn off (learnt from the first plan made)."""

    def options(self, combo: _Combo) -> StepOptions:
        k = combo.micro_batches
        amp = combo.precision == "amp"
        cuda = self.device.type == "cuda"
        return StepOptions(
            micro_batches=k,
            loss_scale=self.scales[k] if k > 1 else None,
            autocast=("float16" if cuda else "bfloat16") if amp else None,
            grad_scaler=amp and cuda,
            set_to_none=combo.set_to_none,
            param_dtype="bfloat16" if combo.precision == "bf16" else None,
            foreach=combo.foreach,
            optimizer_8bit=combo.eight_bit,
            offload=combo.offload,
        )

    def levers(self, combo: _Combo, plan: Plan | None) -> tuple[str, ...]:
        used = set()
        if plan is not None and plan.checkpointed:
            used.add("recompute")
        if combo.micro_batches > 1:
            used.add("microbatch")
        if combo.set_to_none != self.base_set_to_none:
            used.add("set_to_none")
        if combo.precision != "fp32":
            used.add(combo.precision)
        if combo.foreach is not None:
            used.add("foreach")
        if combo.eight_bit:
            used.add("8bit")
        if combo.offload:
            used.add("offload")
        return tuple(lever for lever in LEVERS if lever in used)

    def label(self, combo: _Combo, plan: Plan | None = None) -> str:
        levers = self.levers(combo, plan)
        return describe(levers, self.options(combo), plan, optimizer_type=type(self.optimizer).__name__) or "as it is"

    def peak(self, combo: _Combo) -> int:
        if combo not in self.peaks:
            self.report(f"fake-tensor profile: {self.label(combo)}", 0, 0)
            prof = measure_profile(
                self.model,
                self.inputs,
                loss_fn=self.loss_fn,
                optimizer=self.optimizer,
                fake=True,
                step=self.options(combo),
                targets=self.targets,
            )
            self.peaks[combo] = prof.peak_bytes
            self.host_peaks[combo] = prof.ledger.host_peak_bytes
        return self.peaks[combo]

    def host_note(self, combo: _Combo) -> str:
        """What an offloading step holds in host memory, for its what-if row."""
        return f"host memory {format_bytes(self.host_peaks[combo])}" if combo.offload else ""

    def time(self, combo: _Combo) -> float:
        """Median step time, measured; infinite for a step that does not fit on the device.
        A step over :data:`_SLOW` times the base step's is timed once (bfloat16 on a CPU
        without native support runs 30x slower: minutes of timing that choose nothing)."""
        if combo not in self.times:
            self.report(f"timing: {self.label(combo)}", 0, 0)
            base = self.times.get(_Combo(set_to_none=self.base_set_to_none))
            slow = _SLOW * base if base is not None and not math.isinf(base) else None
            try:
                self.times[combo] = median_step_time(
                    self.model,
                    self.inputs,
                    self.loss_fn,
                    self.optimizer,
                    steps=_TIMED_STEPS,
                    step=self.options(combo),
                    give_up_over=slow,
                    targets=self.targets,
                )
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                self.times[combo] = math.inf
        return self.times[combo]

    def plan(self, combo: _Combo) -> Plan | int:
        """A recompute plan for ``combo`` at the budget, or ``P_min`` when none fits."""
        if combo in self.plans:
            return self.plans[combo]
        self.report(f"planning recompute: {self.label(combo)}", 0, 0)
        k = combo.micro_batches
        options = self.options(combo)
        inputs, targets = self.inputs, self.targets
        if k > 1:
            # One micro-batch's step, starting with the gradients the ones before it left
            # (views of the whole batch, so the inputs alive are the same).
            args, kwargs, targets = split_batch(self.args, self.kwargs, self.targets, k)[0]
            inputs = args[0] if isinstance(self.inputs, torch.Tensor) else join_inputs(args, kwargs)
            options = replace(options, micro_batches=1, loss_scale=self.scales[k], set_to_none=False)
        step = dict(loss_fn=self.loss_fn, optimizer=self.optimizer, targets=targets)
        # Real tensors: the plan's recompute cost comes from module times measured here. A
        # step too big for the device is planned on fake tensors, its cost from FLOPs.
        # With transformers' KV cache off in training where an earlier plan turned it off,
        # as this plan will run the step (memfit.apply.cache): the planner would measure
        # the step again otherwise.
        with switched_off(self.model, self.use_cache_off):
            try:
                prof = measure_profile(self.model, inputs, step=options, **step)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                prof = measure_profile(self.model, inputs, step=options, fake=True, **step)
        # The accumulated step holds a few scalars more than one micro-batch's (the loss sum).
        slack = max(0, self.peak(combo) - prof.peak_bytes) if k > 1 else 0
        try:
            result: Plan | int = make_plan(self.model, inputs, self.budget - slack, profile=prof, **step)
        except BudgetInfeasibleError as exc:
            result = exc.min_peak_bytes + slack
        if isinstance(result, Plan):
            self.use_cache_off = result.use_cache_off
        self.plans[combo] = result
        return result

    def candidate(self, combo: _Combo) -> _Candidate | int:
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
        seconds = self.time(combo) + (self.recompute_s(combo, plan) if plan is not None else 0.0)
        return _Candidate(combo, plan, peak, seconds, self.levers(combo, plan))

    def recompute_s(self, combo: _Combo, plan: Plan) -> float:
        """The plan's predicted recompute time per step (a plan per micro-batch)."""
        if plan.extra_compute_s is not None:
            return combo.micro_batches * plan.extra_compute_s
        # Planned on fake tensors (the step did not fit the device): no module times, so
        # the recompute's share of the step's FLOPs, of the step's time.
        prof = measure_profile(
            self.model,
            self.inputs,
            loss_fn=self.loss_fn,
            optimizer=self.optimizer,
            fake=True,
            step=self.options(combo),
            targets=self.targets,
        )
        return self.time(combo) * combo.micro_batches * plan.extra_flops / max(1, prof.step_flops)


def _choose(cands: list[_Candidate]) -> _Candidate:
    fastest = min(c.time_s for c in cands)
    close = [c for c in cands if c.time_s <= fastest * (1 + _TIE)]
    # then fewer micro-batches: bigger ones keep the device busier, which noise can hide
    return min(close, key=lambda c: (len(c.levers), c.combo.micro_batches, c.time_s))


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
) -> Recipe:
    """The fastest combination of memory levers whose training step peaks within ``budget``.

    Args:
        model, inputs, loss_fn, optimizer, targets: the step, as for :func:`memfit.profile`
            (micro-batches cut the targets with the inputs).
        budget: bytes bounding the whole step's peak (``6 * 2**30``, ``"6GiB"``).
        allow: opt-in levers that change the numerics (``"amp"``, ``"bf16"``, ``"foreach"``,
            ``"8bit"``; a list or ``"amp,bf16"``). The exact levers (recompute,
            micro-batching, ``zero_grad(set_to_none=True)``, offload) are always weighed.
        set_to_none: what the training loop calls now, ``zero_grad(set_to_none=...)``;
            with False its gradients stay allocated between steps, and switching is a lever.

    Returns:
        A :class:`Recipe`: the levers, the predicted and the measured peak and step time,
        the what-if rows and why each other lever was left out. ``recipe.snippet()`` is
        code for a training loop; ``recipe.apply(model, optimizer)`` applies it. The model,
        its gradients and buffers, the optimizer and the RNG are left as they were.

    Raises:
        BudgetInfeasibleError: no allowed combination fits; the message states the lowest
            peak they reach.
    """
    started = time.perf_counter()
    target = fit_budget(budget)
    allowed = parse_allow(allow)
    check_arguments(model, optimizer, loss_fn, targets)
    model = unwrap(model)
    if applied_choices(model) is not None:
        raise PlanError("this model already has a plan applied; call memfit.remove(model) before fitting it")
    args, kwargs = split_inputs(inputs)
    device = check_step(model, args, kwargs, targets)
    if optimizer is None:
        optimizer = default_optimizer([p for p in model.parameters() if p.requires_grad])
    steps = [0]

    def report(desc: str, done: int, total: int | None) -> None:
        if progress is not None:
            steps[0] += 1
            progress(desc, steps[0], None)  # type: ignore[arg-type]  # how many steps depends on what fits

    left_out: dict[str, str] = {}
    report("which levers apply", 0, 0)
    scales, why = _micro_batching(model, args, kwargs, loss_fn, optimizer, targets)
    if why:
        left_out["microbatch"] = why
    if set_to_none:
        left_out["set_to_none"] = "the loop already calls zero_grad(set_to_none=True): no gradients are kept between steps"
    precisions = ["fp32"]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for lever in ("amp", "bf16"):
        if lever not in allowed:
            left_out[lever] = f"changes the numerics: opt in with allow={lever!r} (--allow {lever})"
        elif dtypes != {torch.float32}:
            left_out[lever] = f"the parameters are {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}, not float32"
        else:
            precisions.append(lever)
    foreach_now = _torch_compat.uses_foreach(optimizer)
    if "foreach" not in allowed:
        left_out["foreach"] = "changes the numerics (another summation order): opt in with allow='foreach' (--allow foreach)"
    elif foreach_now is None:
        left_out["foreach"] = f"{type(optimizer).__name__} has no foreach choice here (no flag, fused, or groups that differ)"
    if "8bit" not in allowed:
        left_out["8bit"] = "changes the numerics (quantised optimizer state): opt in with allow='8bit' (--allow 8bit)"
    else:
        why_not = _optim8bit.unavailable(optimizer)
        if why_not is not None:
            left_out["8bit"] = why_not
    why_not = _offload_unavailable(device)
    if why_not is not None:
        left_out["offload"] = why_not

    search = _Search(model, inputs, loss_fn, optimizer, target, device, set_to_none, scales, report, targets)
    ks = [1, *sorted(scales)]
    foreach = [None] + ([not foreach_now] if "foreach" not in left_out else [])
    zero = [set_to_none] + ([True] if not set_to_none else [])
    eight = [False] + ([True] if "8bit" not in left_out else [])
    offload = [False]
    if "offload" not in left_out:
        try:
            search.peak(replace(_Combo(set_to_none=set_to_none), offload=True))
            offload.append(True)
        except MemfitError:
            raise
        except Exception as exc:  # a lever that cannot be measured here must not stop the search
            left_out["offload"] = f"could not be measured here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    base = _Combo(set_to_none=set_to_none)
    singles = [base]
    singles += [replace(base, micro_batches=k) for k in ks[1:]]
    singles += [replace(base, precision=p) for p in precisions[1:]]
    singles += [replace(base, foreach=f) for f in foreach[1:]]
    singles += [replace(base, set_to_none=z) for z in zero[1:]]
    singles += [replace(base, eight_bit=e) for e in eight[1:]]
    singles += [replace(base, offload=o) for o in offload[1:]]

    # Each lever alone: exact peak (fake) and measured time, for the table and the estimates.
    for combo in singles:
        search.peak(combo)
        search.time(combo)
    # The first steps a process times can carry one-time costs that one warm-up step does
    # not absorb (seen on this CPU: 0.475 s against 0.258 s in the same fit): the base step
    # was timed first, so it is timed again after the others and the faster median kept.
    if len(singles) > 1 and not math.isinf(search.times[base]):
        search.times[base] = min(search.times.pop(base), search.time(base))
    base_time = search.times[base]

    def estimate(combo: _Combo) -> float:
        alone = [
            search.times[replace(base, micro_batches=combo.micro_batches)],
            search.times[replace(base, precision=combo.precision)],
            search.times[replace(base, foreach=combo.foreach)],
            search.times[replace(base, set_to_none=combo.set_to_none)],
            search.times[replace(base, eight_bit=combo.eight_bit)],
            search.times[replace(base, offload=combo.offload)],
        ]
        if math.isinf(base_time) or any(math.isinf(t) for t in alone):
            return math.inf  # a step that did not run on the device: no estimate, no pruning
        return base_time + sum(t - base_time for t in alone)

    # foreach is a flag of torch's optimizers: the 8-bit one (bitsandbytes') has none
    combos = [
        _Combo(k, p, f, z, e, o)
        for k, p, f, z, e, o in itertools.product(ks, precisions, foreach, zero, eight, offload)
        if not (e and f is not None)
    ]
    combos.sort(key=lambda c: (estimate(c), len(search.levers(c, None))))
    cands: list[_Candidate] = []
    lowest: tuple[int, _Combo] | None = None
    for combo in combos:
        if cands and estimate(combo) > _choose(cands).time_s * (1 + _TIE):
            break
        result = search.candidate(combo)
        if isinstance(result, int):
            if lowest is None or result < lowest[0]:
                lowest = (result, combo)
            continue
        cands.append(result)
    if not cands:
        assert lowest is not None
        opt_in = [lever for lever in OPT_IN_LEVERS if lever not in allowed]
        raise BudgetInfeasibleError(
            f"budget {format_bytes(target)} is below the lowest peak memfit can reach with the levers allowed: "
            f"{format_bytes(lowest[0])} ({lowest[0]} bytes) with {search.label(lowest[1])}"
            + ("; " if lowest[1].offload else " and recompute; ")  # offload is not combined with recompute
            + f"as it is the step peaks at {format_bytes(search.peaks[base])}"
            # the one line a refused budget prints: say why micro-batches were not weighed
            + (f"; micro-batching left out: {left_out['microbatch']}" if "microbatch" in left_out else "")
            + (f"; levers that change the numerics may go lower: allow {','.join(opt_in)}" if opt_in else ""),
            min_peak_bytes=lowest[0],
            budget_bytes=target,
        )
    best = _choose(cands)
    if search.peaks[base] > target and base not in search.plans:
        search.plan(base)  # recompute alone, for the what-if table

    report("measuring the chosen recipe", 0, 0)
    options = search.options(best.combo)
    measured_peak, measured_time = _measure(model, inputs, loss_fn, optimizer, options, best.plan, targets)

    what_if = _what_if(search, singles, base, best, measured_peak, measured_time)
    unused = (
        "not needed: the step fits as it is"
        if search.peaks[base] <= target
        else "the chosen recipe fits faster (see the what-if rows)"
    )
    for lever in ("recompute", "microbatch", "amp", "bf16", "foreach", "set_to_none", "8bit", "offload"):
        if lever not in best.levers and lever not in left_out:
            left_out[lever] = unused
    batch = batch_size_of(args, kwargs)
    return Recipe(
        budget_bytes=target,
        levers=best.levers,
        step=options,
        plan=best.plan if best.plan is not None and best.plan.checkpointed else None,
        predicted_peak_bytes=best.peak_bytes,
        predicted_step_time_s=best.time_s,
        measured_peak_bytes=measured_peak,
        measured_step_time_s=measured_time,
        base_peak_bytes=search.peaks[base],
        base_step_time_s=base_time,
        what_if=what_if,
        left_out={lever: left_out[lever] for lever in LEVERS if lever in left_out and lever not in best.levers},
        precision=best.combo.precision,
        batch_size=batch,
        inputs_kind="tensor" if isinstance(inputs, torch.Tensor) else ("kwargs" if kwargs else "args"),
        default_loss=loss_fn is None,
        targets=targets is not None,
        model_type=type(model).__name__,
        fingerprint=fingerprint(model),
        optimizer_type=type(optimizer).__name__,
        device=str(device),
        budget=str(budget),
        fit_time_s=time.perf_counter() - started,
    )


def _measure(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    options: StepOptions,
    plan: Plan | None,
    targets: Any,
) -> tuple[int, float]:
    """The recipe's step on the real model: the recorder ledger's peak and the median step time."""
    if plan is not None and plan.checkpointed:
        apply_choices(model, {name: (c.mode, c.save_ops) for name, c in plan.checkpointed.items()}, plan.use_cache_off)
    try:
        prof = measure_profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer, step=options, targets=targets)
        seconds = median_step_time(model, inputs, loss_fn, optimizer, steps=_TIMED_STEPS, step=options, targets=targets)
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        raise MemfitError(
            f"the chosen recipe ran out of device memory when measured ({str(exc).splitlines()[0][:160]}); "
            "memory the ledger does not see (allocator fragmentation, kernel workspaces) needs headroom: lower the budget"
        ) from exc
    finally:
        if plan is not None and plan.checkpointed:
            remove(model)
    return prof.peak_bytes, seconds


def _what_if(
    search: _Search, singles: list[_Combo], base: _Combo, best: _Candidate, measured_peak: int, measured_time: float
) -> list[WhatIf]:
    rows = []
    for combo in singles:
        peak, seconds = search.peaks[combo], search.times[combo]
        note = search.host_note(combo)
        rows.append(WhatIf(search.label(combo), search.levers(combo, None), peak, seconds, peak <= search.budget, note=note))
    plan = search.plans.get(base)
    if search.peaks[base] <= search.budget:
        rows.append(WhatIf("recompute", ("recompute",), None, None, True, note="not needed: the step fits as it is"))
    elif isinstance(plan, Plan):
        seconds = search.times[base] + search.recompute_s(base, plan)
        rows.append(WhatIf(search.label(base, plan), ("recompute",), plan.predicted_peak_bytes, seconds, True))
    elif isinstance(plan, int):
        rows.append(WhatIf("recompute", ("recompute",), plan, None, False, note=f"lowest reachable peak {format_bytes(plan)}"))
    chosen = WhatIf(
        search.label(best.combo, best.plan),
        best.levers,
        best.peak_bytes,
        best.time_s,
        True,
        measured_peak,
        measured_time,
        note=search.host_note(best.combo),
        chosen=True,
    )
    same = next(
        (i for i, r in enumerate(rows) if r.levers == chosen.levers and r.predicted_peak_bytes == chosen.predicted_peak_bytes),
        None,
    )
    if same is not None:
        rows[same] = chosen
    else:
        rows.append(chosen)
    timed = sorted((r for r in rows if r.fits and r.predicted_step_time_s is not None), key=lambda r: r.predicted_step_time_s)
    rest = [r for r in rows if not (r.fits and r.predicted_step_time_s is not None)]
    rest.sort(key=lambda r: (r.predicted_peak_bytes is None, r.predicted_peak_bytes or 0))
    return timed + rest
