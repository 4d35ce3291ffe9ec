"""Which phase of the step is running, and inside which module.

Forward is tracked with per-module pre/post hooks on the user's model (a stack).
Backward is tracked the way ``torch.utils.module_tracker.ModuleTracker`` does it, with
multi-grad hooks: a module is entered when gradients reach its outputs and left when
its inputs' gradients are done. ModuleTracker itself is not used because it names
modules by class (``GPT.transformer.h.0``), keeps a set (a module called twice breaks
it) and forgets the module that raised; memfit needs ``state_dict``-style names and the
innermost module at the moment a forward fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from memfit.measure.ledger import Phase

__all__ = ["Scope"]


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    """Tensors requiring grad anywhere in a module's inputs or outputs, dataclass outputs
    (``GPTOutput``, transformers' ``ModelOutput``) included."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        leaves, _ = tree_flatten(stack.pop())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.requires_grad:
                    out.append(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                stack.append([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return out


class Scope:
    """Context manager hooking ``model``; read :attr:`phase` and :attr:`module` at any time."""

    def __init__(self, model: nn.Module) -> None:
        self.names: dict[nn.Module, str] = {}
        for name, mod in model.named_modules():
            self.names.setdefault(mod, name)
        self.phase = Phase.START
        self._forward: list[str] = []
        self._backward: list[str] = []
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self.calls: dict[str, int] = {}
        """Forward calls per module since the last :meth:`set_phase` to ``FORWARD``."""

    # -- queries ----------------------------------------------------------------------------

    @property
    def module(self) -> str | None:
        """Innermost module running now: the top of the forward stack (also during a
        recompute inside backward), else the deepest module whose backward is running."""
        if self._forward:
            return self._forward[-1]
        if self._backward and self.phase is Phase.BACKWARD:
            return max(reversed(self._backward), key=_depth)
        return None

    def stack(self) -> list[str]:
        """Every module running now, outermost first."""
        if self._forward:
            return list(self._forward)
        if self.phase is Phase.BACKWARD:
            return sorted(set(self._backward), key=_depth)
        return []

    def set_phase(self, phase: Phase) -> None:
        if phase is Phase.FORWARD:
            self.calls = {}
        self.phase = phase
        self._forward.clear()
        self._backward.clear()

    # -- hooks ------------------------------------------------------------------------------

    def _pre(self, mod: nn.Module, args: Any) -> None:
        name = self.names[mod]
        self._forward.append(name)
        if self.phase is Phase.FORWARD:
            self.calls[name] = self.calls.get(name, 0) + 1
        if self.phase is Phase.FORWARD and torch.is_grad_enabled():
            tensors = _grad_tensors(args)
            if tensors:
                self._grad_handles.append(register_multi_grad_hook(tensors, lambda _g, n=name: self._leave_bw(n)))

    def _post(self, mod: nn.Module, args: Any, output: Any) -> None:
        name = self.names[mod]
        # Pop this module's own frame even if a child raised and left frames above it.
        if name in self._forward:
            idx = len(self._forward) - 1 - self._forward[::-1].index(name)
            del self._forward[idx:]
        if self.phase is Phase.FORWARD and torch.is_grad_enabled():
            tensors = _grad_tensors(output)
            if tensors:
                self._grad_handles.append(register_multi_grad_hook(tensors, lambda _g, n=name: self._backward.append(n)))

    def _leave_bw(self, name: str) -> None:
        if name in self._backward:
            idx = len(self._backward) - 1 - self._backward[::-1].index(name)
            del self._backward[idx]

    def __enter__(self) -> Scope:
        for mod in self.names:
            self._handles.append(mod.register_forward_pre_hook(self._pre))
            self._handles.append(mod.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles.clear()
        self._grad_handles.clear()
