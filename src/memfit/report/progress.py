"""Progress on stderr: a live bar on a terminal, plain lines in a log or CI.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    pass


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
