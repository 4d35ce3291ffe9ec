"""Charts and pages for bench results: a memory-vs-throughput PNG (matplotlib) and a
self-contained HTML page (the PNG inlined, the table as HTML)."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from typing import Any

from memfit.units import format_bytes

__all__ = ["pareto_png", "bench_html", "wrap_title"]

MiB = 2**20


def wrap_title(text: str, fontsize: float, width_in: float) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``fontsize`` points (a long
    title, such as a fake-CUDA peak's words, was cut off at the figure's right edge).
    DejaVu Sans averages under 0.6 em a character; a line is kept to 0.62."""
    import textwrap

    chars = max(20, int(width_in * 72 * 0.94 / (fontsize * 0.62)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) for line in text.splitlines())


def pareto_png(rows: Sequence[Any], context: dict[str, Any]) -> bytes:
    """Peak memory (x) against throughput (y): memfit's plans as a line (and, where measured,
    memfit's plans compiled as a second), every baseline as a labelled point. Rows without a measured peak and time are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ok = [r for r in rows if r.measured_peak_bytes and r.step_time_s]
    fronts = (("memfit", "memfit plans", "tab:blue"), ("memfit+compile", "memfit plans + torch.compile", "tab:green"))
    for method, name, color in fronts:
        front = sorted((r for r in ok if r.method == method), key=lambda r: r.measured_peak_bytes)
        if not front:
            continue
        xs, ys = [r.measured_peak_bytes / MiB for r in front], [1 / r.step_time_s for r in front]
        ax.plot(xs, ys, "o-", color=color, label=name, zorder=3)
        for r, x, y in zip(front, xs, ys):
            ax.annotate(f"{r.budget:.0%}", (x, y), textcoords="offset points", xytext=(4, 4))
    for r in ok:
        if r.method in ("memfit", "memfit+compile"):
            continue
        marker = "s" if r.method == "compile" else "^"
        ax.scatter(r.measured_peak_bytes / MiB, 1 / r.step_time_s, marker=marker, color="tab:orange", zorder=2)
        ax.annotate(
            r.label, (r.measured_peak_bytes / MiB, 1 / r.step_time_s), textcoords="offset points", xytext=(4, -10), fontsize=8
        )
    ax.set_xlabel("measured peak memory (MiB, tensors)")
    ax.set_ylabel("throughput (steps / s)")
    # (a workload file's path can be long: wrapped to the axes' width, 12 pt)
    ax.set_title(wrap_title(f"{context['target']} on {context['device']} (torch {context['torch']})", 12, 8 * 0.78))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "s":
        return f"{value:.3f} s"
    if kind == "flops":
        return f"{value / 1e9:.2f} G"
    return html.escape(str(value))


def bench_html(rows: Sequence[Any], context: dict[str, Any], png: bytes) -> str:
    """One page, nothing external: the chart as a data URI and the rows as a table."""
    cols = [
        ("configuration", "label", "text"),
        ("measured peak", "measured_peak_bytes", "bytes"),
        ("predicted peak", "predicted_peak_bytes", "bytes"),
        ("step time", "step_time_s", "s"),
        ("recomputed FLOPs", "recompute_flops", "flops"),
        ("planning time", "plan_time_s", "s"),
        ("error", "error", "text"),
    ]
    head = "".join(f"<th>{html.escape(c)}</th>" for c, _, _ in cols)
    body = "\n".join("<tr>" + "".join(f"<td>{_cell(getattr(r, k), kind)}</td>" for _, k, kind in cols) + "</tr>" for r in rows)
    img = base64.b64encode(png).decode()
    title = html.escape(f"memfit bench: {context['target']} on {context['device']}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}</style>
</head><body>
<h1>{title}</h1>
<p>torch {html.escape(context["torch"])}; tensors alive at the step's start {format_bytes(context["start_bytes"])};
peak with nothing recomputed (ledger) {format_bytes(context["none_peak_bytes"])}.
Each configuration measured in fresh processes: peak (RSS high-water mark or CUDA allocator) over the step's start,
step time (median after warm-up), FLOPs (FlopCounterMode).</p>
<img alt="peak memory against throughput" src="data:image/png;base64,{img}">
<table><tr>{head}</tr>
{body}
</table>
</body></html>
"""
