"""How much one configuration's step time moves between runs in one process, on this host.

    python benchmarks/step_time_drift.py [--model gpt] [--rounds 4] [--micro-batches 1,2,4,8]

Times zoo ``--model`` as it is and with each number of micro-batches, in rounds: every round
times each configuration once (``memfit.measure.timing.time_steps``: a warm-up and the median
of 3 steps, in its own sandbox), one after the other. Prints each configuration's median per
round. A row that moves from round to round while the rounds run back to back is the host
(or the process's allocator), not a prediction: what ``memfit fit`` compares its predictions
against moves as much. Run it with ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment to
compare with glibc's fixed mmap threshold.
"""

from __future__ import annotations

import argparse
import statistics

from memfit import StepOptions, zoo
from memfit.measure.timing import time_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ns = ap.parse_args()
    work = zoo.build(ns.model)
    optimizer = work.make_optimizer()
    ks = [int(k) for k in ns.micro_batches.split(",")]
    rows: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(ns.rounds):
        for k in ks:
            got = time_steps(
                work.model, work.inputs, work.loss_fn, optimizer, step=StepOptions(micro_batches=k), targets=work.targets
            )
            rows[k].append(got.median)
    print(f"{ns.model}: median of 3 steps per round, {ns.rounds} rounds back to back")
    print("| configuration | " + " | ".join(f"round {i + 1}" for i in range(ns.rounds)) + " | spread (max-min)/median |")
    print("|---|" + "---:|" * (ns.rounds + 1))
    for k, times in rows.items():
        label = "as it is" if k == 1 else f"micro-batches x{k}"
        spread = (max(times) - min(times)) / statistics.median(times)
        print(f"| {label} | " + " | ".join(f"{t:.3f} s" for t in times) + f" | {spread:.0%} |")


if __name__ == "__main__":
    main()
