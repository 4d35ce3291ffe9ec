"""A `memfit bench` run: every configuration measured side by side.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.report.layout import add_rows, format_flops
from memfit.units import format_bytes

if TYPE_CHECKING:
    pass


def render_bench(rows: list, context: dict, console: Console) -> None:
    """Every configuration: measured peak and step time (and its change against no
    checkpointing), recomputed FLOPs, and for memfit rows the prediction and planning time."""
    base = next((r.step_time_s for r in rows if r.method == "none" and r.step_time_s), None)
    failures: list[str] = []
    table = Table(
        title=f"{context['target']} on {context['device']} (torch {context['torch']})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("configuration")  # wraps between words at 80 columns
    # Two-line headers where the figures are narrower than one-line ones.
    for col in ("peak", "predicted", "step", "vs\nnone", "+FLOPs", "plan\ntime"):
        table.add_column(col, justify="right", no_wrap=True)
    cells = []
    for r in rows:
        if r.error and r.measured_peak_bytes is None:
            cells.append([escape(r.label), "[red]failed[/]", "", "", "", "", ""])
            failures.append(f"{r.label}: {r.error}")
            continue
        cells.append(
            [
                escape(r.label),
                format_bytes(r.measured_peak_bytes) if r.measured_peak_bytes is not None else "-",
                format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes is not None else "-",
                f"{r.step_time_s:.3f}s" if r.step_time_s is not None else "-",
                f"{r.step_time_s / base - 1:+.0%}" if base and r.step_time_s else "-",
                format_flops(r.recompute_flops) if r.recompute_flops is not None else "-",
                f"{r.plan_time_s:.1f}s" if r.plan_time_s is not None else "-",
            ]
        )
    add_rows(console, table, cells, names=None)
    console.print(table)
    for line in failures:
        console.print(f"[red]failed[/] {escape(line)}", highlight=False)
    console.print(
        "peak = tensors alive at the step's start + the measured rise over it (fresh process each); "
        "step = median after warm-up; +FLOPs = recomputed FLOPs (FlopCounterMode, 0 for pointwise ops)"
    )
