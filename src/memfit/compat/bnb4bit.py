"""bitsandbytes 4-bit base layers (QLoRA): building them without weights, copying them to fake
tensors, and what their matmul allocates on CUDA.

A ``bnb.nn.Linear4bit`` holds its weight as a ``Params4bit``: the packed 4-bit values (two
per uint8, ``n*m/2`` bytes) plus a ``QuantState`` that is *not* a parameter or a buffer: the
absmax of every block of 64 values (float32; with double quantization uint8, with a float32
absmax per 256 of them, a float32 offset and the 256-entry float32 code, a copy per weight),
and the 16-entry float32 4-bit code. :func:`state_tensors` lists them, so the ledger counts them with the
weight.

- :func:`quantize_linears` replaces a model's ``nn.Linear`` layers (the output head left
  out, as transformers' ``replace_with_bnb_linear`` does) by ``Linear4bit`` layers quantized
  by bitsandbytes' own ``F.quantize_4bit``, which runs on meta tensors (bitsandbytes 0.50
  registers fake/meta kernels for its ops): no weight is made, the shapes and dtypes are
  bitsandbytes' own.
- :func:`materialize` gives them untouched CPU memory after ``model.to_empty`` (which
  turns a ``Params4bit`` into a plain parameter and leaves its state on meta).
- :func:`copy_param` makes a fake copy's weight: a fake tensor cannot be wrapped in a
  ``Params4bit``, so the copy is a plain parameter carrying a copied ``quant_state``
  attribute, which is all ``Linear4bit.forward`` reads.
- :func:`cuda_gemm_4bit` is ``bitsandbytes::gemm_4bit``'s CUDA kernel as it allocates
  (its fake kernel makes only the output): past 1536 rows (a training step's batch x
  sequence) the kernel dequantizes the whole weight to the compute dtype and calls
  ``F.linear``; below, bitsandbytes' fused kernel allocates nothing more.

The private corners used (``F.name2qmap``, the gemm dispatch threshold, the CPU kernel being
Python) are checked by ``tests/test_qlora.py``, which fails when bitsandbytes changes them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "unavailable",
    "quantize_linears",
    "materialize",
    "state_tensors",
    "values",
    "copy_param",
    "cuda_gemm_4bit",
    "PYTHON_CPU_KERNELS",
    "FAKE_CUDA_KERNELS",
    "QUANT_TYPES",
    "CUSTOM_MAX_ROWS",
]

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZE = 64
"""transformers' ``bnb_4bit_blocksize`` default, and bitsandbytes'."""
CUSTOM_MAX_ROWS = 1536
"""bitsandbytes 0.50's ``_gemm_4bit_custom_max_m`` on CUDA: past this many rows of input the
4-bit matmul is dequantize + ``F.linear`` (backends/cuda/ops.py)."""

PYTHON_CPU_KERNELS = frozenset({"bitsandbytes::gemm_4bit"})
"""bitsandbytes' 4-bit matmul on CPU is its "default" kernel, Python made of torch ops: the
absmax dequantized (double quantization), the whole weight dequantized to the compute
dtype, then ``F.linear``. The recorder runs it with itself on, so those temporaries are in
the ledger."""


def unavailable() -> str | None:
    """Why a 4-bit base cannot be built here, or None."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    return None


def _bnb() -> Any:
    import bitsandbytes as bnb
    import bitsandbytes.functional  # noqa: F401 - bnb.functional

    return bnb


def quantize_linears(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = ("lm_head",),
) -> int:
    """Replace every ``nn.Linear`` of ``model`` (on the meta device) but those named in ``skip``
    by a ``bnb.nn.Linear4bit`` quantized by ``F.quantize_4bit`` on meta, as
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))``
    leaves it. Returns how many were replaced. The model is marked ``is_loaded_in_4bit``
    (what peft reads to wrap these layers with its own 4-bit LoRA layer)."""
    bnb = _bnb()
    F = bnb.functional
    # quantize_blockwise caches its code by name alone; one made on meta must not stay there
    saved = F.name2qmap.pop("dynamic", None)
    n = 0
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear or name in skip:
                    continue
                setattr(parent, name, _linear4bit(bnb, child, quant_type, double_quant, compute_dtype))
                n += 1
    finally:
        F.name2qmap.pop("dynamic", None)
        if saved is not None:
            F.name2qmap["dynamic"] = saved
    model.is_loaded_in_4bit = True
    return n


def _linear4bit(bnb: Any, child: nn.Linear, quant_type: str, double_quant: bool, compute_dtype: torch.dtype) -> nn.Module:
    layer = bnb.nn.Linear4bit(
        child.in_features,
        child.out_features,
        bias=child.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=double_quant,
        quant_type=quant_type,
        device="meta",
    )
    weight = child.weight.detach()
    packed, state = bnb.functional.quantize_4bit(
        weight, blocksize=BLOCKSIZE, compress_statistics=double_quant, quant_type=quant_type
    )
    _set_weight(bnb, layer, packed, state)
    if child.bias is not None:
        layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
    return layer


