"""Plans at several budgets for zoo models, each measured in a fresh process.

    python benchmarks/plan_accuracy.py [--models gpt,resnet,benchmarks/cnn_family.py:convnext] [--budgets 0.25,0.5,0.75] [--out FILE.md]
    python benchmarks/plan_accuracy.py --models convnext --at every-other   # at the memory another recipe reaches

For each model: one real-tensor profile, then `memfit.plan` at each budget from it, the
plan saved as JSON and the planned step measured in a fresh process (RSS high-water mark
with MALLOC_MMAP_THRESHOLD_=65536 on CPU). ``--at METHOD`` plans instead at the memory a
hand recipe reaches (``every``: every block, transformers' own ``gradient_checkpointing_enable``
on a transformers model; ``every-other``), its step's rise measured in a fresh process the
same way and added to the profile's start. The measured absolute peak is the ledger's
start bytes plus the measured rise over the start; the issue's bars are measured <= budget
(3% allowance) and predicted within 5% of measured.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from _table import emit  # benchmarks/_table.py, beside this script

import memfit
from memfit.bench.child import measure_step_peak, run_child
from memfit.zoo import parse_sizes

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt,mlp-deep,resnet,heavy,bert-base,gpt2,resnet152")
    parser.add_argument("--budgets", default="0.25,0.5,0.75")
    parser.add_argument("--size", action="append", default=[], help="KEY=VALUE for every model, as memfit's --size")
    parser.add_argument("--at", help="plan at the memory this memfit.bench method reaches (every, every-other)")
    parser.add_argument("--out")
    ns = parser.parse_args()
    rows = [
        "| model | budget | P_min | P_none | budget bytes | predicted | measured | within budget | pred. error | modules | extra FLOPs | plan time |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    sizes = parse_sizes(ns.size)
    tmp = tempfile.mkdtemp()
    for name in ns.models.split(","):
        work = memfit.load_target(name, sizes=sizes)  # a zoo name or path/to/file.py:function
        opt = work.make_optimizer()
        prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
        budgets: list[float | int] = [float(b) for b in ns.budgets.split(",")]
        if ns.at:
            base = run_child(name, method=ns.at, sizes=sizes)
            if "error" in base:
                print(f"| {name} | {ns.at} | failed: {base['error']} |", flush=True)
                continue
            budgets = [prof.start_bytes + base["step_peak_bytes"]]
        for b in budgets:
            t0 = time.perf_counter()
            try:
                plan = memfit.plan(work.model, work.inputs, b, loss_fn=work.loss_fn, optimizer=opt, profile=prof)
            except memfit.BudgetInfeasibleError as exc:
                print(f"| {name} | {ns.at or b} | refused: {exc} |", flush=True)
                continue
            took = time.perf_counter() - t0
            path = os.path.join(tmp, f"{name.replace('/', '_').replace(':', '_')}-{b}.json")
            with open(path, "w") as f:
                f.write(plan.to_json())
            m = measure_step_peak(name, sizes=sizes, plan_path=path)
            measured = plan.start_bytes + m["step_peak_bytes"]
            ok = measured <= plan.budget_bytes * 1.03
            err = (plan.predicted_peak_bytes - measured) / measured
            row = (
                f"| {name} | {ns.at or b} | {plan.min_peak_bytes / MiB:.0f} MiB | {plan.none_peak_bytes / MiB:.0f} MiB "
                f"| {plan.budget_bytes / MiB:.1f} MiB | {plan.predicted_peak_bytes / MiB:.1f} MiB | {measured / MiB:.1f} MiB "
                f"| {'yes' if ok else 'NO'} | {err:+.2%} | {len(plan.checkpointed)} | {plan.extra_flops / 1e9:.2f} G | {took:.1f} s |"
            )
            print(row, flush=True)
            rows.append(row)
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    main()
