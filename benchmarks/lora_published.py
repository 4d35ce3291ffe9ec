"""memfit finetune against published GPU measurements of LoRA and QLoRA fine-tunes (issue 27 item 5).

    MEMFIT_FAKE_CUDA=1 python benchmarks/lora_published.py [--rows qlora,lora,fms4,fms8,fms-bnb4,fms-bnb8] [--out FILE.md]

Two sources, every setting of their steps written down (docs/benchmarks/lora.md says where):

- qlora, lora: BenjaminBossan/peft-experiments@e0e5696, torchtune/llama3-{qlora,lora}-single-device:
  Llama-3-8B-Instruct through transformers and peft in torchtune's training loop on one RTX 4090,
  ``torch.cuda.max_memory_allocated() / 1e9`` logged after every optimizer step (reset each step;
  the reserved figure is the run's high-water mark). The figures are each log's largest, the
  steps with a 512-token micro-batch.
- fms*: foundation-model-stack/fms-acceleration@24bdadb, scripts/benchmarks/refs/a100_80gb.csv:
  Mistral-7B-v0.1 through fms-hf-tuning 2.5.0 (TRL's SFTTrainer, transformers 4.48.1) on one
  A100-80GB, alpaca-cleaned packed to 4096 tokens; the Trainer's memory metrics (the training's
  ``torch.cuda.max_memory_allocated``, the model's allocation included).

Each row is run as ``memfit finetune`` answers it with the transformers installed here, then with
the one part of the step that the run's transformers did otherwise, put back (``the run's``):
- qlora, lora (transformers 4.45.dev): K/V repeated to every query head before SDPA (``repeat_kv``),
  which this transformers skips for an unmasked batch on CUDA (``use_gqa_in_sdpa``); the flash
  kernel saves the K and V it is given, 4 times the bytes;
- fms* (transformers 4.48.1): the causal-LM loss shifted the float32 logits with a ``contiguous()``
  copy (removed by transformers' #35646, January 2025), which this transformers avoids by shifting
  the labels; the copy and the model's logits are alive together at the end of the forward;
- fms-bnb* (4-bit, TRL's SFTTrainer preparing the model, ``bf16=True``): that loss, and after
  ``prepare_model_for_kbit_training`` (``--kbit-prep``) TRL's casts: the norms float32, the
  embeddings and the head back to bfloat16. TRL's function also casts the LoRA layers to bfloat16;
  the runs' allocation when training ends holds float32 adapters and optimizer state, so the
  rows leave them so (``trl_bf16_casting`` is the function as written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# isort: off
import memfit  # noqa: F401  (first: with MEMFIT_FAKE_CUDA=1 it loads fake CUDA before anything imports torch)
from _table import emit  # benchmarks/_table.py, beside this script
from memfit.cli import main as memfit_main

# isort: on

CONFIGS = Path(__file__).parent / "configs"
LLAMA = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05", "--batch-size", "2", "--seq-len", "512",
         "--grad-accum", "4", "--gpu", "RTX-4090", "--no-levers"]
MISTRAL = ["--lora-rank", "16", "--lora-alpha", "16", "--lora-dropout", "0.1", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
           "--seq-len", "4096", "--gradient-checkpointing", "--attn", "flash_attention_2", "--gpu", "A100-80GB", "--no-levers"]
FMS_BNB = ["--quant", "4bit", "--kbit-prep", "--autocast", "bfloat16", *MISTRAL]
QLORA_TARGETS = "q_proj,v_proj,k_proj,o_proj,gate_proj,up_proj,down_proj"


@contextlib.contextmanager
def repeated_kv() -> Iterator[None]:
    """transformers < 4.48's SDPA attention: K/V repeated to every query head (``repeat_kv``) first."""
    import transformers.integrations.sdpa_attention as sdpa

    kept = sdpa.use_gqa_in_sdpa
    sdpa.use_gqa_in_sdpa = lambda *args, **kwargs: False
    try:
        yield
    finally:
        sdpa.use_gqa_in_sdpa = kept


