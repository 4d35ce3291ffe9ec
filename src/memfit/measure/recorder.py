"""Mechanism that records a step: a dispatch mode and a saved-tensor hook.

:class:`Recorder` sees every aten op of the step (forward, backward and optimizer, on
real or fake tensors). A storage an op returns that no input shares is an allocation: it
becomes a block, and a ``weakref.finalize`` on its storage object turns the storage's
death into a free. torch keeps one Python object per live storage, so the finalizer fires
exactly when the last tensor or view of it goes, whoever held it (autograd's saved
variables included). A saved-tensor hook marks which blocks autograd saves for backward.

On a CPU step, autograd's graph takes from the same memory as the tensors: each forward
op that records a node, and each tensor saved for backward, adds a block of
:attr:`~memfit.measure.ledger.Category.GRAPH` (an estimate, see
:data:`~memfit.measure.ledger.GRAPH_NODE_BYTES`). Saved records go when backward unpacks
them; nodes when the graph is freed after backward (:meth:`Recorder.free_graph`), except
those of a model output the loop holds (:attr:`memfit.StepOptions.holds_output`), which live
until the next forward returns (:meth:`Recorder.register_held`).

Memory a kernel allocates for itself (:mod:`memfit.measure.workspace`) becomes a block of
:attr:`~memfit.measure.ledger.Category.WORKSPACE` alive across the op: measured on real
tensors the first time an op of that kind runs, taken from what was measured after.

Only the step's own device is in the ledger: on an accelerator, storages in host memory
(activations offloaded there, the optimizer's step counters) do not take from the device's
budget; their peak is kept apart (:attr:`Ledger.host_peak_bytes`).

Times are not taken here: the recorder's bookkeeping would inflate them. The timed step
runs without it (see :class:`memfit.measure.scope.Clock`).
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.compat import bnb4bit, bnb8bit, optim8bit, torch_compat
from memfit.cuda import gpu
from memfit.errors import WorkloadError
from memfit.measure import _distributed, aliasing, determinism, workspace
from memfit.measure.ledger import (
    CHECKPOINT_BYTES_PER_NODE,
    GRAPH_NODE_BYTES,
    GRAPH_SAVED_BYTES,
    START_TICK,
    Block,
    Category,
    Ledger,
    OpCall,
    Phase,
    Span,
    Tick,
    ancestors,
)
from memfit.measure.observer import TWIN_OPS, Observer
from memfit.measure.scope import Scope, compiles

__all__ = ["Recorder", "storage_bytes", "output_tensors"]

# Ops whose CPU kernel is Python made of torch ops (bitsandbytes' optimizer updates: the
# 8-bit one dequantises both moments to float32 temporaries). Dispatched as one op, their
# kernel's own allocations would be invisible; these run under the recorder instead.
_RECORD_INSIDE_ON_CPU = optim8bit.PYTHON_CPU_KERNELS | bnb4bit.PYTHON_CPU_KERNELS
# Ops whose fake kernel makes only their outputs while their CUDA kernel allocates more
# (bitsandbytes' 4-bit matmul dequantizes the whole weight; its int8 matmul makes an int32
# product and finds outlier columns, a data-dependent count): on fake CUDA they run as the
# CUDA kernel allocates, in torch ops, with the recorder on.
_AS_CUDA_ALLOCATES = {**bnb4bit.FAKE_CUDA_KERNELS, **bnb8bit.FAKE_CUDA_KERNELS}
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

# The CUDA caching allocator hands out blocks in multiples of 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize); max_memory_allocated counts those.
_CUDA_BLOCK = 512

_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda ignore_tracing: None)

# Ops the recorder or fake tensors run for themselves (the detached alias the saved-tensor
# hook returns, fake tensors' device queries): not the step's, and they record no node.
BOOKKEEPING_OPS = frozenset({"detach", "device"})


_METADATA_ONLY: dict[Any, bool] = {}


def _metadata_only(func: Any) -> bool:
    """Whether ``func`` only asks a tensor about itself: prim.device, and the sym_size
    family. A tensor subclass (a fake tensor) answers those through the dispatcher when
    C++ code asks, between ops and not always in the same places; a real tensor answers
    without dispatching. Recorded, they would rename the op the next frees are put under
    and add calls (and, where one lands between frees, ticks) a real step never has.
    Remembered per op (asked at every call: a fake step asks thousands of times)."""
    known = _METADATA_ONLY.get(func)
    if known is None:
        known = _METADATA_ONLY[func] = func.namespace == "prim" or func.overloadpacket.__name__.startswith("sym_")
    return known


# Ops whose CUDA kernel goes through cuBLAS (getCurrentCUDABlasHandle, which gives the
# handle its workspace on first use: aten/src/ATen/cuda/CublasHandlePool.cpp). linear and
# matmul reach a dispatch mode as mm/addmm when autograd decomposes them, as themselves
# under inference_mode.
CUBLAS_OPS = frozenset(
    {
        *("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot"),
        *("_addmm_activation", "_scaled_mm", "_int_mm", "linear", "matmul", "bilinear", "einsum"),
    }
)

@dataclass(frozen=True, slots=True)
class _OpFacts:
    """What the recorder asks of an op at every call that depends on the op alone (its
    overload: ``add.Tensor`` and ``add.out`` differ in what they write), asked once per op
    (:func:`_facts`): the recorder's own lookups cost more than the rest of a call's work."""

    name: str
    """The overload packet's name: what ticks and op calls are put under (``self._op``)."""
    qualified: str
    record_inside: bool
    as_cuda: Any
    """:data:`_AS_CUDA_ALLOCATES`' kernel for it, or None."""
    alias: bool
    role: tuple[Category, bool] | None
    fresh_input: bool
    cublas: bool
    writes: bool
    """Its schema writes an argument in place (``torch_compat.written_arguments`` not empty)."""
    nondeterministic: bool
    """:data:`memfit.measure.determinism.WATCHED_OPS` holds it: only then can the check find something."""
    twin: bool
    """:data:`memfit.measure.observer.TWIN_OPS` holds it: only then can ``Observer.after`` act."""


