"""A step's ledger for L identical layers from the ledgers of steps of k, k+1 and k+2 layers
(issues 26 and 27): exact, or not used.

A fake step costs per op dispatched, and a decoder of L identical layers dispatches each
layer's ops L times. Its ledger is periodic: a step of one more layer is the same step with
one layer's worth of events (its forward, its backward, its share of the optimizer's foreach
ops) inserted beside the last layer's, its blocks alive exactly as the last layer's were,
and the last layer's blocks now alive as a middle layer's were. :func:`find_growth` reads
that insertion off the ledgers of k and k+1 layers; :func:`grow` applies it once more.

The safety rule: :func:`extrapolate` synthesizes the (k+2)-layer ledger from the k and k+1
ones and uses the growth only if that equals the recorded (k+2)-layer ledger block for
block and tick for tick (``Ledger.to_dict`` equal); else it says why, and the caller records
the whole model. Pure functions over :class:`~memfit.measure.ledger.Ledger` data.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from memfit.measure.ledger import START_TICK, Block, Ledger, OpCall, Span, Tick

__all__ = ["Layers", "Growth", "find_growth", "grow", "extrapolate", "grow_counts", "NotPeriodic"]


class NotPeriodic(Exception):
    """The ledgers are not one layer's insertion apart (the reason is the message)."""


@dataclass(frozen=True)
class Layers:
    """How module names number the repeated layers: ``prefix`` + index (``model.layers.3.mlp``)."""

    prefix: str
    """The layer list's qualified name and a dot, e.g. ``base_model.model.model.layers.``."""
    exact_frees: bool = False
    """Whether a tick that frees a block says which (:func:`_free_token`), not only its size:
    where many blocks of one size die in a row (a fake CPU step's autograd graph), sizes alone
    let one more layer's frees be placed where other blocks die."""

    def index(self, name: str | None) -> int | None:
        """The layer a module name is in, or None."""
        if not name or not name.startswith(self.prefix):
            return None
        head = name[len(self.prefix) :].partition(".")[0]
        return int(head) if head.isdigit() else None

    def shift(self, name: Any, by: int = 1) -> Any:
        """``name`` with its layer index moved by ``by``; anything else as it is."""
        if not isinstance(name, str) or not name.startswith(self.prefix):
            return name
        head, dot, tail = name[len(self.prefix) :].partition(".")
        return f"{self.prefix}{int(head) + by}{dot}{tail}" if head.isdigit() else name

    def shift_token(self, token: Any, by: int = 1) -> Any:
        if isinstance(token, tuple):
            return tuple(self.shift_token(x, by) for x in token)
        return self.shift(token, by)


@dataclass(frozen=True)
class Seg:
    """Items ``[start, end)`` of a list inserted by one more layer, beside their previous
    period: after it (``after``) or before it."""

    start: int
    end: int
    after: bool

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def at(self) -> int:
        """Where the next period goes, in this list's positions."""
        return self.end if self.after else self.start

    @property
    def key(self) -> tuple[int, int]:
        """The order of copies at one place: an "after" segment's copy first."""
        return (self.at, 0 if self.after else 1)

    @property
    def period(self) -> tuple[int, int]:
        """The previous period's items (the layer before)."""
        return (self.start - self.size, self.start) if self.after else (self.end, self.end + self.size)


def segments(
    old: Sequence[Hashable], new: Sequence[Hashable], layers: Layers, what: str, fits: Callable[[int, int], bool] | None = None
) -> list[Seg]:
    """The runs of ``new`` that are insertions into ``old`` (nothing else may differ), each
    placed beside the run before it that, moved one layer on, is the same; ``fits(start, end)``:
    whether the items ``new[start:end]`` may be one layer's (their ticks among its ticks)."""
    found: list[Seg] = []
    match = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
    for tag, _i1, _i2, j1, j2 in match.get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise NotPeriodic(f"the {what} of one more layer differ by more than an insertion ({tag} at {j1})")
        found.extend(_slid(new, j1, j2, layers, what, fits))
    keys = [s.key for s in found]
    if len(set(keys)) != len(keys):
        raise NotPeriodic(f"two {what} insertions at one place")
    return found


