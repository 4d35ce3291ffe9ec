"""How fast the timeline pictures render, and how big they are, for large ledgers.

    python benchmarks/timeline_render.py                      # a synthetic 100k-tick ledger
    python benchmarks/timeline_render.py --ticks 300000
    python benchmarks/timeline_render.py --target gpt --size n_layer=96 --batch-size 16   # a fake profile
    python benchmarks/timeline_render.py --out /tmp/pictures  # keep the PNG and the page

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=100_000)
    parser.add_argument("--target", help="profile this zoo model on fake tensors instead")
    parser.add_argument("--size", action="append", default=[])
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--out", help="directory to keep timeline.png and timeline.html in")
    ns = parser.parse_args(argv)

    from memfit.report.timeline import Timeline, build_track, timeline_html, timeline_png

    if ns.target:
        import memfit
        from memfit.cli import parse_sizes

        work = memfit.load_target(ns.target, batch_size=ns.batch_size, sizes=parse_sizes(ns.size))
        t0 = time.perf_counter()
        prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake=True)
        print(f"fake profile of {ns.target} {' '.join(ns.size)}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        ledger, what = prof.ledger, f"zoo {ns.target} {' '.join(ns.size)} (fake profile)"
    else:
        ledger, what = synthetic_ledger(ns.ticks), "synthetic"

    t0 = time.perf_counter()
    track = build_track(ledger, "step")
    t1 = time.perf_counter()
    page = timeline_html(Timeline(what, [track]))
    t2 = time.perf_counter()
    png = timeline_png(Timeline(what, [track]))
    t3 = time.perf_counter()
    exact = track.peak_bytes == ledger.peak_bytes and max(track.total) == ledger.peak_bytes
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "timeline.png").write_bytes(png)
        (Path(ns.out) / "timeline.html").write_text(page)
    print(
        "| ledger | ticks | blocks | aggregate | page | page size | PNG | PNG size | peak exact |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---|\n"
        f"| {what} | {len(ledger.ticks)} | {len(ledger.blocks)} | {t1 - t0:.2f} s | {t2 - t1:.2f} s | "
        f"{len(page.encode()) / 1e6:.2f} MB | {t3 - t2:.2f} s | {len(png) / 1e3:.0f} kB | {exact} |"
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
