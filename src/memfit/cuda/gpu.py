"""GPUs to plan for, and the device memory no tensor shows: plain data, no torch.

:data:`GPUS` is a small table of common NVIDIA GPUs (what ``--gpu NAME`` accepts): the
name torch reports, the total memory, the compute capability. The compute capability
decides what cuBLAS's workspace takes (:func:`cublas_workspace_bytes`), which kernel
attention takes, and whether bfloat16 is supported, so fake CUDA answers for the GPU
chosen here.

:func:`device_fit` answers "does this step fit on that GPU, with how much to spare?":
the capacity, minus what lives outside the caching allocator (the CUDA context: a stated
estimate, :data:`CUDA_CONTEXT`), minus the step's predicted peak: on CUDA the caching
allocator's reserved peak (what runs out: :attr:`DeviceFit.reserved_peak_bytes`, from
memfit's model of the allocator, :mod:`memfit.cuda.allocator`), else the ledger's
peak (tensor storages rounded to 512 B blocks, cuBLAS workspaces included).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.cuda import nccl
from memfit.errors import MemfitError

__all__ = [
    "GpuSpec",
    "GPUS",
    "GpuError",
    "find_gpu",
    "Datasheet",
    "DATASHEETS",
    "datasheet",
    "cublas_workspace_bytes",
    "ATTENTION_BACKWARD_OPS",
    "attention_backward_bytes",
    "Estimate",
    "CUDA_CONTEXT",
    "nccl_estimate",
    "DeviceFit",
    "device_fit",
]

MiB = 1024**2


class GpuError(MemfitError):
    """An unknown GPU name, or a GPU asked for where none can be simulated."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as torch describes it (``torch.cuda.get_device_properties``)."""

    key: str
    """What ``--gpu`` takes (``"A100-80GB"``)."""
    name: str
    """The name torch reports."""
    total_memory: int
    """Bytes: the total ``nvidia-smi`` and torch's ``total_memory`` report (a little under
    the marketed size on most models: the driver keeps some)."""
    capability: tuple[int, int]
    multi_processor_count: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "capability": list(self.capability)}


