"""``memfit estimate``: accelerate's estimate-memory numbers beside memfit's measured step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.units import format_bytes

if TYPE_CHECKING:  # the data only: rendering needs neither accelerate nor transformers
    from memfit.integrations.accelerate import Estimate

__all__ = ["render_estimate"]


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)


def render_estimate(est: Estimate, console: Console) -> None:
    console.print(
        f"[bold]{escape(est.model)}[/]: one training step (AdamW) at batch {est.batch_size} x {est.seq_len} tokens",
        highlight=False,
    )
    table = Table(box=box.SIMPLE_HEAD, title="accelerate's estimate | memfit's measured step", title_justify="left")
    table.add_column("dtype")
    # Two-line headers, short enough for 80 columns (the largest layer is in --json)
    for col in ("total\nsize", "training\n(Adam)", "step\npeak", "activa-\ntions", "other", "peak\nin"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in est.rows:
        at = row.memfit_breakdown
        table.add_row(
            row.dtype,
            format_bytes(row.total_bytes),
            _bytes(row.accelerate_training_bytes),
            f"[bold]{_bytes(row.memfit_peak_bytes)}[/]",
            _bytes(at.get("activations")) if at else "n/a",
            _bytes(at.get("other")) if at else "n/a",
            row.memfit_peak_phase or "",
        )
    console.print(table)
    console.print(
        "total size, training: accelerate estimate-memory's own functions on this model (parameters x dtype bytes; "
        "training: the largest of its weights, gradients, Adam-state and step terms, not their sum; no activations). "
        f"memfit: the step run on {est.device} tensors, AdamW (float16 / bfloat16: float32 weights and state, autocast "
        "forward, as Accelerator(mixed_precision=...) trains); activations: what autograd saved, alive at the peak; "
        "other: inputs, temporaries, kernel workspace (on CPU autograd's graph too); int8 / int4: memfit does not train "
        "quantized weights.",
        highlight=False,
    )
