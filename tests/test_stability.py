"""Stability: many steps with a plan applied leave nothing behind (memory stays flat)."""

from __future__ import annotations

import gc

import torch
from torch import nn

import memfit
from memfit.bench.child import _status_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 128)) for _ in range(4)]
    return nn.Sequential(*blocks)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_two_hundred_planned_steps_do_not_grow_memory():
    model, x = _model(), torch.randn(256, 128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, x, 0.0, loss_fn=_loss, optimizer=opt, fake=True)
    assert plan.checkpointed
    memfit.apply(model, plan)
    first = memfit.profile(model, x, loss_fn=_loss, optimizer=opt, fake=True)

    def step() -> None:
        _loss(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(20):  # warm-up: allocator pools and lazily built caches settle
        step()
    gc.collect()
    rss = [_status_bytes("VmRSS")]
    for i in range(180):
        step()
        if i % 60 == 59:
            gc.collect()
            rss.append(_status_bytes("VmRSS"))
    last = memfit.profile(model, x, loss_fn=_loss, optimizer=opt, fake=True)
    # The ledger of step 200 is the ledger of step 1: same start, same peak, nothing left at the end.
    assert (last.start_bytes, last.peak_bytes) == (first.start_bytes, first.peak_bytes)
    assert last.ledger.end_bytes == last.ledger.start_bytes
    # One leaked activation per step would be 180 x 128 KiB = 22.5 MiB; glibc's pools move
    # RSS by a few MiB either way between samples.
    assert max(rss) - rss[0] < 8 * 2**20, [r - rss[0] for r in rss]
