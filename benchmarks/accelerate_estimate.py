"""accelerate estimate-memory against memfit estimate and a measured step (issue 16, item 3).

    python benchmarks/accelerate_estimate.py [--out FILE.md]

For each small transformers model (from a config, random weights) and batch: accelerate's
estimate-memory numbers for it (its own functions: total size and "training using Adam",
float32), memfit's step peak on fake tensors (``memfit.integrations.accelerate.estimate_memory``,
the model built on meta and never given memory), memfit's profile on real tensors, and the
step's peak measured in a fresh process (tensors alive at its start + the RSS rise over it,
memfit's ground-truth child, as ``profile_accuracy.py`` measures).
"""

from __future__ import annotations

import argparse

import torch
from _table import emit  # benchmarks/_table.py, beside this script

import memfit
from memfit.bench.child import measure_step_peak
from memfit.integrations.accelerate import estimate_memory

MiB = 2**20
LLAMA = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8, "vocab_size": 8192}
GPT2 = {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192}
CASES = [("llama", LLAMA, 1, 256), ("llama", LLAMA, 8, 256), ("gpt2", GPT2, 8, 256)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    ns = parser.parse_args()
    rows = [
        "| model | batch x tokens | parameters (accelerate: total size) | accelerate: training with Adam | memfit estimate (fake) "
        "| of which activations | memfit profile (real) | measured (fresh process) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, sizes, batch, seq in CASES:
        est = estimate_memory(name, sizes={**sizes, "use_cache": False}, dtypes=["float32"], batch_size=batch, seq_len=seq)
        row = est.rows[0]
        work = memfit.load_target(name, batch_size=batch, sizes={**sizes, "seq_len": seq})
        real = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
        measured = measure_step_peak(name, batch_size=batch, sizes={**sizes, "seq_len": seq})
        # the child's start is the process's RSS (interpreter and libraries): the tensors
        # alive at the step's start, as memfit's ledger counts them, plus the measured rise
        peak = real.start_bytes + measured["step_peak_bytes"]
        line = (
            f"| {est.model} | {batch} x {seq} | {row.total_bytes / MiB:.1f} MiB | {row.accelerate_training_bytes / MiB:.1f} MiB "
            f"| {row.memfit_peak_bytes / MiB:.1f} MiB | {row.memfit_breakdown['activations'] / MiB:.1f} MiB "
            f"| {real.peak_bytes / MiB:.1f} MiB | {peak / MiB:.1f} MiB |"
        )
        print(line, flush=True)
        rows.append(line)
        del work, real
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
