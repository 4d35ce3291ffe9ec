"""A model of PyTorch's CUDA caching allocator, as plain data (no torch, no GPU).

What runs out on a GPU is not the sum of tensor bytes but what the caching allocator holds:
``max_memory_allocated`` (every block rounded up to 512 B, some larger still) and above all
``max_memory_reserved`` (the segments it ``cudaMalloc`` s). :class:`CachingAllocator` follows
the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``: ``malloc``,
``get_free_block``, ``should_split``, ``alloc_block``, ``free_block``, ``try_merge_blocks``,
``release_available_cached_blocks``, ``release_cached_blocks``, ``garbage_collect_cached_blocks``,
and the expandable-segment path) and ``c10/core/AllocatorConfig.cpp`` (the
``PYTORCH_CUDA_ALLOC_CONF`` options), so a sequence of allocations and frees measured anywhere
(a :class:`~memfit.measure.ledger.Ledger`, by :mod:`memfit.measure.replay`; a GPU's own trace) can be replayed to the very block
addresses the real allocator would choose::

    from memfit.cuda.allocator import Alloc, Free, AllocatorSettings, replay
    stats = replay([Alloc("a", 3_000_000), Alloc("b", 100), Free("a")])
    stats.allocated_peak_bytes, stats.reserved_peak_bytes     # 3000832 (3000320 + 512), 23068672 (20 MiB + 2 MiB)

Known limitations: one device; no CUDA graph private pools; ``record_stream`` (a block used on
another stream is freed at once here, where the real allocator waits on an event); the
``cudaMalloc`` of a segment fails only where ``capacity`` says so (a real GPU also holds the CUDA
context and other processes' memory, which are not the allocator's).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from memfit.errors import MemfitError

__all__ = [
    "AllocatorSettings",
    "AllocatorConfigError",
    "AllocatorOutOfMemory",
    "CachingAllocator",
    "SegmentEvent",
    "AllocatorStats",
    "Alloc",
    "Free",
    "EmptyCache",
    "replay",
    "round_size",
    "allocation_size",
]

MiB = 1 << 20
MIN_BLOCK = 512
"""kMinBlockSize: every size rounds up to a multiple of it."""
SMALL_SIZE = MiB
"""kSmallSize: the largest request served by the small pool."""
SMALL_BUFFER = 2 * MiB
"""kSmallBuffer: the small pool's segments (and its expandable segments' pages)."""
LARGE_BUFFER = 20 * MiB
"""kLargeBuffer: the segment for requests between 1 and 10 MiB (and the large pool's expandable pages)."""
MIN_LARGE_ALLOC = 10 * MiB
"""kMinLargeAlloc: from here on a request gets a segment of its own size (rounded to 2 MiB)."""
ROUND_LARGE = 2 * MiB
"""kRoundLarge."""
ROUNDUP_INTERVALS = 16
"""kRoundUpPowerOfTwoIntervals: roundup_power2_divisions has one value per power of two from 1 MiB to 64 GiB."""


class AllocatorConfigError(MemfitError, ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string (or an allocator option) the model cannot take."""


class AllocatorOutOfMemory(MemfitError):
    """The model could not reserve a segment within its ``capacity``: where the real allocator
    raises ``torch.OutOfMemoryError``."""


# -- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorSettings:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options that change where blocks go (defaults: torch's)."""

    expandable_segments: bool = False
    """One growing segment per stream and pool, mapped in 2 MiB / 20 MiB pages: no slivers."""
    max_split_size: int | None = None
    """Bytes (``max_split_size_mb`` x 1 MiB); blocks this large are never split. ``None``: no limit."""
    max_non_split_rounding: int = LARGE_BUFFER
    """How much larger than a request an unsplittable cached block may be and still serve it."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Per power-of-two interval from 1 MiB (index 0 also takes every smaller size) up: round a
    request up to the next of this many divisions of its interval (0 or 1: to 512 B only)."""
    garbage_collection_threshold: float = 0.0
    """With a capacity: before a new segment, free cached unsplit large blocks (oldest first) once
    reserved memory passes this fraction of it. 0: off."""
    variable: str = field(default="PYTORCH_CUDA_ALLOC_CONF", compare=False)
    """The environment variable they were read from (torch reads ``PYTORCH_CUDA_ALLOC_CONF``, else
    its device-generic ``PYTORCH_ALLOC_CONF``): what a report names. Not part of the settings."""

    @classmethod
    def parse(cls, conf: str | None, variable: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorSettings:
        """Settings from the ``PYTORCH_CUDA_ALLOC_CONF`` form, e.g.
        ``"expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"``;
        ``variable``: the environment variable ``conf`` came from."""
        if not conf:
            return cls(variable=variable)
        tokens = _lex(conf)
        values: dict = {}
        divisions = [0] * ROUNDUP_INTERVALS
        i = 0

        def value(i: int) -> tuple[int, str]:
            if i + 2 >= len(tokens) or tokens[i + 1] != ":":
                raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: {tokens[i]} takes a value after ':'")
            return i + 2, tokens[i + 2]

        while i < len(tokens):
            key = tokens[i]
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                i, v = value(i)
                mb = _int(v, key, conf)
                if mb < LARGE_BUFFER // MiB:
                    raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be >= {LARGE_BUFFER // MiB}, got {mb}")
                values["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = mb * MiB
            elif key == "garbage_collection_threshold":
                i, v = value(i)
                try:
                    t = float(v)
                except ValueError:
                    t = -1.0
                if not 0.0 < t < 1.0:
                    raise AllocatorConfigError(
                        f"PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold takes a number in (0, 1), got {v!r}"
                    )
                values["garbage_collection_threshold"] = t
            elif key in (
                "expandable_segments",
                "release_lock_on_cudamalloc",
                "release_lock_on_hipmalloc",
                "pinned_use_cuda_host_register",
                "pinned_use_hip_host_register",
                "pinned_use_background_threads",
                "graph_capture_record_stream_reuse",
            ):
                i, v = value(i)
                if v not in ("True", "False"):
                    raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} takes True or False, got {v!r}")
                if key == "expandable_segments":
                    values["expandable_segments"] = v == "True"
            elif key in ("pinned_num_register_threads", "pinned_reserve_segment_size_mb"):
                i, _ = value(i)  # host (pinned) memory: not the device allocator's business
            elif key == "backend":
                i, v = value(i)
                if v != "native":
                    raise AllocatorConfigError(
                        f"PYTORCH_CUDA_ALLOC_CONF: backend:{v} is not modelled; memfit models the native caching allocator (backend:native)"
                    )
            elif key == "roundup_power2_divisions":
                i = _parse_divisions(tokens, i, divisions, conf)
                values["roundup_power2_divisions"] = tuple(divisions)
            else:
                raise AllocatorConfigError(
                    f"PYTORCH_CUDA_ALLOC_CONF: unknown option {key!r}; memfit knows expandable_segments, max_split_size_mb, "
                    "max_non_split_rounding_mb, roundup_power2_divisions, garbage_collection_threshold, backend"
                )
            i += 1
            if i < len(tokens):
                if tokens[i] != ",":
                    raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: expected ',' before {tokens[i]!r}")
                i += 1
        return cls(**values, variable=variable)

    @classmethod
    def from_snapshot(cls, meta: dict | None) -> AllocatorSettings:
        """The settings a ``torch.cuda.memory._snapshot()`` recorded (its ``allocator_settings``)."""
        if not meta:
            return cls()
        split = int(meta.get("max_split_size", -1))
        div = meta.get("roundup_power2_divisions") or {}
        divisions = tuple(int(v) for _, v in sorted(((int(k), v) for k, v in div.items()))) if isinstance(div, dict) else ()
        if len(divisions) != ROUNDUP_INTERVALS:
            divisions = (0,) * ROUNDUP_INTERVALS
        return cls(
            expandable_segments=bool(meta.get("expandable_segments", False)),
            max_split_size=None if split < 0 or split >= (1 << 63) else split,
            roundup_power2_divisions=divisions,
            garbage_collection_threshold=float(meta.get("garbage_collection_threshold", 0.0) or 0.0),
        )

    def assignment(self) -> str:
        """``VARIABLE=value`` as the process set it ("" for the defaults)."""
        conf = self.describe()
        return f"{self.variable}={conf}" if conf else ""

    def describe(self) -> str:
        """Back in the ``PYTORCH_CUDA_ALLOC_CONF`` form ("" for the defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MiB}")
        if any(self.roundup_power2_divisions):
            parts.append(
                "roundup_power2_divisions:["
                + ",".join(f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions))
                + "]"
            )
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        return ",".join(parts)

    def to_dict(self) -> dict:
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.describe(),
            "expandable_segments": self.expandable_segments,
            "max_split_size_bytes": self.max_split_size,
            "roundup_power2_divisions": list(self.roundup_power2_divisions),
            "garbage_collection_threshold": self.garbage_collection_threshold,
        }

    def divisions(self, size: int) -> int:
        index = size.bit_length() - 1 - (MiB.bit_length() - 1)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


def _lex(conf: str) -> list[str]:
    tokens, buf = [], ""
    for ch in conf:
        if ch in ",:[]":
            if buf:
                tokens.append(buf)
                buf = ""
            tokens.append(ch)
        elif ch != " ":
            buf += ch
    if buf:
        tokens.append(buf)
    return tokens


def _int(v: str, key: str, conf: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} takes an integer, got {v!r}") from None


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_divisions(tokens: list[str], i: int, divisions: list[int], conf: str) -> int:
    """``roundup_power2_divisions:4`` or ``:[256:1,512:2,>:4]`` (interval starts in MiB), as
    AllocatorConfig::parseRoundUpPower2Divisions reads them (the first entry also fills every
    interval below it, ``>`` fills from the last named interval on)."""
    if i + 2 >= len(tokens) or tokens[i + 1] != ":":
        raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: roundup_power2_divisions takes a value")
    i += 2
    if tokens[i] != "[":
        d = _int(tokens[i], "roundup_power2_divisions", conf)
        if not _power_of_two(d):
            raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions must be a power of 2, got {d}")
        divisions[:] = [d] * ROUNDUP_INTERVALS
        return i
    first, last = True, 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        start = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise AllocatorConfigError(
                f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: roundup_power2_divisions entries are START_MB:DIVISIONS"
            )
        d = _int(tokens[i + 2], "roundup_power2_divisions", conf)
        if d != 0 and not _power_of_two(d):
            raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions must be 0 or a power of 2, got {d}")
        if start == ">":
            divisions[last:] = [d] * (ROUNDUP_INTERVALS - last)
        else:
            mb = _int(start, "roundup_power2_divisions", conf)
            if not _power_of_two(mb):
                raise AllocatorConfigError(
                    f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions intervals must be powers of 2, got {mb}"
                )
            index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                divisions[:index] = [d] * index
                first = False
            divisions[index] = d
            last = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: roundup_power2_divisions list is missing its ']'")
    return i


# -- the sizes ----------------------------------------------------------------------------------


def round_size(size: int, settings: AllocatorSettings | None = None) -> int:
    """The block size a request of ``size`` bytes asks for (DeviceCachingAllocator::round_size)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = settings.divisions(size) if settings is not None else 0
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if _power_of_two(size):
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment ``cudaMalloc`` gets for a rounded request that no cached block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


# -- blocks, pools, segments ------------------------------------------------------------------


class Block:
    """A range of one segment: allocated, cached (free) or, in an expandable segment, unmapped."""

    __slots__ = (
        "ptr",
        "size",
        "stream",
        "small",
        "allocated",
        "requested",
        "prev",
        "next",
        "segment",
        "mapped",
        "gc_base",
        "key",
    )

    def __init__(self, ptr: int, size: int, stream: int, small: bool, segment: _Expandable | None = None) -> None:
        self.ptr = ptr
        self.size = size
        self.stream = stream
        self.small = small
        self.allocated = False
        self.requested = 0
        self.prev: Block | None = None
        self.next: Block | None = None
        self.segment = segment
        self.mapped = True
        self.gc_base = 0
        self.key: tuple | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.ptr:#x}, {self.size}, stream={self.stream}, {state})"


class _Pool:
    """Cached blocks ordered as BlockComparatorSize orders them: (stream, size, address)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Block] = {}
        self.by_ptr: dict[int, Block] = {}
        self.unmapped_keys: list[tuple[int, int]] = []
        self.unmapped: dict[tuple[int, int], Block] = {}
        self.calls = 0
        """get_free_blocks_call_count: the clock blocks age by for garbage collection."""

    def insert(self, b: Block) -> None:
        b.key = (b.stream, b.size, b.ptr)
        b.gc_base = self.calls
        insort(self.keys, b.key)
        self.blocks[b.key] = b
        self.by_ptr[b.ptr] = b

    def remove(self, b: Block) -> None:
        key = b.key
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]
        del self.by_ptr[key[2]]
        b.key = None

    def insert_unmapped(self, b: Block) -> None:
        b.key = (b.stream, b.ptr)
        insort(self.unmapped_keys, b.key)
        self.unmapped[b.key] = b

    def remove_unmapped(self, b: Block) -> None:
        del self.unmapped_keys[bisect_left(self.unmapped_keys, b.key)]
        del self.unmapped[b.key]
        b.key = None


class _Expandable:
    """One expandable segment: a virtual range mapped page by page (ExpandableSegment)."""

    def __init__(self, base: int, page: int, pages: int) -> None:
        self.base, self.page, self.pages = base, page, pages
        self.mapped: set[int] = set()

    @property
    def size(self) -> int:
        return self.page * self.pages

    def pages_to_map(self, ptr: int, size: int) -> range:
        return range((ptr - self.base) // self.page, -(-(ptr + size - self.base) // self.page))

    def pages_to_unmap(self, ptr: int, size: int) -> range:
        return range(-(-(ptr - self.base) // self.page), (ptr + size - self.base) // self.page)


@dataclass(frozen=True, slots=True)
class SegmentEvent:
    """A ``cudaMalloc``/``cudaFree`` (or an expandable segment's map/unmap) the allocator made."""

    action: str
    """``segment_alloc``, ``segment_free``, ``segment_map`` or ``segment_unmap`` (as torch's trace names them)."""
    ptr: int
    size: int
    stream: int
    event: int
    """Index of the request (malloc, free or empty_cache, from 0) during which it happened."""


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """What the allocator held over a replay: torch's ``memory_stats`` peaks, plus the segments."""

    allocated_peak_bytes: int
    """``max_memory_allocated``: the most bytes in allocated blocks at once."""
    reserved_peak_bytes: int
    """``max_memory_reserved``: the most bytes in segments at once (what runs out)."""
    reserved_at_allocated_peak_bytes: int
    """Reserved bytes when allocated first reached its peak."""
    allocated_bytes: int
    """Allocated at the end."""
    reserved_bytes: int
    """Reserved at the end."""
    requested_peak_bytes: int
    """The most bytes requested at once (before rounding): the tensors' own size."""
    segments: tuple[SegmentEvent, ...]
    settings: AllocatorSettings
    capacity: int | None = None

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated when allocated peaked: held, yet of no use to the peak."""
        return self.reserved_at_allocated_peak_bytes - self.allocated_peak_bytes

    @property
    def fragmentation(self) -> float:
        r = self.reserved_at_allocated_peak_bytes
        return self.fragmentation_bytes / r if r else 0.0

    def to_dict(self) -> dict:
        return {
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "reserved_at_allocated_peak_bytes": self.reserved_at_allocated_peak_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "allocated_end_bytes": self.allocated_bytes,
            "reserved_end_bytes": self.reserved_bytes,
            "requested_peak_bytes": self.requested_peak_bytes,
            "segment_allocs": sum(1 for s in self.segments if s.action in ("segment_alloc", "segment_map")),
            "allocator_settings": self.settings.to_dict(),
            "capacity_bytes": self.capacity,
        }


# -- the allocator ----------------------------------------------------------------------------

SegmentAddress = Callable[[int, int, bool, bool], "int | None"]
"""``(size, stream, expandable, small) -> address`` for a new segment (an expandable one: its
virtual range), or ``None`` for the model's own choice."""


class CachingAllocator:
    """One device's caching allocator. ``malloc``/``free``/``empty_cache`` as torch's; ``capacity``
    bounds the bytes it may reserve (``torch.cuda.set_per_process_memory_fraction`` times the
    device's memory, or the device's free memory); ``segment_address`` chooses where a new segment
    goes (the driver's business, so a replay of a real trace passes the real addresses in)."""

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        *,
        capacity: int | None = None,
        segment_address: SegmentAddress | None = None,
    ) -> None:
        self.settings = settings or AllocatorSettings()
        self.capacity = capacity
        self._address = segment_address
        self._next_ptr = 0x7F00_0000_0000
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.segments: list[SegmentEvent] = []
        self.event = -1
        self.allocated = self.reserved = self.requested = 0
        self.allocated_peak = self.reserved_peak = self.requested_peak = 0
        self.reserved_at_allocated_peak = 0

    # -- public requests ----------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> Block:
        """A block of at least ``size`` bytes for ``stream`` (DeviceCachingAllocator::malloc)."""
        if size <= 0:
            raise AllocatorConfigError(f"malloc takes a positive size (torch allocates nothing for 0 bytes), got {size}")
        self.event += 1
        rounded = round_size(size, self.settings)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        alloc_size = allocation_size(rounded)
        block = self._get_free_block(pool, stream, rounded)
        if block is None:
            if self._gc_on:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, rounded, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, stream, rounded):
                block = self._alloc_block(pool, stream, rounded, alloc_size)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, stream, rounded, alloc_size)
            if block is None:
                raise AllocatorOutOfMemory(
                    f"out of memory: tried to allocate {alloc_size} B with {self.reserved} B of {self.capacity} B reserved "
                    f"({self.reserved - self.allocated} B reserved but unallocated)"
                )
        return self._alloc_found_block(block, rounded, size, pool, stream, self._should_split(block, rounded))

    def free(self, block: Block) -> None:
        """Return ``block`` to its pool, merged with free neighbours (free + free_block)."""
        if not block.allocated:
            raise AllocatorConfigError(f"{block!r} is not allocated: freed twice?")
        self.event += 1
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = self.small if block.small else self.large
        for other in (block.prev, block.next):
            self._try_merge(block, other, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment no tensor uses."""
        self.event += 1
        self._release_cached_blocks()

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated_peak_bytes=self.allocated_peak,
            reserved_peak_bytes=self.reserved_peak,
            reserved_at_allocated_peak_bytes=self.reserved_at_allocated_peak,
            allocated_bytes=self.allocated,
            reserved_bytes=self.reserved,
            requested_peak_bytes=self.requested_peak,
            segments=tuple(self.segments),
            settings=self.settings,
            capacity=self.capacity,
        )

    # -- state that did not come from requests (a trace that starts mid-run) -------------------

    def add_segment(self, ptr: int, blocks: list[tuple[int, bool, int]], stream: int = 0, *, small: bool) -> list[Block]:
        """A segment that exists already: ``blocks`` are its ``(size, allocated, requested)`` in
        address order. Returns its allocated blocks (to free later). Not a ``cudaMalloc``: no event."""
        out, prev, addr = [], None, ptr
        for size, allocated, requested in blocks:
            b = Block(addr, size, stream, small)
            b.splice(prev, None)
            prev, addr = b, addr + size
            if allocated:
                out.append(self._allocated_before(b, requested))
        # free neighbours were merged on the GPU; merge what the caller gave separately
        head = prev
        while head is not None and head.prev is not None:
            head = head.prev
        b = head
        while b is not None:
            if not b.allocated:
                while b.next is not None and not b.next.allocated:
                    nxt = b.next
                    b.size += nxt.size
                    b.next = nxt.next
                    if b.next is not None:
                        b.next.prev = b
                (self.small if small else self.large).insert(b)
            b = b.next
        self.reserved += addr - ptr
        self._peaks()
        return out

    def _allocated_before(self, b: Block, requested: int) -> Block:
        """``b`` held a tensor when the snapshot was taken (add_segment, add_expandable_segment)."""
        b.allocated, b.requested = True, requested
        self.allocated += b.size
        self.requested += requested
        return b

    def place(self, ptr: int, size: int, stream: int = 0) -> Block:
        """Allocate ``size`` bytes at ``ptr`` (a recorded allocation's address) by the allocator's
        own split rule, instead of choosing the block by best fit: how a trace's own allocations
        are re-lived to measure what it held."""
        self.event += 1
        rounded = round_size(size, self.settings)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        block = pool.by_ptr.get(ptr)
        if block is None or block.stream != stream or block.size < rounded:
            raise AllocatorConfigError(f"no cached block of >= {rounded} B at {ptr:#x} on stream {stream}")
        pool.remove(block)
        return self._alloc_found_block(block, rounded, size, pool, stream, self._should_split(block, rounded))

    def new_segment(self, ptr: int, size: int, stream: int = 0) -> None:
        """A recorded ``cudaMalloc``: a free segment at ``ptr``."""
        small = size == SMALL_BUFFER
        (self.small if small else self.large).insert(Block(ptr, size, stream, small))
        self.reserved += size
        self.segments.append(SegmentEvent("segment_alloc", ptr, size, stream, self.event + 1))
        self._peaks()

    def add_expandable_segment(
        self, base: int, size: int, stream: int, ranges: list[tuple[int, list[tuple[int, bool, int]]]], *, small: bool
    ) -> list[Block]:
        """An expandable segment that exists already: the virtual range ``[base, base + size)``
        with its mapped ``ranges`` as ``(address, blocks)``, blocks as in :meth:`add_segment`.
        Returns its allocated blocks."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        seg = _Expandable(base, page, -(-size // page))
        pool = self.small if small else self.large
        out: list[Block] = []
        chain: list[Block] = []
        at = base
        for ptr, blocks in sorted(ranges):
            if ptr > at:
                chain.append(Block(at, ptr - at, stream, small, seg))
                chain[-1].mapped = False
            seg.mapped.update(seg.pages_to_map(ptr, sum(b[0] for b in blocks)))
            for bsize, allocated, requested in blocks:
                b = Block(ptr, bsize, stream, small, seg)
                if allocated:
                    out.append(self._allocated_before(b, requested))
                elif chain and chain[-1].mapped and not chain[-1].allocated:
                    chain[-1].size += bsize  # free neighbours were merged on the GPU
                    ptr += bsize
                    continue
                chain.append(b)
                ptr += bsize
            self.reserved += sum(b[0] for b in blocks)
            at = ptr
        if at < seg.base + seg.size:
            chain.append(Block(at, seg.base + seg.size - at, stream, small, seg))
            chain[-1].mapped = False
        prev = None
        for b in chain:
            b.splice(prev, None)
            prev = b
            if not b.allocated:
                (pool.insert if b.mapped else pool.insert_unmapped)(b)
        self._peaks()
        return out

    def map_at(self, ptr: int, size: int, stream: int = 0) -> None:
        """A recorded ``segment_map``: map ``size`` bytes from the unmapped block at ``ptr``."""
        for pool in (self.large, self.small):
            b = pool.unmapped.get((stream, ptr))
            if b is not None:
                self.event += 1
                if not self._map_block(b, size, pool) or self.segments[-1].size != size:
                    raise AllocatorConfigError(f"mapping {size} B at {ptr:#x} does not follow the allocator's pages")
                return
        raise AllocatorConfigError(f"no unmapped block at {ptr:#x} on stream {stream}")

    def unmap_at(self, ptr: int, size: int, stream: int = 0) -> None:
        """A recorded ``segment_unmap``: the free pages of the cached block around ``ptr``."""
        for pool in (self.large, self.small):
            for key in pool.keys:
                b = pool.blocks[key]
                if key[0] == stream and b.segment is not None and b.ptr <= ptr < b.ptr + b.size:
                    self.event += 1
                    n = len(self.segments)
                    self._unmap_block(b, pool)
                    got = self.segments[n:]
                    if not got or (got[0].ptr, got[0].size) != (ptr, size):
                        raise AllocatorConfigError(f"unmapping {size} B at {ptr:#x} does not follow the cached block")
                    if b.prev is None and b.next is None and not b.mapped:
                        pool.remove_unmapped(b)
                    return
        raise AllocatorConfigError(f"no cached expandable block at {ptr:#x} on stream {stream}")

    def release_segment(self, ptr: int) -> None:
        """A recorded ``cudaFree`` of the cached, unsplit segment at ``ptr``."""
        for pool in (self.small, self.large):
            b = pool.by_ptr.get(ptr)
            if b is not None and not b.is_split and b.segment is None:
                self._release_block(b)
                return
        raise AllocatorConfigError(f"no cached unsplit segment at {ptr:#x}")

    # -- the rules ------------------------------------------------------------------------------

    @property
    def _gc_on(self) -> bool:
        return self.capacity is not None and self.settings.garbage_collection_threshold > 0.0

    def _peaks(self) -> None:
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
            self.reserved_at_allocated_peak = self.reserved
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.requested_peak = max(self.requested_peak, self.requested)

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        s = self.settings
        if self._gc_on:
            pool.calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, 0))
        if i == len(keys) or keys[i][0] != stream:
            return None
        b = pool.blocks[keys[i]]
        if b.segment is not None:
            if s.expandable_segments:
                # best fit by the size a block can grow to, not the size it has
                def grows_to(x: Block) -> int:
                    return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)

                j = i + 1
                while b.segment is not None and j < len(keys) and keys[j][0] == stream:
                    nb = pool.blocks[keys[j]]
                    if grows_to(nb) >= grows_to(b):
                        break
                    b, j = nb, j + 1
            else:  # expandable segments turned off after some were made: only ordinary blocks
                j = i + 1
                while j < len(keys) and keys[j][0] == stream and pool.blocks[keys[j]].segment is not None:
                    j += 1
                if j == len(keys) or keys[j][0] != stream:
                    return None
                b = pool.blocks[keys[j]]
        split_limit = s.max_split_size
        if split_limit is not None:
            if size < split_limit and b.size >= split_limit:
                return None  # an oversize block is never carved up for a small request
            if size >= split_limit and b.size >= size + s.max_non_split_rounding:
                return None
        pool.remove(b)
        return b

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK
        limit = self.settings.max_split_size
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    def _alloc_found_block(self, block: Block, size: int, requested: int, pool: _Pool, stream: int, split: bool) -> Block:
        if split:
            remaining = block
            block = Block(remaining.ptr, size, stream, remaining.small, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = requested
        self.allocated += block.size
        self.requested += requested
        self._peaks()
        return block

    def _try_merge(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        return src.size

    def _new_address(self, size: int, stream: int, expandable: bool, small: bool) -> int:
        ptr = self._address(size, stream, expandable, small) if self._address is not None else None
        if ptr is None:
            ptr = self._next_ptr
            self._next_ptr += -(-size // ROUND_LARGE) * ROUND_LARGE
        return ptr

    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int) -> Block | None:
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        if self.settings.expandable_segments:
            return self._alloc_expandable(pool, stream, size)
        b = Block(self._new_address(alloc_size, stream, False, pool.small), alloc_size, stream, pool.small)
        self.reserved += alloc_size
        self.segments.append(SegmentEvent("segment_alloc", b.ptr, alloc_size, stream, self.event))
        self._peaks()
        return b

    def _release_block(self, b: Block) -> None:
        pool = self.small if b.small else self.large
        pool.remove(b)
        self.reserved -= b.size
        self.segments.append(SegmentEvent("segment_free", b.ptr, b.size, b.stream, self.event))

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """With max_split_size: free oversize cached blocks (largest first) until ``size`` fits."""
        limit = self.settings.max_split_size
        if limit is None:
            return False
        want = max(size, limit)
        keys = pool.keys
        i = bisect_left(keys, (stream, want, 0))
        if i < len(keys) and keys[i][0] == stream:
            b = pool.blocks[keys[i]]
            if b.is_split or b.segment is not None:
                return False
            self._release_block(b)
            return True
        released, i = 0, i - 1
        while released < want and i >= 0 and keys[i][0] == stream and keys[i][1] >= limit:
            b = pool.blocks[keys[i]]
            i -= 1
            if b.is_split or b.segment is not None:  # a part of a segment cannot be cudaFree'd (torch does not check)
                continue
            released += b.size
            self._release_block(b)
        return released >= want

    def _release_cached_blocks(self) -> None:
        for pool in (self.large, self.small):
            to_unmap = []
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None:
                    continue
                if b.segment is not None:
                    to_unmap.append(b)
                elif not b.is_split:
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b, pool)
                if b.prev is None and b.next is None and not b.mapped:
                    pool.remove_unmapped(b)  # the whole virtual range is free: the segment goes

    def _garbage_collect(self) -> None:
        threshold = int(self.settings.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = {id(b): pool.calls - b.gc_base for b in pool.blocks.values() if not b.is_split}
        total, count = sum(ages.values()), len(ages)
        if count == 0:
            return
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total / count
            freed = False
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None or b.is_split:
                    continue
                age = pool.calls - b.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total -= age
                    count -= 1
                    self._release_block(b)

    # -- expandable segments --------------------------------------------------------------------

    def _alloc_expandable(self, pool: _Pool, stream: int, size: int) -> Block | None:
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), pool):
            return None
        while c.size < size:
            nc = c.next
            if not self._map_block(nc, min(size - c.size, nc.size), pool):
                return None
            c = nc
        pool.remove(c)
        return c

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> Block:
        def free(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def room(b: Block | None) -> bool:
            got = 0
            while got < size and free(b):
                got += b.size
                b = b.next
            return got >= size

        keys = pool.unmapped_keys
        for key in keys[bisect_left(keys, (stream, 0)) :]:
            if key[0] != stream:
                break
            c = pool.unmapped[key]
            if free(c.prev) and c.prev.mapped:
                c = c.prev
            if room(c):
                return c
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        # torch reserves address space for 9/8 of the device's memory
        space = self.capacity + self.capacity // 8 if self.capacity is not None else 1 << 40
        pages = -(-space // page)
        seg = _Expandable(self._new_address(pages * page, stream, True, pool.small), page, pages)
        c = Block(seg.base, seg.size, stream, pool.small, seg)
        c.mapped = False
        pool.insert_unmapped(c)
        return c

    def _map_block(self, b: Block, size: int, pool: _Pool) -> bool:
        seg = b.segment
        pages = seg.pages_to_map(b.ptr, size)
        if self.capacity is not None and self.reserved + len(pages) * seg.page > self.capacity:
            return False
        seg.mapped.update(pages)
        mapped = len(pages) * seg.page
        pool.remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = Block(b.ptr + mapped, b.size - mapped, b.stream, b.small, seg)
            rest.mapped = False
            rest.splice(b, b.next)
            pool.insert_unmapped(rest)
            b.size = mapped
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self.reserved += mapped
        self.segments.append(SegmentEvent("segment_map", seg.base + pages.start * seg.page, mapped, b.stream, self.event))
        self._peaks()
        return True

    def _unmap_block(self, b: Block, pool: _Pool) -> None:
        seg = b.segment
        pages = seg.pages_to_unmap(b.ptr, b.size)
        if len(pages) <= 0:
            return
        pool.remove(b)
        start, size = seg.base + pages.start * seg.page, len(pages) * seg.page
        seg.mapped.difference_update(pages)
        before = start - b.ptr
        if before > 0:
            bf = Block(b.ptr, before, b.stream, b.small, seg)
            bf.splice(b.prev, b)
            pool.insert(bf)
        after = b.size - (before + size)
        if after > 0:
            af = Block(start + size, after, b.stream, b.small, seg)
            af.splice(b, b.next)
            pool.insert(af)
        b.ptr, b.size, b.mapped = start, size, False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self.reserved -= size
        self.segments.append(SegmentEvent("segment_unmap", start, size, b.stream, self.event))


# -- replaying a sequence -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Alloc:
    """Allocate ``size`` bytes on ``stream``; ``id`` names it for its :class:`Free`."""

    id: Hashable
    size: int
    stream: int = 0


@dataclass(frozen=True, slots=True)
class Free:
    id: Hashable


@dataclass(frozen=True, slots=True)
class EmptyCache:
    """``torch.cuda.empty_cache()``."""


def replay(
    events: Iterable[Alloc | Free | EmptyCache],
    settings: AllocatorSettings | None = None,
    *,
    capacity: int | None = None,
    allocator: CachingAllocator | None = None,
) -> AllocatorStats:
    """Run ``events`` in order through a :class:`CachingAllocator` (a fresh one unless given) and
    return what it held. Raises :class:`AllocatorOutOfMemory` when ``capacity`` is too small."""
    alloc = allocator or CachingAllocator(settings, capacity=capacity)
    live: dict[Hashable, Block] = {}
    for ev in events:
        if isinstance(ev, Alloc):
            if ev.size > 0:
                if ev.id in live:
                    raise AllocatorConfigError(f"allocation {ev.id!r} is made twice without a free")
                live[ev.id] = alloc.malloc(ev.size, ev.stream)
        elif isinstance(ev, Free):
            b = live.pop(ev.id, None)
            if b is not None:
                alloc.free(b)
        else:
            alloc.empty_cache()
    return alloc.stats()
