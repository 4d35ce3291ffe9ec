"""memfit against "checkpoint every block", "every other block" and torch.compile's memory
budget, at the same memory, with step times measured.

    python benchmarks/versus_blocks.py [--models gpt2,bert-base,llama,vit] [--rounds 5] [--compile 0.5] [--objectives time,flops]

For each model: the hand-written plan's exact peak and recomputed FLOPs (a fake-tensor run
with it applied), then memfit planned with that peak as its budget (its peak verified on the
real step). Step times are measured in this process with every configuration's model side by
side and the rounds interleaved (round r runs each configuration once), the fastest of the
rounds kept: on a shared CPU, load only adds time, and interleaving makes a burst of it hit
every configuration alike. The predicted extra time is the planner's (the measured forward
times of the modules recomputed; for a selective plan, their ops' share plus the dispatch
mode's per-op cost); for the hand plans, the forward times of their blocks.

torch.compile rows (``--compile F``: ``torch._functorch.config.activation_memory_budget = F``)
run in fresh processes (``memfit.bench``'s child: peak from the RSS protocol, median step time)
since compiled kernels run below the dispatch modes that count FLOPs and bytes.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import memfit
from memfit import zoo
from memfit.plan.baselines import every_block, every_other_block
from memfit.plan.candidates import pooled_times
from memfit.recompute.checkpoint import apply_choices

MiB = 2**20


def _step(model: torch.nn.Module, work: memfit.Workload):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    args, kwargs = ((), work.inputs) if isinstance(work.inputs, dict) else ((work.inputs,), {})

    def run() -> None:
        out = model(*args, **kwargs)
        loss = work.loss_fn(out) if work.loss_fn is not None else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,bert-base,llama,vit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--objectives", default="time", help="memfit rows per objective: 'time', 'flops' or both ('time,flops')")
    parser.add_argument(
        "--compile", default="1.0,0.5", help="activation_memory_budget values for torch.compile rows ('' for none)"
    )
    ns = parser.parse_args()
    print(
        "| model | configuration | peak | recomputed FLOPs | vs every other block | predicted extra | measured step | measured extra |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in ns.models.split(","):
        work = zoo.build(name)
        opt = work.make_optimizer()
        real = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
        times, _ = pooled_times(real.ledger, {n: m.forward_time_s for n, m in real.modules.items()})
        rows: list[tuple[str, torch.nn.Module, int, int, float]] = [
            ("no recompute", copy.deepcopy(work.model), real.peak_bytes, 0, 0.0)
        ]
        plans = []
        for label, hand in (("every block", every_block), ("every other block", every_other_block)):
            model = copy.deepcopy(work.model)
            choices = hand(model)
            apply_choices(model, choices)
            fake = memfit.profile(
                model, work.inputs, loss_fn=work.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), fake=True
            )
            est = sum(times[n] or 0.0 for n in choices)
            rows.append((f"{label} ({len(choices)})", model, fake.peak_bytes, fake.step_flops - real.step_flops, est))
            for objective in ns.objectives.split(","):
                t0 = time.perf_counter()
                plan = memfit.plan(
                    work.model,
                    work.inputs,
                    fake.peak_bytes,
                    loss_fn=work.loss_fn,
                    optimizer=opt,
                    profile=real,
                    objective=objective,
                )
                planning = time.perf_counter() - t0
                planned = copy.deepcopy(work.model)
                memfit.apply(planned, plan)
                n_full = sum(c.mode == "full" for c in plan.checkpointed.values())
                aim = "" if objective == "time" else f", least {objective}"
                desc = (
                    f"memfit at {label}'s peak{aim} ({n_full} full, {len(plan.checkpointed) - n_full} selective; "
                    f"planned in {planning:.1f} s)"
                )
                plans.append((desc, planned, plan.predicted_peak_bytes, plan.extra_flops, plan.extra_compute_s or 0.0))
        rows += plans
        runs = [_step(m, work) for _, m, *_ in rows]
        for run in runs:
            run()  # warm-up: optimizer state
        best = [float("inf")] * len(rows)
        for _ in range(ns.rounds):
            for i, run in enumerate(runs):
                t0 = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - t0)
        other = rows[2][3]
        for (label, _, peak, flops, est), t in zip(rows, best):
            share = f"{flops / other:.0%}" if other else "-"
            print(
                f"| {name} | {label} | {peak / MiB:.0f} MiB | {flops / 1e9:.2f} G | {share} | {est * 1e3:+.0f} ms "
                f"| {t:.3f} s | {(t - best[0]) * 1e3:+.0f} ms ({t / best[0] - 1:+.0%}) |",
                flush=True,
            )
        for budget in filter(None, ns.compile.split(",")):
            from memfit.bench.child import run_child

            mem = run_child(name, method=f"compile:{budget}", measure="memory")
            tim = run_child(name, method=f"compile:{budget}", measure="time", steps=ns.rounds)
            if "error" in mem or "error" in tim:
                print(f"| {name} | torch.compile, budget {budget} | error: {mem.get('error') or tim.get('error')} |||||||")
                continue
            peak = real.start_bytes + mem["step_peak_bytes"]
            print(
                f"| {name} | torch.compile, activation_memory_budget={budget} (fresh process, median) | {peak / MiB:.0f} MiB "
                f"| - | - | - | {tim['step_time_s']:.3f} s | |",
                flush=True,
            )
        del rows, runs, plans


if __name__ == "__main__":
    main()
