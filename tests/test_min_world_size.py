"""How many ranks: min_world_size's answer against brute force over the candidate sizes (every
rank profiled at every size, every size planned for every rank), with uneven FSDP2 shards; the
work it skips (lower bounds, the unplanned profile reused by the plan) checked against the full
computation."""

from __future__ import annotations

import pytest

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

from memfit.errors import BudgetInfeasibleError, MemfitError  # noqa: E402
from memfit.measure.distributed import FakeGroup, StartOverLimit, profile_rank, profile_ranks, rank_state  # noqa: E402
from memfit.plan.distributed import min_world_size, plan_ranks, world_size_candidates  # noqa: E402

SIZES = (1, 2, 3)  # 3 shards this model unevenly: its last rank holds less


def _llama():
    from memfit import zoo

    # activations outweigh parameters enough at 64 tokens that recompute lowers the peak; one
    # layer: the searches profile and plan every rank at every size on fake tensors, whose cost
    # is per op (two layers took about half as long again)
    sizes = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return zoo.build("llama", vocab_size=96, seq_len=64, batch_size=2, **sizes)


@pytest.fixture(scope="module")
def brute():
    """Every rank of every candidate size, profiled unplanned."""
    work = _llama()
    return work, {n: profile_ranks(work, world_size=n, ranks=range(n)) for n in SIZES}


def _brute_answer(work, profiles, budget, sizes=SIZES):
    """(without recompute, with recompute, the plan): the smallest size at which every rank
    fits, unplanned; and at which plan_ranks, planned and verified on every rank (its own
    profiles recorded afresh), fits (a plan is never needed where the unplanned step fits)."""
    without = next((n for n in sizes if profiles[n].peak_bytes <= budget), None)
    for n in sizes:
        if n == without:
            return without, n, None
        try:
            return without, n, plan_ranks(work, budget, world_size=n, ranks=range(n))
        except BudgetInfeasibleError:
            continue
    return without, None, None


def test_ranks_differ_where_shards_are_uneven(brute):
    work, profiles = brute
    at3 = profiles[3].profiles
    assert at3[2].peak_bytes < at3[0].peak_bytes == at3[1].peak_bytes
    states = [rank_state(work, FakeGroup(3, r)) for r in range(3)]
    # equal layouts, equal steps; the parallelized state alone is a lower bound on the step
    assert states[0].layout == states[1].layout != states[2].layout
    assert at3[0].ledger.blocks == at3[1].ledger.blocks
    for r, st in enumerate(states):
        assert 0 < st.resident_bytes <= at3[r].ledger.start_bytes


def test_equals_brute_force_where_a_plan_is_needed(brute):
    work, profiles = brute
    budget = profiles[3].peak_bytes  # rank 0's at 3: the unplanned step fits from 3
    found = min_world_size(work, budget, world_sizes=SIZES)
    without, with_, plan = _brute_answer(work, profiles, budget)
    assert (found.without_recompute, found.with_recompute) == (without, with_) == (3, 2)
    rows = {row["world_size"]: row for row in found.rows}
    assert rows[3]["ranks"] == [0, 2] and rows[3]["worst_rank"] == 0  # ranks 0 and 1 are one layout
    assert rows[3]["rank_none_peak_bytes"] == {r: profiles[3].profiles[r].peak_bytes for r in (0, 2)}
    assert all(rows[n]["none_peak_bytes"] == profiles[n].peak_bytes for n in rows)
    # its plan (made from the unplanned profile it had, verified on rank 0 for ranks 0 and 1)
    # is the plan recorded afresh and verified on both ranks
    assert found.plan is not None and plan is not None and found.plan.checkpointed == plan.checkpointed
    assert found.plan.min_peak_bytes == plan.min_peak_bytes
    assert found.plan.rank_peak_bytes[0] == plan.rank_peak_bytes[0] == plan.rank_peak_bytes[1] <= budget
    # every rank parallelized: the same layouts, the same ranks profiled
    every = min_world_size(work, budget, world_sizes=(3,), ranks="all")
    assert every.rows[0]["ranks"] == [0, 2] and every.without_recompute == 3


