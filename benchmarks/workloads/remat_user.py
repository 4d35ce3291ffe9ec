"""A model that uses torch_remat itself (issue 27 item 6): each block is a torch_remat
checkpoint whose first projection is saved (``remat.region(..., recompute=False)``) and whose
norm, GELU and second projection are recomputed. memfit must see its regions as the modules
they run, not hide them.

    memfit profile benchmarks/workloads/remat_user.py:workload
"""

from __future__ import annotations

import torch
import torch_remat as remat
from torch import nn
from torch.nn import functional as F

import memfit


class Block(nn.Module):
    def __init__(self, d: int, own_remat: bool) -> None:
        super().__init__()
        self.own_remat = own_remat
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own_remat:
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        h = remat.region(self.fc1, "fc1", recompute=False)(self.ln(x))
        remat.recompute_needs_tensor(h)  # F.gelu reads it in the recompute
        return x + self.fc2(F.gelu(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own_remat:
            return self.body(x)
        return remat.checkpoint(region_name=f"block{id(self)}")(self.body)(x)


class Net(nn.Module):
    def __init__(self, d: int, n: int, own_remat: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, own_remat) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def workload(batch_size: int = 16, d: int = 256, n: int = 4, tokens: int = 128, own_remat: bool = True) -> memfit.Workload:
    """``own_remat=False``: the same model without torch_remat, for memfit's plans to apply."""
    torch.manual_seed(0)
    model = Net(d, n, own_remat)
    x = torch.randn(batch_size, tokens, d)
    return memfit.Workload(model, x, lambda out: out.square().mean(), name="remat_user")


def plain(batch_size: int = 16) -> memfit.Workload:
    """The same model without torch_remat, for memfit's plans to apply."""
    return workload(batch_size, own_remat=False)
