"""Which phase of the step is running, and inside which module.

Forward is tracked with per-module pre/post hooks on the user's model (a stack).
Backward is tracked the way ``torch.utils.module_tracker.ModuleTracker`` does it, with
multi-grad hooks: a module is entered when gradients reach its outputs and left when
its inputs' gradients are done (:func:`memfit.compat.torch_compat.when_all_grads`: torch's
own keeps the gradients it waits on alive, which the step being measured does not). ModuleTracker itself is not used because it names
modules by class (``GPT.transformer.h.0``), keeps a set (a module called twice breaks
it) and forgets the module that raised; memfit needs ``state_dict``-style names and the
innermost module at the moment a forward fails.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.compat import torch_compat
from memfit.measure.ledger import Phase
from memfit.recompute.checkpoint import RECOMPUTE_WATCHERS, compiled_inner

__all__ = ["Scope", "Clock", "compiled_regions", "compiles"]


def compiled_regions(model: nn.Module) -> tuple[set[nn.Module], set[nn.Module]]:
    """The modules of ``model`` that are compiled (``module.compile()``, or the module inside
    ``torch.compile(module)``'s wrapper), and the modules strictly inside them: dynamo traces a
    compiled module's call, hooks and children included, into its graphs."""
    roots: set[nn.Module] = set()
    for mod in model.modules():
        if getattr(mod, "_compiled_call_impl", None) is not None:
            roots.add(mod)
        inner = compiled_inner(mod)
        if inner is not None:
            roots.add(inner)
    inside = {m for r in roots for m in r.modules() if m is not r}
    return roots, inside


def compiles(model: nn.Module) -> bool:
    """``model`` compiles some of its step itself: a compiled module, or a module that says it
    calls a compiled function (``compiles = True``: torchtitan's step, whose loss is one)."""
    return bool(compiled_regions(model)[0]) or any(getattr(m, "compiles", False) is True for m in model.modules())


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


class Clock:
    """Timestamps for module times: ``perf_counter`` on the CPU; on CUDA an event per
    mark, read once the step is over, so the GPU is never synchronised mid-step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


class Scope:
    """Context manager hooking ``model``; read :attr:`phase` and :attr:`module` at any time.

    With a :class:`Clock` it also times every module call, forward and backward, inclusive
    of children: hooks fire per module call, not per op, so timing adds next to nothing.
    """

    def __init__(self, model: nn.Module, clock: Clock | None = None) -> None:
        self.model = model
        """The module named ``""``: under a wrapper (DDP's), the module inside it."""
        self.names: dict[nn.Module, str] = {}
        for name, mod in model.named_modules():
            self.names.setdefault(mod, name)
        self.phase = Phase.START
        self.clock = clock
        self._forward: list[tuple[str, Any]] = []  # (name, start mark)
        self._recompute: str | None = None
        """The checkpointed module whose recompute runs now. torch's checkpoint replays the
        module's bare forward, so its own hooks do not fire: without this, the ops of its
        own body (a residual add, an inline activation) would count as backward's."""
        self._backward: list[tuple[str, Any]] = []
        self._deepest: str | None = None
        """The deepest module of ``_backward`` (the first of the deepest from its top), kept
        as it changes: :attr:`module` is read at every op and allocation of a recorded step."""
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self.calls: dict[str, int] = {}
        """Forward calls per module since the last :meth:`set_phase` to ``FORWARD``."""
        self._spans: list[tuple[Phase, str, Any, Any]] = []
        self._passed: dict[nn.Module, list[dict[int, int]]] = {}  # per call: id -> version of its inputs needing grad
        self.listener: Any = None
        """Optional ``listener(phase, name, entering, inputs)``, told of every module entry and
        exit (``phase`` is FORWARD for forward calls, BACKWARD for their backward);
        ``inputs`` are the tensors a forward call receives, else ``()``."""

    # -- queries ----------------------------------------------------------------------------

    @property
    def module(self) -> str | None:
        """Innermost module running now: the top of the forward stack (also during a
        recompute inside backward), else the deepest module whose backward is running."""
        if self._forward:
            return self._forward[-1][0]
        if self._recompute is not None:
            return self._recompute
        if self._backward and self.phase is Phase.BACKWARD:
            return self._deepest
        return None

    @property
    def recomputing(self) -> bool:
        """A module's forward runs during backward: a checkpointed module's recompute."""
        return self.phase is Phase.BACKWARD and (self._recompute is not None or bool(self._forward))

    def set_phase(self, phase: Phase) -> None:
        if phase is Phase.FORWARD:
            self.calls = {}
            self._spans = []
        if self._backward:
            # modules whose inputs need no grad never "leave" backward: they end with it
            end = self._mark()
            for n, t0 in reversed(self._backward):
                if self.clock is not None:
                    self._spans.append((Phase.BACKWARD, n, t0, end))
                self._tell(Phase.BACKWARD, n, False)
        self.phase = phase
        self._forward.clear()
        self._backward.clear()
        self._deepest = None

    def times(self) -> dict[tuple[Phase, str], float]:
        """Seconds per (phase, module) over the step since the last forward began."""
        out: dict[tuple[Phase, str], float] = {}
        if self.clock is not None:
            for phase, name, t0, t1 in self._spans:
                out[(phase, name)] = out.get((phase, name), 0.0) + self.clock.seconds(t0, t1)
        return out

    # -- hooks ------------------------------------------------------------------------------

    def _mark(self) -> Any:
        return None if self.clock is None else self.clock.mark()

    def _tell(self, phase: Phase, name: str, entering: bool, inputs: Any = ()) -> None:
        if self.listener is not None:
            self.listener(phase, name, entering, inputs)

    def _pre(self, mod: nn.Module, args: Any, kwargs: Any) -> None:
        name = self.names[mod]
        self._forward.append((name, self._mark()))
        if self.phase is Phase.FORWARD:
            if self.listener is not None:
                leaves, _ = tree_flatten((args, kwargs))
                self._tell(Phase.FORWARD, name, True, [t for t in leaves if isinstance(t, torch.Tensor)])
            self.calls[name] = self.calls.get(name, 0) + 1
            if torch.is_grad_enabled():
                tensors = _grad_tensors((args, kwargs))
                self._passed.setdefault(mod, []).append({id(t): t._version for t in tensors})
                if tensors:
                    self._grad_handles.append(torch_compat.when_all_grads(tensors, lambda n=name: self._leave_bw(n)))

    def _post(self, mod: nn.Module, args: Any, output: Any) -> None:
        name = self.names[mod]
        # Pop this module's own frame, and any a child left behind by raising.
        for i in range(len(self._forward) - 1, -1, -1):
            if self._forward[i][0] == name:
                if self.phase is Phase.FORWARD:
                    if self.clock is not None:
                        self._spans.append((Phase.FORWARD, name, self._forward[i][1], self.clock.mark()))
                    self._tell(Phase.FORWARD, name, False)
                del self._forward[i:]
                break
        if self.phase is Phase.FORWARD and torch.is_grad_enabled():
            # An input handed back as it is (T5's position_bias, returned by every block
            # that takes it) gets its gradient only once every user of it is done, this
            # module's own ops included: it says nothing of when this module's backward
            # begins. (One it wrote in place, like ReLU(inplace=True)'s, does.)
            frames = self._passed.get(mod)
            passed = frames.pop() if frames else {}
            tensors = [t for t in _grad_tensors(output) if passed.get(id(t)) != t._version]
            if tensors:
                # An output that is its backward's root enters backward as it gets its gradient
                # (a pipeline stage's last module: its output's gradient comes from the next
                # stage), but the model's own: its output is the step's loss, whose backward is
                # the whole backward, kept outside any module as every profile has it.
                enter = torch_compat.when_all_grads(tensors, lambda n=name: self._enter_bw(n), roots=name != "")
                self._grad_handles.append(enter)

    def _enter_bw(self, name: str) -> None:
        self._backward.append((name, self._mark()))
        self._backward_changed()
        self._tell(Phase.BACKWARD, name, True)

    def _leave_bw(self, name: str) -> None:
        for i in range(len(self._backward) - 1, -1, -1):
            if self._backward[i][0] == name:
                _, t0 = self._backward.pop(i)
                self._backward_changed()
                if self.clock is not None:
                    self._spans.append((Phase.BACKWARD, name, t0, self.clock.mark()))
                self._tell(Phase.BACKWARD, name, False)
                break

    def _backward_changed(self) -> None:
        self._deepest = max((n for n, _ in reversed(self._backward)), key=_depth) if self._backward else None

    def recompute_started(self, name: str) -> None:
        if self.phase is Phase.BACKWARD:
            self._recompute = name

    def recompute_done(self) -> None:
        """A checkpointed module's recompute ended. torch stops a recompute early by raising
        inside a forward, which leaves its modules' frames on the stack: they go, or the
        ticks after would count as the recompute's and be put in its modules."""
        self._recompute = None
        if self.phase is Phase.BACKWARD:
            self._forward.clear()

    def __enter__(self) -> Scope:
        RECOMPUTE_WATCHERS.append(self)  # told as a checkpointed module's recompute starts and ends
        roots, inside = compiled_regions(self.model)
        pre, post = self._pre, self._post
        if roots:
            # dynamo traces a compiled module's own hooks with its forward: these run as
            # torchtitan's FSDP2 hooks do, outside the graph (disabled), each call
            pre, post = torch.compiler.disable(pre, recursive=True), torch.compiler.disable(post, recursive=True)
        for mod in self.names:
            if mod in inside:
                # inside a compiled region (fullgraph: no graph break allowed) the modules are
                # gone: the region's ops are its compiled module's
                continue
            self._handles.append(mod.register_forward_pre_hook(pre if mod in roots else self._pre, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(post if mod in roots else self._post))
        return self

    def __exit__(self, *exc: object) -> None:
        if self in RECOMPUTE_WATCHERS:
            RECOMPUTE_WATCHERS.remove(self)
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles.clear()
        self._grad_handles.clear()
        self._passed.clear()
