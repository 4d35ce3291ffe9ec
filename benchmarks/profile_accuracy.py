"""Predicted vs measured step peak for every zoo model (the foundation issue's table).

    python benchmarks/profile_accuracy.py [--models gpt,resnet,benchmarks/cnn_family.py:convnext] [--device cpu|cuda] [--out FILE.md]

For each model: `memfit.profile` on real tensors and on fake tensors in this process,
then the same step measured in a fresh process (RSS high-water mark on CPU with
MALLOC_MMAP_THRESHOLD_=65536; torch.cuda.max_memory_allocated on CUDA). The compared
figure is the step's peak over its start (on CUDA, the absolute peak too).
"""

from __future__ import annotations

import argparse
import time

import torch
from _table import emit  # benchmarks/_table.py, beside this script

import memfit
from memfit import zoo
from memfit.bench.child import measure_step_peak

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(zoo.names()))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out")
    ns = parser.parse_args()
    rows = [
        "| model | activations saved | predicted step peak (real) | predicted (fake) | measured | error | profile time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ns.models.split(","):
        work = memfit.load_target(name)  # a zoo name or path/to/file.py:function
        model = work.model.to(ns.device)
        inputs = torch.utils._pytree.tree_map(lambda x: x.to(ns.device) if isinstance(x, torch.Tensor) else x, work.inputs)
        t0 = time.perf_counter()
        real = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
        took = time.perf_counter() - t0
        fake = memfit.profile(model.cpu(), work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake=True)
        measured = measure_step_peak(name, device=ns.device)
        saved = sum(b.nbytes for b in real.ledger.blocks if b.category is memfit.Category.ACTIVATION)
        err = (real.step_peak_bytes - measured["step_peak_bytes"]) / measured["step_peak_bytes"]
        row = (
            f"| {name} | {saved / MiB:.1f} MiB | {real.step_peak_bytes / MiB:.1f} MiB | {fake.step_peak_bytes / MiB:.1f} MiB "
            f"| {measured['step_peak_bytes'] / MiB:.1f} MiB | {err:+.2%} | {took:.1f} s |"
        )
        print(row, flush=True)
        rows.append(row)
        del model, real, fake, work
    emit(rows, ns.device, ns.out)


if __name__ == "__main__":
    main()
