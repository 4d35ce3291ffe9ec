"""The memory ledger: plain data describing where the bytes of one training step go.

A :class:`Ledger` is a list of storage :class:`Block` s and a timeline of :class:`Tick` s.
Each tick is one allocation or one free; a block is born at one tick and dies at a later
one (or lives past the end of the step). Memory at a tick is the sum of the blocks alive
there, so the peak, its breakdown and anything a planner wants to simulate derive from
these two lists alone. Nothing here imports torch: planners can work on a ledger that
was measured elsewhere and saved as JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum

from memfit.measure.determinism import Finding

__all__ = [
    "Category",
    "Phase",
    "Block",
    "Tick",
    "Span",
    "OpCall",
    "Ledger",
    "GRAPH_NODE_BYTES",
    "GRAPH_SAVED_BYTES",
    "CHECKPOINT_BYTES_PER_NODE",
]

# Autograd's graph on CPU, where it takes from the same memory as the tensors. The
# recorder counts the graph's nodes and saved tensors exactly; what each costs in host
# memory is a constant, a least-squares fit of the step's RSS peak over chains of tiny ops
# (``python benchmarks/graph_host_memory.py``: torch 2.13, glibc, x86_64). It varies by
# op type (each pattern's figure is within 15% of the fit; zoo ``heavy``'s, held out, 0.3%), which is why the blocks
# are their own category: estimated, where every other block is measured.
GRAPH_NODE_BYTES = 855
"""Host bytes per autograd node (the C++ node, its edges and input metadata, the output
tensor objects): alive from the op that creates it until the graph is freed after backward."""
GRAPH_SAVED_BYTES = 341
"""Host bytes per tensor saved for backward beyond its data (the saved-variable record and
the tensor objects it keeps alive): released when backward has used it."""
CHECKPOINT_BYTES_PER_NODE = 375
"""Host bytes a non-reentrant checkpoint keeps per autograd node of its region instead of
the saved-tensor records (Python holders, weak references, the saved variables' Python
objects): on chains of tiny ops it costs more than the records it replaces."""


class Category(str, Enum):
    """What a storage holds. The order is the order tables show."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    GRADIENT = "gradients"
    OPTIMIZER = "optimizer_state"
    INPUT = "inputs"
    ACTIVATION = "activations"
    """Saved by autograd for backward (a saved-tensor hook saw it)."""
    TEMPORARY = "temporaries"
    """Created during the step and never saved: outputs, intermediate values, scratch."""
    WORKSPACE = "kernel_workspace"
    """Memory a kernel allocates for itself and frees before it returns (oneDNN reorders,
    a kernel's own scratch tensors), which no op returns: measured per kind of op on real
    tensors (:mod:`memfit.measure.workspace`), alive across the op's outputs."""
    OTHER = "other"
    """Alive before the step but none of the above (a cache a module keeps, say)."""
    UNSHARDED = "unsharded_parameters"
    """Distributed steps: FSDP's full parameters, all-gathered for a module's forward or
    backward and freed after it (the sharded ones are :attr:`PARAMETER`)."""
    ALL_GATHER = "all_gather_buffers"
    """Distributed steps: the buffer FSDP copies the local shards into and all-gathers."""
    REDUCE_SCATTER = "reduce_scatter_buffers"
    """Distributed steps: FSDP's reduce-scatter input (the full gradients, concatenated) and output."""
    DDP_BUCKET = "ddp_buckets"
    """Distributed steps: the gradient buckets DDP all-reduces."""
    PIPELINE = "pipeline_buffers"
    """Pipelined steps: a stage's receive buffers (the activations the stage before sends, the
    gradients the stage after sends back), one per microbatch, made at the first step and kept."""
    GRAPH = "autograd_graph"
    """CPU steps only: autograd's nodes and saved-tensor records in host memory, which are
    not tensor storages. Estimated (counted nodes and saved tensors times a per-item
    constant, see :data:`GRAPH_NODE_BYTES`), where every other category is measured."""


class Phase(str, Enum):
    """Where in the step something happened."""

    START = "start"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


START_TICK = -1
"""The ``born`` of a block that was alive when the step began."""


@dataclass(frozen=True, slots=True)
class Block:
    """One storage (views and tensors sharing it count once); on a CPU step also a piece of
    autograd's graph (:attr:`Category.GRAPH`: a node or a saved-tensor record, estimated)."""

    id: int
    nbytes: int
    category: Category
    phase: Phase
    """Phase that allocated it (``START`` if it was alive before the step)."""
    module: str | None
    """Qualified name of the innermost module running when it was allocated; ``""`` is the
    root module, ``None`` outside any module (the loss, the optimizer)."""
    born: int
    """Tick of its allocation, ``START_TICK`` for blocks alive at the start."""
    died: int | None
    """Tick of its free, ``None`` if it outlived the step."""
    savers: tuple[str, ...] = ()
    """Innermost modules whose ops saved it for backward."""
    mutated: bool = False
    """Written in place by a later op in the forward (a ReLU(inplace=True), say): an op
    output that is mutated cannot be kept by selective recompute."""
    stream: int = 0
    """CUDA only: the stream it was allocated on (0: the default stream). The caching
    allocator keeps a pool per stream; FSDP2 allocates its all-gather buffers and the
    sharded gradients on streams of its own."""

    def alive_at(self, tick: int) -> bool:
        return self.born <= tick and (self.died is None or self.died > tick)


