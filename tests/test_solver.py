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


def test_a_priced_lowest_peak_is_the_lowest_peak_of_a_plan_to_run(monkeypatch):
    """``min_peak(priced=True)`` (P_min priced on the ledger, its plan never run) solves
    without HiGHS's feasibility-jump heuristic, faster on a rank's dense rows; its peak is the
    same as the solve whose plan is run, and that solve is left as it was."""
    seen: list[dict] = []
    real = scipy.optimize.milp

    def spy(*args, **kwargs):
        seen.append(dict(kwargs.get("options") or {}))
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    for problem in _problems(0.0):
        run, priced = problem.min_peak(), problem.min_peak(priced=True)
        assert priced.model_peak_bytes == run.model_peak_bytes == problem.model_peak(priced.chosen)
        assert priced.model_peak_bytes < problem.model_peak([])
    assert "mip_heuristic_run_feasibility_jump" not in seen[0]
    assert seen[1]["mip_heuristic_run_feasibility_jump"] is False and seen[1]["node_limit"] == 5_000


def test_rows_are_each_options_delta_at_each_tick():
    """The memory rows are built a column at a time over every tick (numpy), not by a call
    per cell: the same integers as :func:`_delta` and the pair columns' own ``delta`` give,
    at every tick of a step with pair columns and copies."""
    from memfit.plan.solver import _delta, _deltas

    work = zoo.build("resnet", batch_size=2, image_size=16, base=8, depths=(1, 1, 1, 1))  # pair columns and copies; gpt's: held inputs
    prof = measure_profile(work.model, work.inputs, loss_fn=work.loss_fn, fake=True)
    calls = {n: m.calls for n, m in prof.modules.items()}
    cands = build_candidates(prof.ledger, {n: None for n in prof.modules}, rates=DeviceRates.for_device("cpu"), calls=calls)
    problem = Problem(prof.ledger.curve(), prof.ledger.start_bytes, cands.options)
    options, pairs = problem.options, problem.pairs
    (gpt,) = _problems(0.0)
    assert pairs and any(o.copies for o in options) and any(o.held_bytes for o in gpt.options)
    ticks = list(range(-1, len(gpt.curve) + 2))
    assert _deltas(gpt.options, [], ticks).tolist() == [[_delta(o, t) for o in gpt.options] for t in ticks]
    ticks = list(range(-1, len(problem.curve) + 2))
    got = _deltas(options, pairs, ticks)
    want = [[_delta(o, t) for o in options] + [p.delta(t) for p in pairs] for t in ticks]
    assert got.tolist() == want


def test_pooled_times_without_times_are_none_and_with_times_pool_the_repeats():
    """A fake profile's modules have no times: pooling returns them as they are (and skips
    grouping the ledger's ops, most of its work); measured times of identical blocks still
    become their median."""
    from memfit.plan.candidates import pooled_times

    work = zoo.build("gpt", n_layer=3, batch_size=2)
    prof = measure_profile(work.model, work.inputs, loss_fn=work.loss_fn, fake=True)
    none = {n: None for n in prof.modules}
    assert pooled_times(prof.ledger, none) == (none, 0.0)
    blocks = [f"transformer.h.{i}" for i in range(3)]
    timed = {**none, **dict(zip(blocks, (1.0, 2.0, 6.0)))}
    pooled, spread = pooled_times(prof.ledger, timed)
    assert [pooled[n] for n in blocks] == [2.0, 2.0, 2.0] and spread == (6.0 - 1.0) / 2.0


def _gpt_and_resnet() -> list[Problem]:
    problems = []
    for work in (zoo.build("gpt", n_layer=4, batch_size=2), zoo.build("resnet", batch_size=2, image_size=16, base=8, depths=(2, 2, 1, 1))):
        prof = measure_profile(work.model, work.inputs, loss_fn=work.loss_fn, fake=True)
        calls = {n: m.calls for n, m in prof.modules.items()}
        cands = build_candidates(prof.ledger, {n: None for n in prof.modules}, rates=DeviceRates.for_device("cpu"), calls=calls)
        problems.append(Problem(prof.ledger.curve(), prof.ledger.start_bytes, cands.options))
    return problems


