"""Rendering for the terminal (rich). The only place memfit draws tables.

Functions take measured objects and a ``rich.console.Console``; they compute nothing new.
"""

from __future__ import annotations

import copy
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.padding import Padding
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from memfit.cuda.snapshot import SnapshotSummary
from memfit.levers.max_batch import MaxBatch
from memfit.levers.recipe import Recipe, WhatIf
from memfit.measure.ledger import Category, Phase
from memfit.measure.profile import ModuleStats, Profile
from memfit.plan.result import Plan
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.levers.recipe import RankRecipe
    from memfit.measure.distributed import RankProfiles
    from memfit.plan.distributed import WorldSizeFit

__all__ = [
    "render_profile",
    "render_groundtruth",
    "render_plan",
    "render_before_after",
    "render_bench",
    "render_fit",
    "render_max_batch",
    "render_rank_fit",
    "render_left_out",
    "render_zoo",
    "render_snapshot",
    "describe_ops",
    "shorten_name",
    "progress_bar",
    "status",
    "ProgressLines",
    "sparkline",
]

_BARS = " ▁▂▃▄▅▆▇█"
_PHASE_STYLE = {Phase.FORWARD: "cyan", Phase.BACKWARD: "magenta", Phase.OPTIMIZER: "yellow", Phase.START: "white"}


_QUIET_S = 2.0
"""Plain progress lines start after this long: a command that is over sooner needs none,
and an error found in the first seconds (bad input, mostly) stays the one line on stderr."""
_GAP_S = 5.0
"""At most one plain progress line per this many seconds: a fit weighs a lever every few
seconds for minutes, and a log should read as a handful of lines, not hundreds."""
_HEARTBEAT_S = 30.0
"""A stage that lasts longer (a MILP, a benchmark child) is repeated with its elapsed time,
so a log shows the run is alive."""


def _live(err: Console) -> bool:
    """Whether stderr takes a live (redrawn) progress bar. Decided on the stream itself:
    many CI systems set FORCE_COLOR, which makes rich treat a pipe as a terminal, and a bar
    redrawn ten times a second into a log file floods it."""
    isatty = getattr(err.file, "isatty", None)
    try:
        return bool(isatty and isatty()) and err.is_interactive
    except ValueError:  # a closed stream
        return False


class ProgressLines:
    """Progress as plain lines on stderr, for logs and CI where nothing redraws in place:
    ``memfit: planning gpt: recorded step (2/3), 4.1 s``. A line when the stage changes (at
    most one per :data:`_GAP_S`; the latest stage wins), the stage again when it lasts over
    :data:`_HEARTBEAT_S`, nothing in the first :data:`_QUIET_S`, and a last line with the
    total time if any line was printed. A background thread prints stages that arrive while
    a line is held back and the heartbeats (the callback is not called during a long stage)."""

    def __init__(
        self,
        description: str,
        *,
        quiet_s: float = _QUIET_S,
        gap_s: float = _GAP_S,
        heartbeat_s: float = _HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.description = description
        self.quiet_s, self.gap_s, self.heartbeat_s = quiet_s, gap_s, heartbeat_s
        self.clock = clock
        self._write = write
        self.start = clock()
        self.stage: str | None = None
        self.shown: str | None = None
        self.last: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, desc: str, done: int, total: int | None) -> None:
        """The ``progress(description, done, total)`` callback."""
        if desc == "done":  # an inner step ends (a profile inside a plan): the command goes on
            return
        with self._lock:
            self.stage = f"{desc} ({done}/{total})" if total else desc
            self._emit_due()

    def tick(self) -> None:
        with self._lock:
            self._emit_due()

    def finish(self) -> None:
        with self._lock:
            if self.last is not None:
                self._line("finished")

    def _emit_due(self) -> None:
        now = self.clock()
        if now - self.start < self.quiet_s or (self.last is not None and now - self.last < self.gap_s):
            return
        if self.stage != self.shown or self.last is None or now - self.last >= self.heartbeat_s:
            self._line(self.stage or "running")
            self.shown = self.stage

    def _line(self, what: str) -> None:
        now = self.clock()
        self.last = now
        text = f"memfit: {self.description}: {what}, {now - self.start:.1f} s\n"
        try:
            if self._write is not None:
                self._write(text)
            else:  # sys.stderr at the time of writing: a redirected stream is honoured
                sys.stderr.write(text)
                sys.stderr.flush()
        except (OSError, ValueError):  # a closed log must not stop the command
            pass

    def __enter__(self) -> ProgressLines:
        def run() -> None:
            while not self._stop.wait(0.5):
                self.tick()

        self._thread = threading.Thread(target=run, name="memfit-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_type is None:  # on an error, the error line says what happened
            self.finish()


@contextmanager
def progress_bar(console: Console, description: str) -> Iterator[Callable[[str, int, int], None]]:
    """Progress on stderr; yields a ``progress(description, done, total)`` callback. On a
    terminal a rich bar that disappears when done; otherwise (a log, CI, a pipe) plain
    lines (:class:`ProgressLines`). Never on ``console`` (stdout), which carries the
    results: ``memfit plan ... > plan.txt`` keeps its progress on the terminal."""
    err = Console(stderr=True)
    if _live(err):
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=True
        ) as bar:
            task = bar.add_task(description, total=None)

            def update(desc: str, done: int, total: int | None) -> None:
                bar.update(task, description=f"{description}: {desc}", completed=done, total=total or None)

            yield update
    else:
        with ProgressLines(description) as lines:
            yield lines.update