def _slid(
    new: Sequence[Hashable], j1: int, j2: int, layers: Layers, what: str, fits: Callable[[int, int], bool] | None = None
) -> list[Seg]:
    """:func:`_placed` of the insertion ``new[j1:j2]``, or of the same insertion slid along the
    items equal at its two ends (the same list results: ``SequenceMatcher`` picks one of them,
    which need not be where one layer's items begin); the nearest that ``fits``."""
    size = j2 - j1
    lo, hi = j1, j1
    while lo > 0 and new[lo - 1] == new[lo - 1 + size]:
        lo -= 1
    while hi + size < len(new) and new[hi] == new[hi + size]:
        hi += 1
    why = f"the {what} inserted by one more layer (at {j1}) lie outside one layer's events"
    for a in sorted(range(lo, hi + 1), key=lambda a: abs(a - j1)):
        try:
            segs = _placed(new, a, a + size, layers, what)
        except NotPeriodic as exc:
            why = str(exc)
            continue
        if fits is None or all(fits(x.start, x.end) for x in segs):
            return segs
    raise NotPeriodic(why)


def _placed(new: Sequence[Hashable], j1: int, j2: int, layers: Layers, what: str) -> list[Seg]:
    """The insertion ``new[j1:j2]`` as one segment beside its previous period, or as two that
    meet (the end of a run and the start of the next: a foreach op's outputs, then their frees)."""

    def ok(a: int, b: int, after: bool) -> bool:
        size = b - a
        if after and a - size < 0 or not after and b + size > len(new):
            return False
        near = new[a - size : a] if after else new[b : b + size]
        return [layers.shift_token(x) for x in near] == list(new[a:b])

    if ok(j1, j2, True):
        return [Seg(j1, j2, True)]
    if ok(j1, j2, False):
        return [Seg(j1, j2, False)]
    for cut in range(j1 + 1, j2):
        if ok(j1, cut, True) and ok(cut, j2, False):
            return [Seg(j1, cut, True), Seg(cut, j2, False)]
    raise NotPeriodic(f"the {what} inserted by one more layer (at {j1}) repeat no period beside them")


class Moves:
    """Positions in a list before ``times`` more periods and after them: :attr:`Seg.at` of
    each segment receives its copies, copy 1 (the layer after the segment's) nearest."""

    def __init__(self, segs: tuple[Seg, ...], times: int = 1, deep: tuple[bool, ...] = ()) -> None:
        self.segs, self.times = segs, times
        self.deep = deep or (False,) * len(segs)
        """Per segment: the period before its previous period repeats it too (so a block of the
        layer before that is freed in the layer before it moves on with it)."""
        self._ats = sorted((s.at, s.size) for s in segs)
        self._base = {s: s.at + times * sum(o.size for o in segs if o.key < s.key) for s in segs}
        self._where: dict[int, tuple[Seg, int, int]] = {}  # q -> (segment, region, offset)
        for seg, deep in zip(segs, self.deep):
            a, b = seg.period
            two = (a - seg.size, a) if seg.after else (b, b + seg.size)
            for r, (lo, hi) in ((0, (seg.start, seg.end)), (-1, (a, b)), (-2, two if deep else (0, 0))):
                for q in range(lo, hi):
                    self._where.setdefault(q, (seg, r, q - lo))

    def before(self, q: int, pushed: bool = True) -> int:
        """The new position of item (or boundary) ``q``; at an insertion point, after the copies if ``pushed``."""
        out = q
        for at, size in self._ats:
            if at > q or (at == q and not pushed):
                break
            out += self.times * size
        return out

    def fixed(self, q: int) -> int:
        """``q`` where it moves to (more layers after it change nothing about it)."""
        return self.before(q)

    def seg_of(self, q: int) -> Seg | None:
        w = self._where.get(q)
        return w[0] if w is not None and w[1] == 0 else None

    def region(self, q: int) -> tuple[Seg, int, int] | None:
        """The segment ``q`` is in (region 0), or whose previous period (-1) or the period
        before (-2, where it repeats) it is in, and its offset there."""
        return self._where.get(q)

    def copy(self, s: Seg, q: int, j: int = 1) -> int:
        """Where item ``q`` of segment ``s`` lands in copy ``j`` (1: the layer after ``s``'s)."""
        slot = j - 1 if s.after else self.times - j
        return self._base[s] + slot * s.size + (q - s.start)

    def at_region(self, s: Seg, r: int, offset: int) -> int:
        """Where the item at ``offset`` of region ``r`` of ``s`` lands (``r`` >= 1: copy ``r``)."""
        if r >= 1:
            return self.copy(s, s.start + offset, r)
        a, b = s.period
        start = s.start if r == 0 else a if r == -1 else (a - s.size if s.after else b)
        return self.fixed(start + offset)

    def shift(self, q: int, by: int = 1) -> int:
        """``q`` ``by`` layers on: an item of a segment to its copy ``by``, of a previous period
        to copy ``by - 1`` (the segment itself for 1), anything else where it moves to."""
        w = self._where.get(q)
        if w is None:
            return self.fixed(q)
        return self.at_region(w[0], w[1] + by, w[2])

    def last(self, q: int) -> int:
        """``q`` as seen from outside the layers: an item of the last layer's to the new last layer's."""
        w = self._where.get(q)
        return self.copy(w[0], q, self.times) if w is not None and w[1] == 0 else self.fixed(q)

    def item(self, q: int, in_segment: bool) -> int:
        """Boundary ``q`` of a span or op call: at an insertion point, a call of the inserted
        layer stays beside its own events, any other call is pushed past the copies."""
        return q + self.times * sum(s.size for s in self.segs if s.at < q or (s.at == q and in_segment != s.after))


