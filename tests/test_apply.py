"""memfit.apply / memfit.remove: training computes exactly what it computed without a plan."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import TinyNet
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from memfit import Choice, Plan, zoo


def _plan(**checkpointed: Choice) -> Plan:
    return Plan(
        budget_bytes=0,
        predicted_peak_bytes=0,
        start_bytes=0,
        none_peak_bytes=0,
        min_peak_bytes=0,
        checkpointed={k.replace("__", "."): v for k, v in checkpointed.items()},
        extra_compute_s=None,
        extra_flops=0,
        step_time_s=None,
    )


def _train(model: nn.Module, inputs, loss_fn, steps: int, seed: int = 0):
    """``steps`` AdamW steps; returns the first step's gradients and the final state."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    args, kwargs = memfit.workload.split_inputs(inputs)
    grads = None
    for i in range(steps):
        out = model(*args, **kwargs)
        loss = loss_fn(out)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": [{k: v.clone() for k, v in st.items()} for st in opt.state.values()],
    }
    return grads, state


def _assert_bitwise(a, b):
    (ga, sa), (gb, sb) = a, b
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"gradient of {n} differs"
    for key in ("params", "buffers"):
        for n in sa[key]:
            assert torch.equal(sa[key][n], sb[key][n]), f"{key} {n} differs"
    for x, y in zip(sa["opt"], sb["opt"]):
        for k in x:
            assert torch.equal(x[k], y[k]), f"optimizer state {k} differs"


def _equivalent(model: nn.Module, inputs, loss_fn, plan: Plan, steps: int = 3) -> None:
    planned = copy.deepcopy(model)
    reference = _train(model, inputs, loss_fn, steps)
    memfit.apply(planned, plan)
    _assert_bitwise(reference, _train(planned, inputs, loss_fn, steps))


def _sum(out):
    return out.sum()


@pytest.mark.parametrize(
    "plan",
    [
        _plan(fc1=Choice("full"), bn=Choice("full"), drop=Choice("full")),
        _plan(bn=Choice("full"), drop=Choice("selective", ("native_dropout",))),
        _plan(**{"": Choice("full")}),
    ],
    ids=["leaves", "selective-dropout", "root"],
)
def test_equivalence_with_dropout_and_batchnorm(plan):
    torch.manual_seed(0)
    _equivalent(TinyNet(), torch.randn(32, 64), _sum, plan)


def test_batchnorm_statistics_are_updated_once():
    torch.manual_seed(0)
    model, x = TinyNet(), torch.randn(32, 64)
    planned = copy.deepcopy(model)
    memfit.apply(planned, _plan(bn=Choice("full")))
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
    plan = _plan(
        transformer__h__0=Choice("full"),
        transformer__h__1__attn=Choice("selective", ("addmm",)),
        transformer__h__1__mlp=Choice("selective", ("addmm", "gelu")),
        transformer__h__2=Choice("selective", ("addmm", "bmm")),
        lm_head=Choice("full"),
    )
    _equivalent(work.model, work.inputs, lambda out: out.loss, plan)


def test_equivalence_with_a_real_plan():
    work = zoo.build("gpt", n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=256, batch_size=4)
    plan = memfit.plan(work.model, work.inputs, 0.0)
    assert plan.checkpointed
    _equivalent(work.model, work.inputs, lambda out: out.loss, plan)


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
    _equivalent(model, inputs, lambda out: out["pred"].square().mean(), _plan(block=Choice("full")))


def test_apply_and_remove_leave_the_model_as_it_was():
    torch.manual_seed(0)
    model = TinyNet()
    calls = []
    model.fc2.register_forward_hook(lambda m, a, o: calls.append("fc2"))
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    x = torch.randn(8, 64)
    model.eval()
    before = model(x)
    out = memfit.apply(model, _plan(fc2=Choice("full"), bn=Choice("full")))
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
    memfit.apply(model, _plan(fc2=Choice("full")))
    assert torch.equal(model(x), after)


def test_no_grad_forward_runs_without_checkpoint():
    torch.manual_seed(0)
    model, x = TinyNet(), torch.randn(8, 64)
    memfit.apply(model, _plan(fc1=Choice("full")))
    with torch.no_grad():
        y = model(x)
    assert not y.requires_grad


def test_misuse_is_refused_clearly():
    model = TinyNet()
    with pytest.raises(memfit.PlanError, match="nothing to remove"):
        memfit.remove(model)
    memfit.apply(model, _plan(fc1=Choice("full")))
    with pytest.raises(memfit.PlanError, match="already applied"):
        memfit.apply(model, _plan(fc2=Choice("full")))
    memfit.remove(model)
    with pytest.raises(memfit.PlanError, match="does not have"):
        memfit.apply(model, _plan(encoder=Choice("full")))
    other = dataclasses.replace(_plan(fc1=Choice("full")), fingerprint="0123456789abcdef", model_type="GPT")
    with pytest.raises(memfit.PlanError, match="made for another model"):
        memfit.apply(model, other)
    assert "forward" not in model.fc1.__dict__


def test_selective_recompute_with_batchnorm_inside():
    work = zoo.build("resnet", image_size=16, base=8, batch_size=4)
    plan = _plan(
        layer1__0=Choice("selective", ("convolution",)), layer2=Choice("full"), stem=Choice("selective", ("convolution",))
    )
    _equivalent(work.model, work.inputs, work.loss_fn, plan)
