"""Planning from a saved profile in a process that measured nothing, against planning with
every run verified on the real step.

    python benchmarks/plan_saved_profile.py [--target benchmarks/workloads/bart.py:workload] [--budgets 0.25,0.5,0.75]

One real profile of the target is saved and read back with the process's kernel-workspace
table cleared (as in another process). Then at each budget: the plan from the saved profile
(fake copies verify it; op kinds the real step never ran are probed on their own), timed;
the plan measuring its own profile with every run on the real step (``_fake_is_faster`` off),
timed; whether the two chose the same modules and predict the same peak; and the saved-profile
plan applied to the real model, profiled: its real peak against the prediction.
"""

from __future__ import annotations

import argparse
import json
import time

import memfit
from memfit.measure import workspace
from memfit.plan import planner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="benchmarks/workloads/bart.py:workload")
    ap.add_argument("--budgets", default="0.25,0.5,0.75")
    ns = ap.parse_args()
    work = memfit.load_target(ns.target)
    saved = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer()).to_json()
    print(f"{work.name}: profile step {json.loads(saved)['step_time_s']:.3f} s")
    print("| budget | from the saved profile | real verification | same plan and peak | real peak of the saved-profile plan |")
    print("|---|---:|---:|---|---:|")
    fake_is_faster = planner._fake_is_faster
    for budget in (float(b) for b in ns.budgets.split(",")):
        workspace.TABLE.clear()  # another process: only what the file carries
        loaded = memfit.Profile.from_dict(json.loads(saved))
        t0 = time.perf_counter()
        fast = memfit.plan(work.model, work.inputs, budget, loss_fn=work.loss_fn, profile=loaded)
        t_fast = time.perf_counter() - t0
        planner._fake_is_faster = lambda prof: False
        try:
            t0 = time.perf_counter()
            real = memfit.plan(work.model, work.inputs, budget, loss_fn=work.loss_fn)
            t_real = time.perf_counter() - t0
        finally:
            planner._fake_is_faster = fake_is_faster
        same = fast.checkpointed == real.checkpointed and fast.predicted_peak_bytes == real.predicted_peak_bytes
        memfit.apply(work.model, fast)
        try:
            peak = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn).peak_bytes
        finally:
            memfit.remove(work.model)
        error = fast.predicted_peak_bytes / peak - 1
        print(
            f"| {budget:g} | {t_fast:.1f} s | {t_real:.1f} s | {'yes' if same else 'no'} | {peak:,} B (predicted {error:+.3%}) |"
        )
        if not same:  # each plan is costed by its own profile's timings: a near tie can go either way
            for name, p in (("saved", fast), ("real", real)):
                choice = ", ".join(f"{m} ({c.mode})" for m, c in p.checkpointed.items())
                cost = f"{p.extra_compute_s * 1e3:.0f} ms" if p.extra_compute_s is not None else "-"
                print(f"  {name}: {p.predicted_peak_bytes:,} B, predicted extra {cost}: {choice}")


if __name__ == "__main__":
    main()
