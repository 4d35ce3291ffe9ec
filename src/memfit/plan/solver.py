"""The optimal choice of options for a memory bound: a MILP solved by HiGHS (scipy).

Model of the step (see :mod:`memfit.plan.candidates`): memory at tick t under a plan is
``curve[t] + sum_j x_j * delta_j(t)``, where option j frees ``freed_j`` bytes over
``[fwd_end_j, bwd_start_j)``, adds ``transient_j`` just before ``bwd_start_j`` (the recompute) and
keeps the ``held_j`` inputs it holds for the recompute through ``[bwd_start_j, bwd_end_j)``,
with the recomputed copies of tensors that stay alive anyway until their op's backward.
Deltas only change at option boundaries, so one row per segment between boundaries (at
the segment's highest tick) plus one row per recompute covers every tick exactly.
At most one option is chosen on any root-to-leaf path of the module tree: a recomputed
parent makes its children's choice moot. Two options interact when a tensor one frees is
the input of the other's module, whose checkpoint then keeps it: a pair column adds it back.
An option for a module called once a pass (a pipeline stage's microbatches: :attr:`Option.repeats`)
is one column whose delta is every call's, with a recompute row per call.

Two problems share those rows:

- ``min_cost(bound)``: least cost (estimated recompute time unless told otherwise) with
  every row <= bound;
- ``min_peak()``: the lowest reachable model peak, ties broken by cost.
"""

from __future__ import annotations

import warnings
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.measure.ledger import ancestors
from memfit.plan.candidates import Option

__all__ = ["Problem", "Solution"]

_MiB = float(2**20)  # rows in MiB keep HiGHS's tolerances meaningful for GiB-sized peaks

# HiGHS stops a solve after this many branch-and-bound nodes, not after a wall-clock time: a
# time limit made the plan depend on how busy the host was (Llama-3-8B dims on 4 fake ranks:
# optimal after 2,617 nodes, 19 CPU s; stopped by a 30 s limit at 2,022 nodes, 0.5% from
# proven, on a host at load 5). Node for node HiGHS is deterministic, so the same problem gets
# the same plan on any host. The time limit stays only as a safety net far beyond it.
def _options(**more: float) -> dict[str, float]:
    # a new dict per solve: scipy's milp pops "node_limit" out of the one it is given
    return {"node_limit": 5_000, "time_limit": 600.0, **more}


_PRICED = {"mip_heuristic_run_feasibility_jump": False}
"""HiGHS options of a solve whose plan is only priced (:meth:`Problem.min_peak`)."""


_ROUNDS = 6
"""Rounds of :meth:`Problem._min_cost_by_rows` before the whole problem is solved instead."""
_PEAK_ROUNDS, _PEAK_ROWS = 30, 8
"""Rounds of :meth:`Problem._min_peak_by_rows`, and the rows each adds at most."""
_ROW_TOL = 1e-6
"""MiB a plan may exceed a row by and still be within it (about a byte: HiGHS's own rows
hold to its feasibility tolerance, 1e-7)."""
_UNSETTLED = object()


@dataclass(frozen=True)
class Solution:
    chosen: list[Option]
    model_peak_bytes: int
    cost_s: float


def _seconds(option: Option) -> float:
    return option.cost_s


def _delta(option: Option, tick: int) -> int:
    """What choosing ``option`` changes memory by at ``tick`` (outside its recompute), at
    every call of its module."""
    return sum(_call_delta(o, tick) for o in option.calls)


def _call_delta(option: Option, tick: int) -> int:
    if option.fwd_end <= tick < option.bwd_start:
        return -option.freed_bytes
    return option.extra_at(tick)


