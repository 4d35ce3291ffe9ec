"""Step time, measured: the median of several steps after a warm-up, leaving the
model, optimizer and RNG as they were (see :mod:`memfit.measure.sandbox`); the optimizer
phase alone; what selective recompute's dispatch mode costs per op."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit.measure.ledger import Phase
from memfit.measure.sandbox import real_sandbox
from memfit.measure.scope import Clock, Scope
from memfit.measure.step import StepOptions
from memfit.workload import split_inputs

__all__ = ["too_noisy", "NOISY_STEPS", "median_step_time", "selective_overhead_s", "time_steps", "optimizer_step_time", "StepTimes"]


NOISY_STEPS = 0.25
"""Timed steps of the same work further apart than this (relative to the fastest): the host
was too busy for its times to mean anything (zoo gpt on a quiet 2-core CPU: 0.05; beside a
busy neighbour up to 2.7)."""


def too_noisy(seconds: list[float] | tuple[float, ...]) -> bool:
    """Do these wall times of the same step disagree by more than :data:`NOISY_STEPS`?"""
    good = [s for s in seconds if s and s > 0]
    return len(good) > 1 and (max(good) - min(good)) / min(good) > NOISY_STEPS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_time(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 5,
    warmup: int = 1,
    step: StepOptions | None = None,
    give_up_over: float | None = None,
    targets: Any = None,
) -> float:
    """Median wall time of ``steps`` training steps (synchronised on CUDA), run as
    ``step`` says (default the usual step). With ``give_up_over``, a first timed step
    slower than that many seconds is the answer: more samples of a step that slow would
    not change what is done with it, and on a CPU such a step can take a minute."""
    args, kwargs = split_inputs(inputs)
    device = next(model.parameters()).device
    times: list[float] = []
    with real_sandbox(model, args, kwargs, optimizer, step=step, targets=targets) as box:
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            box.step(loss_fn)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                if give_up_over is not None and len(times) == 1 and times[0] > give_up_over:
                    break
    return statistics.median(times)


def selective_overhead_s(device: torch.device | str = "cpu", *, ops: int = 200, repeats: int = 5) -> float:
    """Seconds selective recompute adds per forward op on this host.

    SAC runs a Python dispatch mode over a module's forward (caching what it keeps) and
    again over its recompute; on a host with slow Python that, more than the recomputed
    kernels, can be its cost. The cost is per op call, not per byte or FLOP, so it is timed
    on ``ops`` tiny ops under SAC's caching mode against the same ops plain, ``repeats``
    times alternately, fastest of each: about 0.1 s, and steady on a shared CPU, where
    timing the model's own forward twice (what this did before) gave 5 to 315 us per op on
    zoo ``gpt`` in five runs and moved the plans with it."""
    x = torch.ones(4, device=device)

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    def run(mode: Any) -> float:
        _sync(x.device)
        t0 = time.perf_counter()
        with torch.no_grad(), mode:
            y = x
            for _ in range(ops):
                y = torch.add(y, 1.0)
        _sync(x.device)
        return time.perf_counter() - t0

    run(contextlib.nullcontext())  # first call pays for lazy initialisation
    plain, cached = math.inf, math.inf
    for _ in range(repeats):
        plain = min(plain, run(contextlib.nullcontext()))
        cached = min(cached, run(create_selective_checkpoint_contexts(policy)[0]))
    return max(0.0, (cached - plain) / ops)


class _Stopped(Exception):
    """A step ran past its deadline (see :func:`_deadline`)."""


@contextlib.contextmanager
def _deadline(at: float | None) -> Iterator[None]:
    """Give up on a step once ``perf_counter()`` passes ``at``: every tensor autograd saves
    in forward and unpacks in backward goes through a hook that checks the clock (a few
    hundred Python calls a step), so a step 30x slower than expected stops early instead
    of running for a minute."""
    if at is None:
        yield
        return

    def check(t: torch.Tensor) -> torch.Tensor:
        if time.perf_counter() > at:
            raise _Stopped
        return t

    with torch.autograd.graph.saved_tensors_hooks(check, check):
        yield


@dataclass
class StepTimes:
    """Real training steps of one configuration, timed on the wall clock."""

    seconds: list[float] = field(default_factory=list)
    """Each timed step, forward to ``zero_grad`` (synchronised on CUDA)."""
    forward_backward: list[float] = field(default_factory=list)
    """The part of each timed step before the optimizer phase: forward(s), loss, backward(s)."""
    module_times: dict[tuple[Phase, str], float] = field(default_factory=dict)
    """Seconds per (phase, module), inclusive, from the last timed step (``clock=True``)."""
    stopped_after: float | None = None
    """A step was given up after this many seconds (``give_up_over``): the step takes at
    least that long, and :attr:`seconds` may be empty."""
    peak_bytes: int | None = None
    """The recorder ledger's peak of one more step (``record=True``)."""
    retried: bool = False

    @property
    def median(self) -> float:
        """Median step time; with no timed step, the time a step was given up after (a lower bound)."""
        if self.seconds:
            return statistics.median(self.seconds)
        return self.stopped_after if self.stopped_after is not None else math.inf

    @property
    def forward_backward_median(self) -> float:
        if self.forward_backward:
            return statistics.median(self.forward_backward)
        return self.median

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the timed steps, the fastest and the slowest left out
        from five on (one step that a busy host stalled does not make the rest noisy); 0
        for fewer than two."""
        if len(self.seconds) < 2:
            return 0.0
        times = sorted(self.seconds)
        if len(times) >= 5:
            times = times[1:-1]
        return (times[-1] - times[0]) / max(statistics.median(self.seconds), 1e-12)


def time_steps(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    *,
    step: StepOptions | None = None,
    steps: int = 3,
    warmup: int = 1,
    clock: bool = False,
    give_up_over: float | None = None,
    warmup_give_up_over: float | None = None,
    retry_spread: float | None = None,
    record: bool = False,
    stop_above: float | None = None,
    targets: Any = None,
) -> StepTimes:
    """``warmup`` steps, then ``steps`` timed ones, in a sandbox (model, optimizer and RNG
    restored): each step's wall time and the part of it before the optimizer phase.

    Args:
        clock: the first timed step also times every module call (forward and backward,
            :class:`~memfit.measure.scope.Scope`), for :attr:`StepTimes.module_times`.
        give_up_over: a timed step still running after this many seconds is stopped
            (:func:`_deadline`) and no more are run: :attr:`StepTimes.stopped_after`.
        warmup_give_up_over: the same for a warm-up step, whose one-time costs are
            forgiven once: a stopped warm-up is followed by one more, held to
            ``give_up_over``.
        retry_spread: timed steps whose spread (``(max - min) / median``) is above this are
            joined by as many again, once (a busy host).
        record: one step under the recorder too, whose ledger peak is
            :attr:`StepTimes.peak_bytes` (as :func:`memfit.profile` measures it). It runs
            first, as the warm-up, when the optimizer has its state already (else after
            a warm-up step that creates it, as the profile does).
        stop_above: stop timing once most of the ``steps`` took longer than this (their
            median will be longer whatever the rest take): a race against a time already
            measured, which this configuration has lost.
    """
    from memfit.measure.profile import record_step  # profile imports what this module does

    args, kwargs = split_inputs(inputs)
    device = next(model.parameters()).device
    out = StepTimes()
    with real_sandbox(model, args, kwargs, optimizer, step=step, targets=targets) as box:

        def run(limit: float | None, scope: Scope | None = None) -> tuple[float, float] | None:
            return _run_once(box, loss_fn, device, out, limit, scope)

        if record:
            if not box.optimizer.state:
                run(None)  # creates the optimizer's state: the recorded step starts with it
            with Scope(box.model) as scope:
                ledger, _ = record_step(box, scope, loss_fn)
            out.peak_bytes = ledger.peak_bytes
            warmup = 0  # the recorded step was one
        for _ in range(warmup):
            if run(warmup_give_up_over) is None:
                out.stopped_after = None
                if run(give_up_over) is None:  # one-time costs forgiven once
                    return out
        rounds = 1
        while True:
            for _ in range(steps):
                if clock and not out.seconds:
                    with Scope(box.model, Clock(device)) as scope:
                        got = run(give_up_over, scope)
                        if got is not None:
                            out.module_times = scope.times()
                else:
                    got = run(give_up_over)
                if got is None:
                    return out
                out.seconds.append(got[0])
                out.forward_backward.append(got[1])
                if stop_above is not None and 2 * sum(t > stop_above for t in out.seconds) > rounds * steps:
                    return out
            if rounds == 2 or retry_spread is None or out.spread <= retry_spread:
                break
            out.retried, rounds = True, 2
    return out


def _run_once(
    box: Any, loss_fn: Any, device: torch.device, out: StepTimes, limit: float | None, scope: Scope | None
) -> tuple[float, float] | None:
    """One step in the sandbox ``box``: its wall time and the part before the optimizer phase;
    None when it ran past ``limit`` seconds and was stopped (``out.stopped_after`` says when)."""
    marks: list[float] = []

    def on_phase(phase: Phase) -> None:
        if scope is not None:
            scope.set_phase(phase)
        if phase is Phase.OPTIMIZER and not marks:
            _sync(device)
            marks.append(time.perf_counter())

    _sync(device)
    t0 = time.perf_counter()
    try:
        with _deadline(None if limit is None else t0 + limit):
            box.step(loss_fn, on_phase)
    except _Stopped:
        out.stopped_after = time.perf_counter() - t0
        return None
    finally:
        if scope is not None:
            scope.set_phase(Phase.START)
    _sync(device)
    t1 = time.perf_counter()
    return t1 - t0, (marks[0] if marks else t1) - t0


def optimizer_step_time(
    model: nn.Module, inputs: Any, optimizer: torch.optim.Optimizer, *, step: StepOptions | None = None, steps: int = 3
) -> float:
    """Median seconds of the step's optimizer phase alone (``optimizer.step()`` and
    ``zero_grad``) as ``step`` sets it up (foreach flag, 8-bit state, parameter dtype,
    gradients kept), on zero gradients: no forward or backward runs. One warm-up step
    first (it creates the optimizer's state); everything restored after."""
    args, kwargs = split_inputs(inputs)
    device = next(model.parameters()).device
    times: list[float] = []
    with real_sandbox(model, args, kwargs, optimizer, step=step) as box:
        params = [p for g in box.optimizer.param_groups for p in g["params"] if p.requires_grad]
        for i in range(1 + steps):
            with torch.no_grad():
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            _sync(device)
            t0 = time.perf_counter()
            if box.scaler is not None:
                box.scaler.step(box.optimizer)
                box.scaler.update()
            else:
                box.optimizer.step()
            box.optimizer.zero_grad(set_to_none=box.options.set_to_none)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)
