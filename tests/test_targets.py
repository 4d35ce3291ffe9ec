"""Targets beside the inputs: ``loss_fn(output, targets)``.

The model gets the inputs, the loss gets the model's output and the targets; memfit cuts
both into micro-batches alike, so a loss that compares the output with its targets can be
micro-batched (a loss closing over the whole batch's targets cannot). The one-argument
``loss_fn(output)`` works as before.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same, snapshot
from torch import nn

import memfit
from memfit import StepOptions, WorkloadError
from memfit.levers.catalog.microbatch import probe as _micro_batching
from memfit.measure.step import train_step
from memfit.workload import resize_batch, resize_targets, split_batch


class Classifier(nn.Module):
    """Takes the images only, as vision models do; no BatchNorm, so micro-batching is exact."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return self.head(h + self.blocks(h))


def _setup(batch: int = 8):
    torch.manual_seed(0)
    return Classifier(), torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))


@pytest.mark.parametrize(
    "loss_fn",
    [
        F.cross_entropy,
        nn.CrossEntropyLoss(),
        functools.partial(F.cross_entropy, label_smoothing=0.1),
        lambda out, y: F.cross_entropy(out, y),
    ],
    ids=["function", "module", "partial", "lambda"],
)
def test_the_loss_gets_the_targets(loss_fn):
    model, x, y = _setup()
    opt = torch.optim.AdamW(model.parameters())
    before = snapshot(model, opt)
    prof = memfit.profile(model, x, targets=y, loss_fn=loss_fn, optimizer=opt)
    assert prof.breakdown["inputs"] == x.nbytes + y.nbytes  # the targets are inputs of the step
    assert_same(before, snapshot(model, opt))
    fake = memfit.profile(model, x, targets=y, loss_fn=loss_fn, optimizer=opt, fake=True)
    assert fake.ledger.blocks and fake.breakdown["inputs"] == prof.breakdown["inputs"]


def test_the_one_argument_loss_still_works():
    model, x, y = _setup()
    for loss_fn in (lambda out: F.cross_entropy(out, y), torch.sum):  # torch.sum: a builtin, no signature to read
        assert memfit.profile(model, x, loss_fn=loss_fn).peak_bytes > 0


def test_micro_batches_cut_the_targets_with_the_inputs():
    model, x, y = _setup()
    parts = split_batch((x,), {}, y, 4)
    assert [t.tolist() for _, _, t in parts] == [y[i : i + 2].tolist() for i in range(0, 8, 2)]
    assert all(torch.equal(a[0], x[i * 2 : i * 2 + 2]) for i, (a, _, _) in enumerate(parts))
    # and so does tiling the batch to another size (memfit.max_batch)
    assert torch.equal(resize_targets({"y": y}, x, 12)["y"], y[torch.arange(12) % 8])
    assert resize_batch(x, 12).shape[0] == 12

    # memfit's micro-batched step is the accumulation loop one writes by hand, bitwise; its
    # gradients equal the full batch's to float rounding (each micro-batch sums fewer
    # samples, then the partial gradients are added: another order), as in test_fit.py.
    full, micro, by_hand = _setup()[0], _setup()[0], _setup()[0]
    kept = {}
    for model, k in ((full, 1), (micro, 4)):
        opt = _Keep(model.parameters())
        train_step(model, (x,), {}, F.cross_entropy, opt, micro_batches=k, targets=y)
        kept[k] = opt.kept
    for i in range(4):
        (F.cross_entropy(by_hand(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]) * 0.25).backward()
    for i, (name, p) in enumerate(by_hand.named_parameters()):
        assert torch.equal(kept[4][i], p.grad), name
        torch.testing.assert_close(kept[4][i], kept[1][i], rtol=1e-5, atol=1e-7, msg=name)


class _Keep(torch.optim.SGD):
    """Keeps the gradients it is stepped with (train_step sets them to None after)."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.0)

    def step(self, closure=None):
        self.kept = [p.grad.clone() for g in self.param_groups for p in g["params"]]


def test_fit_may_micro_batch_a_loss_with_targets():
    model, x, y = _setup()
    opt = torch.optim.AdamW(model.parameters())
    scales, why = _micro_batching(model, (x,), {}, F.cross_entropy, opt, targets=y)
    assert scales == {2: 0.5, 4: 0.25, 8: 0.125} and why is None  # a mean over samples
    scales, why = _micro_batching(model, (x,), {}, lambda out: F.cross_entropy(out, y), opt)
    assert not scales and "loss_fn(output, targets)" in why  # the closure over the whole batch's targets


def test_fit_chooses_micro_batches_and_the_recipe_runs_them():
    model, x, y = _setup(16)
    opt = torch.optim.AdamW(model.parameters())
    before = snapshot(model, opt)
    quarter = memfit.profile(
        model, x, targets=y, loss_fn=F.cross_entropy, optimizer=opt, fake=True, step=StepOptions(micro_batches=8)
    )
    recipe = memfit.fit(model, x, quarter.peak_bytes, targets=y, loss_fn=F.cross_entropy, optimizer=opt)
    assert_same(before, snapshot(model, opt))
    assert "microbatch" in recipe.levers and recipe.targets
    snippet = recipe.snippet()
    assert "run.split(batch, targets)" in snippet and "loss_fn(model(micro), micro_targets)" in snippet
    run = memfit.apply_recipe(recipe, model, opt)
    loss = run.step(x, F.cross_entropy, targets=y)
    assert loss == loss and len(run.split(x, y)) == recipe.micro_batches
    if recipe.plan is not None:
        memfit.remove(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"targets": torch.zeros(8, dtype=torch.long)}, r"targets were given but no loss_fn to compare the output with them"),
        (
            {"targets": torch.zeros(8, dtype=torch.long), "loss_fn": lambda out: out.sum()},
            r"loss_fn takes one argument \(output\) but targets were given: make it loss_fn\(output, targets\)",
        ),
        ({"loss_fn": F.cross_entropy}, r"loss_fn takes \(output, targets\) but no targets were given: pass targets="),
        ({"targets": torch.zeros(8, device="meta"), "loss_fn": F.mse_loss}, r"the targets are on meta but the model is on cpu"),
    ],
    ids=["no-loss", "one-argument-loss", "no-targets", "targets-on-meta"],
)
def test_targets_and_loss_that_do_not_match_are_refused(kwargs, match):
    model, x, _ = _setup()
    before = snapshot(model)
    for call in (memfit.profile, lambda *a, **k: memfit.plan(*a, 0.5, **k), lambda *a, **k: memfit.fit(*a, "1GiB", **k)):
        with pytest.raises(WorkloadError, match=match):
            call(model, x, **kwargs)
    if "meta" not in match:  # a Workload is checked when it is made; devices, when it runs
        with pytest.raises(WorkloadError, match=match):
            memfit.Workload(model, x, **kwargs)
    assert_same(before, snapshot(model))
