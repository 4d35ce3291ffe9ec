"""The CUDA caching allocator model on sequences whose outcome follows from torch's rules by hand
(c10/cuda/CUDACachingAllocator.cpp), and ``memfit snapshot`` on a snapshot built here. No torch."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from memfit import Block as LedgerBlock
from memfit import Category, Ledger, Phase, Tick
from memfit.cli import main
from memfit.cuda.allocator import (
    Alloc,
    AllocatorConfigError,
    AllocatorOutOfMemory,
    AllocatorSettings,
    CachingAllocator,
    EmptyCache,
    Free,
    allocation_size,
    replay,
    round_size,
)
from memfit.cuda.snapshot import SnapshotError, load_snapshot, relive, replay_trace
from memfit.measure.ledger import START_TICK
from memfit.measure.replay import replay_ledger

MiB = 1 << 20


def _at(*addresses: int):
    """A segment_address callback handing out ``addresses`` in order."""
    it = iter(addresses)
    return lambda size, stream, expandable, small: next(it)


# -- sizes ------------------------------------------------------------------------------------


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000, 3_000_000)] == [512, 512, 1024, 1024, 3_000_320]
    # a small request gets a 2 MiB segment, up to 10 MiB a 20 MiB one, beyond that its own size in 2 MiB steps
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_roundup_power2_divisions():
    four = AllocatorSettings.parse("roundup_power2_divisions:4")
    # torch's own example, in KiB: 1200 lies between 1024 and 2048, whose quarters are 1024, 1280, 1536, 1792
    assert round_size(1200 * 1024, four) == 1280 * 1024
    assert round_size(2048 * 1024, four) == 2048 * 1024  # a power of two stays
    assert round_size(1000, four) == 1024  # below 512 x divisions: 512 B steps
    s = replay([Alloc("a", 1200 * 1024)], four)
    assert s.allocated_peak_bytes == 1280 * 1024 and s.reserved_peak_bytes == 20 * MiB
    # the first entry fills the intervals below it; '>' fills from the last named one on (itself included, as torch does)
    listed = AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert listed.roundup_power2_divisions == (1,) * 9 + (8,) * 7


# -- placement --------------------------------------------------------------------------------


def test_small_requests_share_a_2mib_segment():
    a = CachingAllocator()
    x, y = a.malloc(1000), a.malloc(1000)
    assert y.ptr == x.ptr + 1024  # best fit: the remainder of the same segment, split at 512 B granularity
    s = a.stats()
    assert s.allocated_peak_bytes == 2048 and s.reserved_peak_bytes == 2 * MiB and len(s.segments) == 1


def test_large_split_and_unsplit_remainder():
    a = CachingAllocator()
    x = a.malloc(3_000_000)  # 20 MiB segment, remainder > 1 MiB: split
    y = a.malloc(5 * MiB)
    assert x.size == 3_000_320 and y.ptr == x.ptr + 3_000_320
    assert a.reserved == 20 * MiB
    b = CachingAllocator()
    z = b.malloc(int(19.5 * MiB))  # its own 20 MiB segment; 0.5 MiB left is not split off
    assert z.size == 20 * MiB and b.allocated == 20 * MiB


def test_best_fit_by_size_then_address():
    a = CachingAllocator(segment_address=_at(0x30_0000_0000, 0x10_0000_0000, 0x20_0000_0000))
    blocks = a.malloc(14 * MiB), a.malloc(12 * MiB), a.malloc(12 * MiB)
    big, low, mid = (b.ptr for b in blocks)
    for b in blocks:
        a.free(b)
    assert a.malloc(11 * MiB).ptr == low  # smallest block that fits; of two equal ones the lower address
    assert a.malloc(12 * MiB).ptr == mid
    assert a.malloc(12 * MiB).ptr == big  # 14 MiB: split, 2 MiB > 1 MiB stays cached
    assert a.malloc(2 * MiB).ptr == big + 12 * MiB
    assert a.stats().reserved_peak_bytes == 38 * MiB


def test_free_merges_neighbours_and_empty_cache_releases_whole_segments():
    a = CachingAllocator()
    x, y, z = (a.malloc(2 * MiB) for _ in range(3))
    a.free(x)
    a.free(z)  # merges with the 14 MiB tail
    a.empty_cache()
    assert a.reserved == 20 * MiB  # y still splits the segment: nothing to release
    a.free(y)  # x, y and z's range merge into the whole segment again
    assert a.malloc(20 * MiB).ptr == x.ptr
    b = CachingAllocator()
    for blk in [b.malloc(2 * MiB) for _ in range(3)]:
        b.free(blk)
    b.empty_cache()
    assert b.reserved == 0 and [s.action for s in b.stats().segments] == ["segment_alloc", "segment_free"]


def test_pools_are_per_stream():
    a = CachingAllocator()
    x = a.malloc(4 * MiB, stream=0)
    first = x.ptr
    a.free(x)
    y = a.malloc(4 * MiB, stream=1)  # stream 0's cached block is not for stream 1
    assert y.ptr != first and a.reserved == 40 * MiB
    assert a.malloc(4 * MiB, stream=0).ptr == first


def test_release_cached_segments_and_retry_when_capacity_is_reached():
    s = replay([Alloc("a", 20 * MiB), Free("a"), Alloc("b", 30 * MiB)], capacity=40 * MiB)
    # 20 MiB cached + 30 MiB > 40 MiB: the cached segment is released and the cudaMalloc retried
    assert [(e.action, e.size) for e in s.segments] == [
        ("segment_alloc", 20 * MiB),
        ("segment_free", 20 * MiB),
        ("segment_alloc", 30 * MiB),
    ]
    assert s.reserved_peak_bytes == 30 * MiB
    assert replay([Alloc("a", 20 * MiB), Free("a"), Alloc("b", 30 * MiB)]).reserved_peak_bytes == 50 * MiB
    with pytest.raises(AllocatorOutOfMemory):
        replay([Alloc("a", 30 * MiB), Alloc("b", 20 * MiB)], capacity=40 * MiB)


def test_max_split_size():
    events = [Alloc("a", 50 * MiB), Free("a"), Alloc("b", 12 * MiB)]
    assert replay(events).reserved_peak_bytes == 50 * MiB  # the cached 50 MiB is split for b
    limited = AllocatorSettings.parse("max_split_size_mb:40")
    assert replay(events, limited).reserved_peak_bytes == 62 * MiB  # an oversize block is not split for a small request
    # an oversize request may take a cached block up to 20 MiB larger, whole
    s = replay([Alloc("a", 50 * MiB), Free("a"), Alloc("b", 45 * MiB)], limited)
    assert s.reserved_peak_bytes == 50 * MiB and s.allocated_peak_bytes == 50 * MiB
    assert replay([Alloc("a", 64 * MiB), Free("a"), Alloc("b", 42 * MiB)], limited).reserved_peak_bytes == 106 * MiB
    # out of room: cached oversize blocks are released first, one that is large enough
    s = replay([Alloc("a", 50 * MiB), Free("a"), Alloc("b", 12 * MiB)], limited, capacity=60 * MiB)
    assert [(e.action, e.size) for e in s.segments] == [
        ("segment_alloc", 50 * MiB),
        ("segment_free", 50 * MiB),
        ("segment_alloc", 12 * MiB),
    ]


def test_expandable_segments_grow_in_place():
    two = [Alloc("a", 12 * MiB), Alloc("b", 12 * MiB)]
    assert replay(two).reserved_peak_bytes == 24 * MiB
    a = CachingAllocator(AllocatorSettings.parse("expandable_segments:True"))
    x, y = a.malloc(12 * MiB), a.malloc(12 * MiB)
    assert y.ptr == x.ptr + 12 * MiB  # one segment, mapped in 20 MiB pages as it grows
    assert a.reserved == 40 * MiB and [e.action for e in a.segments] == ["segment_map", "segment_map"]
    a.free(x)
    a.free(y)
    a.empty_cache()  # whole free pages are unmapped
    assert a.reserved == 0 and a.segments[-1].action == "segment_unmap"


def test_garbage_collection_threshold():
    events = [Alloc("a", 30 * MiB), Alloc("b", 30 * MiB), Free("a"), Free("b"), Alloc("c", 40 * MiB)]
    assert replay(events, capacity=100 * MiB).reserved_bytes == 100 * MiB
    gc = AllocatorSettings.parse("garbage_collection_threshold:0.5")
    # 60 MiB reserved > 50% of 100 MiB before c's cudaMalloc: both cached blocks are as old as the average, both go
    s = replay(events, gc, capacity=100 * MiB)
    assert s.reserved_bytes == 40 * MiB and s.reserved_peak_bytes == 60 * MiB
    assert replay(events, gc).reserved_bytes == 100 * MiB  # no capacity, no threshold to cross


def test_settings_parse_and_errors():
    s = AllocatorSettings.parse("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert s.expandable_segments and s.max_split_size == 128 * MiB and s.garbage_collection_threshold == 0.6
    assert AllocatorSettings.parse(s.describe()) == s
    assert AllocatorSettings.parse("") == AllocatorSettings()
    for bad in (
        "max_split_size_mb:10",
        "colour:blue",
        "backend:cudaMallocAsync",
        "expandable_segments:yes",
        "garbage_collection_threshold:2",
    ):
        with pytest.raises(AllocatorConfigError):
            AllocatorSettings.parse(bad)


def test_replay_ledger_rounds_blocks_and_leaves_host_graph_out():
    F = Phase.FORWARD
    blocks = [
        LedgerBlock(0, 4 * MiB, Category.PARAMETER, Phase.START, None, START_TICK, None),
        LedgerBlock(1, 1000, Category.ACTIVATION, F, "a", 0, 2),
        LedgerBlock(2, 3 * MiB, Category.TEMPORARY, F, "a", 1, None),
        LedgerBlock(3, 855, Category.GRAPH, F, "a", 1, None),
    ]
    ticks = [Tick(F, "a", "mm"), Tick(F, "a", "relu"), Tick(F, "a", "free")]
    s = replay_ledger(Ledger(blocks, ticks))
    assert s.allocated_peak_bytes == 4 * MiB + 1024 + 3 * MiB
    assert s.reserved_peak_bytes == 20 * MiB + 2 * MiB  # the parameter's segment holds the temporary too
    assert replay([EmptyCache()]).reserved_peak_bytes == 0


# -- snapshots --------------------------------------------------------------------------------

P, Q, R = 0x7000_0000_0000, 0x7000_1000_0000, 0x7000_2000_0000
FRAMES = [
    {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
    {"filename": "/x/proj/train.py", "line": 7, "name": "step"},
]


def _snapshot() -> dict:
    """Recording started with one 20 MiB segment holding a 4 MiB tensor; the trace then does
    what torch's allocator does (a lands after the tensor; b needs a small segment; c its own)."""

    def ev(action, addr, size, frames=()):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}

    trace = [
        ev("alloc", P + 4 * MiB, 2 * MiB),
        ev("segment_alloc", Q, 2 * MiB),
        ev("alloc", Q, 1000),
        ev("free_requested", P + 4 * MiB, 2 * MiB),
        ev("free_completed", P + 4 * MiB, 2 * MiB),
        ev("segment_alloc", R, 24 * MiB),
        ev("alloc", R, 24 * MiB, FRAMES),
    ]

    def block(addr, size, state, requested=None):
        return {"address": addr, "size": size, "requested_size": requested or size, "state": state, "frames": []}

    def seg(addr, size, kind, blocks):
        return {
            "device": 0,
            "address": addr,
            "total_size": size,
            "stream": 0,
            "segment_type": kind,
            "is_expandable": False,
            "blocks": blocks,
        }

    segments = [
        seg(P, 20 * MiB, "large", [block(P, 4 * MiB, "active_allocated"), block(P + 4 * MiB, 16 * MiB, "inactive")]),
        seg(Q, 2 * MiB, "small", [block(Q, 1024, "active_allocated", 1000), block(Q + 1024, 2 * MiB - 1024, "inactive")]),
        seg(R, 24 * MiB, "large", [block(R, 24 * MiB, "active_allocated")]),
    ]
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"max_split_size": -1, "expandable_segments": False},
    }


