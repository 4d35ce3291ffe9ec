"""Fake CUDA on a CPU build of torch: fake tensors on ``cuda:0`` with CUDA's semantics.

A CPU build makes fake tensors on "cuda" under FakeTensorMode, but any backward on them
aborts the process, ``torch.autocast("cuda")`` turns itself off and SDPA takes the math
kernel. Three pieces make a training step run there as a CUDA build would run it:

1. ``fake.cpp``, built here with the machine's C++ compiler against the installed
   torch's headers (once per torch, cached), registers CUDA hooks that report one device
   and c10's ``FakeGuardImpl<CUDA>`` as the CUDA device guard. It must be loaded before
   torch is imported: torch keeps the first hooks it looks up.
2. ``torch.cuda`` functions a step asks (device, streams, events, capability, bf16
   support, autocast's availability check) answer for one GPU; ``is_available()`` stays
   False, since True would start torch's CUDA initialisation.
3. ``F.scaled_dot_product_attention`` on CUDA tensors calls the kernel a CUDA build picks
   (flash, else memory-efficient, else the math composite). A global patch, not a
   TorchFunctionMode: modes are per thread, and a checkpoint's recompute must pick the
   kernel the forward picked. Inside :func:`host_attention_as_cuda` it does so on host
   tensors too (a fake-CUDA step compiled on the host).

This module imports no torch at import time (it must run before torch is imported); every
private torch name it touches is here, and ``tests/test_fake_cuda.py`` checks them.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.cuda.gpu import GPUS, GpuSpec
from memfit.errors import MemfitError

__all__ = [
    "FakeCudaError",
    "DEFAULT_GPU",
    "ENV_FLAG",
    "enable",
    "preload",
    "relaunch_for_command",
    "active",
    "require",
    "cache_dir",
    "build",
    "set_gpu",
    "host_attention_as_cuda",
]

ENV_FLAG = "MEMFIT_FAKE_CUDA"
"""``MEMFIT_FAKE_CUDA=1`` in the environment: ``import memfit`` loads the shim (before torch,
if memfit is imported first), for ``memfit.profile(..., fake="cuda")`` in a script."""

SOURCE = Path(__file__).with_name("fake.cpp")
_FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-w")
_HINT = "or use fake CPU tensors (--device fake, fake=True; CPU autocast casts other ops and attention takes the math kernel)"


class FakeCudaError(MemfitError):
    """Fake CUDA cannot run in this process or on this machine."""


DEFAULT_GPU = GPUS["H100-80GB"]
"""The GPU fake CUDA answers for unless told another (:func:`set_gpu`, ``--gpu``)."""

_state: dict[str, Any] = {"enabled": False, "failure": None, "gpu": DEFAULT_GPU, "host_as_cuda": False}


def active() -> bool:
    """Whether this process runs fake CUDA (the shim loaded before torch)."""
    return bool(_state["enabled"])


def gpu() -> GpuSpec:
    return _state["gpu"]


def set_gpu(spec: GpuSpec) -> None:
    """Answer for ``spec`` from now on (the stubs read it at each call: capability, memory,
    name; SDPA's kernel choice and cuBLAS's workspace size follow)."""
    _state["gpu"] = spec


def cache_dir() -> Path:
    """Where built shims are kept: ``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit``,
    else ``~/.cache/memfit``."""
    if os.environ.get("MEMFIT_CACHE_DIR"):
        return Path(os.environ["MEMFIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memfit"


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise FakeCudaError("fake CUDA needs torch installed in this Python")
    return Path(spec.origin).parent


def _compiler() -> str:
    cxx = os.environ.get("CXX")
    found = shutil.which(cxx) if cxx else (shutil.which("g++") or shutil.which("c++"))
    if not found:
        what = f"CXX={cxx!r} is not a program on this machine" if cxx else "no C++ compiler (g++ or c++) on PATH"
        raise FakeCudaError(
            f"fake CUDA builds a small C++ library against torch's headers, and {what}: install g++ (or set CXX), {_HINT}"
        )
    return found


def build(torch_dir: Path | None = None, *, cache: Path | None = None) -> Path:
    """The shim for the installed torch: built on first use, then taken from the cache
    (keyed by torch's version and location, the source and the compiler)."""
    torch_dir = torch_dir or _torch_dir()
    version = importlib.metadata.version("torch")
    if (torch_dir / "lib" / "libtorch_cuda.so").exists():
        raise FakeCudaError(
            f"torch {version} is a CUDA build: measure on the GPU with --device cuda; fake CUDA is for the CPU build of torch"
        )
    include = torch_dir / "include"
    if not (include / "ATen" / "detail" / "CUDAHooksInterface.h").exists() or not (torch_dir / "lib").is_dir():
        raise FakeCudaError(
            f"torch {version} at {torch_dir} has no C++ headers (include/ATen/detail/CUDAHooksInterface.h) to build "
            f"fake CUDA against: install an official torch wheel (they ship them), {_HINT}"
        )
    cxx = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([version.encode(), str(torch_dir).encode(), source, cxx.encode(), *map(str.encode, _FLAGS)]))
    folder = cache or cache_dir()
    out = folder / f"fake_cuda-torch{version}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    lib = torch_dir / "lib"
    print(f"memfit: building the fake-CUDA shim for torch {version} (once; cached in {folder})", file=sys.stderr)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise FakeCudaError(f"cannot write the fake-CUDA shim to {folder} ({exc.strerror}): set MEMFIT_CACHE_DIR") from None
    # torch's own ABI flag: a mismatch shows as missing std::string symbols at load time
    abi = _cxx11_abi(lib)
    cmd = [
        cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}", str(SOURCE), "-o", tmp,
        f"-L{lib}", "-Wl,--no-as-needed", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise FakeCudaError(f"the C++ compiler {cxx} did not run ({exc}): {_HINT}") from None
    if done.returncode != 0:
        os.unlink(tmp)
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["(no output)"]
        raise FakeCudaError(f"building fake CUDA against torch {version}'s headers failed ({errors[0].strip()[:200]}): {_HINT}")
    os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    return out


