"""Kernel workspace: memory a kernel allocates for itself and frees before it returns.

A dispatch mode sees each aten op's inputs and outputs, not what runs inside the kernel:
oneDNN's reorders and scratch on CPU (a depthwise convolution reorders its input and
weight), a kernel's own ``at::empty`` (LayerNorm over a permuted tensor copies it to a
contiguous one first), cuDNN and cuBLAS workspaces on CUDA. That memory is real, and when
the op is at the step's peak, it is on top of the peak. The recorder measures it on real
tensors: each op of a kind not measured yet runs tagged inside a trace of every allocation
(:class:`~memfit.compat.torch_compat.AllocationTrace`), and its workspace is the highest
the allocations inside it rose above what it returned.

What was measured is kept per op kind (:func:`signature`: the op, its tensors' shapes,
strides, dtypes and device type, its other arguments) in :data:`TABLE`, so that every later
step of the same ops (the plan's verification runs, fake-tensor profiles of the same
shapes) takes it from there: a fake profile cannot run a kernel, and says how many of its
ops had no measurement (:attr:`~memfit.measure.ledger.Ledger.unmeasured_ops`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["signature", "workspace_bytes", "WorkspaceTable", "TABLE", "PROBED_DEVICES", "FLOOR_BYTES"]

PROBED_DEVICES = frozenset({"cpu", "cuda"})
"""Devices whose allocator reports to torch's profiler, so a kernel's own allocations can be
measured there (on real tensors)."""


FLOOR_BYTES = 4096
"""Less than a page is not counted. Such scratch is a kernel wrapping a Python scalar into a
0-dim tensor (12 bytes: nearly every op with a scalar argument), taken from the heap, where
autograd's per-node host-memory constants already hold it (they are fitted to RSS,
``benchmarks/graph_host_memory.py``); counted, it would add two ticks to most ops."""


def workspace_bytes(peak: int, net: int) -> int:
    """A kernel's workspace from its allocations: the most it held beyond what it returned
    (``peak - net``), zero under :data:`FLOOR_BYTES`."""
    extra = peak - net
    return extra if extra >= FLOOR_BYTES else 0


_PLAIN = frozenset({int, bool, str})
"""Argument types described as themselves (exactly these types: a subclass takes the long way)."""


def _describe(value: Any) -> Any:
    if value is None or type(value) in _PLAIN:  # the most common arguments, first
        return value
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        if value.layout is not torch.strided:
            strides: tuple = ()
        elif 1 in shape:
            # A size-1 dimension's stride is arbitrary (fake tensors and kernels pick differently)
            # and moves no kernel to another layout.
            strides = tuple([st if n != 1 else 0 for n, st in zip(shape, value.stride())])
        else:
            strides = tuple(value.stride())
        return ("T", shape, strides, value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple([_describe(v) for v in value])
    if isinstance(value, float):
        return float  # a learning rate or bias correction changes every step; scratch does not
    if isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    return type(value).__name__  # a generator or an opaque object: its kind, not its identity


_NAMES: dict[Any, str] = {}


def signature(func: Any, args: tuple, kwargs: dict) -> tuple:
    """What a kernel's workspace depends on: the op (with its overload), every tensor's
    shape, strides, dtype and device type, and the other arguments (a convolution's groups
    and padding; floats only as such). Tensor values are left out: workspaces do not depend on
    them. The recorder asks at nearly every op: the op's name is remembered per op."""
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    described = tuple(sorted((k, _describe(v)) for k, v in kwargs.items())) if kwargs else ()
    return (name, _describe(args), described)


