"""Selective plans through torch_remat (issue 27 item 6), and steps that use torch_remat themselves.

Skipped without torch_remat: memfit works without it (the selective-checkpoint policy)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("torch_remat")

import memfit  # noqa: E402
from memfit.errors import PlanError  # noqa: E402
from memfit.recompute.checkpoint import apply_choices, mechanisms, remove  # noqa: E402

USER = str(Path(__file__).resolve().parent.parent / "benchmarks" / "workloads" / "remat_user.py")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)  # the recompute must draw what the forward drew

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _net() -> Net:
    torch.manual_seed(1)
    return Net()


def _train(model: nn.Module, steps: int = 3, choices: dict | None = None, mechanism: str = "auto"):
    """Parameters, last gradients, AdamW state and losses after ``steps`` steps (and the mechanisms used)."""
    opt = torch.optim.AdamW(model.parameters())
    if choices:
        apply_choices(model, choices, mechanism=mechanism)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        opt.zero_grad()
        loss = model(torch.randn(2, 5, 16))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    used = mechanisms(model)
    if choices:
        remove(model)
    grads = [p.grad.clone() for p in model.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    return [p.detach().clone() for p in model.parameters()], grads, state, losses, used


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


KEEP_MATMULS = {f"blocks.{i}": ("selective", ("addmm",)) for i in range(3)}


def test_selective_plan_through_torch_remat_trains_bitwise_as_without_a_plan():
    base = _net()
    ref = _train(copy.deepcopy(base))
    sac = _train(copy.deepcopy(base), choices=KEEP_MATMULS, mechanism="sac")
    auto = _train(copy.deepcopy(base), choices=KEEP_MATMULS)
    for got in (sac, auto):
        for i in range(4):  # parameters, gradients, optimizer state, losses
            assert _equal(ref[i], got[i])
    assert {v for v, _ in sac[4].values()} == {"sac"}
    assert auto[4] == {name: ("remat", "saves the calls of fc1, fc2") for name in KEEP_MATMULS}


def test_apply_and_remove_leave_names_state_dict_and_forwards_as_they_were():
    model = _net()
    names, keys = [n for n, _ in model.named_modules()], list(model.state_dict())
    dicts = {n: set(m.__dict__) for n, m in model.named_modules()}
    _train(model, steps=2, choices=KEEP_MATMULS)  # removes the plan at the end
    assert [n for n, _ in model.named_modules()] == names and list(model.state_dict()) == keys
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == dicts


def test_a_choice_torch_remat_cannot_say_stays_on_the_policy_and_forcing_it_is_one_line():
    # gelu runs in the block's own forward (F.gelu), not in a submodule: no region holds it
    choices = {f"blocks.{i}": ("selective", ("gelu",)) for i in range(3)}
    base = _net()
    ref = _train(copy.deepcopy(base))
    auto = _train(copy.deepcopy(base), choices=choices)
    assert _equal(ref[0], auto[0]) and _equal(ref[2], auto[2])
    mech, why = auto[4]["blocks.0"]
    assert mech == "sac" and "gelu" in why and "own forward" in why
    with pytest.raises(PlanError, match="cannot be recomputed through torch_remat") as err:
        _train(copy.deepcopy(base), choices=choices, mechanism="remat")
    assert "\n" not in str(err.value)


def test_a_copy_of_the_model_runs_its_own_submodules():
    """copy.deepcopy(model) after the switch (an EMA copy): its saved calls are its own."""
    model = _net()
    apply_choices(model, KEEP_MATMULS)
    for _ in range(2):
        model(torch.randn(2, 5, 16)).backward()
    twin = copy.deepcopy(model)
    assert twin.blocks[0].fc1.forward.module is twin.blocks[0].fc1
    torch.manual_seed(3)
    a = twin(torch.randn(2, 5, 16))
    torch.manual_seed(3)
    b = model(torch.randn(2, 5, 16))
    assert torch.equal(a, b)
    a.backward()
    remove(twin)
    assert "forward" not in twin.blocks[0].fc1.__dict__ and "forward" in model.blocks[0].fc1.__dict__


def test_unknown_mechanism_is_refused_naming_the_choices(monkeypatch):
    with pytest.raises(PlanError, match="unknown recompute mechanism 'fast'; expected one of auto, remat, sac"):
        apply_choices(_net(), KEEP_MATMULS, mechanism="fast")
    monkeypatch.setenv("MEMFIT_RECOMPUTE", "fast")
    model = _net()
    with pytest.raises(PlanError, match="MEMFIT_RECOMPUTE='fast' is not a recompute mechanism; expected one of auto, remat, sac"):
        apply_choices(model, KEEP_MATMULS)
    assert mechanisms(model) is None  # nothing applied
    monkeypatch.setenv("MEMFIT_RECOMPUTE", "sac")
    apply_choices(model, KEEP_MATMULS)
    assert mechanisms(model)["blocks.0"][0] == "sac"


def test_nested_choices_stay_on_the_policy():
    model = _net()
    choices = {"blocks.0": ("selective", ("addmm",)), "blocks.0.fc1": ("full", ())}
    with pytest.raises(PlanError, match="nested"):
        apply_choices(copy.deepcopy(model), choices, mechanism="remat")
    apply_choices(model, choices)
    assert mechanisms(model)["blocks.0"][0] == "sac"
    remove(model)


def test_same_ledger_peak_as_the_policy():
    """The step through torch_remat keeps the tensors the policy keeps: every tensor category
    of the peak is equal; autograd's graph (estimated on CPU) differs by torch_remat's own
    nodes (an identity at each checkpoint's output), under 2 KiB per checkpointed module."""
    torch.manual_seed(0)
    base = Net(d=64, n=3)
    x = torch.randn(4, 32, 64)
    peaks = {}
    for mech in ("sac", "auto"):
        model = copy.deepcopy(base)
        apply_choices(model, KEEP_MATMULS, mechanism=mech)
        peaks[mech] = memfit.profile(model, x, loss_fn=lambda out: out)
        assert mechanisms(model)["blocks.0"][0] == {"sac": "sac", "auto": "remat"}[mech]
    sac, auto = (dict(peaks[m].breakdown) for m in ("sac", "auto"))
    graph = auto.pop("autograd_graph") - sac.pop("autograd_graph")
    assert auto == sac and 0 <= graph <= 2048 * len(KEEP_MATMULS)
    assert peaks["auto"].peak_bytes - peaks["sac"].peak_bytes == graph


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS ground truth reads /proc")
def test_selective_plan_through_torch_remat_measured_in_a_fresh_process(tmp_path):
    """A selective plan applied by memfit.apply in a fresh process (its second step, the first
    through torch_remat): the RSS rise is what memfit's ledger says for that step, within 1%,
    and no more than the policy's step, which the plan was measured on (torch_remat frees a
    saved call's output as the recompute reads it: 2 MiB of 67 MiB less here at batch 16)."""
    from memfit.bench.child import measure_step_peak

    choices = {f"blocks.{i}": ("selective", ("addmm",)) for i in range(4)}
    ledger = {}
    for mech in ("sac", "auto"):
        work = memfit.load_target(f"{USER}:plain", batch_size=8)
        apply_choices(work.model, choices, mechanism=mech)
        ledger[mech] = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
        assert mechanisms(work.model)["blocks.0"][0] == {"sac": "sac", "auto": "remat"}[mech]
    plan = {
        "format": "memfit.plan", "version": 2, "budget_bytes": 0, "predicted_peak_bytes": 0, "start_bytes": 0,
        "none_peak_bytes": 0, "min_peak_bytes": 0, "extra_compute_s": None, "extra_flops": 0, "step_time_s": None,
        "checkpointed": {k: {"mode": m, "save_ops": list(ops)} for k, (m, ops) in choices.items()},
    }  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    measured = measure_step_peak(f"{USER}:plain", batch_size=8, plan_path=str(path))["step_peak_bytes"]
    assert abs(ledger["auto"].step_peak_bytes - measured) <= 0.01 * measured
    assert ledger["auto"].step_peak_bytes <= ledger["sac"].step_peak_bytes + 2048 * len(choices)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS ground truth reads /proc")
def test_profile_of_a_step_that_uses_torch_remat_itself():
    """A model whose blocks are torch_remat checkpoints saving their first projection: the
    ledger's step peak is the fresh process's RSS rise within 3%, and the kept projection
    outputs are seen as made by fc1 and kept by its block's checkpoint."""
    from memfit.bench.child import measure_step_peak

    work = memfit.load_target(f"{USER}:workload", batch_size=8)
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
    measured = measure_step_peak(f"{USER}:workload", batch_size=8)["step_peak_bytes"]
    assert abs(prof.step_peak_bytes - measured) <= 0.03 * measured
    big = [b for b in prof.ledger.blocks if b.category is memfit.Category.ACTIVATION and b.nbytes == 8 * 128 * 1024 * 4]
    assert sorted((b.module, b.savers) for b in big) == [(f"blocks.{i}.fc1", (f"blocks.{i}",)) for i in range(4)]
