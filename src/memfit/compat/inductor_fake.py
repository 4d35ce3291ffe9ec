"""Running an inductor-compiled step on fake tensors: the private corners of torch it needs.

A compiled step's memory is decided by code torch generates: AOTAutograd's partitioner picks
what the forward graph returns for backward, and inductor's Python wrapper allocates every
buffer (``empty_strided_cpu``), hands it to fused kernels and extern kernels (``mm(out=...)``)
and ``del``s it where its last use is. None of that needs real memory but the kernels
themselves. So memfit compiles and runs the step on fake tensors with the generated C++
kernels replaced by calls that do nothing, and the wrapper's allocations through dispatch:

- ``AsyncCompile.cpp_pybinding`` and ``AsyncCompile.cpp`` return a kernel that does nothing
  (fused kernels write into buffers the wrapper allocated: skipping them allocates nothing,
  and no C++ is compiled);
- ``torch._C._dynamo.guards._empty_strided_cpu`` and ``_reinterpret_tensor``, which the
  wrapper binds when its module is loaded, become ``torch.empty_strided`` and
  ``torch.as_strided``: the same tensors, made through the dispatcher, so a fake mode makes
  them fake and a dispatch mode sees them (the C++ fast paths bypass both).

Nothing of this may reach a compile of the user's. Inductor keeps loaded wrapper modules in
``PyCodeCache`` by the hash of their source: the cache is emptied on entry (else memfit's
compile could load a module of the user's, whose real kernels would run on fake tensors) and
on exit (else the user's next compile of the same graph could load memfit's, whose kernels do
nothing). Compiled graphs are never cached on disk meanwhile (the caller turns inductor's FX
graph cache and AOTAutograd's cache off). ``tests/test_compiled_fake.py`` fails when torch
moves any of these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["unavailable", "stubbed_kernels"]

_KERNEL_FACTORIES = ("cpp_pybinding", "cpp")
_FAST_PATHS = ("_empty_strided_cpu", "_reinterpret_tensor")


def unavailable() -> str | None:
    """Why this torch cannot run a compiled step on fake tensors (None: it can)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        # without it a dispatch mode makes dynamo run the step eagerly: nothing compiled to see
        return f"torch {torch.__version__} has no TorchDispatchMode.ignore_compile_internals"
    try:
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import PyCodeCache
    except ImportError as e:
        return f"torch's inductor is not importable here ({e})"
    guards = torch._C._dynamo.guards
    missing = [n for n in _KERNEL_FACTORIES if not hasattr(AsyncCompile, n)]
    missing += [n for n in _FAST_PATHS if not hasattr(guards, n)]
    missing += [] if hasattr(PyCodeCache, "cache_clear") else ["PyCodeCache.cache_clear"]
    return f"torch {torch.__version__} lacks {', '.join(missing)}" if missing else None


class _NoKernel:
    """A generated kernel that is not run: the wrapper allocated its outputs already."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None


def _no_kernel(self: Any, *args: Any, **kwargs: Any) -> _NoKernel:
    return _NoKernel()


def _empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(t: torch.Tensor, size: Any, stride: Any, offset: int = 0) -> torch.Tensor:
    # the C++ helper's offset is relative to the tensor's own
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


@contextmanager
def stubbed_kernels() -> Iterator[None]:
    """Inductor's CPU kernels as calls that do nothing, and its wrapper's allocations through
    dispatch, for the compiles and runs inside; everything put back, and every wrapper module
    loaded meanwhile dropped, on the way out."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    guards = torch._C._dynamo.guards
    factories = {n: AsyncCompile.__dict__[n] for n in _KERNEL_FACTORIES}
    fast = {n: getattr(guards, n) for n in _FAST_PATHS}
    PyCodeCache.cache_clear()
    try:
        for n in _KERNEL_FACTORIES:
            setattr(AsyncCompile, n, _no_kernel)
        guards._empty_strided_cpu = _empty_strided_cpu
        guards._reinterpret_tensor = _reinterpret_tensor
        yield
    finally:
        for n, f in factories.items():
            setattr(AsyncCompile, n, f)
        for n, f in fast.items():
            setattr(guards, n, f)
        PyCodeCache.cache_clear()
