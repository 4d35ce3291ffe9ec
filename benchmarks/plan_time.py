"""Predicted vs measured extra step time of memfit plans (and of "every block").

    python benchmarks/plan_time.py [--model gpt] [--budgets 0.75,0.5,0.25,0.0] [--steps 5]

In this process: a real profile, then for each budget a plan, applied, and the median
step time of ``--steps`` steps after warm-up against the unplanned median.
"""

from __future__ import annotations

import argparse

import memfit
from memfit import zoo
from memfit.measure.timing import median_step_time
from memfit.plan.baselines import every_block
from memfit.recompute.checkpoint import apply_choices, remove


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--budgets", default="0.75,0.5,0.25,0.0")
    parser.add_argument("--steps", type=int, default=5)
    ns = parser.parse_args()
    work = zoo.build(ns.model)
    opt = work.make_optimizer()
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
    base = median_step_time(work.model, work.inputs, work.loss_fn, opt, steps=ns.steps)
    print(f"{ns.model}: no plan {base:.3f} s per step (median of {ns.steps})")
    print("| budget | chosen | measured extra time | predicted |")
    print("|---|---|---:|---:|")
    for b in ns.budgets.split(","):
        plan = memfit.plan(work.model, work.inputs, float(b), loss_fn=work.loss_fn, optimizer=opt, profile=prof)
        memfit.apply(work.model, plan)
        t = median_step_time(work.model, work.inputs, work.loss_fn, opt, steps=ns.steps)
        memfit.remove(work.model)
        modes: dict[str, int] = {}
        for c in plan.checkpointed.values():
            modes[c.mode] = modes.get(c.mode, 0) + 1
        chosen = ", ".join(f"{n} {m}" for m, n in modes.items()) or "nothing"
        print(f"| {b} | {chosen} | +{(t - base) * 1e3:.0f} ms ({t / base - 1:+.1%}) | +{plan.extra_compute_s * 1e3:.0f} ms |")
    apply_choices(work.model, every_block(work.model))
    t = median_step_time(work.model, work.inputs, work.loss_fn, opt, steps=ns.steps)
    remove(work.model)
    print(
        f"| every block (hand-written) | {len(every_block(work.model))} full | +{(t - base) * 1e3:.0f} ms ({t / base - 1:+.1%}) | |"
    )


if __name__ == "__main__":
    main()