Key = tuple[str, int]
"""A block by where it is made: ``("s", i)`` the i-th block registered at the start, ``("l", t)``
a block alive from the start made where first used (tick t: a cuBLAS workspace), ``("t", t)``
a block allocated at tick t. The ids of a ledger are this order (checked)."""


@dataclass
class Work:
    """A ledger as positions: blocks by :data:`Key`, the ticks, spans and op calls."""

    blocks: dict[Key, Block]
    first_use: dict[Key, int]
    ticks: list[Tick]
    spans: list[tuple[Span, tuple[Key, ...]]]
    ops: list[OpCall]
    scalars: dict[str, int]
    rest: dict[str, Any] = field(default_factory=dict)

    @property
    def start(self) -> list[Block]:
        return [self.blocks[("s", i)] for i in range(sum(1 for k in self.blocks if k[0] == "s"))]


SCALARS = ("host_peak_bytes", "unmeasured_ops", "cublas_workspaces", "cublas_workspace_bytes", "attention_estimates")


def to_work(ledger: Ledger) -> Work:
    """``ledger`` as :class:`Work`; :class:`NotPeriodic` where its ids are not in the order
    blocks are made, or a tick is not exactly one allocation or one free."""
    if ledger.held_output:
        raise NotPeriodic("the step holds its output into the next: not extrapolated")
    made = [b for b in ledger.blocks if b.born != START_TICK]
    first_made = min((b.id for b in made), default=len(ledger.blocks))
    keys: dict[int, Key] = {}
    for b in ledger.blocks:
        if b.born != START_TICK:
            keys[b.id] = ("t", b.born)
        elif b.id < first_made:
            keys[b.id] = ("s", b.id)
        elif b.id in ledger.first_use:
            keys[b.id] = ("l", ledger.first_use[b.id])
        else:
            raise NotPeriodic(f"block {b.id}, alive from the start, is made at no tick")
    order = sorted(keys, key=lambda i: _made_order(keys[i]))
    if order != sorted(keys) or len(set(keys.values())) != len(keys):
        raise NotPeriodic("the ledger's block ids are not the order its blocks are made in")
    born = sorted(b.born for b in made)
    died = sorted(b.died for b in ledger.blocks if b.died is not None)
    if sorted(born + died) != list(range(len(ledger.ticks))):
        raise NotPeriodic("a tick of the ledger is not exactly one allocation or one free")
    return Work(
        blocks={keys[b.id]: b for b in ledger.blocks},
        first_use={keys[i]: t for i, t in ledger.first_use.items()},
        ticks=list(ledger.ticks),
        spans=[(s, tuple(keys[i] for i in s.inputs)) for s in ledger.spans],
        ops=list(ledger.ops),
        scalars={name: getattr(ledger, name) for name in SCALARS},
        rest={"nondeterministic": list(ledger.nondeterministic)},
    )


def _made_order(key: Key) -> tuple[int, int, int]:
    kind, n = key
    return (0, n, 0) if kind == "s" else (1, n, 0 if kind == "l" else 1)


