"""A fit (one device or each rank), a max-batch search and a world-size fit: the levers, the what-ifs, the snippet.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.levers.catalog import Reason, Why
from memfit.levers.max_batch import MaxBatch
from memfit.levers.recipe import RankRecipe, Recipe, WhatIf
from memfit.report.layout import add_rows
from memfit.report.plans import render_left_out
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.plan.distributed import WorldSizeFit


def render_max_batch(found: MaxBatch, console: Console, *, title: str | None = None) -> None:
    """How each lever set's peak grows with the batch, and the largest batch each fits."""
    per_rank = f" per rank of {found.world_size}" if found.world_size else ""
    console.print(
        f"[bold]{escape(title or found.model_type)}[/]: largest batch{per_rank} within {format_bytes(found.budget_bytes)}: "
        f"[bold]{found.batch_size}[/] (example batch {found.example_batch}; searched in {found.search_time_s:.1f} s)",
        highlight=False,
    )
    table = Table(
        title=f"Peak{' per rank' if found.world_size else ''} = fixed + per sample x batch (fake tensors)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    rows = [
        [
            lim.label,
            format_bytes(lim.fixed_bytes),
            format_bytes(lim.bytes_per_sample),
            str(lim.predicted_batch),
            f"[bold]{lim.max_batch}[/]" if lim.max_batch == found.batch_size else str(lim.max_batch),
            format_bytes(lim.peak_bytes) if lim.max_batch else "-",
            str(lim.measurements),
        ]
        for lim in found.limits
    ]
    table.add_column("levers")
    # Two-line headers: one-line ones made the numbers' columns 80 cells wide by themselves.
    for col in ("fixed", "per\nsample", "line\nsays", "largest\nbatch", "peak\nthere", "fake\nsteps"):
        table.add_column(col, justify="right", no_wrap=True)
    add_rows(console, table, rows, names=None)
    console.print(table)
    console.print(
        "line says: the batch the line through two measurements predicts; fake steps: fake-tensor steps measured",
        highlight=False,
    )
    if found.world_size:
        if found.recipe is not None:
            console.print(f"the fastest recipe per rank at batch {found.batch_size} (times predicted):")
        return
    if found.recipe is None:
        console.print(
            f"[yellow]note:[/] {escape(found.device)}: peaks predicted on fake CUDA tensors, not measured on a GPU; no recipe "
            "is timed or verified (fake tensors run no kernels): run memfit fit at that batch on the GPU"
        )
        return
    console.print(f"the fastest recipe at batch {found.batch_size}, measured:")


def render_fit(recipe: Recipe | RankRecipe, console: Console, *, title: str | None = None, path: str | None = None) -> None:
    """The what-if rows (those that fit first, fastest first), why other levers (and, with
    recompute, modules) were left out, the chosen recipe predicted against measured, and the
    snippet for the loop. ``path``: where the recipe's JSON was written (None: nowhere).
    A recipe per rank: :func:`render_rank_fit`."""
    if isinstance(recipe, RankRecipe):
        render_rank_fit(recipe, console, title=title or recipe.parallel, path=path)
        return
    base_time = f", {recipe.base_step_time_s:.3f} s/step" if recipe.base_step_time_s is not None else ""
    console.print(
        f"[bold]{escape(title or recipe.model_type)}[/] on [bold]{recipe.device}[/]: budget [bold]{format_bytes(recipe.budget_bytes)}[/]"
        f" ({escape(str(recipe.budget))}); as it is: peak {format_bytes(recipe.base_peak_bytes)}{base_time}",
        highlight=False,
    )
    _weighed(recipe, console)
    measured = []
    if recipe.measured_peak_bytes is not None:
        measured.append(f"peak measured {format_bytes(recipe.measured_peak_bytes)} (recorder ledger of the real step)")
    if recipe.measured_step_time_s is not None:
        predicted = f"predicted {recipe.predicted_step_time_s:.3f} s, " if recipe.predicted_step_time_s is not None else ""
        if recipe.host_speed is not None and recipe.predicted_step_time_s is not None:
            now = recipe.predicted_step_time_s * recipe.host_speed
            predicted = f"predicted {recipe.predicted_step_time_s:.3f} s ({now:.3f} s at the host's speed then), "
        measured.append(f"step {predicted}measured {recipe.measured_step_time_s:.3f} s (median of 3 after warm-up)")
    elif recipe.times_predicted and recipe.predicted_step_time_s is not None:
        measured.append(f"step {recipe.predicted_step_time_s:.4f} s predicted by the cost model (not measured)")
    allocated = ""
    if recipe.allocated_peak_bytes is not None:
        allocated = f" reserved (allocated {format_bytes(recipe.allocated_peak_bytes)})"
    console.print(
        f"chosen: [bold]{escape(recipe.summary())}[/]: predicted peak [bold]{format_bytes(recipe.predicted_peak_bytes)}[/]"
        + allocated
        + (f"; {'; '.join(measured)}" if measured else ""),
        highlight=False,
    )
    for note in recipe.notes:
        console.print(f"[yellow]note[/] {note}", highlight=False)
    snippet = recipe.snippet(path or "recipe.json")
    if recipe.levers and path is None:
        # The snippet reads the recipe from a file, which this run did not write. Saying so
        # beats printing code that fails on its first line; a rerun measures again, so the
        # recipe it writes is the one its own output shows.
        console.print(
            "in your training loop (it reads recipe.json, which this run did not write: "
            "run memfit fit again with --json recipe.json):",
            highlight=False,
        )
        snippet = _unwritten(snippet)
    else:
        console.print("in your training loop:", highlight=False)
    console.print(snippet, markup=False, highlight=False, soft_wrap=True)
    render_training_arguments(recipe, console)
    console.print(f"fitted in {recipe.fit_time_s:.1f} s")


