"""A profile (one device or each rank): the breakdown, the modules, the device fit, the CUDA memory and the ground truth.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.measure.ledger import Category, Phase
from memfit.measure.profile import ModuleStats, Profile
from memfit.report.layout import add_rows, format_flops, format_ms, format_share
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.measure.distributed import RankProfiles


_BARS = " ▁▂▃▄▅▆▇█"
_PHASE_STYLE = {Phase.FORWARD: "cyan", Phase.BACKWARD: "magenta", Phase.OPTIMIZER: "yellow", Phase.START: "white"}


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


FAKE_CUDA_SCRATCH = (
    "fake CUDA: what other CUDA kernels take for themselves (cuDNN workspaces, kernels' own temporaries) is not counted, "
    "attention backward's aside (estimated)"
)
"""What a fake-CUDA step's figures leave out, said alike for an eager and a compiled step."""


def render_profile(
    profile: Profile | RankProfiles, console: Console, *, title: str | None = None, top: int = 12, times: bool = True
) -> None:
    """The breakdown at the peak, when the peak happens, and the heaviest modules. Ranks of a
    distributed step (:class:`~memfit.measure.distributed.RankProfiles`): :func:`render_ranks`."""
    if not isinstance(profile, Profile):
        render_ranks(profile, console, title=title or profile.parallel, top=top)
        return
    peak = profile.peak
    where = peak["module"]
    where = "outside the model" if where is None else (where or "the root module")
    head = title or profile.model_type
    console.print(
        f"[bold]{head}[/] on [bold]{profile.device}[/]: step peak [bold]{format_bytes(profile.peak_bytes)}[/] "
        f"= {format_bytes(profile.start_bytes)} at start + [bold]{format_bytes(profile.step_peak_bytes)}[/] during the step"
    )
    console.print(f"peak during [bold]{peak['phase']}[/], in {where} ({peak['op']})")
    if profile.cuda_memory is not None:
        render_cuda_memory(profile, console)
    if profile.ledger.host_peak_bytes:
        console.print(f"host memory the step took (not in the device's peak): {format_bytes(profile.ledger.host_peak_bytes)}")
    legend = ", ".join(f"[{_PHASE_STYLE[p]}]{p.value}[/]" for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
    console.print(f"memory over the step ({legend}):")
    console.print(sparkline(profile, width=min(64, console.width - 2)))
    _breakdown_table(profile, console)
    _counting_notes(profile, console)
    if profile.reproducibility_note:
        console.print(f"[yellow]note:[/] {escape(profile.reproducibility_note)}")

    # (times=False: the caller found the host too busy to time, and says so once itself)
    timed = profile.time_source == "measured" and times
    if profile.step.inference:
        console.print("evaluation step (torch.inference_mode): nothing is saved for backward; no gradients, no optimizer step")
        if timed:
            _step_time_line(profile, console)
        render_device_fit(profile, console)
        return
    _modules_table(profile, console, top, timed)
    if timed:
        _step_time_line(profile, console)
    elif times:
        console.print("times omitted: fake tensors run no kernels (memory is exact; FLOPs are counted)")
    render_device_fit(profile, console)


def _breakdown_table(profile: Profile, console: Console) -> None:
    """The bytes of each category at the peak, and a note when autograd's graph (an estimate) is a large part."""
    table = Table(title="Memory at the peak", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    breakdown = profile.ledger.breakdown()
    for cat in Category:
        if breakdown[cat]:
            table.add_row(cat.value, format_bytes(breakdown[cat]), format_share(breakdown[cat], profile.peak_bytes))
    table.add_row("[bold]total[/]", f"[bold]{format_bytes(profile.peak_bytes)}[/]", "100%")
    console.print(table)
    graph = breakdown[Category.GRAPH]
    if graph > 0.05 * profile.peak_bytes:
        console.print(
            f"[yellow]note:[/] {format_bytes(graph)} of the peak is autograd's graph in host memory ({profile.graph_ops:,} "
            "forward ops on small tensors), an estimate from counted nodes and saved tensors: "
            "it varies by op type by up to 15% (docs/limitations.md)"
        )


def _counting_notes(profile: Profile, console: Console) -> None:
    """What the kernel workspace includes (cuBLAS workspaces, estimated attention temporaries), and what it cannot count."""
    ledger = profile.ledger
    if ledger.cublas_workspaces:
        console.print(
            f"kernel_workspace includes {ledger.cublas_workspaces} cuBLAS workspace{'s' if ledger.cublas_workspaces > 1 else ''} "
            f"of {format_bytes(ledger.cublas_workspace_bytes)} ({ledger.cublas_workspace_bytes:,} B: one per thread that "
            "runs matmuls, the forward's and autograd's; torch keeps them, so they are alive from the start)"
        )
    if ledger.attention_estimates:
        console.print(
            f"kernel_workspace includes the temporaries of {ledger.attention_estimates} attention backward call"
            f"{'s' if ledger.attention_estimates > 1 else ''} (flash / memory-efficient SDPA: float32 dQ accumulator, "
            "softmax or delta sums, a copy of a non-contiguous output gradient): an estimate from torch's sources, "
            "not a measurement"
        )
    if profile.device.startswith("fake:cuda"):
        console.print(f"[yellow]note:[/] {FAKE_CUDA_SCRATCH}")
    elif ledger.unmeasured_ops:
        console.print(
            f"[yellow]note:[/] kernel workspace (memory kernels take for themselves, such as oneDNN's reorders) is not "
            f"counted for {ledger.unmeasured_ops:,} op calls: fake tensors run no kernels, and no real step of ops "
            "of those kinds and shapes ran in this process to measure it"
        )


def _modules_table(profile: Profile, console: Console, top: int, timed: bool) -> None:
    """The ``top`` modules holding the most saved activations, with their times (when ``timed``) and FLOPs."""
    mods = Table(title="Modules holding the most saved activations", title_justify="left", box=box.SIMPLE_HEAD)
    show_type = console.width >= 100  # names matter more than types on a narrow terminal
    mods.add_column("module", no_wrap=True)
    if show_type:
        mods.add_column("type", overflow="ellipsis", no_wrap=True, max_width=18)
    for header in ("saved", "fwd time", "bwd time", "FLOPs"):
        mods.add_column(header, justify="right", no_wrap=True, min_width=9)
    rows = [
        [
            m.name,
            *([escape(m.type)] if show_type else []),
            format_bytes(m.saved_bytes),
            format_ms(m.forward_time_s) if timed else "-",
            format_ms(m.backward_time_s) if timed else "-",
            format_flops(m.forward_flops + m.backward_flops),
        ]
        for m in _top_modules(profile, top)
    ]
    add_rows(console, mods, rows)
    console.print(mods)


def render_ranks(ranks: RankProfiles, console: Console, *, title: str, top: int = 12) -> None:
    """A distributed step: the worst measured rank's profile, then every measured rank's peak."""
    worst = ranks.worst_rank
    render_profile(
        ranks.profiles[worst], console, title=f"{title} rank {worst} of {ranks.world_size} ({ranks.parallel})", top=top
    )
    cuda = any(p.cuda_memory is not None for p in ranks.profiles.values())
    if len(ranks.profiles) > 1:
        table = Table(title="Per-rank peak", title_justify="left", box=box.SIMPLE_HEAD)
        cols = ("rank", "allocated", "reserved", "at start") if cuda else ("rank", "peak", "at start")
        for col in cols:
            table.add_column(col, justify="right")
        for r, p in sorted(ranks.profiles.items()):
            if cuda:  # the allocator model's max_memory_allocated / max_memory_reserved
                peaks = [format_bytes(p.allocated_peak_bytes or 0), format_bytes(p.reserved_peak_bytes or 0)]
            else:
                peaks = [format_bytes(p.peak_bytes)]
            table.add_row(str(r), *peaks, format_bytes(p.start_bytes))
        console.print(table)
        if cuda:
            console.print(
                f"worst rank {worst}: reserved {format_bytes(ranks.budget_peak_bytes)}, allocated "
                f"{format_bytes(ranks.profiles[worst].allocated_peak_bytes or 0)}; tensor peaks spread "
                f"{format_bytes(ranks.spread_bytes)}"
            )
        else:
            console.print(f"worst rank {worst}: {format_bytes(ranks.peak_bytes)}; spread {format_bytes(ranks.spread_bytes)}")
    names = ranks.profiles[worst].meta.get("peak_names")
    if cuda and names:
        _titan_lines(ranks, names, console)
    if cuda:
        console.print(
            "per rank, the caching allocator's blocks and segments (model): NCCL's own buffers and the CUDA context are "
            "outside them (estimated apart, in the fit above)"
        )
    else:
        console.print(
            "per rank, tensors only: the communication backend's own buffers (NCCL's) and the CUDA context are not in it"
        )


def _titan_lines(ranks: RankProfiles, names: dict[str, str], console: Console) -> None:
    """The peaks under the names torchtitan's memory monitor logs them by (its metrics'
    keys), in its units: GiB, and % of the GPU's capacity."""
    for r, p in sorted(ranks.profiles.items()):
        fit = p.device_fit
        parts = []
        for kind, value in (("allocated", p.allocated_peak_bytes), ("reserved", p.reserved_peak_bytes)):
            if value is None or kind not in names:
                continue
            pct = f" ({100 * value / fit.capacity_bytes:.2f}%)" if fit is not None and fit.capacity_bytes else ""
            parts.append(f"{escape(names[kind])} {value / 2**30:.2f}{pct}")
        if parts:
            console.print(f"rank {r} as torchtitan logs it: " + ", ".join(parts))
    cuda = next(iter(ranks.profiles.values())).cuda_memory
    if cuda is not None and not cuda.settings.expandable_segments:
        # torchtitan's launcher sets it: a reserved peak under other settings is not its job's
        console.print(
            "torchtitan's run_train.sh runs with PYTORCH_ALLOC_CONF=expandable_segments:True; these peaks are under "
            f"{_settings_named(cuda.settings.describe())}: run memfit with that line to predict its job's reserved peak"
        )


def _settings_named(conf: str) -> str:
    return f"PYTORCH_ALLOC_CONF={escape(conf)}" if conf else "the default allocator settings"


def _step_time_line(profile: Profile, console: Console) -> None:
    console.print(f"step time {profile.step_time_s:.3f} s (the faster of two steps after warm-up, measured on {profile.device})")


def render_device_fit(profile: Profile, console: Console) -> None:
    """Does the step fit on the GPU (or capacity) it was judged against, with how much to spare."""
    fit = profile.device_fit
    if fit is None:
        return
    if fit.gpu is not None:
        what = fit.gpu.key
        detail = f"{fit.gpu.name}, sm{''.join(map(str, fit.gpu.capability))}, {format_bytes(fit.gpu.total_memory)}"
        if fit.capacity_bytes != fit.gpu.total_memory:
            detail += f"; capacity given {format_bytes(fit.capacity_bytes)}"
    else:
        what, detail = format_bytes(fit.capacity_bytes), "a capacity given"
    console.rule(f"[bold]Will it fit on {escape(what)}?")
    if profile.device.startswith("fake:"):
        detail += "; a prediction on fake tensors, not a measurement on a GPU"
    console.print(escape(detail), highlight=False)
    rows = Table(box=box.SIMPLE_HEAD, show_header=False)
    rows.add_column("what")
    rows.add_column("bytes", justify="right")
    rows.add_column("source")
    rows.add_row(
        "capacity",
        format_bytes(fit.capacity_bytes),
        "the GPU's total memory" if fit.gpu and fit.capacity_bytes == fit.gpu.total_memory else "given",
    )
    for est in fit.outside:
        if est.bytes or est.name != "nccl":
            rows.add_row(f"- {est.name.replace('_', ' ')}", format_bytes(est.bytes), "estimate, outside the allocator")
    peak = fit.reserved_peak_bytes if fit.reserved_peak_bytes is not None else fit.peak_bytes
    basis = "reserved peak (allocator model)" if fit.reserved_peak_bytes is not None else "step peak (ledger, 512 B blocks)"
    rows.add_row("- predicted peak", format_bytes(peak), basis)
    sign = "green" if fit.fits else "red"
    rows.add_row("[bold]= headroom[/]", f"[bold {sign}]{format_bytes(fit.headroom_bytes)}[/]", "")
    console.print(rows)
    if fit.fits:
        console.print(f"[bold green]fits[/], with {format_bytes(fit.headroom_bytes)} to spare")
    else:
        console.print(f"[bold red]does not fit[/]: short by {format_bytes(-fit.headroom_bytes)}")
    for est in fit.outside:
        if est.bytes:
            console.print(f"[dim]{est.name.replace('_', ' ')}: {escape(est.source)}[/]")
    for note in fit.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def render_cuda_memory(profile: Profile, console: Console) -> None:
    """The caching allocator's peaks beside the tensors' (CUDA only)."""
    c = profile.cuda_memory
    conf = c.settings.assignment()
    how = c.source if c.model is None else f"measured: {c.source}"
    frag = f"; {format_bytes(c.fragmentation_bytes)} reserved but unused at the peak" if c.fragmentation_bytes else ""
    console.print(
        f"CUDA allocator: allocated [bold]{format_bytes(c.allocated_peak_bytes)}[/], reserved "
        f"[bold]{format_bytes(c.reserved_peak_bytes)}[/] ({how}{', ' + escape(conf) if conf else ''}){frag}"
    )


def render_groundtruth(profile: Profile, measured: dict, console: Console) -> None:
    predicted = profile.step_peak_bytes
    actual = measured["step_peak_bytes"]
    err = (predicted - actual) / actual * 100 if actual else float("nan")
    how = "RSS high-water mark" if measured["method_used"] == "rss_hwm" else "torch.cuda.max_memory_allocated"
    console.print(
        f"step peak over start: predicted [bold]{format_bytes(predicted)}[/], measured [bold]{format_bytes(actual)}[/] "
        f"({how}, fresh process): error [bold]{err:+.2f}%[/]"
    )
