"""An accelerate training loop fitted to a memory budget by memfit, in one line.

A tiny GPT-2 from a config (random weights, nothing downloaded), bf16 mixed precision and
two accumulated micro-batches, as ``Accelerator`` runs them. ``fit_accelerator`` measures
that step (the prepared model with accelerate's autocast, the loss divided by the
accumulation steps, the optimizer inside the ``AcceleratedOptimizer``), plans what to
recompute for the budget, applies it to the model and logs predicted and measured peak.
The loop itself is unchanged.

    python examples/accelerate_loop.py            # CPU, a few seconds
"""

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from memfit.integrations.accelerate import fit_accelerator


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, use_cache=False))


def train(accelerator: Accelerator, model, optimizer, loader) -> list[float]:
    """The user's own accelerate loop: memfit changes nothing in it."""
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(budget: str = "50%"):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    fitted = fit_accelerator(accelerator, model, optimizer, loader, budget)  # <- memfit: the one line

    return fitted, train(accelerator, model, optimizer, loader)


if __name__ == "__main__":
    main()
