"""GPU memory snapshots (``torch.cuda.memory._dump_snapshot``) as input: read safely, re-lived,
and replayed through the allocator model (:mod:`memfit.cuda.allocator`). Plain data, no torch.

A snapshot holds the allocator's segments when it was dumped and, if history was being recorded,
a trace of every ``alloc``/``free``/``segment_alloc``/``segment_free`` since recording began. The
trace alone misses what existed before: the segments and tensors it starts with are rebuilt by
walking it backwards from the dumped state. From there the recorded allocations are re-lived at
their recorded addresses (what the GPU held: the recorded peaks), and the same requests are
replayed through the model, under the recorded settings (how well the model predicts this GPU)
or other ones (what ``expandable_segments`` or a ``max_split_size_mb`` would have reserved).

    snap = load_snapshot("memory_snapshot.pickle")
    rec = relive(snap)                 # the recorded span: rec.stats.reserved_peak_bytes
    out = replay_trace(snap, AllocatorSettings(expandable_segments=True))
"""

from __future__ import annotations

import bisect
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

from memfit.cuda.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfigError,
    AllocatorOutOfMemory,
    AllocatorSettings,
    AllocatorStats,
    Block,
    CachingAllocator,
    round_size,
)
from memfit.errors import MemfitError

__all__ = [
    "SnapshotError",
    "load_snapshot",
    "Allocation",
    "Relived",
    "TraceReplay",
    "relive",
    "replay_trace",
    "largest_allocations",
    "trace_device",
    "trace_timeline",
    "TraceTimeline",
    "TraceBlock",
    "TraceSegment",
]


class SnapshotError(MemfitError, ValueError):
    """A file is not a memory snapshot memfit can read (or would run code to read)."""


class _NoGlobals(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: any global (a class, a function) in the
    pickle is refused, since loading it could run arbitrary code."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise SnapshotError(
            f"the pickle refers to {module}.{name}; a memory snapshot holds only dicts, lists, strings and numbers, "
            "so memfit refuses to load it (unpickling it could run code)"
        )


def load_snapshot(path: str | Path) -> dict:
    """The snapshot in ``path``, read without running code from it."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = _NoGlobals(f).load()
    except SnapshotError as exc:
        raise SnapshotError(f"{p}: {exc}") from None
    except OSError as exc:
        raise SnapshotError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:  # a truncated or foreign file fails in many ways inside pickle
        raise SnapshotError(
            f"{p}: not a pickle ({type(exc).__name__}); expected a file written by torch.cuda.memory._dump_snapshot"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise SnapshotError(
            f"{p}: a pickle but not a memory snapshot (no 'segments' list); expected a file written by torch.cuda.memory._dump_snapshot"
        )
    return data


# -- the trace --------------------------------------------------------------------------------

_STATES_ALLOCATED = ("active_allocated", "active_pending_free")


def trace_device(snap: dict) -> int:
    """The device whose trace has the most events; of equals (no history), the one holding the most memory."""
    traces = snap.get("device_traces") or []
    held: dict[int, int] = {}
    for seg in snap["segments"]:
        d = int(seg.get("device", 0))
        held[d] = held.get(d, 0) + int(seg.get("total_size", 0))
    devices = set(range(len(traces))) | set(held) or {0}
    return max(sorted(devices), key=lambda d: (len(traces[d] or []) if d < len(traces) else 0, held.get(d, 0), -d))


def _trace(snap: dict, device: int) -> list[dict]:
    traces = snap.get("device_traces") or []
    return list(traces[device] or []) if device < len(traces) else []


@dataclass(frozen=True, slots=True)
class Allocation:
    """One recorded request: its size and where the code that made it was."""

    size: int
    address: int
    frames: tuple[str, ...]
    """Up to three Python frames, innermost first, as ``file:line function`` (torch's own left out)."""


def _frames(frames: list[dict] | None, limit: int = 3) -> tuple[str, ...]:
    out = []
    for f in frames or []:
        name = str(f.get("filename", ""))
        if not name.endswith(".py") or "/torch/" in name:
            continue
        out.append(f"{name}:{f.get('line', 0)} {f.get('name', '')}")
        if len(out) == limit:
            break
    return tuple(out)


def largest_allocations(snap: dict, device: int | None = None, *, top: int = 10) -> list[Allocation]:
    """The ``top`` largest allocations the trace recorded (the dumped blocks without history)."""
    device = trace_device(snap) if device is None else device
    events = [e for e in _trace(snap, device) if e.get("action") == "alloc"]
    if events:
        items = [Allocation(int(e["size"]), int(e["addr"]), _frames(e.get("frames"))) for e in events]
    else:
        items = [
            Allocation(int(b.get("requested_size", b["size"])), int(b["address"]), _frames(b.get("frames")))
            for s in snap["segments"]
            if int(s.get("device", 0)) == device
            for b in s.get("blocks", [])
            if b.get("state") in _STATES_ALLOCATED
        ]
    items.sort(key=lambda a: -a.size)
    return items[:top]


@dataclass(slots=True)
class _Segment:
    address: int
    size: int
    stream: int
    small: bool
    allocated: dict[int, tuple[int | None, int]]
    """address -> (block size if known, requested size)"""
    expandable: bool = False


@dataclass(slots=True)
class _Region:
    """An expandable segment: its mapped ranges when the trace began, and every address seen in it
    (the lowest is taken as its base: the first mapping starts there)."""

    stream: int
    small: bool
    mapped: list[list[int]]
    lo: int
    hi: int

    def add(self, a: int, b: int) -> None:
        self.mapped.append([a, b])
        self.mapped.sort()
        merged: list[list[int]] = []
        for r in self.mapped:
            if merged and r[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], r[1])
            else:
                merged.append(r)
        self.mapped = merged
        self.lo, self.hi = min(self.lo, a), max(self.hi, b)

    def remove(self, a: int, b: int) -> bool:
        for k, (x, y) in enumerate(self.mapped):
            if x <= a and b <= y:
                self.mapped[k : k + 1] = [r for r in ([x, a], [b, y]) if r[1] > r[0]]
                return True
        return False


