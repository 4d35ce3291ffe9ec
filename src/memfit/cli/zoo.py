"""``memfit zoo``: the built-in models."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from memfit import zoo


def add_parser(sub: Any) -> None:
    p = sub.add_parser("zoo", help="list the built-in models")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.report.console import render_zoo

    render_zoo(zoo.describe(), zoo.DEFAULT, console)
    return 0
