"""A held-out encoder-decoder for plan-time benchmarks: transformers' BART, 3 + 3 layers at
bart-large's width (1024), random weights, batch 4 x 128 tokens, no labels (decoder inputs
given; the loss from the logits), so transformers keeps its KV cache on and memfit's plans
turn it off. ``memfit plan benchmarks/workloads/bart.py:workload --budget 50%``."""

import torch

import memfit


def _loss(out):
    return out.logits.float().logsumexp(-1).mean()


def workload() -> memfit.Workload:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BartConfig(encoder_layers=3, decoder_layers=3)
    ids = torch.randint(4, cfg.vocab_size, (4, 128))
    model = transformers.BartForConditionalGeneration(cfg)
    inputs = {"input_ids": ids, "decoder_input_ids": ids.clone()}
    return memfit.Workload(model, inputs, loss_fn=_loss, name="bart 3+3 x 1024")
