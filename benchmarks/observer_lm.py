"""The observer effect on a CS336-style decoder LM (issue 23, item 1).

    python benchmarks/observer_lm.py [--batch-size 8] [--out FILE.md]

memfit.profile's step peak on real and on fake tensors, with the observer's corrections
and without them (``--without``: the recorder's ledger as a dispatch mode sees the step),
against the same step's peak measured in a fresh process (RSS high-water mark under
MALLOC_MMAP_THRESHOLD_=65536). The workload is benchmarks/workloads/cs336_lm.py.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from _table import emit  # benchmarks/_table.py, beside this script

import memfit
from memfit.bench.child import measure_step_peak
from memfit.measure import observer

MiB = 2**20
TARGET = str(Path(__file__).parent / "workloads" / "cs336_lm.py") + ":workload"


@contextlib.contextmanager
def _uncorrected():
    """The recorder as it was before the observer: no call's output takes over a block."""
    keep = observer.Observer.absorbs
    observer.Observer.absorbs = lambda self, idx, relink: False
    try:
        yield
    finally:
        observer.Observer.absorbs = keep


def _peak(batch_size: int, fake: bool) -> int:
    work = memfit.load_target(TARGET, batch_size=batch_size)
    prof = memfit.profile(
        work.model, work.inputs, targets=work.targets, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake=fake
    )
    return prof.step_peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out")
    ns = parser.parse_args()
    measured = measure_step_peak(TARGET, batch_size=ns.batch_size)["step_peak_bytes"]
    rows = [
        f"CS336-style LM (2 x 128, vocab 10000, fp32), batch {ns.batch_size} x 256: step peak over its start",
        "",
        "| profile | before (no correction) | after | measured (RSS, fresh process) | error before | error after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fake in (False, True):
        with _uncorrected():
            before = _peak(ns.batch_size, fake)
        after = _peak(ns.batch_size, fake)
        row = (
            f"| {'fake' if fake else 'real'} | {before / MiB:.1f} MiB | {after / MiB:.1f} MiB | {measured / MiB:.1f} MiB "
            f"| {(before - measured) / measured:+.2%} | {(after - measured) / measured:+.2%} |"
        )
        print(row, flush=True)
        rows.append(row)
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    main()
