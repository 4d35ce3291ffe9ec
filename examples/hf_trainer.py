"""transformers' Trainer fitted to a memory budget by memfit, in one line.

A tiny GPT-2 from a config (random weights, nothing downloaded), a tiny in-memory data set.
``fit_trainer`` measures the Trainer's own step (model, first batch, outputs.loss, the
optimizer the Trainer builds), chooses recompute and/or micro-batches for the budget, puts
them on the model and the TrainingArguments, and logs predicted and measured peak.

    python examples/hf_trainer.py            # CPU, a few seconds
"""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from memfit.integrations.transformers import fit_trainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(budget: str = "5MiB") -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    fit_trainer(trainer, budget)  # <- memfit: the one line
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
