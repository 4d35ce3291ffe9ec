"""Mechanism: put a :class:`~memfit.levers.recipe.Recipe` on the user's model and optimizer,
and hand the training loop what it needs (optimizer, scaler, micro-batches, autocast,
activation offload).

In place: the recompute plan, with transformers' KV cache off in training where the plan
says so (both undone by :func:`memfit.remove`), parameters cast to
bfloat16 (not undone: a cast back would not restore the lost bits), the optimizer's
``foreach`` flag. The ``8bit`` lever hands back a new bitsandbytes optimizer over the same
parameters and hyperparameters; the one passed in is left as it is. The loop itself stays the user's; :meth:`AppliedRecipe.step` runs one
whole step exactly as memfit measured it, for loops that want nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.compat import optim8bit
from memfit.errors import PlanError
from memfit.levers.recipe import Recipe
from memfit.measure.step import offload_saved, train_step
from memfit.plan.result import check_fingerprint
from memfit.recompute.checkpoint import applied_choices, apply_choices, unwrap
from memfit.recompute.remat import resolve
from memfit.workload import check_loss_targets, default_optimizer, join_inputs, split_batch, split_inputs

__all__ = ["AppliedRecipe", "apply_recipe"]


@dataclass
class AppliedRecipe:
    """What a training loop needs once a recipe is applied."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    """A ``torch.amp.GradScaler`` (float16 autocast) or None."""
    micro_batches: int
    loss_scale: float
    """Factor on each micro-batch's loss so the accumulated gradient is the full batch's."""
    set_to_none: bool
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype | None
    device_type: str
    offload_saved: bool = False
    """Forward and loss run under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` as the recipe says, or a context that does nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def offload(self) -> contextlib.AbstractContextManager:
        """``save_on_cpu(pin_memory=True)`` when the recipe offloads activations, else a
        context that does nothing: put forward and loss inside it."""
        return offload_saved() if self.offload_saved else contextlib.nullcontext()

    def cast(self, inputs: Any) -> Any:
        """Floating-point input tensors in the parameters' dtype (unchanged without ``bf16``)."""
        if self.param_dtype is None:
            return inputs
        dtype = self.param_dtype
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)

    def split(self, inputs: Any, targets: Any = None) -> list[Any]:
        """``inputs`` as micro-batches, each in the inputs' own form (a tensor, a tuple, a
        dict), cast like :meth:`cast`; tensors whose dim 0 is the batch size are cut along it.
        With ``targets``, ``(micro_inputs, micro_targets)`` pairs: the targets cut alike (not cast)."""
        args, kwargs = split_inputs(inputs)
        parts = split_batch(args, kwargs, targets, self.micro_batches)
        if isinstance(inputs, torch.Tensor):
            micro = [self.cast(a[0]) for a, _, _ in parts]
        else:
            micro = [self.cast(join_inputs(a, k)) for a, k, _ in parts]
        return micro if targets is None else [(m, t) for m, (_, _, t) in zip(micro, parts)]

    def step(self, inputs: Any, loss_fn: Callable[..., torch.Tensor] | None = None, targets: Any = None) -> float:
        """One whole training step as memfit measured it (micro-batches, autocast, scaler,
        optimizer step and zero_grad); returns the loss (the micro-batches' scaled sum).
        With ``targets``, the loss is ``loss_fn(output, micro_targets)``."""
        check_loss_targets(loss_fn, targets)
        args, kwargs = split_inputs(self.cast(inputs))
        return train_step(
            self.model,
            args,
            kwargs,
            loss_fn,
            self.optimizer,
            micro_batches=self.micro_batches,
            loss_scale=self.loss_scale if self.micro_batches > 1 else None,
            autocast=self.autocast_dtype,
            scaler=self.scaler,
            set_to_none=self.set_to_none,
            offload=self.offload_saved,
            targets=targets,
        )


def apply_recipe(
    recipe: Recipe, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, mechanism: str | None = None
) -> AppliedRecipe:
    """Apply ``recipe`` to ``model`` (and ``optimizer``, default a new AdamW) in place.

    Raises PlanError if the recipe was made for a model of another structure or a plan is
    already applied. The returned :class:`AppliedRecipe` holds what the loop uses.
    ``mechanism``: how the plan's selective choices run, as for :func:`memfit.apply`."""
    if not isinstance(recipe, Recipe):
        raise PlanError(f"apply_recipe needs a memfit.Recipe, got {type(recipe).__name__}")
    if not isinstance(model, nn.Module):
        raise PlanError(f"a recipe applies to a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise PlanError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    inner = unwrap(model)
    check_fingerprint(inner, recipe.fingerprint, recipe.model_type, "recipe", "make one for it with memfit.fit")
    mechanism = resolve(mechanism)
    if recipe.plan is not None and recipe.plan.checkpointed and applied_choices(inner) is not None:
        raise PlanError("a plan is already applied to this model; call memfit.remove(model) before applying a recipe")
    step = recipe.step
    if step.foreach is not None and optimizer is not None and any("foreach" not in g for g in optimizer.param_groups):
        raise PlanError(f"the recipe sets the optimizer's foreach flag, which {type(optimizer).__name__} does not have")
    if optimizer is None:
        optimizer = default_optimizer([p for p in inner.parameters() if p.requires_grad])
    if step.optimizer_8bit:
        # checked before anything changes: a recipe that cannot be applied whole changes nothing
        why = optim8bit.unavailable(optimizer)
        if why is not None:
            raise PlanError(f"the recipe uses 8-bit optimizer state, but {why}")
    # The plan first: it was made (and fingerprinted) on the parameters as they were.
    if recipe.plan is not None and recipe.plan.checkpointed:
        plan = recipe.plan
        apply_choices(inner, {name: (c.mode, c.save_ops) for name, c in plan.checkpointed.items()}, plan.use_cache_off, mechanism)
    dtype = step.cast_dtype
    if dtype is not None:
        inner.to(dtype)  # floating parameters and buffers; the Parameter objects stay the same
        # (the 8-bit lever leaves the optimizer passed in alone: a new one replaces it below)
        for state in optimizer.state.values() if not step.optimizer_8bit else ():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.is_floating_point():
                    state[key] = value.to(dtype)
    if step.foreach is not None:
        for group in optimizer.param_groups:
            group["foreach"] = step.foreach
    if step.optimizer_8bit:
        optimizer = optim8bit.eight_bit(optimizer)
    device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    return AppliedRecipe(
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler(device.type) if step.grad_scaler else None,
        micro_batches=step.micro_batches,
        loss_scale=recipe.loss_scale,
        set_to_none=step.set_to_none,
        autocast_dtype=step.autocast_dtype,
        param_dtype=dtype,
        device_type=device.type,
        offload_saved=step.offload,
    )