def state_tensors(param: Any) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's quantization state (none for any other parameter):
    absmax, the 4-bit code, and with double quantization the offset and the nested state's
    absmax and code."""
    state = getattr(param, "quant_state", None)
    out: list[torch.Tensor] = []
    while state is not None:
        out.extend(t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor))
        state = state.state2
    return out


def values(param: Any) -> int:
    """How many values ``param`` holds: a 4-bit weight's packed uint8 tensor holds two per
    element (its quantization state knows the weight's shape)."""
    state = getattr(param, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None else param.numel()


def _copy_state(state: Any, tensor: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]) -> Any:
    """``state`` with each tensor ``tensor(t)``; tensors shared between states (the nested
    code, cached by bitsandbytes per device) stay shared through ``memo``."""
    if state is None:
        return None
    if id(state) in memo:
        return memo[id(state)]
    new = type(state).__new__(type(state))
    new.__dict__.update(state.__dict__)
    for key in ("absmax", "code", "offset"):
        t = getattr(state, key)
        if isinstance(t, torch.Tensor):
            if id(t) not in memo:
                memo[id(t)] = tensor(t)
            setattr(new, key, memo[id(t)])
    new.state2 = _copy_state(state.state2, tensor, memo)
    memo[id(state)] = new
    return new


def copy_param(p: nn.Parameter, cp: nn.Parameter, tensor: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]) -> None:
    """Give ``cp`` (the copy of the 4-bit weight ``p``) a copy of ``p``'s quantization state,
    its tensors ``tensor(t)`` (never cast: absmax and codes stay float32); ``memo`` maps the
    state to its copy, so the module's own ``quant_state`` attribute follows in a deepcopy."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        cp.quant_state = _copy_state(state, tensor, memo)


def materialize(model: nn.Module) -> None:
    """After ``model.to_empty(device="cpu")``: every ``Linear4bit`` weight a ``Params4bit``
    again, its quantization state in CPU memory that is never touched, as the packed weight's."""
    bnb = _bnb()
    memo: dict[int, Any] = {}
    for layer in model.modules():
        if not isinstance(layer, bnb.nn.Linear4bit) or layer.quant_state is None:
            continue
        state = _copy_state(layer.quant_state, lambda t: torch.empty_like(t, device="cpu"), memo)
        _set_weight(bnb, layer, layer.weight.data, state)


def _set_weight(bnb: Any, layer: nn.Module, packed: torch.Tensor, state: Any) -> None:
    """``layer``'s weight a quantized, frozen ``Params4bit`` of ``packed`` with ``state``, as
    bitsandbytes leaves a loaded layer (the state on the weight and on the layer)."""
    layer.weight = bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=state.blocksize,
        compress_statistics=state.nested,
        quant_type=state.quant_type,
        module=layer,
        bnb_quantized=True,
    )
    layer.quant_state = state


def cuda_gemm_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    shapeB: Any,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bitsandbytes::gemm_4bit`` on CUDA as it allocates, in torch ops a recorder sees (their
    outputs are the buffers the CUDA kernel allocates). Past
    :data:`CUSTOM_MAX_ROWS` rows, or with an inner dimension not a multiple of the block
    size, bitsandbytes' ``_dequant_linear_fallback``: the absmax dequantized to float32 (and
    the offset added: a second float32 tensor), the weight dequantized to the compute dtype,
    ``F.linear``. Below, its fused kernel (the choice among kernels there depends on the GPU:
    all of them allocate only the output and A made contiguous)."""
    K = A.shape[-1]
    rows = A.numel() // K
    if rows <= CUSTOM_MAX_ROWS and K % blocksize == 0:
        A = A.contiguous()
        return A.new_empty((*A.shape[:-1], shapeB[0]))
    # The default forms of the dequantize ops allocate their output as the CUDA fallback's
    # torch.empty + ``.out`` call do (bitsandbytes 0.50's fake ``dequantize_4bit.out`` compares
    # out.shape with the list the dispatcher hands it, and so always refuses).
    if absmax_8bit is not None:
        absmax_dq = torch.ops.bitsandbytes.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256, torch.float32)
        absmax = absmax_dq + absmax_offset
    B_dq = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, blocksize, quant_type, list(shapeB), A.dtype)
    return torch.nn.functional.linear(A, B_dq, bias)


FAKE_CUDA_KERNELS: dict[str, Callable[..., Any]] = {"bitsandbytes::gemm_4bit": cuda_gemm_4bit}
"""bitsandbytes ops whose fake kernel allocates less than their CUDA kernel: run on fake
CUDA as the CUDA kernel allocates, with the recorder on."""
