"""One rank's step of a model of L identical layers, from the same rank's steps of the model
built with k, k+1 and k+2 layers (issue 26): extrapolated and checked, or not used.

A fake rank's step costs per op dispatched, and a decoder dispatches each layer's ops once per
layer. Where the workload says how to build its model with fewer layers
(:class:`memfit.workload.LayerStack`), the rank's step is run (warm-up step, recorded step) on
the fake process group at the same world size and rank with :data:`EXTRAPOLATE_FROM`, one
and two more layers; :func:`memfit.measure.extrapolate.extrapolate` synthesizes the
(k+2)-layer ledger from the first two and requires it equal to the recorded one, block for
block and tick for tick, before it synthesizes the whole model's ledger. FLOPs and module
calls grow the same way, checked the same way.

Not used (the whole model's step runs, as before, and the reason is given) where the layers
cannot be shown identical or the step is not periodic: no :class:`LayerStack`, too few
layers, a plan already applied, transformers' gradient checkpointing, pipeline parallelism,
DistributedDataParallel (its buckets group parameters across layers, by bytes), FSDP2 with
``keep_last`` (the last blocks differ), a model whose layers differ in their parameters or
modules from the rebuilt ones, and any step whose (k+2)-layer ledger the check refuses (FSDP2's
prefetch across layers would show there).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from memfit.errors import MemfitError
from memfit.measure.extrapolate import Layers, NotPeriodic, find_growth, first_difference, grow, grow_counts
from memfit.measure.ledger import START_TICK, Category, Ledger, Phase, Tick
from memfit.measure.profile import Progress
from memfit.recompute.checkpoint import applied_choices
from memfit.workload import Workload

__all__ = ["EXTRAPOLATE_FROM", "MIN_LAYERS", "RankStep", "refused", "rank_layers", "small_signature"]

EXTRAPOLATE_FROM = 4
"""k. The first layer follows the embeddings and, under FSDP2, its backward is the last (no
layer's all-gather to prefetch); the last layer's backward runs first (no reduce-scatter before
it to free; see :class:`_Last`). From 4 layers, one more is a middle layer inserted beside a
middle one, whose blocks reach into the backward of a middle layer too."""


MIN_LAYERS = 24
"""The fewest layers a model needs for its rank steps to be taken from fewer layers: each of the
three steps pays again for what is outside the layers and for its ``parallelize`` (at Llama-3-8B's
dimensions the 4-, 5- and 6-layer steps cost 10.5 CPU s, the 32-layer model's parallelize and
warm-up step 8.4, its recorded step about as much again)."""


@dataclass(frozen=True)
class RankStep:
    """One rank's recorded step, as the fewer-layer steps are recorded and as the whole model's
    is synthesized from them (:func:`rank_layers`): the same figures either way."""

    ledger: Ledger
    flops: dict[tuple[Phase, str | None], int]
    calls: dict[str, int]
    types: dict[str, str]
    """Each module's class name on the parallelized rank (FSDP2 renames the classes it shards)."""
    resident_bytes: int
    """What the rank held before its first step (:attr:`RankState.resident_bytes`); the whole
    rank's grown as the ledger (checked)."""
    layout: tuple
    """The rank's layout (:attr:`RankState.layout`); the whole rank's is the largest fewer-layer
    step's: equal between ranks exactly when theirs are."""


def refused(workload: Workload) -> str | None:
    """Why ``workload``'s rank steps cannot be extrapolated from fewer layers (None: they may be, if the check passes)."""
    stack, parallel = workload.layers, workload.parallel
    if stack is None:
        return "the workload does not say how to build its model with fewer layers (Workload.layers)"
    if stack.count < max(MIN_LAYERS, EXTRAPOLATE_FROM + 3):
        return f"{stack.count} layers, fewer than {max(MIN_LAYERS, EXTRAPOLATE_FROM + 3)}: the whole step costs about what its steps of 4, 5 and 6 layers do"
    if parallel is None or parallel.name == "pp" or type(parallel.parallelize).__name__ == "Pipeline":
        return "pipeline parallelism: each stage holds other layers"
    if getattr(parallel.parallelize, "keep_last", 0):  # FSDP2's
        return "FSDP2 keeps the last blocks unsharded after forward (keep_last): the layers differ"
    if applied_choices(workload.model) is not None:
        return "a plan is applied to the model"
    if getattr(workload.model, "is_activation_checkpointing", False) or _hf_checkpointing(workload.model):
        return "transformers' gradient checkpointing: a layer's blocks reach two layers back"
    return _layers_differ(workload.model, stack.prefix, stack.count)


def _signature(model: nn.Module, prefix: str) -> tuple[tuple, list[tuple]] | str:
    """The model's modules and tensors outside its layers, and each layer's (names relative to it)."""
    layers = Layers(prefix)
    outside: list[tuple] = []
    per: dict[int, list[tuple]] = {}
    for name, mod in model.named_modules():
        i = layers.index(name)
        row = (type(mod).__name__,)
        if i is None:
            outside.append((name, *row))
        else:
            per.setdefault(i, []).append((name[len(prefix) + len(str(i)) :], *row))
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        i = layers.index(name)
        row = (tuple(t.shape), str(t.dtype), t.requires_grad)
        if i is None:
            outside.append((name, *row))
        else:
            per.setdefault(i, []).append((name[len(prefix) + len(str(i)) :], *row))
    return tuple(outside), [tuple(per[i]) for i in sorted(per)]


def _layers_differ(model: nn.Module, prefix: str, count: int) -> str | None:
    try:
        stack = model.get_submodule(prefix[:-1])
    except AttributeError:
        return f"the model has no {prefix[:-1]!r}"
    if not isinstance(stack, nn.ModuleList) or len(stack) != count:
        return f"{prefix[:-1]!r} is not a list of {count} layers"
    mine = {id(p) for p in stack.parameters()}
    if sum(1 for _, p in model.named_parameters(remove_duplicate=False) if id(p) in mine) != len(mine):
        return "the layers share parameters (tied or shared layers)"
    _, per = _signature(model, prefix)
    if len(per) != count or len(set(per)) != 1:
        return "the layers differ in their modules or parameters"
    return None


def small_signature(workload: Workload, model: nn.Module, n: int) -> str | None:
    """Why ``model``, ``workload``'s model rebuilt with ``n`` layers, is not it with fewer layers (None: it is)."""
    stack = workload.layers
    assert stack is not None
    whole, small = _signature(workload.model, stack.prefix), _signature(model, stack.prefix)
    if whole[0] != small[0] or set(small[1]) != set(whole[1]) or len(small[1]) != n:
        return f"the model rebuilt with {n} layers differs from the whole one outside its layers or in them"
    return None


def rank_layers(workload: Workload, small: Callable[[int], RankStep | str], rank: str = "", progress: Progress | None = None) -> RankStep | str:
    """The rank's whole recorded step (a :class:`RankStep`) from its steps with fewer layers,
    ``small(n)`` (the step with ``n`` layers, or why it cannot be used), or why not."""
    why = refused(workload)
    if why is not None:
        return why
    stack = workload.layers
    assert stack is not None
    k, total, layers = EXTRAPOLATE_FROM, stack.count, Layers(stack.prefix, exact_frees=True)
    report = progress or (lambda desc, done, total: None)
    smalls: list[RankStep] = []
    for i, n in enumerate((k, k + 1, k + 2)):
        report(f"{rank}the step with {n} layers", i, 3)
        try:
            got = small(n)
        except MemfitError as exc:
            return f"the step with {n} layers failed: {exc}"
        if isinstance(got, str):
            return got
        smalls.append(got)
    named = [_Last(layers, n) for n in (k, k + 1, k + 2)]
    whole = _Last(layers, total)
    try:
        ledger = _extrapolated([m.ledger(s.ledger) for m, s in zip(named, smalls)], layers, k - 1, total - 1)
        flops = grow_counts([m.counts(s.flops) for m, s in zip(named, smalls)], layers, k - 1, total - 1)
        calls = grow_counts([m.counts(s.calls) for m, s in zip(named, smalls)], layers, k - 1, total - 1)
        resident = _grown([s.resident_bytes for s in smalls], k, total)
        types = _grown_types(workload.model, smalls[-1].types, layers, k + 1, total)
    except NotPeriodic as exc:
        return str(exc)
    return RankStep(whole.ledger(ledger, back=True), whole.counts(flops, back=True), whole.counts(calls, back=True), types, resident, smalls[-1].layout)


LAST = "@last"
"""The last layer's index in the ledgers extrapolated: it stays the last, whatever the count."""


@dataclass(frozen=True)
class _Last:
    """Names of a model of ``n`` layers with its last layer's index written :data:`LAST` (or back).

    Under FSDP2 the last layer is the first whose backward runs, and it runs without the
    reduce-scatter of a layer after it to free; each other layer frees the one before it.
    So the last layer's events are not a middle layer's: named by a fixed index, the last
    layer stays one, and a step of one more layer is one more middle layer inserted before it."""

    layers: Layers
    n: int

    def name(self, name: Any, back: bool = False) -> Any:
        if not isinstance(name, str) or not name.startswith(self.layers.prefix):
            return name
        head, dot, tail = name[len(self.layers.prefix) :].partition(".")
        last = str(self.n - 1)
        if head == (LAST if back else last):
            return f"{self.layers.prefix}{last if back else LAST}{dot}{tail}"
        return name

    def token(self, key: Any, back: bool = False) -> Any:
        return tuple(self.token(x, back) for x in key) if isinstance(key, tuple) else self.name(key, back)

    def counts(self, counts: dict[Any, int], back: bool = False) -> dict[Any, int]:
        return {self.token(k, back): v for k, v in counts.items()}

    def ledger(self, ledger: Ledger, back: bool = False) -> Ledger:
        def nm(x: Any) -> Any:
            return self.name(x, back)

        return replace(
            ledger,
            blocks=[replace(b, module=nm(b.module), savers=tuple(nm(x) for x in b.savers)) for b in ledger.blocks],
            ticks=[replace(t, module=nm(t.module)) for t in ledger.ticks],
            spans=[replace(x, module=nm(x.module)) for x in ledger.spans],
            ops=[replace(o, module=nm(o.module)) for o in ledger.ops],
        )


def _grown(values: Sequence[int], first: int, target: int) -> int:
    a, b, c = values
    if c - b != b - a:
        raise NotPeriodic("what a rank holds before its step does not grow by the same bytes with each layer")
    return c + (target - first - 2) * (c - b)


def _grown_types(model: nn.Module, types: dict[str, str], layers: Layers, last: int, total: int) -> dict[str, str]:
    """Each module's class name on the whole rank, in the whole model's order, from ``types``
    of the fewer-layer rank whose last layer is ``last``: the whole's last layer's as that
    last layer's, every other layer from ``last`` on as the middle layer before it."""
    out: dict[str, str] = {}
    for name, _ in model.named_modules():
        i = layers.index(name)
        src = name if i is None or i < last else layers.shift(name, (last if i == total - 1 else last - 1) - i)
        if src not in types:
            raise NotPeriodic(f"the fewer-layer rank has no module {src!r}")
        out[name] = types[src]
    return out


def _extrapolated(ledgers: list[Ledger], layers: Layers, first: int, total: int) -> Ledger:
    """:func:`~memfit.measure.extrapolate.extrapolate` of ledgers whose ticks may free many blocks
    at once (a fake CPU step frees its estimated autograd graph at one tick): each such tick
    split into one tick a block for the synthesis and its check, and joined again after."""
    split = [_split(x) for x in ledgers]
    joined = {t for x, (_, multi) in zip(ledgers, split) for t in multi}
    for x, (y, _) in zip(ledgers, split):
        if _join(y, joined).to_dict() != x.to_dict():
            raise NotPeriodic("a tick freeing several blocks is not one run of graph frees")
    (a, _), (b, _), (c, _) = split
    growth = find_growth(a, b, layers, first)
    got, growth = grow(b, growth)
    got_d, want = _join(got, joined).to_dict(), ledgers[2].to_dict()
    if got_d != want:
        # first counts the layers before the last one (:class:`_Last`)
        raise NotPeriodic(f"the {first + 3}-layer ledger synthesized differs from the recorded one: {first_difference(got_d, want)}")
    return ledgers[2] if total == first + 2 else _join(grow(c, growth, total - first - 2)[0], joined)


def _split(ledger: Ledger) -> tuple[Ledger, set[Tick]]:
    """``ledger`` with each tick that frees several blocks made one tick a block (in id order);
    and those ticks. Every boundary after such a tick moves on by the ticks added."""
    born = Counter(b.born for b in ledger.blocks if b.born != START_TICK)
    died: dict[int, list[int]] = defaultdict(list)
    for b in ledger.blocks:
        if b.died is not None:
            died[b.died].append(b.id)
    multi = sorted(t for t, ids in died.items() if len(ids) > 1)
    if not multi:
        return ledger, set()
    if any(born[t] for t in multi) or any(b.category is not Category.GRAPH for b in ledger.blocks if b.died in set(multi)):
        raise NotPeriodic("a tick frees several blocks that are not all the autograd graph's")

    def pos(q: int) -> int:
        return q + sum(len(died[t]) - 1 for t in multi if t < q)

    order = {i: n for t in multi for n, i in enumerate(sorted(died[t]))}
    many = set(multi)
    ticks = [tick for t, tick in enumerate(ledger.ticks) for _ in range(len(died[t]) if t in many else 1)]
    blocks = [
        replace(
            b,
            born=b.born if b.born == START_TICK else pos(b.born),
            died=None if b.died is None else pos(b.died) + (order[b.id] if b.died in many else 0),
        )
        for b in ledger.blocks
    ]
    out = replace(
        ledger,
        blocks=blocks,
        ticks=ticks,
        spans=[replace(x, start=pos(x.start), end=pos(x.end)) for x in ledger.spans],
        ops=[replace(o, first=pos(o.first), end=pos(o.end)) for o in ledger.ops],
        first_use={i: pos(t) for i, t in ledger.first_use.items()},
    )
    return out, {ledger.ticks[t] for t in multi}


def _join(ledger: Ledger, joined: set[Tick]) -> Ledger:
    """:func:`_split` undone: each run of consecutive ticks that are one of ``joined``, each
    freeing one graph block, made one tick."""
    freed = {b.died: b for b in ledger.blocks if b.died is not None}
    born = {b.born for b in ledger.blocks}

    def one(t: int) -> bool:
        b = freed.get(t)
        return b is not None and ledger.ticks[t] in joined and b.category is Category.GRAPH and t not in born

    new: list[int] = []  # each old tick's new index
    for t in range(len(ledger.ticks)):
        same = t > 0 and one(t) and one(t - 1) and ledger.ticks[t] == ledger.ticks[t - 1]
        new.append(new[-1] if same else (new[-1] + 1 if new else 0))
    if len(new) == new[-1] + 1 if new else True:
        return ledger
    count = new[-1] + 1

    def pos(q: int) -> int:
        return new[q] if q < len(new) else count

    ticks = [ledger.ticks[t] for t in range(len(new)) if t == 0 or new[t] != new[t - 1]]
    blocks = [
        replace(b, born=b.born if b.born == START_TICK else new[b.born], died=None if b.died is None else new[b.died])
        for b in ledger.blocks
    ]
    return replace(
        ledger,
        blocks=blocks,
        ticks=ticks,
        spans=[replace(x, start=pos(x.start), end=pos(x.end)) for x in ledger.spans],
        ops=[replace(o, first=pos(o.first), end=pos(o.end)) for o in ledger.ops],
        first_use={i: new[t] for i, t in ledger.first_use.items()},
    )


def _hf_checkpointing(model: nn.Module) -> bool:
    # transformers' layers flag it themselves (is_gradient_checkpointing is deprecated on the model)
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
