"""Step time, measured: the median of several steps after a warm-up, leaving the
model, optimizer and RNG as they were (see :mod:`memfit.measure.sandbox`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from memfit.measure.sandbox import real_sandbox
from memfit.measure.step import train_step
from memfit.workload import split_inputs

__all__ = ["median_step_time"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_time(
    model: nn.Module, inputs: Any, loss_fn: Any, optimizer: torch.optim.Optimizer, *, steps: int = 5, warmup: int = 1
) -> float:
    """Median wall time of ``steps`` training steps (synchronised on CUDA)."""
    args, kwargs = split_inputs(inputs)
    device = next(model.parameters()).device
    times = []
    with real_sandbox(model, args, kwargs, optimizer) as box:
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            train_step(box.model, box.args, box.kwargs, loss_fn, box.optimizer)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)