class WorkspaceTable:
    """Measured workspace bytes by op :func:`signature` (the largest seen)."""

    def __init__(self) -> None:
        self._bytes: dict[tuple, int] = {}
        # measurements read from a saved profile, keyed by their signature's text (what a
        # JSON file can hold): the same op kinds, measured in the process that profiled them
        self._text: dict[str, int] = {}

    def get(self, sig: tuple) -> int | None:
        """Bytes measured for ``sig``, or None if no op of that kind has been measured."""
        known = self._bytes.get(sig)
        if known is None and self._text:
            known = self._text.get(repr(sig))
        return known

    def texts(self) -> dict[str, int]:
        """Every measurement, keyed by its signature's text: what a saved profile carries."""
        return {**self._text, **{repr(sig): n for sig, n in self._bytes.items()}}

    def learn(self, texts: dict[str, int]) -> None:
        """Take measurements a saved profile carries (:meth:`texts`), the largest kept."""
        for text, n in texts.items():
            self._text[text] = max(int(n), self._text.get(text, 0))

    def record(self, sig: tuple, nbytes: int) -> int:
        """Keep ``nbytes`` for ``sig`` (the largest of what was seen); returns what is kept.
        The largest, so that a plan is verified against the worst case of a kernel whose
        scratch varies between calls (oneDNN caches primitives after the first)."""
        kept = max(nbytes, self._bytes.get(sig, 0))
        self._bytes[sig] = kept
        return kept

    def __len__(self) -> int:
        return len(self._bytes)

    def clear(self) -> None:
        self._bytes.clear()
        self._text.clear()


PROBE_LIMIT_BYTES = 256 * 2**20
"""An op whose tensors, its inputs and the new ones it returns, hold more than this is not run
for real to measure its workspace (:func:`probe`): a fake step is often one too big for this
machine."""


def probe(func: Any, args: tuple, kwargs: dict, table: WorkspaceTable) -> int | None:
    """Measure the workspace of one CPU op call made on fake tensors by running it once on
    real zero-filled tensors of the same shapes, strides and dtypes (a workspace depends on
    those, not on values: :func:`signature`), outside every dispatch mode; the table learns
    it. None when it cannot be measured that way: tensors (inputs and outputs) over :data:`PROBE_LIMIT_BYTES`,
    or the op refusing zeros (an index out of range, say), or a profiler already running."""
    from torch.utils._pytree import tree_flatten, tree_map

    from memfit.compat import torch_compat

    leaves, _ = tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if any(t.device.type != "cpu" or t.layout is not torch.strided for t in tensors):
        return None
    held = sum(t.untyped_storage().nbytes() for t in tensors)
    if held > PROBE_LIMIT_BYTES or held + _output_bytes(func, args, kwargs) > PROBE_LIMIT_BYTES:
        return None
    sig = signature(func, args, kwargs)
    tag = "memfit.workspace.probe"
    try:
        with torch_compat.no_dispatch_modes():

            def real(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()

            rargs, rkwargs = tree_map(real, (args, kwargs))
            # a random op (dropout's bernoulli_) must not move the generator the step draws from
            with torch.random.fork_rng(devices=[]), torch.no_grad(), torch_compat.AllocationTrace() as trace:
                with torch.profiler.record_function(tag):
                    out = func(*rargs, **rkwargs)  # held past the region: its outputs are its net
            del out
            peak, net = trace.peaks(tag, "cpu").get(tag, (0, 0))
    except Exception:  # noqa: BLE001 - any refusal leaves the op unmeasured, as before
        return None
    return table.record(sig, workspace_bytes(peak, net))


def _output_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """The bytes of the new tensors ``func`` returns, from its meta kernel: the probe makes
    them for real too, and a factory (``zeros``) or an op whose output dwarfs its inputs
    (``embedding_dense_backward``'s whole-table gradient) would otherwise allocate gigabytes on
    a fake step's behalf. An output that is an input (in place, ``out=``) is not new. 0 where
    the op has no meta kernel: then only its inputs bound it, as before."""
    from torch.utils._pytree import tree_leaves, tree_map

    from memfit.compat import torch_compat

    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    margs, mkwargs = tree_map(meta, (args, kwargs))
    given = {id(t) for t in tree_leaves((margs, mkwargs)) if isinstance(t, torch.Tensor)}
    if "device" in mkwargs or not given:  # a factory makes its output where it is told: on meta
        mkwargs = {**mkwargs, "device": torch.device("meta")}
    try:
        with torch_compat.no_dispatch_modes(), torch.no_grad():
            out = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: the inputs' bound alone, as before
        return 0
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and id(t) not in given)


TABLE = WorkspaceTable()
"""The process's measurements: every real recorded step adds to it, every step reads it."""
