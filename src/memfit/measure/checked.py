"""The step, checked once where it comes in.

People call :func:`memfit.profile`, ``plan``, ``fit`` and ``max_batch`` with the step's parts
as loose arguments (model, inputs, loss, optimizer, targets, step options, ``fake=``), because
that is how a training script holds them. Each entry point turns them into one :class:`Step`
with :func:`checked_step` before anything runs: every refusal of a step that cannot run is
said here, once, and the code below takes the Step instead of the loose parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.errors import WorkloadError
from memfit.measure.sandbox import fake_device
from memfit.measure.step import StepOptions
from memfit.recompute.checkpoint import unwrap
from memfit.workload import (
    Where,
    check_arguments,
    default_optimizer,
    join_inputs,
    model_device,
    split_inputs,
    split_micro_batches,
)

__all__ = ["Step", "checked_step", "check_step"]


@dataclass(frozen=True)
class Step:
    """One training step, checked: what it runs on, how, and where."""

    model: nn.Module
    """The user's module (unwrapped from ``torch.compile``/DDP where the caller asked)."""
    args: tuple
    kwargs: dict
    loss_fn: Callable[..., torch.Tensor] | None
    optimizer: torch.optim.Optimizer
    """The user's optimizer, or memfit's default (AdamW over the trainable parameters)."""
    targets: Any
    options: StepOptions
    where: Where
    """Real tensors, fake ones on the model's device, or fake CUDA (read from ``fake=``)."""
    device: torch.device
    """The model's device (the CPU for a fake-CUDA step: its model stays on the CPU)."""

    @property
    def fake(self) -> bool:
        return self.where.fake

    @property
    def fake_cuda(self) -> bool:
        return self.where.cuda

    @property
    def step_device(self) -> torch.device:
        """Where the step's tensors live: ``cuda:0`` on fake CUDA, else the model's device."""
        return torch.device("cuda", 0) if self.fake_cuda else self.device

    @property
    def cuda(self) -> bool:
        """The step runs on CUDA, real or fake: its peaks are the caching allocator's."""
        return self.step_device.type == "cuda"

    def on(self, where: Where, options: StepOptions | None = None) -> Step:
        """This step on other tensors, with other options if given, checked: one step profiled
        or verified several ways."""
        where, options = fake_device(where), options or self.options
        _check_options(options, where, self.device, self.args, self.kwargs)
        return replace(self, where=where, options=options)

    def at(self, inputs: Any, targets: Any = None) -> Step:
        """This step at other inputs and targets (another batch size), checked."""
        args, kwargs = split_inputs(inputs)
        check_step(self.model, args, kwargs, targets)
        split_micro_batches(args, kwargs, self.options.micro_batches)
        return replace(self, args=args, kwargs=kwargs, targets=targets)

    @property
    def inputs(self) -> Any:
        """The inputs as the model is called with them (a tuple or a dict)."""
        return join_inputs(self.args, self.kwargs)


def checked_step(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    fake: bool | str | Where | None = False,
    options: StepOptions | None = None,
    targets: Any = None,
    unwrapped: bool = False,
) -> Step:
    """The step's parts checked into a :class:`Step`, or the one-line error that says what is
    wrong. ``unwrapped``: take the module inside ``torch.compile``'s and DDP's wrappers, whose
    module names a plan uses."""
    check_arguments(model, optimizer, loss_fn, targets)
    where = fake_device(fake)
    if options is not None and not isinstance(options, StepOptions):
        raise WorkloadError(f"step must be a memfit.StepOptions, got {type(options).__name__}")
    options = options or StepOptions()
    if unwrapped:
        model = unwrap(model)
    args, kwargs = split_inputs(inputs)
    device = check_step(model, args, kwargs, targets)
    _check_options(options, where, device, args, kwargs)
    if optimizer is None:
        optimizer = default_optimizer([p for p in model.parameters() if p.requires_grad])
    return Step(model, args, kwargs, loss_fn, optimizer, targets, options, where, device)


def _check_options(options: StepOptions, where: Where, device: torch.device, args: tuple, kwargs: dict) -> None:
    """Refuse options this step cannot run with, before it runs."""
    if options.offload and where is not Where.FAKE_CUDA and device.type != "cuda":
        raise WorkloadError(
            f"StepOptions(offload=True) moves saved activations from a CUDA device to host memory; this step runs on "
            f"{device.type}, whose memory is host memory already: drop offload or move the model to CUDA"
        )
    split_micro_batches(args, kwargs, options.micro_batches)  # refuse a batch that does not split before running


def check_step(model: nn.Module, args: tuple, kwargs: dict, targets: Any = None) -> torch.device:
    """Refuse a step that cannot run before running anything: the model on several devices,
    on meta, or on another one than its inputs or targets, or nothing to train. Returns the
    model's device."""
    from torch.utils._pytree import tree_flatten

    device = model_device(model)
    for what, tree in (("an input is", (args, kwargs)), ("the targets are", targets)):
        leaves, _ = tree_flatten(tree)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device != device:
                raise WorkloadError(f"{what} on {t.device} but the model is on {device}; move them to one device")
    if not any(p.requires_grad for p in model.parameters()):
        raise WorkloadError("the model has no parameter that requires grad: there is no training step to measure")
    return device
