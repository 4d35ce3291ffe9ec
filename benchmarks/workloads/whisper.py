"""A held-out speech encoder-decoder: transformers' Whisper from a config (never downloaded),
d_model 256, 2 + 2 layers, random weights, batch 4 of 80 mel bins x 400 frames (200 encoder
positions after the strided convolution), 32 decoder tokens given, loss from the logits.
transformers keeps its KV cache on in this training step.
``memfit plan benchmarks/workloads/whisper.py:workload --budget 50%``."""

import torch

import memfit


def _loss(out):
    return out.logits.float().logsumexp(-1).mean()


def workload() -> memfit.Workload:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        d_model=256,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        max_source_positions=200,
    )
    model = transformers.WhisperForConditionalGeneration(cfg)
    features = torch.randn(4, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    tokens = torch.randint(4, cfg.vocab_size, (4, 32))
    inputs = {"input_features": features, "decoder_input_ids": tokens}
    return memfit.Workload(model, inputs, loss_fn=_loss, name="whisper 2+2 x 256")
