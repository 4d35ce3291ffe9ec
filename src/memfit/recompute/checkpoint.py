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
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.compat import torch_compat
from memfit.errors import PlanError
from memfit.recompute import cache, remat
from memfit.recompute.stateful import call_state, changed

__all__ = [
    "apply_choices",
    "remove",
    "unwrap",
    "compiled_inner",
    "applied_choices",
    "mechanisms",
    "last_recompute",
    "CHECKPOINTED",
    "RECOMPUTE_WATCHERS",
]

CHECKPOINTED = "_memfit_applied"
"""Key in a model's ``__dict__`` under which :func:`apply_choices` lists the modules it runs
under a checkpoint (a mapping keyed by qualified name): the recorder reads it, their ops keep
the checkpoint's bookkeeping instead of saved records (checkpointed regions cost host memory
on CPU)."""
_APPLIED = CHECKPOINTED
"""Its values: ``(the instance forward memfit replaced, memfit's forward)`` per module. memfit's
forward is read there, not off the module, whose forward something may have wrapped since
(torchtitan's parallelize wraps each module's)."""

RECOMPUTE_WATCHERS: list[Any] = []
"""What is told as a checkpointed module's recompute starts and ends (its
``recompute_started(name)`` and ``recompute_done()``): every
:class:`~memfit.measure.scope.Scope` while it is entered."""
_NO_INSTANCE_FORWARD = object()

# Name of the module whose recompute began most recently (or whose checkpointed forward
# was refused): a recompute error surfaces later, in an unpack hook, and the planner uses
# this to name the module at fault.
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
                if m._buffers.get(k) is not None and (m._buffers[k]._version != v or torch_compat.updates_running_stats(m))
            ]

    @contextlib.contextmanager
    def recompute(self, name: str) -> Iterator[None]:
        _last_recompute[0] = name
        for watcher in RECOMPUTE_WATCHERS:
            watcher.recompute_started(name)
        originals = [(m, k, m._buffers[k]) for m, k in self.mutated]
        for m, k, b in originals:
            m._buffers[k] = b.detach().clone()
        try:
            yield
        finally:
            for m, k, b in originals:
                m._buffers[k] = b
            for watcher in RECOMPUTE_WATCHERS:  # early stop included: the ticks after it are backward's again
                watcher.recompute_done()


_STATE_CHECKS = 2
"""Recomputes of each checkpointed module whose Python state is compared (the summary
costs about a millisecond per transformer block, every step): a forward that changes state
does so from its first calls on, as :mod:`memfit.recompute.stateful` assumes for the planner."""


class _StateGuard:
    """Refuses a recompute that changes Python state (a call counter, a list grown per call,
    a cache passed in): checkpointing runs the forward a second time, so such state would
    change twice per step, and a value computed from it could differ in the recompute,
    silently. A memo filled on the first call and reused is no change. Only what runs
    before the recompute stops (after the last tensor backward needs) is seen: state
    changed later is not changed again."""

    def __init__(self, owner: _CheckpointedForward, args: tuple, kwargs: dict) -> None:
        self.owner, self.module, self.name, self.args, self.kwargs = owner, owner.module, owner.name, args, kwargs

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        if self.owner.state_checks >= _STATE_CHECKS:
            yield
            return
        self.owner.state_checks += 1
        keep: list[Any] = []  # the objects summarised: no new object may reuse their ids meanwhile
        before = call_state(self.module, self.args, self.kwargs, keep)
        try:
            yield
        finally:
            what = changed(before, call_state(self.module, self.args, self.kwargs, []))
            if what is not None:
                _last_recompute[0] = self.name  # the planner excludes the module named here
                raise PlanError(
                    f"module {self.name!r} ({type(self.module).__name__}) changed its {what} again when recomputed in "
                    "backward: its forward changes state outside its tensors (a counter, a cache), which checkpointing "
                    "changes twice per step, so training would differ; leave it out of the plan (memfit.plan does)"
                )


