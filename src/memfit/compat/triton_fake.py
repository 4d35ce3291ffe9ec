"""Inductor's CUDA (Triton) code for a compiled step on fake CUDA tensors, no kernel run.

Inductor decides a CUDA step's memory before any Triton kernel is compiled: it lowers the
graph, fuses and schedules it for the device, and writes a Python wrapper that allocates every
buffer (``empty_strided_cuda``), reuses and ``del``s them, and hands them to kernels. Only
``async_compile.triton(...)`` (called when the wrapper module is loaded) compiles a kernel, and
only ``kernel.run(...)`` touches the GPU. So on memfit's fake CUDA (a CPU build of torch that
answers for one GPU) inductor generates the code a GPU build generates, given:

- a Triton package (its compiler is never called; inductor imports it to decide it may use it);
- ``CudaInterface.is_available`` True (``torch.utils._triton.has_triton`` asks it before
  inductor picks its Triton scheduling for "cuda"; ``torch.cuda.is_available`` stays False);
- a Triton driver that answers the target (``GPUTarget("cuda", capability, 32)``: the kernels'
  metadata and hashes), the current device and stream, instead of loading ``libcuda``;
- ``torch._C._cuda_getCurrentRawStream``, which the wrapper imports (a CPU build lacks it);
- ``AsyncCompile.triton`` returning a kernel that does nothing (as ``cpp`` on the host: fused
  kernels write into buffers the wrapper allocated), and ``_empty_strided_cuda`` (a C++ fast
  path past the dispatcher) made ``torch.empty_strided(device="cuda")``, so the fake mode makes
  the buffer fake and memfit's recording mode sees it; ``copy_if_misaligned`` (C++, which reads
  an input's address: a fake tensor has none) decides by the input's offset in its storage, as a
  caching allocator's block starts aligned, and copies as it would;
- inductor's constant folding (``UniformValueConstantFolder``), which runs the graph's
  constants as real one-element tensors on their device to find the ones a ``full`` can
  replace, runs them on the host (a CPU build has no CUDA kernels): the same values, so the
  same tensors replaced, each still made on the GPU by the code;
- ``shape_padding`` off: inductor pads a matmul whose sizes are not aligned only where a
  benchmark on the GPU says it is faster, which no fake tensor can run (not padding is what it
  decides without that benchmark, and for aligned sizes).

The caches these answers reach (``has_triton``, the Triton backend and its hash, device
properties) are emptied on entry and on exit, so nothing outside sees a GPU. The fake CUDA
shim answers the rest (:mod:`memfit.cuda.fake`: properties, capability, ``_exchange_device``).
Use inside :func:`memfit.compat.inductor_fake.stubbed_kernels` (its module caches and CPU
kernels). ``tests/test_compiled_triton.py`` fails when torch or Triton moves these names.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memfit.compat import inductor_fake, torch_compat
from memfit.compat.inductor_fake import _no_kernel
from memfit.errors import WorkloadError

__all__ = ["unavailable", "torch_lacks", "cuda_codegen", "compiles_on_fake"]

_SHARED_MEMORY = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (9, 0): 232448, (10, 0): 232448}
"""Bytes of shared memory a block may opt in to, by compute capability (NVIDIA's CUDA
programming guide); other minors of a major take 101,376 (8.6, 8.9, 12.0). Triton's
driver reports it; inductor reads it for grouped matmuls and its learned heuristics."""


def unavailable() -> str | None:
    """Why inductor cannot generate its Triton code on fake CUDA here (None: it can)."""
    try:
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.driver import CudaDriver  # noqa: F401
        from triton.runtime.driver import driver
    except (ImportError, ValueError) as e:  # ValueError: a module hidden (sys.modules["triton"] = None)
        return f"Triton is not importable here ({e})"
    missing = torch_lacks() + ([] if hasattr(driver, "_active") else ["triton.runtime.driver.driver._active"])
    return f"torch {torch.__version__} or triton lacks {', '.join(missing)}" if missing else None


def torch_lacks() -> list[str]:
    """The private names of torch :func:`cuda_codegen` uses that this torch lacks (Triton or not)."""
    try:
        from torch._dynamo import device_interface
        from torch._inductor import utils as inductor_utils
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.fx_passes.joint_graph import UniformValueConstantFolder
        from torch._inductor.runtime.hints import DeviceProperties
        from torch.utils import _triton
    except ImportError as e:
        return [f"an inductor module ({e})"]
    wanted = [
        ("CudaInterface.is_available", "is_available" in device_interface.CudaInterface.__dict__),
        ("caching_worker_device_properties", hasattr(device_interface, "caching_worker_device_properties")),
        ("AsyncCompile.triton", "triton" in AsyncCompile.__dict__),
        ("UniformValueConstantFolder._deduce_value", "_deduce_value" in UniformValueConstantFolder.__dict__),
        ("_empty_strided_cuda", hasattr(torch._C._dynamo.guards, "_empty_strided_cuda")),
        ("copy_if_misaligned", hasattr(torch._C._dynamo.guards, "copy_if_misaligned")),
        ("torch._inductor.utils.ALIGNMENT", hasattr(inductor_utils, "ALIGNMENT")),
        ("torch._inductor.utils.clone_preserve_strides", hasattr(inductor_utils, "clone_preserve_strides")),
        ("DeviceProperties.create.cache_clear", hasattr(DeviceProperties.create, "cache_clear")),
    ]
    wanted += [(f"torch.utils._triton.{n}.cache_clear", hasattr(getattr(_triton, n, None), "cache_clear")) for n in _CACHED]
    return [name for name, ok in wanted if not ok]


_CACHED = ("has_triton", "triton_backend", "triton_hash_with_backend")


def _driver() -> Any:
    """A Triton CUDA driver for the fake GPU: its target, device and stream, no ``libcuda``
    (``CudaDriver.__init__`` builds and loads a C extension that calls the CUDA driver). A
    subclass, so inductor's ``isinstance`` checks see CUDA's driver."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Utils:
        def get_device_properties(self, device: int = 0) -> dict[str, int]:
            p = torch.cuda.get_device_properties(device)
            shared = _SHARED_MEMORY.get((p.major, p.minor), 101376)
            return {"max_shared_mem": shared, "multiprocessor_count": p.multi_processor_count, "warpSize": 32}

    class FakeGpuDriver(CudaDriver):
        def __init__(self) -> None:  # not CudaDriver's: it loads libcuda
            self.utils = Utils()
            self.get_device_capability = lambda device=0: torch.cuda.get_device_capability()
            self.get_current_stream = lambda device=0: 0
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None

        def get_current_target(self) -> Any:
            major, minor = torch.cuda.get_device_capability()
            return GPUTarget("cuda", major * 10 + minor, 32)

    return FakeGpuDriver()


