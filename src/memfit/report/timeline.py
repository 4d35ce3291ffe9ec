"""Pictures of where the memory goes: a step's memory over its ticks, stacked by category.

A :class:`Timeline` holds one or more :class:`Track` s (a profile's ledger; for a plan, the
step before and after), each aggregated to at most a few thousand columns so a 100k-tick
ledger draws in seconds. Aggregation keeps, for each column, the tick of highest memory in
it (with its breakdown), so the curve's envelope and the peak are exact; only dips shorter
than a column are hidden. :func:`timeline_png` draws it with matplotlib;
:func:`timeline_html` writes one self-contained page (inline canvas and script, nothing
fetched at view time) with hover on blocks, the largest blocks at the peak, and for a plan
the candidates' bytes freed against recompute cost.
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import io
import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from memfit.cuda.allocator import AllocatorSettings
from memfit.cuda.snapshot import TraceTimeline
from memfit.levers.recipe import Recipe
from memfit.measure.ledger import START_TICK, Category, Ledger, Phase
from memfit.measure.profile import Profile
from memfit.measure.replay import ledger_series
from memfit.plan.candidates import Option
from memfit.plan.result import Plan
from memfit.report.chart import wrap_title
from memfit.units import format_bytes

__all__ = [
    "Track",
    "Candidate",
    "Timeline",
    "build_track",
    "timeline_png",
    "timeline_html",
    "profile_timeline",
    "plan_timeline",
    "trace_track",
    "snapshot_timeline",
    "Layer",
    "recipe_timeline",
    "COLUMNS",
]

COLUMNS = 1600
"""Columns a track is aggregated to: more than a chart has pixels across."""
_HOVER_BLOCKS = 4000
"""Blocks a page lists per track for hover (the largest; smaller ones are under a pixel high)."""
_TABLE_ROWS = 15

# Persistent state at the bottom, what the step creates above it, transients on top.
_ORDER = (
    Category.PARAMETER,
    Category.BUFFER,
    Category.OPTIMIZER,
    Category.DDP_BUCKET,
    Category.PIPELINE,
    Category.GRADIENT,
    Category.INPUT,
    Category.OTHER,
    Category.UNSHARDED,
    Category.ALL_GATHER,
    Category.REDUCE_SCATTER,
    Category.ACTIVATION,
    Category.GRAPH,
    Category.TEMPORARY,
    Category.WORKSPACE,
)
COLORS = {
    Category.PARAMETER: "#4e79a7",
    Category.BUFFER: "#a0cbe8",
    Category.OPTIMIZER: "#f1ce63",
    Category.GRADIENT: "#f28e2b",
    Category.INPUT: "#8cd17d",
    Category.OTHER: "#bab0ac",
    Category.ACTIVATION: "#e15759",
    Category.GRAPH: "#ff9da7",
    Category.TEMPORARY: "#b07aa1",
    Category.WORKSPACE: "#9d7660",
    Category.UNSHARDED: "#76b7b2",
    Category.ALL_GATHER: "#59a14f",
    Category.REDUCE_SCATTER: "#edc948",
    Category.DDP_BUCKET: "#d4a6c8",
    Category.PIPELINE: "#a6c8d4",
}
_LINE_STYLES = {"allocated": ("#222222", (0, ())), "reserved": ("#6a3d9a", (0, (5, 2)))}
"""Colour and dash of the CUDA lines, by the first word of their name."""


@dataclass(frozen=True)
class Layer:
    """A stacked layer that is not a ledger category (a GPU trace's blocks)."""

    value: str
    color: str


def _color(c: Category | Layer) -> str:
    return c.color if isinstance(c, Layer) else COLORS[c]


def _line_style(name: str) -> tuple[str, tuple]:
    return _LINE_STYLES.get(name.split()[0], ("#222222", (0, ())))


_PHASE_COLORS = {Phase.FORWARD: "#4e79a7", Phase.BACKWARD: "#f28e2b", Phase.OPTIMIZER: "#59a14f"}
_RECOMPUTE_COLOR = "#d62728"


@dataclass
class Track:
    """One ledger, aggregated for drawing. Ticks index the ledger's timeline."""

    label: str
    ticks: int
    edges: list[int]
    """Column ``i`` covers ticks ``[edges[i], edges[i+1])``."""
    rep: list[int]
    """The tick drawn for each column: the one of highest memory in it (first if tied)."""
    categories: list[Category | Layer]
    """Categories present (bottom to top)."""
    stack: list[list[int]]
    """``stack[c][i]``: bytes of ``categories[c]`` alive right after tick ``rep[i]``."""
    start_bytes: int
    peak_tick: int
    peak_bytes: int
    peak_op: str
    peak_module: str | None
    phases: list[tuple[int, int, Phase]]
    """Runs of ticks in one phase, ``[start, end)``."""
    lane: list[tuple[int, int, str, Phase]]
    """Module spans drawn along the axis (the repeated blocks, else the root's children)."""
    recompute: list[tuple[int, int, str]]
    """Runs of recompute ticks in backward, with the checkpointed module they belong to."""
    col_context: list[tuple[Phase, str | None, str]]
    """Phase, module and op of each column's tick."""
    blocks: list[tuple[int, int, int, Category, str | None, str, Phase, str, Phase | None]] = field(default_factory=list)
    """For hover: ``(born, died, bytes, category, module, op at birth, phase at birth, op at
    free, phase at free)``; ``born`` is -1 before the step, ``died`` is ``ticks`` if never freed."""
    at_peak: list[tuple[int, Category | Layer, str | None, str, str]] = field(default_factory=list)
    """Largest blocks alive at the peak: ``(bytes, category, module, born, freed)`` (born and
    freed as words)."""
    lines: list[tuple[str, list[int]]] = field(default_factory=list)
    """Series drawn as lines over the stack, per column (the highest of its ticks): on CUDA,
    ``allocated`` and ``reserved``."""
    line_peaks: list[tuple[str, int]] = field(default_factory=list)
    kind: str = "step"
    """``"step"``: a ledger's ticks; ``"trace"``: a GPU trace's events (``module`` holds a
    block's frames, and the lane shows segments made and released instead of module spans)."""
    marks: list[tuple[int, int, int]] = field(default_factory=list)
    """For a trace: ``(event, bytes, +1 segment made / -1 released)``."""
    segments_at_peak: list[tuple[int, int, str]] = field(default_factory=list)
    """For a trace: the largest segments held at the peak, ``(bytes, allocated in it, what)``."""

    @property
    def total(self) -> list[int]:
        return [sum(col) for col in zip(*self.stack)] if self.stack else []


@dataclass(frozen=True)
class Candidate:
    """One recompute option for the scatter: what it frees and what it costs."""

    module: str
    mode: str
    freed_bytes: int
    cost_s: float
    cost_flops: int
    chosen: bool


@dataclass
class Timeline:
    """What the chart and the page show."""

    title: str
    tracks: list[Track]
    notes: list[str] = field(default_factory=list)
    """Where each track's numbers come from (device, command, what was applied)."""
    budget_bytes: int | None = None
    candidates: list[Candidate] = field(default_factory=list)


def _where(module: str | None) -> str:
    return "(outside any module)" if module is None else (module or "(root)")


def _lane_modules(ledger: Ledger) -> set[str]:
    """The repeated blocks (``...h.0``, ``...h.1``: the shallowest names ending in an index),
    else the root's children: the level at which a step reads as a sequence."""
    names = {s.module for s in ledger.spans}
    indexed = [n for n in names if n and n.rpartition(".")[2].isdigit()]
    if indexed:
        depth = min(n.count(".") for n in indexed)
        return {n for n in indexed if n.count(".") == depth}
    return {n for n in names if n and "." not in n}


def _runs(values: Sequence, start: int = 0) -> list[tuple[int, int, object]]:
    out: list[tuple[int, int, object]] = []
    for i, v in enumerate(values, start):
        if out and out[-1][2] == v and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1, v)
        else:
            out.append((i, i + 1, v))
    return out


