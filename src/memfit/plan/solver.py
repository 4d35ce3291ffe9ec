"""The optimal choice of options for a memory bound: a MILP solved by HiGHS (scipy).

Model of the step (see :mod:`memfit.plan.candidates`): memory at tick t under a plan is
``curve[t] + sum_j x_j * delta_j(t)``, where option j frees ``freed_j`` bytes over
``[fwd_end_j, bwd_start_j)``, adds ``transient_j`` at ``bwd_start_j`` (the recompute) and
keeps the ``held_j`` inputs it holds for the recompute through ``[bwd_start_j, bwd_end_j)``.
Deltas only change at option boundaries, so one row per segment between boundaries (at
the segment's highest tick) plus one row per recompute covers every tick exactly.
At most one option is chosen on any root-to-leaf path of the module tree: a recomputed
parent makes its children's choice moot.

Two problems share those rows:

- ``min_cost(bound)``: least cost (estimated recompute time unless told otherwise) with
  every row <= bound;
- ``min_peak()``: the lowest reachable model peak, ties broken by cost.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from memfit.plan.candidates import Option

__all__ = ["Problem", "Solution"]

_MiB = float(2**20)  # rows in MiB keep HiGHS's tolerances meaningful for GiB-sized peaks


@dataclass(frozen=True)
class Solution:
    chosen: list[Option]
    model_peak_bytes: int
    cost_s: float


def _seconds(option: Option) -> float:
    return option.cost_s


def _delta(option: Option, tick: int) -> int:
    """What choosing ``option`` changes memory by at ``tick`` (outside its recompute)."""
    if option.fwd_end <= tick < option.bwd_start:
        return -option.freed_bytes
    if option.bwd_start <= tick < option.bwd_end:
        return option.held_bytes
    return 0


def _ancestors(name: str) -> list[str]:
    out = []
    while name:
        name = name.rpartition(".")[0]
        out.append(name)
    return out


class Problem:
    """Rows and columns built once per (curve, options); solved for any bound."""

    def __init__(
        self, curve: list[int], start_bytes: int, options: list[Option], cost: Callable[[Option], float] | None = None
    ) -> None:
        self.options = options
        self.curve = np.asarray(curve, dtype=np.float64)
        self.start_bytes = start_bytes
        n = len(curve)
        bounds = sorted({0, n, *(o.fwd_end for o in options), *(o.bwd_start for o in options), *(o.bwd_end for o in options)})
        bounds = [b for b in bounds if 0 <= b <= n]
        rows_tick: list[int] = []
        for a, b in zip(bounds, bounds[1:]):
            if a < b:
                rows_tick.append(a + int(np.argmax(self.curve[a:b])))
        seg_of = {t: bisect_left(bounds, t + 1) - 1 for t in rows_tick}
        # Segment rows: option j frees over [fwd_end, bwd_start) and holds over [bwd_start, bwd_end).
        m_seg = len(rows_tick)
        a_rows = np.zeros((m_seg + len(options), len(options)))
        base = np.zeros(m_seg + len(options))
        for r, t in enumerate(rows_tick):
            base[r] = self.curve[t]
            seg_start = bounds[seg_of[t]]
            for j, o in enumerate(options):
                a_rows[r, j] += _delta(o, seg_start)
        # Recompute rows: at bwd_start_j, the memory there plus option j's transient.
        for j, o in enumerate(options):
            r = m_seg + j
            t = min(o.bwd_start, n - 1)
            base[r] = self.curve[t] if n else start_bytes
            for k, other in enumerate(options):
                if k != j:
                    a_rows[r, k] += _delta(other, o.bwd_start)
            a_rows[r, j] += o.transient_bytes + o.held_bytes
        self._rows = a_rows / _MiB
        self._base = base / _MiB
        # One option per root-to-leaf path: for each module, its options and its ancestors'.
        by_module: dict[str, list[int]] = {}
        for j, o in enumerate(options):
            by_module.setdefault(o.module, []).append(j)
        path_rows = []
        for name in by_module:
            cols = list(by_module[name])
            for anc in _ancestors(name):
                cols += by_module.get(anc, [])
            row = np.zeros(len(options))
            row[cols] = 1
            path_rows.append(row)
        self._paths = np.array(path_rows) if path_rows else np.zeros((0, len(options)))
        self._cost = np.array([(cost or _seconds)(o) for o in options])

    def model_peak(self, chosen: list[Option]) -> int:
        """Peak the model predicts for a set of options (at least the start bytes).

        A recompute row whose option is not chosen reads the plain memory at that tick,
        which its segment's row already bounds, so every row can be taken as is."""
        x = np.array([1.0 if o in chosen else 0.0 for o in self.options])
        mem = self._base + (self._rows @ x if len(self.options) else 0.0)
        return int(max(float(mem.max()) * _MiB if len(mem) else 0.0, self.start_bytes))

    def _constraints(self, bound_mib: float | None) -> list[LinearConstraint]:
        """Path rows and memory rows; with no bound, memory rows are ``<= z`` for an extra
        last column ``z`` (the peak being minimised)."""
        extra = bound_mib is None
        cons = []
        if len(self._paths):
            paths = np.hstack([self._paths, np.zeros((len(self._paths), 1))]) if extra else self._paths
            cons.append(LinearConstraint(paths, -np.inf, 1))
        if extra:
            cons.append(LinearConstraint(np.hstack([self._rows, -np.ones((self._rows.shape[0], 1))]), -np.inf, -self._base))
        else:
            cons.append(LinearConstraint(self._rows, -np.inf, bound_mib - self._base))
        return cons

    def min_cost(self, bound_bytes: int) -> Solution | None:
        """Cheapest options keeping every row within ``bound_bytes``; None if impossible."""
        n = len(self.options)
        if n == 0:
            return Solution([], self.model_peak([]), 0.0) if self.model_peak([]) <= bound_bytes else None
        res = milp(
            c=self._cost + 1e-9,  # the epsilon prefers fewer options among equal costs
            constraints=self._constraints(bound_bytes / _MiB),
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
            options={"time_limit": 30.0},
        )
        if res.x is None or res.status not in (0, 1):
            return None
        return self._solution(res.x[:n])

    def min_peak(self) -> Solution:
        """Options reaching the lowest model peak; among those, the cheapest."""
        n = len(self.options)
        if n == 0:
            return Solution([], self.model_peak([]), 0.0)
        cost_scale = 1e-6 / max(float(self._cost.sum()), 1e-12)  # far below 1 MiB of peak
        res = milp(
            c=np.concatenate([self._cost * cost_scale, [1.0]]),
            constraints=self._constraints(None),
            integrality=np.concatenate([np.ones(n), [0]]),
            bounds=Bounds(np.concatenate([np.zeros(n), [0]]), np.concatenate([np.ones(n), [np.inf]])),
            options={"time_limit": 30.0},
        )
        if res.x is None:
            return Solution([], self.model_peak([]), 0.0)
        return self._solution(res.x[:n])

    def _solution(self, x: np.ndarray) -> Solution:
        chosen = [o for o, v in zip(self.options, x) if v > 0.5]
        return Solution(chosen, self.model_peak(chosen), float(sum(o.cost_s for o in chosen)))
