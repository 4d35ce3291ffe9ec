"""A plan: what is recomputed, what was left out and why, before and after.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from memfit.plan.result import Plan
from memfit.report.layout import add_rows, format_flops
from memfit.units import format_bytes

if TYPE_CHECKING:
    pass


# Selective recompute keeps the outputs of some aten op types (Choice.save_ops, what the
# checkpoint policy matches) and recomputes the rest. Names such as "addmm", "tril" or
# "scalar_tensor" are the dispatcher's vocabulary, not the model's; a reader wants to know
# what stays in memory: the matrix products, a mask, constants. So the table names the
# kind of op; the exact names are in the plan's JSON (--json, plan.checkpointed). An op
# not listed here shows as its aten name, which is honest if terse.
_OP_KINDS: dict[str, str] = {
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "addbmm"), "matrix products"),
    **dict.fromkeys(
        ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "convolution_overrideable"), "convolutions"
    ),
    **dict.fromkeys(
        (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_flash_attention_forward",
            "_efficient_attention_forward",
        ),
        "attention",
    ),
    **dict.fromkeys(("tril", "triu", "masked_fill", "where"), "masks"),
    **dict.fromkeys(
        (
            "ones",
            "zeros",
            "full",
            "empty",
            "arange",
            "scalar_tensor",
            "ones_like",
            "zeros_like",
            "full_like",
            "empty_like",
            "new_ones",
            "new_zeros",
            "new_full",
            "new_empty",
            "eye",
            "lift_fresh",
            "lift_fresh_copy",
        ),
        "constants",
    ),
    **dict.fromkeys(("_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"), "softmax"),
    **dict.fromkeys(
        (
            "native_layer_norm",
            "layer_norm",
            "native_batch_norm",
            "_native_batch_norm_legit",
            "_native_batch_norm_legit_functional",
            "_native_batch_norm_legit_no_training",
            "native_group_norm",
            "_fused_rms_norm",
            "rms_norm",
        ),
        "normalisation",
    ),
    **dict.fromkeys(
        ("gelu", "relu", "silu", "tanh", "sigmoid", "hardtanh", "leaky_relu", "elu", "softplus", "mish", "threshold"),
        "activations",
    ),
    **dict.fromkeys(
        ("mul", "add", "sub", "div", "pow", "exp", "log", "neg", "rsqrt", "sqrt", "reciprocal", "clamp", "abs"),
        "elementwise math",
    ),
    **dict.fromkeys(("native_dropout", "bernoulli", "dropout", "rand", "randn", "rand_like"), "dropout masks"),
    **dict.fromkeys(("embedding", "index_select", "gather"), "lookups"),
    **dict.fromkeys(("sum", "mean", "amax", "max", "min", "var_mean", "logsumexp"), "reductions"),
    **dict.fromkeys(
        ("max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d", "adaptive_avg_pool2d", "max_pool1d"), "pooling"
    ),
    **dict.fromkeys(("cat", "stack", "clone", "_to_copy", "copy", "contiguous", "repeat"), "copies"),
}


def describe_ops(save_ops: tuple[str, ...] | list[str]) -> str:
    """What selective recompute keeps, in words: ``("addmm", "tril")`` -> ``"matrix products, masks"``."""
    kinds = dict.fromkeys(_OP_KINDS.get(op, op) for op in save_ops)
    return ", ".join(kinds) or "-"


_CALLED = re.compile(r"called (\d+) times in a step")
_CHANGES = re.compile(r"recompute not reproducible: its forward changes (.+?), state outside its tensors")
_CONTAINS = re.compile(r"recompute not reproducible: contains '([^']+)', whose forward changes")
_FAILED = re.compile(r"(full|selective) recompute not reproducible: (\w+)")
_SHOWN_PER_REASON = 6


def _why_excluded(name: str, reason: str) -> tuple[str, str]:
    """``(the reason in a few words, the module with what is particular to it)``; the
    planner's whole sentence stays in plan.excluded."""
    if m := _CALLED.match(reason):
        return "called more than once per step", f"{name} ({m[1]} calls)"
    if m := _CHANGES.match(reason):
        hint = " (transformers: use_cache=False)" if "use_cache=False" in reason else ""
        return f"forward changes state a recompute would change again{hint}", f"{name} ({m[1]})"
    if m := _CONTAINS.match(reason):
        return "contains a module whose forward changes state", f"{name} (contains {m[1]})"
    if m := _FAILED.match(reason):
        module, _, selective = name.partition(":")
        return "recompute failed when tried", f"{module} ({'selective, ' if selective else ''}{m[2]})"
    return reason, name


def render_left_out(excluded: dict[str, str], console: Console, *, what: str = "the plan") -> None:
    """Modules memfit would not recompute, grouped by reason, a few names per reason."""
    if not excluded:
        return
    groups: dict[str, list[str]] = {}
    for name, reason in excluded.items():
        why, item = _why_excluded(name, reason)
        groups.setdefault(why, []).append(item)
    n = len(excluded)
    console.print(
        f"[yellow]left out of {what}[/] ({n} module{'s' if n != 1 else ''}; full reasons: plan.excluded, --json):",
        highlight=False,
    )
    # A grid: a group's names wrap under its first line, between words.
    grid = Table.grid()
    grid.add_column()
    for why, items in groups.items():
        more = [f"... and {len(items) - _SHOWN_PER_REASON} more"] if len(items) > _SHOWN_PER_REASON else []
        grid.add_row(escape(f"{why} ({len(items)}): " + ", ".join(items[:_SHOWN_PER_REASON] + more)))
    console.print(Padding(grid, (0, 0, 0, 2)))


