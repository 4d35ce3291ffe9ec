"""A measured step replayed through the model of the CUDA caching allocator
(:mod:`memfit.cuda.allocator`): as one step (:func:`replay_ledger`), as a training loop runs
it (:func:`replay_training`: what ``max_memory_allocated`` / ``max_memory_reserved`` read),
and tick by tick for pictures (:func:`ledger_series`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from memfit.cuda.allocator import Alloc, AllocatorSettings, AllocatorStats, Block, CachingAllocator, Free, replay
from memfit.measure.ledger import START_TICK, Category, Phase

__all__ = ["ledger_events", "replay_ledger", "replay_training", "TrainingReplay", "MAX_STEPS", "ledger_series", "LedgerSeries"]


def ledger_events(ledger) -> list[Alloc | Free]:
    """A ledger's storages as the allocator sees them: those alive at the start first, then each
    tick's allocation or free in tick order. Autograd's graph blocks are host memory, not the
    allocator's, and are left out."""
    timed: list[tuple[int, int, int, Alloc | Free]] = []
    for b in ledger.blocks:
        if b.category is Category.GRAPH or b.nbytes <= 0:
            continue
        # allocations before frees at a shared tick: the order that needs more memory, when the
        # ledger cannot tell which came first
        timed.append((b.born, 0, b.id, Alloc(b.id, b.nbytes, b.stream)))
        if b.died is not None:
            timed.append((b.died, 1, b.id, Free(b.id)))
    timed.sort(key=lambda t: (t[0], t[1], t[2] if t[0] == START_TICK else 0))
    return [t[3] for t in timed]


def replay_ledger(ledger, settings: AllocatorSettings | None = None, *, capacity: int | None = None) -> AllocatorStats:
    """What the CUDA caching allocator would hold for a measured step (a
    :class:`~memfit.measure.ledger.Ledger`): everything alive at its start included, as the
    ledger's ``peak_bytes`` includes it. Each block on its stream, no cached segments before the step."""
    return replay(ledger_events(ledger), settings, capacity=capacity)


# -- a measured step as a training loop runs it ------------------------------------------------

MAX_STEPS = 8
"""Steps :func:`replay_training` replays at most (the first included): until a step leaves the
allocator as an earlier step did (most often the step before it), from when the later steps
repeat the ones since exactly."""


@dataclass(frozen=True, slots=True)
class TrainingReplay:
    """A measured step replayed as a training loop runs it (:func:`replay_training`)."""

    stats: AllocatorStats
    """Over the whole replay: what ``max_memory_allocated`` / ``max_memory_reserved`` read once
    the loop has run these steps (the construction and the first step included)."""
    steps: int
    """Steps replayed: the first (which creates the optimizer state), then steady steps."""
    steady: bool
    """The last step left the allocator's blocks and segments as an earlier step did (the step
    before it, or one before that in a loop that alternates: every later step repeats the steps
    since); False when :data:`MAX_STEPS` ran out first."""


def _start_placement(ledger) -> tuple[list, dict[int, list]]:
    """The blocks alive at the step's start, split into those the program made before its first
    step (the model's ``.to(device)``, the inputs: in the ledger's id order, which the recorder
    gives in program order) and those its first step makes, by the tick they are made at: the
    optimizer state at the first optimizer tick (torch's optimizers make a parameter's whole
    state in its first ``step()``, parameters in group order, before updating any), gradients a
    loop keeps (``zero_grad(set_to_none=False)``) at the first backward tick, and what the step
    revealed only when it used it (``Ledger.first_use``: cuBLAS workspaces, module caches). The
    previous step's output a loop holds (``Ledger.held_output``) is in neither: the program's first
    step starts without one, and each later step frees the one the step before left (:func:`_successors`)."""
    first: dict = {}
    for t, tick in enumerate(ledger.ticks):
        first.setdefault(tick.phase, t)
    made_at = {Category.OPTIMIZER: first.get(Phase.OPTIMIZER), Category.GRADIENT: first.get(Phase.BACKWARD)}
    held = getattr(ledger, "held_output", {})
    before, during = [], {}
    for b in sorted(ledger.blocks, key=lambda b: b.id):
        if b.born != START_TICK or b.category is Category.GRAPH or b.nbytes <= 0 or b.id in held:
            continue  # (the previous step's output, held by the loop: the first step has none)
        tick = ledger.first_use.get(b.id, made_at.get(b.category))
        if tick is None:
            before.append(b)
        else:
            during.setdefault(tick, []).append(b)
    return before, during


