"""A TARGET names a workload: every command takes one. It is a zoo name (``gpt``,
``mlp-deep``, ...) or ``path/to/file.py:function`` where ``function()`` returns a
:class:`~memfit.workload.Workload` (it may take a ``batch_size`` keyword, which
``--batch-size`` then sets), or ``torchtitan:MODULE:CONFIG``: torchtitan's own job
(:mod:`memfit.zoo.torchtitan`).

Its own module because it sits above both :mod:`memfit.workload` (the base) and
:mod:`memfit.zoo` (workloads built on that base): neither imports the other back.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memfit import zoo
from memfit.errors import TargetError
from memfit.workload import Workload
from memfit.zoo import torchtitan

__all__ = ["load_target"]


def _load_file_function(spec: str) -> Callable[..., Any]:
    path_text, _, func_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise TargetError(f"target file {path_text!r} does not exist; expected path/to/file.py:function")
    if not func_name.isidentifier():
        raise TargetError(f"target {spec!r} does not name a function after ':'; expected path/to/file.py:function")
    module_name = f"_memfit_target_{abs(hash(str(path.resolve())))}"
    # As Python runs a script: its directory first on sys.path, so that it imports the
    # modules beside it (``from mymodel import Net``). It stays there, as for a script:
    # the workload's function, the model's forward and unpickling in other processes
    # may import from it later (a bench child loads the file again and does the same).
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise TargetError(f"cannot import {path_text!r} as Python; expected a .py file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise TargetError(f"importing {path_text!r} raised {type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise TargetError(f"{path_text!r} has no function {func_name!r}")
    return func


def load_target(target: str, *, batch_size: int | None = None, sizes: Mapping[str, Any] | None = None) -> Workload:
    """Build the workload a TARGET names (a zoo name or ``file.py:function``)."""
    if not isinstance(target, str) or not target:
        raise TargetError("target must be a zoo name or path/to/file.py:function")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise TargetError(f"batch size must be a positive integer, got {batch_size!r}")
    if sizes and "batch_size" in sizes:
        # the batch is every target's own knob (a file's function takes batch_size= too), set once
        raise TargetError(f"the batch size is not a --size: give --batch-size {sizes['batch_size']} (in Python, batch_size=)")
    if torchtitan.is_torchtitan(target):
        return torchtitan.build(target, batch_size=batch_size, **(sizes or {}))
    if ":" not in target and not target.endswith(".py"):
        return zoo.build(target, batch_size=batch_size, **(sizes or {}))
    if ":" not in target:
        raise TargetError(f"target {target!r} names a file but no function; expected {target}:function")
    if sizes:
        raise TargetError("--size applies to zoo models only; a file target sets its own sizes")
    func = _load_file_function(target)
    kwargs: dict[str, Any] = {}
    if batch_size is not None:
        params = inspect.signature(func).parameters
        if "batch_size" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise TargetError(f"{target} takes no batch_size argument, so --batch-size cannot be applied")
        kwargs["batch_size"] = batch_size
    try:
        workload = func(**kwargs)
    except Exception as exc:
        raise TargetError(f"{target} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise TargetError(f"{target} returned {type(workload).__name__}; expected a memfit.Workload")
    return workload
