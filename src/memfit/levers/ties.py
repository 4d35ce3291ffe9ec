"""What ``fit`` and ``fit`` per rank share: a candidate and its what-if row, the rule that
chooses among near-ties (:func:`choose`), the error when nothing fits (:func:`infeasible`) and
the order of the what-if rows. The two searches differ in what a candidate sets (a combination
of levers on one device, an FSDP2 setting on each rank), in which near-tie is "simpler" and in
the words of their refusal; not in how one is chosen or shown."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from memfit.errors import BudgetInfeasibleError
from memfit.levers.recipe import WhatIf
from memfit.measure.timing import StepTimes
from memfit.plan.result import Plan
from memfit.units import format_bytes

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

    def row(self, label: str, *, chosen: bool = False, note: str = "") -> WhatIf:
        """The candidate as a what-if row: it fits, and where it ran its measured peak and time
        stand beside the predicted ones."""
        m = self.measured
        measured_s = None if m is None or math.isinf(m.median) else m.median
        peak = m.peak_bytes if m is not None else None
        return WhatIf(label, self.levers, self.peak_bytes, self.time_s, True, peak, measured_s, note=note, chosen=chosen)


def choose(cands: Sequence[Candidate[K]], simpler: Callable[[Candidate[K]], tuple], *, measured: bool = False) -> Candidate[K]:
    """The candidate a search takes: of those within :data:`TIE` of the fastest (by predicted
    time, or by measured time with ``measured``), the least by ``simpler`` (what a search counts
    as simpler: fewer levers, fewer micro-batches, no lever that changes the numerics), then by
    that time."""

    def time(c: Candidate[K]) -> float:
        return c.measured_s if measured else c.time_s

    fastest = min(time(c) for c in cands)
    return min((c for c in cands if time(c) <= fastest * (1 + TIE)), key=lambda c: (*simpler(c), time(c)))


def infeasible(
    budget: int,
    peak: int,
    reached: str,
    as_is: str,
    *,
    per: str = "",
    reach: str = "can reach",
    hints: Iterable[str] = (),
    opt_in: Sequence[str] = (),
) -> BudgetInfeasibleError:
    """The one line a search refuses a budget with: the lowest ``peak`` it reached (``reached``:
    with what), the step ``as_is``, ``hints`` (why a lever was not weighed, what else may help),
    and the levers that change the numerics which may go lower (``opt_in``, not allowed).
    ``per`` and ``reach`` are the words for a budget per rank (``" per rank"``, ``"reaches at 4 ranks"``)."""
    parts = [
        f"budget {format_bytes(budget)}{per} is below the lowest peak memfit {reach} with the levers allowed: "
        f"{format_bytes(peak)} ({peak} bytes) with {reached}",
        as_is,
        *hints,
    ]
    if opt_in:
        parts.append(f"levers that change the numerics may go lower: allow {','.join(opt_in)}")
    return BudgetInfeasibleError("; ".join(parts), min_peak_bytes=peak, budget_bytes=budget)


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
