"""Per-stage memory of pipelined steps (torch.distributed.pipelining: GPipe, 1F1B, interleaved
1F1B): memfit's fake-process-group prediction against real multi-process gloo runs on this CPU.

Each real rank runs in its own process (torch.multiprocessing spawn, gloo backend). Two
measurements per rank, each after two warm-up steps:

1. memfit's recorder on the rank's real tensors (the same step, recorded as the prediction is);
   gloo's own copies (none were seen here) and kernel workspaces left out, as in
   ``distributed_gloo.py``;
2. recorder-free: the same pipelined step run plainly (no dispatch mode, no hooks of memfit's)
   under torch's profiler with ``profile_memory=True``, which reports every allocation and free
   of c10's CPU allocator: the peak of live bytes over the step's start. Compared with the
   prediction's rise over its start, tensors only (the autograd-graph estimate is host memory
   outside the allocator).

The prediction is memfit's profile of each rank on the fake process group, fake tensors, one
process. Usage:

    python benchmarks/pipeline_gloo.py [--world-sizes 2,4] [--schedules gpipe,1f1b,interleaved1f1b]
                                       [--microbatches 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo import gloo_ranks  # noqa: E402

# zoo llama's tiny preset (8 x 512, vocab 8192): 8 layers split into 2, 4 or 8 stages.
SIZES = dict(preset="tiny", seq_len=128, batch_size=8)


def workload(schedule: str, microbatches: int, sizes: dict | None = None):
    from memfit import zoo

    return zoo.build("llama", parallel="pp", schedule=schedule, microbatches=microbatches, **(sizes or SIZES))


def _rank(rank: int, world_size: int, schedule: str, microbatches: int, sizes: dict | None) -> dict:
    from memfit.measure.distributed import CURRENT_GROUP, profile_rank

    return profile_rank(workload(schedule, microbatches, sizes), CURRENT_GROUP).to_dict()


def _rank_allocations(rank: int, world_size: int, schedule: str, microbatches: int, sizes: dict | None) -> dict:
    """The step run plainly (memfit's sandbox builds the rank's model, optimizer and inputs;
    no recorder), its CPU allocator events read from torch's profiler: the peak rise."""
    import gc

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from memfit.measure.compiled import _allocations
    from memfit.measure.distributed import _mesh, _parallel_sandbox

    work = workload(schedule, microbatches, sizes)
    box = _parallel_sandbox(work, work.parallel, _mesh(work.parallel, world_size), None)
    for _ in range(2):
        box.step(work.loss_fn)
    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        box.step(work.loss_fn)
    live = peak = 0
    for _, _, nbytes in _allocations(prof):
        live += nbytes
        peak = max(peak, live)
    return {"allocator_rise_bytes": peak, "allocator_end_bytes": live}


def predicted_tensor_rise(ledger) -> int:
    """The ledger's peak over its start, tensors only (no autograd-graph estimate)."""
    from memfit.measure.ledger import Category, Ledger

    tensors = Ledger([b for b in ledger.blocks if b.category is not Category.GRAPH], ledger.ticks)
    return tensors.peak_bytes - tensors.start_bytes


def most_activations(ledger) -> int:
    """The most saved-activation bytes alive at once over the step (the microbatches in flight)."""
    from memfit.measure.ledger import START_TICK, Category

    events = []
    for b in ledger.blocks:
        if b.category is Category.ACTIVATION:
            events.append((-1 if b.born == START_TICK else b.born, b.nbytes))
            if b.died is not None:
                events.append((b.died, -b.nbytes))
    live = most = 0
    for _, n in sorted(events):  # frees (negative) first at a tick
        live += n
        most = max(most, live)
    return most


def theory(world_sizes: list[int], schedules: list[str], m: int) -> None:
    """Fake group only: each stage's peak and the most saved activations it holds at once, in
    microbatches' worth (the last stage's per-microbatch figure differs: it holds the head's)."""
    from memfit.measure.distributed import profile_ranks

    for schedule in schedules:
        for n in world_sizes:
            profs = profile_ranks(workload(schedule, m), world_size=n, ranks=range(n)).profiles
            for r, p in profs.items():
                print(
                    f"{schedule:16s} pp {n} m {m} rank {r}: peak {p.peak_bytes:,} B, most activations {most_activations(p.ledger):,} B",
                    flush=True,
                )


def _row(schedule, n, m, r, pred, meas, alloc, t_fake) -> dict:
    from memfit.measure.distributed import without_backend_buffers
    from memfit.measure.ledger import Category, Ledger

    def tensors(ledger):
        return Ledger([b for b in ledger.blocks if b.category is not Category.WORKSPACE], ledger.ticks)

    predicted = Ledger.from_dict(pred["ledger"])
    raw = Ledger.from_dict(meas["ledger"])
    p, q = tensors(predicted), tensors(without_backend_buffers(raw))
    rise = predicted_tensor_rise(predicted)
    return dict(
        schedule=schedule,
        world_size=n,
        microbatches=m,
        rank=r,
        predicted_peak_bytes=p.peak_bytes,
        measured_peak_bytes=q.peak_bytes,
        error=(p.peak_bytes - q.peak_bytes) / q.peak_bytes,
        same_blocks=[(b.category, b.nbytes) for b in p.blocks] == [(b.category, b.nbytes) for b in q.blocks],
        predicted_activations_bytes=pred["breakdown"]["activations"],
        predicted_tensor_rise_bytes=rise,
        allocator_rise_bytes=alloc["allocator_rise_bytes"],
        allocator_error=(rise - alloc["allocator_rise_bytes"]) / alloc["allocator_rise_bytes"],
        fake_seconds=t_fake,
        breakdown_predicted=pred["breakdown"],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--theory", action="store_true", help="fake group only: peaks and the most activations held at once")
    ns = ap.parse_args()
    if ns.theory:
        theory(list(map(int, ns.world_sizes.split(","))), ns.schedules.split(","), ns.microbatches)
        return 0
    from memfit.measure.distributed import profile_ranks

    rows = []
    for schedule in ns.schedules.split(","):
        for n in map(int, ns.world_sizes.split(",")):
            m = ns.microbatches
            t = time.perf_counter()
            fake = profile_ranks(workload(schedule, m), world_size=n, ranks=range(n)).to_dict()
            t_fake = time.perf_counter() - t
            real = gloo_ranks(_rank, n, schedule, m, None)
            alloc = gloo_ranks(_rank_allocations, n, schedule, m, None)
            for r in range(n):
                row = _row(schedule, n, m, r, fake["ranks"][r], real[r], alloc[r], t_fake)
                rows.append(row)
                print(
                    f"{schedule:16s} pp {n} m {m} rank {r}: predicted {row['predicted_peak_bytes']:,} B, measured (recorder, "
                    f"real gloo) {row['measured_peak_bytes']:,} B, error {row['error']:+.4%}, same blocks {row['same_blocks']}; "
                    f"activations {row['predicted_activations_bytes']:,} B; step rise: predicted {row['predicted_tensor_rise_bytes']:,} B, "
                    f"CPU allocator {row['allocator_rise_bytes']:,} B ({row['allocator_error']:+.4%}); fake {t_fake:.1f} s",
                    flush=True,
                )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(abs(r["error"]) <= 0.001 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
