"""What ``fit`` and ``fit`` per rank share: a candidate, the rule that chooses among near-ties,
and the order of the what-if rows. The two searches differ in what a candidate sets (a
combination of levers on one device, an FSDP2 setting on each rank), not in how one is chosen
or shown."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from memfit.levers.recipe import WhatIf
from memfit.measure.timing import StepTimes
from memfit.plan.result import Plan

C = TypeVar("C")
K = TypeVar("K")

TIE = 0.05
"""Step times within 5% of the fastest are a tie (timing noise on a busy host; a cost model's
round rates): among them the simpler recipe wins."""


@dataclass
class Candidate(Generic[K]):
    """A way to run the step within the budget: what it sets (``fit``'s lever combination, or
    an FSDP2 setting of every rank), the recompute plan it needs (None: none), its exact peak
    and predicted step time (the plan's recompute included), the levers it names, and its real
    steps when it was one of the few timed."""

    choice: K
    plan: Plan | None
    peak_bytes: int
    time_s: float
    levers: tuple[str, ...]
    measured: StepTimes | None = None

    @property
    def measured_s(self) -> float:
        return self.measured.median if self.measured is not None else math.inf

    @property
    def recomputes(self) -> bool:
        return self.plan is not None and bool(self.plan.checkpointed)


def simplest_of_fastest(cands: Sequence[C], time: Callable[[C], float], simpler: Callable[[C], Any]) -> C:
    """Of the candidates whose ``time`` is within :data:`TIE` of the fastest, the least by
    ``simpler`` (a key: fewer levers, fewer micro-batches, ...)."""
    fastest = min(time(c) for c in cands)
    return min((c for c in cands if time(c) <= fastest * (1 + TIE)), key=simpler)


def what_if_order(rows: Iterable[WhatIf]) -> list[WhatIf]:
    """The what-if rows as reports show them: those that ran for real (the chosen first, then by
    measured time), then those that fit by predicted time, then the rest by peak."""
    rows = list(rows)
    ran = sorted((r for r in rows if r.measured_step_time_s is not None), key=lambda r: (not r.chosen, r.measured_step_time_s))
    fitting = sorted(
        (r for r in rows if r.measured_step_time_s is None and r.fits and r.predicted_step_time_s is not None),
        key=lambda r: r.predicted_step_time_s or 0.0,
    )
    rest = [r for r in rows if r not in ran and r not in fitting]
    rest.sort(key=lambda r: (r.predicted_peak_bytes is None, r.predicted_peak_bytes or 0))
    return ran + fitting + rest