def _stacked(size: np.ndarray, layer: np.ndarray, born: np.ndarray, died: np.ndarray, n: int, k: int):
    """``(curves, base)``: bytes of each of ``k`` layers right after each of ``n`` ticks, and
    before the first (blocks born at ``START_TICK``); ``died`` is ``n`` for never freed."""
    # np.add.at, not bincount: bincount's float weights would round bytes above 2**53
    delta = np.zeros((k, n + 1), np.int64)
    grown = born != START_TICK
    np.add.at(delta, (layer[grown], born[grown]), size[grown])
    np.add.at(delta, (layer, died), -size)
    base = np.zeros(k, np.int64)
    np.add.at(base, layer[~grown], size[~grown])
    return base[:, None] + np.cumsum(delta[:, :n], axis=1), base


def _columns(total: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """``(edges, rep)``: at most ``columns`` columns over the ticks, each drawn at its highest tick."""
    n = len(total)
    if n <= columns:
        return np.arange(n + 1), np.arange(n)
    edges = np.linspace(0, n, columns + 1).round().astype(np.int64)
    col = np.searchsorted(edges, np.arange(n), side="right") - 1
    order = np.lexsort((np.arange(n), -total, col))  # by column, highest first, earliest of ties
    first = np.ones(n, bool)
    first[1:] = col[order][1:] != col[order][:-1]
    return edges, order[first]


def _envelope(series: Sequence[int], edges: Sequence[int]) -> list[int]:
    """The highest value of ``series`` in each column: a line's peak stays exact."""
    v = np.asarray(series, np.int64)
    if not len(v):
        return []
    return [int(x) for x in np.maximum.reduceat(v, np.asarray(edges[:-1], np.int64))]


def build_track(
    ledger: Ledger,
    label: str,
    *,
    columns: int = COLUMNS,
    checkpointed: Sequence[str] = (),
    lines: Sequence[tuple[str, Sequence[int], int]] = (),
) -> Track:
    """``ledger`` aggregated to at most ``columns`` columns, its peak exact.

    ``checkpointed``: the modules a plan recomputes, to name each run of recompute ticks by
    its module (else the innermost module running is named). ``lines``: ``(name, one value
    per tick, peak)`` drawn over the stack (each column its highest value)."""
    n = len(ledger.ticks)
    cat_index = {c: i for i, c in enumerate(_ORDER)}
    nb = len(ledger.blocks)
    size = np.fromiter((b.nbytes for b in ledger.blocks), np.int64, nb)
    cat = np.fromiter((cat_index[b.category] for b in ledger.blocks), np.int64, nb)
    born = np.fromiter((b.born for b in ledger.blocks), np.int64, nb)
    died = np.fromiter((n if b.died is None else b.died for b in ledger.blocks), np.int64, nb)
    k = len(_ORDER)
    curves, base = _stacked(size, cat, born, died, n, k)
    total = curves.sum(axis=0)
    edges, rep = _columns(total, columns)

    present = [i for i in range(k) if curves[i].any() or base[i]]
    start_bytes = int(base.sum())
    peak_bytes = max(start_bytes, int(total.max()) if n else 0)
    peak_tick = int(np.argmax(total)) if n and int(total.max()) > start_bytes else START_TICK
    pt = ledger.ticks[peak_tick] if peak_tick != START_TICK else None

    ticks = ledger.ticks
    phases = [(a, b, p) for a, b, p in _runs([t.phase for t in ticks])]
    lane_names = _lane_modules(ledger)
    lane = sorted((s.start, s.end, s.module, s.phase) for s in ledger.spans if s.module in lane_names and s.end > s.start)
    recompute = _recompute_runs(ledger, checkpointed)
    at_peak = _at_peak(ledger, peak_tick)
    hover = _hover(ledger, peak_bytes)
    return Track(
        label=label,
        ticks=n,
        edges=[int(e) for e in edges],
        rep=[int(r) for r in rep],
        categories=[_ORDER[i] for i in present],
        stack=[[int(v) for v in curves[i, rep]] for i in present],
        start_bytes=start_bytes,
        peak_tick=peak_tick,
        peak_bytes=peak_bytes,
        peak_op=pt.op if pt else "",
        peak_module=pt.module if pt else None,
        phases=phases,
        lane=lane,
        recompute=recompute,
        col_context=[(ticks[r].phase, ticks[r].module, ticks[r].op) for r in rep],
        blocks=hover,
        at_peak=at_peak,
        lines=[(name, _envelope(v, edges)) for name, v, _ in lines],
        line_peaks=[(name, peak) for name, _, peak in lines],
    )


def _recompute_runs(ledger: Ledger, checkpointed: Sequence[str]) -> list[tuple[int, int, str]]:
    """The runs of recompute ticks, each named by the checkpointed module it belongs to (else the innermost module running)."""
    ticks = ledger.ticks
    recompute: list[tuple[int, int, str]] = []
    chosen = sorted(checkpointed, key=len, reverse=True)
    for a, b, flag in _runs([t.recompute for t in ticks]):
        if not flag:
            continue
        inner = ticks[a].module or ""
        owner = next((c for c in chosen if inner == c or inner.startswith(c + ".") or c == ""), inner)
        if recompute and recompute[-1][2] == owner and recompute[-1][1] >= a - 2:
            recompute[-1] = (recompute[-1][0], b, owner)  # a free or two between a module's recompute ops
        else:
            recompute.append((a, b, owner))
    return recompute


def _tick_words(ledger: Ledger, tick: int, end: bool) -> str:
    """When a block was born (or died, ``end``), in words."""
    if tick == START_TICK:
        return "before the step"
    if end and tick >= len(ledger.ticks):
        return "outlives the step"
    t = ledger.ticks[tick]
    return f"tick {tick} ({t.phase.value}, {t.op})"


def _at_peak(ledger: Ledger, peak_tick: int) -> list[tuple]:
    """The largest blocks alive at the peak, for the page's table."""
    n = len(ledger.ticks)
    alive = [b for b in ledger.blocks if b.alive_at(peak_tick)] if n else list(ledger.blocks)
    alive.sort(key=lambda b: -b.nbytes)
    born = [_tick_words(ledger, b.born, False) for b in alive[:_TABLE_ROWS]]
    died = [_tick_words(ledger, b.died if b.died is not None else n, True) for b in alive[:_TABLE_ROWS]]
    return [(b.nbytes, b.category, b.module, w, d) for b, w, d in zip(alive[:_TABLE_ROWS], born, died)]


def _hover(ledger: Ledger, peak_bytes: int) -> list[tuple]:
    """The blocks the page shows on hover, in birth order."""
    ticks, n = ledger.ticks, len(ledger.ticks)
    # Blocks under a pixel high at the chart's scale cannot be pointed at: left out of hover.
    floor = peak_bytes / 1500
    big = [b for b in ledger.blocks if b.nbytes >= floor]
    big.sort(key=lambda b: -b.nbytes)
    hover = []
    for b in sorted(big[:_HOVER_BLOCKS], key=lambda b: (b.born, b.id)):
        bt = ticks[b.born] if 0 <= b.born < n else None
        dt = ticks[b.died] if b.died is not None and b.died < n else None
        hover.append(
            (
                b.born,
                n if b.died is None else b.died,
                b.nbytes,
                b.category,
                b.module,
                bt.op if bt else "",
                bt.phase if bt else Phase.START,
                dt.op if dt else "",
                dt.phase if dt else None,
            )
        )
    return hover


_DUMPED = "the dumped state (no trace)"
_TRACE_LAYERS = (Layer("alive when the trace began", "#4e79a7"), Layer("allocated during the trace", "#e15759"))


def _frames_text(frames: Sequence[str]) -> str:
    return "\n".join(frames) if frames else "(no Python frames recorded)"


def trace_track(tt: TraceTimeline, label: str, *, columns: int = COLUMNS) -> Track:
    """A GPU trace re-lived (:func:`memfit.cuda.snapshot.trace_timeline`) aggregated like a
    ledger: its blocks stacked (those alive when the trace began at the bottom), reserved as a
    line, the allocated peak exact, the segments made and released along the axis. Without a
    trace, the dumped state is drawn as one column."""
    actions, reserved = tt.actions, tt.reserved
    if not actions:
        actions, reserved = [_DUMPED], [tt.start_reserved_bytes]
    n = len(actions)
    nb = len(tt.blocks)
    size = np.fromiter((b.size for b in tt.blocks), np.int64, nb)
    born = np.fromiter((START_TICK if b.born < 0 else b.born for b in tt.blocks), np.int64, nb)
    died = np.fromiter((n if b.died is None else b.died for b in tt.blocks), np.int64, nb)
    layer = (born != START_TICK).astype(np.int64)
    curves, base = _stacked(size, layer, born, died, n, 2)
    total = curves.sum(axis=0)
    edges, rep = _columns(total, columns)
    present = [i for i in range(2) if curves[i].any() or base[i]]
    start_bytes = int(base.sum())
    peak_tick = int(np.argmax(total)) if n and int(total.max()) > start_bytes else START_TICK
    peak_bytes = start_bytes if peak_tick == START_TICK else int(total[peak_tick])

    at_peak_blocks = sorted((b for b in tt.blocks if _trace_alive(b.born, b.died, peak_tick)), key=lambda b: -b.size)
    at_peak = _trace_at_peak(at_peak_blocks, n)
    seg_rows = _segments_at_peak(tt, at_peak_blocks, peak_tick)
    hover = _trace_hover(tt, peak_bytes, n)
    marks = [(g.born, g.size, 1) for g in tt.segments if g.born >= 0] + [
        (g.died, g.size, -1) for g in tt.segments if g.died is not None
    ]
    return Track(
        label=label,
        ticks=n,
        edges=[int(e) for e in edges],
        rep=[int(r) for r in rep],
        categories=[_TRACE_LAYERS[i] for i in present],
        stack=[[int(v) for v in curves[i, rep]] for i in present],
        start_bytes=start_bytes,
        peak_tick=peak_tick,
        peak_bytes=peak_bytes,
        peak_op=actions[peak_tick] if peak_tick != START_TICK else actions[0] if not tt.actions else "",
        # the largest block at the peak that says where it was made (those alive at the start often do not)
        peak_module=next((_frames_text(b.frames) for b in at_peak_blocks if b.frames), None),
        phases=[],
        lane=[],
        recompute=[],
        col_context=[(Phase.START, None, actions[r]) for r in rep],
        blocks=hover,
        at_peak=at_peak,
        lines=[("reserved", _envelope(reserved, edges))],
        line_peaks=[("reserved", max([tt.start_reserved_bytes, *reserved]))],
        kind="trace",
        marks=sorted(marks),
        segments_at_peak=seg_rows,
    )


def _trace_words(event: int | None) -> str:
    """When a trace's block was born or died, in words."""
    if event is None:
        return "alive at the dump"
    return "before the trace" if event < 0 else f"event {event}"


def _trace_alive(b_born: int, b_died: int | None, at: int) -> bool:
    """Whether a block (or segment) of a trace is alive at event ``at`` (:data:`START_TICK`: when the trace began)."""
    return (b_born < 0 or b_born <= at) and (b_died is None or b_died > at) if at >= 0 else b_born < 0


def _trace_at_peak(at_peak_blocks: list, n: int) -> list[tuple]:
    """The page's table of the blocks at the peak, largest first."""
    # blocks of one size from one place (a layer's activations, repeated) are one row
    groups: dict[tuple, list] = {}
    for b in at_peak_blocks:
        groups.setdefault((b.size, b.born >= 0, b.frames), []).append(b)
    at_peak = []
    for (size, during, frames), bs in sorted(groups.items(), key=lambda kv: -kv[0][0] * len(kv[1]))[:_TABLE_ROWS]:
        if len(bs) == 1:
            born_w, died_w = _trace_words(bs[0].born), _trace_words(bs[0].died)
        else:
            bw = sorted(_trace_words(b.born) for b in bs)
            dw = {_trace_words(b.died) for b in bs}
            ends = [n if b.died is None else b.died for b in bs]
            born_w = f"{len(bs)} blocks of {format_bytes(size)}: " + (
                bw[0] if len(set(bw)) == 1 else f"events {min(b.born for b in bs)}..{max(b.born for b in bs)}"
            )
            died_w = dw.pop() if len(dw) == 1 else f"events {min(ends)}..{max(ends)}"
        at_peak.append((size * len(bs), _TRACE_LAYERS[during], _frames_text(frames), born_w, died_w))
    return at_peak


def _segments_at_peak(tt: TraceTimeline, at_peak_blocks: list, peak_tick: int) -> list[tuple[int, int, str]]:
    """The largest segments at the peak: their size, the bytes of blocks in them, and what kind they are."""
    segs = sorted((g for g in tt.segments if _trace_alive(g.born, g.died, peak_tick)), key=lambda g: -g.size)
    starts = sorted((b.address, b.size) for b in at_peak_blocks)
    addrs = [a for a, _ in starts]
    seg_rows = []
    for g in segs[:_TABLE_ROWS]:
        lo, hi = bisect_left(addrs, g.address), bisect_left(addrs, g.address + g.size)
        kind = ("small pool" if g.small else "large pool") + (", expandable" if g.expandable else "")
        made = "before the trace" if g.born < 0 else f"made at event {g.born}"
        seg_rows.append((g.size, sum(sz for _, sz in starts[lo:hi]), f"{kind}, {made}, at {g.address:#x}"))
    return seg_rows


def _trace_hover(tt: TraceTimeline, peak_bytes: int, n: int) -> list[tuple]:
    """The blocks the page shows on hover (those at least a pixel high), in birth order."""
    floor = peak_bytes / 1500
    big = sorted((b for b in tt.blocks if b.size >= floor), key=lambda b: -b.size)[:_HOVER_BLOCKS]
    return [
        (
            START_TICK if b.born < 0 else b.born,
            n if b.died is None else b.died,
            b.size,
            _TRACE_LAYERS[b.born >= 0],
            _frames_text(b.frames),
            "",
            Phase.START,
            "",
            None if b.died is None else Phase.START,
        )
        for b in sorted(big, key=lambda b: (b.born, b.address))
    ]


def _peak_words(t: Track) -> str:
    lines = "".join(f"; {name} peak {format_bytes(b)}" for name, b in t.line_peaks)
    if t.kind == "trace":
        if t.peak_op == _DUMPED:
            return f"allocated {format_bytes(t.peak_bytes)} in {_DUMPED}{lines.replace(' peak', '')}"
        if t.peak_tick == START_TICK:
            return f"allocated peak {format_bytes(t.peak_bytes)} when the trace began{lines}"
        words = f"allocated peak {format_bytes(t.peak_bytes)} at event {t.peak_tick}{lines}"
        if t.peak_module:
            first = "/".join(t.peak_module.split("\n")[0].split("/")[-2:])  # the file and its folder: one line
            first = first if len(first) <= 60 else first[:59] + "…"
            words += f"; largest block then with frames from {first}"
        return words
    return _step_peak_words(t) + lines


def _step_peak_words(t: Track) -> str:
    if t.peak_tick == START_TICK:
        return f"peak {format_bytes(t.peak_bytes)} before the step"
    return f"peak {format_bytes(t.peak_bytes)} at tick {t.peak_tick}: {t.peak_op} in {_where(t.peak_module)}"


# -- PNG ------------------------------------------------------------------------------------


def _top(tl: Timeline) -> int:
    """The highest value any track draws (stack, lines) or the budget."""
    return max([t.peak_bytes for t in tl.tracks] + [b for t in tl.tracks for _, b in t.line_peaks] + [tl.budget_bytes or 0])


def timeline_png(tl: Timeline, *, dpi: int = 100) -> bytes:
    """The timeline as a PNG: one stacked panel per track (same y scale), phases shaded, the
    peak marked, CUDA's allocated and reserved as lines, module spans and recomputes (a
    trace: segments made and released) in a lane under each panel."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(tl, dpi=dpi)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


_WIDTH_IN = 11.0


def timeline_figure(tl: Timeline, *, dpi: int = 100):  # -> matplotlib Figure
    """:func:`timeline_png`'s figure, before it is saved (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = len(tl.tracks)
    fig = plt.figure(figsize=(_WIDTH_IN, 3.3 * rows + 0.9), dpi=dpi, layout="constrained")
    subs = fig.subfigures(rows, 1) if rows > 1 else [fig]
    axes = [ax for sub in subs for ax in sub.subplots(2, 1, gridspec_kw={"height_ratios": (5, 1), "hspace": 0.02})]
    top = _top(tl) * 1.12 or 1
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    shown: dict[Category | Layer, None] = {}
    line_names: dict[str, None] = {}
    for r, t in enumerate(tl.tracks):
        ax, lane = axes[2 * r], axes[2 * r + 1]
        # steps as a polygon per category (each column flat over its ticks); fill_between
        # is much faster than stairs on thousands of columns
        xs = np.repeat(np.array(t.edges, dtype=float), 2)[1:-1]
        bottom = np.zeros(len(t.rep))
        for c, values in zip(t.categories, t.stack):
            v = np.array(values, dtype=float) / scale
            ax.fill_between(xs, np.repeat(bottom, 2), np.repeat(bottom + v, 2), color=_color(c), linewidth=0)
            bottom += v
            shown[c] = None
        for name, values in t.lines:
            color, dash = _line_style(name)
            ax.plot(xs, np.repeat(np.array(values, dtype=float) / scale, 2), color=color, linestyle=dash, linewidth=1.1)
            line_names[name] = None
        for p, col in _PHASE_COLORS.items():
            ax.broken_barh(
                [(a, b - a) for a, b, q in t.phases if q is p],
                (0, 1),
                transform=ax.get_xaxis_transform(),
                facecolor=col,
                alpha=0.07,
            )
        ax.broken_barh(
            [(a, b - a) for a, b, _ in t.recompute],
            (0, 1),
            transform=ax.get_xaxis_transform(),
            facecolor=_RECOMPUTE_COLOR,
            alpha=0.18,
        )
        if t.peak_tick != START_TICK:
            ax.axvline(t.peak_tick + 0.5, color="black", linewidth=0.8, linestyle=":")
            ax.plot([t.peak_tick + 0.5], [t.peak_bytes / scale], "v", color="black", markersize=6)
        ax.set_title(wrap_title(f"{t.label}: {_peak_words(t)}", 9, _WIDTH_IN), fontsize=9, loc="left")
        if tl.budget_bytes:
            ax.axhline(tl.budget_bytes / scale, color=_RECOMPUTE_COLOR, linewidth=0.9, linestyle="--")
            ax.text(t.ticks, tl.budget_bytes / scale, " budget", color=_RECOMPUTE_COLOR, fontsize=7, va="center")
        ax.set_xlim(0, max(1, t.ticks))
        ax.set_ylim(0, top / scale)
        ax.set_ylabel(unit)
        ax.tick_params(labelbottom=False, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        if t.kind == "trace":
            _trace_lane(lane, t)
        else:
            _step_lane(lane, t)
        lane.set_xlim(0, max(1, t.ticks))
        lane.set_ylim(0, 2)
        lane.tick_params(labelsize=8)
    handles = [Patch(color=_color(c), label=c.value) for c in [*_ORDER, *_TRACE_LAYERS] if c in shown]
    handles += [Line2D([], [], color=_line_style(n)[0], linestyle=_line_style(n)[1], label=n) for n in line_names]
    if any(t.phases for t in tl.tracks):
        handles += [Patch(color=_PHASE_COLORS[p], alpha=0.25, label=p.value) for p in _PHASE_COLORS]
    if any(t.recompute for t in tl.tracks):
        handles.append(Patch(color=_RECOMPUTE_COLOR, alpha=0.4, label="recompute"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)
    fig.suptitle(wrap_title(tl.title, 10, _WIDTH_IN), fontsize=10)
    # span labels last: how many fit depends on the lanes' final width in pixels
    fig.draw_without_rendering()
    for r, t in enumerate(tl.tracks):
        if t.kind != "trace":
            _span_labels(axes[2 * r + 1], t)
    return fig


def _step_lane(lane, t: Track) -> None:
    """Forward spans above, backward below, recomputes in red; one collection per row, so
    thousands of spans draw as fast as a dozen."""
    for p, y in ((Phase.FORWARD, 1.0), (Phase.BACKWARD, 0.0)):
        bars = [(a, b - a) for a, b, _, q in t.lane if q is p]
        edge = "white" if len(bars) < 200 else "none"
        lane.broken_barh(bars, (y + 0.1, 0.8), facecolor=_PHASE_COLORS[p], edgecolor=edge, linewidth=0.4)
    lane.broken_barh([(a, max(b - a, t.ticks / 800)) for a, b, _ in t.recompute], (0.0, 0.35), facecolor=_RECOMPUTE_COLOR)
    lane.set_yticks([0.5, 1.5], ["bwd", "fwd"], fontsize=7)
    lane.set_xlabel("tick (one allocation or free)", fontsize=8)


def _span_labels(lane, t: Track, fontsize: float = 6) -> None:
    """Each span's last name part (``h.21`` -> ``21``) where its text fits: inside the bar in
    white, or beside a bar too narrow for it in black where no other label is (22 layers'
    forwards are each narrower than a fixed share of the axis, which hid every label)."""
    px_per_tick = lane.get_window_extent().width / max(1, t.ticks)
    char_px = fontsize * 0.62 * lane.figure.dpi / 72
    for p, y in ((Phase.FORWARD, 1.0), (Phase.BACKWARD, 0.0)):
        free_from = float("-inf")  # pixels: where the last label on this row ended
        for a, b, name, _phase in sorted(x for x in t.lane if x[3] is p):
            label = name.rpartition(".")[2] or name
            width, middle = len(label) * char_px, (a + b) / 2 * px_per_tick
            inside = (b - a) * px_per_tick >= width + 2
            if middle - width / 2 < free_from + 3:
                continue
            lane.text(
                (a + b) / 2, y + 0.5, label, fontsize=fontsize, ha="center", va="center", color="white" if inside else "black"
            )
            free_from = middle + width / 2


def _trace_lane(lane, t: Track) -> None:
    """Segments made (cudaMalloc, an expandable segment mapped) above, released below, each a
    mark as tall as its share of the largest."""
    if not t.marks:
        lane.text(
            t.ticks / 2, 1, "no segment made or released during the trace", fontsize=7, ha="center", va="center", color="#555"
        )
    big = max((b for _, b, _ in t.marks), default=1)
    for sign, y, color in ((1, 1.05, _LINE_STYLES["reserved"][0]), (-1, 0.05, "#999999")):
        ev = [(e, b) for e, b, s in t.marks if s == sign]
        if ev:
            lane.vlines([e + 0.5 for e, _ in ev], y, [y + 0.1 + 0.8 * b / big for _, b in ev], color=color, linewidth=1)
    lane.set_yticks([0.5, 1.5], ["released", "made"], fontsize=7)
    if t.peak_op == _DUMPED:
        lane.set_xticks([])
        lane.set_xlabel("no trace (recorded without torch.cuda.memory._record_memory_history): the dumped state", fontsize=8)
    else:
        lane.set_xlabel("event in the trace (alloc, free, segment made or released); lane: segments", fontsize=8)


# -- HTML -----------------------------------------------------------------------------------


def _page_data(tl: Timeline) -> dict:
    strings: dict[str, int] = {}

    def s(x: str | None) -> int:
        key = "\0" if x is None else x
        if key not in strings:
            strings[key] = len(strings)
        return strings[key]

    phases = [p.value for p in Phase]
    pidx = {p: i for i, p in enumerate(Phase)}
    layers: list[Category | Layer] = list(_ORDER) + [c for c in _TRACE_LAYERS if any(c in t.categories for t in tl.tracks)]
    cats = [c.value for c in layers]
    cidx = {c: i for i, c in enumerate(layers)}
    tracks = []
    for t in tl.tracks:
        tracks.append(
            {
                "label": t.label,
                "n": t.ticks,
                "edges": t.edges,
                "rep": t.rep,
                "cats": [cidx[c] for c in t.categories],
                "stack": t.stack,
                "phases": [[a, b, pidx[p]] for a, b, p in t.phases],
                "lane": [[a, b, s(name), pidx[p]] for a, b, name, p in t.lane],
                "recompute": [[a, b, s(name)] for a, b, name in t.recompute],
                "ctx": [[pidx[p], s(m), s(op)] for p, m, op in t.col_context],
                "peak": [t.peak_tick, t.peak_bytes],
                "kind": t.kind,
                "lines": [[name, v, _line_style(name)[0]] for name, v in t.lines],
                "marks": [list(m) for m in t.marks],
                "peakText": _peak_words(t),
                "blocks": [
                    [b, d, nbytes, cidx[c], s(m), s(op), pidx[bp], s(dop), -1 if dp is None else pidx[dp]]
                    for b, d, nbytes, c, m, op, bp, dop, dp in t.blocks
                ],
            }
        )
    return {
        "strings": [None if k == "\0" else k for k in strings],
        "phases": phases,
        "cats": cats,
        "colors": [_color(c) for c in layers],
        "phaseColors": {p.value: col for p, col in _PHASE_COLORS.items()},
        "top": _top(tl),
        "budget": tl.budget_bytes,
        "tracks": tracks,
    }


def _scatter_svg(cands: Sequence[Candidate]) -> str:
    """Bytes freed (y) against recompute cost (x) per candidate; chosen ones filled."""
    w, h, pad = 640, 360, 56
    timed = any(c.cost_s > 0 for c in cands)
    xs = [c.cost_s * 1e3 if timed else c.cost_flops / 1e9 for c in cands]
    xlabel = "estimated recompute time (ms)" if timed else "recomputed GFLOPs"
    ys = [c.freed_bytes / 2**20 for c in cands]
    xmax, ymax = (max(xs) if xs else 1) or 1, (max(ys) if ys else 1) or 1

    def px(x: float) -> float:
        return pad + x / xmax * (w - pad - 16)

    def py(y: float) -> float:
        return h - pad + 16 - y / ymax * (h - pad - 8)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" id="scatter" role="img">']
    parts.append(f'<line x1="{pad}" y1="{py(0)}" x2="{w - 10}" y2="{py(0)}" stroke="#888"/>')
    parts.append(f'<line x1="{pad}" y1="{py(0)}" x2="{pad}" y2="8" stroke="#888"/>')
    for f in (0.0, 0.5, 1.0):
        parts.append(
            f'<text x="{px(f * xmax):.1f}" y="{py(0) + 16:.1f}" font-size="10" text-anchor="middle">{f * xmax:.3g}</text>'
        )
        parts.append(f'<text x="{pad - 4}" y="{py(f * ymax) + 3:.1f}" font-size="10" text-anchor="end">{f * ymax:.3g}</text>')
    parts.append(f'<text x="{(w + pad) / 2}" y="{h - 6}" font-size="11" text-anchor="middle">{xlabel}</text>')
    parts.append(
        f'<text x="12" y="{h / 2}" font-size="11" text-anchor="middle" transform="rotate(-90 12 {h / 2})">bytes freed (MiB)</text>'
    )
    for c, x, y in sorted(zip(cands, xs, ys), key=lambda z: z[0].chosen):
        fill = _RECOMPUTE_COLOR if c.chosen else "none"
        shape = "circle" if c.mode == "full" else "rect"
        tip = html.escape(
            f"{_where(c.module)} ({c.mode}{', chosen' if c.chosen else ''}): frees {format_bytes(c.freed_bytes)}, "
            f"costs {c.cost_s * 1e3:.2f} ms / {c.cost_flops / 1e9:.3g} GFLOPs"
        )
        if shape == "circle":
            parts.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{fill}" stroke="{_RECOMPUTE_COLOR}"><title>{tip}</title></circle>'
            )
        else:
            parts.append(
                f'<rect x="{px(x) - 3.5:.1f}" y="{py(y) - 3.5:.1f}" width="7" height="7" fill="{fill}" stroke="#4e79a7"><title>{tip}</title></rect>'
            )
    parts.append("</svg>")
    return "".join(parts)


# The page's script ships beside this module as package data (timeline.js): read once, on the first page.
_SCRIPT_FILE = "timeline.js"


@functools.cache
def _script() -> str:
    return importlib.resources.files(__package__).joinpath(_SCRIPT_FILE).read_text(encoding="utf-8")


def timeline_html(tl: Timeline) -> str:
    """One page, nothing fetched at view time: the data, the canvas drawing and hover inline."""
    data = json.dumps(_page_data(tl), separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(tl.title)
    legend, notes = _html_legend(tl), "".join(f"<li>{html.escape(n)}</li>" for n in tl.notes)
    tables, explain, scatter = _html_tables(tl), _html_explain(tl), _html_scatter(tl)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}td:first-child{{text-align:right}}
.legend span{{margin-right:12px;font-size:13px}}.legend i{{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}}
#tip{{position:absolute;display:none;background:#fff;border:1px solid #888;padding:6px 8px;font-size:12px;max-width:460px;pointer-events:none;box-shadow:2px 2px 6px rgba(0,0,0,.2)}}
h3{{margin:14px 0 4px;font-size:14px}}</style>
<script>window.onerror=function(m,s,l){{var e=document.getElementById('memfit-error')||document.createElement('pre');
e.id='memfit-error';e.textContent='error: '+m+' (line '+l+')';document.body.appendChild(e);}};</script>
</head><body>
<h1 style="font-size:20px">{title}</h1>
<ul>{notes}</ul>
<div class="legend">{legend}</div>
<div id="charts"></div>
{explain}
{"".join(tables)}
{scatter}
<div id="tip"></div><div id="memfit-status" style="display:none">loading</div>
<script type="application/json" id="memfit-data">{data}</script>
<script>{_script()}</script>
</body></html>
"""


def _html_legend(tl: Timeline) -> str:
    """The page's legend: the categories drawn, the lines, the phases and recompute."""
    legend = " ".join(
        f'<span><i style="background:{_color(c)}"></i>{html.escape(c.value)}</span>'
        for c in [*_ORDER, *_TRACE_LAYERS]
        if any(c in t.categories for t in tl.tracks)
    )
    for name in dict.fromkeys(n for t in tl.tracks for n, _ in t.lines):
        color, dash = _line_style(name)
        style = "dashed" if dash[1] else "solid"
        legend += f' <span><i style="height:0;border-top:2px {style} {color};vertical-align:3px"></i>{html.escape(name)}</span>'
    if any(t.phases for t in tl.tracks):
        legend += " " + " ".join(
            f'<span><i style="background:{col};opacity:.35"></i>{p.value}</span>' for p, col in _PHASE_COLORS.items()
        )
    if any(t.recompute for t in tl.tracks):
        legend += f' <span><i style="background:{_RECOMPUTE_COLOR};opacity:.5"></i>recompute</span>'
    return legend


def _html_tables(tl: Timeline) -> list[str]:
    """Each track's tables: the largest blocks at the peak and, for a GPU trace, the largest segments."""
    tables = []
    for t in tl.tracks:
        trace = t.kind == "trace"
        rows = "".join(
            f"<tr><td>{format_bytes(b)}</td><td>{html.escape(c.value)}</td>"
            f"<td>{html.escape(m or '').replace(chr(10), '<br>') if trace else html.escape(_where(m))}</td>"
            f"<td>{html.escape(bw)}</td><td>{html.escape(fw)}</td></tr>"
            for b, c, m, bw, fw in t.at_peak
        )
        tables.append(
            f"<h3>Largest blocks at the peak: {html.escape(t.label)}</h3><table><tr><th>bytes</th><th>"
            f"{'kind' if trace else 'category'}</th><th>{'allocated at (innermost frame first)' if trace else 'module'}</th>"
            f"<th>born</th><th>freed</th></tr>{rows}</table>"
        )
        if t.segments_at_peak:
            rows = "".join(
                f"<tr><td>{format_bytes(size)}</td><td>{format_bytes(used)}</td><td>{html.escape(what)}</td></tr>"
                for size, used, what in t.segments_at_peak
            )
            tables.append(
                f"<h3>Largest segments at the peak: {html.escape(t.label)}</h3><table><tr><th>bytes</th>"
                f"<th>allocated in it</th><th>segment</th></tr>{rows}</table>"
            )
    return tables


def _html_explain(tl: Timeline) -> str:
    """The paragraph saying what the chart draws (a GPU trace's events, or a step's ticks)."""
    if all(t.kind == "trace" for t in tl.tracks):
        explain = (
            "Bytes in allocated blocks right after each event of the GPU's trace (an allocation, a free, a segment made "
            "or released), those alive when the trace began at the bottom; dashed: reserved (the segments). "
            "Dotted line: the allocated peak. Along the axis: segments made (above) and released (below), "
            "each mark as tall as its size. "
        )
    else:
        explain = (
            "Memory right after each tick (one allocation or free), stacked by category; shaded: forward, backward, "
            "optimizer; dotted line: the peak. Along the axis: module spans (forward above, backward below), recomputes "
            "in red. "
        )
        if any(t.lines for t in tl.tracks):
            explain += (
                "Lines: the CUDA caching allocator's allocated (blocks, rounded up) and reserved (segments) bytes, from "
                "the allocator model's replay of the same ticks. "
            )
    return (
        f'<p style="font-size:12px">{explain}Where a track has more ticks than columns, each column shows the tick of '
        "highest memory in it: the envelope and the peak are exact. Hover for the block under the pointer.</p>"
    )


def _html_scatter(tl: Timeline) -> str:
    """A plan's recompute candidates, bytes freed against cost; empty without candidates."""
    if not tl.candidates:
        return ""
    return (
        "<h2>Recompute candidates: bytes freed against cost</h2><p>Each module the planner could recompute "
        "(circles: full recompute, squares: selective), filled where the plan chose it. Bytes freed are the "
        "activations off the curve between the module's forward and its backward, read off the ledger; cost is "
        "the planner's estimate. "
        f"{len(tl.candidates)} candidates, {sum(c.chosen for c in tl.candidates)} chosen; identical modules (repeated "
        "blocks) fall on one point. Hover a point for its module.</p>" + _scatter_svg(tl.candidates)
    )


# -- from what memfit measured ----------------------------------------------------------------


def _source(prof: Profile) -> str:
    on = "fake tensors (simulated, no memory used)" if prof.fake else f"real tensors on {prof.device}"
    how = prof.meta.get("recorded_by", "memfit.profile")
    return f"recorded by {how} on {on}: {len(prof.ledger.ticks)} ticks, {len(prof.ledger.blocks)} blocks"


def _conf(settings: AllocatorSettings) -> str:
    return settings.assignment() or "the allocator's default settings"


def _cuda(prof: Profile) -> tuple[list[tuple[str, list[int], int]], list[str]]:
    """On CUDA, the lines (allocated, reserved: the allocator model's replay of the ledger's
    ticks, since torch reports only their peaks) and a note saying so; on the CPU, nothing."""
    cm = prof.cuda_memory
    if cm is None:
        return [], []
    s = ledger_series(prof.ledger, cm.settings)
    note = (
        f"allocated and reserved lines: the CUDA caching allocator model replaying these ticks under "
        f"{_conf(cm.settings)} (peaks {format_bytes(s.stats.allocated_peak_bytes)} allocated, "
        f"{format_bytes(s.stats.reserved_peak_bytes)} reserved)"
    )
    if cm.source != "caching allocator model":
        note += (
            f"; measured on the GPU ({cm.source}): {format_bytes(cm.allocated_peak_bytes)} allocated, "
            f"{format_bytes(cm.reserved_peak_bytes)} reserved"
        )
    lines = [
        # the measured step's own highest (an earlier step of the replayed loop may have placed blocks higher)
        ("allocated", s.allocated, max([s.start_allocated_bytes, *s.allocated])),
        ("reserved", s.reserved, s.stats.reserved_peak_bytes),
    ]
    return lines, [note]


def _track(prof: Profile, label: str, notes: list[str], checkpointed: Sequence[str] = ()) -> Track:
    """``prof``'s ledger as a track, with CUDA's lines where it ran on CUDA (their note added to ``notes``)."""
    lines, note = _cuda(prof)
    notes += [f"{label}: {n}" for n in note]
    return build_track(prof.ledger, label, checkpointed=checkpointed, lines=lines)


def profile_timeline(prof: Profile, title: str) -> Timeline:
    """The profiled step as one track."""
    notes = [f"step {_source(prof)}"]
    return Timeline(title, [_track(prof, "step", notes)], notes=notes)


def snapshot_timeline(tt: TraceTimeline, title: str, source: str) -> Timeline:
    """A GPU's recorded trace (``source``: where it was read) as one track."""
    notes = [
        f"GPU {tt.device}'s trace in {source}: {len(tt.actions)} events, {len(tt.blocks)} blocks, "
        f"{len(tt.segments)} segments, recorded under {_conf(tt.settings)}",
        "re-lived at the recorded addresses (memfit.cuda.snapshot.trace_timeline): what the GPU held, "
        "not a model's guess; blocks count as the allocator does (memory_allocated: requests rounded up)",
    ]
    if not tt.actions:
        notes.append("the snapshot has no trace (recorded without _record_memory_history): only the dumped state")
    return Timeline(title, [trace_track(tt, f"GPU {tt.device}")], notes=notes)


def plan_timeline(before: Profile, after: Profile, plan: Plan, candidates: Sequence[Option], title: str) -> Timeline:
    """The step without and with ``plan``: ``after`` is the step profiled with the plan
    applied (the same recorded run the planner verifies its plans with), so its peak is the
    plan's predicted peak; ``candidates`` are the options the planner weighed on ``before``."""
    chosen = {(m, c.mode) for m, c in plan.checkpointed.items()}
    cands = [Candidate(o.module, o.mode, o.freed_bytes, o.cost_s, o.cost_flops, (o.module, o.mode) in chosen) for o in candidates]
    notes = [
        f"no plan: the step {_source(before)}",
        f"plan: the same step with the plan applied (memfit.apply), {_source(after)}; "
        f"the plan's predicted peak is {format_bytes(plan.predicted_peak_bytes)}",
    ]
    tracks = [
        _track(before, "no plan", notes),
        _track(after, f"plan ({len(plan.checkpointed)} modules recomputed)", notes, list(plan.checkpointed)),
    ]
    return Timeline(
        title,
        tracks,
        notes=notes
        + (
            [
                "tensors a selective checkpoint keeps are held by the checkpoint, not by autograd's saved-tensor hooks: "
                "in the planned step they count as temporaries"
            ]
            if any(c.mode == "selective" for c in plan.checkpointed.values())
            else []
        ),
        budget_bytes=plan.budget_bytes,
        candidates=cands,
    )


def recipe_timeline(before: Profile, after: Profile, recipe: Recipe, title: str) -> Timeline:
    """The step as it is and with ``recipe``'s levers (its step options and plan), each profiled."""
    checkpointed = list(recipe.plan.checkpointed) if recipe.plan is not None else []
    notes = [f"as it is: the step {_source(before)}", f"recipe: the recipe's step (its plan applied), {_source(after)}"]
    tracks = [_track(before, "as it is", notes), _track(after, f"recipe: {recipe.summary()}", notes, checkpointed)]
    return Timeline(title, tracks, notes=notes, budget_bytes=recipe.budget_bytes)