def _weighed(recipe: Recipe | RankRecipe, console: Console, *, measured_column: bool = True) -> None:
    """What a fit weighed, on one device or per rank alike: the what-if rows, the levers left
    out, and the modules a recompute plan left out."""
    _what_if_table(recipe.what_if, recipe.base_step_time_s, console, measured_column=measured_column)
    _left_out_levers(recipe.left_out, console)
    if recipe.plan is not None:
        render_left_out(recipe.plan.excluded, console, what="recompute")


def _what_if_table(what_if: list[WhatIf], base_time: float | None, console: Console, *, measured_column: bool = True) -> None:
    """The what-if rows as fit made them: configuration, peak, step time, against the step as it is."""
    rows = []
    for row in what_if:
        peak = format_bytes(row.predicted_peak_bytes) if row.predicted_peak_bytes is not None else "-"
        secs = row.predicted_step_time_s
        change = f"{secs / base_time - 1:+.0%}" if secs is not None and base_time else "-"
        measured = "-"
        if row.measured_peak_bytes is not None:
            measured = format_bytes(row.measured_peak_bytes)
            if row.measured_step_time_s is not None:
                measured += f", {row.measured_step_time_s:.3f} s"
        label = f"[bold]{escape(row.label)}[/] (chosen)" if row.chosen else escape(row.label)
        cells = [
            label,
            peak,
            f"{secs:.3f} s" if secs is not None else "-",
            change,
            "[green]yes[/]" if row.fits else ("[red]no[/]" if row.predicted_peak_bytes is not None else "-"),
        ]
        last = measured if not row.note else (row.note if measured == "-" else f"{measured}; {row.note}")
        if measured_column:
            cells.append(escape(last))
        elif row.note:
            cells[0] += f" ({escape(row.note)})"
        rows.append(cells)
    table = Table(title="What if (within the budget first, fastest first)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("configuration")
    for col in ("peak", "step", "vs\nas is", "fits"):  # two lines: the figures are narrower
        table.add_column(col, justify="right", no_wrap=True)
    if measured_column:
        table.add_column("measured", justify="right")
    add_rows(console, table, rows, names=None)
    console.print(table)


def _left_out_levers(left_out: dict[str, Reason], console: Console) -> None:
    # Levers not allowed share one reason and one remedy: one line, not one per lever.
    opt_in = [lever for lever, why in left_out.items() if why.why is Why.OPT_IN]
    for lever, why in left_out.items():
        if lever not in opt_in:
            console.print(f"[yellow]left out[/] {lever}: {escape(why)}", highlight=False)
    if opt_in:
        console.print(
            f"[yellow]left out[/] {', '.join(opt_in)}: they change the numerics; --allow {','.join(opt_in)} weighs them",
            highlight=False,
        )


def render_rank_fit(recipe: RankRecipe, console: Console, *, title: str, path: str | None = None) -> None:
    """A per-rank fit: the what-if rows (peaks exact per rank, times predicted), the levers
    left out, the chosen configuration, and the fully_shard calls for the training script."""
    console.print(
        f"[bold]{escape(title)}[/], rank of {recipe.world_size} ({escape(recipe.parallel)}) on [bold]{recipe.device}[/]: "
        f"budget [bold]{format_bytes(recipe.budget_bytes)}[/] per rank ({escape(str(recipe.budget))}); as it is: peak "
        f"{format_bytes(recipe.base_peak_bytes)}, {recipe.base_all_gathers} all-gathers, "
        f"{recipe.base_step_time_s:.4f} s/step predicted",
        highlight=False,
    )
    _weighed(recipe, console, measured_column=False)
    ranks = ", ".join(f"rank {r} {format_bytes(b)}" for r, b in sorted(recipe.rank_peak_bytes.items()))
    reserved = "reserved " if recipe.allocated_peak_bytes is not None else ""
    allocated = f", allocating {format_bytes(recipe.allocated_peak_bytes)}" if recipe.allocated_peak_bytes is not None else ""
    console.print(
        f"chosen: [bold]{escape(recipe.summary())}[/]: predicted {reserved}peak "
        f"[bold]{format_bytes(recipe.predicted_peak_bytes)}[/] per rank ({ranks}{allocated}); "
        f"{recipe.all_gathers} all-gathers per step; step {recipe.predicted_step_time_s:.4f} s "
        "predicted by the cost model (not measured)",
        highlight=False,
    )
    for note in recipe.notes:
        console.print(f"[yellow]note[/] {escape(note)}", highlight=False)
    snippet = recipe.snippet(path or "recipe.json")
    if recipe.plan is not None and path is None:
        snippet = _unwritten(snippet)
    console.print("in your training script (model built, before training):", highlight=False)
    console.print(snippet, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"fitted in {recipe.fit_time_s:.1f} s ({recipe.search.get('profiles', 0)} rank profiles, "
        f"{recipe.search.get('plans', 0)} plans)"
    )


def _unwritten(snippet: str) -> str:
    """A snippet that reads recipe.json, which this run did not write: a line after its head says how to."""
    head, _, rest = snippet.partition("\n")
    return f"{head}\n# recipe.json: written by memfit fit ... --json recipe.json (in Python: recipe.to_json())\n{rest}"


def render_training_arguments(recipe: Recipe, console: Console) -> None:
    """The recipe in transformers' Trainer's terms: the TrainingArguments to set, and what
    they cannot say (recompute: memfit's plan, put on the model by ``fit_trainer``). Only
    for a step the Trainer runs: ``model(**batch)`` trained on ``output.loss``."""
    if not recipe.levers or recipe.inputs_kind != "kwargs" or not recipe.default_loss:
        return
    kwargs = recipe.training_arguments()
    line = "in transformers' Trainer: TrainingArguments(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
    if recipe.plan is not None and recipe.plan.checkpointed:
        line += " + the recompute plan: memfit.integrations.transformers.fit_trainer(trainer, budget) applies it"
    missing = recipe.training_arguments_missing()
    if missing:
        line += f"; no TrainingArguments for {', '.join(missing)}"
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_world_size_fit(found: WorldSizeFit, console: Console, *, title: str) -> None:
    """How many ranks: per world size tried, the worst rank's peak without and with recompute
    (a size a lower bound ruled out shows the bound)."""
    table = Table(title=f"How many ranks: {title}", title_justify="left", box=box.SIMPLE_HEAD)
    varies = any(row.get("budget_bytes", found.budget_bytes) != found.budget_bytes for row in found.rows)
    for col in ("world size", "worst rank", *(("budget",) if varies else ()), "peak, no recompute", "lowest with recompute"):
        table.add_column(col, justify="right")
    table.add_column("memfit's plan", justify="right")
    for row in found.rows:
        cells = [
            "" if c is None else format_bytes(c) for c in (row["none_peak_bytes"], row["min_peak_bytes"], row["plan_peak_bytes"])
        ]
        bound = row.get("lower_bound_bytes")
        if row.get("skipped") == "profile":
            cells = [f"> {format_bytes(bound)} (state)", "", ""]
        elif row.get("skipped") == "plan":
            cells[1] = f"> {format_bytes(bound)} (start)"
            if row["none_peak_bytes"] is None:  # its recorded step was not run either
                cells[0] = cells[1]
        elif row.get("min_peak_verified") is False:
            cells[1] = f"~{cells[1]} (priced)"  # not run: the plan verified within the budget without it
        worst = row.get("worst_rank")
        ranks = row.get("ranks") or []
        shown = "" if worst is None else str(worst) if len(ranks) < 2 else f"{worst} (of {', '.join(map(str, ranks))})"
        budget = (format_bytes(row.get("budget_bytes", found.budget_bytes)),) if varies else ()
        table.add_row(str(row["world_size"]), shown, *budget, *cells)
    console.print(table)
    per = "per rank (less NCCL's estimate at each size)" if varies else "per rank"
    for what, n in (("without recompute", found.without_recompute), ("with memfit's plan", found.with_recompute)):
        answer = f"[bold]{n}[/] ranks" if n is not None else f"no world size tried (up to {found.rows[-1]['world_size']})"
        console.print(f"fits {format_bytes(found.budget_bytes)} {per} {what}: {answer}")
    if found.plan is not None and found.plan.checkpointed:
        console.print(f"the plan at {found.with_recompute} ranks recomputes {len(found.plan.checkpointed)} modules (--json: all)")