@contextlib.contextmanager
def shifted_logits_copy() -> Iterator[None]:
    """transformers 4.46-4.48's causal-LM loss: the float32 logits shifted by a contiguous copy
    (``logits[..., :-1, :].contiguous()``), then cross entropy (sum over ``num_items_in_batch``, else mean)."""
    import torch.nn.functional as F
    from transformers.loss.loss_utils import LOSS_MAPPING

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):  # noqa: ANN001, ANN003, ANN202
        logits = logits.float()
        shifted = logits[..., :-1, :].contiguous().view(-1, vocab_size)
        targets = labels[..., 1:].contiguous().view(-1).to(shifted.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        out = F.cross_entropy(shifted, targets, ignore_index=ignore_index, reduction=reduction)
        return out / num_items_in_batch if num_items_in_batch is not None else out

    kept = LOSS_MAPPING["ForCausalLM"]
    LOSS_MAPPING["ForCausalLM"] = loss
    try:
        yield
    finally:
        LOSS_MAPPING["ForCausalLM"] = kept


@contextlib.contextmanager
def trl_bf16_casting(adapters_too: bool = True) -> Iterator[None]:
    """What TRL's ``SFTTrainer`` (0.13) does to a 4-bit peft model with ``bf16=True`` after
    ``prepare_model_for_kbit_training`` (``--kbit-prep``) and ``get_peft_model``
    (``peft_module_casting_to_bf16``): the LoRA layers' adapters to bfloat16, the norms to
    float32, the embeddings and the output head back to bfloat16; with transformers 4.48's loss.
    ``adapters_too=False``: the adapters left in float32."""
    import torch
    from peft.tuners.lora import LoraLayer

    import memfit.integrations.finetune as ft

    built = ft.lora_model

    def lora_model(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        model = built(*args, **kwargs)
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):  # the adapters only: the 4-bit base layer's weights stay packed
                for adapters in (module.lora_A, module.lora_B) if adapters_too else ():
                    adapters.to(torch.bfloat16)
            elif "norm" in name:
                module.to(torch.float32)
            elif any(x in name for x in ("lm_head", "embed_tokens")) and getattr(module, "weight", None) is not None:
                if module.weight.dtype == torch.float32:
                    module.to(torch.bfloat16)
        return model

    ft.lora_model = lora_model
    try:
        with shifted_logits_copy():
            yield
    finally:
        ft.lora_model = built


@contextlib.contextmanager
def trl_bf16_casting_float32_adapters() -> Iterator[None]:
    """:func:`trl_bf16_casting` with the adapters left in float32 (what the runs' allocation at the end says)."""
    with trl_bf16_casting(adapters_too=False):
        yield


ROWS: dict[str, tuple[str, list[str], tuple[int, int | None], str, Callable[[], contextlib.AbstractContextManager[None]]]] = {
    # name: (config, flags, published allocated and reserved bytes (None: not published), source, the run's step)
    "qlora": ("llama-3-8b-instruct.json", ["--quant", "4bit", "--lora-targets", QLORA_TARGETS, *LLAMA],
              (18_969_474_048, 21_386_756_096), "peft-experiments log_peft_bnb-0.43.3.txt", repeated_kv),
    "lora": ("llama-3-8b-instruct.json", ["--lora-targets", "q_proj,v_proj", "--no-autocast-adapter-dtype", *LLAMA],
             (23_446_532_096, 24_748_490_752), "peft-experiments log_peft.txt", repeated_kv),
    "fms4": ("mistral-7b-v0.1.json", [*MISTRAL, "--batch-size", "4"], (26_704_571_904, None), "a100_80gb.csv standard-peft, batch 4",
             shifted_logits_copy),
    "fms8": ("mistral-7b-v0.1.json", [*MISTRAL, "--batch-size", "8"], (38_742_912_512, None), "a100_80gb.csv standard-peft, batch 8",
             shifted_logits_copy),
    "fms-bnb4": ("mistral-7b-v0.1.json", [*FMS_BNB, "--batch-size", "4"], (20_669_338_112, None),
                 "a100_80gb.csv baseline-peft-bnb, batch 4", trl_bf16_casting_float32_adapters),
    "fms-bnb8": ("mistral-7b-v0.1.json", [*FMS_BNB, "--batch-size", "8"], (37_002_646_016, None),
                 "a100_80gb.csv baseline-peft-bnb, batch 8", trl_bf16_casting_float32_adapters),
}


def _answer(config: str, flags: list[str], patch: contextlib.AbstractContextManager[None]) -> tuple[dict, float]:
    """memfit finetune's JSON answer and the CPU seconds it took in this process."""
    with tempfile.TemporaryDirectory() as tmp, patch:
        out = os.path.join(tmp, "answer.json")
        t0 = time.process_time()
        assert memfit_main(["finetune", str(CONFIGS / config), *flags, "--json", out]) == 0
        return json.loads(Path(out).read_text()), time.process_time() - t0


def _ratio(got: int, published: int | None) -> str:
    return f"{got / published:.4f}" if published else "-"


def main() -> None:
    if os.environ.get("MEMFIT_FAKE_CUDA") != "1":
        sys.exit("run with MEMFIT_FAKE_CUDA=1 (fake CUDA must be loaded before torch)")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out")
    ns = parser.parse_args()
    rows = [
        "| row | step | published allocated | memfit allocated | ratio | published reserved | memfit reserved | ratio | CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ns.rows.split(","):
        config, flags, (alloc, reserved), source, the_runs = ROWS[name]
        print(f"{name}: memfit finetune benchmarks/configs/{config} {' '.join(flags)}   vs {source}", flush=True)
        for how, patch in (("as installed", contextlib.nullcontext), (f"the run's: {the_runs.__name__}", the_runs)):
            answer, cpu = _answer(config, flags, patch())
            prof = answer["profile"]
            a, r = prof["allocated_peak_bytes"], prof["reserved_peak_bytes"]
            rows.append(
                f"| {name} | {how} | {alloc:,} | {a:,} | {_ratio(a, alloc)} | {f'{reserved:,}' if reserved else '-'} | {r:,} | {_ratio(r, reserved)} | {cpu:.1f} |"
            )
    emit(rows, "fake CUDA", ns.out)


if __name__ == "__main__":
    main()