def _deltas(options: list[Option], pairs: list[_Pair], ticks: list[int]) -> np.ndarray:
    """What each column changes memory by at each of ``ticks``: row r, column j is
    :func:`_delta` of option j (then :meth:`_Pair.delta` of each pair) at ``ticks[r]``, the
    same integers, made a column at a time over every tick (a 553-option rank's 1,430 rows
    were 800k Python calls)."""
    t = np.asarray(ticks, dtype=np.int64)
    out = np.zeros((len(t), len(options) + len(pairs)))
    for j, option in enumerate(options):
        for o in option.calls:
            col = np.where((o.fwd_end <= t) & (t < o.bwd_start), -o.freed_bytes, 0)
            extra = (o.bwd_start <= t) & (t < o.bwd_end)  # outside [fwd_end, bwd_start): extra_at's
            if extra.any():
                held = np.full(len(t), o.held_bytes, dtype=np.int64)
                for until, nbytes in o.copies:
                    held += np.where(t < until, nbytes, 0)
                col = np.where(extra, held, col)
            out[:, j] += col
    for q, p in enumerate(pairs):
        out[:, len(options) + q] = np.where((p.start <= t) & (t < p.end), p.nbytes, 0)
    return out


@dataclass(frozen=True)
class _Pair:
    """Options ``i`` and ``k`` both chosen: memory changes by ``nbytes`` over ``[start, end)``
    (see :attr:`Option.pairs`)."""

    i: int
    k: int
    start: int
    end: int
    nbytes: int

    def delta(self, tick: int) -> int:
        return self.nbytes if self.start <= tick < self.end else 0


def _pairs(options: list[Option], by_module: dict[str, list[int]]) -> list[_Pair]:
    return [
        _Pair(i, k, start, end, nbytes)
        for i, option in enumerate(options)
        for o in option.calls
        for module, start, end, nbytes in o.pairs
        for k in by_module.get(module, [])
    ]


