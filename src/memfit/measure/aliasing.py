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

from memfit.compat import torch_compat

__all__ = ["returned_inputs", "may_return_inputs", "FRESH_INPUT_OPS"]

FRESH_INPUT_OPS = frozenset({"aten::lift_fresh"})
"""Ops whose input is a tensor the step has just made where no mode sees it: ``torch.tensor()``
builds its data, then hands it to lift_fresh, which returns it (a fake mode makes a fake copy
instead). Its storage is an allocation of the step, born there, on real tensors as on fake
ones: not something alive before the step, the rule for other outputs sharing an input memfit
has not seen."""


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


_SELF_ALIAS: dict[Any, bool] = {}


def _aliases_self(func: Any) -> bool:
    """Whether the op's schema says its outputs are views of its first argument (``Tensor(a)
    self -> Tensor(a)``, as ``alias``, ``detach``, ``view``) without writing to it."""
    known = _SELF_ALIAS.get(func)
    if known is None:
        schema = func._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        known = (
            first is not None
            and not first.is_write
            and any(r.alias_info is not None and r.alias_info.before_set == first.before_set for r in schema.returns)
        )
        _SELF_ALIAS[func] = known
    return known


_MAY_RETURN: dict[Any, bool] = {}


def may_return_inputs(func: Any) -> bool:
    """False for an op :func:`returned_inputs` answers empty for, whatever its arguments: one
    with no composite kernel that is neither a view nor an alias of its first argument (most
    ops). The recorder asks this first at every op of a fake step; remembered per op."""
    known = _MAY_RETURN.get(func)
    if known is None:
        known = _MAY_RETURN[func] = torch_compat.composite_kernel(func) is not None or func.is_view or _aliases_self(func)
    return known


def returned_inputs(
    func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor], out: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(output, input)`` pairs of a fake op call ``out = func(*args, **kwargs)``: outputs with
    a storage of their own where the real kernel returns that input's (and views of a real
    tensor the fake mode converted). Empty for the usual op (every output already an input's,
    no composite kernel, or the kernel refusing fake arguments, as a data-dependent one does)."""
    by_storage = {k: t for t in inputs if (k := _storage_id(t)) is not None}
    outputs = _flat(out)
    fresh = [t for t in outputs if t is not None and _storage_id(t) not in by_storage]
    if not fresh:
        return []
    kernel = torch_compat.composite_kernel(func)
    if kernel is None:
        # A view of a real tensor the step keeps outside the model (a constant; the
        # recorder's own detach of a saved one): the fake mode makes it a view of the fake
        # tensor it converts that one to, whose storage is another than the real one's.
        # (Ops that only may alias, ``to`` or ``reshape``, are composite: asked above.)
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or torch_compat.is_fake(source) or func.overloadpacket._qualified_op_name in FRESH_INPUT_OPS:
            return []
        if not (func.is_view or _aliases_self(func)):
            return []
        return [(t, source) for t in fresh]
    if not torch_compat.python_decomposition(func) and all(torch_compat.is_fake(t) for t in inputs):
        return []  # the fake mode ran this very kernel on these very tensors: nothing to ask
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
