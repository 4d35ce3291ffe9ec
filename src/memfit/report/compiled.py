"""Rendering of compiled steps (:mod:`memfit.measure.compiled`): one step, or one row per
``activation_memory_budget`` value with the one that fits a byte budget marked."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.measure.compiled import CompiledProfile
from memfit.report.layout import add_rows
from memfit.report.profiles import FAKE_CUDA_SCRATCH
from memfit.units import format_bytes

BACKEND_NOTE = (
    "depends on the backend: inductor's fusion and buffer reuse (its code for the device: C++ on the host, Triton on CUDA; "
    "on fake CUDA its Triton code where Triton is installed, else the host's C++ code, as the label says), "
    "the partitioner's saved set (the same min-cut for inductor, aot_eager_decomp_partition and aot_eager); attention is the kernel the "
    "device picks (on fake CUDA, the one a CUDA build picks for this GPU)"
)


def _cuda(p: CompiledProfile) -> list[str]:
    if p.allocated_peak_bytes is None:
        return []
    return [format_bytes(p.allocated_peak_bytes), format_bytes(p.reserved_peak_bytes or 0)]


def render_compiled(
    profiles: list[CompiledProfile],
    console: Console,
    *,
    title: str,
    chosen: CompiledProfile | None = None,
    budget: int | None = None,
) -> None:
    """A row per compiled profile: its memory budget, peaks and what the forward saved."""
    cuda = any(p.allocated_peak_bytes is not None for p in profiles)
    table = Table(title=title)
    for col in ("memory budget", "step peak", "over start", "saved for backward"):
        table.add_column(col, justify="right")
    if cuda:
        table.add_column("allocated (model)", justify="right")
        table.add_column("reserved (model)", justify="right")
    table.add_column("graphs / breaks", justify="right")
    rows = []
    for p in profiles:
        mark = " <- fits" if chosen is p else ""
        budget_cell = "eager" if p.fallback else f"{p.memory_budget:g}{mark}"
        rows.append(
            [
                budget_cell,
                format_bytes(p.peak_bytes),
                format_bytes(p.step_peak_bytes),
                "" if p.fallback else format_bytes(p.saved_bytes),
                *_cuda(p),
                "" if p.fallback else f"{p.graphs} / {p.graph_breaks}",
            ]
        )
    add_rows(console, table, rows, names=None)
    console.print(table)
    for p in profiles:
        if p.fallback:
            console.print(f"[yellow]not compiled: {p.fallback}; the figures are the eager step's[/yellow]")
            break
    else:
        p = profiles[0]
        what = p.label if len(profiles) == 1 else f"compiled steps ({p.backend}{p.code_words}), one compile per memory budget"
        console.print(f"{what}; warm-up steps (they compile) {sum(q.compile_cpu_s for q in profiles):.1f} CPU s")
        if any(q.graph_breaks for q in profiles):
            console.print("graph breaks: the step ran several graphs with eager code between them; measured as it ran")
    console.print(f"[dim]{BACKEND_NOTE}[/dim]")
    _scratch_note(profiles, console)
    if budget is not None:
        if chosen is None:
            console.print(f"[red]no activation_memory_budget tried fits {format_bytes(budget)}[/red]")
        else:
            console.print(
                f"fits {format_bytes(budget)}: torch._functorch.config.activation_memory_budget = {chosen.memory_budget:g}"
            )


def _scratch_note(profiles: list[CompiledProfile], console: Console) -> None:
    """What kernels allocate for themselves and is not in the figures, said as the eager profile says it."""
    if any(p.allocated_peak_bytes is not None for p in profiles):  # fake CUDA (or a host run replayed as CUDA)
        console.print(f"[dim]{FAKE_CUDA_SCRATCH}[/dim]")
        return
    unmeasured = max(p.unmeasured_ops for p in profiles)
    if unmeasured:
        console.print(
            f"[dim]kernel workspace (memory kernels take for themselves) is not counted for {unmeasured:,} op calls: "
            "no measurement of their kinds and shapes[/dim]"
        )