def _cxx11_abi(lib: Path) -> int:
    """torch's ``_GLIBCXX_USE_CXX11_ABI``, read from libc10 without importing torch: c10's own
    exported symbols name ``std::__cxx11`` types only under the new ABI. Only c10's: torch
    2.6's wheels (the old ABI) name them too, in the libstdc++ symbols they carry."""
    try:
        data = (lib / "libc10.so").read_bytes()
    except OSError:
        return 1
    return 1 if re.search(rb"_ZN3c10\w*St7__cxx11", data) else 0


def enable(gpu: GpuSpec | None = None) -> None:
    """Load the shim and import torch with it (idempotent). Raises :class:`FakeCudaError`
    when this process imported torch already or the shim cannot be built or loaded."""
    if gpu is not None:
        _state["gpu"] = gpu
    if _state["enabled"]:
        return
    if "torch" in sys.modules:
        raise FakeCudaError(_too_late())
    path = build()
    # The autograd engine starts a thread per CUDA device. At exit it would wake them to
    # stop, and one taking the GIL while Python finalizes is killed by a forced unwind
    # through C++ (std::terminate). Not waiting leaves them asleep.
    os.environ.setdefault("TORCH_AUTOGRAD_SHUTDOWN_WAIT_LIMIT", "0")
    try:
        handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        handle.memfit_fake_cuda_version.restype = ctypes.c_int
        handle.memfit_fake_cuda_version()
    except (OSError, AttributeError) as exc:
        raise FakeCudaError(
            f"cannot load the fake-CUDA shim {path} ({str(exc).splitlines()[0][:200]}): delete it to rebuild, {_HINT}"
        ) from None
    import torch

    if not _hooks_registered(torch):
        raise FakeCudaError(f"torch {torch.__version__} did not take memfit's fake CUDA hooks: {_HINT}")
    _install_stubs(torch)
    _patch_sdpa(torch)
    _fused_as_on_cuda(torch)
    _state["enabled"] = True