def test_equals_brute_force_where_bounds_skip_work(brute):
    work, profiles = brute
    # below the 1-rank step's start (parameters and AdamW state): no plan there can fit
    budget = profiles[1].profiles[0].ledger.start_bytes - 1
    found = min_world_size(work, budget, world_sizes=(1, 2))
    assert (found.without_recompute, found.with_recompute) == _brute_answer(work, profiles, budget, (1, 2))[:2]
    assert found.rows[0]["skipped"] == "plan" and found.rows[0]["lower_bound_bytes"] > budget
    # below what one rank's parameters take: that size is not even profiled
    budget = rank_state(work, FakeGroup(1, 0)).resident_bytes - 1
    found = min_world_size(work, budget, world_sizes=(1,))
    assert (found.without_recompute, found.with_recompute) == _brute_answer(work, profiles, budget, (1,))[:2] == (None, None)
    assert found.rows[0]["skipped"] == "profile" and found.rows[0]["none_peak_bytes"] is None


def test_unplanned_must_hold_the_ranks(brute):
    work, profiles = brute
    with pytest.raises(MemfitError, match="unplanned holds"):
        plan_ranks(work, 10**9, world_size=3, unplanned=profiles[2])


def test_candidates():
    work = _llama()
    assert world_size_candidates(work, max_world_size=20) == [1, 2, 4, 8, 16]
    assert world_size_candidates(work, node_size=8, max_world_size=32) == [8, 16, 24, 32]
    assert world_size_candidates(work, world_sizes=[24, 8, 8, 12]) == [8, 12, 24]
    for kwargs, words in [
        (dict(world_sizes=[8, 0]), "world_sizes"),
        (dict(node_size=0), "node_size"),
        (dict(node_size=64, max_world_size=32), "no multiple"),
    ]:
        with pytest.raises(MemfitError, match=words):
            world_size_candidates(work, **kwargs)
    with pytest.raises(MemfitError, match="ranks"):
        min_world_size(work, 10**9, world_sizes=[1], ranks=())


def test_fsdp_chunks_made_when_indexed_are_torch_chunks():
    # the adapter replaces FSDP2's private _chunk_with_empty on the fake group: a torch that
    # moves it fails here; the views it makes are those torch.chunk makes
    import torch

    from memfit.measure import _distributed

    module = _distributed._fsdp_param_module()
    assert module is not None
    original = module._chunk_with_empty
    with _distributed.chunks_when_indexed():
        patched = module._chunk_with_empty
    assert module._chunk_with_empty is original and patched is not original
    for size in range(1, 13):
        t = torch.empty(size, 3, 4)
        for dim in (0, 1):
            for n in range(1, 9):
                want = original(t, n, dim)
                got = patched(t, n, dim)
                assert len(got) == len(want) == n
                for i in [*range(n), -1]:
                    a, b = got[i], want[i]
                    assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
                    assert a.numel() == 0 or a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def test_fsdp_chunks_made_when_indexed_leave_the_ledger_as_it_was(brute, monkeypatch):
    from contextlib import nullcontext

    from memfit.measure import _distributed
    from memfit.measure.distributed import profile_rank

    work, profiles = brute
    monkeypatch.setattr(_distributed, "chunks_when_indexed", nullcontext)
    for r in (0, 2):  # uneven shards at 3: the last rank's is shorter
        assert profile_rank(work, FakeGroup(3, r)).ledger.blocks == profiles[3].profiles[r].ledger.blocks