@contextmanager
def status(console: Console, description: str) -> Iterator[None]:
    """A step without stages of its own (a fresh process measuring): a spinner on a
    terminal, else plain lines as :func:`progress_bar` prints them."""
    err = Console(stderr=True)
    if _live(err):
        with err.status(description):
            yield
    else:
        with ProgressLines(description):
            yield


# -- tables at any width ------------------------------------------------------------------
# Logs and CI render at 80 columns. Rich shrinks a table that is too wide by narrowing its
# wrappable columns, down to nothing (a label column vanished) or below their min_width
# (then the table is cropped at the edge), and folds long names in the middle. So widths
# are settled here before rich sees the table: text columns wrap between words only and
# are never narrower than their longest word, the widest shrinking first; then the name
# column's qualified names are shortened (shorten_name keeps the indices that tell rows
# apart). A name is never wrapped.

_MIN_NAME = 20
"""Fewer cells than this say little about a module."""
_NAME_COMFORT = 32
_TEXT_COMFORT = 24
"""Widths that read well; below them, text wraps and names shorten in turns."""


def shorten_name(name: str, width: int) -> str:
    """A qualified module name in at most ``width`` cells. Components go from the left,
    indices last (in ``bert.encoder.layer.11.attention`` the index tells the rows of a
    table apart; ``bert.encoder`` is the same on every row), and the last component is
    only ever cut at its start; an ellipsis marks each cut. Room left after a component
    goes keeps that component's end."""
    if cell_len(name) <= width:
        return name
    parts = name.split(".")
    last = len(parts) - 1
    shown: list[int | None] = [None] * len(parts)  # None: whole; 0: dropped; k: its last k characters

    def text() -> str:
        out, gap = "", False
        for part, k in zip(parts, shown):
            if k == 0:
                gap = True
                continue
            cut = k is not None and k < len(part)
            out += ("…" if gap or cut else ("." if out else "")) + (part[-k:] if k else part)
            gap = False
        return out

    def longest_end(i: int, least: int) -> bool:
        """Show as much of the end of component ``i`` as fits (at least ``least`` characters)."""
        for k in range(len(parts[i]), least - 1, -1):
            shown[i] = k
            if cell_len(text()) <= width:
                return True
        return False

    inner = [i for i in range(last) if not parts[i].isdigit()]
    indices = [i for i in range(last) if parts[i].isdigit()]
    for i in inner:
        shown[i] = 0
        if cell_len(text()) <= width:
            if not longest_end(i, 4):
                shown[i] = 0
            return text()
    for i in [*indices, None]:
        if longest_end(last, min(8, len(parts[last])) if i is not None else 1):
            return text()
        shown[last] = None
        if i is not None:
            shown[i] = 0
    return "…" + parts[last][len(parts[last]) - max(1, width - 1) :]