def _step_events(ledger, k: int, successor: dict, during: dict | None, *, ticks: bool = False) -> list:
    """Step ``k`` of the loop: the ledger's allocations and frees, its own blocks named ``(k, id)``.
    A block alive at the start that the step frees is the one the step before left in its place
    (``successor``; else the start's own, ``("start", id)``). ``during``: the first step, which
    makes those start blocks at their ticks. ``ticks``: ``(tick, event)`` pairs."""
    start = {b.id for b in ledger.blocks if b.born == START_TICK}
    timed: list[tuple[int, int, int, Alloc | Free]] = []
    for b in ledger.blocks:
        if b.category is Category.GRAPH or b.nbytes <= 0:
            continue
        if b.id in start:
            if b.died is not None:
                name = (k - 1, successor[b.id]) if k > 1 and b.id in successor else ("start", b.id)
                timed.append((b.died, 1, b.id, Free(name)))
            continue
        timed.append((b.born, 0, b.id, Alloc((k, b.id), b.nbytes, b.stream)))
        if b.died is not None:
            timed.append((b.died, 1, b.id, Free((k, b.id))))
    for tick, made in (during or {}).items():
        timed.extend((tick, -1, b.id, Alloc(("start", b.id), b.nbytes, b.stream)) for b in made)
    timed.sort(key=lambda t: (t[0], t[1], t[2] if t[1] < 0 else 0))
    return [(t[0], t[3]) for t in timed] if ticks else [t[3] for t in timed]


def _successors(ledger) -> tuple[dict[int, int], list[int]]:
    """Which block a step leaves alive in place of each start block it frees (an optimizer that
    replaces its state, ``state["m"] = beta * m + ...``, frees the old and keeps the new): paired
    in order where the sizes agree. Returns the pairs and the step's other survivors, which the
    replay frees as the next step begins (they would pile up step after step otherwise, which
    the measured step, starting without them, says does not happen). The previous step's output
    a loop holds is the one the step leaves in its place as the ledger pairs them
    (``Ledger.held_output``), before the rest are paired."""
    pairs = {i: j for i, j in getattr(ledger, "held_output", {}).items() if j is not None}
    ends = set(pairs.values())
    dying = sorted(
        (b for b in ledger.blocks if b.born == START_TICK and b.died is not None and b.id not in pairs),
        key=lambda b: (b.died, b.id),
    )
    kept = sorted(
        (b for b in ledger.blocks if b.born != START_TICK and b.died is None and b.id not in ends), key=lambda b: (b.born, b.id)
    )
    left, i = [], 0
    for b in kept:
        while i < len(dying) and dying[i].nbytes != b.nbytes:
            i += 1
        if i < len(dying):
            pairs[dying[i].id] = b.id
            i += 1
        else:
            left.append(b.id)
    return pairs, left


def _state(alloc: CachingAllocator, live: dict) -> tuple:
    """What decides the allocator's next choices: its segments' free and used blocks."""
    pools = tuple(tuple(p.keys) + tuple(p.unmapped_keys) for p in (alloc.small, alloc.large))
    return pools, alloc.reserved, tuple(sorted((b.ptr, b.size) for b in live.values()))


def replay_training(
    ledger, settings: AllocatorSettings | None = None, *, capacity: int | None = None, max_steps: int = MAX_STEPS
) -> TrainingReplay:
    """A measured step as a training loop runs it, through one :class:`CachingAllocator`: the
    blocks the program makes before its first step, in program order (:func:`_start_placement`);
    the first step, which makes the optimizer state (and what else the step keeps) as it goes;
    then the step again until it leaves the allocator as an earlier step did (the segments
    the earlier steps cached are the ones later steps reuse). The peaks are over all of it, as
    ``max_memory_allocated`` / ``max_memory_reserved`` read in a loop that has run the steps: a
    step replayed from an empty cache with its start in some other order places blocks where
    the program never did (a small CNN's allocated peak moved by 1.2% with the order)."""
    alloc = CachingAllocator(settings, capacity=capacity)
    steps, steady = _loop(alloc, ledger, max_steps)
    return TrainingReplay(alloc.stats(), steps, steady)


