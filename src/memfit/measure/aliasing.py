"""Which inputs a real kernel returns as its outputs, for op calls on fake tensors.

A real op may hand back one of its inputs, storage and all, where a fake one makes a new
storage: FakeTensorMode runs an op that has no kernel of its own (a ``CompositeImplicitAutograd``
op such as ``dropout``) through torch's Python decomposition when it has one, and
``dropout(x, p, train=False)``'s (``torch/_decomp/decompositions.py``) returns ``x.clone()``
where the C++ kernel a real tensor runs returns ``x``. A dispatch mode sees such ops only where
autograd does not decompose them first: under ``torch.inference_mode()``, memfit's eval step.
A fake ledger that took the clone for an allocation held a copy of every dropout's input
(issue 23: 128 MiB after each attention softmax of BERT-large at batch 8 x 512).

Rather than a list of ops, each such call asks the real kernel: the C++ composite kernel runs
once more on the same fake arguments (its inner ops are fake: no memory, no values), and an
output that is one of the arguments' storages there is that argument's memory in the ledger.
Ops with kernels of their own run their meta kernel on fake tensors, whose outputs are new
as the real kernels' are unless the schema says they alias (views, in-place ops), which fake
tensors honour: ``benchmarks/alias_audit.py`` compares real and fake op by op.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.measure import _torch_compat

__all__ = ["returned_inputs"]


def _storage_id(t: torch.Tensor) -> int | None:
    if t.layout is not torch.strided:
        return None
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # storage-less subclasses
        return None


def _flat(out: Any) -> list[torch.Tensor | None]:
    """An op's outputs in schema order, None for what is not a tensor (kept for alignment)."""
    items = out if isinstance(out, (list, tuple)) else (out,)
    flat: list[torch.Tensor | None] = []
    for v in items:
        if isinstance(v, (list, tuple)):
            flat.extend(x if isinstance(x, torch.Tensor) else None for x in v)
        else:
            flat.append(v if isinstance(v, torch.Tensor) else None)
    return flat


def returned_inputs(func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor], out: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(output, input)`` pairs of a fake op call ``out = func(*args, **kwargs)``: outputs with
    a storage of their own where the real kernel returns that input's. Empty for the usual op
    (no composite kernel, or every output already an input's, or the kernel refusing fake
    arguments, as a data-dependent one does)."""
    by_storage = {k: t for t in inputs if (k := _storage_id(t)) is not None}
    outputs = _flat(out)
    fresh = [t for t in outputs if t is not None and _storage_id(t) not in by_storage]
    if not fresh or func.is_view:
        return []
    kernel = _torch_compat.composite_kernel(func)
    if kernel is None:
        return []
    try:
        real = _flat(kernel(*args, **kwargs))
    except Exception:  # noqa: BLE001 - a kernel that cannot run on fake tensors tells nothing
        return []
    if len(real) != len(outputs):
        return []
    pairs = []
    for fake_t, real_t in zip(outputs, real):
        if fake_t is None or real_t is None or _storage_id(fake_t) in by_storage:
            continue
        source = by_storage.get(_storage_id(real_t))
        if source is not None:
            pairs.append((fake_t, source))
    return pairs
