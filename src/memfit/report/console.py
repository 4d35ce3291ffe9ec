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
from memfit.plan.max_batch import MaxBatch
from memfit.plan.recipe import Recipe
from memfit.plan.result import Plan
from memfit.units import format_bytes

__all__ = [
    "render_profile",
    "render_groundtruth",
    "render_plan",
    "render_before_after",
    "render_bench",
    "render_fit",
    "render_max_batch",
    "progress_bar",
    "sparkline",
]

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
    if profile.ledger.host_peak_bytes:
        console.print(f"host memory the step took (not in the device's peak): {format_bytes(profile.ledger.host_peak_bytes)}")
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
    graph = breakdown[Category.GRAPH]
    if graph > 0.05 * profile.peak_bytes:
        console.print(
            f"[yellow]note:[/] {format_bytes(graph)} of the peak is autograd's graph in host memory ({profile.graph_ops:,} "
            "forward ops on small tensors), an estimate from counted nodes and saved tensors: "
            "it varies by op type by up to 15% (README, Known limitations)"
        )

    timed = profile.time_source == "measured"
    if profile.step.inference:
        console.print("evaluation step (torch.inference_mode): nothing is saved for backward; no gradients, no optimizer step")
        if timed:
            console.print(f"step time {profile.step_time_s:.3f} s (one step after warm-up, measured on {profile.device})")
        return
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
    how = "RSS high-water mark" if measured["method_used"] == "rss_hwm" else "torch.cuda.max_memory_allocated"
    console.print(
        f"step peak over start: predicted [bold]{format_bytes(predicted)}[/], measured [bold]{format_bytes(actual)}[/] "
        f"({how}, fresh process): error [bold]{err:+.2f}%[/]"
    )