_FACTS: dict[Any, _OpFacts] = {}


def _facts(func: Any) -> _OpFacts:
    """:class:`_OpFacts` of ``func`` (an ``OpOverload``), remembered for the process: every
    field comes from the op's name, schema and constant tables, none from a call."""
    known = _FACTS.get(func)
    if known is not None:
        return known
    name = str(func.overloadpacket.__name__)
    qualified = func.overloadpacket._qualified_op_name
    record_inside = qualified in _RECORD_INSIDE_ON_CPU
    known = _FACTS[func] = _OpFacts(
        name=name,
        qualified=qualified,
        record_inside=record_inside,
        as_cuda=_AS_CUDA_ALLOCATES.get(qualified),
        alias=qualified in _distributed.ALIAS_OPS,
        role=_distributed.COLLECTIVE_ROLES.get(qualified),
        fresh_input=qualified in aliasing.FRESH_INPUT_OPS,
        cublas=name in CUBLAS_OPS,
        writes=bool(func._schema.is_mutable),
        nondeterministic=name in determinism.WATCHED_OPS,
        twin=name in TWIN_OPS,
    )
    return known


_TAG = "memfit.op#"
"""Prefix of the profiler regions around ops whose kernel workspace is being measured."""


def _attention_backward_estimate(op: str, args: tuple) -> int:
    """:func:`memfit.cuda.gpu.attention_backward_bytes` for an SDPA backward call: its
    arguments start with the output's gradient, query, key (batch, heads, seq, dim)."""
    grad_out, query, key = args[0], args[1], args[2]
    batch, heads, seq_q, head_dim = query.shape
    return gpu.attention_backward_bytes(
        op,
        batch=batch,
        heads=heads,
        heads_kv=key.shape[1],
        seq_q=seq_q,
        seq_k=key.shape[2],
        head_dim=head_dim,
        itemsize=query.element_size(),
        # the kernels take it as (batch, seq, heads, dim), contiguous, copying it if not
        grad_out_copy=not grad_out.transpose(1, 2).is_contiguous(),
    )


# What kind of op a kernel-scratch figure is asked for (:func:`kernel_scratch`), by op.
_NO_KERNEL, _RUN_INSIDE, _RUN_AS_CUDA, _KERNEL = range(4)
_SCRATCH_KIND: dict[Any, int] = {}


def _scratch_kind(func: Any) -> int:
    """:func:`kernel_scratch`'s kind of ``func``, remembered per op (asked at every call)."""
    kind = _SCRATCH_KIND.get(func)
    if kind is None:
        name = func.overloadpacket.__name__
        qualified = func.overloadpacket._qualified_op_name
        if func.is_view or func.namespace in ("prim", "c10d") or name in BOOKKEEPING_OPS:
            # a view allocates nothing (and a select's index would make each call a kind of its
            # own); a communication backend's own ops (gloo's copies, NCCL's buffers) are not the step's
            kind = _NO_KERNEL
        elif qualified in _RECORD_INSIDE_ON_CPU:
            kind = _RUN_INSIDE
        elif qualified in _AS_CUDA_ALLOCATES:
            kind = _RUN_AS_CUDA
        else:
            kind = _KERNEL
        _SCRATCH_KIND[func] = kind
    return kind


def kernel_scratch(
    func: Any,
    args: tuple,
    kwargs: dict,
    *,
    table: workspace.WorkspaceTable | None,
    attention: bool,
    probe: bool,
    inside: bool,
    as_cuda: bool,
    tensorless: bool,
) -> tuple[int | None, bool]:
    """What the kernel of one op call allocates for itself and frees before it returns, as
    memfit counts it on a step where no kernel's allocations can be read (fake tensors, or a
    real op of a kind not measured yet): ``(bytes, estimated)``, bytes None when there is no
    figure (the caller counts it unmeasured, or measures it), 0 for none; ``estimated``: the
    figure is SDPA backward's estimate from torch's sources.

    The rule, in order: no kernel that allocates (a view, the recorder's bookkeeping, a
    communication backend's own op: not the step's), 0; the figure a real step of this process
    measured for the op's kind (``table``); on fake CUDA (``attention``), SDPA backward's
    estimate; on a fake CPU step (``probe``), the op run once on real zeros of its shapes
    (:func:`memfit.measure.workspace.probe`); else None. Where the eager recorder and a
    compiled fake step differ, an argument says so:

    - ``table`` None: the step's tensors are not the device's (a fake-CUDA step compiled on
      host tensors, whose signatures would find the host's figures), so no table;
    - ``inside``: ops the caller runs with itself recording the torch ops inside them
      (bitsandbytes' Python CPU kernels under the eager recorder) get 0, their scratch being
      recorded as those ops; a compiled step's dispatch mode is off inside an op, so there
      they take the rule;
    - ``as_cuda``: ops the caller runs as their CUDA kernel allocates (bitsandbytes' 4-bit
      and int8 matmuls under the eager fake recorder) get 0, for the same reason;
    - ``tensorless``: an op without a tensor argument (a factory; inductor's wrapper makes its
      buffers with ``empty_strided``) makes nothing but its output, 0; the eager recorder
      keeps its figures as they were for those (the table's, the probe's, or unmeasured)."""
    kind = _SCRATCH_KIND.get(func)
    if kind is None:
        kind = _scratch_kind(func)
    if kind == _NO_KERNEL or (inside and kind == _RUN_INSIDE) or (as_cuda and kind == _RUN_AS_CUDA):
        return 0, False
    if tensorless and not any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves((args, kwargs))):
        return 0, False
    known = table.get(workspace.signature(func, args, kwargs)) if table is not None else None
    if known is None and attention:
        name = func.overloadpacket.__name__
        if name in gpu.ATTENTION_BACKWARD_OPS:
            return _attention_backward_estimate(name, args), True
    if known is None and probe and table is not None:
        known = workspace.probe(func, args, kwargs, table)  # the table learns it
    return known, False


