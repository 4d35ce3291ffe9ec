"""Lightning with memfit: a recompute plan for a budget, and the largest batch that fits,
found on fake tensors (no step run until it runs out of memory).

    python examples/lightning_module.py      # CPU, a few seconds
"""

import tempfile

import lightning.pytorch as pl
import torch
from torch import nn

from memfit.integrations.lightning import MemfitBatchSizeFinder, MemfitCallback


class Net(pl.LightningModule):
    def __init__(self, batch_size: int = 16, width: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size  # BatchSizeFinder's (and memfit's) batch_arg_name
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)]
        )
        self.head = nn.Linear(width, 10)
        g = torch.Generator().manual_seed(3)
        self.data = torch.utils.data.TensorDataset(
            torch.randn(256, 32, width, generator=g), torch.randint(0, 10, (256,), generator=g)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.layers(x).mean(1)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def trainer(callback: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
        callbacks=[callback],
    )


def main() -> tuple[MemfitCallback, MemfitBatchSizeFinder]:
    torch.manual_seed(0)
    fitted = MemfitCallback("50%")  # <- memfit: recompute half way from the lowest peak to none
    trainer(fitted).fit(Net())
    finder = MemfitBatchSizeFinder("16MiB", mode="binsearch")  # <- memfit: in place of BatchSizeFinder
    trainer(finder).fit(Net(batch_size=2))
    return fitted, finder


if __name__ == "__main__":
    main()