def test_the_cheapest_plan_on_few_rows_costs_what_the_whole_problem_costs(monkeypatch):
    """``min_cost`` solves on the rows that bind and gives identical blocks' choices out in
    canonical order (the tie-break). At every bound from near the lowest peak to near the
    unplanned one, its plan is within the bound, and costs what the whole problem's optimum
    costs (the same objective solved on every row, to HiGHS's relative gap), never more
    than the whole problem solved as before (cost plus the old tie-break) and the same in
    every call. Four identical gpt blocks; a resnet's pair columns (their blocks stay put).
    On Llama-3-8B dims at 4 fake ranks (845 rows, one binding) the same comparison is in
    docs/benchmarks/distributed.md: 244.336430384 s against the whole problem's 244.336442022."""
    from scipy.optimize import Bounds, milp

    from memfit.plan import solver

    settled = []
    real = Problem._min_cost_by_rows
    monkeypatch.setattr(Problem, "_min_cost_by_rows", lambda self, b: settled.append(real(self, b)) or settled[-1])
    for problem in _gpt_and_resnet():
        low, none = problem.min_peak().model_peak_bytes, problem.model_peak([])
        for frac in (0.05, 0.25, 0.5, 0.75, 0.95):
            bound = int(low + frac * (none - low))
            fast, again = problem.min_cost(bound), problem.min_cost(bound)
            assert settled[-1] is not solver._UNSETTLED  # answered on few rows, not by the fallback
            exact = milp(
                c=problem._cost,
                constraints=problem._constraints(bound / solver._MiB),
                integrality=problem._integrality(),
                bounds=Bounds(0, 1),
                options=solver._options(mip_rel_gap=1e-9),
            )
            with monkeypatch.context() as m:
                m.setattr(solver, "_ROUNDS", 0)
                before = problem.min_cost(bound)
            assert settled[-1] is solver._UNSETTLED  # the whole problem, as before
            assert exact.status == 0 and fast is not None and before is not None
            assert problem.model_peak(fast.chosen) == fast.model_peak_bytes
            # a pair column that takes bytes off is 1 only with both its options (the rows alone
            # let it be 1 with one: the rows held, the plan's peak was over the bound)
            assert fast.model_peak_bytes <= bound and before.model_peak_bytes <= bound
            assert abs(fast.cost_s - exact.fun) <= 1e-6 * exact.fun + 1e-12, (fast.cost_s, exact.fun)
            assert fast.cost_s <= before.cost_s * (1 + 1e-6) + 1e-12
            assert [(o.module, o.mode, o.save_ops) for o in again.chosen] == [(o.module, o.mode, o.save_ops) for o in fast.chosen]
    assert len(settled) == 3 * 5 * 2


def test_identical_blocks_take_their_choices_in_forward_order():
    """The tie-break: among plans of equal cost the earliest of identical blocks recompute
    the most. A gpt of 4 identical blocks at a bound two blocks' full recompute reach: the
    blocks' choices, in forward order, free fewer bytes block by block."""
    gpt = _gpt_and_resnet()[0]
    low, none = gpt.min_peak().model_peak_bytes, gpt.model_peak([])
    for frac in (0.25, 0.5, 0.75):
        plan = gpt.min_cost(int(low + frac * (none - low)))
        freed = {f"transformer.h.{i}": 0 for i in range(4)}
        for o in plan.chosen:
            block = ".".join(o.module.split(".")[:3])
            if block in freed:
                freed[block] += o.freed_bytes
        assert list(freed.values()) == sorted(freed.values(), reverse=True), (frac, freed, plan.chosen)


def test_a_priced_lowest_peak_on_few_rows_is_the_whole_problems(monkeypatch):
    """``min_peak(priced=True)`` solves on a few rows at a time; its peak is the whole
    problem's (solved as before), and it came from the rows, not the fallback."""
    from memfit.plan import solver

    settled = []
    real = Problem._min_peak_by_rows
    monkeypatch.setattr(Problem, "_min_peak_by_rows", lambda self: settled.append(real(self)) or settled[-1])
    for problem in [*_gpt_and_resnet(), *_problems(0.0)]:
        fast = problem.min_peak(priced=True)
        assert settled[-1] is not solver._UNSETTLED
        with monkeypatch.context() as m:
            m.setattr(solver, "_PEAK_ROUNDS", 0)
            whole = problem.min_peak(priced=True)
        assert settled[-1] is solver._UNSETTLED
        assert fast.model_peak_bytes == whole.model_peak_bytes == problem.model_peak(fast.chosen) < problem.model_peak([])