class Problem:
    """Rows and columns built once per (curve, options); solved for any bound.

    Columns are the options, then one per interacting pair (:class:`_Pair`), which the
    constraint ``x_i + x_k - y <= 1`` forces to 1 when both are chosen. A pair that adds
    bytes is never 1 otherwise (nothing rewards it); one that takes bytes off would be, so
    ``y <= x_i`` and ``y <= x_k`` hold it to the product."""

    def __init__(
        self,
        curve: list[int],
        start_bytes: int,
        options: list[Option],
        cost: Callable[[Option], float] | None = None,
        near: float = 0.0,
    ) -> None:
        self.options = options
        self.near = near
        """Relative cost within which ``min_cost`` prefers the simplest plan to the cheapest."""
        by_module: dict[str, list[int]] = {}
        for j, o in enumerate(options):
            by_module.setdefault(o.module, []).append(j)
        self.pairs = _pairs(options, by_module)
        self.curve = np.asarray(curve, dtype=np.float64)
        self.start_bytes = start_bytes
        n, n_opt = len(curve), len(options)
        width = n_opt + len(self.pairs)
        calls = [(j, o) for j, option in enumerate(options) for o in option.calls]
        ticks = {0, n, *(t for _, o in calls for t in (o.fwd_end, o.bwd_start, o.bwd_end, *(u for u, _ in o.copies)))}
        ticks |= {t for p in self.pairs for t in (p.start, p.end)}
        bounds = sorted(b for b in ticks if 0 <= b <= n)
        # Segment rows: every column is constant between two boundaries, so the segment's
        # highest tick bounds all of it.
        rows_tick = [a + int(np.argmax(self.curve[a:b])) for a, b in zip(bounds, bounds[1:]) if a < b]
        seg_start = {t: bounds[bisect_left(bounds, t + 1) - 1] for t in rows_tick}
        # Recompute rows: the memory just before M's backward (its freed bytes still off the
        # curve, its held inputs already on it) plus the recompute's own peak. Other options
        # count as at M's first backward tick: a backward that ended there has let go of what
        # it held before M's recompute starts.
        # (one a call: an option of several calls recomputes at each call's backward, where
        # its other calls count as at that tick)
        recompute_tick = [min(o.bwd_start, n) - 1 for _, o in calls]
        base = np.zeros(len(rows_tick) + len(calls))
        for r, t in enumerate(rows_tick):
            base[r] = self.curve[t]
        for c, t in enumerate(recompute_tick):
            base[len(rows_tick) + c] = self.curve[t] if t >= 0 else start_bytes
        a_rows = _deltas(options, self.pairs, [seg_start[t] for t in rows_tick] + [t + 1 for t in recompute_tick])
        for c, ((j, o), t) in enumerate(zip(calls, recompute_tick)):
            a_rows[len(rows_tick) + c, j] += _call_delta(o, t) - _call_delta(o, t + 1) + o.transient_bytes
        self._rows = a_rows / _MiB
        self._base = base / _MiB
        # One option per root-to-leaf path: for each module, its options and its ancestors'.
        link_rows, link_ub = [], []  # each row's upper bound
        for name in by_module:
            cols_on_path = [j for anc in ancestors(name) for j in by_module.get(anc, [])]
            row = np.zeros(width)
            row[cols_on_path] = 1
            link_rows.append(row)
            link_ub.append(1.0)
        for q, p in enumerate(self.pairs):
            row = np.zeros(width)
            row[[p.i, p.k]] = 1
            row[n_opt + q] = -1
            link_rows.append(row)
            link_ub.append(1.0)
            if p.nbytes < 0:
                # a pair that lowers memory rewards its column: y <= x_i and y <= x_k keep it
                # at 0 unless both are chosen (else the rows hold with y = 1 and one option alone,
                # and the plan's real peak is over the bound)
                for j in (p.i, p.k):
                    row = np.zeros(width)
                    row[j] = -1
                    row[n_opt + q] = 1
                    link_rows.append(row)
                    link_ub.append(0.0)
        self._links = np.array(link_rows) if link_rows else np.zeros((0, width))
        self._link_ub = np.array(link_ub)
        self._cost = np.array([(cost or _seconds)(o) for o in options] + [0.0] * len(self.pairs))
        self._tie = self._tie_break()
        self._blocks: dict[tuple[str, str], list[tuple[int, tuple[str, str, tuple[str, ...]]]]] | None = None

    def _columns(self, chosen: list[Option]) -> np.ndarray:
        x = [1.0 if o in chosen else 0.0 for o in self.options]
        return np.array(x + [x[p.i] * x[p.k] for p in self.pairs])

    def model_peak(self, chosen: list[Option]) -> int:
        """Peak the model predicts for a set of options (at least the start bytes).

        A recompute row whose option is not chosen reads the plain memory at that tick,
        which its segment's row already bounds, so every row can be taken as is."""
        mem = self._base + (self._rows @ self._columns(chosen) if self._rows.shape[1] else 0.0)
        return int(max(float(mem.max()) * _MiB if len(mem) else 0.0, self.start_bytes))

    def _constraints(self, bound_mib: float | None, at: list[int] | None = None) -> list[Any]:
        """Link rows (one option per path, pair columns) and memory rows (those numbered
        ``at``, or all); with no bound, memory rows are ``<= z`` for an extra last column ``z``
        (the peak being minimised)."""
        from scipy.optimize import LinearConstraint  # scipy at the first solve: 1 CPU s off every `import memfit`

        extra = bound_mib is None
        rows, base = (self._rows, self._base) if at is None else (self._rows[at], self._base[at])
        cons = []
        if len(self._links):
            links = np.hstack([self._links, np.zeros((len(self._links), 1))]) if extra else self._links
            cons.append(LinearConstraint(links, -np.inf, self._link_ub))
        if extra:
            cons.append(LinearConstraint(np.hstack([rows, -np.ones((rows.shape[0], 1))]), -np.inf, -base))
        else:
            cons.append(LinearConstraint(rows, -np.inf, bound_mib - base))
        return cons

    def _integrality(self) -> np.ndarray:
        # Options are 0/1; a pair column is continuous: its link row and memory rows
        # already pin it to x_i * x_k at an optimum.
        return np.concatenate([np.ones(len(self.options)), np.zeros(len(self.pairs))])

    def min_cost(self, bound_bytes: int) -> Solution | None:
        """Cheapest options keeping every row within ``bound_bytes``; None if impossible."""
        n = len(self.options)
        if n == 0:
            return Solution([], self.model_peak([]), 0.0) if self.model_peak([]) <= bound_bytes else None
        from scipy.optimize import Bounds, LinearConstraint, milp

        if self.near <= 0 and len(self._base):
            found = self._min_cost_by_rows(bound_bytes / _MiB)
            if found is not _UNSETTLED:
                return found
        constraints = self._constraints(bound_bytes / _MiB)
        # With `near`, this solve only finds the cost the second one stays near: within 2% is
        # enough (the second takes every plan within `near` of it). Proving the last percent
        # can take HiGHS thousands of nodes: zoo gpt's plan at 50%, whose identical blocks
        # leave the relaxation 1.2% under the optimum, ran 30 s (99,131 nodes) where a 2%
        # gap stops at the root in 0.08 s with a plan 0.002% dearer. Without `near` (costs
        # from fixed rates, not timings), the tie-break needs the tight gap.
        res = milp(
            c=self._cost + self._tie,
            constraints=constraints,
            integrality=self._integrality(),
            bounds=Bounds(0, 1),
            options=_options(mip_rel_gap=2e-2 if self.near > 0 else 1e-6),
        )
        if res.x is None or res.status not in (0, 1):
            return None
        best = float(self._cost @ res.x)
        if self.near <= 0 or best <= 0:
            return self._solution(res.x[:n])
        # Among the plans within `near` of the cheapest, the simplest: fewest options, whole
        # modules before selective ones. Costs are estimates from timings that move by a few
        # percent between runs; without this, near-ties (a block in full against the same
        # block keeping its matmuls) flip with them and each run prints another plan.
        simple = np.array([1.0 + (o.mode == "selective") for o in self.options] + [0.0] * len(self.pairs))
        res2 = milp(
            c=simple + self._tie / max(float(self._cost[:n].mean()), 1e-12),
            constraints=[*constraints, LinearConstraint(self._cost[None, :], -np.inf, best * (1 + self.near))],
            integrality=self._integrality(),
            bounds=Bounds(0, 1),
            options=_options(mip_rel_gap=1e-6),
        )
        x = res2.x if res2.x is not None and res2.status in (0, 1) else res.x
        return self._solution(x[:n])

    def _min_cost_by_rows(self, bound_mib: float) -> Solution | None | object:
        """The least cost within ``bound_mib``, solved on a few memory rows at a time.

        Few rows bind a rank's plan (on Llama-3-8B dims at 4 ranks one of 845: the end of the
        forward, where every layer's savings count alike), and on those rows the identical
        layers are interchangeable. HiGHS then sees the symmetry and proves the optimum in a
        few nodes (15 nodes, 0.8 to 1.3 CPU s), where the whole problem, whose other rows tell the
        layers apart, took 2,617 nodes (15 CPU s). The rows start with the highest one (the
        unplanned peak's); each round solves the cost alone (no tie-break: it would hide the
        symmetry), gives identical blocks' choices out in canonical order
        (:func:`_canonical`), and adds every row that plan exceeds. A plan within every row
        is optimal: fewer rows bound the cost from below. Not settled in ``_ROUNDS`` rounds,
        or a solve not proven: :data:`_UNSETTLED`, and the whole problem is solved as before."""
        from scipy.optimize import Bounds, milp

        rows = self._rows
        n = len(self.options)
        at = [int(np.argmax(self._base))]
        for _ in range(_ROUNDS):
            res = milp(
                c=self._cost,
                constraints=self._constraints(bound_mib, at),
                integrality=self._integrality(),
                bounds=Bounds(0, 1),
                options=_options(mip_rel_gap=1e-6),
            )
            if res.status == 2:  # fewer rows infeasible: so is the whole problem
                return None
            if res.status != 0 or res.x is None:
                return _UNSETTLED
            x = _canonical(self, res.x[:n] > 0.5, at)
            # pair columns as the solve set them (its blocks never move): the rows as the whole problem has them
            over = np.flatnonzero(self._base + rows @ np.concatenate([x, res.x[n:]]) > bound_mib + _ROW_TOL)
            if not len(over):
                return self._solution(x.astype(float))
            at = sorted({*at, *over.tolist()})
        return _UNSETTLED

    def _tie_break(self) -> np.ndarray:
        """A cost far below any real difference (at most 0.1% of the mean option's) that
        grows with where the option's module ends in the forward: among equal costs (the
        identical layers of a transformer, priced alike) the earliest modules win, the same
        choice in every run instead of whichever HiGHS meets first; also fewer options
        among equal sums. HiGHS's default relative gap (1e-4) would hide it: the gap is
        tightened to 1e-6."""
        n = len(self.options)
        mean = float(self._cost[:n].mean()) if n else 0.0
        ranked = sorted(range(n), key=lambda j: (self.options[j].fwd_end, self.options[j].module, self.options[j].save_ops))
        rank = np.empty(n)
        rank[ranked] = np.arange(1, n + 1)
        eps = 1e-3 * max(mean, 1e-12) * rank / (n + 1)
        return np.concatenate([eps, np.zeros(len(self.pairs))])

    def min_peak(self, priced: bool = False) -> Solution:
        """Options reaching the lowest model peak; among those, the cheapest.

        ``priced=True``: only the peak is used, not the plan (see :attr:`Solution.model_peak_bytes`;
        the plan is never run): HiGHS's feasibility-jump heuristic is off. On this problem HiGHS
        finds its answer at the root node by central rounding anyway, and the heuristic was most
        of the solve: Llama-3-8B dims on 8 fake ranks (553 columns, 877 dense memory rows) 5.6
        against 2.2 CPU s, the same plan. Where the lowest peak is reached by several plans the
        heuristic may pick another of them (a 2-block gpt: 6 solves of 26 in the planner's tests,
        the same peak in all 26), so a plan that is run is solved as before. Priced, it is
        solved on a few rows at a time first (:meth:`_min_peak_by_rows`)."""
        n = len(self.options)
        if n == 0:
            return Solution([], self.model_peak([]), 0.0)
        if priced and len(self._base):
            found = self._min_peak_by_rows()
            if found is not _UNSETTLED:
                return found
        res = self._peak_solve(None, priced)
        if res.x is None:
            return Solution([], self.model_peak([]), 0.0)
        return self._solution(res.x[:n])

    def _peak_solve(self, at: list[int] | None, priced: bool) -> Any:
        """HiGHS's answer to the lowest peak over the memory rows numbered ``at`` (or all)."""
        from scipy.optimize import Bounds, milp

        cost_scale = 1e-6 / max(float(self._cost.sum()), 1e-12)  # far below 1 MiB of peak
        width = len(self._cost)
        with warnings.catch_warnings():
            # scipy's milp names only a few of HiGHS's options; it passes the others on to HiGHS
            # with this warning (a HiGHS without the option skips it, with the same words)
            warnings.filterwarnings("ignore", message="Unrecognized options")
            return milp(
                c=np.concatenate([self._cost * cost_scale, [1.0]]),
                constraints=self._constraints(None, at),
                integrality=np.concatenate([self._integrality(), [0]]),
                bounds=Bounds(np.zeros(width + 1), np.concatenate([np.ones(width), [np.inf]])),
                options=_options(**_PRICED) if priced else _options(),
            )

    def _min_peak_by_rows(self) -> Solution | object:
        """The lowest model peak (priced: only its peak is used), solved on a few memory rows.

        A plan whose every row is within the peak ``z`` found on fewer rows reaches the lowest
        peak: fewer rows bound it from below (to the whole problem's relative gap). The rows
        start with the highest one; each round adds the ``_PEAK_ROWS`` rows the plan exceeds
        ``z`` by most (adding every row it exceeds brought back 803 of 845). Llama-3-8B dims at
        4 fake ranks: 3 rounds, 7 rows, 0.2 CPU s against 2.7 for the whole problem, the same
        peak. Not settled in ``_PEAK_ROUNDS`` rounds, or a solve not proven: :data:`_UNSETTLED`."""
        n = len(self.options)
        at = [int(np.argmax(self._base))]
        for _ in range(_PEAK_ROUNDS):
            res = self._peak_solve(at, priced=True)
            if res.status != 0 or res.x is None:
                return _UNSETTLED
            mem = self._base + self._rows @ res.x[:-1]
            over = np.flatnonzero(mem > res.x[-1] + _ROW_TOL)
            if not len(over):
                return self._solution(res.x[:n])
            at = sorted({*at, *over[np.argsort(-mem[over], kind="stable")][:_PEAK_ROWS].tolist()})
        return _UNSETTLED

    def blocks(self) -> dict[tuple[str, str], list[tuple[int, tuple[str, str, tuple[str, ...]]]]]:
        """The options of each numbered block (``model.layers.3`` and the modules inside it),
        keyed by (the block's parent, the block): each option's column and its name inside the
        block (path, mode, saved ops). Blocks any pair column touches are left out: their
        choices are not free to move."""
        if self._blocks is None:
            paired = {_block(self.options[j].module) for p in self.pairs for j in (p.i, p.k)}
            found: dict[tuple[str, str], list[tuple[int, tuple[str, str, tuple[str, ...]]]]] = {}
            for j, o in enumerate(self.options):
                named = _block(o.module)
                if named is not None and named not in paired:
                    found.setdefault((named[0].rpartition(".")[0], named[0]), []).append((j, (named[1], o.mode, o.save_ops)))
            self._blocks = found
        return self._blocks

    def _solution(self, x: np.ndarray) -> Solution:
        chosen = [o for o, v in zip(self.options, x) if v > 0.5]
        return Solution(chosen, self.model_peak(chosen), float(sum(o.cost_s for o in chosen)))