def preload() -> None:
    """Called first thing by ``import memfit``: load the shim when ``MEMFIT_FAKE_CUDA=1`` asks for
    it and torch is not imported yet. Reads the environment, never the command line (the memfit
    command decides at its edge: :func:`relaunch_for_command`). Never raises: a failure is kept
    for :func:`require` to report."""
    if os.environ.get(ENV_FLAG, "") in ("", "0"):
        return
    _load_early()


def _load_early() -> None:
    if "torch" in sys.modules:
        return  # too late: require() says so
    try:
        enable()
    except FakeCudaError as exc:
        _state["failure"] = exc


RELAUNCHED = "MEMFIT_FAKE_CUDA_RELAUNCHED"
"""Set (with :data:`ENV_FLAG`) in the environment of a memfit command run again by
:func:`relaunch_for_command`; both are taken out again as it starts."""


def relaunch_for_command(argv: list[str]) -> None:
    """The memfit command's edge (:func:`memfit.cli.main`): when ``argv``, the interpreter's whole
    command line (``sys.orig_argv``), is ``memfit ... --device fake-cuda`` or ``python -m memfit
    ... --device=fake-cuda`` and fake CUDA is not on, run that command line again in this process
    (``os.execve``) with ``MEMFIT_FAKE_CUDA=1``: the shim must load before torch, which ``import
    memfit`` has imported by the time the command runs. In the command run again, takes both
    variables out of the environment (what it starts does not inherit them, as before) and
    returns; a shim that failed to load there is reported by :func:`require`. Returns at once
    for any other command line."""
    if os.environ.pop(RELAUNCHED, None) is not None:
        os.environ.pop(ENV_FLAG, None)
        return
    if _state["enabled"] or _state["failure"] is not None or not _is_fake_cuda_command(argv):
        return
    if "torch" not in sys.modules:
        _load_early()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(argv), {**os.environ, ENV_FLAG: "1", RELAUNCHED: "1"})


def _is_fake_cuda_command(argv: list[str]) -> bool:
    """``memfit ... --device fake-cuda`` or ``python -m memfit ... --device=fake-cuda``, or ``memfit finetune ...``."""
    args, i = argv[1:], 0
    # The interpreter's own options come first (`python -u -X dev -m memfit ...`).
    while i < len(args):
        a = args[i]
        if a in ("-m", "-mmemfit"):
            if a == "-m" and args[i + 1 : i + 2] != ["memfit"]:
                return False
            args = args[i + (2 if a == "-m" else 1) :]
            break
        if not a.startswith("-"):  # the script: the memfit command, or something else
            if os.path.basename(a) != "memfit":
                return False
            args = args[i + 1 :]
            break
        i += 2 if a in ("-X", "-W") else 1
    else:
        return False
    if next((a for a in args if not a.startswith("-")), None) == "finetune":  # a command that runs on fake CUDA only
        return True
    return "--device=fake-cuda" in args or any(a == "--device" and b == "fake-cuda" for a, b in zip(args, args[1:]))


def require() -> None:
    """Make sure fake CUDA is on, or raise the one-line reason it cannot be."""
    if _state["enabled"]:
        return
    if _state["failure"] is not None:
        raise _state["failure"]
    if "torch" in sys.modules:
        raise FakeCudaError(_too_late())
    enable()


def _too_late() -> str:
    return (
        "fake CUDA must be loaded before torch, and this Python imported torch without it: run the memfit command with "
        f"--device fake-cuda, or start Python with {ENV_FLAG}=1 and import memfit before torch, {_HINT}"
    )


# --- torch side (torch imported) ------------------------------------------------------


def _hooks_registered(torch: Any) -> bool:
    """Canary: the accelerator torch reports comes from the hooks (None on a CPU build
    without them)."""
    try:
        acc = torch.accelerator.current_accelerator()
    except Exception:  # noqa: BLE001 - any failure means the hooks are not usable
        return False
    return acc is not None and acc.type == "cuda"