# Total memory: the "MiB" total nvidia-smi prints for each model (recent drivers), as found
# in public nvidia-smi outputs; torch's total_memory is the same figure in bytes. Compute
# capabilities and SM counts: NVIDIA's CUDA GPUs table and the models' datasheets.
_TABLE = [
    ("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, (9, 0), 132),
    ("A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 108),
    ("A100-40GB", "NVIDIA A100-SXM4-40GB", 40960, (8, 0), 108),
    ("L40S", "NVIDIA L40S", 46068, (8, 9), 142),
    ("L4", "NVIDIA L4", 23034, (8, 9), 58),
    ("A10G", "NVIDIA A10G", 23028, (8, 6), 80),
    ("RTX-4090", "NVIDIA GeForce RTX 4090", 24564, (8, 9), 128),
    ("RTX-3090", "NVIDIA GeForce RTX 3090", 24576, (8, 6), 82),
    ("V100-16GB", "Tesla V100-SXM2-16GB", 16160, (7, 0), 80),
    ("T4", "Tesla T4", 15360, (7, 5), 40),
]
GPUS: dict[str, GpuSpec] = {key: GpuSpec(key, name, mib * MiB, cc, sms) for key, name, mib, cc, sms in _TABLE}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_gpu(name: str) -> GpuSpec:
    """The GPU ``name`` means (case, spaces and dashes ignored: ``a100-80gb``, ``RTX 4090``)."""
    wanted = _norm(name)
    for spec in GPUS.values():
        if wanted in (_norm(spec.key), _norm(spec.name)):
            return spec
    raise GpuError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --capacity BYTES for another one)")


# --- speed ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Datasheet:
    """A GPU's peak rates as NVIDIA states them (what the cost model scales its rates by)."""

    half_flops_per_s: float
    """Dense FP16/BF16 tensor-core FLOP/s, FP32 accumulation (torch's), without sparsity."""
    fp32_flops_per_s: float
    """FP32 FLOP/s without tensor cores (torch's float32 matmuls: TF32 is off by default)."""
    bytes_per_s: float
    """Memory bandwidth."""


_T, _G = 1e12, 1e9
# NVIDIA's datasheets (sparsity figures halved), the GeForce cards' from the Ampere GA102 and
# Ada architecture whitepapers (FP16 tensor with FP32 accumulate). The A10G is AWS's part:
# NVIDIA publishes no datasheet for it, so it has none here (its steps get an H100's rates).
DATASHEETS: dict[str, Datasheet] = {
    "H100-80GB": Datasheet(989 * _T, 67 * _T, 3350 * _G),  # H100 SXM5
    "A100-80GB": Datasheet(312 * _T, 19.5 * _T, 2039 * _G),  # A100 SXM4 80GB
    "A100-40GB": Datasheet(312 * _T, 19.5 * _T, 1555 * _G),
    "L40S": Datasheet(362 * _T, 91.6 * _T, 864 * _G),
    "L4": Datasheet(121 * _T, 30.3 * _T, 300 * _G),
    "RTX-4090": Datasheet(165.2 * _T, 82.6 * _T, 1008 * _G),
    "RTX-3090": Datasheet(71 * _T, 35.6 * _T, 936 * _G),
    "V100-16GB": Datasheet(125 * _T, 15.7 * _T, 900 * _G),  # V100 SXM2
    "T4": Datasheet(65 * _T, 8.1 * _T, 320 * _G),
}


def _table_key(spec: GpuSpec) -> str | None:
    """``spec``'s key in :data:`GPUS` (matched by key, or by the name torch reports for a real
    GPU), or None for a GPU the table lacks."""
    names = (_norm(spec.key), _norm(spec.name))
    return next((key for key, s in GPUS.items() if _norm(s.name) in names or _norm(key) in names), None)


def datasheet(spec: GpuSpec) -> Datasheet | None:
    """``spec``'s datasheet figures (by key, or by the name torch reports for a real GPU), or None."""
    known = _table_key(spec)
    return DATASHEETS.get(known) if known is not None else None


# --- cuBLAS ---------------------------------------------------------------------------------

_CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" = 8,519,680 B
_CUBLAS_LARGE = 4096 * 8 * 1024  # 32 MiB
_CUBLAS_LARGE_MAJORS = (9, 10, 11, 12)


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace: torch allocates one through the caching allocator per
    (cuBLAS handle, stream), at a thread's first cuBLAS call, and keeps it.

    torch's ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (``parseChosenWorkspaceSize``,
    ``getChosenWorkspaceSize``, ``setWorkspaceForHandle``): ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs) when set, else ``:4096:2:16:8`` = 8,519,680 B, or 32 MiB on
    Hopper and Blackwell (compute capability major 9, 10, 11, 12; torch 2.6-2.7 gave 32 MiB
    to exactly sm90 only). cuBLASLt shares that workspace (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
    defaults to on outside fbcode), so it adds none.
    """
    if config is None:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    default = _CUBLAS_LARGE if capability[0] in _CUBLAS_LARGE_MAJORS else _CUBLAS_DEFAULT
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return default


# --- attention backward ---------------------------------------------------------------------

ATTENTION_BACKWARD_OPS = frozenset(
    {"_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward"}
)
"""SDPA's CUDA backward kernels, which allocate temporaries no op returns (below)."""


def _up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _block(nbytes: int) -> int:
    """One allocation as the caching allocator counts it (512 B blocks)."""
    return _up(nbytes, 512)