def _longest_word(cells: list[str]) -> int:
    return max((cell_len(w) for c in cells for w in Text.from_markup(c).plain.split()), default=1)


def _natural(cells: list[str]) -> int:
    return max((cell_len(line) for c in cells for line in Text.from_markup(c).plain.splitlines()), default=0)


def _add_rows(console: Console, table: Table, rows: list[list[str]], *, names: int | None = 0) -> None:
    """Add ``rows`` (rich markup) to ``table`` so that it fits the console: text columns
    (those that may wrap) wrap between words; then column ``names``, which holds plain
    qualified names, is shortened."""
    columns = table.columns
    probe = copy.deepcopy(table)
    for row in rows:
        probe.add_row(*row)
    excess = Measurement.get(console, console.options.update_width(1 << 16), probe).maximum - console.width
    widths = {}
    for i, col in enumerate(columns):
        cells = [str(col.header), *(r[i] for r in rows)]
        widths[i] = max(_natural(cells), col.min_width or 0)
    text_cols = [i for i, col in enumerate(columns) if not col.no_wrap and i != names]
    floor = {i: max(_longest_word([str(columns[i].header), *(r[i] for r in rows)]), columns[i].min_width or 0) for i in text_cols}

    def narrow(down_to: dict[int, int]) -> None:  # the widest text column gives a cell at a time
        nonlocal excess
        while excess > 0:
            i = max((i for i in text_cols if widths[i] > down_to[i]), key=lambda i: widths[i], default=None)
            if i is None:
                return
            widths[i] -= 1
            excess -= 1
            columns[i].width = widths[i]

    longest = max((cell_len(r[names]) for r in rows), default=0) if names is not None else 0
    # Text first down to a comfortable width, then names down to theirs, then text to its
    # longest word, then names to the least that still says something.
    narrow({i: max(floor[i], _TEXT_COMFORT) for i in text_cols})
    name_width = max(longest - max(0, excess), min(longest, _NAME_COMFORT))
    excess -= longest - name_width
    narrow(floor)
    name_width = max(name_width - max(0, excess), min(longest, _MIN_NAME))
    if names is not None and rows:
        rows = [[escape(shorten_name(c, name_width)) if i == names else c for i, c in enumerate(r)] for r in rows]
    for row in rows:
        table.add_row(*row)


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


def render_profile(
    profile: Profile, console: Console, *, title: str | None = None, top: int = 12, times: bool = True
) -> None:
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
    if profile.cuda_memory is not None:
        render_cuda_memory(profile, console)
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
            "it varies by op type by up to 15% (docs/limitations.md)"
        )
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
        console.print(
            "[yellow]note:[/] fake CUDA: what other CUDA kernels take for themselves (cuDNN workspaces, kernels' own "
            "temporaries) is not counted, attention backward's aside (estimated)"
        )
    elif profile.ledger.unmeasured_ops:
        console.print(
            f"[yellow]note:[/] kernel workspace (memory kernels take for themselves, such as oneDNN's reorders) is not "
            f"counted for {profile.ledger.unmeasured_ops:,} op calls: fake tensors run no kernels, and no real step of ops "
            "of those kinds and shapes ran in this process to measure it"
        )

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
            _seconds(m.forward_time_s) if timed else "-",
            _seconds(m.backward_time_s) if timed else "-",
            _flops(m.forward_flops + m.backward_flops),
        ]
        for m in _top_modules(profile, top)
    ]
    _add_rows(console, mods, rows)
    console.print(mods)
    if timed:
        _step_time_line(profile, console)
    elif times:
        console.print("times omitted: fake tensors run no kernels (memory is exact; FLOPs are counted)")
    render_device_fit(profile, console)