def _clear_caches() -> None:
    from torch._dynamo import device_interface
    from torch._inductor.runtime.hints import DeviceProperties
    from torch.utils import _triton

    for n in _CACHED:
        getattr(_triton, n).cache_clear()
    DeviceProperties.create.cache_clear()
    device_interface.caching_worker_device_properties.pop("cuda", None)


@contextmanager
def cuda_codegen() -> Iterator[None]:
    """Inside, inductor generates its CUDA (Triton) code for fake CUDA tensors, with its Triton
    kernels not compiled or run; everything put back, and its caches emptied, on the way out."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.fx_passes.joint_graph import UniformValueConstantFolder
    from triton.runtime.driver import driver

    guards = torch._C._dynamo.guards
    folder = UniformValueConstantFolder.__dict__["_deduce_value"]
    saved = (CudaInterface.__dict__["is_available"], AsyncCompile.__dict__["triton"], guards._empty_strided_cuda, folder)
    misaligned = guards.copy_if_misaligned
    active, had_stream = driver._active, hasattr(torch._C, "_cuda_getCurrentRawStream")
    _clear_caches()
    try:
        CudaInterface.is_available = staticmethod(lambda: True)  # type: ignore[method-assign]
        AsyncCompile.triton = _no_kernel  # type: ignore[method-assign]
        guards._empty_strided_cuda = _empty_strided_cuda
        guards.copy_if_misaligned = _copy_if_misaligned
        UniformValueConstantFolder._deduce_value = _folded_on_host(folder)  # type: ignore[method-assign]
        driver.set_active(_driver())
        if not had_stream:
            torch._C._cuda_getCurrentRawStream = _raw_stream  # type: ignore[attr-defined]
        with inductor_config.patch(shape_padding=False):
            yield
    finally:
        CudaInterface.is_available, AsyncCompile.triton, guards._empty_strided_cuda, folder = saved  # type: ignore[method-assign]
        UniformValueConstantFolder._deduce_value = folder  # type: ignore[method-assign]
        guards.copy_if_misaligned = misaligned
        driver._active = active
        if not had_stream:
            del torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
        _clear_caches()


class _ConstantsOnHost(TorchFunctionMode):
    """Factories and moves asked for "cuda" made on the host instead."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = {k: _host(v) for k, v in (kwargs or {}).items()}
        return func(*[_host(a) for a in args], **kwargs)


def _host(v: Any) -> Any:
    if isinstance(v, torch.device) and v.type == "cuda" or isinstance(v, str) and v.split(":")[0] == "cuda":
        return torch.device("cpu")
    return v


def _folded_on_host(deduce: Any) -> Any:
    def deduce_value(self: Any, node: Any) -> Any:
        with _ConstantsOnHost():
            return deduce(self, node)

    return deduce_value


def _empty_strided_cuda(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def _copy_if_misaligned(t: torch.Tensor) -> torch.Tensor:
    from torch._inductor.utils import ALIGNMENT, clone_preserve_strides

    # a CUDA caching allocator's block starts 512-byte aligned: only the offset into it can misalign
    return t if (t.storage_offset() * t.element_size()) % ALIGNMENT == 0 else clone_preserve_strides(t)


def _raw_stream(device: int) -> int:
    return 0  # the default stream's handle; the kernels it is passed to do nothing


@contextmanager
def compiles_on_fake(cuda: bool) -> Iterator[None]:
    """Inside, the modules a model compiled itself (``module.compile()``, as torchtitan compiles
    each block) compile and run on fake tensors: inductor's kernels not run, its wrapper's
    buffers made through dispatch (:func:`memfit.compat.inductor_fake.stubbed_kernels`); on fake
    CUDA (``cuda``) its CUDA (Triton) code generated (:func:`cuda_codegen`). Inductor's and
    AOTAutograd's compile caches are off: no graph compiled without its kernels is kept for a
    compile of the user's, and none of the user's is loaded here. Refused in one line where
    this torch (or, on fake CUDA, a missing Triton) cannot."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    why = inductor_fake.unavailable()
    if why:
        raise WorkloadError(f"compiled modules cannot run on fake tensors here: {why}")
    why = unavailable() if cuda else None
    if why:
        raise WorkloadError(f"compiled modules on fake CUDA need Triton for inductor's CUDA code (pip install triton): {why}")
    # fake CUDA loaded breaks inductor's cache key (it reads the fake device's properties)
    torch_compat.host_compile_system_info()
    with (
        inductor_fake.stubbed_kernels(),
        cuda_codegen() if cuda else nullcontext(),
        functorch_config.patch(enable_autograd_cache=False),
        inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
    ):
        yield