def _cuda_capability(device: torch.device | None) -> tuple[int, int]:
    """The step's GPU's compute capability (fake CUDA answers for the GPU it simulates)."""
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def _cuda_stream() -> int:
    return int(torch.cuda.current_stream().stream_id)


def storage_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes a storage of ``nbytes`` takes from the device's allocator."""
    if device.type == "cuda" and nbytes:
        return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK
    return nbytes


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    """Tensors among aten arguments or results: tensors, or lists of them (foreach ops).
    Written out because ``tree_flatten`` costs more than the rest of the recorder."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def output_tensors(output: Any, _depth: int = 0) -> list[torch.Tensor]:
    """The tensors in what a model returned, in order: a tensor, or tensors inside tuples,
    lists, dicts (a transformers ``ModelOutput`` is one: its fields that are set) and
    dataclasses, nested. What the loop holds when it holds the output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if _depth > 8:
        return []
    if isinstance(output, dict):
        values: Iterable[Any] = output.values()
    elif isinstance(output, (list, tuple)):
        values = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        values = (getattr(output, f.name, None) for f in dataclasses.fields(output))
    else:
        return []
    return [t for v in values for t in output_tensors(v, _depth + 1)]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    t = _distributed.local_tensor(t)  # a DTensor's memory is its shard on this rank
    if t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less subclasses
        return None


