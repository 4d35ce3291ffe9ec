"""Choosing among near-ties: the one rule ``fit`` and ``fit`` per rank share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

C = TypeVar("C")

TIE = 0.05
"""Step times within 5% of the fastest are a tie (timing noise on a busy host; a cost model's
round rates): among them the simpler recipe wins."""


def simplest_of_fastest(cands: Sequence[C], time: Callable[[C], float], simpler: Callable[[C], Any]) -> C:
    """Of the candidates whose ``time`` is within :data:`TIE` of the fastest, the least by
    ``simpler`` (a key: fewer levers, fewer micro-batches, ...)."""
    fastest = min(time(c) for c in cands)
    return min((c for c in cands if time(c) <= fastest * (1 + TIE)), key=simpler)
