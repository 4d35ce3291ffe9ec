"""bitsandbytes 8-bit base layers (LLM.int8, ``BitsAndBytesConfig(load_in_8bit=True)``):
building them without weights, copying them to fake tensors, and what their matmul
allocates on CUDA.

A ``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``, transformers' default) holds its
weight as an ``Int8Params``: the int8 values (``n*m`` bytes, row-major, the parameter's own
storage, also its ``CB`` attribute) and ``SCB``, the absmax of each row (float32, ``n``
values), which is neither a parameter nor a buffer. The first forward moves both onto the
layer's ``MatmulLtState`` (``init_8bit_state``); :func:`state_tensors` finds the scale in
either place, so the ledger counts it with the weight.

- :func:`quantize_linears` replaces a model's ``nn.Linear`` layers (the output head left
  out, as transformers' ``replace_with_bnb_linear`` does for ``llm_int8_skip_modules=None``)
  by ``Linear8bitLt`` layers quantized by bitsandbytes' own ``int8_vectorwise_quant``, which
  runs on meta tensors: no weight is made.
- :func:`materialize` gives them untouched CPU memory after ``model.to_empty``.
- :func:`copy_states` makes a fake copy's weights and layer states: a fake tensor cannot be
  an ``Int8Params``, so the copy is a plain parameter carrying ``CB`` (itself) and ``SCB``
  attributes, which is all ``Linear8bitLt.forward`` reads.
- :data:`FAKE_CUDA_KERNELS`: the int8 ops as their CUDA kernels allocate (bitsandbytes'
  fake kernels make only outputs, and with an outlier threshold an output of data-dependent
  size, which a fake step cannot have), run by the recorder or, in a step no recorder runs
  (a warm-up), by :func:`as_cuda_allocates`, which :meth:`memfit.measure.sandbox.Sandbox.active`
  enters for a model with 8-bit layers.
- :func:`forward_leaves_state`: on CUDA a first forward leaves each layer's last outlier
  columns on its state, so such a step is warmed up by a whole step, not a light one.

On CUDA, training runs ``MatMul8bitLt``: the input cast to float16 and quantized per row
(int8 ``CA`` + float32 row scales; with ``threshold > 0``, ``|x| >= threshold`` as a float16
and a bool tensor of the input's size, to find the outlier columns), an int32 product, its
float16 dequantized form and the output in the input's dtype; the input itself is kept for
backward (on ``ctx``, not through saved-tensor hooks), and backward dequantizes the whole
weight to the input's dtype for the input's gradient. On CPU, training runs
``MatMul8bitFp``: the weight dequantized to the input's dtype and ``F.linear``, in torch ops
the recorder sees, forward and backward.

Outlier columns (LLM.int8's mixed-precision decomposition) depend on the data. memfit
assumes :func:`assumed_outliers` of them (0 unless :func:`assume_outliers` says
otherwise): each one adds, per 8-bit layer call, its input column (rows x 2 bytes in the
input's dtype, kept for backward), its weight column dequantized (float32, then the input's
dtype) and a second output of the layer's size while the outliers' product is added.

The private corners used (the kernels' names, schemas and sources) are checked by
``tests/test_int8.py``, which fails when bitsandbytes changes them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.compat import torch_compat
from memfit.compat.bnb4bit import unavailable

__all__ = [
    "unavailable",
    "quantize_linears",
    "materialize",
    "state_tensors",
    "copy_states",
    "assume_outliers",
    "assumed_outliers",
    "as_cuda_allocates",
    "quiet_cast_warning",
    "forward_leaves_state",
    "FAKE_CUDA_KERNELS",
    "THRESHOLD",
]

THRESHOLD = 6.0
"""transformers' ``llm_int8_threshold`` default: input values at or above it in magnitude make
their column an outlier column (computed in 16 bits)."""

_outliers = [0]


def assumed_outliers() -> int:
    """How many outlier columns each 8-bit matmul's input is assumed to have (default 0)."""
    return _outliers[0]