def render_plan(plan: Plan, console: Console, *, top: int = 20) -> None:
    """What is recomputed, the predicted peak against budget and no-plan peak, the cost."""
    fits = plan.predicted_peak_bytes <= plan.budget_bytes
    console.print(
        f"budget [bold]{format_bytes(plan.budget_bytes)}[/] ({plan.budget}): predicted peak [bold]{format_bytes(plan.predicted_peak_bytes)}[/] "
        + ("[green]fits[/]" if fits else "[red]over[/]")
        + f"; no plan {format_bytes(plan.none_peak_bytes)}, lowest reachable {format_bytes(plan.min_peak_bytes)}"
    )
    if plan.extra_compute_s is not None and plan.step_time_s:
        cost = (
            f"{plan.extra_compute_s * 1e3:.1f} ms per step ({plan.extra_compute_fraction:.1%} of a {plan.step_time_s:.3f} s step)"
        )
    else:
        cost = "time not measured (fake tensors)"
    console.print(f"predicted extra compute: {cost}; recomputed FLOPs {_flops(plan.extra_flops)}")
    if not plan.checkpointed:
        console.print("nothing to recompute: the step already fits")
    else:
        table = Table(title=f"Recomputed modules ({len(plan.checkpointed)})", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("module", overflow="fold")
        table.add_column("recompute")
        table.add_column("keeps outputs of", overflow="fold")
        for i, (name, choice) in enumerate(plan.checkpointed.items()):
            if i == top:
                table.add_row(f"... and {len(plan.checkpointed) - top} more", "", "")
                break
            table.add_row(name or "(root)", choice.mode, ", ".join(choice.save_ops) or "-")
        console.print(table)
    failed = {k: v for k, v in plan.excluded.items() if "not reproducible" in v}
    for i, (name, why) in enumerate(failed.items()):
        if i == top:  # a 32-layer model with a KV cache would list ~65; plan.excluded has them all
            console.print(f"[yellow]excluded[/] ... and {len(failed) - top} more (see plan.excluded or --json)", highlight=False)
            break
        console.print(f"[yellow]excluded[/] {name}: {why}", highlight=False)
    console.print(f"planned in {plan.planning_time_s:.1f} s")


def render_before_after(rows: list[tuple[str, int | None, int | None, float | None]], console: Console) -> None:
    """``rows`` of (label, predicted peak, measured peak, step time)."""
    table = Table(title="Before and after", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("", "predicted peak", "measured peak", "step time"):
        table.add_column(col, justify="right" if col else "left")
    base = rows[0][3]
    for label, pred, meas, secs in rows:
        slow = f" ({secs / base - 1:+.1%})" if secs and base and secs is not base else ""
        table.add_row(
            label,
            format_bytes(pred) if pred is not None else "-",
            format_bytes(meas) if meas is not None else "-",
            f"{secs:.3f} s{slow}" if secs is not None else "-",
        )
    console.print(table)


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
    table.add_column("configuration", no_wrap=True)
    for col in ("peak", "predicted", "step", "vs none", "+FLOPs", "plan"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        if r.error and r.measured_peak_bytes is None:
            table.add_row(r.label, "[red]failed[/]", "", "", "", "", "")
            failures.append(f"{r.label}: {r.error}")
            continue
        table.add_row(
            r.label,
            format_bytes(r.measured_peak_bytes) if r.measured_peak_bytes is not None else "-",
            format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes is not None else "-",
            f"{r.step_time_s:.3f}s" if r.step_time_s is not None else "-",
            f"{r.step_time_s / base - 1:+.0%}" if base and r.step_time_s else "-",
            _flops(r.recompute_flops) if r.recompute_flops is not None else "-",
            f"{r.plan_time_s:.1f}s" if r.plan_time_s is not None else "-",
        )
    console.print(table)
    for line in failures:
        console.print(f"[red]failed[/] {line}", highlight=False)
    console.print(
        "peak = tensors alive at the step's start + the measured rise over it (fresh process each); "
        "step = median after warm-up; +FLOPs = recomputed FLOPs (FlopCounterMode, 0 for pointwise ops)"
    )


def render_max_batch(found: MaxBatch, console: Console, *, title: str | None = None) -> None:
    """How each lever set's peak grows with the batch, and the largest batch each fits."""
    console.print(
        f"[bold]{title or found.recipe.model_type}[/]: largest batch within {format_bytes(found.budget_bytes)}: "
        f"[bold]{found.batch_size}[/] (example batch {found.example_batch}; searched in {found.search_time_s:.1f} s)",
        highlight=False,
    )
    table = Table(title="Peak = fixed + per sample x batch (fake tensors)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("levers", overflow="fold")
    for col in ("fixed", "per sample", "line says", "largest batch", "peak there", "measurements"):
        table.add_column(col, justify="right", no_wrap=True)
    for lim in found.limits:
        table.add_row(
            lim.label,
            format_bytes(lim.fixed_bytes),
            format_bytes(lim.bytes_per_sample),
            str(lim.predicted_batch),
            f"[bold]{lim.max_batch}[/]" if lim.max_batch == found.batch_size else str(lim.max_batch),
            format_bytes(lim.peak_bytes) if lim.max_batch else "-",
            str(lim.measurements),
        )
    console.print(table)
    console.print(f"the fastest recipe at batch {found.batch_size}, measured:")


def render_fit(recipe: Recipe, console: Console, *, title: str | None = None, path: str = "recipe.json") -> None:
    """The what-if rows (those that fit first, fastest first), why other levers were left
    out, the chosen recipe predicted against measured, and the snippet for the loop."""
    base_time = f", {recipe.base_step_time_s:.3f} s/step" if recipe.base_step_time_s is not None else ""
    console.print(
        f"[bold]{title or recipe.model_type}[/] on [bold]{recipe.device}[/]: budget [bold]{format_bytes(recipe.budget_bytes)}[/]"
        f" ({recipe.budget}); as it is: peak {format_bytes(recipe.base_peak_bytes)}{base_time}",
        highlight=False,
    )
    table = Table(title="What if (within the budget first, fastest first)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("configuration", overflow="fold")
    for col in ("peak", "step", "vs as is", "fits", "measured"):
        table.add_column(col, justify="right", no_wrap=col != "measured")
    for row in recipe.what_if:
        peak = format_bytes(row.predicted_peak_bytes) if row.predicted_peak_bytes is not None else "-"
        secs = row.predicted_step_time_s
        change = f"{secs / recipe.base_step_time_s - 1:+.0%}" if secs is not None and recipe.base_step_time_s else "-"
        measured = "-"
        if row.measured_peak_bytes is not None:
            measured = format_bytes(row.measured_peak_bytes)
            if row.measured_step_time_s is not None:
                measured += f", {row.measured_step_time_s:.3f} s"
        label = f"[bold]{row.label}[/] (chosen)" if row.chosen else row.label
        table.add_row(
            label,
            peak,
            f"{secs:.3f} s" if secs is not None else "-",
            change,
            "[green]yes[/]" if row.fits else ("[red]no[/]" if row.predicted_peak_bytes is not None else "-"),
            measured if not row.note else (row.note if measured == "-" else f"{measured}; {row.note}"),
        )
    console.print(table)
    for lever, why in recipe.left_out.items():
        console.print(f"[yellow]left out[/] {lever}: {why}", highlight=False)
    measured = []
    if recipe.measured_peak_bytes is not None:
        measured.append(f"peak measured {format_bytes(recipe.measured_peak_bytes)} (recorder ledger of the real step)")
    if recipe.measured_step_time_s is not None:
        predicted = f"predicted {recipe.predicted_step_time_s:.3f} s, " if recipe.predicted_step_time_s is not None else ""
        measured.append(f"step {predicted}measured {recipe.measured_step_time_s:.3f} s (median of 3 after warm-up)")
    console.print(
        f"chosen: [bold]{recipe.summary()}[/]: predicted peak [bold]{format_bytes(recipe.predicted_peak_bytes)}[/]"
        + (f"; {'; '.join(measured)}" if measured else ""),
        highlight=False,
    )
    for note in recipe.notes:
        console.print(f"[yellow]note[/] {note}", highlight=False)
    console.print("in your training loop:", highlight=False)
    console.print(recipe.snippet(path), markup=False, highlight=False, soft_wrap=True)
    console.print(f"fitted in {recipe.fit_time_s:.1f} s")