@dataclass(frozen=True, slots=True)
class Tick:
    """Context of one allocation or free."""

    phase: Phase
    module: str | None
    op: str
    """The aten op running (or just run) when the tick happened."""
    recompute: bool = False
    """In backward, inside a checkpointed module's forward run again (a recompute)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One module call's forward, or its backward, as the ticks ``[start, end)``."""

    module: str
    phase: Phase
    start: int
    end: int
    inputs: tuple[int, ...] = ()
    """Blocks the call received as tensor arguments (forward spans)."""


@dataclass(frozen=True, slots=True)
class OpCall:
    """One forward op: where it ran, what it cost, what it allocated (ticks ``[first, end)``)."""

    module: str | None
    op: str
    flops: int
    first: int
    end: int


@dataclass(slots=True)
class Ledger:
    """Blocks and timeline of one step; memory is integer bytes throughout."""

    blocks: list[Block]
    ticks: list[Tick]
    spans: list[Span] = field(default_factory=list)
    """Forward and backward spans of every module call (what planners cut the timeline by)."""
    ops: list[OpCall] = field(default_factory=list)
    """Forward ops in order (what selective recompute chooses among)."""
    host_peak_bytes: int = 0
    """A step on an accelerator: the most bytes it held at once in host memory, which is
    not in the blocks (offloaded activations, the optimizer's step counters)."""
    unmeasured_ops: int = 0
    """Op calls whose kernel workspace is not in the blocks: a fake-tensor step of ops no
    real step in this process has measured (:mod:`memfit.measure.workspace`)."""
    cublas_workspaces: int = 0
    """CUDA steps: cuBLAS workspaces among the :attr:`Category.WORKSPACE` blocks (one per
    thread and stream that ran a cuBLAS op, alive from the start; no tensor shows them)."""
    cublas_workspace_bytes: int = 0
    """Bytes of each of them (by the GPU's generation, :func:`memfit.cuda.gpu.cublas_workspace_bytes`)."""
    attention_estimates: int = 0
    """Fake CUDA steps: SDPA backward calls whose :attr:`Category.WORKSPACE` block is an
    estimate of the kernel's own temporaries (:func:`memfit.cuda.gpu.attention_backward_bytes`),
    not a measurement."""
    nondeterministic: list[Finding] = field(default_factory=list)
    """Ops of the step whose result differs from run to run even without memfit, on this
    device, at these sizes and settings (:mod:`memfit.measure.determinism`), once per
    (op, phase, module)."""
    first_use: dict[int, int] = field(default_factory=dict)
    """Blocks alive at the start (``START_TICK``) that the step first touched at a tick, by id:
    what the step made for itself the first time it ran and kept (a cuBLAS workspace, made at a
    thread's first cuBLAS call; a tensor a module caches), found only when used. A replay of the
    program's first step (:func:`memfit.measure.replay.replay_training`) allocates them
    there rather than before the step."""
    held_output: dict[int, int | None] = field(default_factory=dict)
    """:attr:`memfit.StepOptions.holds_output`: the blocks alive at the start that are the
    previous step's model output, which the loop holds until this step's forward returns, by
    id, each with the block of this step's output the loop holds in its place at the end (the
    tensor in the same place of the output; None if none fits). The program's first step starts
    without them; every later step frees the one the step before left (the allocator replay,
    :func:`memfit.measure.replay.replay_training`, pairs them so)."""
    _curve: list[int] | None = field(default=None, repr=False, compare=False)
    _op_outputs: tuple[list[int], dict[int, int]] | None = field(default=None, repr=False, compare=False)

    # -- the curve and its peak -------------------------------------------------------------

    @property
    def start_bytes(self) -> int:
        """Bytes alive when the step began."""
        return sum(b.nbytes for b in self.blocks if b.born == START_TICK)

    @property
    def end_bytes(self) -> int:
        """Bytes alive when the step ended."""
        return sum(b.nbytes for b in self.blocks if b.died is None)

    def curve(self) -> list[int]:
        """Live bytes after each tick (``curve()[i]`` is memory right after tick ``i``)."""
        if self._curve is None:
            delta = [0] * len(self.ticks)
            for b in self.blocks:
                if b.born != START_TICK:
                    delta[b.born] += b.nbytes
                if b.died is not None:
                    delta[b.died] -= b.nbytes
            live, curve = self.start_bytes, []
            for d in delta:
                live += d
                curve.append(live)
            self._curve = curve
        return self._curve

    def op_outputs(self) -> tuple[list[int], dict[int, int]]:
        """Bytes each forward op call returned, and the op call that returned each block id
        (kept: a plan reads them three times). A kernel's workspace is not an output: selective
        recompute cannot keep it, and the cost model's bytes are what an op writes."""
        if self._op_outputs is None:
            op_bytes = [0] * len(self.ops)
            born_op: dict[int, int] = {}
            owner = [-1] * len(self.ticks)
            for i, op in enumerate(self.ops):
                for t in range(op.first, op.end):
                    owner[t] = i
            for b in self.blocks:
                if b.born >= 0 and owner[b.born] >= 0 and b.category is not Category.WORKSPACE:
                    born_op[b.id] = owner[b.born]
                    op_bytes[owner[b.born]] += b.nbytes
            self._op_outputs = op_bytes, born_op
        return self._op_outputs

    @property
    def peak_tick(self) -> int:
        """The first tick at which memory is highest (``START_TICK`` for an empty timeline)."""
        curve = self.curve()
        if not curve or max(curve) <= self.start_bytes:
            return START_TICK
        peak = max(curve)
        return curve.index(peak)

    @property
    def peak_bytes(self) -> int:
        """Highest live bytes during the step, including what was alive at its start."""
        curve = self.curve()
        return max([self.start_bytes, *curve])

    def live_at(self, tick: int) -> Iterator[Block]:
        return (b for b in self.blocks if b.alive_at(tick))

    def breakdown(self, tick: int | None = None) -> dict[Category, int]:
        """Bytes by category alive at ``tick`` (default: the peak), every category present."""
        tick = self.peak_tick if tick is None else tick
        out = {c: 0 for c in Category}
        for b in self.live_at(tick):
            out[b.category] += b.nbytes
        return out

    def phase_peaks(self) -> dict[Phase, int]:
        """Highest live bytes reached within each phase."""
        out = {p: 0 for p in Phase}
        out[Phase.START] = self.start_bytes
        for tick, live in zip(self.ticks, self.curve()):
            out[tick.phase] = max(out[tick.phase], live)
        return out

    # -- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "blocks": [
                _block_dict(b) for b in self.blocks
            ],
            # the recompute flag only where set: ledgers without recompute read as before
            "ticks": [[t.phase.value, t.module, t.op, *((True,) if t.recompute else ())] for t in self.ticks],
            "spans": [[s.module, s.phase.value, s.start, s.end, list(s.inputs)] for s in self.spans],
            "ops": [[o.module, o.op, o.flops, o.first, o.end] for o in self.ops],
            "host_peak_bytes": self.host_peak_bytes,
            "unmeasured_ops": self.unmeasured_ops,
            "cublas_workspaces": self.cublas_workspaces,
            "cublas_workspace_bytes": self.cublas_workspace_bytes,
            "attention_estimates": self.attention_estimates,
            "first_use": [[i, t] for i, t in self.first_use.items()],
            "nondeterministic": [f.to_dict() for f in self.nondeterministic],
            # only where the step holds its output: other ledgers read as before
            **({"held_output": [[i, j] for i, j in self.held_output.items()]} if self.held_output else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Ledger:
        blocks = [
            Block(**{**b, "category": Category(b["category"]), "phase": Phase(b["phase"]), "savers": tuple(b.get("savers", ()))})  # noqa: E501
            for b in data["blocks"]
        ]
        ticks = [Tick(Phase(t[0]), t[1], t[2], bool(t[3]) if len(t) > 3 else False) for t in data["ticks"]]
        spans = [Span(m, Phase(p), a, b, tuple(i)) for m, p, a, b, i in data.get("spans", [])]
        ops = [OpCall(*o) for o in data.get("ops", [])]
        return cls(
            blocks,
            ticks,
            spans,
            ops,
            host_peak_bytes=int(data.get("host_peak_bytes", 0)),
            unmeasured_ops=int(data.get("unmeasured_ops", 0)),
            cublas_workspaces=int(data.get("cublas_workspaces", 0)),
            cublas_workspace_bytes=int(data.get("cublas_workspace_bytes", 0)),
            attention_estimates=int(data.get("attention_estimates", 0)),
            first_use={int(i): int(t) for i, t in data.get("first_use", [])},
            nondeterministic=[Finding.from_dict(f) for f in data.get("nondeterministic", [])],
            held_output={int(i): None if j is None else int(j) for i, j in data.get("held_output", [])},
        )


def ancestors(name: str) -> Iterable[str]:
    """``"a.b.c"`` -> ``"a.b.c", "a.b", "a", ""``: the module and every module around it."""
    yield name
    while name:
        name = name.rpartition(".")[0]
        yield name


def _block_dict(b: Block) -> dict:
    """A block as JSON; its stream only where not the default one (other ledgers read as before)."""
    out = {**asdict(b), "category": b.category.value, "phase": b.phase.value, "savers": list(b.savers)}
    if not b.stream:
        del out["stream"]
    return out