def from_work(work: Work) -> Ledger:
    """The :class:`Ledger` of ``work``: ids in the order its blocks are made."""
    keys = sorted(work.blocks, key=_made_order)
    ids = {k: i for i, k in enumerate(keys)}
    blocks = [replace(work.blocks[k], id=ids[k]) for k in keys]
    spans = [replace(s, inputs=tuple(ids[k] for k in inputs)) for s, inputs in work.spans]
    return Ledger(
        blocks,
        list(work.ticks),
        spans,
        list(work.ops),
        first_use={ids[k]: t for k, t in sorted(work.first_use.items(), key=lambda kv: ids[kv[0]])},
        nondeterministic=list(work.rest.get("nondeterministic", [])),
        **work.scalars,
    )


@dataclass(frozen=True)
class Growth:
    """One more layer, as read off the ledgers of k and k+1 layers: where each list of the
    (k+1)-layer ledger received the new layer's items (:class:`Seg`), and how its totals grew."""

    layers: Layers
    last: int
    """The index of the ledger's last layer: the one whose items the segments hold."""
    ticks: tuple[Seg, ...]
    start: tuple[Seg, ...]
    """Blocks registered at the start (the layer's parameters, their optimizer state)."""
    spans: tuple[Seg, ...]
    ops: tuple[Seg, ...]
    scalars: dict[str, int]
    """How much each scalar of the ledger grew by."""


def _free_token(b: Block, at: str | None, layers: Layers) -> Hashable:
    """A free of ``b`` at a tick of module ``at``: its size, and with :attr:`Layers.exact_frees`
    which block it is, as far as one more layer leaves that the same: its category and phase,
    and its layer relative to the tick's (or its module, outside the layers)."""
    if not layers.exact_frees:
        return ("f", b.nbytes)
    i, j = layers.index(at), layers.index(b.module)
    where = b.module if j is None else ("x" if i is None else j - i)
    return ("f", b.nbytes, b.category.value, b.phase.value, where)


def _tick_tokens(work: Work, layers: Layers) -> list[Hashable]:
    """What each tick is, without what it is for: the layer's events repeat these exactly."""
    freed = {b.died: b for b in work.blocks.values() if b.died is not None}
    out: list[Hashable] = []
    for t, tick in enumerate(work.ticks):
        b = work.blocks.get(("t", t))
        what = ("a", b.nbytes, b.module, b.phase.value, b.stream) if b is not None else _free_token(freed[t], tick.module, layers)
        out.append((tick.phase.value, tick.module, tick.op, tick.recompute, what))
    return out


def _start_tokens(work: Work) -> list[Hashable]:
    # who saves a parameter names its layer: without it the layers' parameters are alike
    return [(b.nbytes, b.category.value, b.module, b.stream, b.savers) for b in work.start]


def find_growth(a: Ledger, b: Ledger, layers: Layers, last: int) -> Growth:
    """How ``b`` (one more layer, whose last layer is ``last``) grew from ``a``; :class:`NotPeriodic` if it did not by one layer."""
    wa, wb = to_work(a), to_work(b)
    if wa.rest != wb.rest:
        raise NotPeriodic("the nondeterministic ops found differ with one more layer")
    spans = [[(s.module, s.phase.value) for s, _ in w.spans] for w in (wa, wb)]
    ops = [[(o.module, o.op, o.flops) for o in w.ops] for w in (wa, wb)]
    ticks = segments(_tick_tokens(wa, layers), _tick_tokens(wb, layers), layers, "ticks")

    def within(ranges: list[tuple[int, int]]) -> Callable[[int, int], bool]:
        # a layer's op calls and module calls lie among its ticks (where copies of them can go)
        return lambda i, j: all(any(t.start <= a and b <= t.end for t in ticks) for a, b in ranges[i:j])

    return Growth(
        layers,
        last,
        tuple(ticks),
        tuple(segments(_start_tokens(wa), _start_tokens(wb), layers, "blocks at the start")),
        tuple(segments(spans[0], spans[1], layers, "module spans", within([(s.start, s.end) for s, _ in wb.spans]))),
        tuple(segments(ops[0], ops[1], layers, "op calls", within([(o.first, o.end) for o in wb.ops]))),
        {k: wb.scalars[k] - wa.scalars[k] for k in SCALARS},
    )


