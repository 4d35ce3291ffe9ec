"""Selective recompute through ``torch_remat`` (BSD, torch >= 2.10), where it is installed.

A selective choice keeps the outputs of some aten op types (``save_ops``) and recomputes the
rest. Today's mechanism does that with a selective-checkpoint policy, which runs a Python
``TorchDispatchMode`` over every op of the module, twice a step. ``torch_remat`` checkpoints
a region and lets calls inside it be saved (``remat.region(..., recompute=False)``) with no
dispatch mode, so it costs less CPU per op. Its regions are calls, not op types, so a choice
goes through it only where it says the same thing: every op of a kept type runs inside a
submodule of the chosen module whose ops that make new tensors are all of kept types (an
``nn.Linear`` when ``addmm``/``mm`` are kept). Saving that submodule's call keeps exactly
what the policy keeps, and recomputes the rest.

Which submodules those are is measured, not guessed: the first step of a choice runs with
the policy, which also notes each op's type and the submodules it ran in (:class:`Probe`).
From the second step on the choice runs through ``torch_remat`` if the probe found such
submodules, else it stays on the policy, and :func:`describe` says which and why.
"""

from __future__ import annotations

import importlib.util
import os
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.compat import torch_compat
from memfit.errors import PlanError

__all__ = [
    "MECHANISMS",
    "available",
    "check_mechanism",
    "Probe",
    "RngState",
    "RegionForward",
    "output_ok",
    "fake_or_meta",
    "Verdict",
    "run",
]

MECHANISMS = ("auto", "remat", "sac")
"""How selective choices are applied: ``"auto"`` through ``torch_remat`` where it is installed
and the choice can be expressed in its regions, else a selective-checkpoint policy
(``"sac"``); ``"remat"`` insists on ``torch_remat``; ``"sac"`` never uses it."""

# Ops that make no new storage although torch does not mark them as views.
_ALIASES = frozenset({"_unsafe_view", "alias", "lift_fresh"})


def available() -> bool:
    """Whether ``torch_remat`` can be imported (it needs torch >= 2.10)."""
    if importlib.util.find_spec("torch_remat") is None:
        return False
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 10)


ENV = "MEMFIT_RECOMPUTE"
"""The environment variable that picks the mechanism when the caller names none (a training
script run as it is, a benchmark's child process): ``auto``, ``remat`` or ``sac``."""


def resolve(mechanism: str | None) -> str:
    """``mechanism``, or the one ``MEMFIT_RECOMPUTE`` names, or ``"auto"``; checked."""
    if mechanism is None:
        mechanism = os.environ.get(ENV) or "auto"
        if mechanism not in MECHANISMS:
            raise PlanError(f"{ENV}={mechanism!r} is not a recompute mechanism; expected one of {', '.join(MECHANISMS)}")
    check_mechanism(mechanism)
    return mechanism


def check_mechanism(mechanism: str) -> None:
    if mechanism not in MECHANISMS:
        raise PlanError(f"unknown recompute mechanism {mechanism!r}; expected one of {', '.join(MECHANISMS)}")
    if mechanism == "remat" and not available():
        raise PlanError(
            "mechanism 'remat' needs torch_remat (pip install torch_remat; torch >= 2.10), "
            "which is not installed: use mechanism 'auto' or 'sac'"
        )