@contextmanager
def assume_outliers(n: int) -> Iterator[None]:
    """Fake CUDA steps inside assume ``n`` outlier columns per 8-bit matmul, at most its input's
    width (the widest input's width is the upper bound; LLM.int8's paper finds a handful of
    feature dimensions at 6.7B+)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the number of outlier columns is a non-negative integer, got {n!r}")
    saved, _outliers[0] = _outliers[0], n
    try:
        yield
    finally:
        _outliers[0] = saved


@contextmanager
def quiet_cast_warning() -> Iterator[None]:
    """Inside: bitsandbytes' warning that ``MatMul8bitLt`` casts its input to float16 is not
    logged. It is logged at every call whose input is not float16, which for a bfloat16 or
    float32 base is every 8-bit layer of every step memfit runs: hundreds of lines that say
    what :data:`FAKE_CUDA_KERNELS` already counts (the float16 copy)."""
    log = logging.getLogger("bitsandbytes.autograd._functions")
    saved = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(saved)


def _bnb() -> Any:
    import bitsandbytes as bnb

    return bnb


def quantize_linears(model: nn.Module, *, threshold: float = THRESHOLD, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` of ``model`` (on the meta device) but those named in ``skip``
    by a ``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``) whose weight bitsandbytes'
    ``int8_vectorwise_quant`` quantized on meta, as ``from_pretrained(...,
    quantization_config=BitsAndBytesConfig(load_in_8bit=True))`` leaves it. Returns how many
    were replaced; the model is marked ``is_loaded_in_8bit`` (what peft reads to wrap these
    layers with its own 8-bit LoRA layer)."""
    bnb = _bnb()
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name in skip:
                continue
            layer = bnb.nn.Linear8bitLt(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                has_fp16_weights=False,
                threshold=threshold,
                device="meta",
            )
            # Int8Params._quantize's own call: the weight in float16, quantized per row
            CB, SCB, _ = bnb.functional.int8_vectorwise_quant(child.weight.detach().to(torch.float16))
            layer.weight = bnb.nn.Int8Params(CB, requires_grad=False, has_fp16_weights=False, CB=CB, SCB=SCB)
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, name, layer)
            n += 1
    model.is_loaded_in_8bit = True
    return n


def _layers(model: nn.Module) -> Iterator[nn.Module]:
    """``model``'s ``Linear8bitLt`` layers; none, without a look, while bitsandbytes is not
    imported (no such layer can exist then): this is asked at every fake step of any model."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None or not hasattr(bnb, "nn"):
        return
    yield from (m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt))


def materialize(model: nn.Module) -> None:
    """After ``model.to_empty(device="cpu")`` (which turns an ``Int8Params`` into a plain
    parameter): every ``Linear8bitLt`` weight an ``Int8Params`` again, its ``CB`` itself and its
    row scales in CPU memory that is never touched."""
    bnb = _bnb()
    for layer in _layers(model):
        w = layer.weight
        scb = getattr(w, "SCB", None)
        if scb is None:
            continue
        data = w.data
        layer.weight = bnb.nn.Int8Params(
            data, requires_grad=False, has_fp16_weights=False, CB=data, SCB=torch.empty_like(scb, device="cpu")
        )


def state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """An 8-bit layer's row scales (float32): on its weight before its first forward, on its
    ``MatmulLtState`` after; none for any other module. (The int8 values are the weight.)"""
    w = getattr(module, "weight", None)
    state = getattr(module, "state", None)
    if w is None or state is None or type(state).__name__ != "MatmulLtState":
        return []
    scb = getattr(w, "SCB", None)
    if scb is None:
        scb = state.SCB
    return [scb] if isinstance(scb, torch.Tensor) else []


def forward_leaves_state(model: nn.Module) -> bool:
    """Whether a first forward of ``model`` leaves a tensor a later one keeps: an 8-bit layer
    off the CPU with an outlier threshold (``MatMul8bitLt`` keeps the last call's outlier
    columns on the layer's state, ``state.idx``, until the next call replaces it; on the CPU,
    training runs ``MatMul8bitFp``, which keeps nothing)."""
    return any(layer.weight.device.type != "cpu" and layer.state.threshold > 0.0 for layer in _layers(model))


def copy_states(
    model: nn.Module, copies: dict[Any, nn.Parameter], tensor: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]
) -> None:
    """Give each 8-bit layer's weight copy (``copies[weight]``) the ``CB`` (an alias of itself)
    and ``SCB`` (``tensor(SCB)``, never cast) attributes ``Linear8bitLt.forward`` reads, and put
    the layer state's tensors in ``memo`` (its ``CB`` the copy's alias, its ``SCB`` and last
    outlier columns copied), so the deepcopy of the model gives the copy's state those."""
    for layer in _layers(model):
        w, state = layer.weight, layer.state
        cp = copies.get(w)
        if cp is None:
            continue
        alias = cp.detach()
        for t in (getattr(w, "CB", None), state.CB):
            if t is not None:
                memo[id(t)] = alias
        for t in (getattr(w, "SCB", None), state.SCB, state.idx):
            if t is not None and id(t) not in memo:
                memo[id(t)] = tensor(t)
        cp.CB = alias if getattr(w, "CB", None) is not None else None
        cp.SCB = memo[id(w.SCB)] if getattr(w, "SCB", None) is not None else None
        cp.has_fp16_weights = getattr(w, "has_fp16_weights", False)


