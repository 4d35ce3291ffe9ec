"""The step of three public GPU snapshots (fdrose/efficient-dl-systems @ 086ab0f,
week06_dl_arithmetic/seminar/cross_entropy/): ``F.cross_entropy`` on 1024 x 128,000 bfloat16 logits,
a leaf with grad, forward and backward, recorded from before the logits were made.

The logits are a parameter here (memfit's step starts with its parameters alive, as the trace starts
before they are made: the same blocks at the peak) and the optimizer is SGD with lr 0 (no state, an
in-place update that allocates nothing: the script steps none). docs/benchmarks/gpu-traces.md
compares:

    MEMFIT_FAKE_CUDA=1 memfit profile benchmarks/workloads/cross_entropy_public.py:workload --device fake-cuda
    memfit snapshot MIRROR/vanilla_ce_snapshot.pickle
"""

import torch
import torch.nn.functional as F
from torch import nn

import memfit

VOCAB = 128_000


class CrossEntropy(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.randn(rows, VOCAB, dtype=torch.bfloat16))

    def forward(self, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits, targets)


def workload(batch_size: int = 1024) -> memfit.Workload:
    targets = torch.randint(0, VOCAB, (batch_size,))
    return memfit.Workload(
        CrossEntropy(batch_size),
        (targets,),
        loss_fn=lambda loss: loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        name=f"cross_entropy {batch_size} x {VOCAB} bf16",
    )
