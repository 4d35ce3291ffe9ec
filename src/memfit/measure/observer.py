"""What watching a step changes in it, and how the recorder puts that back.

torch takes a slower, out-of-place path in some places when a tensor might be a subclass
(``at::isTensorSubclassLike`` in ``ATen/TensorSubclassLikeUtils.h``): true for every tensor
while any Python dispatch mode is active (the recorder is one), and for fake tensors always
(their Python dispatch key). Where the path a user's step takes writes into a tensor in
place, the step the recorder sees allocates a second tensor of the same size beside it:
``torch.gather(x, -1, i).sum().backward()`` runs ``zeros(x.shape).scatter_add_(...)`` but
dispatches ``scatter_add`` under a mode, which holds two blocks of ``x``'s size at once.

The recorder records what it sees. For the calls in :data:`TWINS`, whose unwatched twin
writes into the call's first argument, it then hands the output the block of that argument
once it is sure the argument was a temporary (it dies before any other op runs, so nothing
but the formula held it): the output takes over the block, the way the unwatched step's
in-place op returns the very tensor it wrote. The values computed are untouched; only the
ledger changes. :data:`KNOWN` lists the branches whose paths differ in other ways, left
as they are (each entry says why and by how much).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch

from memfit.compat import torch_compat

__all__ = ["Twin", "Known", "TWINS", "TWIN_OPS", "KNOWN", "ENGINE", "Observer"]

ENGINE = "engine"
"""Node name of :data:`TWINS` entries that are the autograd engine's, not a formula's."""


@dataclass(frozen=True)
class Twin:
    """An out-of-place op a watched step dispatches whose unwatched twin writes its first
    argument in place."""

    op: str
    """The aten op (overload packet) the watched step dispatches."""
    nodes: frozenset[str]
    """Backward nodes whose formula has the branch, without the overload number
    (``GatherBackward`` for ``GatherBackward0``); :data:`ENGINE` for the engine's own."""
    real: str
    """What the unwatched step runs instead."""
    where: str
    """The torch function with the branch."""
    after: frozenset[str] = frozenset()
    """When not empty: the ops whose output the first argument must be (the unwatched
    path's chain of in-place ops), for nodes that also run the op out of place."""


@dataclass(frozen=True)
class Known:
    """A branch whose two paths differ in more than an output's block: not corrected."""

    where: str
    ops: tuple[str, ...]
    """aten ops the watched path dispatches more often than the unwatched one."""
    why: str


_VALUE_SELECTING = frozenset(
    {"MaxBackward", "MinBackward", "KthvalueBackward", "TopkBackward", "SortBackward"}
    | {"ModeBackward", "MedianBackward", "NanmedianBackward"}
)

_BCE_LOGITS = frozenset({"BinaryCrossEntropyWithLogitsBackward"})

TWINS: tuple[Twin, ...] = (
    # The autograd engine sums the gradients a tensor receives from several uses (a residual
    # stream, a weight used twice) in InputBuffer::accumulate (torch/csrc/autograd/input_buffer.cpp):
    # in place into the first when it holds the only reference and neither is subclass-like,
    # else old + new. The largest of all: one activation-sized block at every branch point.
    Twin("add", frozenset({ENGINE}), "add_ into the first gradient", "InputBuffer::accumulate"),
    # ``zeros(self.shape)`` filled in place (aten/src/ATen/native/TensorAdvancedIndexing.cpp,
    # ReduceOps.cpp): the loss that gathers target logits holds a second logits-sized block.
    Twin(
        "scatter_add",
        frozenset({"GatherBackward", "CummaxBackward", "CumminBackward"}),
        "scatter_add_",
        "gather_backward, cummaxmin_backward",
    ),
    Twin("scatter", _VALUE_SELECTING, "scatter_", "value_selecting_reduction_backward"),
    Twin("index_add", frozenset({"IndexSelectBackward"}), "index_add_", "index_select_backward"),
    Twin("index_put", frozenset({"IndexBackward"}), "_index_put_impl_", "index_backward"),
    Twin("put", frozenset({"TakeBackward"}), "put_", "take_backward"),
    Twin("masked_scatter", frozenset({"MaskedSelectBackward"}), "masked_scatter_", "masked_select_backward"),
    Twin("index_fill", frozenset({"TraceBackward"}), "index_fill_", "trace_backward"),
    # sigmoid(x) - y, then * grad (* weight): in place on the sigmoid unless subclass-like or
    # GradMode (torch/csrc/autograd/FunctionsManual.cpp, binary_cross_entropy_with_logits_backward
    # and _target_backward). The target's -x * grad is out of place on both paths: hence ``after``.
    Twin("sub", _BCE_LOGITS, "sub_", "binary_cross_entropy_with_logits_backward", frozenset({"sigmoid", "mul"})),
    Twin("mul", _BCE_LOGITS, "mul_", "binary_cross_entropy_with_logits_backward", frozenset({"sub", "mul"})),
    # the zero-safe 1 / (x^2 + y^2): masked_fill_ on a temporary (atan2_backward)
    Twin("masked_fill", frozenset({"Atan2Backward"}), "masked_fill_", "atan2_backward"),
)