def _loop(
    alloc: CachingAllocator, ledger, max_steps: int, last: int | None = None, on_tick: Callable[[int], None] | None = None
) -> tuple[int, bool]:
    """:func:`replay_training` on ``alloc``: the steps it ran and whether they became steady.
    ``last``: run exactly this many steps, calling ``on_tick(START_TICK)`` as the last begins and
    ``on_tick(tick)`` after each of its events (for :func:`ledger_series`)."""
    live: dict[Hashable, Block] = {}

    def run(events: Iterable, on_tick=None) -> None:
        for item in events:
            tick, ev = item if on_tick is not None else (None, item)
            if isinstance(ev, Alloc):
                live[ev.id] = alloc.malloc(ev.size, ev.stream)
            else:
                b = live.pop(ev.id, None)
                if b is not None:
                    alloc.free(b)
            if on_tick is not None:
                on_tick(tick)

    before, during = _start_placement(ledger)
    successor, leftover = _successors(ledger)
    run(Alloc(("start", b.id), b.nbytes, b.stream) for b in before)
    # A step that leaves the allocator as an earlier step did repeats from there on what the
    # steps between did (the replay is deterministic in that state): their peaks are all in. Most
    # loops repeat the step before; one whose output the loop holds into the next step
    # (StepOptions.holds_output) puts each step's output where the one before it is not, by turns.
    seen: list[tuple] = []
    steady, k = False, 0
    limit = max(max_steps, 1) if last is None else last
    while k < limit and (not steady or last is not None):
        k += 1
        if k > 1:
            run(Free((k - 1, i)) for i in leftover)
        hook = on_tick if k == last else None
        if hook is not None:
            hook(START_TICK)
        run(_step_events(ledger, k, successor, during if k == 1 else None, ticks=hook is not None), hook)
        now = _state(alloc, live)
        steady = now in seen
        seen.append(now)
    return k, steady


# -- allocated and reserved over a ledger's ticks (for pictures) --------------------------------


@dataclass(frozen=True, slots=True)
class LedgerSeries:
    """What the allocator model holds over a ledger's ticks: ``allocated[t]`` and ``reserved[t]``
    are the bytes in blocks and in segments right after tick ``t`` (one allocation or free), so
    with the start's they reach the measured step's peaks (``stats``: the whole replayed loop's)."""

    allocated: list[int]
    reserved: list[int]
    start_allocated_bytes: int
    """Held before the step's first tick: the blocks alive at its start."""
    start_reserved_bytes: int
    stats: AllocatorStats


def ledger_series(ledger, settings: AllocatorSettings | None = None, *, capacity: int | None = None) -> LedgerSeries:
    """The measured step's ticks as :func:`replay_training` replays it (the last of the loop's
    steps, after the construction and the earlier steps): the allocator's state after every tick,
    and at the step's start. ``stats`` are the whole loop's, :func:`replay_training`'s (the series'
    maxima are the measured step's, which is where a steady loop peaks)."""
    steps = replay_training(ledger, settings, capacity=capacity).steps
    n = len(ledger.ticks)
    allocated, reserved = [-1] * n, [-1] * n
    alloc = CachingAllocator(settings, capacity=capacity)
    marks: list[tuple[int, int]] = []

    def on_tick(tick: int) -> None:
        if tick == START_TICK:  # the measured step begins: what the loop holds then
            marks.append((alloc.allocated, alloc.reserved))
        elif 0 <= tick < n:
            allocated[tick], reserved[tick] = alloc.allocated, alloc.reserved

    _loop(alloc, ledger, steps, last=steps, on_tick=on_tick)
    start = marks[0]
    prev = start
    for t in range(n):  # a tick without a block of the allocator's (host graph memory) holds what the one before did
        if allocated[t] < 0:
            allocated[t], reserved[t] = prev
        prev = (allocated[t], reserved[t])
    return LedgerSeries(allocated, reserved, start[0], start[1], alloc.stats())
