"""What fit on one device and fit per rank share (levers/ties.py): the near-tie rule, a
candidate's what-if row and the one-line refusal when nothing fits."""

from __future__ import annotations

import pytest

from memfit.errors import BudgetInfeasibleError
from memfit.levers.ties import TIE, Candidate, choose, infeasible
from memfit.measure.timing import StepTimes


def _cand(name: str, time_s: float, levers: tuple[str, ...] = (), peak: int = 100, measured: list[float] | None = None) -> Candidate[str]:
    got = StepTimes(seconds=measured, peak_bytes=peak + 1) if measured is not None else None
    return Candidate(name, None, peak, time_s, levers, got)


def _fewer_levers(c: Candidate[str]) -> tuple:
    return (len(c.levers),)


def test_choose_takes_the_simpler_of_near_ties_and_the_fastest_beyond():
    fast = _cand("fast", 1.0, ("a", "b"))
    near = _cand("near", 1.0 * (1 + TIE) * 0.99, ("a",))
    far = _cand("far", 1.0 * (1 + TIE) * 1.01, ())
    assert choose([fast, near, far], _fewer_levers).choice == "near"  # within TIE: fewer levers
    assert choose([fast, far], _fewer_levers).choice == "fast"  # beyond TIE: the faster
    # the same simplicity: the faster of the two
    assert choose([_cand("x", 1.02, ("a",)), _cand("y", 1.0, ("b",))], _fewer_levers).choice == "y"


def test_choose_by_measured_time_reads_the_runs_not_the_predictions():
    predicted_fast = _cand("p", 1.0, ("a",), measured=[3.0, 3.0, 3.0])
    measured_fast = _cand("m", 2.0, ("a",), measured=[1.0, 1.0, 1.0])
    assert choose([predicted_fast, measured_fast], _fewer_levers).choice == "p"
    assert choose([predicted_fast, measured_fast], _fewer_levers, measured=True).choice == "m"


def test_a_candidate_row_fits_and_shows_what_ran_beside_what_was_predicted():
    ran = _cand("r", 1.5, ("a",), peak=200, measured=[2.0, 1.0, 3.0])
    row = ran.row("r label", chosen=True, note="n")
    assert (row.label, row.levers, row.predicted_peak_bytes, row.predicted_step_time_s, row.fits) == ("r label", ("a",), 200, 1.5, True)
    assert (row.measured_peak_bytes, row.measured_step_time_s, row.note, row.chosen) == (201, 2.0, "n", True)
    unrun = _cand("u", 0.5).row("u label")
    assert (unrun.measured_peak_bytes, unrun.measured_step_time_s, unrun.chosen) == (None, None, False)
    # a run given up without a timed step has no measured time to show
    stopped = Candidate("s", None, 1, 1.0, (), StepTimes(seconds=[]))
    assert stopped.row("s").measured_step_time_s is None


@pytest.mark.parametrize(
    "kw, text",
    [
        (
            dict(hints=["micro-batching left out: why"], opt_in=["amp", "bf16"]),
            "budget 1.00 KiB is below the lowest peak memfit can reach with the levers allowed: 2.00 KiB (2048 bytes) with "
            "recompute; as it is the step peaks at 4 KiB; micro-batching left out: why; levers that change the numerics "
            "may go lower: allow amp,bf16",
        ),
        (
            dict(per=" per rank", reach="reaches at 4 ranks", hints=["more ranks shard more"]),
            "budget 1.00 KiB per rank is below the lowest peak memfit reaches at 4 ranks with the levers allowed: 2.00 KiB "
            "(2048 bytes) with recompute; as it is the step peaks at 4 KiB; more ranks shard more",
        ),
    ],
)
def test_infeasible_is_one_line_with_the_lowest_peak(kw, text):
    err = infeasible(1024, 2048, "recompute", "as it is the step peaks at 4 KiB", **kw)
    assert isinstance(err, BudgetInfeasibleError)
    assert str(err) == text and "\n" not in str(err)
    assert (err.min_peak_bytes, err.budget_bytes) == (2048, 1024)
