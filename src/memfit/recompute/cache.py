"""Mechanism: transformers' KV cache off in training, as transformers does under gradient checkpointing.

A transformers model keeps ``use_cache=True`` in its config, and in a training step its
attention layers then write each key and value into a cache that nothing reads. A
recompute would write them a second time, so :mod:`memfit.recompute.stateful` refuses every
layer that does, which blocks the plans transformers itself reaches: its
``gradient_checkpointing_enable()`` makes the forward run with ``use_cache=False`` when
the model is training (``merge_with_config_defaults``, ``GradientCheckpointingLayer``).

memfit does the same, on the model it plans and applies to: the outermost modules whose
``forward`` takes a ``use_cache`` argument get an instance attribute ``forward`` that,
while the module is in training mode, calls the original with ``use_cache=False`` where
the call would have run with it on (an explicit true value, or none given and
``config.use_cache`` true, or a true default). Nothing else changes: the config, the
class, hooks and an evaluation-mode call (``generate``) stay as they are.

Which modules need it is seen, not guessed: a probe (the same attribute, changing
nothing) notes which of them return a cache (``past_key_values``) from a training-mode
call. An encoder such as BERT takes ``use_cache`` and has it true in its config, but
returns no cache: it is left alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["takes_use_cache", "cache_modules", "install", "uninstall", "switched_off", "turned_off", "writers", "CACHE_OFF"]

CACHE_OFF = "_memfit_cache_off"
"""``model.__dict__`` key: ``{module name: the forward it replaced}`` while a plan turns the cache off."""
_NONE = object()


def _takes_use_cache(mod: nn.Module) -> int | None:
    """The position of ``use_cache`` among the arguments of ``mod``'s class forward (-1:
    keyword only), or None if it takes none by that name."""
    try:
        params = list(inspect.signature(type(mod).forward).parameters.values())[1:]  # less self
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            positional = p.kind is p.POSITIONAL_OR_KEYWORD and all(
                q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD) for q in params[:i]
            )
            return i if positional else -1
    return None


def takes_use_cache(mod: nn.Module) -> bool:
    return _takes_use_cache(mod) is not None


def cache_modules(model: nn.Module) -> list[str]:
    """Names of the outermost modules (``""``: the root) whose forward takes ``use_cache``."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if any(name == f or name.startswith(f + ".") or f == "" for f in found):
            continue
        if takes_use_cache(mod):
            found.append(name)
    return found


def _carries_cache(out: Any) -> bool:
    """Whether a forward's result holds a KV cache: transformers' ``past_key_values``, or
    a cache object among the items of a tuple."""
    if getattr(out, "past_key_values", None) is not None:
        return True
    if isinstance(out, dict):
        return out.get("past_key_values") is not None
    return isinstance(out, (tuple, list)) and any(type(x).__name__.endswith("Cache") for x in out)


class _CacheOffForward:
    """The ``forward`` memfit puts on a module taking ``use_cache``. A callable object, not
    a closure: ``copy.deepcopy(model)`` (a fake-tensor copy) binds it to the copy."""

    def __init__(self, module: nn.Module, name: str, original: Any, position: int, probe: bool = False) -> None:
        self.module = module
        self.name = name
        self.original = original  # the instance-level forward it replaced, or None
        self.position = position
        self.probe = probe
        """A probe changes nothing: it notes whether a training-mode call returned a cache."""
        self.turned_off = False
        """Whether a call ran with the cache off that would have run with it on."""
        self.writes = False
        """(A probe) whether a training-mode call returned a cache."""

    @property
    def __signature__(self) -> inspect.Signature:
        # code that reads the forward's parameters (transformers' Trainer keeps only the
        # dataset columns the model's forward takes) sees the module's own
        return inspect.signature(self.original if self.original is not None else type(self.module).forward.__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.original if self.original is not None else type(self.module).forward.__get__(self.module)
        if not self.module.training:
            return inner(*args, **kwargs)
        if self.probe:
            out = inner(*args, **kwargs)
            self.writes = self.writes or _carries_cache(out)
            return out
        args, kwargs = self._off(args, kwargs)
        return inner(*args, **kwargs)

    def _off(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        positional = 0 <= self.position < len(args)
        value = args[self.position] if positional else kwargs.get("use_cache")
        if value is None:  # transformers' default: the config's, else the signature's
            config = getattr(self.module, "config", None)
            value = getattr(config, "use_cache", None)
            if value is None:
                default = inspect.signature(type(self.module).forward).parameters["use_cache"].default
                value = None if default is inspect.Parameter.empty else default
        if not value:
            return args, kwargs
        self.turned_off = True
        if positional:
            return (*args[: self.position], False, *args[self.position + 1 :]), kwargs
        return args, {**kwargs, "use_cache": False}


def install(model: nn.Module, names: list[str] | tuple[str, ...], *, probe: bool = False) -> dict[str, Any]:
    """Put the switch (or with ``probe``, the probe) on ``names``, modules of ``model``;
    returns what :func:`uninstall` needs."""
    originals: dict[str, Any] = {}
    for name in names:
        mod = model.get_submodule(name)
        position = _takes_use_cache(mod)
        if position is None:
            continue
        original = mod.__dict__.get("forward", _NONE)
        originals[name] = original
        mod.forward = _CacheOffForward(mod, name, None if original is _NONE else original, position, probe)
    return originals


def uninstall(model: nn.Module, originals: dict[str, Any]) -> None:
    """Undo :func:`install` exactly."""
    for name, original in originals.items():
        mod = model.get_submodule(name)
        if original is _NONE:
            mod.__dict__.pop("forward", None)
        else:
            mod.forward = original


def _installed(model: nn.Module) -> list[_CacheOffForward]:
    return [f for _, mod in model.named_modules() if isinstance(f := mod.__dict__.get("forward"), _CacheOffForward)]


def turned_off(model: nn.Module) -> tuple[str, ...]:
    """Modules of ``model`` whose switch has turned the cache off in a call so far."""
    return tuple(f.name for f in _installed(model) if not f.probe and f.turned_off)


def switched(model: nn.Module) -> tuple[str, ...]:
    """Modules of ``model`` carrying the switch (a copy of a switched model carries it too)."""
    return tuple(f.name for f in _installed(model) if not f.probe)


def writers(model: nn.Module) -> tuple[str, ...]:
    """Modules of ``model`` whose probe saw a training-mode call return a cache."""
    return tuple(f.name for f in _installed(model) if f.probe and f.writes)


@contextmanager
def switched_off(model: nn.Module, names: tuple[str, ...] | list[str]) -> Iterator[None]:
    """The switch on ``names`` while the block runs, then removed."""
    originals = install(model, names)
    try:
        yield
    finally:
        uninstall(model, originals)