def render_ranks(ranks: RankProfiles, console: Console, *, title: str, top: int = 12) -> None:
    """A distributed step: the worst measured rank's profile, then every measured rank's peak."""
    worst = ranks.worst_rank
    render_profile(
        ranks.profiles[worst], console, title=f"{title} rank {worst} of {ranks.world_size} ({ranks.parallel})", top=top
    )
    if len(ranks.profiles) > 1:
        table = Table(title="Per-rank peak", title_justify="left", box=box.SIMPLE_HEAD)
        for col, justify in (("rank", "right"), ("peak", "right"), ("at start", "right")):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for r, p in sorted(ranks.profiles.items()):
            table.add_row(str(r), format_bytes(p.peak_bytes), format_bytes(p.start_bytes))
        console.print(table)
        console.print(f"worst rank {worst}: {format_bytes(ranks.peak_bytes)}; spread {format_bytes(ranks.spread_bytes)}")
    console.print("per rank, tensors only: the communication backend's own buffers (NCCL's) and the CUDA context are not in it")


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
    conf = c.settings.describe()
    how = c.source if c.model is None else f"measured: {c.source}"
    frag = f"; {format_bytes(c.fragmentation_bytes)} reserved but unused at the peak" if c.fragmentation_bytes else ""
    console.print(
        f"CUDA allocator: allocated [bold]{format_bytes(c.allocated_peak_bytes)}[/], reserved "
        f"[bold]{format_bytes(c.reserved_peak_bytes)}[/] ({how}{', PYTORCH_CUDA_ALLOC_CONF=' + escape(conf) if conf else ''}){frag}"
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
    console.print(f"predicted extra compute: {cost}; recomputed FLOPs {_flops(plan.extra_flops)}")
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
            f"parallelizing: {peaks} (tensors only: NCCL's buffers and the CUDA context are not in it)"
        )
    if plan.use_cache_off:
        where = ", ".join(n or "(root)" for n in plan.use_cache_off)
        console.print(f"use_cache=False while training in {where}: transformers' KV cache, as its gradient checkpointing does")
    if not plan.checkpointed:
        console.print("nothing to recompute: the step already fits")
    else:
        rows = [
            [name or "(root)", choice.mode, describe_ops(choice.save_ops)]
            for name, choice in list(plan.checkpointed.items())[:top]
        ]
        if len(plan.checkpointed) > top:
            rows.append([f"... and {len(plan.checkpointed) - top} more", "", ""])
        table = Table(title=f"Recomputed modules ({len(plan.checkpointed)})", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("module", no_wrap=True)
        table.add_column("recompute", no_wrap=True)
        table.add_column("keeps outputs of")
        _add_rows(console, table, rows)
        console.print(table)
    render_left_out(plan.excluded, console)
    console.print(f"planned in {plan.planning_time_s:.1f} s")


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
                _flops(r.recompute_flops) if r.recompute_flops is not None else "-",
                f"{r.plan_time_s:.1f}s" if r.plan_time_s is not None else "-",
            ]
        )
    _add_rows(console, table, cells, names=None)
    console.print(table)
    for line in failures:
        console.print(f"[red]failed[/] {escape(line)}", highlight=False)
    console.print(
        "peak = tensors alive at the step's start + the measured rise over it (fresh process each); "
        "step = median after warm-up; +FLOPs = recomputed FLOPs (FlopCounterMode, 0 for pointwise ops)"
    )


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
    _add_rows(console, table, rows, names=None)
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


def render_fit(recipe: Recipe, console: Console, *, title: str | None = None, path: str | None = None) -> None:
    """The what-if rows (those that fit first, fastest first), why other levers (and, with
    recompute, modules) were left out, the chosen recipe predicted against measured, and the
    snippet for the loop. ``path``: where the recipe's JSON was written (None: nowhere)."""
    base_time = f", {recipe.base_step_time_s:.3f} s/step" if recipe.base_step_time_s is not None else ""
    console.print(
        f"[bold]{escape(title or recipe.model_type)}[/] on [bold]{recipe.device}[/]: budget [bold]{format_bytes(recipe.budget_bytes)}[/]"
        f" ({escape(str(recipe.budget))}); as it is: peak {format_bytes(recipe.base_peak_bytes)}{base_time}",
        highlight=False,
    )
    _what_if_table(recipe.what_if, recipe.base_step_time_s, console)
    _left_out_levers(recipe.left_out, console)
    if recipe.plan is not None:
        render_left_out(recipe.plan.excluded, console, what="recompute")
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
        head, _, rest = snippet.partition("\n")
        snippet = f"{head}\n# recipe.json: written by memfit fit ... --json recipe.json (in Python: recipe.to_json())\n{rest}"
    else:
        console.print("in your training loop:", highlight=False)
    console.print(snippet, markup=False, highlight=False, soft_wrap=True)
    render_training_arguments(recipe, console)
    console.print(f"fitted in {recipe.fit_time_s:.1f} s")


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
    _add_rows(console, table, rows, names=None)
    console.print(table)


