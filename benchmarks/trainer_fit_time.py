"""How long transformers' Trainer integration takes to decide (issue 24, item 5): a Phi-3
config of ~7M parameters (random weights), batch 4 x 128 tokens, ``fit_trainer`` at a budget
that the step as it is does not meet (a fraction of its profiled peak).

    python benchmarks/trainer_fit_time.py [--fraction 0.7] [--mode fit|plan]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import Phi3Config, Phi3ForCausalLM, Trainer, TrainingArguments

import memfit
from memfit.integrations.transformers import fit_trainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 128, vocab: int = 4096) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fraction", type=float, default=0.7)
    parser.add_argument("--mode", default="fit", choices=["fit", "plan"])
    ns = parser.parse_args()
    torch.manual_seed(0)
    cfg = Phi3Config(
        hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=4096, max_position_embeddings=256, pad_token_id=0,
    )
    model = Phi3ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    batch = next(iter(trainer.get_train_dataloader()))
    prof = memfit.profile(model, {k: v for k, v in batch.items()}, fake=True)
    budget = int(prof.peak_bytes * ns.fraction)
    print(f"Phi-3 {n / 1e6:.1f}M parameters, batch 4 x 128: step peak {prof.peak_bytes / 2**20:.1f} MiB (fake), budget {budget / 2**20:.1f} MiB")
    t0 = time.perf_counter()
    cb = fit_trainer(trainer, budget, mode=ns.mode, log=print)
    took = time.perf_counter() - t0
    print(f"fit_trainer decided in {took:.1f} s: {cb.recipe.levers if getattr(cb, 'recipe', None) else cb}")


if __name__ == "__main__":
    main()
