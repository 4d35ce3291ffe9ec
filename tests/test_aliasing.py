"""Fake ledgers alias where real ones do (issue 23 item 2).

A real kernel may return one of its inputs where fake tensors make a copy (eval dropout under
inference_mode: torch's Python decomposition clones). Each case is one op of those memfit's
zoo and test models dispatch (``benchmarks/alias_audit.py`` lists them), in a module whose
step is profiled on real CPU tensors and on fake ones: the two ledgers must be the same,
block for block and tick for tick.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.measure.step import StepOptions

WIDE = 2048  # the op's tensor dwarfs the input: a copy of it moves the peak


class OneOp(nn.Module):
    """Linear(8 -> WIDE), then ``op`` on its output, then a reduction. ``grad``: the op under
    torch.no_grad() inside the forward (the no_grad mode of the audit)."""

    def __init__(self, op, grad: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(8, WIDE)
        self.op = op
        self.grad = grad
        # a tensor the module keeps outside its parameters and buffers (a constant, labels
        # in a loss closure): a fake copy keeps it real, so the fake mode converts it on use
        self.outside = torch.ones(4, WIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.grad:
            y = self.op(self, h)
        else:
            with torch.no_grad():
                y = self.op(self, h)
        return (h * y).sum() if y.dtype.is_floating_point else h.sum() + y.sum()


CASES = {
    # the issue: the real kernel returns its input, torch's Python decomposition a clone
    "dropout eval": lambda m, h: F.dropout(h, 0.5, training=False),
    "dropout p=0 train": lambda m, h: F.dropout(h, 0.0, training=True),
    # a real tensor kept outside the model, moved to the device it is on already
    "to(device) of a kept tensor": lambda m, h: m.outside.to(h.device),
    "to(dtype, device) of a kept tensor": lambda m, h: m.outside.to(device=h.device, dtype=h.dtype),
    # torch.tensor() inside the step: its data is made where no mode sees it (lift_fresh)
    "torch.tensor constant": lambda m, h: h * torch.tensor(2.0),
    # composite ops that return their input on real tensors and on fake ones alike
    "to same dtype": lambda m, h: h.to(torch.float32),
    "contiguous": lambda m, h: h.contiguous(),
    "reshape": lambda m, h: h.reshape(-1, WIDE),
    "type_as": lambda m, h: h.type_as(h),
    # and ops that make a new tensor on both
    "dropout train": lambda m, h: F.dropout(h, 0.5, training=True),
    "to other dtype": lambda m, h: h.to(torch.float64),
}
MODES = {
    "train": (StepOptions(), True),
    "no_grad": (StepOptions(), False),
    "inference": (StepOptions(inference=True), True),
}


def _ledger_rows(prof: memfit.Profile) -> tuple[list, list]:
    blocks = [(b.nbytes, b.category, b.phase, b.module, b.born, b.died) for b in prof.ledger.blocks]
    ticks = [(t.phase, t.module, t.op) for t in prof.ledger.ticks]
    return blocks, ticks


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_fake_ledger_is_the_real_one_op_by_op(case, mode):
    step, grad = MODES[mode]
    torch.manual_seed(0)
    model, x = OneOp(CASES[case], grad), torch.randn(4, 8)
    real = memfit.profile(model, x, step=step)
    fake = memfit.profile(model, x, step=step, fake=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.start_bytes == real.start_bytes
    real_blocks, real_ticks = _ledger_rows(real)
    fake_blocks, fake_ticks = _ledger_rows(fake)
    assert fake_ticks == real_ticks
    assert fake_blocks == real_blocks


def test_eval_dropout_copy_no_longer_moves_the_fake_peak():
    """The issue's case on its own: the peak of an eval step whose dropout follows a wide
    linear. On fake tensors the clone doubled the linear's output at the dropout."""
    torch.manual_seed(0)
    model, x = OneOp(CASES["dropout eval"]), torch.randn(4, 8)
    step = StepOptions(inference=True)
    real = memfit.profile(model, x, step=step)
    fake = memfit.profile(model, x, step=step, fake=True)
    assert fake.peak_bytes == real.peak_bytes
    assert not any(t.op == "dropout" for t in fake.ledger.ticks[: fake.ledger.peak_tick + 1])


def test_returned_inputs_asks_the_real_kernel():
    """The probe itself: dropout(train=False) returns its input on the real kernel; a copy,
    an out-of-place op and a view (aliasing by schema, which fake tensors keep) give nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.measure import aliasing

    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(3, 4))
    aten = torch.ops.aten
    with torch.inference_mode(), mode:
        for func, args, expect in (
            (aten.dropout.default, (x, 0.5, False), True),
            (aten.dropout.default, (x, 0.5, True), False),
            (aten.to.dtype, (x, torch.float64), False),
            (aten.add.Tensor, (x, x), False),
            (aten.view.default, (x, [12]), False),
        ):
            out = func(*args)
            pairs = aliasing.returned_inputs(func, args, {}, [x], out)
            assert bool(pairs) is expect, func
            if expect:
                assert pairs == [(out, x)]


def test_bert_eval_step_on_fake_tensors_is_the_real_one():
    """End to end: transformers' BERT (eager attention, whose probabilities go through
    dropout) in memfit's eval step. On fake tensors each dropout held a copy of its input:
    the softmax's, at the peak's size. The peak itself ties on the CPU ledger (the softmax's
    input and output were alive just before), so the whole curve is compared: memory after
    every tick."""
    pytest.importorskip("transformers")
    from memfit import zoo

    work = zoo.build(
        "bert-base",
        batch_size=2,
        seq_len=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=64,
        attn_implementation="eager",
    )
    step = StepOptions(inference=True)
    real = memfit.profile(work.model, work.inputs, step=step)
    fake = memfit.profile(work.model, work.inputs, step=step, fake=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.ledger.curve() == real.ledger.curve()
    assert _ledger_rows(fake) == _ledger_rows(real)
