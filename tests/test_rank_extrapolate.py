"""A rank's step of L identical layers synthesized from the same rank's steps with 4, 5 and 6
layers (:mod:`memfit.measure.rank_layers`; issue 26 item 3): on configs small enough to record
whole too, every per-rank JSON is the whole model's; what cannot be shown periodic (DDP's
buckets, FSDP2's last blocks kept, pipeline stages, layers that differ) runs the whole model,
saying why; and the check at the third step refuses FSDP2's cross-layer buffers where too few
layers are recorded to see a middle layer's."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import needs, skip_without_fake_collectives

pytestmark = needs("transformers")

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


@pytest.fixture(autouse=True)
def _small_models_too(monkeypatch):
    # the configs here are small enough to record whole too: from fewer layers from 7 on
    from memfit.measure import rank_layers

    monkeypatch.setattr(rank_layers, "MIN_LAYERS", 7)


def llama(layers: int = 7, **kw):
    from memfit import zoo

    return zoo.build("llama", batch_size=2, seq_len=32, num_hidden_layers=layers, **{**SIZES, **kw})


def _whole(work):
    return dataclasses.replace(work, layers=None)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fsdp2_profile_from_fewer_layers_is_the_whole_models(world_size):
    from memfit.measure.distributed import profile_ranks

    work = llama(parallel="fsdp2")
    got = profile_ranks(work, world_size=world_size)
    assert got.layers == {0: None}  # synthesized from 4, 5 and 6 layers, checked at 6
    whole = profile_ranks(_whole(work), world_size=world_size)
    assert "Workload.layers" in whole.layers[0]
    assert got.to_json() == whole.to_json()


def test_uneven_last_rank_from_fewer_layers():
    # 3 ranks: dimensions of 64 and 256 do not split evenly, so the last rank's shards are shorter
    from memfit.measure.distributed import profile_ranks

    work = llama(parallel="fsdp2")
    got = profile_ranks(work, world_size=3, ranks=(2,))
    assert got.layers == {2: None}
    assert got.to_json() == profile_ranks(_whole(work), world_size=3, ranks=(2,)).to_json()


def test_too_few_layers_recorded_the_check_refuses_fsdp2(monkeypatch):
    # from 2, 3 and 4 layers the layer beside the one inserted is the first (whose backward
    # prefetches no all-gather) or the last (whose backward frees no reduce-scatter before it):
    # FSDP2's buffers across layers are not one layer's insertion, and the check refuses it
    # (profile_ranks then runs the whole model, as for any refusal)
    from memfit.measure import rank_layers
    from memfit.measure.distributed import FakeGroup, layered_rank

    monkeypatch.setattr(rank_layers, "EXTRAPOLATE_FROM", 2)
    why = layered_rank(llama(parallel="fsdp2"), FakeGroup(2, 0))
    assert isinstance(why, str) and ("repeat no period" in why or "synthesized differs from the recorded one" in why), why


def test_fake_cuda_is_refused_before_any_step():
    # fake CUDA numbers streams per process: the fewer-layer steps would renumber the whole
    # model's after them, and no two of them are alike
    from memfit.measure.distributed import FakeGroup, layered_rank

    assert "fake CUDA" in layered_rank(llama(parallel="fsdp2"), FakeGroup(2, 0, "cuda"))


def test_ddp_is_refused_once_parallelized():
    # DDP's buckets group parameters by bytes across layers: refused before any step runs
    from memfit.measure.distributed import FakeGroup, layered_rank

    assert "buckets" in layered_rank(llama(parallel="ddp"), FakeGroup(2, 0))


def test_refusals_named_before_any_step():
    from memfit.measure import rank_layers
    from memfit.measure.distributed import fsdp2
    from memfit.workload import Parallel

    refused = rank_layers.refused
    assert refused(llama(parallel="fsdp2")) is None
    assert "6 layers, fewer than 7" in refused(llama(layers=6, parallel="fsdp2"))
    assert "pipeline" in refused(llama(parallel="pp", pp=2))
    kept = llama(parallel="fsdp2")
    kept.parallel = Parallel(fsdp2(lambda m: m.model.layers, keep_last=1), name="fsdp2")
    assert "keep_last" in refused(kept)
    assert "checkpointing" in refused(llama(parallel="fsdp2", gradient_checkpointing=True))
    assert "Workload.layers" in refused(_whole(llama(parallel="fsdp2")))
    # a copy whose model is not the one the layers were described for
    other = dataclasses.replace(llama(parallel="fsdp2"), model=llama(layers=8, parallel="fsdp2").model)
    assert "list of 7 layers" in refused(other)


def test_a_plan_applied_drops_the_layers():
    from memfit.measure.distributed import with_recompute

    work = llama(parallel="fsdp2")
    planned = with_recompute(work, {"model.layers.0.mlp": ("full", ())})
    assert planned.layers is None and work.layers is not None


def test_split_and_join_of_a_tick_freeing_many_blocks():
    skip_without_fake_collectives()  # an FSDP2 step on the fake group
    # a fake CPU step frees its estimated autograd graph at one tick: split into one tick a
    # block for the synthesis, then joined back to the same ledger
    from memfit.measure import rank_layers
    from memfit.measure.distributed import FakeGroup, _small_step

    small = _small_step(llama(parallel="fsdp2"), FakeGroup(2, 0), 4)
    split, joined = rank_layers._split(small.ledger)
    assert joined and len(split.ticks) > len(small.ledger.ticks)
    assert rank_layers._join(split, joined).to_dict() == small.ledger.to_dict()


@pytest.mark.parametrize("world_size", [1, 4])
def test_min_world_size_rows_from_fewer_layers_are_the_whole_models(world_size):
    # a size measured after a plan was found (min_world_size's _unplanned), at 3.45 MB per
    # rank: 1 rank starts over it after its warm-up step (its row from the synthesized step's
    # start: the bytes the whole model's warm-up leaves), 4 ranks fit unplanned
    from memfit.plan import distributed

    work = llama(parallel="fsdp2")
    rows, profiles = [], []
    for w in (work, _whole(work)):
        row = {"world_size": world_size, "ranks": [], "lower_bound_bytes": None, "skipped": None}
        got = distributed._unplanned(w, world_size, sorted({0, world_size - 1}), 3_450_000, row, True)
        rows.append(row)
        profiles.append(None if got is None else got.to_json())
    assert rows[0] == rows[1] and profiles[0] == profiles[1]
    assert rows[0]["skipped"] == ("plan" if world_size == 1 else None)
