"""Selective recompute through torch_remat against today's selective-checkpoint policy.

For each model: every block recomputed selectively, keeping the outputs of its matrix
products (``addmm``, ``mm``: what a "save the matmuls" policy keeps), applied once with
``mechanism="sac"`` and once with ``mechanism="remat"`` to two copies of the same model.
The steps alternate between the two (ABAB...), so load on the host falls on both alike.
Reported: CPU seconds (user+sys of this process, all its threads) per training step
(forward, backward, AdamW), the median over the timed steps, and the same with no recompute
for scale; and whether the two trainings stayed bitwise equal (losses, parameters).

    python benchmarks/remat_overhead.py --models gpt,llama,bert-base,gpt-small-ops --steps 12

``gpt-small-ops`` is zoo gpt at 24 x 64 wide, 32 tokens, batch 2: a step of many small ops.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from memfit import zoo
from memfit.measure.step import train_step
from memfit.plan.baselines import blocks
from memfit.recompute.checkpoint import apply_choices, mechanisms
from memfit.workload import split_inputs

SIZES = {
    "gpt": {},
    "gpt-small-ops": {"n_layer": 24, "n_embd": 64, "n_head": 4, "block_size": 32},
    "llama": {},
    "bert-base": {},
}
BATCH = {"gpt-small-ops": 2}
KEEP = ("addmm", "mm")


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run(name: str, steps: int) -> dict:
    w = zoo.build(name.replace("-small-ops", ""), batch_size=BATCH.get(name), **SIZES[name])
    torch.manual_seed(0)
    models = {m: copy.deepcopy(w.model) for m in ("none", "sac", "remat")}
    choices = {b: ("selective", KEEP) for b in blocks(w.model)}
    for m in ("sac", "remat"):
        apply_choices(models[m], choices, mechanism=m)
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in models}
    args, kwargs = split_inputs(w.inputs)
    times: dict[str, list[float]] = {m: [] for m in models}
    losses: dict[str, list[float]] = {m: [] for m in models}
    for i in range(steps + 2):  # two untimed: the probe and the first step after it
        for m in models:
            torch.manual_seed(i)  # dropout draws the same numbers for each
            c0 = cpu_s()
            loss = train_step(models[m], args, kwargs, w.loss_fn, opts[m], targets=w.targets)
            if i >= 2:
                times[m].append(cpu_s() - c0)
            losses[m].append(loss)
    same = losses["sac"] == losses["remat"] and all(
        torch.equal(a, b) for a, b in zip(models["sac"].parameters(), models["remat"].parameters())
    )
    mech = mechanisms(models["remat"]) or {}
    return {
        "model": name,
        "blocks": len(choices),
        "remat_blocks": sum(1 for v, _ in mech.values() if v == "remat"),
        "why": next((why for v, why in mech.values() if v != "remat"), ""),
        "median": {m: statistics.median(t) for m, t in times.items()},
        "bitwise": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,llama,bert-base,gpt-small-ops")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: CPU seconds less noisy)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(
        f"torch {torch.__version__}, {a.threads} thread(s), {a.steps} timed steps, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print("| model | blocks (through torch_remat) | no recompute | SAC policy | torch_remat | torch_remat vs SAC | bitwise |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in a.models.split(","):
        r = run(name, a.steps)
        med = r["median"]
        ratio = med["remat"] / med["sac"] - 1
        print(
            f"| {name} | {r['blocks']} ({r['remat_blocks']}) | {med['none']:.3f} s | {med['sac']:.3f} s | "
            f"{med['remat']:.3f} s | {ratio:+.1%} | {'yes' if r['bitwise'] else 'NO'} |" + (f" {r['why']}" if r["why"] else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
