"""The training step memfit measures, shared by the profiler and the ground-truth runs.

One steady-state step: forward, loss, backward (the model's output stays alive through
backward, as it does in a loop that writes ``out = model(x); out.loss.backward()``),
then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. Gradients are ``None``
when it starts and when it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.measure.ledger import Phase
from memfit.workload import check_loss, default_loss

__all__ = ["train_step"]


def train_step(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    optimizer: torch.optim.Optimizer,
    on_phase: Callable[[Phase], None] = lambda phase: None,
) -> float:
    """Run one step; returns the loss value (a float, or nan on fake tensors)."""
    on_phase(Phase.FORWARD)
    output = model(*args, **kwargs)
    loss = check_loss((loss_fn or default_loss)(output))
    on_phase(Phase.BACKWARD)
    loss.backward()
    value = loss.detach()
    del output, loss
    on_phase(Phase.OPTIMIZER)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    try:
        return float(value)
    except Exception:  # fake tensors have no value
        return float("nan")