def output_ok(value: Any) -> bool:
    """``torch_remat`` takes a call's output only as a tensor or a flat tuple/list of them."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


class Probe:
    """Watches one forward of a chosen module under the selective policy: each op's type and
    the submodules it ran in, how often each submodule was called, and what each returned.

    Only hooks are added (removed by :meth:`close`), so the forward computes what it did."""

    def __init__(self, module: nn.Module, save_ops: frozenset[str]) -> None:
        self.save_ops = save_ops
        self.stack: list[str] = []
        self.ops: list[tuple[str, tuple[str, ...]]] = []  # (op type, submodules it ran in), ops that make tensors
        self.calls: dict[str, int] = defaultdict(int)
        self.bad_output: set[str] = set()
        self.handles = []
        for name, sub in module.named_modules():
            if name:
                self.handles.append(sub.register_forward_pre_hook(self._enter(name)))
                self.handles.append(sub.register_forward_hook(self._leave(name), always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            self.stack.append(name)
            self.calls[name] += 1

        return hook

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if not output_ok(output):
                self.bad_output.add(name)

        return hook

    def note(self, ctx: Any, op: Any) -> None:
        """Called by the policy for each op (forward only: the recompute repeats them)."""
        if ctx.is_recompute or getattr(op, "is_view", False):
            return
        packet = getattr(op, "overloadpacket", op)
        kind = getattr(packet, "__name__", str(op))
        if kind not in _ALIASES:
            self.ops.append((kind, tuple(self.stack)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def regions(self) -> tuple[tuple[str, ...], str]:
        """The submodules to save through ``torch_remat`` (outermost first), or ``()`` and why not."""
        impure = {m for kind, where in self.ops if kind not in self.save_ops for m in where}
        chosen: list[str] = []
        for kind, where in self.ops:
            if kind not in self.save_ops:
                continue
            if not where:
                return (), f"a kept op ({kind}) runs in the module's own forward, outside any submodule"
            fit = next((m for m in where if m not in impure and self.calls[m] == 1 and m not in self.bad_output), None)
            if fit is None:
                return (
                    (),
                    f"a kept op ({kind}) runs only in submodules that also make other tensors, are called twice, or return other than tensors",
                )
            if fit not in chosen:
                chosen.append(fit)
        if not chosen:
            return (), "no kept op ran in the forward"
        return tuple(chosen), ""


class RngState:
    """``torch_remat`` refuses ``preserve_rng_state``: it keeps random draws aligned through
    hooks called at the region's entry and at each saved call, which this one is. Dropout then
    draws in the recompute what it drew in the forward, as ``preserve_rng_state=True`` does."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def snapshot(self) -> Any:
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if self.cuda else None)

    def restore(self, state: Any) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


class RegionForward:
    """The ``forward`` put on a submodule whose call is saved inside a ``torch_remat``
    checkpoint: it runs the submodule's own forward as a ``recompute=False`` region.

    Its outputs are marked as needed by the recompute (``recompute_needs_tensor``): the code
    after the call is the user's, which ``torch_remat`` cannot see, and the selective policy
    keeps these outputs too. Outside a checkpoint ``remat.region`` is a plain call."""

    def __init__(self, module: nn.Module, name: str, original: Any) -> None:
        # (nothing of torch_remat held: copy.deepcopy(model) copies this too, and its copy
        # must call the copied submodule)
        self.module = module
        self.name = name
        self.original = original  # the instance-level forward it replaced, or None

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.original if self.original is not None else type(self.module).forward.__get__(self.module)
        return inner(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # a compiled chosen module runs the policy's checkpoint (dynamo's own recompute):
            # the call is the submodule's alone there
            return self._call(*args, **kwargs)
        import torch_remat

        out = torch_remat.region(self._call, self.name, recompute=False)(*args, **kwargs)
        if not torch_remat.is_recomputing():
            torch_remat.recompute_needs_tensor(*([out] if isinstance(out, torch.Tensor) else [t for t in out if t is not None]))
        return out


def fake_or_meta(args: tuple, kwargs: dict) -> bool:
    """Whether a call runs on fake or meta tensors, where the policy stays (planning runs there)."""
    from torch.utils._pytree import tree_leaves

    return any(isinstance(t, torch.Tensor) and (t.is_meta or torch_compat.is_fake(t)) for t in tree_leaves((args, kwargs)))


class Verdict:
    """What the probed call found, judged at the next call: by then the code after the
    module has run, and an output it changed in place would break ``torch_remat``'s
    boundary (it hands out a view of the output made by a custom autograd function)."""

    def __init__(self, probe: Probe, out: Any) -> None:
        self.found = probe.regions()
        self.ok = output_ok(out)
        leaves = [out] if isinstance(out, torch.Tensor) else list(out) if self.ok else []
        self.versions = [(weakref.ref(t), t._version) for t in leaves]

    def regions(self) -> tuple[tuple[str, ...], str]:
        if not self.ok:
            return (), "its output is not a tensor or a tuple or list of tensors"
        for ref, version in self.versions:
            t = ref()
            if t is not None and t._version != version:
                return (), "its output is changed in place after it returns"
        return self.found


def run(owner: Any, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The chosen module's call as a ``torch_remat`` checkpoint, with memfit's guards: the
    buffers the forward changes hidden from the recompute, the recompute's Python state
    compared, the recorder told when the recompute starts and ends (``owner`` is the
    checkpointed forward of :mod:`memfit.recompute.checkpoint`)."""
    import torch_remat

    state = owner.state_guard(args, kwargs)

    def body(*a: Any, **k: Any) -> Any:
        if torch_remat.is_recomputing():
            with owner.guard.recompute(owner.name), state.recompute():
                return inner(*a, **k)
        with owner.guard.forward():
            return inner(*a, **k)

    return torch_remat.checkpoint(region_name=owner.name, recompute_state_hooks=(RngState(),))(body)(*args, **kwargs)