class _Within(TorchDispatchMode):
    """The recorder again, for the ops inside a kernel the recorder is running (a mode is
    off while its own ``__torch_dispatch__`` runs)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.__torch_dispatch__(func, types, args, kwargs)


@dataclass
class _Record:
    nbytes: int
    category: Category | None
    phase: Phase
    module: str | None
    born: int
    died: int | None = None
    savers: dict[str, None] = field(default_factory=dict)  # ordered set
    mutated: bool = False
    stream: int = 0


class Recorder(TorchDispatchMode):
    """Dispatch mode building a :class:`Ledger`; also counts FLOPs per (phase, module)."""

    def __init__(
        self,
        scope: Scope,
        *,
        count_flops: bool = True,
        device: torch.device | None = None,
        checkpointed: Iterable[str] = (),
        fake: bool = False,
        probe: bool = False,
        forward_before_loop: bool = False,
    ) -> None:
        """``checkpointed``: modules running under a checkpoint (an applied plan, or one
        being verified), whose ops keep the checkpoint's per-node bookkeeping instead of
        saved records. ``fake``: the step runs on fake tensors, whose kernels allocate
        nothing; their workspace comes from :data:`memfit.measure.workspace.TABLE`, which
        real steps fill. ``probe``: on a fake CPU step, an op kind the table lacks is run
        once for real on zeros of its shapes to measure it (:func:`memfit.measure.workspace.probe`)
        instead of being left unmeasured. ``forward_before_loop``: the program ran the model's
        forward once before its loop (:attr:`memfit.StepOptions.forward_before_loop`), so what
        the step's forward makes for itself and keeps (the forward thread's cuBLAS workspace, a
        cache a module fills) existed before the loop's first step: not in ``Ledger.first_use``."""
        super().__init__()
        self.scope = scope
        self.device_type = device.type if device is not None else None
        # Only a CPU step's graph is in its memory; elsewhere it is host memory beside it.
        self.graph = self.device_type == "cpu"
        self.checkpointed = frozenset(checkpointed)
        self._graph_live: list[int] = []  # record indices of nodes and saved records not yet freed
        self._saved: dict[int, int] = {}  # id(packed alias) -> record index of its saved record
        self._elsewhere: dict[int, int] = {}  # id(storage) -> bytes, on another device than the step's
        self._elsewhere_live = 0
        self.elsewhere_peak = 0
        self.count_flops = count_flops
        self.records: list[_Record] = []
        self.ticks: list[Tick] = []
        self.flops: dict[tuple[Phase, str | None], int] = defaultdict(int)
        self._live: dict[int, int] = {}  # id(storage object) -> record index
        self._aliases: dict[int, int] = {}  # record index -> storage objects beyond the first holding it
        self._finalizers: list[weakref.finalize] = []
        self._op = "(start)"
        self._closed = False
        self.spans: list[Span] = []
        self.ops: list[OpCall] = []
        self._open: dict[tuple[Phase, str], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        self._init_kernel_workspaces(device, fake=fake, probe=probe)
        # record index -> the tick before which the step first touched a block alive at its
        # start that only the step revealed (Ledger.first_use)
        self._first_use: dict[int, int] = {}
        self._forward_before_loop = forward_before_loop
        # StepOptions.holds_output (register_held): the previous step's output's blocks alive at
        # the start, one entry per tensor of it (None: not its own block); the record of the graph
        # it keeps (CPU steps, training); node records made since the last backward, those of the
        # output now held (its forward's) and those of the output held from an earlier pass
        # (alive after backward until the next forward returns); the held output's blocks.
        self._held_start: list[int | None] = []
        self._held_graph_start: int | None = None
        self._pass_nodes: list[int] = []
        self._output_nodes: list[int] = []
        # which forward pass made each graph record, and the passes the running backward has
        # unpacked saved records of: a pipeline schedule runs other microbatches' forwards and
        # backwards between one microbatch's, and only that one's graph goes after its backward
        self._pass = 0
        self._pass_of: dict[int, int] = {}
        self._unpacked: set[int] = set()
        self._held_nodes: list[int] = []
        self._held_end: list[int | None] = []
        self._recording = False
        # (op, phase, module) -> what the step's note says of it (memfit.measure.determinism)
        self._nondeterministic: dict[tuple[str, str, str | None], determinism.Finding] = {}
        self._sites: dict[tuple, dict[str, None]] = defaultdict(dict)  # determinism.forward_site -> modules (ordered)
        # calls whose unwatched twin writes in place (see memfit.measure.observer)
        self.observer = Observer()
        scope.listener = self._on_scope
        # on real tensors inductor's wrapper makes its buffers past the dispatcher (a C++ fast
        # path), which this mode would not see: there dynamo sees the mode and runs eagerly
        self._compiled = fake and compiles(scope.model)

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        """Off while dynamo compiles, on while the compiled code runs, for a fake step of a model
        that compiles its own modules (torchtitan's blocks): else dynamo would see this mode and
        run them eagerly. The recorder then sees what inductor's wrapper runs: its buffers (made
        through dispatch on fake tensors), extern kernels and views; its fused kernels are not ops."""
        return self._compiled

    def _init_kernel_workspaces(self, device: torch.device | None, *, fake: bool, probe: bool) -> None:
        """What the recorder needs to count the memory kernels take for themselves (part of ``__init__``)."""
        self.table = workspace.TABLE
        self._workspace = self.device_type in workspace.PROBED_DEVICES
        # Real tensors: ops of a kind the table lacks run tagged inside an allocation trace;
        # their blocks wait, with no bytes, for the trace to be read when the step is over.
        self._trace = torch_compat.AllocationTrace() if self._workspace and not fake else None
        self._pending: list[tuple[int, tuple]] = []  # (record index, signature) waiting for a figure
        self._tagged: dict[tuple, str] = {}  # signature -> profiler tag of the call that measures it
        self.unmeasured_ops = 0
        self.attention_estimates = 0
        self._probe = probe and fake and self.device_type == "cpu"
        self._fake = fake
        # cuBLAS workspaces: one per (handle, stream), handles per thread (the forward's, the
        # autograd engine's device thread). Made at a thread's first cuBLAS call and kept by
        # torch for the process: in the steady-state step memfit records (a warm-up step ran
        # the same ops) they are alive from its start. Tensors never show them.
        self._cublas_bytes = gpu.cublas_workspace_bytes(_cuda_capability(device)) if self.device_type == "cuda" else 0
        self._cublas_keys: set[tuple[int, int]] = set()

    def _on_scope(self, phase: Phase, name: str, entering: bool, inputs: list[torch.Tensor]) -> None:
        key = (phase, name)
        if entering:
            ids = [idx for idx in map(self._block_of, inputs) if idx is not None]
            self._open[key].append((len(self.ticks), tuple(dict.fromkeys(ids))))
        elif self._open[key]:
            start, ids = self._open[key].pop()
            self.spans.append(Span(name, phase, start, len(self.ticks), ids))

    # -- blocks -----------------------------------------------------------------------------

    def _add(self, storage: torch.UntypedStorage, device: torch.device, category: Category | None, at_start: bool) -> int | None:
        if self.device_type is not None and device.type != self.device_type:
            if not at_start:
                self._add_elsewhere(storage)
            return None
        idx = len(self.records)
        if at_start:
            born, phase, module = START_TICK, Phase.START, None
            if self._recording:
                self._first_used(idx)
        else:
            born = self._tick()
            phase, module = self.scope.phase, self.scope.module
        stream = _cuda_stream() if device.type == "cuda" else 0  # the allocator's pools are per stream
        self.records.append(_Record(storage_bytes(storage.nbytes(), device), category, phase, module, born, stream=stream))
        if phase is Phase.BACKWARD:
            self.observer.born(idx, self._op)
        key = id(storage)
        self._live[key] = idx
        self._finalizers.append(weakref.finalize(storage, self._free, key))
        return idx

    def _add_elsewhere(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        self._elsewhere[key] = nbytes
        self._elsewhere_live += nbytes
        self.elsewhere_peak = max(self.elsewhere_peak, self._elsewhere_live)
        self._finalizers.append(weakref.finalize(storage, self._free_elsewhere, key))

    def _free_elsewhere(self, key: int) -> None:
        self._elsewhere_live -= self._elsewhere.pop(key, 0)

    def _block_of(self, t: torch.Tensor) -> int | None:
        """Index of the live block ``t``'s storage is, or None if memfit has not seen it."""
        s = _storage(t)
        return None if s is None else self._live.get(id(s))

    def _tick(self) -> int:
        self.ticks.append(Tick(self.scope.phase, self.scope.module, self._op, self.scope.recomputing))
        return len(self.ticks) - 1

    def _free(self, key: int) -> None:
        idx = self._live.pop(key, None)
        if idx is not None and self._aliases.get(idx):
            self._aliases[idx] -= 1  # another storage object still holds this block
            return
        if idx is not None and not self._closed and self.observer.absorbs(idx, self._relink):
            return  # the unwatched step wrote this block in place: the call's output holds it
        if idx is not None and not self._closed:
            self.records[idx].died = self._tick()

    def _relink(self, storage: int, idx: int) -> None:
        self._live[storage] = idx

    def _alias(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """The outputs' storages are the first input's block (see ``_distributed.ALIAS_OPS``
        and :meth:`_as_real_kernel`): it dies when the last of them does."""
        idx = self._block_of(inputs[0]) if inputs else None
        if idx is None:
            return
        for t in outputs:
            s = _storage(t)
            if s is not None and id(s) not in self._live:
                self._live[id(s)] = idx
                self._aliases[idx] = self._aliases.get(idx, 0) + 1
                self._finalizers.append(weakref.finalize(s, self._free, id(s)))

    def _as_real_kernel(self, func: Any, args: tuple, kwargs: dict, ins: list[torch.Tensor], out: Any, inputs: set[int]) -> None:
        """Fake steps: an output the real kernel returns as one of its inputs (eval dropout,
        :mod:`memfit.measure.aliasing`) is that input's memory, as on a real step: its block,
        made now for an input memfit has not seen, something alive before the step (a real
        step's rule for an output sharing such an input's storage: ``inputs``, the ids of the
        inputs' storages, takes the output's)."""
        for t, source in aliasing.returned_inputs(func, args, kwargs, ins, out):
            s, src = _storage(t), _storage(source)
            if s is None or src is None:
                continue
            inputs.add(id(s))
            if self._block_of(source) is None and src.nbytes() and id(src) not in self._elsewhere:
                self._add(src, source.device, Category.OTHER, at_start=True)
            self._alias([source], [t])

    def _add_graph(self, nbytes: int, saver: str | None = None) -> int:
        self.records.append(_Record(nbytes, Category.GRAPH, self.scope.phase, self.scope.module, self._tick()))
        if saver is not None:
            self.records[-1].savers[saver] = None
        self._graph_live.append(len(self.records) - 1)
        self._pass_of[len(self.records) - 1] = self._pass
        return len(self.records) - 1

    def new_pass(self) -> None:
        """A forward pass starts (a micro-batch's, a pipeline microbatch's): its graph is its own."""
        self._pass += 1

    def _add_node(self) -> None:
        """An autograd node for the op just run (under a checkpoint, with its bookkeeping)."""
        self._add_graph(GRAPH_NODE_BYTES + (CHECKPOINT_BYTES_PER_NODE if self._in_checkpoint() else 0))
        self._pass_nodes.append(len(self.records) - 1)

    def _records_node(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
        """Whether autograd records a node for this forward op: grad mode on, an input
        that requires grad, an output that can have a gradient."""
        if self._op in BOOKKEEPING_OPS or not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in inputs) and any(t.is_floating_point() or t.is_complex() for t in outputs)

    def _in_checkpoint(self) -> bool:
        module = self.scope.module
        if module is not None and self.checkpointed and any(m in self.checkpointed for m in ancestors(module)):
            return True
        # Someone else's checkpoint (transformers' gradient checkpointing, a model's own
        # torch.utils.checkpoint): its saved-tensor hooks sit above the recorder's.
        top = _top_saved_tensors_hooks(False)
        return top is not None and top[0] is not self._hooks_pack

    def free_graph(self) -> None:
        """The step let go of the graph (after backward): its nodes and any saved record
        backward did not use die now, but the nodes of a model output the loop holds
        (:meth:`held_replaced`), which live until the next forward returns. Where other forward
        passes' graphs are alive too (a pipeline schedule's microbatches in flight), only the
        graphs this backward ran through go (:meth:`_free_passes`)."""
        passes, self._unpacked = self._unpacked, set()
        if passes and any(self._pass_of.get(i) not in passes for i in self._graph_live):
            self._free_passes(passes)
            return
        keep = set(self._output_nodes)
        if self._graph_live and (not keep or any(i not in keep for i in self._graph_live)):
            tick = self._tick()
            for idx in self._graph_live:
                if idx not in keep and self.records[idx].died is None:
                    self.records[idx].died = tick
        self._held_nodes += [i for i in self._output_nodes if self.records[i].died is None]
        self._graph_live.clear()
        self._saved.clear()
        self._pass_nodes.clear()
        self._output_nodes = []

    def _free_passes(self, passes: set[int]) -> None:
        dying = {i for i in self._graph_live if self._pass_of.get(i) in passes}
        tick = self._tick()
        for idx in dying:
            if self.records[idx].died is None:
                self.records[idx].died = tick
        self._graph_live = [i for i in self._graph_live if i not in dying]
        self._saved = {k: v for k, v in self._saved.items() if v not in dying}
        self._pass_nodes = [i for i in self._pass_nodes if i not in dying]

    def register_held(self, output: Any) -> None:
        """:attr:`memfit.StepOptions.holds_output`: ``output``, what the model returned in the
        step before, is alive at the start (the loop's name for it) until this step's forward
        returns (:meth:`held_replaced`): its tensors' storages (those not registered already,
        a parameter the model returns), and on a CPU step the autograd nodes its tensors keep
        after backward (one block, as many nodes as this step's output keeps: the same step).
        Register after the step's other tensors."""
        tensors = output_tensors(output)
        for t in tensors:
            s = _storage(t)
            fresh = s is not None and id(s) not in self._live and s.nbytes()
            self._held_start.append(self._add(s, t.device, Category.TEMPORARY, at_start=True) if fresh else None)
        if self.graph and any(t.grad_fn is not None for t in tensors):
            self._held_graph_start = len(self.records)
            self.records.append(_Record(0, Category.GRAPH, Phase.START, None, START_TICK))  # sized in ledger()

    def held_replaced(self, dropped: bool, output: Any) -> None:
        """``HeldOutput.on_replace``: a forward returned and the loop's name now holds its
        output. The one it held before has just been dropped (its tensors' frees are recorded
        as they happen), with the graph it kept; the new output's graph is the nodes made since
        the last backward (the forward's), and its tensors are the step's output."""
        if self._closed:
            return
        if dropped:
            dying = list(self._held_nodes)
            if self._held_graph_start is not None and self.records[self._held_graph_start].died is None:
                dying.append(self._held_graph_start)
            if dying:
                tick = self._tick()
                for idx in dying:
                    self.records[idx].died = tick
            self._held_nodes = []
        tensors = output_tensors(output)
        keeps_graph = self.graph and any(t.grad_fn is not None for t in tensors)
        self._output_nodes = list(self._pass_nodes) if keeps_graph else []
        self._held_end = [self._block_of(t) for t in tensors]

    def register_start(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        """Declare tensors alive before the step, with what they are. First claim wins, so
        register in order of precedence (parameters before optimizer state, say)."""
        for t in tensors:
            s = _storage(t)
            if s is not None and id(s) not in self._live and s.nbytes():
                self._add(s, t.device, category, at_start=True)

    def mark(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        """Give blocks created during the step their final category (gradients, new
        optimizer state); blocks alive since the start keep theirs."""
        for t in tensors:
            idx = self._block_of(t)
            if idx is not None and self.records[idx].born != START_TICK:
                self.records[idx].category = category

    # -- hooks ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = _storage(t)
        if s is not None:
            idx = self._live.get(id(s))
            if idx is None and s.nbytes():
                idx = self._add(s, t.device, Category.OTHER, at_start=True)
            if idx is not None:
                self.records[idx].savers.setdefault(self.scope.module or "", None)
        # Returning ``t`` itself would hold its grad_fn from inside that grad_fn's saved
        # variables: a reference cycle that never frees the activation. A detached alias
        # shares the storage and autograd restores the metadata on unpack.
        alias = t.detach()
        if self.graph and self.scope.phase is Phase.FORWARD:
            self._saved[id(alias)] = self._add_graph(GRAPH_SAVED_BYTES, self.scope.module or "")
        return alias

    def _policy_saved(self, t: torch.Tensor) -> None:
        """A selective-checkpoint policy kept ``t`` for backward in its own cache (torchtitan's
        per-op SAC keeps every other matmul's output so): an activation, as what autograd's
        hooks save is, though those hooks never see it."""
        s = _storage(t)
        idx = self._live.get(id(s)) if s is not None else None
        if idx is not None:
            self.records[idx].savers.setdefault(self.scope.module or "", None)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        idx = self._saved.pop(id(t), None)
        if idx is not None and not self._closed:
            self.records[idx].died = self._tick()
            self._unpacked.add(self._pass_of.get(idx, -1))
        return t

    # a compiled graph's higher-order operators come here too: _higher_order follows them
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, types, args, kwargs or {})
        dtensors = _distributed.dtensor_types()
        if dtensors and any(t in dtensors for t in types):
            # Let DTensor run first: it comes back here as ops on its local shards, the
            # memory this rank holds (as torch's MemTracker does). Autograd records its node
            # for the op on the wrapper, whose inputs require grad, where the shards handed on
            # do not: counted here (before the op's outputs rather than after), unless a plain
            # input that requires grad has it counted when the op comes back.
            if self.graph and self.scope.phase is Phase.FORWARD and not _metadata_only(func):
                self._op = (_FACTS.get(func) or _facts(func)).name
                ins = _tensors((*args, *(kwargs or {}).values()))
                plain_grad = any(t.requires_grad and type(t) not in dtensors for t in ins)
                if not plain_grad and self._records_node(ins, ins):  # a float op on floats makes floats
                    self._add_node()
            return NotImplemented
        kwargs = kwargs or {}
        if _metadata_only(func):  # allocates nothing, returns no storage: no trace in the ledger
            return func(*args, **kwargs)
        facts = _FACTS.get(func) or _facts(func)
        self._op = facts.name
        phase = self.scope.phase
        backward = phase is Phase.BACKWARD
        self.observer.on_call(backward)
        first = len(self.ticks)
        in_tensors = _tensors((*args, *kwargs.values()))
        inputs = {id(s) for s in map(_storage, in_tensors) if s is not None}
        if facts.writes and phase is Phase.FORWARD:
            self._mark_mutated(torch_compat.written_arguments(func, args, kwargs))
        if self._cublas_bytes and facts.cublas:
            self._cublas_workspace()
        if facts.nondeterministic:
            self._check_determinism(func, args, kwargs, in_tensors)
        scratch, tag = self._open_workspace(func, facts, args, kwargs)
        if tag is None:
            out = self._call(func, facts, args, kwargs)
        else:
            with torch.profiler.record_function(tag):
                out = self._call(func, facts, args, kwargs)
        out_tensors = _tensors(out if isinstance(out, (list, tuple)) else (out,))
        if facts.alias:
            self._alias(in_tensors, out_tensors)
        if self._fake and aliasing.may_return_inputs(func):
            self._as_real_kernel(func, args, kwargs, in_tensors, out, inputs)
        for t in out_tensors:
            s = _storage(t)
            if s is None or id(s) in self._live or id(s) in self._elsewhere or not s.nbytes():
                continue
            # An output sharing an input's storage that memfit has not seen is a view of
            # something alive before the step (a cache a module keeps): not an allocation.
            before = id(s) in inputs and not facts.fresh_input
            self._add(s, t.device, Category.OTHER if before else None, at_start=before)
        if backward and facts.twin:
            self.observer.after(func, args, kwargs, out, self._block_of, lambda t: id(_storage(t)))
        if facts.role is not None:
            self._give_role(facts.role[0], in_tensors + out_tensors if facts.role[1] else out_tensors)
        if scratch is not None:
            # Alive from before the op's outputs to after them: at the op's last output the
            # ledger holds what the kernel held at its highest.
            self.records[scratch].died = self._tick()
        flops = torch_compat.op_flops(func, args, kwargs, out) if self.count_flops else 0
        if flops:
            self.flops[(self.scope.phase, self.scope.module)] += flops
        if self.scope.phase is Phase.FORWARD:
            self.ops.append(OpCall(self.scope.module, self._op, flops, first, len(self.ticks)))
            # After the op's own ticks: the node is not an allocation of the op's kernel.
            if self.graph and self._records_node(in_tensors, out_tensors):
                self._add_node()
        return out

    def _higher_order(self, hop: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """The RNG wrappers a compiled graph runs a random op in (AOTAutograd's functionalized
        RNG: the op run and the generator's state kept for its recompute, then the op run again
        from that state): the op recorded as any op, the state (a host tensor of the
        generator's) as torch's rule makes it. Any other higher-order operator is refused."""
        name = hop.name()
        if name == "run_and_save_rng_state":
            op, *rest = args
            # the generator's state is host memory on either device, and only handed back
            return torch.get_rng_state(), self.__torch_dispatch__(op, types, tuple(rest), kwargs)
        if name == "run_with_rng_state":
            _, op, *rest = args
            return self.__torch_dispatch__(op, types, tuple(rest), kwargs)
        raise WorkloadError(f"memfit's recorder does not follow the higher-order operator {name} (a compiled graph ran it)")

    def _check_determinism(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> None:
        """Note an op whose result varies from run to run of this very step (it is the
        step's, not memfit's: the note says so where a user would suspect memfit's plans),
        under the module whose forward made it when it is a backward op."""
        phase = self.scope.phase
        if phase is Phase.FORWARD:
            site = determinism.forward_site(self._op, args)
            if site is not None and torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
                self._sites[site][self.scope.module or ""] = None
        rule = determinism.check(self._op, self.device_type, args, kwargs)
        if rule is None:
            return
        module = self.scope.module
        if phase is Phase.BACKWARD:
            made_by = self._sites.get(determinism.backward_site(self._op, args))  # type: ignore[arg-type]
            if made_by:
                module = ", ".join(m or "(root)" for m in made_by)
        key = (rule.label, phase.value, module)
        if key not in self._nondeterministic:
            self._nondeterministic[key] = determinism.finding(rule, *key[1:])

    def _give_role(self, role: Category, tensors: list[torch.Tensor]) -> None:
        """Blocks a collective allocates or communicates through are its buffers: those born
        in the step and not yet given a category, and those first seen as parts of
        something alive before the step (DDP's buckets, made by its C++ reducer when it was
        built, where no mode sees them)."""
        for t in tensors:
            idx = self._block_of(t)
            if idx is None and role is Category.DDP_BUCKET:
                s = _storage(t)
                if s is not None and s.nbytes() and id(s) not in self._elsewhere:
                    idx = self._add(s, t.device, role, at_start=True)
            if idx is None:
                continue
            r = self.records[idx]
            if r.category is None and r.born != START_TICK or r.category is Category.OTHER and r.born == START_TICK:
                r.category = role

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        """``storage.resize_(n)``: the block it was dies, and with ``n`` > 0 a new block of
        its new size is born (FSDP2 frees and re-allocates unsharded parameters this way)."""
        if self._closed:
            return
        key = id(storage)
        self._op = "resize_"
        idx = self._live.pop(key, None)
        if idx is not None:
            self.records[idx].died = self._tick()
        if storage.nbytes():
            # a fake tensor's storage is on meta; the tensor is on the step's device
            device = storage.device if storage.device.type != "meta" else torch.device(self.device_type or "cpu")
            self._add(storage, device, Category.UNSHARDED, at_start=False)

    def _first_used(self, idx: int) -> None:
        """Record ``idx``, a block alive at the start that the step only now touched, in
        ``Ledger.first_use``: made by the program's first step where the step first used it,
        unless a forward the program ran before its loop made it (we are in the forward)."""
        if not (self._forward_before_loop and self.scope.phase is Phase.FORWARD):
            self._first_use[idx] = len(self.ticks)

    def _cublas_workspace(self) -> None:
        key = (threading.get_ident(), _cuda_stream())
        if key in self._cublas_keys:
            return
        self._cublas_keys.add(key)
        self._first_used(len(self.records))
        self.records.append(_Record(self._cublas_bytes, Category.WORKSPACE, Phase.START, None, START_TICK))

    @property
    def cublas_workspaces(self) -> int:
        """cuBLAS workspaces the step holds (one per thread and stream that ran a cuBLAS op)."""
        return len(self._cublas_keys)

    def _open_workspace(self, func: Any, facts: _OpFacts, args: tuple, kwargs: dict) -> tuple[int | None, str | None]:
        """The workspace block of this op call (its record index, born now) and the profiler
        tag to run it under when it is still to be measured; Nones when the op needs none."""
        if not self._workspace:
            return None, None
        fake = self._trace is None
        known, estimated = kernel_scratch(
            func,
            args,
            kwargs,
            table=self.table,
            attention=fake and self.device_type == "cuda",  # fake CUDA runs no kernel to measure
            probe=self._probe,
            inside=True,
            as_cuda=fake,
            tensorless=False,
        )
        self.attention_estimates += estimated
        if known is None and fake:
            self.unmeasured_ops += 1
            return None, None
        if known == 0:
            return None, None
        self.records.append(_Record(known or 0, Category.WORKSPACE, self.scope.phase, self.scope.module, self._tick()))
        idx = len(self.records) - 1
        if known is not None:
            return idx, None
        sig = workspace.signature(func, args, kwargs)  # measured in this step: the table learns it after
        self._pending.append((idx, sig))
        if sig in self._tagged:  # the first call of this kind measures it for all
            return idx, None
        self._tagged[sig] = f"{_TAG}{len(self._tagged)}"
        return idx, self._tagged[sig]

    def _settle_workspace(self) -> None:
        """Read the allocation trace: each kind of op measured in this step (its first call)
        gets its workspace (the most its kernel held beyond what it returned), the table
        learns it, and every call of that kind gets the table's figure, so the ledger is the
        one a later step of the same ops (or a fake one) records."""
        if self._trace is None or not self._pending:
            return
        peaks = self._trace.peaks(_TAG, self.device_type or "cpu")
        for sig, tag in self._tagged.items():
            self.table.record(sig, workspace.workspace_bytes(*peaks.get(tag, (0, 0))))
        for idx, sig in self._pending:
            self.records[idx].nbytes = self.table.get(sig) or 0
        self._pending.clear()
        self._tagged.clear()

    def _call(self, func: Any, facts: _OpFacts, args: tuple, kwargs: dict) -> Any:
        if facts.record_inside and all(t.device.type == "cpu" for t in _tensors((*args, *kwargs.values()))):
            # Straight to the CPU kernel (fake tensors too: its ops are then faked), with
            # the recorder on for the torch ops it runs.
            with _Within(self):
                return func.redispatch(_CPU_KEYS, *args, **kwargs)
        as_cuda = facts.as_cuda
        if as_cuda is not None and self._trace is None:
            tensors = list(_tensors((*args, *kwargs.values())))
            if tensors and all(t.device.type == "cuda" and torch_compat.is_fake(t) for t in tensors):
                with _Within(self):
                    return as_cuda(*args, **kwargs)
        return func(*args, **kwargs)

    def _mark_mutated(self, written: list[Any]) -> None:
        for t in _tensors(written):
            idx = self._block_of(t)
            if idx is not None:
                self.records[idx].mutated = True

    def __enter__(self):
        if self._trace is not None:
            try:
                self._trace.__enter__()
            except RuntimeError:  # a profiler already running (the user's): nothing to measure with
                self._trace = None
        # No cyclic collection inside the step: a tensor held only by a reference cycle (a
        # fake step's loss gradient is) would die wherever a collection happens to fall
        # (Python counts its own allocations, so what ran earlier in the process moves it),
        # a free in one ledger and not in the same step's next. It dies after the step.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._hooks_pack = self._pack  # one bound method object, to recognise it on the hooks' stack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._hooks_pack, self._unpack)
        self._hooks.__enter__()
        self._policy_saves = torch_compat.selective_checkpoint_saves(self._policy_saved)
        self._policy_saves.__enter__()
        self._resizes = _distributed.tracking_resize(self._on_resize)
        self._resizes.__enter__()
        self._recording = True
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.__exit__(*exc)
            self._closed = True  # what dies from here on (a collection, say) dies after the step
            self._recording = False
            if self._gc_was_enabled:
                gc.enable()
            self._policy_saves.__exit__(*exc)
            self._hooks.__exit__(*exc)
            if self._trace is not None:
                self._trace.__exit__(*exc)
                if exc[0] is None:
                    self._settle_workspace()

    def close(self) -> None:
        """Stop listening for frees (blocks still alive outlive the step)."""
        self._closed = True
        self.scope.listener = None
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live.clear()
        self._aliases.clear()
        self._elsewhere.clear()
        self._saved.clear()

    def ledger(self) -> Ledger:
        # Workspace blocks measured at zero bytes are dropped with their two ticks: the
        # ledger is then the one a step that knew the figures beforehand records.
        if self._held_graph_start is not None:
            # the previous step's held graph: the nodes this step's held output keeps at its end
            self.records[self._held_graph_start].nbytes = sum(self.records[i].nbytes for i in self._held_nodes)
        empty = {i for i, r in enumerate(self.records) if r.category is Category.WORKSPACE and not r.nbytes}
        if self._held_graph_start is not None and not self.records[self._held_graph_start].nbytes:
            empty.add(self._held_graph_start)
        empty |= self.observer.merged  # allocations the unwatched step never makes
        gone = sorted(t for i in empty for t in (self.records[i].born, self.records[i].died) if t is not None and t >= 0)

        def at(tick: int) -> int:  # a tick index (or a span's boundary) once ``gone`` are removed
            return tick - bisect.bisect_left(gone, tick)

        kept = [i for i in range(len(self.records)) if i not in empty]
        index = {old: new for new, old in enumerate(kept)}
        blocks = []
        for i, r in enumerate(self.records[k] for k in kept):
            category = r.category or (Category.ACTIVATION if r.savers else Category.TEMPORARY)
            born = r.born if r.born == START_TICK else at(r.born)
            died = None if r.died is None else at(r.died)
            blocks.append(Block(i, r.nbytes, category, r.phase, r.module, born, died, tuple(r.savers), r.mutated, r.stream))
        dropped = set(gone)
        ticks = [t for i, t in enumerate(self.ticks) if i not in dropped]
        spans = sorted(
            (
                Span(s.module, s.phase, at(s.start), at(s.end), tuple(index[b] for b in s.inputs if b in index))
                for s in self.spans
            ),
            key=lambda s: (s.start, -s.end),
        )
        ops = [OpCall(o.module, o.op, o.flops, at(o.first), at(o.end)) for o in self.ops]
        return Ledger(
            blocks,
            ticks,
            spans,
            ops,
            host_peak_bytes=self.elsewhere_peak,
            unmeasured_ops=self.unmeasured_ops,
            cublas_workspaces=self.cublas_workspaces,
            cublas_workspace_bytes=self._cublas_bytes,
            attention_estimates=self.attention_estimates,
            first_use={index[i]: at(t) for i, t in self._first_use.items() if i in index},
            nondeterministic=list(self._nondeterministic.values()),
            held_output=self._held_pairs(index),
        )

    def _held_pairs(self, index: dict[int, int]) -> dict[int, int | None]:
        """``Ledger.held_output``: each block of the previous step's held output, with the block
        of this step's output that the loop holds in its place (the tensor in the same place of
        the output, of the same size), or None."""
        pairs: dict[int, int | None] = {}
        ends = self._held_end if len(self._held_end) == len(self._held_start) else [None] * len(self._held_start)
        taken: set[int] = set()
        for start, end in zip(self._held_start, ends):
            if start is None or start not in index:
                continue
            r = self.records[end] if end is not None else None
            fits = (
                r is not None
                and end not in taken
                and end in index
                and r.born != START_TICK
                and r.died is None
                and r.nbytes == self.records[start].nbytes
            )
            pairs[index[start]] = index[end] if fits else None  # type: ignore[index]
            if fits:
                taken.add(end)  # type: ignore[arg-type]
        return pairs
