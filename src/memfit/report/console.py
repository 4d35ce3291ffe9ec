"""Rendering for the terminal (rich). The only place memfit draws tables.

Functions take measured objects and a ``rich.console.Console``; they compute nothing new.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from memfit.measure.ledger import Category, Phase
from memfit.measure.profile import ModuleStats, Profile
from memfit.units import format_bytes

__all__ = ["render_profile", "render_groundtruth", "progress_bar", "sparkline"]

_BARS = " ▁▂▃▄▅▆▇█"
_PHASE_STYLE = {Phase.FORWARD: "cyan", Phase.BACKWARD: "magenta", Phase.OPTIMIZER: "yellow", Phase.START: "white"}


@contextmanager
def progress_bar(console: Console, description: str) -> Iterator:
    """A rich progress bar; yields a ``progress(description, done, total)`` callback."""
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console, transient=True
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(desc: str, done: int, total: int) -> None:
            bar.update(task, description=f"{description}: {desc}", completed=done, total=total)

        yield update


def _share(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _flops(n: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def sparkline(profile: Profile, width: int = 64) -> str:
    """Memory over the step as one line of block characters, coloured by phase (rich markup)."""
    curve = profile.ledger.curve()
    if not curve:
        return ""
    lo, hi = min(curve + [profile.start_bytes]), max(curve)
    n = len(curve)
    chars = []
    for i in range(min(width, n)):
        a, b = i * n // min(width, n), max(i * n // min(width, n) + 1, (i + 1) * n // min(width, n))
        level = max(curve[a:b])
        idx = 0 if hi == lo else round((level - lo) / (hi - lo) * (len(_BARS) - 1))
        phase = profile.ledger.ticks[a].phase
        chars.append(f"[{_PHASE_STYLE[phase]}]{_BARS[idx]}[/]")
    return "".join(chars)


def _top_modules(profile: Profile, limit: int) -> list[ModuleStats]:
    """Called modules holding the most saved activations, without the root and without
    wrappers whose figure is a single child's passed through."""
    order = {name: i for i, name in enumerate(profile.modules)}  # model order breaks ties
    mods = [m for m in profile.modules.values() if m.name and m.saved_bytes and m.calls]

    def is_passthrough(m: ModuleStats) -> bool:
        return any(c.saved_bytes == m.saved_bytes for c in mods if c.name.rpartition(".")[0] == m.name)

    keep = sorted((m for m in mods if not is_passthrough(m)), key=lambda m: (-m.saved_bytes, order[m.name]))
    return keep[:limit]


def render_profile(profile: Profile, console: Console, *, title: str | None = None, top: int = 12) -> None:
    """The breakdown at the peak, when the peak happens, and the heaviest modules."""
    peak = profile.peak
    where = peak["module"]
    where = "outside the model" if where is None else (where or "the root module")
    head = title or profile.model_type
    console.print(
        f"[bold]{head}[/] on [bold]{profile.device}[/]: step peak [bold]{format_bytes(profile.peak_bytes)}[/] "
        f"= {format_bytes(profile.start_bytes)} at start + [bold]{format_bytes(profile.step_peak_bytes)}[/] during the step"
    )
    console.print(f"peak during [bold]{peak['phase']}[/], in {where} ({peak['op']})")
    legend = ", ".join(f"[{_PHASE_STYLE[p]}]{p.value}[/]" for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
    console.print(f"memory over the step ({legend}):")
    console.print(sparkline(profile, width=min(64, console.width - 2)))

    table = Table(title="Memory at the peak", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    breakdown = profile.ledger.breakdown()
    for cat in Category:
        if breakdown[cat]:
            table.add_row(cat.value, format_bytes(breakdown[cat]), _share(breakdown[cat], profile.peak_bytes))
    table.add_row("[bold]total[/]", f"[bold]{format_bytes(profile.peak_bytes)}[/]", "100%")
    console.print(table)

    timed = profile.time_source == "measured"
    mods = Table(title="Modules holding the most saved activations", title_justify="left", box=box.SIMPLE_HEAD)
    show_type = console.width >= 100  # names matter more than types on a narrow terminal
    mods.add_column("module", overflow="fold")
    if show_type:
        mods.add_column("type", overflow="ellipsis", no_wrap=True, max_width=18)
    for header in ("saved", "fwd time", "bwd time", "FLOPs"):
        mods.add_column(header, justify="right", no_wrap=True, min_width=9)
    for m in _top_modules(profile, top):
        mods.add_row(
            m.name,
            *([m.type] if show_type else []),
            format_bytes(m.saved_bytes),
            _seconds(m.forward_time_s) if timed else "-",
            _seconds(m.backward_time_s) if timed else "-",
            _flops(m.forward_flops + m.backward_flops),
        )
    console.print(mods)
    if timed:
        console.print(f"step time {profile.step_time_s:.3f} s (one step after warm-up, measured on {profile.device})")
    else:
        console.print("times omitted: fake tensors run no kernels (memory is exact; FLOPs are counted)")


def render_groundtruth(profile: Profile, measured: dict, console: Console) -> None:
    predicted = profile.step_peak_bytes
    actual = measured["step_peak_bytes"]
    err = (predicted - actual) / actual * 100 if actual else float("nan")
    how = "RSS high-water mark" if measured["method"] == "rss_hwm" else "torch.cuda.max_memory_allocated"
    console.print(
        f"step peak over start: predicted [bold]{format_bytes(predicted)}[/], measured [bold]{format_bytes(actual)}[/] "
        f"({how}, fresh process): error [bold]{err:+.2f}%[/]"
    )