class _Maps:
    """One growth's maps of blocks (:data:`Key`) and ticks, from the ledger before to the one
    after ``times`` more layers."""

    def __init__(self, g: Growth, ticks: Moves, start: Moves) -> None:
        self.g, self.ticks, self.start, self.times = g, ticks, start, ticks.times

    def _moves(self, key: Key) -> Moves:
        return self.start if key[0] == "s" else self.ticks

    def kind(self, key: Key) -> int | None:
        """0: made by the last layer; -1: by the layer before; None: anything else."""
        if key[0] == "l":
            return None
        w = self._moves(key).region(key[1])
        return None if w is None or w[1] == -2 else w[1]

    def fixed(self, key: Key) -> Key:
        return (key[0], self._moves(key).fixed(key[1]))

    def copy(self, key: Key, j: int) -> Key:
        m = self._moves(key)
        seg = m.seg_of(key[1])
        assert seg is not None
        return (key[0], m.copy(seg, key[1], j))

    def shift(self, key: Key, by: int) -> Key:
        return self.fixed(key) if key[0] == "l" else (key[0], self._moves(key).shift(key[1], by))

    def last(self, key: Key) -> Key:
        """A block referred to from outside the layers: the last layer's becomes the new last layer's."""
        return self.fixed(key) if key[0] == "l" else (key[0], self._moves(key).last(key[1]))

    def counterpart(self, key: Key) -> Key:
        """The layer before's block made where ``key`` (the last layer's) is made."""
        seg = self._moves(key).seg_of(key[1])
        assert seg is not None
        return (key[0], seg.period[0] + key[1] - seg.start)


def _block(b: Block, born: int, module: str | None, died: int | None, savers: tuple[str, ...], src: Block) -> Block:
    return Block(0, b.nbytes, src.category, b.phase, module, born, died, savers, src.mutated, b.stream)


def _outer_savers(m: _Maps, savers: tuple[str, ...]) -> tuple[str, ...]:
    """Who saves a block made outside the layers: saved by the last layer, it is by the new
    last layer; by every layer (the last and the one before), by the new ones too, beside the
    last layer's on the side away from the layer before's (a recompute in backward saves them
    last layer first)."""
    layers, last = m.g.layers, m.g.last
    mine = [i for i, s in enumerate(savers) if layers.index(s) == last]
    if not mine:
        return savers
    before = [i for i, s in enumerate(savers) if layers.index(s) == last - 1]
    if not before:
        return tuple(layers.shift(s, m.times) if layers.index(s) == last else s for s in savers)
    ahead = min(before) > max(mine)
    at = mine[0] if ahead else mine[-1] + 1
    order = range(m.times, 0, -1) if ahead else range(1, m.times + 1)
    new = tuple(layers.shift(savers[i], j) for j in order for i in mine)
    return savers[:at] + new + savers[at:]


def _grow_blocks(w: Work, m: _Maps) -> tuple[dict[Key, Block], dict[Key, int]]:
    """Each block after the growth: a block of the last layer now as the layer before's was
    (one layer on), its copies as the layer before's (j + 1 layers on) but the last copy, which
    is as the last layer's was (``times`` layers on); the layer before's as it was; any other
    with what it had of the last layer moved to the new last layer."""
    blocks: dict[Key, Block] = {}
    first_use: dict[Key, int] = {}
    t, layers = m.ticks, m.g.layers

    def put(key: Key, b: Block, born: int, module: str | None, src: Block, first: int | None, by: int) -> None:
        died = None if src.died is None else t.shift(src.died, by)
        blocks[key] = _block(b, born, module, died, tuple(layers.shift(x, by) for x in src.savers), src)
        if first is not None:
            first_use[key] = t.shift(first, by)

    for key, b in w.blocks.items():
        kind, first = m.kind(key), w.first_use.get(key)
        born = b.born if b.born == START_TICK else t.fixed(b.born)
        if kind == 0:
            src_key = m.counterpart(key)
            src = w.blocks.get(src_key)
            if src is None:
                raise NotPeriodic(f"the last layer makes a block where the layer before makes none ({key})")
            put(m.fixed(key), b, born, b.module, src, w.first_use.get(src_key), 1)
            for j in range(1, m.times + 1):
                copy_born = b.born if b.born == START_TICK else t.copy(t.seg_of(b.born), b.born, j)  # type: ignore[arg-type]
                last = j == m.times
                mine = b if last else src
                put(m.copy(key, j), b, copy_born, layers.shift(b.module, j), mine, first if last else w.first_use.get(src_key), j if last else j + 1)
        elif kind == -1:
            died = None if b.died is None else t.fixed(b.died)
            blocks[m.fixed(key)] = _block(b, born, b.module, died, b.savers, b)
            if first is not None:
                first_use[m.fixed(key)] = t.fixed(first)
        else:
            died = None if b.died is None else t.last(b.died)
            blocks[m.fixed(key)] = _block(b, born, b.module, died, _outer_savers(m, b.savers), b)
            if first is not None:
                first_use[m.fixed(key)] = t.last(first)
    return blocks, first_use


