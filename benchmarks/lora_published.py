"""memfit finetune against published GPU measurements of LoRA and QLoRA fine-tunes (issue 27 item 5).

    MEMFIT_FAKE_CUDA=1 python benchmarks/lora_published.py [--rows qlora,lora] [--out FILE.md]

The published runs: BenjaminBossan/peft-experiments@e0e5696, torchtune/llama3-{lora,qlora}-single-device:
Llama-3-8B-Instruct through transformers and peft in torchtune's training loop on one RTX 4090,
torchtune's ``get_memory_stats`` logged after every optimizer step (``peak_memory_alloc``:
``torch.cuda.max_memory_allocated() / 1e9``, reset each step; ``peak_memory_reserved``: the
reserved peak, which only grows over the run). The tables' figures are the largest of each log,
the steps with a 512-token micro-batch (alpaca-cleaned, truncated to 512).

Each row is run twice on fake CUDA, with the transformers installed here:
- as ``memfit finetune`` answers it (the command printed), the attention as this transformers runs it;
- with transformers' SDPA attention as it ran in August 2024 (transformers 4.45.dev, the runs'):
  K/V repeated to every query head before ``scaled_dot_product_attention`` (``repeat_kv``), which
  this transformers skips for an unmasked batch on CUDA (``use_gqa_in_sdpa``). The repeated K and
  V are what the kernel saves for backward: 32 instead of 8 heads, 12 MiB more a layer here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import memfit  # noqa: F401  (first: with MEMFIT_FAKE_CUDA=1 it loads fake CUDA before anything imports torch)
from _table import emit  # benchmarks/_table.py, beside this script
from memfit.cli import main as memfit_main

# isort: on

CONFIG = str(Path(__file__).parent / "configs" / "llama-3-8b-instruct.json")
COMMON = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05", "--batch-size", "2", "--seq-len", "512",
          "--grad-accum", "4", "--gpu", "RTX-4090", "--no-levers"]
ROWS = {
    # name: (flags, published peak_memory_alloc and peak_memory_reserved in bytes, the log)
    "qlora": (
        ["--quant", "4bit", "--lora-targets", "q_proj,v_proj,k_proj,o_proj,gate_proj,up_proj,down_proj"],
        (18_969_474_048, 21_386_756_096),
        "torchtune/llama3-qlora-single-device/log_peft_bnb-0.43.3.txt",
    ),
    "lora": (
        ["--lora-targets", "q_proj,v_proj", "--no-autocast-adapter-dtype"],
        (23_446_532_096, 24_748_490_752),
        "torchtune/llama3-lora-single-device/log_peft.txt",
    ),
}


def _answer(flags: list[str], repeat_kv: bool) -> tuple[dict, float]:
    """memfit finetune's JSON answer for ``flags`` and the CPU seconds it took in this process."""
    import transformers.integrations.sdpa_attention as sdpa

    kept = sdpa.use_gqa_in_sdpa
    if repeat_kv:
        sdpa.use_gqa_in_sdpa = lambda *args, **kwargs: False  # as transformers < 4.48: repeat_kv, then SDPA
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "answer.json")
        t0 = time.process_time()
        try:
            assert memfit_main(["finetune", CONFIG, *flags, "--json", out]) == 0
        finally:
            sdpa.use_gqa_in_sdpa = kept
        return json.loads(Path(out).read_text()), time.process_time() - t0


def main() -> None:
    if os.environ.get("MEMFIT_FAKE_CUDA") != "1":
        sys.exit("run with MEMFIT_FAKE_CUDA=1 (fake CUDA must be loaded before torch)")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out")
    ns = parser.parse_args()
    rows = [
        "| row | attention | published allocated | memfit allocated | ratio | published reserved | memfit reserved | ratio | CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ns.rows.split(","):
        flags, (alloc, reserved), log = ROWS[name]
        print(f"{name}: memfit finetune {CONFIG} {' '.join(flags + COMMON)}   vs {log}", flush=True)
        for repeat_kv in (False, True):
            answer, cpu = _answer(flags + COMMON, repeat_kv)
            prof = answer["profile"]
            a, r = prof["allocated_peak_bytes"], prof["reserved_peak_bytes"]
            how = "K/V repeated (transformers 4.45)" if repeat_kv else "as installed (grouped K/V)"
            rows.append(
                f"| {name} | {how} | {alloc:,} | {a:,} | {a / alloc:.4f} | {reserved:,} | {r:,} | {r / reserved:.4f} | {cpu:.1f} |"
            )
    emit(rows, "fake CUDA (RTX 4090)", ns.out)


if __name__ == "__main__":
    main()
