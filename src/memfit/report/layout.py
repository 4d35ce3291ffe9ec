"""Tables that read at any width (80 columns in a log or CI) and the small formatters every renderer shares.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    pass


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


def add_rows(console: Console, table: Table, rows: list[list[str]], *, names: int | None = 0) -> None:
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


def format_share(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def format_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def format_flops(n: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
