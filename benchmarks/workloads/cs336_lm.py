"""A CS336-style decoder LM (Stanford CS336 assignment 1's Transformer LM: pre-norm RMSNorm
blocks, causal multi-head attention written out with softmax, SwiGLU, untied LM head) whose
loss is the assignment's cross-entropy: log of the sum of exps by hand and the target logits
picked with ``gather``. fp32, vocab 10000, context 256, random weights. Its backward holds two
gradients at once wherever the residual stream branches, and gather's backward scatters
into a zeros tensor of the logits' size: the two places where a watched step allocates what
the unwatched one writes in place (memfit.measure.observer).

    memfit profile benchmarks/workloads/cs336_lm.py:workload
    python benchmarks/observer_lm.py
"""

from __future__ import annotations

import math

import torch
from torch import nn

import memfit

VOCAB, CONTEXT = 10_000, 256


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        h = self.ln2(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class TransformerLM(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4, d_ff: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads, d_ff) for _ in range(layers))
        self.ln_final = RMSNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """As CS336 students write it: subtract the max for stability, log of the sum of exps,
    gather the target logits."""
    logits = logits - logits.max(dim=-1, keepdim=True).values
    log_z = torch.log(torch.exp(logits).sum(dim=-1))
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_z - picked).mean()


def workload(batch_size: int = 8) -> memfit.Workload:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return memfit.Workload(
        TransformerLM(),
        ids[:, :-1].contiguous(),
        targets=ids[:, 1:].contiguous(),
        loss_fn=cross_entropy,
        name=f"CS336-style LM, 2 x 128, vocab {VOCAB}, {batch_size} x {CONTEXT}",
    )
