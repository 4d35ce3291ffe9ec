"""The plan's MILP stops by work done, not by the clock: the same problem gets the same plan
on a busy host as on a quiet one.

HiGHS used to stop each solve after 30 s of wall-clock time. On Llama-3-8B dimensions on 4
fake ranks the cheapest-plan solve needs 2,617 branch-and-bound nodes (19 CPU s); at load 5
the limit stopped it at 2,022 nodes and memfit printed another plan than on a quiet host.
A node limit is deterministic. scipy's ``milp`` pops ``node_limit`` out of the options dict
it is given, so every solve must get a dict of its own: a shared one lost its node limit
after the first solve (caught here).
"""

from __future__ import annotations

import scipy.optimize

from memfit import zoo
from memfit.measure.profile import profile as measure_profile
from memfit.plan.candidates import DeviceRates, build_candidates
from memfit.plan.solver import Problem


def _problems(*nears: float) -> list[Problem]:
    work = zoo.build("gpt", n_layer=2, batch_size=2)
    prof = measure_profile(work.model, work.inputs, loss_fn=work.loss_fn, fake=True)
    calls = {n: m.calls for n, m in prof.modules.items()}
    cands = build_candidates(prof.ledger, {n: None for n in prof.modules}, rates=DeviceRates.for_device("cpu"), calls=calls)
    assert cands.options
    return [Problem(prof.ledger.curve(), prof.ledger.start_bytes, cands.options, near=near) for near in nears]


def test_every_solve_is_bounded_by_nodes_not_by_the_clock(monkeypatch):
    seen: list[dict] = []
    real = scipy.optimize.milp

    def spy(*args, **kwargs):
        seen.append(dict(kwargs.get("options") or {}))  # as given, before scipy pops from it
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    for problem in _problems(0.0, 0.05):
        lowest = problem.min_peak()
        bound = (lowest.model_peak_bytes + problem.model_peak([])) // 2
        answers = [(problem.min_peak(), problem.min_cost(bound)) for _ in range(2)]
        first, again = ([(o.module, o.mode) for o in s.chosen] for s in (answers[0][1], answers[1][1]))
        assert first == again and answers[0][0].model_peak_bytes == answers[1][0].model_peak_bytes == lowest.model_peak_bytes
    assert len(seen) >= 6
    for options in seen:
        assert options.get("node_limit") == 5_000, options
        assert options.get("time_limit", float("inf")) >= 600, options