def _policy(save_ops: frozenset[str], watch: list[Any] | None = None) -> Callable[..., CheckpointPolicy]:
    """``watch[0]``, while it holds a :class:`~memfit.recompute.remat.Probe`, is told each op."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if watch and watch[0] is not None:
            watch[0].note(ctx, op)
        packet = getattr(op, "overloadpacket", op)
        if getattr(packet, "__name__", None) in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _call(fn: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
    return fn(*args, **kwargs)


def _input_versions(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor, int]]:
    """Every tensor in a call's arguments, with which argument holds it and its version."""
    from torch.utils._pytree import tree_flatten

    out = []
    for where, value in [
        *((f"argument {i}", a) for i, a in enumerate(args)),
        *((f"keyword {k!r}", v) for k, v in kwargs.items()),
    ]:
        leaves, _ = tree_flatten(value)
        # (inference tensors have no version counter; they cannot be saved for backward anyway)
        out.extend((where, t, t._version) for t in leaves if isinstance(t, torch.Tensor) and not t.is_inference())
    return out


class _CheckpointedForward:
    """The ``forward`` memfit puts on a chosen module.

    A callable object rather than a closure: ``copy.deepcopy(model)`` (an EMA copy, a
    fake-tensor copy) then gets a forward bound to the copied module, not the original."""

    def __init__(
        self, module: nn.Module, name: str, original: Any, mode: str, save_ops: tuple[str, ...], mechanism: str = "sac"
    ) -> None:
        self.module = module
        self.name = name
        self.original = original  # the instance-level forward it replaced, or None
        self.choice = (mode, save_ops)
        self.guard = _BufferGuard(module)
        self.watch: list[Any] = [None]
        self.policy = _policy(frozenset(save_ops), self.watch) if mode == "selective" else None
        self.state_checks = 0  # recomputes whose Python state _StateGuard compared
        # How the choice is applied: "full" checkpoints and "sac" run torch.utils.checkpoint;
        # "pending" probes the first step under the policy, then becomes "remat" or "sac".
        self.mechanism = "full" if mode == "full" else ("sac" if mechanism == "sac" else "pending")
        self.requested = mechanism
        self.why = "" if mode == "full" or mechanism != "sac" else "mechanism 'sac' asked for"
        self.pending: Any = None  # the probe's verdict, checked at the next call
        self.regions: dict[str, Any] = {}  # submodule -> the forward a RegionForward replaced

    def _inner(self) -> Callable[..., Any]:
        return self.original if self.original is not None else type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        # code that reads the forward's parameters (transformers' Trainer keeps only the
        # dataset columns the model's forward takes) sees the module's own
        return inspect.signature(self._inner())

    def state_guard(self, args: tuple, kwargs: dict) -> _StateGuard:
        return _StateGuard(self, args, kwargs)

    def _context_fn(self, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        state = _StateGuard(self, args, kwargs)
        if self.policy is None:
            return self.guard.forward(), _Pair(self.guard.recompute(self.name), state.recompute())
        sac_forward, sac_recompute = create_selective_checkpoint_contexts(self.policy)
        # The guard's buffer clones must happen outside SAC's mode, which would otherwise
        # see a clone in the recompute that the forward never ran.
        return _Pair(self.guard.forward(), sac_forward), _Pair(self.guard.recompute(self.name), state.recompute(), sac_recompute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner()
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return inner(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Dynamo keeps only a plain function or a functools.partial as context_fn (it
            # drops a bound method's self), and its own recompute neither re-applies buffer
            # updates (functionalised) nor needs RNG replay: the plain SAC contexts suffice.
            # (Passing context_fn=noop_context_fn explicitly fails too: leave it out.)
            if self.policy is None:
                return checkpoint(_call, inner, kwargs, *args, use_reentrant=False)
            sac = functools.partial(create_selective_checkpoint_contexts, self.policy)
            return checkpoint(_call, inner, kwargs, *args, use_reentrant=False, context_fn=sac)
        before = _input_versions(args, kwargs)
        if self.mechanism == "pending":
            self._decide(args, kwargs)
        if self.mechanism == "remat":
            out = remat.run(self, inner, args, kwargs)
        else:
            contexts = functools.partial(self._context_fn, args, kwargs)
            out = self._probed(inner, args, kwargs, contexts)
        changed = next((where for where, t, version in before if t._version != version), None)
        if changed is not None:
            # The recompute runs the forward again on these same tensors, now changed: torch
            # would recompute from wrong values (silently for keyword arguments, which it does
            # not save; with an obscure autograd error in backward for positional ones).
            _last_recompute[0] = self.name  # the planner excludes the module named here
            raise PlanError(
                f"module {self.name!r} ({type(self.module).__name__}) changed its input ({changed}) in place, "
                "so its recompute in backward would start from the changed values: it cannot be checkpointed; "
                "leave it out of the plan (memfit.plan does)"
            )
        return out

    def _probed(self, inner: Callable[..., Any], args: tuple, kwargs: dict, contexts: Any) -> Any:
        """The policy's checkpoint; while the mechanism is pending, under a probe."""
        if self.mechanism != "pending" or self.pending is not None or remat.fake_or_meta(args, kwargs):
            return checkpoint(_call, inner, kwargs, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)
        probe = remat.Probe(self.module, frozenset(self.choice[1]))
        self.watch[0] = probe
        try:
            out = checkpoint(_call, inner, kwargs, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)
        finally:
            self.watch[0] = None
            probe.close()
        self.pending = remat.Verdict(probe, out)
        return out

    def _decide(self, args: tuple, kwargs: dict) -> None:
        """At the call after the probed one: torch_remat if the probe allows it, else the policy."""
        if self.pending is None:
            return
        regions, why = self.pending.regions()
        self.pending = None
        if not regions:
            if self.requested == "remat":
                raise PlanError(
                    f"module {self.name!r} cannot be recomputed through torch_remat: {why}; use mechanism 'auto' or 'sac'"
                )
            self.mechanism, self.why = "sac", why
            return
        for sub in regions:
            mod = self.module.get_submodule(sub)
            # None, not the sentinel, for "no instance forward": copy.deepcopy copies an object()
            own = mod.__dict__.get("forward")
            self.regions[sub] = own
            mod.forward = remat.RegionForward(mod, sub, own)
        self.mechanism, self.why = "remat", f"saves the calls of {', '.join(regions)}"

    def uninstall(self) -> None:
        """Put back the forwards of the submodules saved through torch_remat."""
        for sub, own in self.regions.items():
            mod = self.module.get_submodule(sub)
            if own is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = own
        self.regions.clear()


def mechanisms(model: nn.Module) -> dict[str, tuple[str, str]] | None:
    """``{module: (mechanism, why)}`` for the plan applied to ``model`` (None if none is):
    ``"full"`` (torch.utils.checkpoint), ``"sac"`` (a selective-checkpoint policy),
    ``"remat"`` (torch_remat) or ``"pending"`` (the first step, under the policy, decides)."""
    applied = unwrap(model).__dict__.get(_APPLIED)
    if applied is None:
        return None
    return {name: (ours.mechanism, ours.why) for name, (_, ours) in applied.items()}


def applied_choices(model: nn.Module) -> dict[str, tuple[str, tuple[str, ...]]] | None:
    """``{module: (mode, save_ops)}`` applied to ``model``, or None if nothing is."""
    applied = model.__dict__.get(_APPLIED)
    if applied is None:
        return None
    return {name: ours.choice for name, (_, ours) in applied.items()}


def apply_choices(
    model: nn.Module,
    choices: dict[str, tuple[str, tuple[str, ...]]],
    cache_off: tuple[str, ...] | list[str] = (),
    mechanism: str | None = None,
) -> nn.Module:
    """Recompute ``choices`` (``{module name: (mode, save_ops)}``) in ``model``, in place,
    with transformers' KV cache off in training in the modules ``cache_off`` names
    (:mod:`memfit.recompute.cache`). ``mechanism`` says how selective choices run
    (:data:`memfit.recompute.remat.MECHANISMS`; ``"auto"`` uses torch_remat where it can;
    None: ``MEMFIT_RECOMPUTE``, else ``"auto"``)."""
    mechanism = remat.resolve(mechanism)
    if mechanism == "auto" and not remat.available():
        mechanism = "sac"
    if model.__dict__.get(_APPLIED) is not None:
        raise PlanError("a plan is already applied to this model; call memfit.remove(model) before applying another")
    modules = dict(model.named_modules())
    missing = [n for n in [*choices, *cache_off] if n not in modules]
    if missing:
        raise PlanError(f"the plan names module {missing[0]!r}, which this model does not have: was it made for another model?")
    for name in cache_off:
        if not cache.takes_use_cache(modules[name]):
            raise PlanError(f"the plan turns use_cache off in module {name!r}, whose forward takes no use_cache argument")
    for name, (mode, _) in choices.items():
        if mode not in ("full", "selective"):
            raise PlanError(f"unknown recompute mode {mode!r} for {name!r}; expected 'full' or 'selective'")
    for name, (mode, _) in choices.items():
        if (
            mechanism == "remat"
            and mode == "selective"
            and any(o != name and (_within(o, name) or _within(name, o)) for o in choices)
        ):
            raise PlanError(
                f"module {name!r} cannot be recomputed through torch_remat: another chosen module is nested in it or around it; use mechanism 'auto' or 'sac'"
            )
    # The switch first: a checkpoint on the same module then replays the switched forward.
    switched = cache.install(model, cache_off)
    applied: dict[str, tuple[Any, _CheckpointedForward]] = {}
    for name, (mode, save_ops) in choices.items():
        mod = modules[name]
        original = mod.__dict__.get("forward", _NO_INSTANCE_FORWARD)
        own = None if original is _NO_INSTANCE_FORWARD else original
        # torch_remat refuses a checkpoint inside another: a choice nested in or around
        # another stays on the policy.
        nested = any(o != name and (_within(o, name) or _within(name, o)) for o in choices)
        mod.forward = _CheckpointedForward(mod, name, own, mode, tuple(save_ops), "sac" if nested else mechanism)
        if nested and mode == "selective" and mechanism != "sac":
            mod.forward.why = "another chosen module is nested in it or around it (torch_remat nests no checkpoints)"
        applied[name] = (original, mod.forward)
    model.__dict__[_APPLIED] = applied
    if switched:
        model.__dict__[cache.CACHE_OFF] = switched
    return model


def _within(inner: str, outer: str) -> bool:
    return outer == "" or inner.startswith(outer + ".")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside ``torch.compile``'s and (Distributed)DataParallel's wrappers.

    A plan names modules as the unwrapped model does (a wrapper adds ``_orig_mod.`` or
    ``module.``) and is applied there, so ``memfit.apply``/``remove`` accept either. Both
    wrappers call the inner module at each step, and dynamo's guards on the inner modules'
    ``forward`` recompile when a plan is applied or removed after ``torch.compile``."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
            continue
        inner = compiled_inner(model)
        if inner is not None:
            model = inner
            continue
        return model


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module inside ``torch.compile(module)``'s wrapper when ``module`` is one, else None."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # no OptimizedModule before dynamo is imported
    return module._orig_mod if dynamo is not None and isinstance(module, dynamo.OptimizedModule) else None


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_choices` exactly; raises PlanError if nothing is applied.

    Takes the model or a wrapper of it (see :func:`unwrap`); returns what it was given."""
    inner = unwrap(model)
    applied = inner.__dict__.get(_APPLIED)
    if applied is None:
        raise PlanError("no memfit plan is applied to this model, so there is nothing to remove")
    covered = [n for n, (_, ours) in applied.items() if inner.get_submodule(n).__dict__.get("forward") is not ours]
    if covered:
        # (torchtitan's parallelize wraps each module's forward, memfit's included): taking
        # memfit's out would take the wrapper with it, and the model would compute otherwise
        raise PlanError(
            f"module {covered[0]!r}'s forward was wrapped after the plan was applied (by parallelizing?): removing the "
            "plan would remove that wrapper too; build the model again without the plan instead"
        )
    for name, (original, ours) in applied.items():
        mod = inner.get_submodule(name)
        ours.uninstall()
        if original is _NO_INSTANCE_FORWARD:
            mod.__dict__.pop("forward", None)
        else:
            mod.forward = original
    del inner.__dict__[_APPLIED]
    cache.uninstall(inner, inner.__dict__.pop(cache.CACHE_OFF, {}))
    return model