def _block(module: str) -> tuple[str, str] | None:
    """The numbered block ``module`` is in (its outermost numbered part: ``model.layers.3``
    of ``model.layers.3.mlp``) and its path inside it (``mlp``; empty for the block itself);
    None outside any."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1]), ".".join(parts[i + 1 :])
    return None


def _canonical(problem: Problem, x: np.ndarray, rows: list[int]) -> np.ndarray:
    """``x`` (one bool an option) with the choices of interchangeable blocks given out in
    canonical order: the tie-break among plans of equal cost.

    Blocks of one parent are interchangeable on ``rows`` when their options match name for
    name with equal costs and equal coefficients in every one of ``rows``: moving a block's
    choices to another then changes neither the cost nor any of those rows. Within each such
    class the blocks take, in forward order, the class's choices sorted by the bytes they
    free (most first), then by cost (dearest first), then by name: the earliest layers
    recompute the most."""
    x = x.copy()
    cost, sub = problem._cost, problem._rows[rows]
    classes: dict[tuple, list[str]] = {}
    named = problem.blocks()
    for (parent, name), cols in named.items():
        sig = tuple(sorted((key, cost[j], tuple(sub[:, j])) for j, key in cols))
        classes.setdefault((parent, sig), []).append(name)
    for (parent, _), names in classes.items():
        if len(names) < 2:
            continue
        names.sort(key=lambda b: min(problem.options[j].fwd_end for j, _ in named[parent, b]))
        chosen = []
        for b in names:
            cols = [(j, key) for j, key in named[parent, b] if x[j]]
            freed = sum(problem.options[j].freed_bytes for j, _ in cols)
            chosen.append((-freed, -sum(cost[j] for j, _ in cols), sorted(key for _, key in cols)))
        for b, (_, _, keys) in zip(names, sorted(chosen)):
            column = {key: j for j, key in named[parent, b]}
            for j in column.values():
                x[j] = False
            for key in keys:
                x[column[key]] = True
    return x