def render_plan(plan: Plan, console: Console, *, top: int = 20, times: bool = True) -> None:
    """What is recomputed, the predicted peak against budget and no-plan peak, the cost,
    and which modules were left out and why. ``times=False``: no times (the caller says
    once why: :func:`render_untimed`)."""
    fits = plan.predicted_peak_bytes <= plan.budget_bytes
    console.print(
        f"budget [bold]{format_bytes(plan.budget_bytes)}[/] ({escape(str(plan.budget))}): predicted peak [bold]{format_bytes(plan.predicted_peak_bytes)}[/] "
        + ("[green]fits[/]" if fits else "[red]over[/]")
        + f"; no plan {format_bytes(plan.none_peak_bytes)}, lowest reachable {format_bytes(plan.min_peak_bytes)}"
        + ("" if plan.min_peak_verified else " (priced on the ledger, not run)")
    )
    if plan.allocated_peak_bytes is not None:
        console.print(
            f"on CUDA these are reserved bytes (the caching allocator's segments, memfit's model of it: what runs out); "
            f"the plan's step allocates {format_bytes(plan.allocated_peak_bytes)} at its peak"
        )
    if not times:
        cost = "time not shown"
    elif plan.extra_compute_s is not None and plan.step_time_s:
        cost = (
            f"{plan.extra_compute_s * 1e3:.1f} ms per step ({plan.extra_compute_fraction:.1%} of a {plan.step_time_s:.3f} s step)"
        )
    else:
        cost = "time not measured (fake tensors)"
    console.print(f"predicted extra compute: {cost}; recomputed FLOPs {format_flops(plan.extra_flops)}")
    if plan.timing_note and times:
        console.print(f"[yellow]note:[/] {plan.timing_note}")
    if plan.reproducibility_note:
        console.print(f"[yellow]note:[/] {escape(plan.reproducibility_note)}")
    if plan.verify_note:
        console.print(f"[yellow]note:[/] {escape(plan.verify_note)}")
    if plan.rank_peak_bytes:
        peaks = ", ".join(f"rank {r} {format_bytes(b)}" for r, b in sorted(plan.rank_peak_bytes.items()))
        console.print(
            f"per rank of {plan.world_size}, each re-profiled on the fake process group with the plan applied before "
            f"parallelizing: {peaks} ("
            + ("reserved" if plan.peak_basis == "reserved_peak_bytes" else "tensors only")
            + ": NCCL's buffers and the CUDA context are not in it)"
        )
    if plan.use_cache_off:
        where = ", ".join(n or "(root)" for n in plan.use_cache_off)
        console.print(f"use_cache=False while training in {where}: transformers' KV cache, as its gradient checkpointing does")
    if not plan.checkpointed:
        console.print("nothing to recompute: the step already fits")
    else:
        console.print(_recomputed_table(plan, console, top))
        if any(c.mode == "selective" for c in plan.checkpointed.values()):
            console.print(
                "selective rows run through torch_remat where it is installed and the kept ops run in submodules "
                "(no dispatch mode: less CPU per op), else through a selective-checkpoint policy; "
                "memfit.apply(model, plan, mechanism=) forces either"
            )
    render_left_out(plan.excluded, console)
    console.print(f"planned in {plan.planning_time_s:.1f} s")


def _recomputed_table(plan: Plan, console: Console, top: int) -> Table:
    """The plan's modules, how each is recomputed; under pipeline parallelism the stage rank
    whose module it is (:attr:`Plan.rank_modules`)."""
    owner = {name: r for r, names in (plan.rank_modules or {}).items() for name in names}
    lead = ["stage rank"] if owner else []
    rows = [
        [*([str(owner.get(name, "-"))] if owner else []), name or "(root)", choice.mode, describe_ops(choice.save_ops)]
        for name, choice in list(plan.checkpointed.items())[:top]
    ]
    if len(plan.checkpointed) > top:
        rows.append([*([""] if owner else []), f"... and {len(plan.checkpointed) - top} more", "", ""])
    table = Table(title=f"Recomputed modules ({len(plan.checkpointed)})", title_justify="left", box=box.SIMPLE_HEAD)
    for col in lead:
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("module", no_wrap=True)
    table.add_column("recompute", no_wrap=True)
    table.add_column("keeps outputs of")
    add_rows(console, table, rows, names=len(lead))
    return table


def render_before_after(
    rows: list[tuple[str, int | None, int | None, float | None]], console: Console, *, times: bool = True
) -> None:
    """``rows`` of (label, predicted peak, measured peak, step time); ``times=False``: no
    step time column (the host was too busy to time: :func:`render_untimed` says so)."""
    table = Table(title="Before and after", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("", "predicted peak", "measured peak", *(["step time"] if times else [])):
        table.add_column(col, justify="right" if col else "left")
    base = rows[0][3]
    for label, pred, meas, secs in rows:
        slow = f" ({secs / base - 1:+.1%})" if secs and base and secs is not base else ""
        table.add_row(
            label,
            format_bytes(pred) if pred is not None else "-",
            format_bytes(meas) if meas is not None else "-",
            *([f"{secs:.3f} s{slow}" if secs is not None else "-"] if times else []),
        )
    console.print(table)


def render_untimed(console: Console, seconds: list[float]) -> None:
    """In place of step times the host was too busy to measure: why none are shown."""
    console.print(
        f"[yellow]step times not shown:[/] this machine is too busy to time steps (the same step took "
        f"{min(seconds):.3f} s to {max(seconds):.3f} s); the memory figures are not affected"
    )