def _grow_ticks(w: Work, m: _Maps) -> list[Tick]:
    total = len(w.ticks) + m.times * sum(s.size for s in m.g.ticks)
    out: list[Tick | None] = [None] * total
    for t, tick in enumerate(w.ticks):
        out[m.ticks.fixed(t)] = tick
    for seg in m.g.ticks:
        for t in range(seg.start, seg.end):
            tick = w.ticks[t]
            for j in range(1, m.times + 1):
                out[m.ticks.copy(seg, t, j)] = Tick(tick.phase, m.g.layers.shift(tick.module, j), tick.op, tick.recompute)
    assert all(t is not None for t in out)
    return out  # type: ignore[return-value]


def _copy_range(m: _Maps, start: int, end: int, j: int, what: str) -> tuple[int, int]:
    """Ticks ``[start, end)`` of the last layer's call, in copy ``j``."""
    for seg in m.g.ticks:
        if seg.start <= start and end <= seg.end:
            return m.ticks.copy(seg, start, j), m.ticks.copy(seg, end, j)
    raise NotPeriodic(f"a {what} of the last layer lies outside its events ({start}, {end})")


def _grow_list(
    items: list[Any], segs: tuple[Seg, ...], times: int, kept: Callable[[Any, bool, bool], Any], copy: Callable[[Any, int], Any]
) -> list[Any]:
    """``items`` with each segment's copies beside it: ``kept(item, in_segment, in_period)``
    and ``copy(item, j)`` give the items as they are in the ledger after."""
    moves = Moves(segs, times)
    out: list[Any] = [None] * (len(items) + times * sum(s.size for s in segs))
    for i, item in enumerate(items):
        w = moves.region(i)
        seg = w[0] if w is not None and w[1] == 0 else None
        out[moves.fixed(i)] = kept(item, seg is not None, w is not None and w[1] == -1)
        if seg is not None:
            for j in range(1, times + 1):
                out[moves.copy(seg, i, j)] = copy(item, j)
    return out


def _grow_spans(w: Work, m: _Maps) -> list[tuple[Span, tuple[Key, ...]]]:
    def kept(item: Any, new: bool, period: bool) -> Any:
        s, inputs = item
        moved = Span(s.module, s.phase, m.ticks.item(s.start, new), m.ticks.item(s.end, new), s.inputs)
        return moved, tuple(m.fixed(k) if new or period else m.last(k) for k in inputs)

    def copy(item: Any, j: int) -> Any:
        s, inputs = item
        start, end = _copy_range(m, s.start, s.end, j, "module call")
        return Span(m.g.layers.shift(s.module, j), s.phase, start, end, s.inputs), tuple(m.shift(k, j) for k in inputs)

    out = _grow_list(w.spans, m.g.spans, m.times, kept, copy)
    return sorted(out, key=lambda si: (si[0].start, -si[0].end))


def _grow_ops(w: Work, m: _Maps) -> list[OpCall]:
    def kept(o: OpCall, new: bool, period: bool) -> OpCall:
        return OpCall(o.module, o.op, o.flops, m.ticks.item(o.first, new), m.ticks.item(o.end, new))

    def copy(o: OpCall, j: int) -> OpCall:
        first, end = _copy_range(m, o.first, o.end, j, "op call")
        return OpCall(m.g.layers.shift(o.module, j), o.op, o.flops, first, end)

    return _grow_list(w.ops, m.g.ops, m.times, kept, copy)