def _left_out_levers(left_out: dict[str, str], console: Console) -> None:
    # Levers not allowed share one reason and one remedy: one line, not one per lever.
    opt_in = [lever for lever, why in left_out.items() if "opt in with allow=" in why]
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
    _what_if_table(recipe.what_if, recipe.base_step_time_s, console, measured_column=False)
    _left_out_levers(recipe.left_out, console)
    if recipe.plan is not None:
        render_left_out(recipe.plan.excluded, console, what="recompute")
    ranks = ", ".join(f"rank {r} {format_bytes(b)}" for r, b in sorted(recipe.rank_peak_bytes.items()))
    console.print(
        f"chosen: [bold]{escape(recipe.summary())}[/]: predicted peak [bold]{format_bytes(recipe.predicted_peak_bytes)}[/] "
        f"per rank ({ranks}); {recipe.all_gathers} all-gathers per step; step {recipe.predicted_step_time_s:.4f} s "
        "predicted by the cost model (not measured)",
        highlight=False,
    )
    for note in recipe.notes:
        console.print(f"[yellow]note[/] {escape(note)}", highlight=False)
    snippet = recipe.snippet(path or "recipe.json")
    if recipe.plan is not None and path is None:
        head, _, rest = snippet.partition("\n")
        snippet = f"{head}\n# recipe.json: written by memfit fit ... --json recipe.json (in Python: recipe.to_json())\n{rest}"
    console.print("in your training script (model built, before training):", highlight=False)
    console.print(snippet, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"fitted in {recipe.fit_time_s:.1f} s ({recipe.search.get('profiles', 0)} rank profiles, "
        f"{recipe.search.get('plans', 0)} plans)"
    )


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


def render_zoo(models: dict[str, str], default: str, console: Console) -> None:
    """The zoo's models and what each is."""
    table = Table(title="memfit zoo (random weights, nothing downloaded)", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("what")  # wraps between words at 80 columns
    for name, about in models.items():
        # escaped: "(needs [hf])" is text, not rich markup
        table.add_row(escape(name + (" (default)" if name == default else "")), escape(about))
    console.print(table)


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


def render_world_size_fit(found: WorldSizeFit, console: Console, *, title: str) -> None:
    """How many ranks: per world size tried, the worst rank's peak without and with recompute
    (a size a lower bound ruled out shows the bound)."""
    table = Table(title=f"How many ranks: {title}", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("world size", "worst rank", "peak, no recompute", "lowest with recompute", "memfit's plan"):
        table.add_column(col, justify="right")
    for row in found.rows:
        cells = [
            "" if c is None else format_bytes(c) for c in (row["none_peak_bytes"], row["min_peak_bytes"], row["plan_peak_bytes"])
        ]
        bound = row.get("lower_bound_bytes")
        if row.get("skipped") == "profile":
            cells = [f"> {format_bytes(bound)} (state)", "", ""]
        elif row.get("skipped") == "plan":
            cells[1] = f"> {format_bytes(bound)} (start)"
        worst = row.get("worst_rank")
        ranks = row.get("ranks") or []
        shown = "" if worst is None else str(worst) if len(ranks) < 2 else f"{worst} (of {', '.join(map(str, ranks))})"
        table.add_row(str(row["world_size"]), shown, *cells)
    console.print(table)
    for what, n in (("without recompute", found.without_recompute), ("with memfit's plan", found.with_recompute)):
        answer = f"[bold]{n}[/] ranks" if n is not None else f"no world size tried (up to {found.rows[-1]['world_size']})"
        console.print(f"fits {format_bytes(found.budget_bytes)} per rank {what}: {answer}")
    if found.plan is not None and found.plan.checkpointed:
        console.print(f"the plan at {found.with_recompute} ranks recomputes {len(found.plan.checkpointed)} modules (--json: all)")