def attention_backward_bytes(
    op: str,
    *,
    batch: int,
    heads: int,
    heads_kv: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    itemsize: int,
    grad_out_copy: bool,
) -> int:
    """An estimate of what one SDPA backward kernel on CUDA allocates for itself (through the
    caching allocator, freed before it returns), from torch's sources:

    - both kernels copy the output's gradient when it is not contiguous in the kernel's
      (batch, seq, heads, dim) layout (``grad_out.contiguous()``, ``attention_backward.cu``);
    - flash (``flash_api.cpp``, ``mha_bwd``): ``softmax_d``, float32 (batch, heads,
      seq_q rounded to 128), and the float32 dQ accumulator ``dq_accum`` (batch, seq_q
      rounded to 128, heads, head_dim rounded to 32, or 64 past 128; the non-deterministic
      path); with fewer key/value heads (GQA), dK and dV expanded to every head;
    - memory-efficient (cutlass ``_efficient_attention_backward``): ``delta``, float32
      (batch, heads, seq_q), and the ``workspace`` of ``kernel_backward.h``: a float32 dQ
      accumulator per (batch, head), taken here as seq_q and head_dim each rounded to 64
      (one key split; the kernel's split-keys heuristic can take more), plus float32 dK and
      dV accumulators when head_dim is over 128 (the kernels then keep them in memory, not
      in registers).

    Each allocation is counted in the caching allocator's 512 B blocks. An estimate: kernel choices inside a kernel family (block sizes, split keys,
    deterministic mode) move these by their rounding, and cuDNN attention is not modelled.
    """
    copy = _block(batch * seq_q * heads * head_dim * itemsize) if grad_out_copy else 0
    if op == "_scaled_dot_product_flash_attention_backward":
        dim_rounded = _up(head_dim, 32 if head_dim <= 128 else 64)
        softmax_d = _block(batch * heads * _up(seq_q, 128) * 4)
        dq_accum = _block(batch * _up(seq_q, 128) * heads * dim_rounded * 4)
        expanded = 2 * _block(batch * seq_k * heads * head_dim * itemsize) if heads_kv != heads else 0
        return copy + softmax_d + dq_accum + expanded
    if op == "_scaled_dot_product_efficient_attention_backward":
        delta = _block(batch * heads * seq_q * 4)
        accumulators = batch * heads * _up(seq_q, 64) * _up(head_dim, 64)
        if head_dim > 128:
            accumulators += 2 * batch * heads * _up(seq_k, 64) * _up(head_dim, 64)
        return copy + delta + _block(accumulators * 4)  # one workspace tensor
    raise ValueError(f"not an attention backward op: {op}")