class _Stream:
    """A CUDA stream that orders nothing (fake tensors have no kernels to order) but is one
    stream of its own: ``torch.cuda.stream(s)`` makes it the current stream, so that the
    recorder notes which stream each block is allocated on (FSDP2 allocates its all-gather
    buffers on its copy-in stream and its reduce-scatter outputs, the sharded gradients, on
    its reduce-scatter stream), and the caching-allocator model keeps a pool per stream as
    the real allocator does. The default stream is ``stream_id`` 0."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        import torch

        self.device = torch.device("cuda", 0)
        self.priority = priority
        self.stream_id = _streams["made"]
        _streams["made"] += 1
        self.cuda_stream = self.stream_id
        self._entered: list[_Stream] = []

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _Stream:
        self._entered.append(_streams["current"])
        _streams["current"] = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _streams["current"] = self._entered.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return self.stream_id


_streams: dict[str, Any] = {"made": 0, "current": None}
"""Streams made so far (the next one's id) and the current stream: one for the process, not
per thread, as a CUDA device's current stream is (autograd's thread runs backward while the
forward's thread waits for it)."""


class _StreamContext:
    """``torch.cuda.stream(s)``: ``s`` is the current stream inside (None: unchanged)."""

    def __init__(self, stream: _Stream | None) -> None:
        self.stream = stream

    def __enter__(self) -> _Stream | None:
        if self.stream is not None:
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            self.stream.__exit__()


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


@dataclass(frozen=True)
class _Properties:
    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


def _install_stubs(torch: Any) -> None:
    cuda = torch.cuda
    stream = _Stream()  # the default stream, id 0
    _streams["current"] = stream

    def capability(device: Any = None) -> tuple[int, int]:
        return gpu().capability

    def properties(device: Any = None) -> _Properties:
        g = gpu()
        return _Properties(g.name, g.capability[0], g.capability[1], g.total_memory, g.multi_processor_count)

    stubs = {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: _streams["current"],
        "default_stream": lambda device=None: stream,
        "stream": _StreamContext,
        "get_device_capability": capability,
        "get_device_properties": properties,
        "get_device_name": lambda device=None: gpu().name,
        "is_bf16_supported": lambda including_emulation=True: gpu().capability >= (8, 0),
        # device guards (torch.cuda._DeviceGuard, in inductor's CUDA wrapper code): one device, 0
        "_exchange_device": lambda device: -1 if device < 0 else 0,
        "_maybe_exchange_device": lambda device: -1 if device < 0 else 0,
    }
    for name, fn in stubs.items():
        setattr(cuda, name, fn)
    # autocast asks this before turning CUDA autocast on (torch/amp/autocast_mode.py)
    cuda.amp.common.amp_definitely_not_available = lambda: False


def _fused_as_on_cuda(torch: Any) -> None:
    """Ops a CUDA build runs as one kernel but a CPU build decomposes on CUDA tensors: those
    with a CPU kernel and a CompositeImplicitAutograd fallback, which the dispatcher takes
    for a backend without its own kernel (torch 2.13: ``silu_backward``, ``mish_backward``,
    ``native_channel_shuffle``). Decomposed, ``silu_backward`` made five temporaries the size
    of its input inside one op (Llama's MLP backward on fake CUDA), which the CUDA kernel
    never allocates. A CUDA kernel registered for each (never run: fake tensors answer above
    it, from the op's meta kernel, as on the CPU) keeps them whole."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = [
        n
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and has(n, "CPU") and has(n, "CompositeImplicitAutograd") and not has(n, "CUDA")
    ]
    if not names:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name in names:
        lib.impl(name[len("aten::") :], _no_kernel, "CUDA")
    _state["kernels"] = lib  # registrations last as long as their Library object


def _no_kernel(*args: Any, **kwargs: Any) -> Any:
    raise FakeCudaError("fake CUDA runs no kernels: this op was called on a CUDA tensor outside fake tensors")


def _patch_sdpa(torch: Any) -> None:
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    if getattr(original, "__memfit_fake_cuda__", False):
        return

    def scaled_dot_product_attention(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        if query.device.type != "cuda" and not _state["host_as_cuda"]:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return cuda_sdpa(torch, original, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    scaled_dot_product_attention.__memfit_fake_cuda__ = True  # type: ignore[attr-defined]
    scaled_dot_product_attention.__doc__ = original.__doc__
    F.scaled_dot_product_attention = scaled_dot_product_attention


@contextmanager
def host_attention_as_cuda() -> Iterator[None]:
    """Inside, SDPA on host (CPU) tensors calls the kernel a CUDA build would pick, as on CUDA
    tensors. For a fake-CUDA step compiled on fake host tensors (``memfit.measure.compiled``):
    dynamo traces this function, so the graph AOTAutograd partitions holds CUDA's attention op
    (flash or memory-efficient: the output, logsumexp and RNG state saved, not the T x T
    weights), whose meta kernel gives its outputs on any device; and inductor calls it as an
    extern kernel, run on fake tensors only. The CPU's choice (math with dropout) would save
    the weights. Outside, a host tensor takes the CPU's kernel (a fake CPU step is the CPU's)."""
    before = _state["host_as_cuda"]
    _state["host_as_cuda"] = True
    try:
        yield
    finally:
        _state["host_as_cuda"] = before


def sdpa_kernel(query: Any, key: Any, value: Any, attn_mask: Any, enable_gqa: bool, capability: tuple[int, int]) -> str:
    """The kernel a CUDA build's SDPA picks (``sdp_utils.cpp``, default priority: flash,
    memory-efficient, math): "flash", "efficient" or "math"."""
    import torch

    if not (query.dim() == key.dim() == value.dim() == 4):
        return "math"
    half = (torch.float16, torch.bfloat16)
    d, dv = query.size(-1), value.size(-1)
    gqa = query.size(1) != key.size(1)
    if (
        attn_mask is None
        and query.dtype in half
        and capability >= (8, 0)
        and d == key.size(-1) == dv
        and d <= 256
        and (not gqa or enable_gqa)
    ):
        return "flash"
    if gqa:  # only flash takes grouped K/V; the math composite repeats them
        return "math"
    align = 4 if query.dtype == torch.float32 else 8
    if capability >= (5, 0) and d == key.size(-1) and d % align == 0 and dv % align == 0:
        return "efficient"
    return "math"


def cuda_sdpa(
    torch: Any,
    original: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Any:
    """SDPA on CUDA tensors as a CUDA build runs it: autocast's cast (the kernels are not on
    its lists; SDPA is), then the chosen kernel's aten op (what it allocates and saves). On
    host tensors (:func:`host_attention_as_cuda`) the math kernel is called by name: the host's
    SDPA would pick its own (flash without dropout)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)

        def cast(t: Any) -> Any:
            return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t

        query, key, value, attn_mask = cast(query), cast(key), cast(value), cast(attn_mask)
    kernel = sdpa_kernel(query, key, value, attn_mask, enable_gqa, gpu().capability)
    aten = torch.ops.aten
    if kernel == "math" and device != "cuda":
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]
    if kernel == "math":
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if kernel == "flash":
        d = query.size(-1)
        pad = (8 - d % 8) % 8  # the composite pads the head dim to a multiple of 8 for flash
        if pad:
            import torch.nn.functional as F

            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
            scale = scale if scale is not None else d**-0.5
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :d] if pad else out
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # convert_boolean_attn_mask: an additive bias
            bias = torch.where(bias, 0.0, float("-inf")).to(query.dtype)
        size = bias.size(-1)
        if size % 16:  # the kernel reads the bias in aligned rows: padded, then viewed back
            import torch.nn.functional as F

            bias = F.pad(bias, (0, 16 - size % 16))[..., :size]
        shape = (query.size(0), query.size(1), query.size(2), key.size(2))
        bias = bias.expand(shape)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]
