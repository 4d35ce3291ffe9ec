"""Run training steps for measurement without leaving a trace on the user's objects.

Real tensors: the steps run on the user's own model and optimizer (so memory is what
training would use, with no second copy on the device), after a snapshot to host memory
of everything a step changes: parameters, gradients, buffers (BatchNorm statistics),
optimizer state and the RNG. The snapshot is written back in place afterwards, whether
the steps succeeded or raised.

Fake tensors: a copy of the model whose parameters and buffers are fake tensors (no
memory), built with ``copy.deepcopy`` seeded with the fake replacements, plus an
optimizer of the same class and settings over them. The user's objects are never touched.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.errors import WorkloadError
from memfit.measure import _torch_compat

__all__ = ["Sandbox", "real_sandbox", "fake_sandbox"]


@dataclass
class Sandbox:
    """What the measured steps run on."""

    model: nn.Module
    args: tuple
    kwargs: dict
    optimizer: torch.optim.Optimizer
    fake_mode: Any = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Enter the fake mode (if any) so factory calls inside the step make fake tensors."""
        if self.fake_mode is None:
            yield
        else:
            with self.fake_mode:
                yield


_SCALARS = (int, float, bool, str, type(None))
_CONTAINERS = (list, dict, set)
_INTERNALS = frozenset(vars(nn.Module()))  # nn.Module's own dicts (parameters, hooks, ...)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


@contextmanager
def real_sandbox(model: nn.Module, args: tuple, kwargs: dict, optimizer: torch.optim.Optimizer) -> Iterator[Sandbox]:
    params = list(model.parameters())
    buffers = list(model.buffers())
    saved_params = [_to_host(p) for p in params]
    saved_grads = [p.grad for p in params]
    saved_buffers = [_to_host(b) for b in buffers]
    saved_state = {
        p: {k: (v, _to_host(v)) if isinstance(v, torch.Tensor) else (v, copy.deepcopy(v)) for k, v in st.items()}
        for p, st in optimizer.state.items()
    }
    saved_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # Plain Python attributes a forward may bump (call counters, step flags).
    saved_attrs = [(m, {k: v for k, v in vars(m).items() if type(v) in _SCALARS}) for m in model.modules()]
    # And the contents of plain containers one may fill (a cache list, a memo dict): the
    # steps would otherwise leave their entries, and the tensors in them, behind.
    saved_items = [
        (v, copy.copy(v)) for m in model.modules() for k, v in vars(m).items() if type(v) in _CONTAINERS and k not in _INTERNALS
    ]
    for p in params:
        p.grad = None  # a steady-state step starts after zero_grad(set_to_none=True)
    try:
        yield Sandbox(model, args, kwargs, optimizer)
    finally:
        with torch.no_grad():
            for p, v, g in zip(params, saved_params, saved_grads):
                p.copy_(v)
                p.grad = g
            for b, v in zip(buffers, saved_buffers):
                b.copy_(v)
        for p in list(optimizer.state):
            if p not in saved_state:
                del optimizer.state[p]
        for p, st in saved_state.items():
            current = optimizer.state[p]
            current.clear()
            for k, (obj, value) in st.items():
                if isinstance(obj, torch.Tensor):
                    with torch.no_grad():
                        obj.copy_(value)
                    current[k] = obj
                else:
                    current[k] = value
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.update(saved)
        for m, attrs in saved_attrs:
            m.__dict__.update(attrs)
        for obj, items in saved_items:
            obj.clear()
            if isinstance(obj, list):
                obj.extend(items)
            else:
                obj.update(items)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _fake_state(mode: Any, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if value.numel() == 1 and value.dim() == 0:
        # Scalars such as Adam's `step` are read with .item(); a fake tensor made from a
        # Python number inside the mode keeps its value, one converted from a tensor does not.
        number = value.item()  # outside the mode, where the tensor is still real
        with mode:
            return torch.tensor(number, dtype=value.dtype, device=value.device)
    return mode.from_tensor(value)


@contextmanager
def fake_sandbox(model: nn.Module, args: tuple, kwargs: dict, optimizer: torch.optim.Optimizer) -> Iterator[Sandbox]:
    mode = _torch_compat.new_fake_mode()
    memo: dict[int, Any] = {}
    fakes: dict[nn.Parameter, nn.Parameter] = {}
    for p in model.parameters():
        fp = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
        memo[id(p)] = fakes[p] = fp
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    try:
        fake_model = copy.deepcopy(model, memo)
    except Exception as exc:
        raise WorkloadError(f"cannot copy the model to fake tensors ({type(exc).__name__}: {exc})") from exc
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [fakes[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    # ``defaults`` can hold entries the constructor does not take (AdamW's
    # decoupled_weight_decay); every group carries its full settings anyway.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        fake_opt = type(optimizer)(groups, **defaults)
    except Exception as exc:
        raise WorkloadError(
            f"cannot rebuild {type(optimizer).__name__} over fake parameters from its defaults ({exc}); "
            "profile with real tensors instead"
        ) from exc
    for p, st in optimizer.state.items():
        fake_opt.state[fakes[p]] = {k: _fake_state(mode, v) for k, v in st.items()}
    _torch_compat.pin_optimizer_impl(fake_opt, optimizer)

    def fake(x: Any) -> Any:
        return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x

    fake_args, fake_kwargs = tree_map(fake, (args, kwargs))
    cpu_rng = torch.get_rng_state()
    try:
        yield Sandbox(fake_model, fake_args, fake_kwargs, fake_opt, mode)
    finally:
        torch.set_rng_state(cpu_rng)  # fake dropout does not draw, but be sure