def test_snapshot_relived_and_replayed():
    snap = _snapshot()
    rec = relive(snap)
    assert (rec.start_allocated_bytes, rec.start_reserved_bytes) == (4 * MiB, 20 * MiB)
    assert rec.stats.allocated_peak_bytes == 28 * MiB + 1024 and rec.stats.reserved_peak_bytes == 46 * MiB
    assert rec.stats.reserved_bytes == rec.dumped_reserved_bytes and rec.stats.allocated_bytes == rec.dumped_allocated_bytes
    out = replay_trace(snap)
    assert out.same_address == out.allocs == 3 and out.segment_allocs_matched == out.segment_allocs == 2
    # expandable: b gets a 2 MiB page, c two 20 MiB pages of a new large segment
    exp = replay_trace(snap, AllocatorSettings(expandable_segments=True))
    assert exp.stats.reserved_peak_bytes == 20 * MiB + 2 * MiB + 40 * MiB


def test_cli_snapshot_prints_and_writes_json(tmp_path, capsys):
    path, out = tmp_path / "snap.pickle", tmp_path / "out.json"
    path.write_bytes(pickle.dumps(_snapshot()))
    assert main(["snapshot", str(path), "--json", str(out)]) == 0
    text = "".join(capsys.readouterr().out.split())  # table cells fold long words at any width
    assert "Peaksovertherecordedspan" in text and "expandable_segments:True" in text and "proj/train.py:7step" in text
    data = json.loads(out.read_text())
    assert data["allocated_peak_bytes"] == 28 * MiB + 1024 and data["reserved_peak_bytes"] == 46 * MiB
    assert data["allocator_settings"]["expandable_segments"] is False
    assert data["what_if"][0]["reserved_peak_bytes"] == 62 * MiB
    assert main(["snapshot", str(path), "--max-split-size-mb", "20", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["what_if"][0]["allocator_settings"]["max_split_size_bytes"] == 20 * MiB


class _Sneaky:
    def __reduce__(self):
        return (str, ("this would have run",))


def test_pickle_with_a_global_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Sneaky()]]}))
    with pytest.raises(SnapshotError, match="builtins.str"):
        load_snapshot(path)
    assert main(["snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refuses to load it" in err


def test_not_a_snapshot(tmp_path, capsys):
    (tmp_path / "list.pickle").write_bytes(pickle.dumps([1, 2]))
    (tmp_path / "text.pickle").write_text("hello")
    for name in ("list.pickle", "text.pickle", "missing.pickle"):
        assert main(["snapshot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "not a memory snapshot" in err[0] and "not a pickle" in err[1] and "cannot read" in err[2]


def test_a_trace_that_starts_after_a_segment_was_freed_and_ends_with_empty_cache():
    """The reverse walk brings back a segment the trace frees (S: freed by an empty_cache at the
    start), and the replay mirrors the recorded run of segment frees as one empty_cache."""
    S = 0x7000_3000_0000

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size, "stream": 0}

    trace = [
        ev("segment_free", S, 20 * MiB),  # torch.cuda.empty_cache() right after recording began
        ev("segment_alloc", R, 24 * MiB),
        ev("alloc", R, 24 * MiB),
        ev("free_requested", R, 24 * MiB),
        ev("free_completed", R, 24 * MiB),
        ev("segment_free", R, 24 * MiB),  # and another at the end
    ]
    snap = {"segments": [], "device_traces": [trace]}
    rec = relive(snap)
    assert (rec.start_reserved_bytes, rec.stats.reserved_peak_bytes, rec.stats.reserved_bytes) == (20 * MiB, 24 * MiB, 0)
    out = replay_trace(snap)
    assert out.empty_cache_calls == 2 and out.stats.reserved_bytes == 0 and out.same_address == 1


def test_replay_of_a_measured_ledger():
    """A real (fake-tensor) profile's ledger: rounding and segments only ever add to its peak."""
    import memfit
    from memfit import zoo

    work = zoo.build("gpt", batch_size=2, n_layer=2, n_embd=64, block_size=32)
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, fake=True)
    s = replay_ledger(prof.ledger)
    tensors = prof.peak_bytes - prof.breakdown.get("autograd_graph", 0)
    assert tensors <= s.allocated_peak_bytes <= s.reserved_peak_bytes
    assert s.allocated_peak_bytes < tensors * 1.1 + 64 * 512  # 512 B rounding on a small model: a few percent


def test_an_expandable_segments_trace():
    """expandable_segments:True: the segment is mapped in 20 MiB pages as requests need them."""
    E = 0x7100_0000_0000

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size, "stream": 0}

    trace = [
        ev("segment_map", E, 20 * MiB),
        ev("alloc", E, 16 * MiB),  # 4 MiB of the page stay free
        ev("segment_map", E + 20 * MiB, 20 * MiB),
        ev("alloc", E + 16 * MiB, 16 * MiB),  # the free 4 MiB and a new page, merged
        ev("free_requested", E, 16 * MiB),
        ev("free_completed", E, 16 * MiB),
    ]
    blocks = [(E, 16 * MiB, "inactive"), (E + 16 * MiB, 16 * MiB, "active_allocated"), (E + 32 * MiB, 8 * MiB, "inactive")]
    segment = {
        "device": 0,
        "address": E,
        "total_size": 40 * MiB,
        "stream": 0,
        "segment_type": "large",
        "is_expandable": True,
        "blocks": [{"address": a, "size": n, "requested_size": n, "state": st} for a, n, st in blocks],
    }
    snap = {
        "segments": [segment],
        "device_traces": [trace],
        "allocator_settings": {"expandable_segments": True, "max_split_size": -1},
    }
    rec = relive(snap)
    assert (rec.stats.allocated_peak_bytes, rec.stats.reserved_peak_bytes, rec.start_reserved_bytes) == (32 * MiB, 40 * MiB, 0)
    assert rec.stats.reserved_bytes == rec.dumped_reserved_bytes and rec.stats.allocated_bytes == rec.dumped_allocated_bytes
    out = replay_trace(snap)
    assert out.same_address == 2 and out.segment_allocs_matched == out.segment_allocs == 2
    # without expandable segments each request gets a 16 MiB segment of its own
    assert replay_trace(snap, AllocatorSettings()).stats.reserved_peak_bytes == 32 * MiB


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-split-size-mb", "10"], "--max-split-size-mb must be >= 20"),
        (["--capacity", "lots"], "lots"),
        (["--device-index", "3"], "has GPUs 0 to 0, not 3"),
    ],
)
def test_cli_snapshot_bad_flags_are_one_line(flags, needle, tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    assert main(["snapshot", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_cli_what_if_keeps_the_recorded_settings_it_does_not_change(tmp_path):
    # --max-split-size-mb over a trace recorded with expandable segments and power-of-two
    # rounding changes the split limit only: the rest is what the trace ran with, not torch's defaults.
    snap = _snapshot()
    snap["allocator_settings"] = {
        "max_split_size": -1,
        "expandable_segments": True,
        "roundup_power2_divisions": {str(1 << (20 + i)): 4 for i in range(16)},
        "garbage_collection_threshold": 0.5,
    }
    path, out = tmp_path / "snap.pickle", tmp_path / "out.json"
    path.write_bytes(pickle.dumps(snap))
    recorded = AllocatorSettings.from_snapshot(snap["allocator_settings"])
    assert recorded.expandable_segments and any(recorded.roundup_power2_divisions)
    assert main(["snapshot", str(path), "--max-split-size-mb", "20", "--json", str(out)]) == 0
    (what_if,) = json.loads(out.read_text())["what_if"]
    asked = dataclasses.replace(recorded, max_split_size=20 * MiB)
    assert what_if["allocator_settings"] == asked.to_dict()
    assert what_if["reserved_peak_bytes"] == replay_trace(snap, asked).stats.reserved_peak_bytes
    assert main(["snapshot", str(path), "--expandable-segments", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["what_if"][0]["allocator_settings"] == recorded.to_dict()


# -- a step replayed as the training loop runs it ------------------------------------------------


def _loop_ledger():
    """Parameters P; AdamW-like state S (start); a step: activation A in forward, freed in
    backward; an optimizer temporary T; a cuBLAS workspace W first used at tick 1."""
    from memfit.measure.ledger import START_TICK, Block, Category, Ledger, Phase, Tick

    ticks = [Tick(Phase.FORWARD, "m", "mm"), Tick(Phase.FORWARD, "m", "mm"), Tick(Phase.BACKWARD, "m", "mm_bw"),
             Tick(Phase.OPTIMIZER, None, "_foreach_sqrt"), Tick(Phase.OPTIMIZER, None, "_foreach_sqrt")]
    blocks = [
        Block(0, 6 * MiB, Category.PARAMETER, Phase.START, None, START_TICK, None),
        Block(1, 6 * MiB, Category.OPTIMIZER, Phase.START, None, START_TICK, None),
        Block(2, 3 * MiB, Category.INPUT, Phase.START, None, START_TICK, None),
        Block(3, 5 * MiB, Category.ACTIVATION, Phase.FORWARD, "m", 0, 2),
        Block(4, 2 * MiB, Category.WORKSPACE, Phase.START, None, START_TICK, None),
        Block(5, 6 * MiB, Category.TEMPORARY, Phase.OPTIMIZER, None, 3, 4),
    ]
    return Ledger(blocks, ticks, first_use={4: 1})


def test_first_step_makes_optimizer_state_and_workspaces_where_the_program_does():
    from memfit.measure.replay import _start_placement, _step_events, _successors

    led = _loop_ledger()
    before, during = _start_placement(led)
    assert [b.id for b in before] == [0, 2]  # model, then inputs: made before the loop
    assert {t: [b.id for b in bs] for t, bs in during.items()} == {3: [1], 1: [4]}
    first = _step_events(led, 1, *_successors(led)[:1], during)
    names = [(type(e).__name__, e.id) for e in first]
    # the workspace at its first use (after the activation), the state at the first optimizer tick
    assert names == [("Alloc", (1, 3)), ("Alloc", ("start", 4)), ("Free", (1, 3)), ("Alloc", ("start", 1)),
                     ("Alloc", (1, 5)), ("Free", (1, 5))]
    steady = _step_events(led, 2, {}, None)
    assert [(type(e).__name__, e.id) for e in steady] == [("Alloc", (2, 3)), ("Free", (2, 3)), ("Alloc", (2, 5)), ("Free", (2, 5))]


def test_replay_training_runs_until_the_allocator_repeats_itself():
    from memfit.measure.replay import replay_training

    run = replay_training(_loop_ledger())
    assert run.steady and run.steps == 2  # the second step leaves the allocator as the first did
    # P and the input at construction (a 20 MiB segment, 11 MiB left), the activation and the
    # workspace split from what is left; the state (6 MiB) fits in neither the activation's freed
    # 5 MiB nor the last 4: a second segment, which the temporary shares. Peak: P, input,
    # workspace, state and temporary (the activation is freed before the optimizer)
    assert run.stats.reserved_peak_bytes == 40 * MiB
    assert run.stats.allocated_peak_bytes == (6 + 3 + 2 + 6 + 6) * MiB
    assert replay_training(_loop_ledger(), max_steps=1).steps == 1


def test_start_state_is_placed_in_program_order():
    """The blocks alive at the step's start come in the order ``model.to(device)`` makes them
    (nn.Module._apply: children first, each module's parameters then its buffers), then the
    inputs: a root's own parameter after its children's, BatchNorm's buffers beside its weights
    (model.parameters() then model.buffers() would put the root's first and every buffer last)."""
    import torch

    import memfit
    from memfit.measure.ledger import START_TICK, Category
    from memfit.measure.replay import _start_placement

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(7))
            self.lin = torch.nn.Linear(3, 5)
            self.bn = torch.nn.BatchNorm1d(5)

        def forward(self, x):
            return self.bn(self.lin(x)) * self.scale[:5]

    model = Scaled()
    prof = memfit.profile(model, torch.randn(4, 3))
    P, B, IN = Category.PARAMETER, Category.BUFFER, Category.INPUT
    start = [b for b in sorted(prof.ledger.blocks, key=lambda b: b.id) if b.born == START_TICK]
    got = [(b.category, b.nbytes) for b in start if b.category in (P, B, IN)]
    # lin.weight, lin.bias, bn.weight, bn.bias, bn.running_mean, running_var, num_batches_tracked, scale, x
    assert got == [(P, 60), (P, 20), (P, 20), (P, 20), (B, 20), (B, 20), (B, 8), (P, 28), (IN, 48)]
    # and the allocator model makes them before the first step in that order
    before, _ = _start_placement(prof.ledger)
    assert [b.id for b in before] == [b.id for b in start if b.category in (P, B, IN)]
