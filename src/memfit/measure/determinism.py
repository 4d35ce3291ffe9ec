"""Ops whose result differs from run to run of the same step, memfit or not.

memfit promises that training with its plans is bitwise equal to training without. That
promise can only hold for a step that is bitwise equal to *itself*: some kernels sum in an
order set by thread or GPU-block scheduling (atomic adds), so two runs of the very same
step differ in the last bits, and a plan's run "differs" from the unplanned one for that
reason alone. The recorder sees every aten op of a step; :func:`check` tells it which
calls are of that kind on the step's device and sizes, so the profile and the plan can say
so (:func:`note`) instead of leaving the user to suspect memfit.

:data:`TABLE` is the one list, each entry with why. The CPU entries were checked on this
project's host by running the op twice (tests/test_determinism.py does it again). The CUDA
entries are torch's documented list for :func:`torch.use_deterministic_algorithms`
(torch 2.13), as aten ops a dispatch mode sees. Left out on purpose: ops nondeterministic
only when indices repeat in a plain write (``index_copy``, ``index_put(accumulate=False)``,
``scatter`` with a tensor ``src``, ``put_(accumulate=False)``): which duplicate wins
depends on index values, which a fake step does not have, and a training step's backward
does not write that way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Finding", "Rule", "TABLE", "WATCHED_OPS", "backward_site", "check", "finding", "forward_site", "note", "GRAIN_SIZE"]

GRAIN_SIZE = 32768
"""``at::internal::GRAIN_SIZE`` (aten/src/ATen/Parallel.h): below it, a CPU kernel does not
split its work between threads."""


@dataclass(frozen=True)
class Rule:
    """One kind of nondeterministic op call."""

    ops: frozenset[str]
    """aten op names (overload packets) the rule covers."""
    device: str
    """``"cpu"`` or ``"cuda"``."""
    label: str
    """Short name for the note, e.g. ``"index_put_ (accumulate)"``."""
    why: str
    """Why the result varies (says what the rule's condition checks); ``{threads}`` is the
    step's thread count."""
    applies: Callable[[tuple, dict], bool] = lambda args, kwargs: True
    """Whether this call (its arguments: sizes, dtype, flags) takes the nondeterministic path."""
    raises: bool = False
    """torch has no deterministic kernel: with ``use_deterministic_algorithms(True)`` the op
    raises (with ``warn_only=True`` it warns and stays nondeterministic)."""


@dataclass(frozen=True)
class Finding:
    """A nondeterministic op the step ran: which, where, why."""

    op: str
    phase: str
    module: str | None
    why: str
    raises: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "phase": self.phase, "module": self.module, "why": self.why, "raises": self.raises}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(str(data["op"]), str(data["phase"]), data.get("module"), str(data["why"]), bool(data.get("raises")))


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _indexed_numel(self: torch.Tensor, indices: Iterable[Any], values: torch.Tensor) -> int:
    """Elements ``index_put`` iterates over: the indexed shape (the indices broadcast together,
    times the dimensions they leave alone), which the values are broadcast to. A boolean
    mask's count depends on its values: the values' own count stands in for it."""
    idx = list(indices)
    given = [i for i in idx if i is not None]
    if not given or any(i.dtype in (torch.bool, torch.uint8) for i in given):
        return values.numel()
    n = math.prod(torch.broadcast_shapes(*(i.shape for i in given)))
    for d in range(self.dim()):
        if d >= len(idx) or idx[d] is None:
            n *= self.shape[d]
    return int(n)


def _cpu_atomic_accumulate(args: tuple, kwargs: dict) -> bool:
    """aten/src/ATen/native/cpu/IndexKernel.cpp, index_put_kernel and put_kernel: with
    accumulate, a float32 tensor, at least GRAIN_SIZE elements and more than one thread,
    the threads add with ``cpu_atomic_add_float`` into shared elements, in scheduling order;
    other dtypes, smaller calls and one thread run serially."""
    self = args[0]
    if not _arg(args, kwargs, 3, "accumulate", False) or self.dtype != torch.float32 or torch.get_num_threads() < 2:
        return False
    second = args[1] if len(args) > 1 else kwargs.get("indices", kwargs.get("index"))
    values = args[2] if len(args) > 2 else kwargs.get("values", kwargs.get("source"))
    if isinstance(second, torch.Tensor):  # put_(index, source): one element per index
        n = second.numel()
    else:
        n = _indexed_numel(self, second, values)
    return n >= GRAIN_SIZE


