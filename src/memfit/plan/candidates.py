"""Candidates: what recomputing each module would save and cost, read off the ledger.

Pure policy over plain data (a :class:`~memfit.measure.ledger.Ledger` and module
figures); nothing here touches a model.

For a module M called once, with forward ticks ``[fs, fe)`` and backward ticks
``[bs, be)``, the blocks recompute can free are the activations born inside M's forward,
saved only by ops inside M, and released during M's backward: autograd alone kept them
alive from ``fe`` to ``bs``. Checkpointing M removes them from ``[fe, bs)`` and brings
them back when M's backward starts, together with the temporaries of M's forward (the
recompute transient). Selective recompute keeps the outputs of some op types (their
bytes stay, and so does any such output that was not saved before) and recomputes the
rest. A module's options are independent of its neighbours', so a plan's memory at any
tick is the unplanned curve plus the chosen options' deltas there.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field, replace

from memfit.cuda.gpu import DATASHEETS, GpuSpec, datasheet
from memfit.measure.ledger import CHECKPOINT_BYTES_PER_NODE, Category, Ledger, Phase, Span, ancestors

__all__ = ["Option", "Candidates", "build_candidates", "DeviceRates", "leaf_samples", "pooled_times"]


@dataclass(frozen=True)
class DeviceRates:
    """Turns an op's FLOPs, output bytes and count into estimated seconds: to split a
    measured module time among its ops, or to stand in for time where none was measured."""

    flops_per_s: float
    bytes_per_s: float
    seconds_per_op: float = 0.0
    """Fixed cost of launching any op (dispatcher, Python, kernel launch)."""
    fp32_slower: float = 1.0
    """How many times slower float32 FLOPs run than :attr:`flops_per_s` (CUDA's are
    half-precision tensor-core figures; torch's float32 matmuls, TF32 off by default, are not)."""

    def estimate(self, flops: float, nbytes: float, ops: float = 1.0) -> float:
        return flops / self.flops_per_s + nbytes / self.bytes_per_s + ops * self.seconds_per_op

    @staticmethod
    def for_device(device: str, gpu: GpuSpec | None = None) -> DeviceRates:
        """Round figures for the device class, used where nothing was measured; on CUDA an
        H100's, or ``gpu``'s: the H100's scaled by its datasheet peaks against the H100's (the
        same share of each peak reached; an H100's where the GPU has no datasheet figures)."""
        if "cuda" in device:
            # H100-class, HBM3; float32 about an eighth as fast (H100: 67 against 989 dense
            # TFLOP/s in NVIDIA's datasheet, A100: 19.5 against 312)
            h100 = DeviceRates(flops_per_s=400e12, bytes_per_s=2.5e12, seconds_per_op=5e-6, fp32_slower=8.0)
            sheet, base = (datasheet(gpu) if gpu is not None else None), DATASHEETS["H100-80GB"]
            if sheet is None:
                return h100
            half = sheet.half_flops_per_s / base.half_flops_per_s
            return replace(
                h100,
                flops_per_s=h100.flops_per_s * half,
                bytes_per_s=h100.bytes_per_s * sheet.bytes_per_s / base.bytes_per_s,
                fp32_slower=h100.fp32_slower * half / (sheet.fp32_flops_per_s / base.fp32_flops_per_s),
            )
        return DeviceRates(flops_per_s=100e9, bytes_per_s=10e9, seconds_per_op=10e-6)  # a few CPU cores, fp32

    @staticmethod
    def fit(samples: list[tuple[float, float, float, float]], fallback: DeviceRates) -> DeviceRates:
        """Least-squares (non-negative) fit of ``seconds = flops/F + bytes/B + ops*c`` to
        measured ``(seconds, flops, bytes, ops)`` of leaf modules: the device's real balance
        between matmuls, memory-bound ops and per-op overhead. Falls back where the
        samples cannot pin a coefficient down."""
        import numpy as np
        from scipy.optimize import nnls

        rows = [(f, b, n) for t, f, b, n in samples if t > 0]
        if len(rows) < 3:
            return fallback
        a = np.array(rows, dtype=np.float64)
        y = np.array([t for t, *_ in samples if t > 0])
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(a / scale, y)
        coef = coef / scale
        inv = [1.0 / c if c > 0 else None for c in coef[:2]]
        return DeviceRates(
            flops_per_s=float(inv[0] or fallback.flops_per_s),
            bytes_per_s=float(inv[1] or fallback.bytes_per_s),
            seconds_per_op=float(coef[2]),
        )


@dataclass(frozen=True)
class Option:
    """One way to recompute one module."""

    module: str
    mode: str
    """``"full"`` (recompute everything) or ``"selective"`` (keep outputs of ``save_ops``)."""
    save_ops: tuple[str, ...]
    freed_bytes: int
    """Net bytes off the curve from the end of M's forward to the start of its backward."""
    transient_bytes: int
    """Peak bytes M's recompute has alive at once (what it brings back, its temporaries, the
    copies below), on top of what is alive just before M's backward with the option taken."""
    cost_s: float
    """Estimated recompute time (measured module time split by op estimates)."""
    cost_flops: int
    fwd_end: int
    bwd_start: int
    held_bytes: int = 0
    """Inputs the checkpoint keeps that would have died before M's backward: alive through
    the recompute and M's backward (the checkpoint frees them when its last saved
    tensor is unpacked), on top of what the curve shows there."""
    bwd_end: int = 0
    copies: tuple[tuple[int, int], ...] = ()
    """``(until_tick, bytes)``: tensors saved inside M that stay alive anyway (the model's
    output kept by the caller, or saved by an op outside M too) are not freed, yet the
    recompute makes a second copy of each, alive from ``bwd_start`` until the backward of
    the op that saved it (e.g. a block ending in tanh or ReLU, whose output the next
    block also keeps)."""

    pairs: tuple[tuple[str, int, int, int], ...] = ()
    """``(module, start, end, bytes)``: what changes over ``[start, end)`` if ``module`` is
    checkpointed too. A tensor this option frees that is the other module's input without
    being saved there stays alive, kept by the other checkpoint (``+bytes`` from
    ``fwd_end`` until the other's backward ends). A tensor this option makes a copy of
    because the other module saves it dies when the other checkpoint lets its inputs go
    (``-bytes`` from the end of its backward to when it died without either)."""

    repeats: tuple[Option, ...] = ()
    """The same choice at M's other calls, chosen with this one: a pipeline stage calls M once
    per microbatch, and a checkpoint applies to every call (:func:`build_candidates`'s
    ``per_pass``). Each holds that call's ticks and bytes; :attr:`cost_s` and
    :attr:`cost_flops` here are every call's together."""

    @property
    def calls(self) -> tuple[Option, ...]:
        """This option at each call of M: itself, then :attr:`repeats`."""
        return (self, *self.repeats)

    def extra_at(self, tick: int) -> int:
        """Bytes this option adds over the unplanned curve at ``tick`` of M's backward."""
        if not self.bwd_start <= tick < self.bwd_end:
            return 0
        return self.held_bytes + sum(n for until, n in self.copies if tick < until)


@dataclass
class Candidates:
    options: list[Option]
    excluded: dict[str, str]
    """Modules not offered, with the reason."""


_MIN_FREED_FRACTION = 1_000
_SAVED = (Category.ACTIVATION, Category.GRAPH)
"""Blocks autograd keeps for backward: saved tensors and (on CPU) their records."""


def _span_map(ledger: Ledger) -> dict[str, dict[Phase, list[Span]]]:
    out: dict[str, dict[Phase, list[Span]]] = defaultdict(lambda: defaultdict(list))
    for s in ledger.spans:
        out[s.module][s.phase].append(s)
    return out


def _within(name: str, root: str) -> bool:
    return root == "" or name == root or name.startswith(root + ".")


def build_candidates(
    ledger: Ledger,
    forward_time: dict[str, float | None],
    *,
    rates: DeviceRates,
    calls: dict[str, int],
    exclude: dict[str, str] | None = None,
    max_selective: int = 3,
    op_overhead_s: float = 0.0,
    per_pass: bool = False,
) -> Candidates:
    """Options for every module called once in the step, except those in ``exclude``
    (a module name excludes the module; ``"name:selective"`` only its selective options).

    ``per_pass``: the step is several forward and backward passes (a pipeline stage's
    microbatches), which a module called once per pass joins in order: its k-th forward's
    saved tensors are the k-th backward's. Such a module is a candidate too, one option for all
    its calls (:attr:`Option.repeats`), as its checkpoint applies to each.

    ``forward_time`` maps module names to measured forward seconds (``None`` where only
    estimates exist, as on fake tensors). ``op_overhead_s`` is what a Python dispatch mode
    adds per op on this host: selective recompute pays it twice for each forward op (in
    the forward and in the recompute).
    """
    step = _Step.of(ledger, per_pass)
    excluded = dict(exclude or {})
    options: list[Option] = []
    for name, by_phase in step.spans.items():
        if name == "":
            continue  # recomputing the whole model at the start of backward frees nothing
        if name in excluded:
            continue
        # (calls are counted per forward pass: a step of several passes, micro-batches or
        # accumulation, calls a module once in each, which its forward spans count)
        n_calls = max(calls.get(name, 0), len(by_phase.get(Phase.FORWARD, [])))
        if n_calls != 1 and (calls.get(name, 0) > 1 or name not in step.paired):
            excluded[name] = f"called {n_calls} times in a step (memfit plans modules called once)"
            continue
        if name not in step.paired:
            continue  # no gradient flows through it: nothing saved for backward
        regions = [_region(step, name, fwd, bwd) for fwd, bwd in step.paired[name]]
        if regions[0].full_freed <= step.floor:
            continue
        costs = [_cost(step, m, rates, forward_time) for m in regions]
        options.append(_together([_full_option(step, m, cost) for m, cost in zip(regions, costs)]))
        if f"{name}:selective" in excluded:
            continue
        per_call = [_selective_options(step, m, cost, max_selective, op_overhead_s) for m, cost in zip(regions, costs)]
        for first in per_call[0]:
            same = [next((o for o in opts if o.save_ops == first.save_ops), None) for opts in per_call[1:]]
            if all(o is not None for o in same):
                options.append(_together([first, *same]))  # type: ignore[list-item]
    return Candidates(options, excluded)


def _together(calls: list[Option]) -> Option:
    """One option for a module's calls (each call's own, in order): the first, with the
    others as its :attr:`Option.repeats`. Each call's cost already counts every call's ops
    (a region's ops are the module's, over the step), so the first's is the whole cost."""
    return calls[0] if len(calls) == 1 else replace(calls[0], repeats=tuple(calls[1:]))


@dataclass
class _Step:
    """What every module's options read off the step's ledger, computed once."""

    ledger: Ledger
    spans: dict[str, dict[Phase, list[Span]]]
    floor: int
    """An option must free more than this (see :meth:`of`)."""
    op_bytes: list[int]
    born_op: dict[int, int]
    order: list
    """The blocks in birth order, and their birth ticks (:attr:`borns`) to bisect."""
    borns: list[int]
    ops_by_module: dict[str | None, list[int]]
    once: dict[str, tuple[Span, Span]]
    """Modules that could be checkpointed (one forward and one backward call): those spans."""
    consumers: dict[int, list[str]]
    """Block id -> the modules of :attr:`paired` taking it as an input (a checkpoint there would keep it)."""
    per_pass: bool = False
    paired: dict[str, list[tuple[Span, Span]]] = field(default_factory=dict)
    """Modules that could be checkpointed: each call's (forward, backward) spans. One call
    (:attr:`once`), or with ``per_pass`` one a pass (:func:`_per_pass_calls`)."""

    def call_of(self, module: str, block_id: int) -> tuple[Span, Span] | None:
        """The call of ``module`` (in :attr:`paired`) whose forward takes block ``block_id`` in."""
        return next((c for c in self.paired.get(module, ()) if block_id in c[0].inputs), None)

    @classmethod
    def of(cls, ledger: Ledger, per_pass: bool = False) -> _Step:
        spans = _span_map(ledger)
        # An option must free more than a thousandth of the peak: a deep CNN has hundreds of
        # modules whose checkpoint would free a few saved records' worth, which cannot move the
        # peak and swell the MILP (resnet152: 1044 options, 566 under 64 KiB of a 2 GiB peak,
        # P_min solved in 31.7 s; with this floor 319 options, 4.5 s, the same P_min).
        floor = ledger.peak_bytes // _MIN_FREED_FRACTION
        op_bytes, born_op = ledger.op_outputs()
        order = sorted(ledger.blocks, key=lambda b: b.born)
        ops_by_module: dict[str | None, list[int]] = defaultdict(list)
        for i, op in enumerate(ledger.ops):
            ops_by_module[op.module].append(i)
        once = {
            module: (by_phase[Phase.FORWARD][0], by_phase[Phase.BACKWARD][0])
            for module, by_phase in spans.items()
            if module and len(by_phase.get(Phase.FORWARD, [])) == 1 and len(by_phase.get(Phase.BACKWARD, [])) == 1
        }
        paired = {module: [call] for module, call in once.items()}
        if per_pass:
            paired.update(_per_pass_calls(spans, once))
        consumers: dict[int, list[str]] = defaultdict(list)
        for module, calls in paired.items():
            for fwd, _ in calls:
                for i in fwd.inputs:
                    consumers[i].append(module)
        borns = [b.born for b in order]
        return cls(ledger, spans, floor, op_bytes, born_op, order, borns, ops_by_module, once, consumers, per_pass, paired)

    def pairs(self, name: str, fe: int, be: int, freed: list, copied: list) -> tuple[tuple[str, int, int, int], ...]:
        """:attr:`Option.pairs` of an option of ``name`` that frees ``freed`` and copies ``copied``."""
        out: dict[tuple[str, int, int], int] = defaultdict(int)
        for b in freed:
            for other in self.consumers.get(b.id, ()):
                if not _within(other, name) and not _within(name, other):
                    out[(other, fe, self.call_of(other, b.id)[1].end)] += b.nbytes  # type: ignore[index]
        for b in copied:
            outside = [s for s in b.savers if not _within(s, name)]
            if not outside or b.died is None or b.died > be:
                continue  # kept by the caller: no other checkpoint lets it go
            # Every module holding all outside savers whose checkpoint would take b in.
            for other in ancestors(outside[0]):
                if other not in self.paired or _within(name, other) or not all(_within(s, other) for s in outside):
                    continue
                call = self.call_of(other, b.id)
                if call is not None and call[1].end < b.died:
                    bwd = call[1]
                    out[(other, bwd.end, b.died)] -= b.nbytes
        return tuple(sorted((m, a, z, n) for (m, a, z), n in out.items() if n))


def _per_pass_calls(spans: dict[str, dict[Phase, list[Span]]], once: dict[str, tuple[Span, Span]]) -> dict[str, list[tuple[Span, Span]]]:
    """Modules called once a pass over a step of several passes: as many backward calls as
    forward ones, the k-th backward after the k-th forward (a pipeline schedule runs each
    stage's microbatches' backwards in the order of their forwards: GPipe, 1F1B, interleaved)."""
    out = {}
    for module, by_phase in spans.items():
        fwd, bwd = by_phase.get(Phase.FORWARD, []), by_phase.get(Phase.BACKWARD, [])
        if not module or module in once or len(fwd) < 2 or len(fwd) != len(bwd):
            continue
        if all(f.end <= b.start for f, b in zip(fwd, bwd)):
            out[module] = list(zip(fwd, bwd))
    return out


@dataclass
class _Region:
    """Module M's forward region: its ticks, what a checkpoint of it holds, and its blocks by fate."""

    name: str
    fe: int
    bs: int
    be: int
    held: int
    inside: list
    """Blocks born in M's forward."""
    freeable: list
    temps: list
    others: list
    kept_anyway: list
    my_ops: list[int]
    bookkeeping: int
    full_freed: int


def _region(step: _Step, name: str, fwd: Span, bwd: Span) -> _Region:
    ledger = step.ledger
    (fs, fe), (bs, be) = (fwd.start, fwd.end), (bwd.start, bwd.end)
    # The checkpoint keeps the call's inputs for the recompute: those that would have
    # died before M's backward now live until it.
    held = sum(ledger.blocks[i].nbytes for i in fwd.inputs if ledger.blocks[i].died is not None and ledger.blocks[i].died < bs)
    inside = step.order[bisect_left(step.borns, fs) : bisect_left(step.borns, fe)]  # born in M's forward
    freeable, temps, others, kept_anyway = [], [], [], []
    for b in inside:
        if b.died is not None and fe <= b.died < bs:
            others.append(b)  # e.g. M's output, freed after use: kept longer if SAC caches it
        if b.died is not None and b.died < fe:
            temps.append(b)
        elif b.category not in _SAVED or not any(_within(s, name) for s in b.savers):
            continue
        elif all(_within(s, name) for s in b.savers) and b.died is not None and bs <= b.died <= be:
            freeable.append(b)
        elif b.died is None or b.died >= bs:
            kept_anyway.append(b)
    my_ops = [i for m, ids in step.ops_by_module.items() if m is not None and _within(m, name) for i in ids]
    # On CPU the checkpoint frees the region's saved records (graph blocks with savers)
    # but keeps its own bookkeeping per autograd node (graph blocks without): a region
    # of tiny ops can cost more than it frees.
    nodes = sum(1 for b in inside if b.category is Category.GRAPH and not b.savers)
    bookkeeping = CHECKPOINT_BYTES_PER_NODE * nodes
    full_freed = sum(b.nbytes for b in freeable) - held - bookkeeping
    return _Region(name, fe, bs, be, held, inside, freeable, temps, others, kept_anyway, my_ops, bookkeeping, full_freed)


@dataclass
class _Cost:
    """What recomputing M's ops costs: each op's estimated seconds, scaled to M's measured forward time."""

    est: dict[int, float]
    total_est: float
    scale: float
    flops_total: int
    copy_until: dict[int, int]


def _cost(step: _Step, m: _Region, rates: DeviceRates, forward_time: dict[str, float | None]) -> _Cost:
    ops = step.ledger.ops
    fifo = step.paired if step.per_pass else {}
    copy_until = {b.id: _saved_until(b, m.name, step.spans, m.be, fifo) for b in m.kept_anyway}
    # Estimated seconds per forward op call of M, scaled to M's measured forward time.
    est = {i: rates.estimate(ops[i].flops, step.op_bytes[i]) for i in m.my_ops}
    total_est = sum(est.values()) or 1e-12
    measured = forward_time.get(m.name)
    scale = (measured / total_est) if measured else 1.0
    return _Cost(est, total_est, scale, sum(ops[i].flops for i in m.my_ops), copy_until)


def _full_option(step: _Step, m: _Region, cost: _Cost) -> Option:
    copies = tuple(sorted((cost.copy_until[b.id], b.nbytes) for b in m.kept_anyway))
    transient = _recompute_peak(m.inside, m.freeable + m.kept_anyway)
    return Option(
        m.name,
        "full",
        (),
        m.full_freed,
        transient,
        cost.total_est * cost.scale,
        cost.flops_total,
        m.fe,
        m.bs,
        m.held,
        m.be,
        copies,
        step.pairs(m.name, m.fe, m.be, m.freeable, m.kept_anyway),
    )


def _selective_options(step: _Step, m: _Region, cost: _Cost, max_selective: int, op_overhead_s: float) -> list[Option]:
    """Selective: keep the outputs of the op types with the most compute per byte kept."""
    ops, born_op = step.ledger.ops, step.born_op
    by_type: dict[str, list[int]] = defaultdict(list)
    for i in m.my_ops:
        if step.op_bytes[i]:
            by_type[ops[i].op].append(i)
    # SAC refuses to keep an output that is later written in place.
    unkeepable = {ops[born_op[b.id]].op for b in m.inside if b.mutated and b.id in born_op}
    if len(by_type) < 2:
        return []
    blocks = m.freeable + m.temps + m.others + m.kept_anyway
    op_of_block = {b.id: ops[born_op[b.id]].op for b in blocks if b.id in born_op}
    kept = {k: sum(b.nbytes for b in m.freeable + m.temps if op_of_block.get(b.id) == k) for k in by_type}
    density = {k: sum(cost.est[i] for i in ids) / max(1, kept[k]) for k, ids in by_type.items()}
    ranked = sorted((k for k in by_type if k not in unkeepable), key=lambda k: -density[k])
    options = []
    for k in range(1, min(max_selective, len(by_type) - 1, len(ranked)) + 1):
        save = tuple(sorted(ranked[:k]))
        freed = sum(b.nbytes for b in m.freeable if op_of_block.get(b.id) not in save)
        # SAC caches every output of a saved op until the recompute, even ones that
        # autograd did not save and that would have been freed sooner.
        # (With early stopping the recompute may never reach those ops, so the cache
        # lives until the checkpoint is released at the end of M's backward.)
        cached = sum(b.nbytes for b in m.temps + m.others if op_of_block.get(b.id) in save)
        extra = cached + m.held + m.bookkeeping
        if freed - extra <= step.floor:
            continue
        saved_est = sum(cost.est[i] for t in save for i in by_type[t])
        saved_flops = sum(ops[i].flops for t in save for i in by_type[t])
        recomputed = [b for b in m.freeable if op_of_block.get(b.id) not in save]
        copied = [b for b in m.kept_anyway if op_of_block.get(b.id) not in save]
        options.append(
            Option(
                m.name,
                "selective",
                save,
                freed - extra,
                _recompute_peak([b for b in m.inside if op_of_block.get(b.id) not in save], m.freeable + m.kept_anyway),
                (cost.total_est - saved_est) * cost.scale + 2 * len(m.my_ops) * op_overhead_s,
                cost.flops_total - saved_flops,
                m.fe,
                m.bs,
                m.held + cached,
                m.be,
                # SAC hands back its cached output instead of a copy
                tuple(sorted((cost.copy_until[b.id], b.nbytes) for b in copied)),
                step.pairs(m.name, m.fe, m.be, recomputed, copied),
            )
        )
    return options


def _saved_until(
    block, name: str, spans: dict[str, dict[Phase, list[Span]]], be: int, fifo: dict[str, list[tuple[Span, Span]]] | None = None
) -> int:
    """When the recomputed copy of ``block`` dies: after the backward of the modules inside
    ``name`` that saved it (the checkpoint hands each recomputed tensor to its op once).
    For a module called several times (one ReLU module used three times in a block), the
    backward of the call that saved it: backward runs the calls in reverse order, but for a
    module of ``fifo`` (called once a pass: its calls' spans in order, each pass its own)."""
    ends = []
    for s in block.savers:
        if not _within(s, name):
            continue
        if s == name:  # an op of M itself: its backward may come last
            ends.append(be)
            continue
        fwd, bwd = spans.get(s, {}).get(Phase.FORWARD, []), spans.get(s, {}).get(Phase.BACKWARD, [])
        call = next((k for k, f in enumerate(fwd) if f.start <= block.born < f.end), None)
        if fifo and s in fifo and call is not None:
            ends.append(fifo[s][call][1].end)
            continue
        ends.append(bwd[len(bwd) - 1 - call].end if call is not None and len(fwd) == len(bwd) else be)
    return min(max(ends, default=be), be)


def _recompute_peak(again: list, saved: list) -> int:
    """Peak bytes alive at once while M's forward is replayed in its backward.

    The replay allocates the blocks of ``again`` (those M's forward allocated, in birth
    order, less SAC's cached outputs) and frees its temporaries as the forward did. The
    non-reentrant checkpoint stops the replay once the last tensor saved for backward is
    back (the last of ``saved``, even one SAC hands back from its cache: the replay runs up
    to that op), so later ops do not run."""
    stop = max((b.born for b in saved), default=None)
    if stop is None:
        return 0
    delta: dict[int, int] = defaultdict(int)
    for b in again:
        if b.born <= stop:
            delta[b.born] += b.nbytes
            if b.died is not None and b.died <= stop:
                delta[b.died] -= b.nbytes
    live = peak = 0
    for t in sorted(delta):
        live += delta[t]
        peak = max(peak, live)
    return peak


def pooled_times(ledger: Ledger, forward_time: dict[str, float | None]) -> tuple[dict[str, float | None], float]:
    """Forward times with the repeats of a block pooled, and how much the repeats disagreed.

    Modules that run the same ops, in the same order, with the same FLOPs, output bytes
    and sub-module layout (the layers of a transformer) all get the median of their
    measured times. One timed step measures each block once, and on a shared CPU one
    block's time moves by 30% or more from step to step (ViT-S/16's twelve identical layers:
    39 to 62 ms in one step). Planned on raw times, which of two identical blocks is
    "cheaper" is noise: plans change from run to run. The median of a dozen is steady.

    The second value is the spread of the largest group of repeats, ``(max - min) /
    median`` of their times (0 without repeats): identical work that took different time
    measures the host's noise."""
    import statistics

    if not any(forward_time.values()):
        # no times to pool (fake tensors): every group below would be passed over, and the
        # signatures are most of the work (a rank of Llama-3-8B: 39,000 ops, each under its ancestors)
        return dict(forward_time), 0.0
    op_bytes, _ = ledger.op_outputs()
    signature: dict[str, list[tuple[str, str, int, int]]] = defaultdict(list)
    for i, op in enumerate(ledger.ops):
        if op.module is None:
            continue
        for outer in ancestors(op.module):
            if outer:
                signature[outer].append((op.module[len(outer) :], op.op, op.flops, op_bytes[i]))
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, ops in signature.items():
        groups[tuple(ops)].append(name)
    out = dict(forward_time)
    spread, weight = 0.0, 0.0
    for names in groups.values():
        times = [t for n in names if (t := forward_time.get(n))]
        if len(names) < 2 or not times:
            continue
        median = statistics.median(times)
        for n in names:
            if n in out:
                out[n] = median
        # The repeats doing the most work say most about the host (a tiny module's time
        # is mostly the clock's own overhead).
        if len(times) >= 3 and median * len(times) > weight:
            spread, weight = (max(times) - min(times)) / median, median * len(times)
    return out, spread


def leaf_samples(ledger: Ledger, forward_time: dict[str, float | None]) -> list[tuple[float, float, float, float]]:
    """``(seconds, flops, output bytes, ops)`` of each timed module whose ops all run in
    it directly (no child module ran an op): the data :meth:`DeviceRates.fit` fits."""
    op_bytes, _ = ledger.op_outputs()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for i, op in enumerate(ledger.ops):
        if op.module is not None:
            acc = per[op.module]
            acc[0] += op.flops
            acc[1] += op_bytes[i]
            acc[2] += 1
    parents = {m.rpartition(".")[0] for m in per if m}
    return [(forward_time[m], f, b, n) for m, (f, b, n) in per.items() if m not in parents and forward_time.get(m)]
