"""How long ``memfit.plan`` takes when its plans are verified on fake copies of the step
against on the real step, from one real profile (CPU).

    python benchmarks/plan_verify.py [--models gpt,llama] [--budget 0.5]

For each model: one real profile, then the plan at ``--budget`` twice from that profile,
verified on the real step and on fake copies (``memfit.plan.planner._FAKE_S_PER_OP`` set to
force each; selective recompute's per-op cost measured once and given to both, so that the
two solve the same problem), the wall time of each and whether the two plans, P_min,
verified peaks and recomputed FLOPs are the same. Which one ``memfit.plan`` uses by itself
is printed too.
"""

from __future__ import annotations

import argparse
import time

import memfit
from memfit import zoo
from memfit.measure.timing import selective_overhead_s
from memfit.plan import planner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--budget", type=float, default=0.5)
    ns = parser.parse_args()
    print(
        "| model | forward ops | step | verified by default on | real: plan time | fake: plan time | same plan, P_min, peak, FLOPs |"
    )
    print("|---|---:|---:|---|---:|---:|---|")
    default = planner._FAKE_S_PER_OP
    for name in ns.models.split(","):
        work = zoo.build(name)
        opt = work.make_optimizer()
        prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
        by_default = "fake copies" if planner._fake_is_faster(prof) else "the real step"
        plans, times = {}, {}
        overhead = selective_overhead_s(prof.device)
        for label, per_op in (("real", float("inf")), ("fake", 0.0)):
            planner._FAKE_S_PER_OP = per_op
            t0 = time.perf_counter()
            plans[label] = memfit.plan(
                work.model, work.inputs, ns.budget, loss_fn=work.loss_fn, optimizer=opt, profile=prof, op_overhead_s=overhead
            )
            times[label] = time.perf_counter() - t0
        planner._FAKE_S_PER_OP = default
        r, f = plans["real"], plans["fake"]
        same = (r.checkpointed, r.min_peak_bytes, r.predicted_peak_bytes, r.extra_flops) == (
            f.checkpointed,
            f.min_peak_bytes,
            f.predicted_peak_bytes,
            f.extra_flops,
        )
        print(
            f"| {name} | {len(prof.ledger.ops)} | {prof.step_time_s:.3f} s | {by_default} | {times['real']:.1f} s "
            f"| {times['fake']:.1f} s | {'yes' if same else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