# --- outside the allocator ------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Device memory that is not in the ledger (outside torch's caching allocator): a stated
    estimate, never a measurement, with where it comes from."""

    name: str
    bytes: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CUDA_CONTEXT = Estimate(
    "cuda_context",
    512 * MiB,
    "estimate, not measured: the CUDA context a PyTorch process creates on the device (driver state, the kernels of "
    "torch, cuBLAS and cuDNN loaded lazily) shows in nvidia-smi as about 0.3-1 GiB depending on GPU, driver and "
    "CUDA_MODULE_LOADING; memfit takes 512 MiB",
)


def nccl_estimate(
    communicators: Sequence[nccl.Communicator] = (),
    gpu: GpuSpec | None = None,
    settings: nccl.NcclSettings | None = None,
) -> Estimate:
    """NCCL's device memory outside the caching allocator, per rank: none in a single-process
    step (no process group, NCCL not loaded); else the sum over the rank's ``communicators`` of
    what NCCL's source allocates for each (:mod:`memfit.cuda.nccl`) on ``gpu``'s usual board
    (None: H100-80GB), under ``settings`` (NCCL's variables; None: its defaults). A stated
    estimate: the channel count is the topology's, taken from public logs."""
    comms = [c for c in communicators if c.ranks > 1]
    if not comms:
        return Estimate("nccl", 0, "a single-process step initialises no NCCL communicator")
    s = settings or nccl.NcclSettings()
    key = _gpu_key(gpu)
    topo = nccl.topology(key)
    each = [_summed(nccl.communicator_parts(c, topo, s)) for c in comms]
    what = "; ".join(
        f"{c.ranks} ranks{_role(c)}: "
        + " + ".join(f"{k} {b // MiB}" for k, b in parts.items())
        + f" = {sum(parts.values()) // MiB} MiB"
        for c, parts in zip(comms, each)
    )
    given = f"; NCCL variables set: {', '.join(s.given)}" if s.given else ""
    return Estimate(
        "nccl",
        sum(sum(parts.values()) for parts in each),
        f"estimate from NCCL's source, not measured: {what}; on {key or 'H100-80GB'}: {topo.source}; "
        f"{_mib(s.ll_buffsize + s.ll128_buffsize + s.buffsize)} MiB of buffers a connection (NCCL_BUFFSIZE and LL, LL128); "
        f"NCCL 2.22+, every algorithm the group may use counted{given}",
    )


def _summed(parts: list[nccl.Part]) -> dict[str, int]:
    """The parts by kind (ring, tree, NVLS, send/recv, bookkeeping)."""
    out: dict[str, int] = {}
    for p in parts:
        kind = p.name.split()[0].rstrip(":")
        out[kind] = out.get(kind, 0) + p.bytes
    return out


def _gpu_key(gpu: GpuSpec | None) -> str | None:
    """The ``--gpu`` key of a spec (a real GPU's spec is keyed by the name torch reports)."""
    if gpu is None:
        return None
    return _table_key(gpu) or gpu.key


def _role(c: nccl.Communicator) -> str:
    if not c.collectives:
        return " (send/recv)"
    return " (all-reduce)" if c.allreduce else ""


def _mib(n: int) -> str:
    return f"{n / MiB:.4g}"


# --- the answer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceFit:
    """Whether the step fits on a GPU: capacity minus what lives outside the allocator minus
    the predicted peak."""

    capacity_bytes: int
    peak_bytes: int
    """The ledger's peak (tensor storages in 512 B blocks, kernel and cuBLAS workspaces)."""
    outside: tuple[Estimate, ...]
    gpu: GpuSpec | None = None
    """The GPU ``capacity_bytes`` is from; None for a capacity given as bytes."""
    allocated_peak_bytes: int | None = None
    """The caching allocator's ``max_memory_allocated`` (on CUDA; None elsewhere)."""
    reserved_peak_bytes: int | None = None
    """The caching allocator's ``max_memory_reserved`` (its segments: what runs out), on
    CUDA; where known, the answer is against it instead of ``peak_bytes``."""
    notes: tuple[str, ...] = field(default=())

    @property
    def outside_bytes(self) -> int:
        return sum(e.bytes for e in self.outside)

    @property
    def basis(self) -> str:
        return "reserved_peak_bytes" if self.reserved_peak_bytes is not None else "peak_bytes"

    @property
    def needed_bytes(self) -> int:
        """What the step needs on the device: the peak it is judged by, plus what is outside."""
        peak = self.reserved_peak_bytes if self.reserved_peak_bytes is not None else self.peak_bytes
        return peak + self.outside_bytes

    @property
    def headroom_bytes(self) -> int:
        """Capacity left at the peak (negative: short by that much)."""
        return self.capacity_bytes - self.needed_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_dict() if self.gpu is not None else None,
            "capacity_bytes": self.capacity_bytes,
            "peak_bytes": self.peak_bytes,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "basis": self.basis,
            "outside_allocator": [e.to_dict() for e in self.outside],
            "needed_bytes": self.needed_bytes,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceFit:
        g = data.get("gpu")
        gpu = GpuSpec(g["key"], g["name"], g["total_memory"], tuple(g["capability"]), g["multi_processor_count"]) if g else None
        return cls(
            capacity_bytes=data["capacity_bytes"],
            peak_bytes=data["peak_bytes"],
            outside=tuple(Estimate(**e) for e in data.get("outside_allocator", ())),
            gpu=gpu,  # type: ignore[arg-type]
            allocated_peak_bytes=data.get("allocated_peak_bytes"),
            reserved_peak_bytes=data.get("reserved_peak_bytes"),
            notes=tuple(data.get("notes", ())),
        )


def device_fit(
    peak_bytes: int,
    *,
    capacity_bytes: int | None = None,
    gpu: GpuSpec | None = None,
    cuda: bool = True,
    allocated_peak_bytes: int | None = None,
    reserved_peak_bytes: int | None = None,
) -> DeviceFit:
    """The answer for a step whose predicted peak is ``peak_bytes``, against ``capacity_bytes``
    (default: the GPU's total memory). On CUDA the context is taken off the capacity (and
    NCCL's buffers, none for one process); on another device nothing is."""
    if capacity_bytes is None:
        if gpu is None:
            raise GpuError("device_fit needs a capacity or a GPU")
        capacity_bytes = gpu.total_memory
    outside = (CUDA_CONTEXT, nccl_estimate()) if cuda else ()
    notes = []
    if cuda and reserved_peak_bytes is None:
        notes.append(
            "judged by the ledger's peak (allocated bytes): no reserved peak was given, and the caching allocator "
            "reserves more than it allocates (fragmentation, whole segments)"
        )
    return DeviceFit(capacity_bytes, peak_bytes, outside, gpu, allocated_peak_bytes, reserved_peak_bytes, tuple(notes))
