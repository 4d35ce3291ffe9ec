"""The zoo's model list.

Part of memfit.report, the only place memfit draws; functions take measured objects and a
``rich.console.Console`` and compute nothing new."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    pass


def render_zoo(models: dict[str, str], default: str, console: Console) -> None:
    """The zoo's models and what each is."""
    table = Table(title="memfit zoo (random weights, nothing downloaded)", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("what")  # wraps between words at 80 columns
    for name, about in models.items():
        # escaped: "(needs [hf])" is text, not rich markup
        table.add_row(escape(name + (" (default)" if name == default else "")), escape(about))
    console.print(table)
