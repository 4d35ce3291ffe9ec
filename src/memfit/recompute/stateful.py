"""Modules whose forward changes state outside their tensors, which a recompute would change again.

Checkpointing runs a module's forward a second time, in backward. Parameters, buffers and
the RNG are handled (:mod:`memfit.recompute.checkpoint`), Python state is not: a call counter
is bumped again, a list gets a second item, a KV cache (transformers' ``past_key_values``,
on by default in training, which a plan turns off instead: :mod:`memfit.recompute.cache`) is
extended twice. Some of these make the recompute fail,
which verifying a plan catches, one module per planning round; others change values
silently (a counter that scales the output) and training would quietly differ.

So before planning, the forward runs twice with hooks that summarise each module's own
attributes and the objects passed to it (except plain tensor arguments) before and after
its call. A module that changed them in the second, steady-state forward (the first may
fill a memo once, which a recompute then reuses) is excluded with the reason, and so is
every module containing it, whose recompute would run it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.compat import torch_compat

__all__ = ["stateful_modules", "call_state", "changed", "checking_forward"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward"}
_DEPTH = 4  # transformers' EncoderDecoderCache -> its DynamicCache -> list of layers -> a layer -> tensors
_MAX_ITEMS = 32
_MAX_NODES = 2048  # objects summarised per module call, beyond which only identities count


def _summary(value: Any, depth: int, keep: list[Any]) -> Any:
    """A comparable summary of ``value``: identities, lengths, tensor versions and plain
    values, to ``depth`` levels of containers and object attributes. ``keep`` holds the
    objects whose identity is recorded, so that no new object can reuse an id meanwhile."""
    if isinstance(value, _PLAIN):
        return value if value == value else "nan"
    keep.append(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if depth <= 0 or len(keep) > _MAX_NODES or isinstance(value, (nn.Module, type)) or callable(value):
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        items = tuple(_summary(v, depth - 1, keep) for v in value[:_MAX_ITEMS])
        return (type(value).__name__, id(value), len(value), items)
    if isinstance(value, dict):
        pairs = tuple((_summary(k, 0, keep), _summary(v, depth - 1, keep)) for k, v in list(value.items())[:_MAX_ITEMS])
        return ("dict", id(value), len(value), pairs)
    if isinstance(value, (set, frozenset)):
        return ("set", id(value), len(value))
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return (type(value).__name__, id(value), _summary(attrs, depth, keep))  # an object is its attributes
    return ("object", id(value))


def _own_state(mod: nn.Module, keep: list[Any]) -> dict[str, Any]:
    # FSDP2's state changes in its hooks around the forward, which a recompute does not run
    hooks_state = torch_compat.composable_state_keys()
    return {
        k: _summary(v, _DEPTH - 1, keep)
        for k, v in vars(mod).items()
        if k not in _MODULE_INTERNALS and not k.startswith("_memfit") and k not in hooks_state
    }


def _passed(args: tuple, kwargs: dict, keep: list[Any]) -> dict[str, Any]:
    """What the call was given, except plain tensors (a forward writing its input tensor
    in place, like ``ReLU(inplace=True)``, is autograd's business)."""
    named = {f"argument {i} ({type(a).__name__})": a for i, a in enumerate(args)}
    named |= {f"argument {k!r} ({type(v).__name__})": v for k, v in kwargs.items()}
    return {k: _summary(v, _DEPTH, keep) for k, v in named.items() if not isinstance(v, torch.Tensor)}


def call_state(module: nn.Module, args: tuple, kwargs: dict, keep: list[Any]) -> dict[str, Any]:
    """A comparable summary of what a call of ``module`` could change outside its tensors:
    its own and its submodules' attributes (``"attribute 'calls'"``, ``"attribute
    'attn.cache'"``) and the objects passed to it (``"argument 'log'"``), as
    :func:`stateful_modules` summarises them. ``keep`` holds the objects summarised."""
    out = {}
    for prefix, mod in module.named_modules():
        for key, value in _own_state(mod, keep).items():
            out[f"attribute {(prefix + '.' if prefix else '') + key!r}"] = value
    passed = {f"argument {i}": a for i, a in enumerate(args)} | {f"argument {k!r}": v for k, v in kwargs.items()}
    out |= {k: _summary(v, _DEPTH, keep) for k, v in passed.items() if not isinstance(v, torch.Tensor)}
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The first key whose summary differs, or None."""
    return _changed(before, after)


def _changed(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    for key in sorted(before.keys() | after.keys()):
        if before.get(key, "<absent>") != after.get(key, "<absent>"):
            return key
    return None


def _transformers_checkpointing(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", None) is True for m in model.modules())


def checking_forward(model: nn.Module) -> Any:
    """The autograd mode for a forward that only checks Python state: ``torch.no_grad()``
    (the same state changes at half the cost), unless transformers' gradient checkpointing
    is on (``gradient_checkpointing_enable()``, as peft's LoRA recipes use it). It acts only
    while grad is enabled: under no_grad the layers run uncheckpointed with the KV cache
    kept on (``merge_with_config_defaults``, ``GradientCheckpointingLayer``), which the
    training step never writes, and every attention layer would be excluded for it."""
    return torch.enable_grad() if _transformers_checkpointing(model) else torch.no_grad()


CACHE_HINT = "; transformers models: pass use_cache=False to train"
"""What a reason adds for a module writing transformers' KV cache (the planner replaces it
when it kept the cache on because turning it off changes the step's numbers)."""


def stateful_modules(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    first: Callable[[], None] | None = None,
    second: Callable[[], None] | None = None,
) -> dict[str, str]:
    """``{module name: reason}`` for the modules a recompute could not repeat safely.

    Runs the forward twice on ``model`` as it is (the first time by calling ``first``,
    if given: anything that runs the forward on ``args`` and ``kwargs`` once, such as a
    whole training step; the second, the one judged, by calling ``second`` if given, such as
    the step a caller records next, which then costs no forward of its own): call it where
    the step's state is restored afterwards (a sandbox)."""
    names: dict[nn.Module, str] = {}
    for name, mod in model.named_modules():
        names.setdefault(mod, name)
    frames: dict[nn.Module, list[tuple[dict, dict, list]]] = {}
    changes: dict[str, str] = {}
    called: set[str] = set()

    def pre(mod: nn.Module, a: tuple, kw: dict) -> None:
        keep: list[Any] = []
        frames.setdefault(mod, []).append((_own_state(mod, keep), _passed(a, kw, keep), keep))

    def post(mod: nn.Module, a: tuple, kw: dict, out: Any) -> None:
        own, passed, _keep = frames[mod].pop()  # _keep holds the objects summarised before
        name = names[mod]
        called.add(name)
        after: list[Any] = []  # counts nodes as ``pre`` did, so both truncate alike
        own_after, passed_after = _own_state(mod, after), _passed(a, kw, after)
        what = _changed(own, own_after)
        what = f"attribute {what!r}" if what else _changed(passed, passed_after)
        if what and name not in changes:
            changes[name] = what

    handles = []
    try:
        for mod in names:
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
        if first is not None:
            first()
        else:
            with checking_forward(model):
                model(*args, **kwargs)
        changes.clear()  # the first forward may fill a memo once, which a recompute reuses
        if second is not None:
            second()
        else:
            with checking_forward(model):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()

    reasons: dict[str, str] = {}
    for name, what in changes.items():
        if name:
            hint = CACHE_HINT if "Cache)" in what else ""
            reasons[name] = (
                f"recompute not reproducible: its forward changes {what}, state outside its tensors (a cache, "
                f"a counter) that a recompute would change again{hint}"
            )
    for name in sorted(changes, key=len):
        parts = name.split(".")
        for i in range(1, len(parts)):
            outer = ".".join(parts[:i])
            if outer in called and outer not in reasons:
                reasons[outer] = f"recompute not reproducible: contains {name!r}, whose forward changes {changes[name]}"
    return reasons
