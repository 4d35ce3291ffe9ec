"""The memory of a torch.compile'd step (memfit.measure.compiled, issue 27 item 4): checked
against the same compiled step's RSS rise in a fresh process, the partitioner's saved set moved
by activation_memory_budget, the user's objects and torch's configs left alone, the labelled
fallback, and bad input refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch._functorch.config as functorch_config
from torch import nn

import memfit
from memfit.bench.child import run_child
from memfit.cli import main
from memfit.measure.checked import checked_step
from memfit.measure.compiled import fit_memory_budget_step, profile_compiled_step

MLP = ["--batch-size", "256", "--size", "depth=3"]
"""zoo mlp-deep, 3 x Linear(1024)+ReLU at batch 256: tens of MB over the step's start, one graph."""


def _mlp_step():
    work = memfit.load_target("mlp-deep", batch_size=256, sizes={"depth": 3})
    return checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())


def test_compiled_peak_matches_the_rss_rise_of_the_compiled_step():
    """inductor's step in this process, against torch.compile(model) measured in a fresh one."""
    pred = profile_compiled_step(_mlp_step())
    assert pred.fallback is None and pred.graphs == 1 and pred.graph_breaks == 0
    gt = run_child("mlp-deep", method="compile:1.0", batch_size=256, sizes={"depth": 3})
    assert "error" not in gt, gt
    err = (pred.step_peak_bytes - gt["step_peak_bytes"]) / gt["step_peak_bytes"]
    assert abs(err) < 0.03, (pred.step_peak_bytes, gt)


class _Net(nn.Module):
    """Pointwise ops between matmuls: the min-cut saves some, a budget of 0 recomputes them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 256)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).sin().cos())


def test_memory_budget_changes_what_the_forward_saves():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(128, 256)
    step = checked_step(model, x)
    full, none = (profile_compiled_step(step, backend="aot_eager_decomp_partition", memory_budget=b) for b in (1.0, 0.0))
    assert full.memory_budget == 1.0 and none.memory_budget == 0.0
    assert none.saved_bytes < full.saved_bytes
    chosen, tried = fit_memory_budget_step(step, none.peak_bytes, (1.0, 0.0), backend="aot_eager_decomp_partition")
    assert [p.memory_budget for p in tried] == [1.0, 0.0]
    if full.peak_bytes > none.peak_bytes:
        assert chosen is not None and chosen.memory_budget == 0.0
    chosen, _ = fit_memory_budget_step(step, none.start_bytes, (1.0, 0.0), backend="aot_eager_decomp_partition")
    assert chosen is None  # nothing fits below the step's own start


def test_compiling_leaves_model_rng_and_configs_as_they_were():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(64, 256)
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    configs = (functorch_config.save_config(), dynamo_config.save_config())
    rng = torch.get_rng_state()
    out = memfit.profile_compiled(model, x, optimizer=opt, backend="aot_eager", memory_budget=0.5)
    assert out.fallback is None and out.memory_budget == 0.5
    assert (functorch_config.save_config(), dynamo_config.save_config()) == configs
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_fake_host_tensors_fall_back_to_the_eager_step_labelled(monkeypatch):
    # a torch that cannot run compiled code on fake tensors (tests/test_compiled_fake.py: this one can)
    from memfit.compat import inductor_fake

    monkeypatch.setattr(inductor_fake, "unavailable", lambda: "torch 2.x lacks what it needs")
    model, x = _Net(), torch.randn(64, 256)
    out = memfit.profile_compiled(model, x, fake=True)
    eager = memfit.profile(model, x, fake=True)
    assert out.fallback and out.label.startswith("eager step (not compiled:") and "lacks what it needs" in out.fallback
    assert out.step_peak_bytes == eager.step_peak_bytes


@pytest.mark.parametrize(
    "argv, says",
    [
        (["profile", "mlp-deep", "--compile", "--memory-budget", "2"], "fractions from 0 to 1"),
        (["profile", "mlp-deep", "--memory-budget", "0.5"], "give --compile too"),
        (["profile", "mlp-deep", "--compile", "tvm"], "is not one memfit measures"),
        (["plan", "mlp-deep", "--compile", "--budget", "50%"], "give --budget in bytes"),
        (["profile", "mlp-deep", "--compile", "--plot", "t.png"], "draws no timeline"),
    ],
)
def test_bad_compile_input_is_one_line(argv, says, capsys):
    assert main([*argv, *MLP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_compile_on_fake_refused_in_one_line_where_torch_cannot(monkeypatch, capsys):
    from memfit.compat import inductor_fake

    monkeypatch.setattr(inductor_fake, "unavailable", lambda: "torch 2.x lacks what it needs")
    assert main(["profile", "mlp-deep", "--compile", "--device", "fake", *MLP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks what it needs" in err[0] and "--device cpu or fake-cuda" in err[0], err


FAKE_CUDA_SCRIPT = """
import json, torch, memfit
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
out = memfit.profile_compiled(model, torch.randn(128, 256), fake="cuda")
from memfit.compat import inductor_fake
inductor_fake.unavailable = lambda: "as a torch without it"  # the host's step at full size, as before
host = memfit.profile_compiled(model, torch.randn(128, 256), fake="cuda")
from memfit.cuda.gpu import cublas_workspace_bytes
ws = 2 * cublas_workspace_bytes(tuple(torch.cuda.get_device_capability()))
print(json.dumps({"workspaces": ws, "label": out.label, "fallback": out.fallback, "peak": out.peak_bytes, "step_peak": out.step_peak_bytes,
                  "allocated": out.allocated_peak_bytes, "reserved": out.reserved_peak_bytes, "events": len(out.events),
                  "host": [host.fallback, host.allocated_peak_bytes, host.reserved_peak_bytes, host.saved_bytes], "saved": out.saved_bytes}))
"""


def test_fake_cuda_replays_the_compiled_step_through_the_allocator_model(fake_cuda):
    """On fake CUDA, inductor compiles and runs the step on fake host tensors (its kernels not
    run; its cache key would read the fake GPU's properties) and the allocations go through the
    caching allocator model, with the two cuBLAS workspaces a CUDA step holds: allocated at least
    the step's bytes and those (each block rounded up to 512 B), within a block's rounding per
    tensor; and the same allocated and reserved peaks as the step run for real on the host at its
    full size (what memfit did before, and does where torch cannot run compiled code on fake tensors)."""
    done = fake_cuda.script(FAKE_CUDA_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fallback"] is None and out["label"].startswith("compiled step (inductor")
    assert out["events"] > 0 and out["step_peak"] > 0
    host = out["peak"] + out["workspaces"]  # the host's bytes, and two cuBLAS workspaces the host's step has not
    assert host <= out["allocated"] <= host * 1.01
    assert out["reserved"] >= out["allocated"]
    # the host's run also allocates a few 4-8 B scalars inside C++ that no op dispatches, a 512 B
    # block each here (1 KiB on this MLP)
    fallback, allocated, reserved, saved = out["host"]
    assert fallback is None and (reserved, saved) == (out["reserved"], out["saved"])
    assert 0 <= allocated - out["allocated"] <= 4 * 512, (allocated, out["allocated"])
