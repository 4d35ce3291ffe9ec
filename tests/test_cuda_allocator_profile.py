"""A CUDA profile's caching-allocator peaks (allocated_peak_bytes, reserved_peak_bytes): on fake
CUDA from the allocator model under PYTORCH_CUDA_ALLOC_CONF; on CPU absent. Fake-CUDA steps run
in the session's interpreter with the shim loaded (it loads before torch; conftest's ``fake_cuda``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import memfit
from memfit.measure.profile import Profile

MiB = 1 << 20
GPT = [
    "gpt",
    "--batch-size",
    "2",
    "--size",
    "n_layer=2",
    "--size",
    "n_embd=128",
    "--size",
    "n_head=4",
    "--size",
    "block_size=128",
]


def _profile(fake_cuda, tmp: Path, conf: str | None, *args: str) -> subprocess.CompletedProcess:
    """``memfit profile`` of the small GPT on fake CUDA, under PYTORCH_CUDA_ALLOC_CONF=``conf`` (unset: None)."""
    env = None if conf is None else {"PYTORCH_CUDA_ALLOC_CONF": conf}
    return fake_cuda.cli(["profile", *GPT, "--device", "fake-cuda", *args, "--json", str(tmp / "p.json")], env)


@pytest.fixture(scope="session")
def default_profile(fake_cuda, tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("default")
    done = _profile(fake_cuda, tmp, None)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp / "p.json").read_text()), done.stdout


def test_fake_cuda_profile_has_the_allocators_peaks(default_profile):
    data, stdout = default_profile
    alloc, res = data["allocated_peak_bytes"], data["reserved_peak_bytes"]
    blocks = data["ledger"]["blocks"]
    # every tensor is a 512-byte block; the allocator holds at least the most of them alive at once
    assert all(b["nbytes"] % 512 == 0 for b in blocks)
    assert alloc >= data["peak_bytes"] > 0
    assert alloc <= sum(b["nbytes"] for b in blocks)
    # segments are 2 MiB (small pool) or 20 MiB / multiples of 2 MiB (large pool)
    assert res >= alloc and res % (2 * MiB) == 0
    assert (
        data["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == "" and data["allocator_settings"]["expandable_segments"] is False
    )
    assert data["cuda_memory"]["source"] == "caching allocator model"
    assert data["cuda_memory"]["fragmentation_bytes"] >= 0
    assert "allocated" in stdout and "reserved" in stdout and "caching allocator model" in stdout
    back = Profile.from_dict(data)
    assert (back.allocated_peak_bytes, back.reserved_peak_bytes) == (alloc, res)


def test_reserved_peak_replays_the_loop_by_default(default_profile):
    """The profile's peaks are the training loop's (replay_training: construction in program
    order, a first step that makes AdamW's state, steady steps until the allocator repeats
    itself), not one step replayed from an empty cache: the JSON says how many steps."""
    from memfit.cuda.allocator import AllocatorSettings
    from memfit.measure.ledger import Ledger
    from memfit.measure.replay import replay_ledger, replay_training

    data, _ = default_profile
    ledger = Ledger.from_dict(data["ledger"])
    run = replay_training(ledger, AllocatorSettings())
    assert data["cuda_memory"]["replayed_steps"] == run.steps >= 2 and run.steady
    assert (data["allocated_peak_bytes"], data["reserved_peak_bytes"]) == (
        run.stats.allocated_peak_bytes,
        run.stats.reserved_peak_bytes,
    )
    # a cuBLAS workspace per thread that ran a matmul, made by the step at its first matmul
    assert len([i for i in ledger.first_use if ledger.blocks[i].category.value == "kernel_workspace"]) == 2
    assert replay_ledger(ledger).reserved_peak_bytes > 0  # the one-step replay is still there, not the default


def test_forward_before_loop_makes_the_forward_workspace_before_the_first_step(fake_cuda, default_profile, tmp_path):
    """StepOptions.forward_before_loop (--forward-before-loop): the program ran the model's
    forward before its loop, so the forward thread's cuBLAS workspace exists before the first
    step: it leaves Ledger.first_use (the replay places it with the program's start) and the
    autograd thread's, first used in backward, stays. The step itself is the same."""
    from memfit.cuda.allocator import AllocatorSettings
    from memfit.measure.ledger import Ledger, Phase
    from memfit.measure.replay import replay_training

    base, _ = default_profile
    done = _profile(fake_cuda, tmp_path, None, "--forward-before-loop")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["step"]["forward_before_loop"] is True and "forward_before_loop" not in base["step"]
    ledger, before = Ledger.from_dict(data["ledger"]), Ledger.from_dict(base["ledger"])
    assert ledger.blocks == before.blocks and ledger.ticks == before.ticks
    workspaces = [i for i in before.first_use if before.blocks[i].category.value == "kernel_workspace"]
    phases = {i: before.ticks[before.first_use[i]].phase for i in workspaces}
    assert sorted(phases.values()) == [Phase.BACKWARD, Phase.FORWARD]
    assert ledger.first_use == {i: t for i, t in before.first_use.items() if phases.get(i) is not Phase.FORWARD}
    run = replay_training(ledger, AllocatorSettings())
    assert (data["allocated_peak_bytes"], data["reserved_peak_bytes"]) == (
        run.stats.allocated_peak_bytes,
        run.stats.reserved_peak_bytes,
    )


HOLDS_SCRIPT = r"""
import json
import memfit  # first: the fake CUDA shim loads before torch
import torch
from torch import nn
from memfit.cuda.allocator import AllocatorSettings
from memfit.measure.replay import replay_training


class BigOutput(nn.Module):  # a 2 MiB output; the forward peaks at a scratch tensor 4x its size
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2048)

    def forward(self, x):
        torch.ones(x.shape[0], 4 * 2048, device=x.device).sum()
        return self.lin(x)


out = {}
for name, step, loss in (("eval", {"inference": True}, lambda o: o[0, 0]), ("train", {}, lambda o: o.sum())):
    for holds in (False, True):
        torch.manual_seed(0)
        p = memfit.profile(
            BigOutput(), torch.randn(256, 4), fake="cuda", loss_fn=loss, step=memfit.StepOptions(holds_output=holds, **step)
        )
        led = p.ledger
        run = replay_training(led, AllocatorSettings())
        out[f"{name} {holds}"] = {
            "allocated": p.allocated_peak_bytes,
            "reserved": p.reserved_peak_bytes,
            "phase": p.peak["phase"],
            "held": [[led.blocks[i].nbytes, led.blocks[j].nbytes] for i, j in led.held_output.items()],
            "steps": p.cuda_memory.replayed_steps,
            "replay": [run.stats.allocated_peak_bytes, run.stats.reserved_peak_bytes, run.steps, run.steady],
        }
print(json.dumps(out))
"""


def test_holds_output_adds_the_held_block_at_a_forward_peak(fake_cuda):
    """StepOptions.holds_output on fake CUDA: the step starts with the previous step's output
    (one 2 MiB block) and frees it as its forward returns. The loop replay places it where the
    program does: absent from the first step, then each step's output in the place the one
    before it is not (by turns: the replay stops when a state repeats, at the third step).
    Evaluation and training alike peak in the forward, higher by exactly that block."""
    done = fake_cuda.script(HOLDS_SCRIPT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("eval", "train"):
        base, held = out[f"{name} False"], out[f"{name} True"]
        assert base["held"] == [] and held["held"] == [[2 * MiB, 2 * MiB]]
        assert base["phase"] == held["phase"] == "forward"
        assert held["allocated"] - base["allocated"] == 2 * MiB, name
        assert held["reserved"] >= base["reserved"]
        assert held["replay"] == [held["allocated"], held["reserved"], held["steps"], True]
        assert held["steps"] == 3 and base["steps"] == 2


def test_expandable_segments_changes_reserved_not_allocated(fake_cuda, default_profile, tmp_path):
    base, _ = default_profile
    done = _profile(fake_cuda, tmp_path, "expandable_segments:True")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["allocator_settings"]["expandable_segments"] is True
    assert data["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert data["peak_bytes"] == base["peak_bytes"] and data["allocated_peak_bytes"] == base["allocated_peak_bytes"]
    # one growing segment per pool, mapped in 20 MiB pages (large) and 2 MiB (small): at this size
    # it rounds up past what the default's separate segments hold (70 MiB -> 72 MiB measured)
    assert data["reserved_peak_bytes"] != base["reserved_peak_bytes"]
    assert data["reserved_peak_bytes"] >= data["allocated_peak_bytes"] and data["reserved_peak_bytes"] % (2 * MiB) == 0


def test_bad_alloc_conf_is_one_line_exit_2(fake_cuda, tmp_path):
    done = _profile(fake_cuda, tmp_path, "expandable_segments:Yes")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "PYTORCH_CUDA_ALLOC_CONF" in lines[0] and "True or False" in lines[0]
    assert not (tmp_path / "p.json").exists()


def test_cpu_profile_has_no_allocator_keys(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "not:a:valid:conf")  # CUDA-only: a CPU step never reads it
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    prof = memfit.profile(model, torch.randn(4, 16))
    data = prof.to_dict(ledger=False)
    assert prof.allocated_peak_bytes is None and prof.reserved_peak_bytes is None
    assert not {"allocated_peak_bytes", "reserved_peak_bytes", "allocator_settings", "cuda_memory"} & data.keys()


def test_the_allocator_settings_are_read_under_either_name(monkeypatch):
    # torch reads PYTORCH_CUDA_ALLOC_CONF or else PYTORCH_ALLOC_CONF (the name torchtitan's
    # run_train.sh sets); different values under both names are refused in one line
    from memfit.cuda.allocator import AllocatorConfigError
    from memfit.measure.profile import allocator_settings_from_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert allocator_settings_from_env().expandable_segments is False
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    generic = allocator_settings_from_env()
    assert generic.expandable_segments is True
    # reports name the variable the process set (the same settings either way)
    assert generic.assignment() == "PYTORCH_ALLOC_CONF=expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cuda = allocator_settings_from_env()
    assert cuda == generic and cuda.assignment() == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    with pytest.raises(AllocatorConfigError, match="PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:128' and PYTORCH_ALLOC_CONF"):
        allocator_settings_from_env()
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert allocator_settings_from_env().max_split_size == 128 * 2**20