KNOWN: tuple[Known, ...] = (
    Known(
        "engine: InputBuffer::accumulate of two gradients one node makes for one tensor (x * x, aminmax)",
        ("add",),
        "the engine's sum runs while the node that made both is current, where a formula's own "
        "a + b runs too: not told apart, so not corrected. One gradient-sized block over-counted there",
    ),
    Known(
        "evenly_distribute_backward (max(), min(), median(), nanmedian() of a whole tensor)",
        ("isnan", "logical_and", "logical_or_", "mul"),
        "watched: masks built with isnan/logical_and, then mask * (grad / count); unwatched: "
        "new_zeros(...).masked_fill_(mask, ...). Over-counts up to two bool masks of the input "
        "(a quarter of a float32 input each) during that one node",
    ),
    Known(
        "prod_backward",
        ("view", "ones", "slice", "cat", "cumprod", "flip", "mul"),
        "watched: the zero-safe path (two cumprods of the input and their concatenations); "
        "unwatched: grad * (result / input) when the input has no zero. Over-counts a few "
        "input-sized temporaries during that node",
    ),
    Known(
        "cumprod_backward",
        ("cumprod", "mul", "eq", "zeros", "cumsum", "bitwise_not", "masked_fill", "where", "max")
        + ("zeros_like", "scatter_", "logical_and_", "bitwise_and_", "ne", "sub", "relu_", "gather", "masked_fill_", "sum"),
        "watched: the composite path for inputs with zeros; unwatched: the fast one when the input "
        "has none. Several input-sized temporaries during that node",
    ),
    Known(
        "masked_fill_backward (a tensor value that requires grad)",
        ("where",),
        "watched: where(mask, grad, 0).sum(); unwatched: grad.masked_select(mask).sum(): one "
        "temporary of the grad's size against one of the selected elements",
    ),
    Known(
        "clamp_backward, clamp_backward_min_max (tensor min and max)",
        ("logical_and", "logical_or"),
        "one bool mask of the input's size more, out of place",
    ),
    Known(
        "binary_cross_entropy backward",
        ("mul",),
        "grad_input * grad out of place on a temporary that C++ keeps to the end of its expression",
    ),
    Known(
        "linalg backward formulas (eigh, householder_product, ormqr, matrix_exp, det)",
        ("diagonal_scatter", "cat", "zeros_like", "view"),
        "square matrices of the operand's size; no training step of a model in memfit's scope uses them",
    ),
    Known(
        "scaled_dot_product_attention, math path (aten/src/ATen/native/transformers/attention.cpp)",
        ("add",),
        "forward: scores.add(mask) instead of add_; only where no fused CPU kernel applies. "
        "Over-counts one scores-sized block in that forward op",
    ),
    Known(
        "linear_cross_entropy (chunked), ctc_loss: composite forwards",
        ("_linear_cross_entropy_batch_chunked", "_linear_cross_entropy_batch_chunked_no_reduction"),
        "a mode sees the composite op where the unwatched step runs its kernel",
    ),
)

_OVERLOAD = re.compile(r"\d+$")


_KINDS: dict[str, str] = {}


def _node_kind(name: str) -> str:
    """``GatherBackward0`` -> ``GatherBackward``; C++ namespaces dropped. Remembered per name
    (asked at every backward op; a step has a few dozen kinds of node)."""
    kind = _KINDS.get(name)
    if kind is None:
        kind = _KINDS[name] = _OVERLOAD.sub("", name.rsplit("::", 1)[-1])
    return kind


_BY_OP: dict[str, list[Twin]] = {}
for _twin in TWINS:
    _BY_OP.setdefault(_twin.op, []).append(_twin)

TWIN_OPS = frozenset(_BY_OP)
"""The ops of :data:`TWINS`: :meth:`Observer.after` does nothing for any other, so the
recorder calls it only for these."""


