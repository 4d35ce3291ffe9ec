"""Step time, measured: the median of several steps after a warm-up, leaving the
model, optimizer and RNG as they were (see :mod:`memfit.measure.sandbox`)."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit.measure.sandbox import real_sandbox
from memfit.measure.step import StepOptions
from memfit.workload import split_inputs

__all__ = ["median_step_time", "selective_overhead_s"]


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


def selective_overhead_s(
    model: nn.Module, inputs: Any, optimizer: torch.optim.Optimizer, *, forward_ops: int, step: StepOptions | None = None
) -> float:
    """Seconds selective recompute adds per forward op on this host, measured on the model.

    SAC runs a Python dispatch mode over a module's forward (caching what it keeps) and
    again over its recompute; on a host with slow Python that, more than the recomputed
    kernels, can be its cost. Timed as one forward under SAC's caching mode (policy:
    recompute everything) against a plain one, without grad, state restored;
    ``forward_ops`` is the number of aten ops in a forward (from the ledger).
    """
    args, kwargs = split_inputs(inputs)
    device = next(model.parameters()).device

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    dtype = step.autocast_dtype if step is not None else None

    def forward(mode: Any) -> float:
        cast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), cast, mode:
            box.model(*box.args, **box.kwargs)
        _sync(device)
        return time.perf_counter() - t0

    with real_sandbox(model, args, kwargs, optimizer, step=step) as box:
        plain = forward(contextlib.nullcontext())  # warm already: the profile ran steps
        cached = forward(create_selective_checkpoint_contexts(policy)[0])
    return max(0.0, (cached - plain) / max(forward_ops, 1))
