"""Plans for a reserved budget on fake CUDA, checked by profiling the planned step again.

    MEMFIT_FAKE_CUDA=1 python benchmarks/plan_reserved_fake_cuda.py [--budgets 0.75,0.5,0.25,0.0] [--out FILE]

On CUDA memfit's budgets bound what the caching allocator reserves (its model of it). For each
budget (a fraction of the way from the lowest reachable reserved peak to the unplanned one) the
plan is made on fake CUDA, applied to the model, and the step profiled again on fake CUDA: its
reserved peak (the ledger of that fresh profile replayed through the allocator model) must be
within the budget. Everything is simulated: no GPU runs here (the allocator model itself is
checked against real GPU traces in ``allocator_replay.py`` and ``gpu_trace_e2e.py``).
"""

from __future__ import annotations

import argparse
import time

from _table import emit

import memfit
from memfit import zoo

CASES = {
    "gpt 6 x 512, 512 tokens, batch 8": dict(n_layer=6, n_embd=512, n_head=8, block_size=512, batch_size=8),
    "gpt 4 x 256, 256 tokens, batch 16": dict(n_layer=4, n_embd=256, n_head=4, block_size=256, batch_size=16),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="0.75,0.5,0.25,0.0")
    parser.add_argument("--out")
    ns = parser.parse_args()
    rows = [
        "| step | budget | plan: reserved | allocated | modules | re-profiled reserved | within | planning |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, sizes in CASES.items():
        work = zoo.build("gpt", **sizes)
        kw = dict(loss_fn=work.loss_fn, targets=work.targets)
        prof = memfit.profile(work.model, work.inputs, optimizer=work.make_optimizer(), fake="cuda", **kw)
        rows.append(f"| {name} | no plan | {prof.reserved_peak_bytes:,} B | {prof.allocated_peak_bytes:,} B | 0 | - | - | - |")
        for b in ns.budgets.split(","):
            started = time.perf_counter()
            plan = memfit.plan(work.model, work.inputs, float(b), optimizer=work.make_optimizer(), fake="cuda", **kw)
            took = time.perf_counter() - started
            memfit.apply(work.model, plan)
            after = memfit.profile(work.model, work.inputs, optimizer=work.make_optimizer(), fake="cuda", **kw)
            memfit.remove(work.model)
            ok = after.reserved_peak_bytes <= plan.budget_bytes
            rows.append(
                f"| {name} | {b} = {plan.budget_bytes:,} B | {plan.predicted_peak_bytes:,} B | {plan.allocated_peak_bytes:,} B "
                f"| {len(plan.checkpointed)} | {after.reserved_peak_bytes:,} B | {'yes' if ok else 'NO'} | {took:.1f} s |"
            )
    emit(rows, "fake cuda:0 (simulated H100-80GB)", ns.out)


if __name__ == "__main__":
    main()
