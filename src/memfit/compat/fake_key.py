"""FakeTensorMode's dispatch-cache key, built faster, element for element the same.

torch caches a fake op's output under a key made of the op and its arguments, each fake
tensor flattened into its metadata (``extract_tensor_metadata`` then
``TensorMetadata._flatten_into``: a dataclass built, its fields walked, sizes and strides
recursed into one element at a time). On a rank of Llama-3-8B that key is a third of the
fake dispatch: about 17,000 keys a step, each tensor's metadata walked in Python. Here a
plain fake tensor (strided, dense, static sizes: every tensor of a memfit step) is
flattened inline into the same elements in the same order; anything else (a symbolic size,
sparse, a tensor of another mode, a SymInt argument) goes through torch's own code. The key
decides only which cached output is reused, and only an equal key may reuse one, so the
same key is the same dispatch: ``tests/test_fake_key.py`` checks every key of parallelized
steps against torch's.

Installed only when torch's :class:`TensorMetadata` has the fields this flattening writes,
in that order, and its ``_prep_args_for_hash`` has the signature this one copies (else
torch's own key is used, slower and the same: torch 2.6's).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fast_prep_args_for_hash", "fast_key_applies"]

_FIELDS = (
    "dtype",
    "shape",
    "stride",
    "device",
    "layout",
    "memory_format",
    "storage_offset",
    "storage_bytes",
    "requires_grad",
    "is_quantized",
    "is_conj",
    "is_neg",
    "is_inference",
    "is_sparse",
    "is_coalesced",
    "dense_dim",
    "sparse_dim",
)


def fast_key_applies() -> bool:
    """Whether torch's key flattens a tensor's metadata as :func:`fast_prep_args_for_hash` does."""
    try:
        import dataclasses

        from torch._prims_common import suggest_memory_format  # noqa: F401
        from torch._subclasses.fake_tensor import FakeTensorMode, TensorMetadata, extract_tensor_metadata  # noqa: F401
    except ImportError:
        return False
    names = tuple(f.name for f in dataclasses.fields(TensorMetadata))
    prep = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    return names == _FIELDS and callable(prep) and _prep_takes_id_hashed_objects(prep)


def _prep_takes_id_hashed_objects(prep: Any) -> bool:
    """Whether torch's ``_prep_args_for_hash`` is the one this flattening copies: it takes
    ``id_hashed_objects`` and writes a list's or tuple's type and length first. torch 2.6's
    takes three arguments and writes neither, so its keys would differ: it keeps its own."""
    import inspect

    try:
        params = list(inspect.signature(prep).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["self", "result", "args", "state", "id_hashed_objects"]


def _flat_tensor(result: list, t: Any, suggest: Any) -> bool:
    """Append ``t``'s metadata as torch's ``TensorMetadata._flatten_into`` does for a strided,
    dense tensor of static sizes; False (nothing appended) for any other tensor."""
    if t._has_symbolic_sizes_strides or t.layout is not torch.strided:  # sparse layouts are not strided
        return False
    shape = t.shape
    stride = t.stride()
    fmt = suggest(t)
    append = result.append
    append(t.dtype)
    append(torch.Size)  # a Size is a tuple: its type, its length, then (type, value) per element
    append(f"length_{len(shape)}")
    for v in shape:
        append(int)
        append(v)
    append(tuple)
    append(f"length_{len(stride)}")
    for v in stride:
        append(int)
        append(v)
    append(t.device)
    append(torch.strided)
    append(fmt if t.is_contiguous(memory_format=fmt) else None)
    append(t.storage_offset())
    append(t.untyped_storage().nbytes())
    append(t.requires_grad)
    append(t.is_quantized)
    append(t.is_conj())
    append(t.is_neg())
    append(t.is_inference())
    append(False)  # is_sparse (COO): a strided tensor is not
    append(None)  # is_coalesced, dense_dim, sparse_dim: a dense tensor's
    append(None)
    append(None)
    return True


def fast_prep_args_for_hash(torch_prep: Any) -> Any:
    """A ``_prep_args_for_hash`` for a FakeTensorMode subclass: torch's (``torch_prep``) for
    every argument but a plain fake tensor of this mode, which is flattened inline."""
    from torch._prims_common import suggest_memory_format
    from torch._subclasses.fake_tensor import FakeTensor

    def prep(mode: Any, result: list, args: Any, state: Any, id_hashed_objects: list) -> None:
        kind = type(args)
        if kind is not tuple and kind is not list:
            return torch_prep(mode, result, args, state, id_hashed_objects)
        append = result.append
        append(kind)
        append(f"length_{len(args)}")
        for arg in args:
            akind = type(arg)
            if akind is int or akind is float or akind is bool or arg is None or akind is torch.dtype or akind is torch.device:
                append(akind)  # torch's last branch: the type (1 and 1.0 hash alike), then the value
                append(arg)
            elif (
                akind is FakeTensor
                and arg.fake_mode is mode
                and arg.constant is None
                and _flat_tensor(result, arg, suggest_memory_format)
            ):
                pass
            else:
                # torch's own code for this one argument: it appends what its loop body would
                # (a one-element tuple would add a tuple's type and length; strip them)
                mark = len(result)
                torch_prep(mode, result, (arg,), state, id_hashed_objects)
                del result[mark : mark + 2]
        return None

    return prep

