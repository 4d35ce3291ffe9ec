"""A GPU memory snapshot's summary.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.cuda.snapshot import SnapshotSummary
from memfit.units import format_bytes

if TYPE_CHECKING:
    pass


def render_snapshot(summary: SnapshotSummary, console: Console, *, top: int = 10) -> None:
    """A GPU memory snapshot: the recorded span's peaks, the model's replay, other settings."""
    rec = summary.recorded
    s = rec.stats
    conf = rec.settings.describe() or "defaults"
    console.print(f"[bold]{escape(summary.path)}[/]: device {rec.device}, allocator settings {escape(conf)}")
    if rec.has_trace:
        console.print(
            f"recorded span: {rec.events:,} trace events, {rec.allocs:,} allocations; at its start "
            f"{format_bytes(rec.start_allocated_bytes)} allocated, {format_bytes(rec.start_reserved_bytes)} reserved"
        )
    else:
        console.print("no trace recorded (torch.cuda.memory._record_memory_history was off): the state at the dump only")
    title = "Peaks over the recorded span" if rec.has_trace else "At the dump"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("", "allocated peak", "reserved peak", "vs GPU", "unused at the allocated peak"):
        # the settings name the row: kept whole, the numbers wrap instead
        table.add_column(col, justify="right", overflow="fold") if col else table.add_column(col, no_wrap=True)
    table.add_row(
        "GPU (recorded)",
        format_bytes(s.allocated_peak_bytes),
        format_bytes(s.reserved_peak_bytes),
        "",
        f"{format_bytes(s.fragmentation_bytes)} ({s.fragmentation:.1%})",
    )
    # one option a line: a long PYTORCH_CUDA_ALLOC_CONF would squeeze the numbers
    rows = [("model, same settings", summary.model)] + [
        ((w.settings.describe() or "defaults").replace(",", "\n"), w) for w in summary.what_if
    ]
    for label, t in rows:
        if t is None:
            continue
        m = t.stats
        if t.out_of_memory:
            table.add_row(escape(label), "out of memory", f"> {format_bytes(t.stats.capacity or 0)}", "", "")
            continue
        table.add_row(
            escape(label),
            format_bytes(m.allocated_peak_bytes),
            format_bytes(m.reserved_peak_bytes),
            format_bytes(m.reserved_peak_bytes - s.reserved_peak_bytes, signed=True),
            f"{format_bytes(m.fragmentation_bytes)} ({m.fragmentation:.1%})",
        )
    console.print(table)
    if summary.what_if:
        cap = summary.what_if[0].stats.capacity
        within = f", within {format_bytes(cap)} (released and retried as torch does when it runs out)" if cap else ""
        console.print(
            f"other settings: the same requests from the state the trace began with (segments made before it stay){within}"
        )
    if summary.model is not None:
        t = summary.model
        console.print(
            f"model replay: {t.same_address_fraction:.2%} of {t.allocs:,} allocations at the address the GPU's allocator chose; "
            f"{t.segment_allocs_matched} of {t.segment_allocs} cudaMallocs matched, {t.segment_allocs_extra} extra"
        )
    if summary.largest:
        table = Table(title=f"Largest allocations (top {len(summary.largest)})", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("bytes", justify="right")
        table.add_column("where (innermost Python frames)")
        for a in summary.largest[:top]:
            where = "\n".join(_short_frame(f) for f in a.frames) or "(no Python frames recorded)"
            table.add_row(format_bytes(a.size), escape(where))
        console.print(table)


def _short_frame(frame: str) -> str:
    """``/home/u/proj/model.py:12 forward`` -> ``proj/model.py:12 forward``."""
    path, _, rest = frame.partition(":")
    return "/".join(path.split("/")[-2:]) + ":" + rest
