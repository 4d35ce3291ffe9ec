"""A held-out encoder-decoder: transformers' T5 in its default configuration (t5-small's
shape: 6 + 6 layers, width 512), random weights, batch 4 x 128 tokens with labels.

    python benchmarks/plan_accuracy.py --models benchmarks/workloads/t5.py:workload --budgets 0.0,0.5
"""

import torch

import memfit


def _loss(out):
    return out.loss


def workload(batch_size: int = 4) -> memfit.Workload:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(decoder_start_token_id=0)  # the default config names none; shifting labels needs one
    model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, 128))
    labels = torch.randint(0, cfg.vocab_size, (batch_size, 128))
    return memfit.Workload(model, {"input_ids": ids, "labels": labels}, loss_fn=_loss, name="t5 6+6")
