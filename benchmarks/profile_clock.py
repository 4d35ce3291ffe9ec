"""The profile's module clock in a fresh process and after: the blocks' forward times
``memfit.profile`` measures, profiled several times in one process.

    python benchmarks/profile_clock.py [--model gpt2] [--profiles 2]

Prints, per profile, the step time (the faster of its two timed steps, both shown), the sum
of the repeated blocks' forward times and the whole model's forward time. Compare with
``benchmarks/recompute_cost.py``, which times the same blocks with one timer each inside
steps of a process that has run steps already.
"""

from __future__ import annotations

import argparse

import memfit
from memfit import zoo
from memfit.plan.baselines import blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--profiles", type=int, default=2)
    ns = ap.parse_args()
    work = zoo.build(ns.model)
    names = blocks(work.model)
    for i in range(ns.profiles):
        prof = memfit.profile(
            work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), targets=work.targets
        )
        blocks_s = sum(prof.modules[n].forward_time_s or 0.0 for n in names)
        steps = ", ".join(f"{t:.3f}" for t in prof.step_times_s)
        print(
            f"{ns.model}, profile {i + 1} in this process: step {prof.step_time_s:.3f} s (timed steps {steps} s), "
            f"{len(names)} blocks' forward {blocks_s * 1e3:.0f} ms, the model's forward "
            f"{(prof.modules[''].forward_time_s or 0.0) * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
