"""minGPT (karpathy/minGPT, fetched, never committed) as a held-out workload: gpt-mini
(6 layers, 6 heads, width 192), GPT-2's vocabulary, 256 tokens, batch 8, random weights.
Its ``Block`` calls its MLP through a lambda closing over ``self.mlp``: the case that showed
copies of the step running the user's own weights (memfit.measure.sandbox.copy_model).

    git --git-dir MIRROR/karpathy+minGPT/repo archive HEAD mingpt | tar x -C DIR
    MINGPT_DIR=DIR memfit plan benchmarks/workloads/mingpt.py:workload --budget 50%
"""

import os
import sys

import torch

import memfit


def _loss(out):
    logits, loss = out
    return loss


def workload(batch_size: int = 8) -> memfit.Workload:
    folder = os.environ.get("MINGPT_DIR")
    if not folder:
        raise memfit.TargetError("set MINGPT_DIR to a folder holding minGPT's mingpt package (see this file's docstring)")
    sys.path.insert(0, folder)
    from mingpt.model import GPT

    torch.manual_seed(0)
    cfg = GPT.get_default_config()
    cfg.model_type, cfg.vocab_size, cfg.block_size = "gpt-mini", 50257, 256
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, 256))
    return memfit.Workload(model, {"idx": idx, "targets": idx.clone()}, loss_fn=_loss, name="minGPT gpt-mini")
