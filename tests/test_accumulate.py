"""StepOptions(accumulate=k): k forward+backward passes over the batch, no zero_grad between
them, then one optimizer step, as a training loop that accumulates gradients writes it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TinyNet

import memfit
from memfit import StepOptions, zoo
from memfit.errors import WorkloadError
from memfit.measure.step import train_step


def _hand_loop(model, x, y, optimizer, k: int, steps: int) -> list[float]:
    """The loop people write: k passes, loss / k each, backward, then step and zero_grad(set_to_none=False)."""
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(k):
            loss = torch.nn.functional.mse_loss(model(x), y) * (1.0 / k)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        losses.append(total)
    return losses


def test_accumulate_computes_what_the_hand_written_loop_computes():
    torch.manual_seed(0)
    model, x, y = TinyNet(), torch.randn(32, 64), torch.randn(32, 64)
    mine = copy.deepcopy(model)
    opt_hand = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    torch.manual_seed(1)  # dropout draws the same masks in both
    _hand_loop(model, x, y, opt_hand, k=3, steps=2)
    torch.manual_seed(1)
    loss_fn = lambda out, t: torch.nn.functional.mse_loss(out, t)  # noqa: E731
    for _ in range(2):
        train_step(mine, (x,), {}, loss_fn, opt_mine, accumulate=3, set_to_none=False, targets=y)
    for (name, a), b in zip(model.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b), name  # bitwise
    for a, b in zip(model.parameters(), mine.parameters()):
        assert b.grad is not None and torch.equal(a.grad, b.grad)  # zeros, kept allocated
    for sa, sb in zip(opt_hand.state.values(), opt_mine.state.values()):
        assert all(torch.equal(sa[key], sb[key]) for key in sa)


def test_accumulate_peak_fake_equals_real_and_holds_the_whole_batch():
    work = zoo.build("gpt", batch_size=4, n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=512)
    step = StepOptions(accumulate=3, set_to_none=False)
    real = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, step=step)
    fake = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, step=step, fake=True)
    assert fake.peak_bytes == real.peak_bytes and fake.start_bytes == real.start_bytes
    assert real.step == step
    # gradients alive at the start (set_to_none=False), each pass the whole batch's activations:
    # more than the same batch split into 3 micro-batches... (batch 4 does not split in 3: 2)
    split = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, step=StepOptions(micro_batches=2, set_to_none=False), fake=True)
    assert real.step_peak_bytes > split.step_peak_bytes
    once = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, step=StepOptions(set_to_none=False), fake=True)
    assert real.start_bytes == once.start_bytes
    optimizer_flops = once.step_flops - once.modules[""].forward_flops - once.modules[""].backward_flops
    assert real.step_flops - optimizer_flops == 3 * (once.step_flops - optimizer_flops)  # three passes ran


def test_accumulate_json_and_bad_values():
    assert "accumulate" not in StepOptions().to_dict()  # readable by a memfit from before the field
    step = StepOptions(accumulate=4, set_to_none=False)
    assert StepOptions.from_dict(step.to_dict()) == step and step.to_dict()["accumulate"] == 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(WorkloadError, match="accumulate must be a positive integer"):
            StepOptions(accumulate=bad)
    with pytest.raises(WorkloadError, match="inference"):
        StepOptions(accumulate=2, inference=True)