def test_cli_min_world_size(tmp_path, capsys):
    import json

    from memfit.cli import main

    argv = ["plan", "llama", "--size", "num_hidden_layers=1", "--size", "hidden_size=64", "--size", "intermediate_size=128"]
    argv += ["--size", "num_attention_heads=4", "--size", "vocab_size=256", "--device", "fake", "--budget", "1000B"]
    out = tmp_path / "w.json"
    # 1000 bytes: below any rank's parameters, so no size is profiled (the bound is shown)
    assert main([*argv, "--min-world-size", "--world-sizes", "2,1", "--ranks", "0,-1", "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    assert [r["world_size"] for r in found["rows"]] == [1, 2] and found["with_recompute"] is None
    assert all(r["skipped"] == "profile" and r["lower_bound_bytes"] > 1000 for r in found["rows"])
    assert "(state)" in capsys.readouterr().out
    for bad, words in [
        (["--min-world-size", "--world-sizes", "2,x"], "--world-sizes takes integers"),
        (["--min-world-size", "--world-sizes", "2", "--node-size", "8"], "drop --node-size"),
        (["--min-world-size", "--node-size", "8", "--max-world-size", "4"], "no multiple of 8"),
        (["--world-sizes", "2"], "--min-world-size"),
    ]:
        assert main([*argv, *bad]) == 2
        assert words in capsys.readouterr().err


def test_a_start_over_the_budget_skips_the_recorded_step(brute):
    work, profiles = brute
    start, peak = profiles[1].profiles[0].ledger.start_bytes, profiles[1].peak_bytes
    # one byte under what the 1-rank step starts with (parameters, AdamW state): only the
    # warm-up step runs there; the bound it gives is that start, to the byte
    found = min_world_size(work, start - 1, world_sizes=(1,))
    row = found.rows[0]
    assert (found.without_recompute, found.with_recompute) == (None, None)
    assert row["skipped"] == "plan" and row["none_peak_bytes"] is None and row["lower_bound_bytes"] == start
    with pytest.raises(StartOverLimit, match="over"):
        profile_rank(work, FakeGroup(1, 0), start_limit=start - 1)
    # at the start: the step is recorded, as it was without the limit
    found = min_world_size(work, peak, world_sizes=(1,))
    assert found.rows[0]["none_peak_bytes"] == peak and found.rows[0]["skipped"] is None
    assert profile_rank(work, FakeGroup(1, 0), start_limit=start).ledger.blocks == profiles[1].profiles[0].ledger.blocks


def test_the_first_ranks_state_read_off_its_profile(brute):
    """min_world_size reads the first rank's state (resident bytes, layout) off its own
    profile's parallelized step before the warm-up, not from a parallelize of its own: the
    same state as rank_state's, and the same profile to the byte as without the read."""
    import json

    work, profiles = brute
    for n, r in ((2, 0), (3, 2)):
        got = []
        prof = profile_rank(work, FakeGroup(n, r), on_state=got.append)
        assert got == [rank_state(work, FakeGroup(n, r))]
        assert json.dumps(prof.to_dict(), sort_keys=True) == json.dumps(profiles[n].profiles[r].to_dict(), sort_keys=True)

    class Stop(Exception):
        pass

    def stop(state):  # what on_state raises ends the profile before its warm-up step
        raise Stop

    with pytest.raises(Stop):
        profile_rank(work, FakeGroup(2, 0), on_state=stop)


def test_a_size_planned_on_its_profiles_verifier_answers_as_apart(brute, monkeypatch):
    """Where a plan may be needed, a size's unplanned step is recorded on the verifier the plan
    then runs on (one parallelize and warm-up, not two): every row, bound and the plan equal,
    to the byte of the JSON but the planning time, the search made apart (the unplanned profile
    on its own, then plan_ranks from it on a verifier of its own)."""
    import json

    from memfit.plan import distributed

    work, profiles = brute

    def answer(budget, sizes):
        out = min_world_size(work, budget, world_sizes=sizes).to_dict()
        if out["plan"] is not None:
            out["plan"].pop("planning_time_s")
        return json.dumps(out, sort_keys=True)

    # a plan at 2 ranks (1 rank over the budget); one byte under the 1-rank start: its
    # recorded step is not run
    asked = [(profiles[3].peak_bytes, (1, 2)), (profiles[1].profiles[0].ledger.start_bytes - 1, (1,))]
    folded = [answer(*a) for a in asked]
    monkeypatch.setattr(distributed, "_size", lambda *a: distributed._planned_apart(*a, None))
    assert folded == [answer(*a) for a in asked]
    assert json.loads(folded[0])["plan"]["checkpointed"] and json.loads(folded[1])["rows"][0]["skipped"] == "plan"
