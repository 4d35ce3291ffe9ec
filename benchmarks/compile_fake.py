"""A compiled step on fake tensors against the same step compiled and run for real (issue 27 item 4).

    python benchmarks/compile_fake.py [--models 'mlp-deep:depth=8,batch_size=64;gpt:n_layer=2;...']

For each zoo model: ``profile_compiled_step`` on real tensors (torch's profiler reading the CPU
allocator while inductor's compiled step runs) and on fake tensors (inductor compiles the same
step, its kernels not run, its wrapper's allocations recorded: memfit.compat.inductor_fake).
Prints the start, the step's peak over it, the bytes saved for backward, the difference and the
CPU seconds of each (compiles included).
"""

from __future__ import annotations

import argparse
import time

import memfit  # noqa: F401  (before torch)
from memfit import zoo
from memfit.measure.checked import checked_step
from memfit.measure.compiled import profile_compiled_step

DEFAULT = "mlp-deep:depth=8,batch_size=64;gpt:n_layer=2;resnet:depths=(1,1,1,1);llama:num_hidden_layers=2"


def _sizes(text: str) -> dict:
    return eval(f"dict({text})") if text else {}  # the benchmark's own argument, as compile_accuracy.py reads it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT)
    args = ap.parse_args()
    print("| model | start (real / fake) | step peak: real | fake | difference | saved for backward: real / fake | CPU s: real / fake |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in args.models.split(";"):
        name, _, sizes = spec.partition(":")
        work = zoo.build(name, **_sizes(sizes))
        opt = work.make_optimizer()
        t0 = time.process_time()
        real = profile_compiled_step(checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt))
        t1 = time.process_time()
        fake = profile_compiled_step(checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True))
        t2 = time.process_time()
        diff = fake.step_peak_bytes - real.step_peak_bytes
        print(
            f"| {spec} | {real.start_bytes:,} / {fake.start_bytes:,} | {real.step_peak_bytes:,} | {fake.step_peak_bytes:,} | "
            f"{diff:+,} B ({diff / real.step_peak_bytes:+.3%}) | {real.saved_bytes:,} / {fake.saved_bytes:,} | "
            f"{t1 - t0:.1f} / {t2 - t1:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
