"""Real-world architectures from transformers, built from configs with random weights.

Nothing is downloaded: each model is constructed from its config class. Needs the
``[hf]`` extra (``pip install memfit[hf]``).
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import TargetError
from memfit.workload import Workload


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise TargetError("this zoo model needs transformers: pip install 'memfit[hf]'") from exc
    transformers.logging.set_verbosity_error()
    return transformers


def build_bert(batch_size: int = 8, seq_len: int = 128, **config: Any) -> Workload:
    tf = _transformers()
    cfg = tf.BertConfig(**config)
    model = tf.BertForMaskedLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    meta = {"batch_size": batch_size, "seq_len": seq_len, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, name="bert-base", meta=meta)


def build_gpt2(batch_size: int = 4, seq_len: int = 256, **config: Any) -> Workload:
    tf = _transformers()
    # A training step keeps no KV cache (transformers turns it off for gradient
    # checkpointing, and a memfit plan does too: plan.use_cache_off); off here, the step
    # is the same with and without a plan.
    cfg = tf.GPT2Config(**{"use_cache": False, **config})
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    meta = {"batch_size": batch_size, "seq_len": seq_len, "layers": cfg.n_layer, "hidden": cfg.n_embd}
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, name="gpt2", meta=meta)


def build_llama(batch_size: int = 4, seq_len: int = 256, **config: Any) -> Workload:
    tf = _transformers()
    # A small Llama (RMSNorm, rotary, SwiGLU, SDPA): 8 x 512, a 8k vocabulary so that the
    # blocks' activations, not the logits, dominate, as in the larger models of the family.
    defaults = dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=8192, use_cache=False
    )
    cfg = tf.LlamaConfig(**{**defaults, **config})
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    meta = {"batch_size": batch_size, "seq_len": seq_len, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, name="llama", meta=meta)


def build_vit(batch_size: int = 8, image_size: int = 224, **config: Any) -> Workload:
    tf = _transformers()
    # ViT-S/16 dims (timm's vit_small_patch16_224): 12 x 384, 6 heads, 197 tokens.
    defaults = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, num_labels=1000)
    cfg = tf.ViTConfig(**{**defaults, **config, "image_size": image_size})
    model = tf.ViTForImageClassification(cfg)
    pixels = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, cfg.num_labels, (batch_size,))
    meta = {"batch_size": batch_size, "image_size": image_size, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}
    return Workload(model, {"pixel_values": pixels, "labels": labels}, name="vit", meta=meta)


def build_resnet152(batch_size: int = 8, image_size: int = 224, **config: Any) -> Workload:
    tf = _transformers()
    defaults = dict(depths=[3, 8, 36, 3], layer_type="bottleneck", hidden_sizes=[256, 512, 1024, 2048], num_labels=1000)
    cfg = tf.ResNetConfig(**{**defaults, **config})
    model = tf.ResNetForImageClassification(cfg)
    pixels = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, cfg.num_labels, (batch_size,))
    meta = {"batch_size": batch_size, "image_size": image_size, "depths": list(cfg.depths)}
    return Workload(model, {"pixel_values": pixels, "labels": labels}, name="resnet152", meta=meta)
