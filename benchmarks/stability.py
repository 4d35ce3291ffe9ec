"""Many steps with a plan applied: memory (ledger and RSS) and step time stay flat.

    python benchmarks/stability.py [--model gpt] [--budget 0.5] [--steps 200] [--out FILE.md]

Plans the zoo model, applies the plan, then trains ``--steps`` steps in this process,
reading VmRSS after every step and timing each. The ledger of the planned step is
recorded before and after (start and peak bytes must not move). RSS is read without
MALLOC_MMAP_THRESHOLD_ (which would distort the times): glibc's pools make it move by a
few MiB, and a leak shows as steady growth.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from _table import emit  # benchmarks/_table.py, beside this script

import memfit
from memfit import zoo
from memfit.bench.child import _status_bytes
from memfit.measure.step import train_step
from memfit.workload import split_inputs

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out")
    ns = parser.parse_args()
    work = zoo.build(ns.model)
    opt = work.make_optimizer()
    plan = memfit.plan(work.model, work.inputs, float(ns.budget), loss_fn=work.loss_fn, optimizer=opt)
    memfit.apply(work.model, plan)
    args, kwargs = split_inputs(work.inputs)
    before = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
    times, rss = [], []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        train_step(work.model, args, kwargs, work.loss_fn, opt)
        times.append(time.perf_counter() - t0)
        gc.collect()
        rss.append(_status_bytes("VmRSS"))
    after = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
    n = max(5, ns.steps // 10)
    first, last = statistics.median(times[2 : 2 + n]), statistics.median(times[-n:])
    rows = [
        f"{ns.model}, budget {ns.budget}: {len(plan.checkpointed)} modules recomputed, {ns.steps} steps",
        "",
        "| measure | steps 3.. | last steps | change |",
        "|---|---:|---:|---:|",
        f"| ledger start bytes | {before.start_bytes / MiB:.2f} MiB | {after.start_bytes / MiB:.2f} MiB "
        f"| {after.start_bytes - before.start_bytes:+d} B |",
        f"| ledger peak bytes | {before.peak_bytes / MiB:.2f} MiB | {after.peak_bytes / MiB:.2f} MiB "
        f"| {after.peak_bytes - before.peak_bytes:+d} B |",
        f"| RSS after a step (step 3 / last; max over all) | {rss[2] / MiB:.1f} MiB | {rss[-1] / MiB:.1f} MiB "
        f"| {(rss[-1] - rss[2]) / MiB:+.1f} MiB (max {(max(rss[2:]) - rss[2]) / MiB:+.1f}) |",
        f"| median step time (first / last {n} steps) | {first * 1e3:.0f} ms | {last * 1e3:.0f} ms | {last / first - 1:+.1%} |",
    ]
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    main()