def _float_dtype(args: tuple, kwargs: dict) -> bool:
    return args[0].dtype.is_floating_point or args[0].dtype.is_complex


def _reduce_is(*reductions: str) -> Callable[[tuple, dict], bool]:
    return lambda args, kwargs: _arg(args, kwargs, 3, "reduce") in reductions


_ATOMIC = "adds with atomics, in the order the GPU schedules its blocks"
_CUDA_RULES: list[tuple[tuple[str, ...], str, str, Callable[[tuple, dict], bool] | None, bool]] = [
    # (aten ops, label, why, condition, raises): torch.use_deterministic_algorithms' list
    (("convolution_backward",), "convolution backward", "cuDNN's backward algorithms may accumulate with atomics", None, False),
    (("index_add", "index_add_"), "index_add", _ATOMIC + " (index_select's backward too)", None, False),
    (("scatter_add", "scatter_add_"), "scatter_add", _ATOMIC + " (gather's backward too)", None, False),
    (("scatter_reduce", "scatter_reduce_"), "scatter_reduce (sum/mean)", _ATOMIC, _reduce_is("sum", "mean"), False),
    (("scatter_reduce", "scatter_reduce_"), "scatter_reduce (prod)", _ATOMIC, _reduce_is("prod"), True),
    (("put_", "put"), "put_ (accumulate)", _ATOMIC, lambda a, k: bool(_arg(a, k, 3, "accumulate", False)), True),
    (
        tuple(f"replication_pad{d}d_backward" for d in (1, 2, 3)),
        "replication_pad backward",
        _ATOMIC,
        None,
        False,
    ),
    (tuple(f"reflection_pad{d}d_backward" for d in (1, 2, 3)), "reflection_pad backward", _ATOMIC, None, True),
    (("max_pool3d_with_indices_backward",), "max_pool3d backward", _ATOMIC, None, False),
    (("avg_pool3d_backward",), "avg_pool3d backward", _ATOMIC, None, True),
    (
        ("_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward", "adaptive_avg_pool3d_backward"),
        "adaptive_avg_pool backward",
        _ATOMIC,
        None,
        True,
    ),
    (("adaptive_max_pool2d_backward",), "adaptive_max_pool2d backward", _ATOMIC, None, True),
    (
        ("fractional_max_pool2d_backward", "fractional_max_pool3d_backward"),
        "fractional_max_pool backward",
        _ATOMIC,
        None,
        True,
    ),
    (
        ("upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward")
        + ("upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward", "_upsample_bicubic2d_aa_backward"),
        "interpolate backward (linear modes)",
        _ATOMIC,
        None,
        True,
    ),
    (("nll_loss2d_forward",), "nll_loss (2d)", "sums the loss with atomics", None, True),
    (("_ctc_loss_backward",), "ctc_loss backward", _ATOMIC, None, True),
    (
        ("_embedding_bag_backward", "_embedding_bag_dense_backward"),
        "embedding_bag backward (mode='max')",
        _ATOMIC,
        lambda a, k: _arg(a, k, 7, "mode") == 2,  # EmbeddingBagMode: 0 sum, 1 mean, 2 max
        True,
    ),
    (("grid_sampler_2d_backward", "grid_sampler_3d_backward"), "grid_sample backward", _ATOMIC, None, True),
    (("histc",), "histc", _ATOMIC, None, True),
    (("bincount",), "bincount (weights)", _ATOMIC, lambda a, k: _arg(a, k, 1, "weights") is not None, True),
    (("median",), "median (with indices)", "picks among equal values by scheduling", lambda a, k: len(a) > 1, True),
    (("cumsum", "cumsum_"), "cumsum (floating point)", "sums in an order set by scheduling", _float_dtype, True),
]