def cuda_int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``bitsandbytes::int8_vectorwise_quant`` on CUDA as it allocates (backends/cuda/ops.py):
    the row scales, the int8 rows, and with a threshold the outlier search (``A.abs() >=
    threshold``: a float16 and a bool tensor of ``A``'s size, ``.any()``), then the outlier
    columns: :func:`assumed_outliers` of them (``any(dim=0)`` and ``argwhere``'s int64 index),
    or none (``torch.empty(0)``), zeroed in the int8 rows."""
    rows = A.numel() // A.shape[-1]
    row_stats = torch.empty(rows, device=A.device, dtype=torch.float32)
    out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    outlier_cols = None
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        outliers.any()  # the kernel branches on it (a sync); its value is data, the count is assumed
        n = min(assumed_outliers(), A.shape[-1])
        if n:
            outliers.any(dim=0)
            outlier_cols = torch.empty((n, 1), device=A.device, dtype=torch.int64).view(-1)  # argwhere's shape
        else:
            outlier_cols = torch.empty(0, device=A.device, dtype=torch.int64)
        del outliers
    if rows > 1 and outlier_cols is not None:
        out_row[:, outlier_cols] = 0
    return out_row, row_stats, outlier_cols


def cuda_int8_mixed_scaled_mm(
    A: torch.Tensor,
    CA: torch.Tensor,
    CB: torch.Tensor,
    SCA: torch.Tensor,
    SCB: torch.Tensor,
    outlier_cols: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``bitsandbytes::int8_mixed_scaled_mm``: on CUDA its "default" kernel (Python,
    backends/default/ops.py), line for line: the outlier columns of ``A`` and of the weight
    (dequantized to float32, then ``A``'s dtype), the int8 product, the outliers' added by
    ``addmm`` (a second output)."""
    subB = None
    if outlier_cols is not None and outlier_cols.numel():
        subA = A[:, outlier_cols].contiguous()
        subB = torch.ops.bitsandbytes.int8_vectorwise_dequant.default(CB[:, outlier_cols].contiguous(), SCB).to(A.dtype).t()
    else:
        subA = torch.empty(0, device=A.device, dtype=A.dtype)
    output = torch.ops.bitsandbytes.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    if subB is not None:
        output = output.addmm(subA, subB)
    return output, subA


def cuda_int8_scaled_mm(
    A: torch.Tensor,
    B: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``bitsandbytes::int8_scaled_mm``: on CUDA its "default" kernel, the int32 product and
    its dequantized form (the int32 block alive until the dequantized one is made)."""
    out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(A, B)
    return torch.ops.bitsandbytes.int8_mm_dequant.default(out_i32, row_stats, col_stats, dtype=dtype or torch.float16, bias=bias)


def cuda_int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``bitsandbytes::int8_linear_matmul`` on CUDA: an int32 output (cuBLASLt's igemm); with an
    inner dimension not a multiple of 4, its float32 fallback (both operands in float32, their
    product, cast to int32, copied into the output)."""
    out = torch.empty((*A.shape[:-1], B.shape[0]), device=A.device, dtype=torch.int32)
    if A.shape[-1] % 4 != 0:
        out.copy_(torch.matmul(A.float(), B.float().t()).to(torch.int32))
    return out


def cuda_int8_mm_dequant(
    A: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bitsandbytes::int8_mm_dequant`` on CUDA: its kernel writes float16 only, so another
    output of the same size when ``dtype`` is not float16 (a bfloat16 base); a bias not in
    float16 added in place."""
    out = torch.empty_like(A, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def cuda_int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """``bitsandbytes::int8_vectorwise_dequant``: its "default" kernel on CUDA too, two float32
    products (an outlier column of the weight, dequantized)."""
    return A * stats.view(-1, 1) * 7.874015718698502e-3


FAKE_CUDA_KERNELS: dict[str, Callable[..., Any]] = {
    "bitsandbytes::int8_vectorwise_quant": cuda_int8_vectorwise_quant,
    "bitsandbytes::int8_vectorwise_dequant": cuda_int8_vectorwise_dequant,
    "bitsandbytes::int8_mixed_scaled_mm": cuda_int8_mixed_scaled_mm,
    "bitsandbytes::int8_scaled_mm": cuda_int8_scaled_mm,
    "bitsandbytes::int8_linear_matmul": cuda_int8_linear_matmul,
    "bitsandbytes::int8_mm_dequant": cuda_int8_mm_dequant,
}
"""bitsandbytes' int8 ops whose fake kernel allocates less than their CUDA kernel (or cannot
run on fake tensors: a data-dependent outlier count): run on fake CUDA as the CUDA kernel
allocates, with the recorder on."""


class _AsCuda(TorchDispatchMode):
    """:data:`FAKE_CUDA_KERNELS` for the int8 ops of a fake CUDA step that no recorder runs (a
    warm-up step): bitsandbytes' fake kernels cannot make the outlier columns' index."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kernel = FAKE_CUDA_KERNELS.get(func.overloadpacket._qualified_op_name)
        if kernel is not None:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if tensors and all(t.device.type == "cuda" and torch_compat.is_fake(t) for t in tensors):
                with _AsCuda():  # the ops inside (bitsandbytes' own among them) come back here
                    return kernel(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def as_cuda_allocates(model: nn.Module) -> Iterator[None]:
    """Inside: the int8 ops of ``model``'s fake CUDA steps run as their CUDA kernels allocate
    (:data:`FAKE_CUDA_KERNELS`), and bitsandbytes' cast warning is not logged at each call
    (:func:`quiet_cast_warning`); a no-op for a model without 8-bit layers, which then pays
    for no extra dispatch mode."""
    if next(_layers(model), None) is None:
        yield
        return
    with quiet_cast_warning(), _AsCuda():
        yield