@dataclass(slots=True)
class _Start:
    segments: dict[int, _Segment]
    regions: list[_Region]


def _region_for(regions: list[_Region], addr: int, stream: int, small: bool | None) -> _Region:
    """The expandable segment an address belongs to: the nearest one of its stream (and pool, if
    known); virtual ranges lie tens of GiB apart."""
    mine = [r for r in regions if r.stream == stream and (small is None or r.small == small)]
    if not mine:
        r = _Region(stream, bool(small), [], addr, addr)
        regions.append(r)
        return r
    return min(mine, key=lambda r: 0 if r.lo <= addr <= r.hi else min(abs(addr - r.lo), abs(addr - r.hi)))


def _start_state(snap: dict, device: int, trace: list[dict]) -> _Start:
    """The segments and allocated blocks when the trace began: the dumped state with the trace
    undone from its end."""
    segs: dict[int, _Segment] = {}
    regions: list[_Region] = []
    allocated: dict[int, tuple[int | None, int]] = {}
    for s in snap["segments"]:
        if int(s.get("device", 0)) != device:
            continue
        addr, size, stream, small = (
            int(s["address"]),
            int(s["total_size"]),
            int(s.get("stream", 0)),
            s.get("segment_type") == "small",
        )
        if s.get("is_expandable"):
            _region_for(regions, addr, stream, small).add(addr, addr + size)
        else:
            segs[addr] = _Segment(addr, size, stream, small, {})
        a = addr
        for b in s.get("blocks", []):
            if b.get("state") in _STATES_ALLOCATED:
                allocated[int(b.get("address", a))] = (int(b["size"]), int(b.get("requested_size", b["size"])))
            a += int(b["size"])
    for e in reversed(trace):
        act, addr = e.get("action"), int(e.get("addr", 0))
        if act == "alloc":
            if allocated.pop(addr, None) is None:
                raise SnapshotError(f"the trace allocates {addr:#x} but the dumped state does not hold it: an inconsistent trace")
        elif act == "free_completed":
            allocated[addr] = (None, int(e["size"]))
        elif act == "segment_alloc":
            if segs.pop(addr, None) is None:
                raise SnapshotError(f"the trace allocates segment {addr:#x} that the dumped state does not have")
        elif act == "segment_free":
            size = int(e["size"])
            segs[addr] = _Segment(addr, size, int(e.get("stream", 0)), size == SMALL_BUFFER, {})
        elif act == "segment_map":
            size, stream = int(e["size"]), int(e.get("stream", 0))
            r = _region_for(regions, addr, stream, None)
            if not r.remove(addr, addr + size):
                raise SnapshotError(f"the trace maps {addr:#x} that the dumped state does not have mapped")
            r.lo = min(r.lo, addr)
        elif act == "segment_unmap":
            size = int(e["size"])
            # a page of the small pool is 2 MiB, of the large pool 20 MiB
            _region_for(regions, addr, int(e.get("stream", 0)), size % LARGE_BUFFER != 0).add(addr, addr + size)
    for r in regions:
        for a, b in r.mapped:
            segs[a] = _Segment(a, b - a, r.stream, r.small, {}, expandable=True)
    starts = sorted(segs)
    for addr, info in allocated.items():
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= starts[i] + segs[starts[i]].size:
            raise SnapshotError(f"block {addr:#x} alive when the trace began lies in no segment: an inconsistent snapshot")
        segs[starts[i]].allocated[addr] = info
    _sizes_from_trace([s for s in segs.values() if not s.expandable and not s.small], trace)
    return _Start(segs, regions)


