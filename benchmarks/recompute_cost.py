"""What recomputing every block costs in a real step: each block's forward timed inside the
step, without checkpointing and with every block under torch's own non-reentrant
checkpoint, where the same timer also catches each block's recompute in backward.

    python benchmarks/recompute_cost.py [--model gpt2] [--rounds 3]

Prints per round the step, its backward, the blocks' forward and their recompute. memfit's
time model prices a block's full recompute at its forward: this checks that rule on the
real step, in one process, no memfit code in the step (zoo models only build it).
"""

from __future__ import annotations

import argparse
import collections
import time

from torch.utils.checkpoint import checkpoint

from memfit import zoo
from memfit.plan.baselines import blocks


def run(name: str, checkpointed: bool, rounds: int) -> None:
    work = zoo.build(name)
    model = work.model
    times: dict[int, list[float]] = collections.defaultdict(list)
    for i, block_name in enumerate(blocks(model)):
        block = model.get_submodule(block_name)

        def forward(*a, _orig=block.forward, _i=i, **k):
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:  # a non-reentrant recompute stops early by raising
                    return _orig(*a, **k)
                finally:
                    times[_i].append(time.perf_counter() - t0)

            return checkpoint(timed, *a, use_reentrant=False, **k) if checkpointed else timed(*a, **k)

        block.forward = forward
    opt = work.make_optimizer()
    args, kwargs = ((), work.inputs) if isinstance(work.inputs, dict) else ((work.inputs,), {})

    def step() -> float:
        out = model(*args, **kwargs)
        loss = work.loss_fn(out) if work.loss_fn is not None else out.loss
        t0 = time.perf_counter()
        loss.backward()
        took = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return took

    step()  # warm-up: optimizer state
    mode = "every block checkpointed" if checkpointed else "plain"
    for r in range(rounds):
        times.clear()
        t0 = time.perf_counter()
        back = step()
        total = time.perf_counter() - t0
        fwd = sum(v[0] for v in times.values())
        again = sum(v[1] for v in times.values() if len(v) > 1)
        print(
            f"{name}, {mode}, round {r}: step {total:.3f} s, backward {back:.3f} s, "
            f"blocks' forward {fwd * 1e3:.0f} ms, their recompute {again * 1e3:.0f} ms",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    for checkpointed in (False, True):
        run(ns.model, checkpointed, ns.rounds)


if __name__ == "__main__":
    main()
