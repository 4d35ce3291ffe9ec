"""Mixture-of-experts models (issue 24, item 2): transformers' Qwen2-MoE, whose experts run
as one grouped GEMM (``aten._grouped_mm``) after top-k routing. torch's fake kernel of that
op takes bf16 only, while the fp32 CPU step runs: planning ended in a ~170-line traceback
from the fake copy the planner verifies on. Now the step is profiled on fake tensors with
the real step's peak, planned, and trained bitwise with the plan; a fake kernel that fails
where the real op runs sends plans to the real step, in one line."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise, needs, train

import memfit
from memfit.cli import main
from memfit.compat import torch_compat as _torch_compat

pytestmark = needs("transformers")  # looked up, not imported: the tests import it when they run
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("torch before 2.8 has no grouped GEMM", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "benchmarks" / "workloads" / "qwen_moe.py"


def _workload() -> memfit.Workload:
    spec = importlib.util.spec_from_file_location("qwen_moe_workload", WORKLOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qwen_moe()


def _runs_grouped_mm(prof: memfit.Profile) -> bool:
    return any(o.op == "_grouped_mm" for o in prof.ledger.ops)


def test_fake_profile_of_a_moe_step_peaks_as_the_real_one():
    w = _workload()
    real = memfit.profile(w.model, w.inputs, loss_fn=w.loss_fn)
    fake = memfit.profile(w.model, w.inputs, loss_fn=w.loss_fn, fake=True)
    assert _runs_grouped_mm(real) and _runs_grouped_mm(fake)  # the experts' path, not a fallback loop
    assert fake.peak_bytes == real.peak_bytes  # 15707590 bytes on torch 2.13
    assert fake.step_flops == real.step_flops > 0


def test_a_moe_step_plans_and_trains_bitwise_with_the_plan():
    w = _workload()
    model, inputs = w.model, w.inputs
    plan = memfit.plan(model, inputs, 0.0, loss_fn=w.loss_fn)  # P_min: the most recompute
    assert plan.checkpointed and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.extra_flops > 0  # the experts' recompute is counted (a GEMM's 2MNK)
    assert not plan.verify_note
    planned = copy.deepcopy(model)
    reference = train(model, inputs, w.loss_fn, 2)
    memfit.apply(planned, plan)
    assert_bitwise(reference, train(planned, inputs, w.loss_fn, 2))


def test_a_fake_kernel_that_refuses_what_the_real_op_runs_sends_plans_to_the_real_step(monkeypatch, caplog):
    # memfit's rule off: torch's own fake _grouped_mm refuses fp32, as on the main of 2025-11
    monkeypatch.setattr(_torch_compat, "_grouped_mm_rule", lambda *a: None)
    # plans go to fake copies when those are faster than the real step: on a loaded host they
    # are, on a quiet one this tiny step's real run can be; the test is of the fallback, so
    # the planner is told they are
    monkeypatch.setattr(importlib.import_module("memfit.plan.planner"), "_fake_is_faster", lambda prof: True)
    w = _workload()
    with caplog.at_level(logging.ERROR, logger="torch._subclasses.fake_tensor"):
        plan = memfit.plan(w.model, w.inputs, "50%", loss_fn=w.loss_fn)
    assert plan.verify_note.startswith("fake tensors could not run this step (RuntimeError: Expected inputs of BF16")
    assert plan.verify_note.endswith("plans verified on the real step") and "\n" not in plan.verify_note
    assert not [r for r in caplog.records if "failed while attempting" in r.getMessage()]  # torch's 22 lines
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_cli_plans_a_moe_step_without_a_traceback(capsys):
    assert main(["plan", f"{WORKLOAD}:qwen_moe", "--budget", "50%"]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "predicted peak" in out.out


def test_a_moe_step_profiles_and_plans_on_fake_cuda(fake_cuda, tmp_path):
    # in the session's fake-CUDA interpreter (conftest): `python -m memfit ... --device fake-cuda`
    # relaunching itself with the shim is test_fake_cuda's test_cli_profiles_a_transformer_on_fake_cuda;
    # a fresh one here cost two more start-ups of torch and memfit for the same step
    prof = tmp_path / "p.json"
    args = ["plan", f"{WORKLOAD}:qwen_moe", "--device", "fake-cuda", "--budget", "0%"]
    done = fake_cuda.cli([*args, "--profile", str(prof)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr and "fake:cuda:0" in done.stdout
    data = json.loads(prof.read_text())
    assert data["device"] == "fake:cuda:0" and "_grouped_mm" in {op[1] for op in data["ledger"]["ops"]}


class _RealOnlyBackward(torch.autograd.Function):
    """An op whose backward runs on real tensors and raises on fake ones, as a fake kernel
    that refuses what the real kernel runs does (torch's _grouped_mm in fp32 on main)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if _torch_compat.is_fake(grad):
            raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32\nsecond line")
        return grad * 2


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _RealOnlyBackward.apply(self.fc(x))


def test_a_fake_backward_that_fails_is_one_line_where_the_real_one_runs():
    model, x = _Net(), torch.randn(4, 8)
    assert memfit.profile(model, x, loss_fn=lambda y: y.sum()).peak_bytes > 0
    with pytest.raises(memfit.MemfitError) as err:
        memfit.profile(model, x, loss_fn=lambda y: y.sum(), fake=True)
    message = str(err.value)
    assert message.startswith("the backward on fake tensors raised RuntimeError: Expected inputs of BF16")
    assert "\n" not in message and "measure on real tensors" in message
