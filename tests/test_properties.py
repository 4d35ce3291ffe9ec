"""Property-based tests: random module trees, random plans.

For any tree of modules and any choice of what to recompute (at most one choice on each
root-to-leaf path), training with the plan computes bitwise what it computes without,
and the peak the planner's model of the step predicts bounds the peak the recorder
measures on the planned step, closely. ``memfit.plan`` at a random budget returns a plan
whose measured peak is its predicted peak, within the budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same, make_plan, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memfit
from memfit.measure.profile import profile as measure_profile
from memfit.plan.candidates import DeviceRates, build_candidates
from memfit.plan.result import Choice, Plan
from memfit.plan.solver import Problem

WIDTH, BATCH = 64, 64  # 16 KiB activations: large enough to be worth recomputing
LEAVES = ("linear", "gelu", "tanh", "dropout", "layernorm", "relu_", "scale")

# A tree is a leaf name, ("seq", [trees]) or ("res", tree): residual x + f(x).
trees = st.recursive(
    st.sampled_from(LEAVES),
    lambda kids: st.one_of(st.tuples(st.just("seq"), st.lists(kids, min_size=1, max_size=3)), st.tuples(st.just("res"), kids)),
    max_leaves=8,
)


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class InplaceReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1.0).relu_()  # in place on a fresh tensor, as users write it


class Scale(nn.Module):
    """A parameter used through an in-place multiply."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.mul_(self.g)
        return y


def build(tree) -> nn.Module:
    if isinstance(tree, str):
        return {
            "linear": lambda: nn.Linear(WIDTH, WIDTH),
            "gelu": nn.GELU,
            "tanh": nn.Tanh,
            "dropout": lambda: nn.Dropout(0.3),
            "layernorm": lambda: nn.LayerNorm(WIDTH),
            "relu_": InplaceReLU,
            "scale": Scale,
        }[tree]()
    kind, body = tree
    if kind == "res":
        return Residual(build(body))
    return nn.Sequential(*(build(t) for t in body))


def model_of(forest, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # The root is always a Sequential with a Linear, so every step has a parameter to train.
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *(build(t) for t in forest))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def train(model: nn.Module, x: torch.Tensor, steps: int = 2) -> dict:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss_fn(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return snapshot(model, opt)


def plan_of(chosen) -> Plan:
    return make_plan(**{o.module.replace(".", "__"): Choice(o.mode, o.save_ops) for o in chosen})


def antichain(options, picks: list[int]):
    """Options at the picked indices, dropping any inside (or around) one already taken."""
    chosen = []
    for i in picks:
        o = options[i % len(options)]
        clash = any(
            o.module == c.module or o.module.startswith(c.module + ".") or c.module.startswith(o.module + ".") for c in chosen
        )
        if not clash and o.module != "":
            chosen.append(o)
    return chosen


# Derandomized: CI runs the same examples every time (a new counterexample is found by running
# with --hypothesis-seed, not by chance in someone else's build).
_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(
    forest=st.lists(trees, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=4),
)
def test_random_plans_are_equivalent_and_their_peak_is_predicted(forest, seed, picks):
    model = model_of(forest, seed)
    x = torch.randn(BATCH, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prof = measure_profile(model, x, loss_fn=loss_fn, optimizer=opt, fake=True)
    ledger = prof.ledger
    calls = {n: m.calls for n, m in prof.modules.items()}
    cands = build_candidates(ledger, {n: None for n in prof.modules}, rates=DeviceRates.for_device("cpu"), calls=calls)
    if not cands.options:
        return
    chosen = antichain(cands.options, picks)
    if not chosen:
        return
    predicted = Problem(ledger.curve(), ledger.start_bytes, cands.options).model_peak(chosen)

    planned = copy.deepcopy(model)
    memfit.apply(planned, plan_of(chosen))
    measured = measure_profile(planned, x, loss_fn=loss_fn, optimizer=torch.optim.AdamW(planned.parameters(), lr=1e-2)).peak_bytes
    # The model of the step is conservative (it keeps a checkpointed module's activations
    # alive through its whole forward): on 63 random trees it was 0.1% to 14% over
    # the recorded peak. memfit.plan never returns the model's figure unverified (below).
    assert predicted >= measured * 0.99, (measured, predicted, [o.module for o in chosen])
    assert predicted <= measured * 1.25, (measured, predicted, [o.module for o in chosen])

    assert_same(train(copy.deepcopy(model), x), train(planned, x))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    forest=st.lists(trees, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    fraction=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
)
def test_planned_step_peaks_where_predicted_and_within_budget(forest, seed, fraction):
    model = model_of(forest, seed)
    x = torch.randn(BATCH, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = snapshot(model, opt)
    plan = memfit.plan(model, x, fraction, loss_fn=loss_fn, optimizer=opt, fake=True)
    assert_same(before, snapshot(model, opt))
    assert plan.min_peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes <= plan.none_peak_bytes

    planned = memfit.apply(copy.deepcopy(model), plan)
    measured = measure_profile(planned, x, loss_fn=loss_fn, optimizer=torch.optim.AdamW(planned.parameters(), lr=1e-2))
    assert measured.peak_bytes == pytest.approx(plan.predicted_peak_bytes, rel=0.01)
    assert measured.peak_bytes <= plan.budget_bytes


# Counterexamples random seeds found, each once a real error of the model of the step
# (predicted bytes, recorded bytes), kept so they never come back.
@pytest.mark.parametrize(
    "forest,picks",
    [
        # (169232, 181008): the chain's last tanh saves its output, which the caller keeps
        # too, so the recompute makes a second copy of it during backward (Option.copies).
        pytest.param([("seq", ["tanh", "tanh", "tanh"])], [0], id="output-kept-by-the-caller"),
        # (230160, 181008): the recompute's transient was added on top of everything alive at
        # M's backward, freed activations included; now it is replayed from M's forward.
        pytest.param([("seq", ["gelu", ("res", "dropout"), ("seq", ["tanh", "tanh"])])], [0], id="recompute-transient"),
        # (420652, 429868): two adjacent checkpoints: the first frees the ReLU output the
        # second keeps as its input (a pair column in the solver adds it back).
        pytest.param(
            [
                "linear",
                ("seq", ["relu_", "dropout", "linear"]),
                ("seq", ["linear", ("res", "dropout"), ("seq", ["relu_", "relu_", "scale"])]),
            ],
            [3877, 224],
            id="adjacent-checkpoints",
        ),
        # (176400, 181008): selective recompute keeping tanh: the replay runs up to the
        # tanh (SAC hands its output back from the cache), not only to the last tensor it
        # makes again.
        pytest.param([("seq", ["dropout", "dropout", "tanh"])], [1], id="replay-runs-to-a-cached-output"),
    ],
)
def test_known_counterexamples(forest, picks):
    test_random_plans_are_equivalent_and_their_peak_is_predicted.hypothesis.inner_test(forest=forest, seed=0, picks=picks)
