"""Mechanism: recompute chosen modules of the user's model, reversibly, without editing it.

Each chosen module gets an instance attribute ``forward`` that runs its original forward
under non-reentrant ``torch.utils.checkpoint.checkpoint`` (with a selective-checkpoint
``context_fn`` when only some ops are recomputed). Nothing else changes: module names,
``state_dict`` keys, classes and user hooks stay as they are, and :func:`remove` deletes
the attribute again.

What plain checkpointing gets wrong and this layer fixes:

- Buffers a forward mutates (BatchNorm's running statistics, ``num_batches_tracked``)
  would be updated twice, once more by the recompute. The forward context notes which
  buffers the forward changed; the recompute runs with throwaway clones of those.
- Dropout must draw the same numbers in the recompute: ``preserve_rng_state=True``.
- Reentrant checkpointing drops keyword arguments and breaks DDP: always non-reentrant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.errors import PlanError
from memfit.measure import _torch_compat

__all__ = ["apply_choices", "remove", "applied_choices", "last_recompute"]

_APPLIED = "_memfit_applied"
_NO_INSTANCE_FORWARD = object()

# Name of the module whose recompute began most recently: a recompute error surfaces
# later, in an unpack hook, and the planner uses this to name the module at fault.
_last_recompute: list[str | None] = [None]


def last_recompute() -> str | None:
    return _last_recompute[0]


class _Pair:
    """Enter several context managers as one (``context_fn`` returns exactly two)."""

    def __init__(self, *cms: contextlib.AbstractContextManager) -> None:
        self.cms = cms
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        for cm in self.cms:
            self.stack.enter_context(cm)

    def __exit__(self, *exc: Any) -> Any:
        return self.stack.__exit__(*exc)


class _BufferGuard:
    """Watches which buffers the forward mutates, and hides them from the recompute.

    A bumped version counter catches in-place updates (``num_batches_tracked.add_(1)``);
    BatchNorm's kernels update ``running_mean``/``running_var`` without bumping it on some
    backends, so normalisation layers tracking running statistics are always covered."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.mutated: list[tuple[nn.Module, str]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        before = {(m, k): b._version for m in self.module.modules() for k, b in m._buffers.items() if b is not None}
        try:
            yield
        finally:
            self.mutated = [
                (m, k)
                for (m, k), v in before.items()
                if m._buffers.get(k) is not None and (m._buffers[k]._version != v or _torch_compat.updates_running_stats(m))
            ]

    @contextlib.contextmanager
    def recompute(self, name: str) -> Iterator[None]:
        _last_recompute[0] = name
        originals = [(m, k, m._buffers[k]) for m, k in self.mutated]
        for m, k, b in originals:
            m._buffers[k] = b.detach().clone()
        try:
            yield
        finally:
            for m, k, b in originals:
                m._buffers[k] = b


def _policy(save_ops: frozenset[str]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        if getattr(packet, "__name__", None) in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _call(fn: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
    return fn(*args, **kwargs)


class _CheckpointedForward:
    """The ``forward`` memfit puts on a chosen module.

    A callable object rather than a closure: ``copy.deepcopy(model)`` (an EMA copy, a
    fake-tensor copy) then gets a forward bound to the copied module, not the original."""

    def __init__(self, module: nn.Module, name: str, original: Any, mode: str, save_ops: tuple[str, ...]) -> None:
        self.module = module
        self.name = name
        self.original = original  # the instance-level forward it replaced, or None
        self.choice = (mode, save_ops)
        self.guard = _BufferGuard(module)
        self.policy = _policy(frozenset(save_ops)) if mode == "selective" else None

    def _inner(self) -> Callable[..., Any]:
        return self.original if self.original is not None else type(self.module).forward.__get__(self.module)

    def _context_fn(self) -> tuple[Any, Any]:
        if self.policy is None:
            return self.guard.forward(), self.guard.recompute(self.name)
        sac_forward, sac_recompute = create_selective_checkpoint_contexts(self.policy)
        # The guard's buffer clones must happen outside SAC's mode, which would otherwise
        # see a clone in the recompute that the forward never ran.
        return _Pair(self.guard.forward(), sac_forward), _Pair(self.guard.recompute(self.name), sac_recompute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner()
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return inner(*args, **kwargs)
        return checkpoint(_call, inner, kwargs, *args, use_reentrant=False, preserve_rng_state=True, context_fn=self._context_fn)


def applied_choices(model: nn.Module) -> dict[str, tuple[str, tuple[str, ...]]] | None:
    """``{module: (mode, save_ops)}`` applied to ``model``, or None if nothing is."""
    applied = model.__dict__.get(_APPLIED)
    if applied is None:
        return None
    return {name: model.get_submodule(name).forward.choice for name in applied}


def apply_choices(model: nn.Module, choices: dict[str, tuple[str, tuple[str, ...]]]) -> nn.Module:
    """Recompute ``choices`` (``{module name: (mode, save_ops)}``) in ``model``, in place."""
    if model.__dict__.get(_APPLIED) is not None:
        raise PlanError("a plan is already applied to this model; call memfit.remove(model) before applying another")
    modules = dict(model.named_modules())
    missing = [n for n in choices if n not in modules]
    if missing:
        raise PlanError(f"the plan names module {missing[0]!r}, which this model does not have: was it made for another model?")
    for name, (mode, _) in choices.items():
        if mode not in ("full", "selective"):
            raise PlanError(f"unknown recompute mode {mode!r} for {name!r}; expected 'full' or 'selective'")
    originals: dict[str, Any] = {}
    for name, (mode, save_ops) in choices.items():
        mod = modules[name]
        original = mod.__dict__.get("forward", _NO_INSTANCE_FORWARD)
        originals[name] = original
        own = None if original is _NO_INSTANCE_FORWARD else original
        mod.forward = _CheckpointedForward(mod, name, own, mode, tuple(save_ops))
    model.__dict__[_APPLIED] = originals
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_choices` exactly; raises PlanError if nothing is applied."""
    originals = model.__dict__.get(_APPLIED)
    if originals is None:
        raise PlanError("no memfit plan is applied to this model, so there is nothing to remove")
    for name, original in originals.items():
        mod = model.get_submodule(name)
        if original is _NO_INSTANCE_FORWARD:
            mod.__dict__.pop("forward", None)
        else:
            mod.forward = original
    del model.__dict__[_APPLIED]
    return model