def _deep(tokens: list[Hashable], segs: tuple[Seg, ...], layers: Layers) -> tuple[bool, ...]:
    """Per segment: whether the period two layers back (beside the previous period) is the segment's, two layers on."""
    out = []
    for s in segs:
        a, b = s.period
        lo, hi = (a - s.size, a) if s.after else (b, b + s.size)
        two = [layers.shift_token(x, 2) for x in tokens[lo:hi]] if lo >= 0 and hi <= len(tokens) else []
        out.append(two == tokens[s.start : s.end])
    return tuple(out)


def grow(ledger: Ledger, g: Growth, times: int = 1) -> tuple[Ledger, Growth]:
    """``ledger`` with ``times`` more layers, as ``g`` says; and the growth of the ledger after."""
    w = to_work(ledger)
    m = _Maps(g, Moves(g.ticks, times, _deep(_tick_tokens(w, g.layers), g.ticks, g.layers)), Moves(g.start, times))
    blocks, first_use = _grow_blocks(w, m)
    grown = Work(
        blocks,
        first_use,
        _grow_ticks(w, m),
        _grow_spans(w, m),
        _grow_ops(w, m),
        {k: v + times * g.scalars[k] for k, v in w.scalars.items()},
        w.rest,
    )

    def moved(segs: tuple[Seg, ...]) -> tuple[Seg, ...]:
        moves = Moves(segs, times)
        return tuple(Seg(moves.copy(s, s.start, times), moves.copy(s, s.start, times) + s.size, s.after) for s in segs)

    after = replace(g, last=g.last + times, ticks=moved(g.ticks), start=moved(g.start), spans=moved(g.spans), ops=moved(g.ops))
    return from_work(grown), after


def first_difference(got: dict[str, Any], want: dict[str, Any]) -> str:
    """Where two ledgers (``Ledger.to_dict``) first differ, in a few words."""
    for name in want:
        if got.get(name) == want[name]:
            continue
        a, b = got.get(name), want[name]
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return f"{name}: {len(a)} synthesized, {len(b)} recorded"
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"{name}[{i}]: synthesized {a[i]}, recorded {b[i]}"
        return f"{name}: synthesized {a}, recorded {b}"
    return "nothing"


def extrapolate(ledgers: Sequence[Ledger], layers: Layers, first: int, target: int) -> Ledger:
    """The ledger of ``target`` layers from ``ledgers`` of ``first``, ``first + 1`` and
    ``first + 2`` layers: the growth the first two show, checked to give the third exactly
    (:class:`NotPeriodic` saying where it does not), then applied up to ``target``."""
    a, b, c = ledgers
    growth = find_growth(a, b, layers, first)
    synthesized, growth = grow(b, growth)
    got, want = synthesized.to_dict(), c.to_dict()
    if got != want:
        raise NotPeriodic(f"the {first + 2}-layer ledger synthesized differs from the recorded one: {first_difference(got, want)}")
    if target == first + 2:
        return c
    return grow(c, growth, target - first - 2)[0]


def grow_counts(counts: Sequence[dict[Any, int]], layers: Layers, first: int, target: int) -> dict[Any, int]:
    """Counts by module (FLOPs by (phase, module), calls by module) of ``target`` layers from
    those of ``first``, ``first + 1`` and ``first + 2`` layers: the last layer's keys copied
    for each new layer, every other count grown as from ``first`` to ``first + 1``; checked
    at ``first + 2`` as :func:`extrapolate` checks the ledger."""
    a, b, c = counts
    if not set(a) <= set(b) or any(layers.index(_module(k)) != first for k in set(b) - set(a)):
        raise NotPeriodic("the counts by module of one more layer differ by more than its modules")
    step = {k: b[k] - a[k] for k in a}

    def more(cur: dict[Any, int], last: int) -> dict[Any, int]:
        out = {k: v + step.get(k, 0) for k, v in cur.items()}
        out.update({layers.shift_token(k): v for k, v in cur.items() if layers.index(_module(k)) == last})
        return out

    if more(b, first) != c:
        raise NotPeriodic(f"the counts by module synthesized for {first + 2} layers differ from the recorded ones")
    out = c
    for last in range(first + 1, target - 1):
        out = more(out, last)
    return out


def _module(key: Any) -> Any:
    return key[1] if isinstance(key, tuple) else key
