"""A step's input tensors that share storage stay one block of memory wherever memfit copies
them (to fake tensors, to fake CUDA, to another device) and wherever it counts their bytes.

The README's own pattern passes one tensor twice, ``{"input_ids": ids, "labels": ids}``;
``labels = ids[:, 1:]`` shares it too. The real step holds that storage once. Copying each
tensor on its own (``t.to("cuda")`` per leaf) would hold it twice, and the profile would
count bytes the step does not have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["map_shared", "input_bytes"]


def _storage_key(t: torch.Tensor) -> tuple | None:
    """What identifies the real storage ``t`` views (None: no real storage to share: fake,
    meta, sparse, or empty)."""
    if t.layout is not torch.strided or t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
        ptr = s.data_ptr()
    except (RuntimeError, NotImplementedError):  # fake tensors and tensor subclasses
        return None
    return (ptr, str(t.device)) if ptr and s.nbytes() else None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The elements of its storage ``t`` reaches: ``[start, end)``."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    end = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.storage_offset(), end


def _groups(leaves: list[Any]) -> dict[tuple, list[torch.Tensor]]:
    """Tensors (distinct objects, in order) by the storage they share, for storages that
    more than one leaf views, each viewing it with the same dtype."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in leaves:
        if isinstance(t, torch.Tensor) and not t.requires_grad:
            key = _storage_key(t)
            if key is not None:
                by_key.setdefault(key, []).append(t)
    return {
        k: list({id(t): t for t in ts}.values())
        for k, ts in by_key.items()
        if len(ts) > 1 and len({t.dtype for t in ts}) == 1
    }


def map_shared(convert: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``convert(t)`` (a copy to another device,
    a fake copy), keeping what shares storage shared: one tensor met twice becomes one copy
    met twice; views of one storage become views of one copy of the part of it they reach
    (no more than that: two slices of a dataset tensor do not copy the dataset). Tensors that
    require grad, or share storage in different dtypes, are copied one by one."""
    leaves, spec = tree_flatten(tree)
    groups = _groups(leaves)
    made: dict[int, Any] = {}
    for ts in groups.values():
        if len(ts) == 1:
            continue  # one tensor met more than once: copied once below
        lo = min(_span(t)[0] for t in ts)
        hi = max(_span(t)[1] for t in ts)
        dtype = ts[0].dtype
        # the reached part of the storage as one 1-D tensor: no copy, a view of it
        part = torch.empty(0, dtype=dtype, device=ts[0].device).set_(ts[0].untyped_storage(), lo, (hi - lo,), (1,))
        base = convert(part)
        if base is part:  # nothing to copy (already on that device): the tensors themselves
            continue
        for t in ts:
            made[id(t)] = base.as_strided(t.shape, t.stride(), base.storage_offset() + t.storage_offset() - lo)
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if id(t) not in made:
                made[id(t)] = convert(t)
            out.append(made[id(t)])
        else:
            out.append(t)
    return tree_unflatten(out, spec)


def input_bytes(tree: Any, *, copied_to: torch.device | None = None) -> int:
    """Bytes the step's input tensors hold in a ledger, each storage once: the whole storages
    they view (a step on their own device, or on fake copies there, which keep the storages'
    sizes), or with ``copied_to`` the copies :func:`map_shared` makes on that device (fake
    CUDA: dense copies, one per storage that several tensors share, of the part they reach),
    in the device's allocation blocks (CUDA's 512 bytes)."""
    from memfit.measure.recorder import storage_bytes

    leaves, _ = tree_flatten(tree)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.layout is torch.strided]
    if copied_to is None:
        storages = {}
        for t in tensors:
            s = t.untyped_storage()
            storages[_storage_key(t) or id(s)] = storage_bytes(s.nbytes(), t.device)
        return sum(storages.values())
    groups = _groups(tensors)
    counted: set[int] = set()
    total = 0
    for ts in groups.values():
        lo, hi = min(_span(t)[0] for t in ts), max(_span(t)[1] for t in ts)
        total += storage_bytes((hi - lo) * ts[0].element_size(), copied_to)
        counted.update(id(t) for t in ts)
    for t in {id(t): t for t in tensors if id(t) not in counted}.values():
        total += storage_bytes(t.numel() * t.element_size(), copied_to)
    return total