TABLE: tuple[Rule, ...] = (
    Rule(
        frozenset({"index_put", "index_put_", "_index_put_impl_"}),
        "cpu",
        "index_put_ (accumulate)",
        "sums in thread order on {threads} threads: float32 and 32768+ elements take torch's atomic-add path",
        _cpu_atomic_accumulate,
    ),
    Rule(
        frozenset({"put_", "put"}),
        "cpu",
        "put_ (accumulate)",
        "sums in thread order on {threads} threads: float32 and 32768+ elements take torch's atomic-add path",
        _cpu_atomic_accumulate,
    ),
    *(
        Rule(frozenset(ops), "cuda", label, why, cond or (lambda args, kwargs: True), raises)
        for ops, label, why, cond, raises in _CUDA_RULES
    ),
)

_BY_OP: dict[tuple[str, str], list[Rule]] = {}
for _rule in TABLE:
    for _op in _rule.ops:
        _BY_OP.setdefault((_rule.device, _op), []).append(_rule)

_FORWARD_SITES = frozenset({"index", "take"})
"""The forward ops :func:`forward_site` names a site for."""

WATCHED_OPS = frozenset(op for _, op in _BY_OP) | _FORWARD_SITES
"""Every op :func:`check` or :func:`forward_site` can say something of, on any device: for
any other op both return None, so a caller of thousands of ops a step asks only of these."""


def check(op: str, device: str | None, args: tuple, kwargs: dict) -> Rule | None:
    """The rule an op call on ``device`` breaks (None: its result is reproducible), given the
    process's settings now: deterministic algorithms on make every call reproducible, or
    raise, except with ``warn_only``, where the ops without a deterministic kernel still run
    theirs."""
    rules = _BY_OP.get((device or "cpu", op))
    if not rules:
        return None
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
    for rule in rules:
        if deterministic and not (rule.raises and warn_only):
            continue
        try:
            if rule.applies(args, kwargs):
                return rule
        except (AttributeError, IndexError, TypeError, RuntimeError):  # an unexpected signature: not ours to judge
            continue
    return None


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def forward_site(op: str, args: tuple) -> tuple | None:
    """For a forward op whose backward is a call :data:`TABLE` may cover (``x[idx]``: index,
    whose backward is ``index_put(zeros_like(x), idx, grad, accumulate=True)``; ``take``:
    ``put_``), the key that backward call has (:func:`backward_site`). A backward op runs
    where the scope's module is only the deepest module whose backward is under way, often
    another one; this names the module whose forward made it."""
    try:
        if op == "index":
            return ("index_put", _shape(args[0]), tuple(_shape(i) for i in args[1]))
        if op == "take":
            return ("put", _shape(args[0]), _shape(args[1]))
    except (IndexError, TypeError):
        pass
    return None


def backward_site(op: str, args: tuple) -> tuple | None:
    """The :func:`forward_site` key of a backward call, or None."""
    try:
        if op in ("index_put", "index_put_", "_index_put_impl_"):
            return ("index_put", _shape(args[0]), tuple(_shape(i) for i in args[1]))
        if op in ("put", "put_"):
            return ("put", _shape(args[0]), _shape(args[1]))
    except (IndexError, TypeError):
        pass
    return None


def finding(rule: Rule, phase: str, module: str | None) -> Finding:
    """What the step's note says of a call that broke ``rule`` in ``module`` during ``phase``."""
    return Finding(rule.label, phase, module, rule.why.format(threads=torch.get_num_threads()), rule.raises)


def note(findings: Iterable[Finding]) -> str:
    """One sentence for the profile and the plan: which ops, where, why, and the remedy;
    empty for a reproducible step."""
    found = list(findings)
    if not found:
        return ""
    parts = []
    for f in found[:3]:
        where = f" in {f.module}" if f.module else ""
        parts.append(f"{f.op}{where} {f.phase} ({f.why})")
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    fix = (
        "torch.use_deterministic_algorithms(True) makes it so (a CUDA op without a deterministic kernel then raises), "
        "and memfit's plans then train bitwise alike"
    )
    return (
        f"this step is not bitwise reproducible even without memfit: {'; '.join(parts)}{more}; {fix}"
    )
