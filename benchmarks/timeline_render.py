"""How fast the timeline pictures render, and how big they are, for large ledgers.

    python benchmarks/timeline_render.py                      # a synthetic 100k-tick ledger
    python benchmarks/timeline_render.py --ticks 300000
    python benchmarks/timeline_render.py --target gpt --size n_layer=96 --batch-size 16   # a fake profile
    python benchmarks/timeline_render.py --out /tmp/pictures  # keep the PNG and the page
    python benchmarks/timeline_render.py --cuda               # with the allocator model's allocated/reserved lines
    python benchmarks/timeline_render.py --snapshot-events 100000   # a synthetic GPU trace (memfit snapshot --plot)

The synthetic ledger is a step of many identical layers: each forward saves activations and
makes short-lived temporaries, each backward frees them; parameters and optimizer state
are alive throughout. Times are wall clock of one render on this host.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from memfit.measure.ledger import START_TICK, Block, Category, Ledger, Phase, Span, Tick


def synthetic_ledger(ticks: int = 100_000, seed: int = 0) -> Ledger:
    """A step of about ``ticks`` ticks: ``ticks // 60`` layers of 30 ticks forward, 30 backward."""
    rng = random.Random(seed)
    blocks: list[Block] = []
    timeline: list[Tick] = []
    spans: list[Span] = []
    born: dict[int, tuple] = {}
    died: dict[int, int] = {}

    def alloc(nbytes: int, cat: Category, phase: Phase, module: str | None, op: str) -> int:
        i = len(born)
        born[i] = (nbytes, cat, phase, module, len(timeline))
        timeline.append(Tick(phase, module, op))
        return i

    def free(i: int, phase: Phase, module: str | None, op: str) -> None:
        died[i] = len(timeline)
        timeline.append(Tick(phase, module, op))

    layers = max(1, ticks // 60)
    for i in range(50):
        born[len(born)] = (4 << 20, Category.PARAMETER, Phase.START, f"layers.{i}", START_TICK)
        born[len(born)] = (8 << 20, Category.OPTIMIZER, Phase.START, None, START_TICK)
    saved: list[list[int]] = []
    for layer in range(layers):
        name, start = f"layers.{layer}", len(timeline)
        acts = []
        for _ in range(10):
            acts.append(alloc(rng.randint(1, 64) << 16, Category.ACTIVATION, Phase.FORWARD, name, "mm"))
            t = alloc(rng.randint(1, 256) << 16, Category.TEMPORARY, Phase.FORWARD, name, "gelu")
            free(t, Phase.FORWARD, name, "gelu")
        saved.append(acts)
        spans.append(Span(name, Phase.FORWARD, start, len(timeline)))
    for layer in reversed(range(layers)):
        name, start = f"layers.{layer}", len(timeline)
        for a in saved[layer]:
            t = alloc(rng.randint(1, 128) << 16, Category.TEMPORARY, Phase.BACKWARD, name, "mm")
            free(t, Phase.BACKWARD, name, "mm")
            free(a, Phase.BACKWARD, name, "mm")
        spans.append(Span(name, Phase.BACKWARD, start, len(timeline)))
    for i, (nbytes, cat, phase, module, b) in born.items():
        blocks.append(Block(i, nbytes, cat, phase, module, b, died.get(i)))
    return Ledger(blocks, timeline, spans)


def synthetic_snapshot(events: int = 100_000, seed: int = 0) -> dict:
    """A ``torch.cuda.memory._dump_snapshot`` dict of about ``events`` trace events, made by
    running training steps of many layers through memfit's allocator model (so addresses,
    splits and segments are consistent the way a real GPU's are): parameters allocated before
    recording began, then per step each layer's activations and temporaries (some under 1 MiB,
    in the small pool), freed in backward; the gradients allocated in the first step stay."""
    from memfit.cuda.allocator import CachingAllocator

    rng = random.Random(seed)
    alloc = CachingAllocator()
    trace: list[dict] = []
    live = {}

    def frames(line: int, fn: str) -> list[dict]:
        return [
            {"filename": "/site-packages/torch/nn/functional.py", "line": 1, "name": fn},
            {"filename": "/proj/model.py", "line": line, "name": "forward"},
            {"filename": "/proj/train.py", "line": 12, "name": "step"},
        ]

    def malloc(size: int, where: list[dict] | None, record: bool = True) -> int:
        before = len(alloc.segments)
        b = alloc.malloc(size)
        live[b.ptr] = b
        if record:
            for sg in alloc.segments[before:]:
                trace.append({"action": sg.action, "addr": sg.ptr, "size": sg.size, "stream": 0, "frames": where or []})
            trace.append({"action": "alloc", "addr": b.ptr, "size": size, "stream": 0, "frames": where or []})
        return b.ptr

    def free(ptr: int) -> None:
        b = live.pop(ptr)
        for act in ("free_requested", "free_completed"):
            trace.append({"action": act, "addr": ptr, "size": b.requested, "stream": 0, "frames": []})
        alloc.free(b)

    layers = 24
    params = [malloc(rng.randint(4, 24) << 20, None, record=False) for _ in range(layers)]
    grads: list[int] = []
    while len(trace) < events:
        saved: list[list[int]] = []
        for layer in range(layers):
            acts = [malloc(rng.choice((rng.randint(1, 255) << 12, rng.randint(1, 16) << 20)), frames(40 + layer, "linear"))]
            for _ in range(6):
                acts.append(malloc(rng.randint(1, 64) << 18, frames(60 + layer, "gelu")))
                tmp = malloc(rng.randint(1, 96) << 18, frames(80, "softmax"))
                free(tmp)
            saved.append(acts)
        for layer in reversed(range(layers)):
            for a in saved[layer]:
                tmp = malloc(rng.randint(1, 64) << 18, frames(120 + layer, "backward"))
                free(tmp)
                free(a)
            if len(grads) < layers:
                grads.append(malloc(live[params[layer]].requested, frames(200, "backward")))
    released = len(alloc.segments)
    alloc.empty_cache()
    trace.extend(
        {"action": sg.action, "addr": sg.ptr, "size": sg.size, "stream": 0, "frames": []} for sg in alloc.segments[released:]
    )

    blocks = [b for pool in (alloc.small, alloc.large) for b in pool.blocks.values()] + list(live.values())
    segments = []
    for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.ptr):
        chain, b = [], head
        while b is not None:
            state = "active_allocated" if b.allocated else "inactive"
            chain.append(
                {"address": b.ptr, "size": b.size, "requested_size": b.requested or b.size, "state": state, "frames": []}
            )
            b = b.next
        segments.append(
            {
                "device": 0,
                "address": head.ptr,
                "total_size": sum(c["size"] for c in chain),
                "stream": 0,
                "segment_type": "small" if head.small else "large",
                "is_expandable": False,
                "blocks": chain,
            }
        )
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": False}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=100_000)
    parser.add_argument("--target", help="profile this zoo model on fake tensors instead")
    parser.add_argument("--size", action="append", default=[])
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--out", help="directory to keep timeline.png and timeline.html in")
    parser.add_argument("--cuda", action="store_true", help="draw CUDA's allocated and reserved (the allocator model's replay)")
    parser.add_argument("--snapshot-events", type=int, help="render a synthetic GPU trace of about this many events instead")
    ns = parser.parse_args(argv)

    from memfit.report.timeline import Timeline, build_track, timeline_html, timeline_png

    if ns.snapshot_events:
        return _snapshot(ns)

    if ns.target:
        import memfit
        from memfit.zoo import parse_sizes

        work = memfit.load_target(ns.target, batch_size=ns.batch_size, sizes=parse_sizes(ns.size))
        t0 = time.perf_counter()
        prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake=True)
        print(f"fake profile of {ns.target} {' '.join(ns.size)}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        ledger, what = prof.ledger, f"zoo {ns.target} {' '.join(ns.size)} (fake profile)"
    else:
        ledger, what = synthetic_ledger(ns.ticks), "synthetic"

    t0 = time.perf_counter()
    lines = []
    if ns.cuda:
        from memfit.measure.replay import ledger_series

        s = ledger_series(ledger)
        lines = [("allocated", s.allocated, s.stats.allocated_peak_bytes), ("reserved", s.reserved, s.stats.reserved_peak_bytes)]
        what += " + allocated/reserved lines"
    track = build_track(ledger, "step", lines=lines)
    t1 = time.perf_counter()
    page = timeline_html(Timeline(what, [track]))
    t2 = time.perf_counter()
    png = timeline_png(Timeline(what, [track]))
    t3 = time.perf_counter()
    exact = track.peak_bytes == ledger.peak_bytes and max(track.total) == ledger.peak_bytes
    head = "| ledger | ticks | blocks | aggregate | page | page size | PNG | PNG size | peak exact |"
    row = [what, len(ledger.ticks), len(ledger.blocks), t1 - t0, t2 - t1]
    return _report(ns, "timeline", head, row, page, png, t3 - t2, exact)


def _report(ns, name: str, head: str, row: list, page: str, png: bytes, png_s: float, exact: bool) -> int:
    """Keep the pictures if asked; print the table's row."""
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / f"{name}.png").write_bytes(png)
        (Path(ns.out) / f"{name}.html").write_text(page)
    cells = [f"{v:.2f} s" if isinstance(v, float) else str(v) for v in row]
    cells += [f"{len(page.encode()) / 1e6:.2f} MB", f"{png_s:.2f} s", f"{len(png) / 1e3:.0f} kB", str(exact)]
    print(head + "\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n| " + " | ".join(cells) + " |")
    return 0 if exact else 1


def _snapshot(ns: argparse.Namespace) -> int:
    from memfit.cuda.snapshot import relive, trace_timeline
    from memfit.report.timeline import snapshot_timeline, timeline_html, timeline_png

    snap = synthetic_snapshot(ns.snapshot_events)
    t0 = time.perf_counter()
    tt = trace_timeline(snap)
    t1 = time.perf_counter()
    tl = snapshot_timeline(tt, "synthetic trace", "memory")
    page = timeline_html(tl)
    t2 = time.perf_counter()
    png = timeline_png(tl)
    t3 = time.perf_counter()
    rec = relive(snap).stats
    track = tl.tracks[0]
    exact = track.peak_bytes == rec.allocated_peak_bytes and track.line_peaks[0][1] == rec.reserved_peak_bytes
    head = "| trace | events | blocks | re-live | aggregate + page | page size | PNG | PNG size | peaks exact |"
    return _report(
        ns, "snapshot", head, ["synthetic", len(tt.actions), len(tt.blocks), t1 - t0, t2 - t1], page, png, t3 - t2, exact
    )


if __name__ == "__main__":
    sys.exit(main())