def _sizes_from_trace(segments: list[_Segment], trace: list[dict]) -> None:
    """Blocks alive at the start and freed during the trace left no size behind, and a large-pool
    block may have taken up to 1 MiB more than its request (a remainder too small to split off).
    A later allocation placed up to 1 MiB past the request while the block still lived shows
    where the block ended (a free block starts right after it)."""
    unknown = {a: seg for seg in segments for a, (size, _) in seg.allocated.items() if size is None}
    freed_at: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e.get("action") == "free_completed":
            a = int(e["addr"])
            if a in unknown and a not in freed_at:
                freed_at[a] = i
    if not freed_at:
        return
    allocs = sorted((int(e["addr"]), i) for i, e in enumerate(trace) if e.get("action") == "alloc")
    addrs = [a for a, _ in allocs]
    for a, until in freed_at.items():
        seg = unknown[a]
        requested = seg.allocated[a][1]
        lo = a + MIN_BLOCK * ((requested + MIN_BLOCK - 1) // MIN_BLOCK)
        k = bisect.bisect_right(addrs, lo)
        while k < len(allocs) and allocs[k][0] <= min(lo + SMALL_SIZE, seg.address + seg.size):
            if allocs[k][1] < until:
                seg.allocated[a] = (allocs[k][0] - a, requested)
                break
            k += 1


def _layout(seg: _Segment, settings: AllocatorSettings) -> list[tuple[int, bool, int]]:
    """A segment's blocks, ``(size, allocated, requested)`` in address order. Blocks freed during
    the trace left no size behind: their request rounded, or the whole gap to the next block
    where the allocator would not have split the remainder off."""
    out: list[tuple[int, bool, int]] = []
    at = seg.address
    addrs = sorted(seg.allocated)
    for k, addr in enumerate(addrs):
        size, requested = seg.allocated[addr]
        if addr > at:
            out.append((addr - at, False, 0))
        end = addrs[k + 1] if k + 1 < len(addrs) else seg.address + seg.size
        if size is not None and addr + size > end:
            size = None  # a hint from an allocation in the next segment
        if size is None:
            size = round_size(max(requested, 1), settings)
            gap = end - addr
            limit = settings.max_split_size
            unsplit = (gap - size <= SMALL_SIZE) or (limit is not None and size >= limit)
            if not seg.small and not seg.expandable and not settings.expandable_segments and unsplit:
                size = gap
            elif gap - size < MIN_BLOCK:
                size = gap
        out.append((size, True, requested))
        at = addr + size
    if at < seg.address + seg.size:
        out.append((seg.address + seg.size - at, False, 0))
    return out


_VIRTUAL = 1 << 40
"""Address space given to an expandable segment beyond the addresses the snapshot shows (torch
reserves 9/8 of the device's memory, which the snapshot does not say)."""


def _install(alloc: CachingAllocator, start: _Start, settings: AllocatorSettings, *, empty_regions: bool) -> dict[int, Block]:
    live: dict[int, Block] = {}
    for addr in sorted(start.segments):
        seg = start.segments[addr]
        if not seg.expandable:
            blocks = alloc.add_segment(seg.address, _layout(seg, settings), seg.stream, small=seg.small)
            live.update((b.ptr, b) for b in blocks)
    for r in start.regions:
        if not r.mapped and not empty_regions:
            continue  # made during the trace: the model makes it, at the recorded base
        ranges = [(a, _layout(start.segments[a], settings)) for a, _ in r.mapped]
        blocks = alloc.add_expandable_segment(r.lo, r.hi - r.lo + _VIRTUAL, r.stream, ranges, small=r.small)
        live.update((b.ptr, b) for b in blocks)
    return live


# -- re-living the recorded span --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Relived:
    """The recorded span as the GPU lived it (allocations at their recorded addresses)."""

    device: int
    settings: AllocatorSettings
    stats: AllocatorStats
    events: int
    allocs: int
    start_allocated_bytes: int
    start_reserved_bytes: int
    dumped_reserved_bytes: int
    """Sum of the dumped segments: the re-lived end must equal it."""
    dumped_allocated_bytes: int
    """Sum of the dumped allocated blocks: likewise."""
    has_trace: bool


def relive(snap: dict, device: int | None = None) -> Relived:
    """Peaks over the recorded span (the state it starts with included), from the recorded
    addresses and the allocator's split rule. Without a trace: the dumped state alone."""
    device, settings, trace, start, alloc, live = _relive_start(snap, device)
    start_alloc, start_res = alloc.allocated, alloc.reserved
    n_allocs = 0
    for e in trace:
        _relive_event(alloc, live, e)
        n_allocs += e.get("action") == "alloc"
    mine = [s for s in snap["segments"] if int(s.get("device", 0)) == device]
    dumped = sum(int(s["total_size"]) for s in mine)
    dumped_alloc = sum(int(b["size"]) for s in mine for b in s.get("blocks", []) if b.get("state") in _STATES_ALLOCATED)
    return Relived(
        device, settings, alloc.stats(), len(trace), n_allocs, start_alloc, start_res, dumped, dumped_alloc, bool(trace)
    )


def _relive_start(snap: dict, device: int | None):
    """The device, its recorded settings and trace, the state the trace began with, and an
    allocator holding that state with its live blocks by address: where re-living starts."""
    device = trace_device(snap) if device is None else device
    settings = AllocatorSettings.from_snapshot(snap.get("allocator_settings"))
    trace = _trace(snap, device)
    start = _start_state(snap, device, trace)
    alloc = CachingAllocator(settings)
    live = _install(alloc, start, settings, empty_regions=True)
    return device, settings, trace, start, alloc, live


def _relive_event(alloc: CachingAllocator, live: dict[int, Block], e: dict) -> None:
    """One recorded event, at its recorded address."""
    act = e.get("action")
    addr = int(e.get("addr", 0))
    try:
        if act == "alloc":
            live[addr] = alloc.place(addr, int(e["size"]), int(e.get("stream", 0)))
        elif act == "free_completed":
            alloc.free(live.pop(addr))
        elif act == "segment_alloc":
            alloc.new_segment(addr, int(e["size"]), int(e.get("stream", 0)))
        elif act == "segment_free":
            alloc.release_segment(addr)
        elif act == "segment_map":
            alloc.map_at(addr, int(e["size"]), int(e.get("stream", 0)))
        elif act == "segment_unmap":
            alloc.unmap_at(addr, int(e["size"]), int(e.get("stream", 0)))
    except (AllocatorConfigError, KeyError) as exc:
        raise SnapshotError(f"the trace does not re-live consistently ({exc}): a trace memfit cannot follow") from None


# -- replaying the requests through the model -------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceReplay:
    """The recorded requests replayed through the model, compared with what the GPU did."""

    settings: AllocatorSettings
    stats: AllocatorStats
    allocs: int
    same_address: int
    """Allocations the model placed at the address the real allocator chose."""
    segment_allocs: int
    """Recorded ``cudaMalloc`` s."""
    segment_allocs_matched: int
    """Recorded ``cudaMalloc`` s the model made at the same request with the same size."""
    segment_allocs_extra: int
    """``cudaMalloc`` s the model made that the GPU did not."""
    empty_cache_calls: int
    """Runs of recorded segment frees (``empty_cache`` or an out-of-memory retry), mirrored."""
    out_of_memory: bool = False
    """The requests did not fit in the ``capacity`` (the stats are those up to the failure)."""

    @property
    def same_address_fraction(self) -> float:
        return self.same_address / self.allocs if self.allocs else 1.0


def replay_trace(
    snap: dict,
    settings: AllocatorSettings | None = None,
    device: int | None = None,
    *,
    capacity: int | None = None,
    model: type[CachingAllocator] = CachingAllocator,
) -> TraceReplay:
    """The trace's requests through the model under ``settings`` (default: the recorded ones),
    starting from the state the trace began with. New segments take the address of a recorded
    ``cudaMalloc`` of the same size made for the same request (where the driver put it), so the
    model's placements can be compared address for address. ``model`` is the allocator class to
    replay through (a subclass with a rule changed, to see what the rule is worth)."""
    device = trace_device(snap) if device is None else device
    recorded = AllocatorSettings.from_snapshot(snap.get("allocator_settings"))
    settings = settings or recorded
    trace = _trace(snap, device)
    start = _start_state(snap, device, trace)
    address = _Addresses(start, recorded)
    alloc = address.alloc = model(settings, segment_address=address, capacity=capacity)
    live = _install(alloc, start, recorded, empty_regions=False)
    allocs = same = seg_total = seg_matched = seg_extra = empties = 0
    real_sizes: list[int] = []
    pending = address.pending
    prev = None
    for e in trace:
        act = e.get("action")
        addr = int(e.get("addr", 0))
        if act in ("segment_alloc", "segment_map"):
            pending.append((int(e["size"]), int(e.get("stream", 0)), addr))
            real_sizes.append(int(e["size"]))
            seg_total += 1
        elif act in ("segment_free", "segment_unmap"):
            if prev not in ("segment_free", "segment_unmap"):
                alloc.empty_cache()
                empties += 1
        elif act == "oom":
            pending.clear()
            real_sizes.clear()
        elif act == "alloc":
            before = len(alloc.segments)
            try:
                b = alloc.malloc(int(e["size"]), int(e.get("stream", 0)))
            except AllocatorOutOfMemory:
                return TraceReplay(settings, alloc.stats(), allocs, same, seg_total, seg_matched, seg_extra, empties, True)
            live[addr] = b
            allocs += 1
            same += b.ptr == addr
            made = sorted(s.size for s in alloc.segments[before:] if s.action in ("segment_alloc", "segment_map"))
            real = sorted(real_sizes)
            seg_matched += _common(made, real)
            seg_extra += len(made) - _common(made, real)
            pending.clear()
            real_sizes.clear()
        elif act == "free_completed":
            b = live.pop(addr, None)
            if b is not None:
                alloc.free(b)
        prev = act
    return TraceReplay(settings, alloc.stats(), allocs, same, seg_total, seg_matched, seg_extra, empties)


class _Addresses:
    """Where :func:`replay_trace`'s model puts a new segment: the address of a recorded
    ``cudaMalloc`` of the same size made for the same request (:attr:`pending`), where it does
    not overlap a segment the model still holds; an expandable segment at its recorded base;
    else a fresh address far above the recorded ones."""

    def __init__(self, start: _Start, recorded: AllocatorSettings) -> None:
        self.recorded = recorded
        self.pending: list[tuple[int, int, int]] = []  # (size, stream, addr) of recorded cudaMallocs not yet used
        self.fresh = 1 << 56
        # a recorded address must not overlap these
        self.held = {a: seg.size for a, seg in start.segments.items() if not seg.expandable}
        self.seen = 0  # segment events of the model already read into held
        # expandable segments made during the trace
        self.bases = {(r.stream, r.small): r.lo for r in start.regions if not r.mapped}
        self.alloc: CachingAllocator  # the model, set once it is made (it takes this as its segment_address)

    def __call__(self, size: int, stream: int, expandable: bool, small: bool) -> int:
        if expandable:
            base = self.bases.pop((stream, small), None) if self.recorded.expandable_segments else None
            if base is not None:
                return base
        for ev in self.alloc.segments[self.seen :]:
            if ev.action == "segment_alloc":
                self.held[ev.ptr] = ev.size
            elif ev.action == "segment_free":
                self.held.pop(ev.ptr, None)
        self.seen = len(self.alloc.segments)
        for k, (s, st, a) in enumerate(self.pending):
            if s == size and st == stream and not expandable:
                if any(a < p + n and p < a + size for p, n in self.held.items()):
                    continue  # the model still holds that range: the driver could not have returned it
                del self.pending[k]
                return a
        self.fresh += -(-size // SMALL_BUFFER) * SMALL_BUFFER + SMALL_BUFFER
        return self.fresh


def _common(a: list[int], b: list[int]) -> int:
    from collections import Counter

    return sum((Counter(a) & Counter(b)).values())


# -- what `memfit snapshot` reports ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    """A snapshot's recorded span, the model's replay of it, and what other settings would reserve."""

    path: str
    recorded: Relived
    model: TraceReplay | None
    """The trace under its own settings through the model (``None`` without a trace)."""
    what_if: tuple[TraceReplay, ...]
    largest: tuple[Allocation, ...]

    def to_dict(self) -> dict:
        r = self.recorded
        out = {
            "snapshot": self.path,
            "device": r.device,
            "allocated_peak_bytes": r.stats.allocated_peak_bytes,
            "reserved_peak_bytes": r.stats.reserved_peak_bytes,
            "fragmentation_bytes": r.stats.fragmentation_bytes,
            "reserved_at_allocated_peak_bytes": r.stats.reserved_at_allocated_peak_bytes,
            "allocator_settings": r.settings.to_dict(),
            "recorded_span": {
                "trace": r.has_trace,
                "events": r.events,
                "allocs": r.allocs,
                "start_allocated_bytes": r.start_allocated_bytes,
                "start_reserved_bytes": r.start_reserved_bytes,
                "end_allocated_bytes": r.stats.allocated_bytes,
                "end_reserved_bytes": r.stats.reserved_bytes,
            },
            "largest_allocations": [{"bytes": a.size, "address": a.address, "frames": list(a.frames)} for a in self.largest],
        }
        if self.model is not None:
            out["model"] = _replay_dict(self.model)
        out["what_if"] = [_replay_dict(w) for w in self.what_if]
        return out


def _replay_dict(t: TraceReplay) -> dict:
    return {
        "allocator_settings": t.settings.to_dict(),
        "allocated_peak_bytes": t.stats.allocated_peak_bytes,
        "reserved_peak_bytes": t.stats.reserved_peak_bytes,
        "reserved_end_bytes": t.stats.reserved_bytes,
        "fragmentation_bytes": t.stats.fragmentation_bytes,
        "out_of_memory": t.out_of_memory,
        "capacity_bytes": t.stats.capacity,
        "same_address_fraction": t.same_address_fraction,
        "segment_allocs_recorded": t.segment_allocs,
        "segment_allocs_matched": t.segment_allocs_matched,
        "segment_allocs_extra": t.segment_allocs_extra,
    }


def summarize(
    path: str | Path,
    *,
    what_if: list[AllocatorSettings | dict] | None = None,
    top: int = 10,
    device: int | None = None,
    capacity: int | None = None,
) -> SnapshotSummary:
    """Everything ``memfit snapshot`` shows. ``what_if`` defaults to the recorded settings with
    ``expandable_segments`` turned on (off, if the recording had it on); a dict in it is the
    recorded settings with those fields changed (``{"max_split_size": 128 * MiB}`` keeps the
    recording's rounding and the rest); ``capacity`` bounds what those may reserve (the GPU's
    memory: without it nothing is ever released to retry)."""
    snap = load_snapshot(path)
    n = max(len(snap.get("device_traces") or []), 1 + max((int(s.get("device", 0)) for s in snap["segments"]), default=0))
    if device is not None and device >= n:
        raise SnapshotError(f"{path}: the snapshot has GPUs 0 to {n - 1}, not {device}")
    device = trace_device(snap) if device is None else device
    rec = relive(snap, device)
    model = replay_trace(snap, device=device) if rec.has_trace else None
    if what_if is None:
        what_if = [{"expandable_segments": not rec.settings.expandable_segments}]
    what_if = [replace(rec.settings, **w) if isinstance(w, dict) else w for w in what_if]
    alts = tuple(replay_trace(snap, w, device, capacity=capacity) for w in what_if) if rec.has_trace else ()
    return SnapshotSummary(str(path), rec, model, alts, tuple(largest_allocations(snap, device, top=top)))


# -- the recorded span event by event (for pictures) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceBlock:
    """One allocated block over the recorded span. Events index the trace."""

    address: int
    size: int
    """As the allocator counts it (``memory_allocated``): the request rounded, or more."""
    born: int
    """The ``alloc`` event; -1 if alive when the trace began."""
    died: int | None
    """The ``free_completed`` event; ``None`` if alive at the dump."""
    frames: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TraceSegment:
    """A segment (or an expandable segment's mapped range) over the recorded span."""

    address: int
    size: int
    born: int
    """The ``segment_alloc``/``segment_map`` event; -1 if held when the trace began."""
    died: int | None
    """The ``segment_free``/``segment_unmap`` event; ``None`` if held at the dump."""
    small: bool
    expandable: bool


@dataclass(frozen=True)
class TraceTimeline:
    """The recorded span re-lived event by event: ``allocated[i]``/``reserved[i]`` are the
    bytes in blocks and in segments right after event ``i`` (their maxima are :func:`relive`'s
    peaks)."""

    device: int
    settings: AllocatorSettings
    actions: list[str]
    allocated: list[int]
    reserved: list[int]
    start_allocated_bytes: int
    start_reserved_bytes: int
    blocks: list[TraceBlock]
    segments: list[TraceSegment]


def trace_timeline(snap: dict, device: int | None = None) -> TraceTimeline:
    """The trace re-lived as :func:`relive` does, keeping the state after every event, each
    block's life and frames, and each segment's life. Without a trace: the dumped state, no events."""
    device, settings, trace, start, alloc, live = _relive_start(snap, device)
    # the dump's frames belong to the blocks alive at its end: those alive throughout get them
    dumped = {
        int(b["address"]): _frames(b.get("frames")) or _any_frames(b.get("frames"))
        for s in snap["segments"]
        if int(s.get("device", 0)) == device
        for b in s.get("blocks", [])
        if b.get("state") in _STATES_ALLOCATED and "address" in b
    }
    blocks: list[list] = [[a, b.size, -1, None, dumped.get(a, ())] for a, b in sorted(live.items()) if b.allocated]
    open_blocks = {rec[0]: k for k, rec in enumerate(blocks)}
    segments: list[list] = [[a, seg.size, -1, None, seg.small, seg.expandable] for a, seg in sorted(start.segments.items())]
    open_segments = {rec[0]: k for k, rec in enumerate(segments)}
    start_alloc, start_res = alloc.allocated, alloc.reserved
    actions, allocated, reserved = [], [], []
    for i, e in enumerate(trace):
        _relive_event(alloc, live, e)
        act, addr = str(e.get("action")), int(e.get("addr", 0))
        if act == "alloc":
            open_blocks[addr] = len(blocks)
            blocks.append([addr, live[addr].size, i, None, _frames(e.get("frames")) or _any_frames(e.get("frames"))])
        elif act == "free_completed":
            k = open_blocks.pop(addr, None)
            if k is not None:
                blocks[k][3] = i
        elif act in ("segment_alloc", "segment_map"):
            size = int(e["size"])
            open_segments[addr] = len(segments)
            small = size == SMALL_BUFFER if act == "segment_alloc" else size % LARGE_BUFFER != 0
            segments.append([addr, size, i, None, small, act == "segment_map"])
        elif act in ("segment_free", "segment_unmap"):
            k = open_segments.pop(addr, None)
            if k is not None:
                segments[k][3] = i
        actions.append(act)
        allocated.append(alloc.allocated)
        reserved.append(alloc.reserved)
    return TraceTimeline(
        device,
        settings,
        actions,
        allocated,
        reserved,
        start_alloc,
        start_res,
        # a block alive at the start and freed later: its address's frames in the dump are another block's
        [TraceBlock(a, n, b, d, f if b >= 0 or d is None else ()) for a, n, b, d, f in blocks],
        [TraceSegment(*rec) for rec in segments],
    )


def _any_frames(frames: list[dict] | None, limit: int = 3) -> tuple[str, ...]:
    """The innermost frames where no frame is the user's own: torch's Python frames if any,
    else the C++ ones below the allocator's own (the unwinder, ``CUDACachingAllocator``) that
    name a file: the op that asked (``ReduceOps.cpp ... max_kernel_impl``)."""
    frames = frames or []
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    if not py:
        inner = [
            k
            for k, f in enumerate(frames)
            if any(w in str(f.get("name", "")) + str(f.get("filename", "")) for w in _ALLOCATOR_FRAMES)
        ]
        frames = frames[inner[-1] + 1 :] if inner else frames
    named = py or [f for f in frames if f.get("filename") and f.get("filename") != "??"]
    return tuple(f"{f.get('filename', '')}:{f.get('line', 0)} {str(f.get('name', ''))[:160]}" for f in named[:limit])


_ALLOCATOR_FRAMES = ("CachingAllocator", "CapturedTraceback", "unwind", "memory_snapshot.cpp")
"""Words naming the frames a C++ stack starts with inside the allocator and its recorder."""
