"""memfit against "checkpoint every block" and "every other block", at the same memory.

    python benchmarks/versus_blocks.py [--models gpt,resnet,bert-base,gpt2]

For each model: the hand-written plan's exact peak and recomputed FLOPs (a fake-tensor
run with it applied), then memfit planned with that peak as its budget. Recomputed FLOPs
are FlopCounterMode's count, which is 0 for pointwise ops; the estimated recompute time
(measured module forward times, split by op for selective recompute) is the fairer cost.
"""

from __future__ import annotations

import argparse
import copy

import torch

import memfit
from memfit import zoo
from memfit.apply.checkpoint import apply_choices
from memfit.plan.baselines import every_block, every_other_block

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt,resnet,bert-base,gpt2")
    ns = parser.parse_args()
    print(
        "| model | hand plan | peak | recompute FLOPs | est. recompute time | memfit peak | memfit FLOPs | ratio | memfit est. time | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in ns.models.split(","):
        work = zoo.build(name)
        opt = work.make_optimizer()
        real = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
        for label, hand in (("every block", every_block), ("every other block", every_other_block)):
            model = copy.deepcopy(work.model)
            choices = hand(model)
            apply_choices(model, choices)
            fake = memfit.profile(
                model, work.inputs, loss_fn=work.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), fake=True
            )
            flops = fake.step_flops - real.step_flops
            est = sum(real.modules[n].forward_time_s for n in choices)
            plan = memfit.plan(work.model, work.inputs, fake.peak_bytes, loss_fn=work.loss_fn, optimizer=opt, profile=real)
            print(
                f"| {name} | {label} ({len(choices)}) | {fake.peak_bytes / MiB:.0f} MiB | {flops / 1e9:.2f} G | {est * 1e3:.0f} ms "
                f"| {plan.predicted_peak_bytes / MiB:.0f} MiB | {plan.extra_flops / 1e9:.2f} G | {plan.extra_flops / max(flops, 1):.0%} "
                f"| {plan.extra_compute_s * 1e3:.0f} ms | {plan.extra_compute_s / est:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
