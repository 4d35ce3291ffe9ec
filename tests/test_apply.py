"""memfit.apply / memfit.remove: training computes exactly what it computed without a plan."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import TinyNet, assert_equivalent, make_plan
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from memfit import Choice, zoo


def _sum(out):
    return out.sum()


@pytest.mark.parametrize(
    "plan",
    [
        make_plan(fc1=Choice("full"), bn=Choice("full"), drop=Choice("full")),
        make_plan(bn=Choice("full"), drop=Choice("selective", ("native_dropout",))),
        make_plan(**{"": Choice("full")}),
    ],
    ids=["leaves", "selective-dropout", "root"],
)
def test_equivalence_with_dropout_and_batchnorm(plan):
    torch.manual_seed(0)
    assert_equivalent(TinyNet(), torch.randn(32, 64), _sum, plan)


def test_batchnorm_statistics_are_updated_once():
    torch.manual_seed(0)
    model, x = TinyNet(), torch.randn(32, 64)
    planned = copy.deepcopy(model)
    memfit.apply(planned, make_plan(bn=Choice("full")))
    for m in (model, planned):
        for _ in range(3):
            m(x).sum().backward()
    assert torch.equal(model.bn.running_mean, planned.bn.running_mean)
    assert torch.equal(model.bn.running_var, planned.bn.running_var)
    assert int(planned.bn.num_batches_tracked) == 3


def test_plain_checkpoint_updates_batchnorm_twice():
    # The trap memfit guards against: torch's checkpoint alone runs BatchNorm's update
    # again in the recompute.
    torch.manual_seed(0)
    bn, x = nn.BatchNorm1d(8), torch.randn(16, 8, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


def test_equivalence_on_gpt_with_full_and_selective_choices():
    work = zoo.build("gpt", n_layer=3, n_embd=64, n_head=4, block_size=32, vocab_size=256, batch_size=4)
    plan = make_plan(
        transformer__h__0=Choice("full"),
        transformer__h__1__attn=Choice("selective", ("addmm",)),
        transformer__h__1__mlp=Choice("selective", ("addmm", "gelu")),
        transformer__h__2=Choice("selective", ("addmm", "bmm")),
        lm_head=Choice("full"),
    )
    assert_equivalent(work.model, work.inputs, lambda out: out.loss, plan)


def test_equivalence_with_a_real_plan():
    work = zoo.build("gpt", n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=256, batch_size=4)
    plan = memfit.plan(work.model, work.inputs, 0.0)
    assert plan.checkpointed
    assert_equivalent(work.model, work.inputs, lambda out: out.loss, plan)


@dataclasses.dataclass
class Pair:
    value: torch.Tensor
    tag: str


class KwBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, gate: torch.Tensor | None = None) -> Pair:
        y = torch.tanh(self.fc(x)) * scale
        return Pair(y * gate if gate is not None else y, "ok")


class KwModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = KwBlock()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> dict:
        out = self.block(x, scale=0.5, gate=gate)
        assert out.tag == "ok"
        return {"pred": self.head(out.value), "n": 3}


def test_keyword_arguments_and_non_tensor_outputs():
    torch.manual_seed(0)
    model = KwModel()
    inputs = {"x": torch.randn(8, 16), "gate": torch.rand(8, 16, requires_grad=True)}
    assert_equivalent(model, inputs, lambda out: out["pred"].square().mean(), make_plan(block=Choice("full")))


def test_apply_and_remove_leave_the_model_as_it_was():
    torch.manual_seed(0)
    model = TinyNet()
    calls = []
    model.fc2.register_forward_hook(lambda m, a, o: calls.append("fc2"))
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    x = torch.randn(8, 64)
    model.eval()
    before = model(x)
    out = memfit.apply(model, make_plan(fc2=Choice("full"), bn=Choice("full")))
    assert out is model
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == names
    assert isinstance(model.fc2, nn.Linear) and type(model) is TinyNet
    assert torch.equal(model(x), before)
    model.train()
    calls.clear()
    model(x).sum().backward()
    assert calls == ["fc2"], "a user hook must run once per forward, not again in the recompute"
    memfit.remove(model)
    assert "forward" not in model.fc2.__dict__ and "forward" not in model.bn.__dict__
    model.eval()
    after = model(x)
    memfit.apply(model, make_plan(fc2=Choice("full")))
    assert torch.equal(model(x), after)


def test_no_grad_forward_runs_without_checkpoint():
    torch.manual_seed(0)
    model, x = TinyNet(), torch.randn(8, 64)
    memfit.apply(model, make_plan(fc1=Choice("full")))
    with torch.no_grad():
        y = model(x)
    assert not y.requires_grad


def test_selective_recompute_with_batchnorm_inside():
    work = zoo.build("resnet", image_size=16, base=8, batch_size=4)
    plan = make_plan(
        layer1__0=Choice("selective", ("convolution",)), layer2=Choice("full"), stem=Choice("selective", ("convolution",))
    )
    assert_equivalent(work.model, work.inputs, work.loss_fn, plan)
