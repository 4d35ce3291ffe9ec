"""memfit against transformers' own gradient checkpointing, on models whose config keeps
the KV cache on (``use_cache=True``, the default) in a training step.

    python benchmarks/hf_use_cache.py [--models t5,bart,bart-logits,gpt2,llama,whisper] [--batch 4] [--seq 128]

Each model is built from its config with random weights (nothing is downloaded), in
training mode, and one AdamW step runs on random tokens with labels (``bart-logits``: no
labels, ``decoder_input_ids`` and a loss from the logits, which BART runs with its cache
on; with labels BART turns it off itself). Columns:

- *as it is*: the step's peak with nothing changed (cache on), ``memfit.profile``;
- *P_none*: the step memfit plans, nothing recomputed (cache off where the plan turns it off);
- *P_min before*: the lowest peak memfit reached before it turned the cache off (the
  switch disabled), the issue's "budget below the lowest peak";
- *P_min*: the lowest peak memfit reaches now (``memfit.plan(..., 0.0)``);
- *HF peak*: the step's peak with ``model.gradient_checkpointing_enable(
  gradient_checkpointing_kwargs={"use_reentrant": False})``, measured by ``memfit.profile``
  (which charges its checkpoints the same autograd bookkeeping on CPU as memfit's own);
- *HF recompute*: the FLOPs transformers recomputes: every checkpointed layer's forward
  FLOPs (the profile's module FLOPs) and, in brackets, as counted (its step's FLOPs less
  the step's without checkpointing; the non-reentrant checkpoint stops once the last
  saved tensor is back, so it can be less);
- *memfit at HF peak*: memfit planned with the HF peak as budget: its predicted (verified)
  peak and recomputed FLOPs (counted by running the plan), and their ratio to HF's counted.

Peaks are the whole step's (parameters, optimizer state, activations; on CPU autograd's
graph estimated); FLOPs are FlopCounterMode's (0 for pointwise ops).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _table import emit

import memfit
from memfit.recompute import cache

MiB = 2**20


def _t5(batch: int, seq: int, tf: Any) -> tuple[Any, dict, str]:
    cfg = tf.T5Config(decoder_start_token_id=0, pad_token_id=0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return tf.T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids.clone()}, "T5Config() (t5-small: 6+6 x 512)"


def _bart(batch: int, seq: int, tf: Any, labels: bool = True) -> tuple[Any, dict, str]:
    cfg = tf.BartConfig(encoder_layers=3, decoder_layers=3)
    ids = torch.randint(4, cfg.vocab_size, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids.clone()} if labels else {"input_ids": ids, "decoder_input_ids": ids.clone()}
    return tf.BartForConditionalGeneration(cfg), inputs, "BartConfig(encoder_layers=3, decoder_layers=3) (bart-large width 1024)"


def _gpt2(batch: int, seq: int, tf: Any) -> tuple[Any, dict, str]:
    cfg = tf.GPT2Config()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids.clone()}, "GPT2Config() (gpt2: 12 x 768)"


def _llama(batch: int, seq: int, tf: Any) -> tuple[Any, dict, str]:
    cfg = tf.LlamaConfig(hidden_size=1024, intermediate_size=2752, num_attention_heads=8, num_hidden_layers=4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    desc = "LlamaConfig(hidden_size=1024, intermediate_size=2752, num_attention_heads=8, num_hidden_layers=4)"
    return tf.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}, desc


def _whisper(batch: int, seq: int, tf: Any) -> tuple[Any, dict, str]:
    cfg = tf.WhisperConfig()
    features = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    labels = torch.randint(0, 50000, (batch, seq // 2))
    return (
        tf.WhisperForConditionalGeneration(cfg),
        {"input_features": features, "labels": labels},
        f"WhisperConfig() (4+4 x 256; 3000 frames, {seq // 2} label tokens)",
    )


MODELS: dict[str, Callable[..., tuple[Any, dict, str]]] = {
    "t5": _t5,
    "bart": _bart,
    "bart-logits": lambda b, s, tf: _bart(b, s, tf, labels=False),
    "gpt2": _gpt2,
    "llama": _llama,
    "whisper": _whisper,
}


def _loss(out: Any) -> torch.Tensor:
    return out.loss if getattr(out, "loss", None) is not None else out.logits.float().logsumexp(-1).mean()


def _fmt(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def _gflops(n: int) -> str:
    return f"{n / 1e9:.1f} G"


def row(name: str, batch: int, seq: int, tf: Any) -> str:
    torch.manual_seed(0)
    model, inputs, desc = MODELS[name](batch, seq, tf)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    as_is = memfit.profile(model, inputs, loss_fn=_loss, optimizer=opt)

    # Before: the switch disabled (no module is seen to take use_cache), the cache stays on.
    modules = cache.cache_modules
    cache.cache_modules = lambda m: []
    try:
        before = memfit.plan(model, inputs, 0.0, loss_fn=_loss, optimizer=opt, profile=as_is).min_peak_bytes
    finally:
        cache.cache_modules = modules

    lowest = memfit.plan(model, inputs, 0.0, loss_fn=_loss, optimizer=opt)

    hf = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [n for n, m in hf.named_modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    hf_prof = memfit.profile(hf, inputs, loss_fn=_loss, optimizer=torch.optim.AdamW(hf.parameters(), lr=1e-4))
    hf_peak = hf_prof.peak_bytes
    hf_layer_flops = sum(as_is.modules[n].forward_flops for n in layers)
    hf_counted = max(0, hf_prof.step_flops - as_is.step_flops)
    del hf, hf_prof

    # (below P_min: the plan at P_min, marked)
    at_hf = memfit.plan(model, inputs, max(hf_peak, lowest.min_peak_bytes), loss_fn=_loss, optimizer=opt)
    ratio = f"{at_hf.extra_flops / hf_counted:.0%}" if hf_counted else "-"
    if hf_peak < lowest.min_peak_bytes:
        ratio += f"; at P_min, {lowest.min_peak_bytes - hf_peak} B over HF"
    print(f"{name}: {time.perf_counter() - started:.0f} s; cache off in {lowest.use_cache_off}", file=sys.stderr, flush=True)
    return (
        f"| {name} | {desc} | {_fmt(as_is.peak_bytes)} | {_fmt(lowest.none_peak_bytes)} | {_fmt(before)} "
        f"| **{_fmt(lowest.min_peak_bytes)}** | {_fmt(hf_peak)} | {_gflops(hf_layer_flops)} ({_gflops(hf_counted)}, "
        f"{len(layers)} layers) | {_fmt(at_hf.predicted_peak_bytes)} | {_gflops(at_hf.extra_flops)} ({ratio}) "
        f"| {'yes' if lowest.use_cache_off else 'no'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="t5,bart,bart-logits,gpt2,llama,whisper")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    import transformers as tf

    tf.logging.set_verbosity_error()
    rows = [
        f"batch {ns.batch}, {ns.seq} tokens (whisper: 3000 frames, {ns.seq // 2} label tokens), AdamW, training mode; "
        f"transformers {tf.__version__}",
        "",
        "| model | config | as it is | P_none | P_min before | P_min | HF peak | HF recompute: layers' fwd (counted) "
        "| memfit at HF peak | memfit recompute (vs HF counted) | cache off |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in ns.models.split(","):
        rows.append(row(name, ns.batch, ns.seq, tf))
        print(rows[-1], flush=True)
    emit(rows, "cpu", ns.out)


if __name__ == "__main__":
    main()