@dataclass
class _Pending:
    argument: int  # block the unwatched twin writes into
    output: int  # block the watched call allocated
    storage: int  # id of the output's storage object
    call: int  # the call's number: the argument must die before the next one


class Observer:
    """The recorder's bookkeeping for :data:`TWINS`: which node each block was born in, and
    the call whose output may take over its first argument's block."""

    def __init__(self) -> None:
        self._calls = 0
        self._node: int | None = None
        self._epoch = 0  # one more for each node the engine runs
        # block index -> (epoch, op, made by a node's formula) it was born in (backward only)
        self._born: dict[int, tuple[int, str, bool]] = {}
        self._pending: _Pending | None = None
        self._kind: str | None = None  # the running node's kind (``GatherBackward``)
        self._op = ""  # the pending call's op
        self.merged: set[int] = set()
        """Blocks whose allocation the unwatched step never makes: the ledger drops them."""
        self.corrected: Counter[str] = Counter()
        """Calls corrected, by op: what tests compare with an unwatched step's ops."""

    def on_call(self, backward: bool) -> None:
        """An op is dispatched (before its outputs are recorded)."""
        self._calls += 1
        self._pending = None
        node = torch_compat.current_autograd_node() if backward else None
        key = None if node is None else node[0]
        if key != self._node:
            self._node = key
            self._epoch += 1
        self._kind = None if node is None else _node_kind(node[1])

    def born(self, idx: int, op: str) -> None:
        self._born[idx] = (self._epoch, op, self._kind is not None)

    def after(self, func, args: tuple, kwargs: dict, out: object, block_of, live_key) -> None:
        """Remember the call if it is one of :data:`TWINS` whose first argument is a block
        that may be the temporary the unwatched twin writes into."""
        op = func.overloadpacket.__name__
        twins = _BY_OP.get(op)
        if twins is None or self._kind is None or not isinstance(out, torch.Tensor) or not args:
            return
        arg = args[0]
        if not isinstance(arg, torch.Tensor) or not _same_block_shape(arg, out):
            return
        idx, out_idx = block_of(arg), block_of(out)
        born, made = self._born.get(idx, (None, None, False)), self._born.get(out_idx, (None, None, False))
        if idx is None or out_idx is None or idx == out_idx or born[0] is None or made[0] != self._epoch:
            return
        for twin in twins:
            if ENGINE in twin.nodes:
                # The engine sums into a gradient an earlier node's formula made: a gradient
                # given from outside (autograd.grad's grad_outputs) has a Python object too,
                # which InputBuffer::accumulate counts as a second reference.
                ok = born[0] < self._epoch and born[2] and self._accumulates(func, args, kwargs)
            else:
                # A formula writes into a temporary it made itself.
                ok = self._kind in twin.nodes and born[0] == self._epoch and (not twin.after or born[1] in twin.after)
            if ok:
                self._pending = _Pending(idx, out_idx, live_key(out), self._calls)
                self._op = op
                return

    @staticmethod
    def _accumulates(func, args: tuple, kwargs: dict) -> bool:
        """``old + new`` as InputBuffer::accumulate calls it: add.Tensor, no alpha, no broadcast."""
        other = args[1] if len(args) > 1 else None
        return (
            func is torch.ops.aten.add.Tensor
            and not kwargs
            and len(args) == 2
            and isinstance(other, torch.Tensor)
            and other.shape == args[0].shape
        )

    def absorbs(self, idx: int, relink) -> bool:
        """Block ``idx`` is dying. If it is the pending call's argument, dying before any
        other op ran, the call's output takes over its block (``relink(storage, idx)``) and
        the output's own block is dropped: True, the block lives on."""
        p = self._pending
        if p is None or p.argument != idx or p.call != self._calls:
            return False
        self._pending = None
        relink(p.storage, idx)
        self._born[idx] = (self._born[idx][0], self._op, self._born[idx][2])  # the block now holds the call's output
        self.merged.add(p.output)
        self.corrected[self._op] += 1
        return True


def _same_block_shape(arg: torch.Tensor, out: torch.Tensor) -> bool:
    """The unwatched twin returns ``arg`` itself: ``out`` must be what ``arg`` is, a tensor
    of the same shape and dtype whose elements fill a storage of the same size (dense, no
    overlap, not a view: a view's base holds the storage too, and InputBuffer::accumulate
    sums in place only into a storage it holds alone)."""
    if arg.shape != out.shape or arg.dtype != out.dtype or arg.storage_offset() or arg._is_view():
        return False
    try:
        nbytes = arg.untyped_storage().nbytes()
        return nbytes == arg.numel() * arg.element_size() == out.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
