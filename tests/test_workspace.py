"""Kernel workspace: memory a kernel allocates for itself, which no op returns, is measured
on real tensors, kept per kind of op, and taken by later steps (fake ones included)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from torch import nn

import memfit
from memfit import Category
from memfit.measure import workspace


class ChannelsNorm(nn.Module):
    """LayerNorm over the channels of NCHW: its kernel copies the permuted input to a
    contiguous one before normalising, a copy no op returns."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.norm = nn.LayerNorm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x).permute(0, 2, 3, 1)).sum()


@pytest.fixture(autouse=True)
def fresh_table():
    workspace.TABLE.clear()
    yield
    workspace.TABLE.clear()


def _workload():
    torch.manual_seed(0)
    return ChannelsNorm(16), torch.randn(4, 16, 32, 32)


def _scratch(prof: memfit.Profile, op: str) -> list[int]:
    ticks = prof.ledger.ticks
    return [b.nbytes for b in prof.ledger.blocks if b.category is Category.WORKSPACE and ticks[b.born].op == op]


def _blocks(prof: memfit.Profile, category: Category) -> list[tuple]:
    return [(b.nbytes, b.born, b.died, b.phase, b.module) for b in prof.ledger.blocks if b.category is category]


def test_a_kernels_own_copy_is_in_the_ledger():
    model, x = _workload()
    prof = memfit.profile(model, x, loss_fn=lambda out: out)
    # The forward's contiguous copy of the permuted (4, 32, 32, 16) float32 input, exactly.
    assert _scratch(prof, "native_layer_norm") == [x.numel() * 4]
    assert prof.ledger.unmeasured_ops == 0
    assert Category.WORKSPACE.value in prof.breakdown


def test_fake_profile_takes_the_measured_workspace_and_says_when_it_has_none(monkeypatch):
    model, x = _workload()
    # a step too big to probe (every op over the limit): the fake profile has no figures and says so
    monkeypatch.setattr(workspace, "PROBE_LIMIT_BYTES", 0)
    blind = memfit.profile(model, x, loss_fn=lambda out: out, fake=True)
    assert blind.ledger.unmeasured_ops > 0 and not _scratch(blind, "native_layer_norm")
    real = memfit.profile(model, x, loss_fn=lambda out: out)
    fake = memfit.profile(model, x, loss_fn=lambda out: out, fake=True)
    assert fake.ledger.unmeasured_ops == 0
    # The real ledger drops the ticks of ops measured at zero: it is the one a step that knew
    # every figure beforehand records, tick for tick.
    assert len(fake.ledger.ticks) == len(real.ledger.ticks)
    assert _blocks(fake, Category.WORKSPACE) == _blocks(real, Category.WORKSPACE) != []
    assert fake.peak_bytes == real.peak_bytes > blind.peak_bytes
    assert fake.breakdown == real.breakdown


def test_a_fake_profile_probes_what_no_real_step_measured():
    """Nothing measured in this process yet: the fake CPU profile runs each op kind once on
    real zeros and has the real step's workspace, tick for tick (a bf16 matmul's float32
    buffer on a CPU without bf16 instructions was missed this way: 10% of a step's peak)."""
    model, x = _workload()
    workspace.TABLE.clear()
    fake = memfit.profile(model, x, loss_fn=lambda out: out, fake=True)
    assert fake.ledger.unmeasured_ops == 0
    workspace.TABLE.clear()
    real = memfit.profile(model, x, loss_fn=lambda out: out)
    assert _blocks(fake, Category.WORKSPACE) == _blocks(real, Category.WORKSPACE) != []
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown


def test_fake_and_real_ledgers_match_whatever_ran_before_and_whenever_python_collects(monkeypatch):
    # Fake tensors answer C++'s device queries through the dispatcher (prim.device; real ones
    # do not), and a fake step's loss gradient is held by a reference cycle. After other
    # code had run (lightning imported) the fake ledger gained a tick: neither may leave a
    # trace, with Python's collector run at every chance.
    from memfit.measure import recorder

    asked = []
    metadata_only = recorder._metadata_only
    monkeypatch.setattr(recorder, "_metadata_only", lambda func: metadata_only(func) and not asked.append(str(func)))
    model, x = _workload()
    real = memfit.profile(model, x, loss_fn=lambda out: out)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        fake = memfit.profile(model, x, loss_fn=lambda out: out, fake=True)
    finally:
        gc.set_threshold(*threshold)
    assert "prim.device.default" in asked  # the fake step did dispatch them
    assert fake.ledger.ticks == real.ledger.ticks
    assert [(o.module, o.op, o.first, o.end) for o in fake.ledger.ops] == [
        (o.module, o.op, o.first, o.end) for o in real.ledger.ops
    ]
    assert fake.ledger.blocks == real.ledger.blocks


def test_ops_without_workspace_leave_the_ledger_as_it_was(monkeypatch):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(16, 64)
    probed = memfit.profile(model, x)
    assert not any(b.category is Category.WORKSPACE for b in probed.ledger.blocks)
    monkeypatch.setattr(workspace, "PROBED_DEVICES", frozenset())
    unprobed = memfit.profile(model, x)
    assert unprobed.ledger.to_dict() == probed.ledger.to_dict()


def test_signature_keeps_what_scratch_depends_on():
    conv = torch.ops.aten.convolution.default
    x, w = torch.randn(2, 8, 16, 16), torch.randn(8, 1, 3, 3)
    depthwise = workspace.signature(conv, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8), {})
    dense = workspace.signature(conv, (x, torch.randn(8, 8, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {})
    assert depthwise != dense
    # values do not matter, nor a float argument's (a learning rate changes every step)
    assert depthwise == workspace.signature(conv, (x + 1, w * 2, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8), {})
    add = torch.ops.aten.add.Tensor
    assert workspace.signature(add, (x, x), {"alpha": 0.5}) == workspace.signature(add, (x, x), {"alpha": 0.25})
    assert workspace.signature(add, (x, x), {}) != workspace.signature(add, (x, x.mT), {})  # strides matter
    one = torch.randn(2, 8, 1, 1)  # ... but not a size-1 dimension's, which is arbitrary
    assert workspace.signature(add, (one,), {}) == workspace.signature(add, (one.as_strided(one.shape, (8, 1, 8, 8)),), {})


def test_floor_and_largest_figure_kept():
    assert workspace.workspace_bytes(peak=100 + workspace.FLOOR_BYTES, net=100) == workspace.FLOOR_BYTES
    assert workspace.workspace_bytes(peak=112, net=100) == 0  # a wrapped scalar, in the graph's constants
    table = workspace.WorkspaceTable()
    assert table.record(("op",), 8192) == 8192 and table.record(("op",), 4096) == 8192
    assert table.get(("op",)) == 8192 and table.get(("other",)) is None


def test_plan_verifies_with_workspace_and_stays_within_budget():
    # a plan is verified by a recorded step, which measures the workspace too: the verified
    # peak includes the recompute's kernel copies
    from memfit import zoo

    work = zoo.build("convnext", batch_size=2, pixels=64, dims=(16, 32, 48, 64), depths=(1, 1, 2, 1))
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
    assert prof.breakdown[Category.WORKSPACE.value] >= 0 and any(b.category is Category.WORKSPACE for b in prof.ledger.blocks)
    plan = memfit.plan(work.model, work.inputs, 0.5, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), profile=prof)
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_cli_says_when_a_fake_profile_has_no_workspace_figures(capsys, monkeypatch):
    from memfit.cli import main

    monkeypatch.setattr(workspace, "PROBE_LIMIT_BYTES", 0)  # a step too big to probe its ops for real
    args = ["profile", "convnext", "--batch-size", "2", "--size", "pixels=32", "--size", "depths=(1, 1, 1, 1)"]
    assert main([*args, "--device", "fake"]) == 0
    assert "kernel workspace" in " ".join(capsys.readouterr().out.split())
    assert main(args) == 0  # a real profile measures it: no note, and a fake one after it takes its figures
    assert "is not counted" not in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--device", "fake"]) == 0
    assert "is not counted" not in " ".join(capsys.readouterr().out.split())


def test_a_saved_profile_carries_its_workspaces_to_another_process(monkeypatch):
    """A plan made from a profile file in another process verifies on fake copies, which
    run no kernel: the file carries what the real profile measured, and reading it teaches
    this process's table (the other process is stood in for by clearing the table; its
    step too big to probe its ops for real)."""
    monkeypatch.setattr(workspace, "PROBE_LIMIT_BYTES", 0)
    model, x = _workload()
    real = memfit.profile(model, x, loss_fn=lambda out: out)
    saved = real.to_json()
    workspace.TABLE.clear()
    assert memfit.profile(model, x, loss_fn=lambda out: out, fake=True).ledger.unmeasured_ops > 0
    loaded = memfit.Profile.from_dict(json.loads(saved))
    assert loaded.workspaces == real.workspaces and loaded.workspaces
    fake = memfit.profile(model, x, loss_fn=lambda out: out, fake=True)
    assert fake.ledger.unmeasured_ops == 0
    assert _blocks(fake, Category.WORKSPACE) == _blocks(real, Category.WORKSPACE) != []
    assert fake.peak_bytes == real.peak_bytes


def test_probe_measures_an_op_on_fake_tensors_as_a_real_step_does():
    """An op kind no real step ran (a fake step took another path) is run once, for real, on
    zeros of its shapes: the same figure the real step's trace gives, and the table learns it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, x = _workload()
    real = memfit.profile(model, x, loss_fn=lambda out: out)
    measured = _scratch(real, "native_layer_norm")
    workspace.TABLE.clear()
    y = torch.randn(4, 16, 32, 32).permute(0, 2, 3, 1)  # the permuted input LayerNorm copies
    with FakeTensorMode() as mode:
        args = (mode.from_tensor(y), [16], mode.from_tensor(torch.ones(16)), mode.from_tensor(torch.zeros(16)), 1e-5)
        got = workspace.probe(torch.ops.aten.native_layer_norm.default, args, {}, workspace.TABLE)
    assert [got] == measured and got == x.numel() * 4
    assert workspace.TABLE.get(workspace.signature(torch.ops.aten.native_layer_norm.default, args, {})) == got
    # too big to materialise here: left unmeasured, as before
    old, workspace.PROBE_LIMIT_BYTES = workspace.PROBE_LIMIT_BYTES, 1024
    try:
        assert workspace.probe(torch.ops.aten.native_layer_norm.default, args, {}, workspace.TABLE) is None
    finally:
        workspace.PROBE_LIMIT_BYTES = old


class FakeOnlyPath(nn.Module):
    """Takes another path on fake tensors, as transformers does (it builds an explicit
    attention mask there and skips it on real tensors): ops no real step of it ever runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        for block in self.blocks:
            x = x + block(x)
            if is_fake(x):
                x = torch.where(x.abs() >= 0, x, x.flip(0))  # the same values, other ops
        return x.pow(2).mean()


@pytest.mark.parametrize("probe", [True, False])
def test_a_plan_from_a_saved_profile_probes_ops_only_fake_steps_run(monkeypatch, probe):
    from memfit.plan import planner

    torch.manual_seed(0)
    model, x = FakeOnlyPath(), torch.randn(2048, 256)
    saved = memfit.profile(model, x, loss_fn=lambda out: out).to_json()
    workspace.TABLE.clear()  # another process
    loaded = memfit.Profile.from_dict(json.loads(saved))
    monkeypatch.setattr(planner, "_fake_is_faster", lambda prof: not prof.fake)  # this tiny step's ops are small
    real_steps = []
    monkeypatch.setattr(planner.Verifier, "warmed", lambda self, off: real_steps.append(1) or self)
    if not probe:
        monkeypatch.setattr(workspace, "probe", lambda *a: None)
    plan = memfit.plan(model, x, "50%", loss_fn=lambda out: out, profile=loaded)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    # with the probe, the ops only the fake copy runs are measured on their own: no real step
    assert (real_steps == []) is probe


def test_probing_a_random_op_leaves_the_generator_as_it_was():
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    x = torch.randn(64, 64)
    state = torch.random.get_rng_state()
    with FakeTensorMode() as mode:
        args = (mode.from_tensor(x), 0.5, True)
        assert workspace.probe(torch.ops.aten.native_dropout.default, args, {}, workspace.TABLE) is not None
    assert torch.equal(torch.random.get_rng_state(), state)


def test_probe_bounds_what_an_op_returns_and_makes_nothing_to_learn_it(monkeypatch):
    """The probe runs an op for real on a fake step's behalf, so its bound counts the new tensors
    the op returns as well as its inputs: a factory (``zeros``) or an op whose output dwarfs its
    inputs (the whole table's gradient of ``embedding_dense_backward``) is left unmeasured
    instead of allocating its output here. Their sizes come from meta kernels, which allocate
    nothing. An output that is an input (in place) is not counted twice."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.compat import torch_compat

    aten = torch.ops.aten
    monkeypatch.setattr(workspace, "PROBE_LIMIT_BYTES", 2**20)
    with FakeTensorMode() as mode:
        grad = mode.from_tensor(torch.zeros(4, 8))
        ids = mode.from_tensor(torch.zeros(4, dtype=torch.long))
        small = mode.from_tensor(torch.zeros(2**20 // 4 * 3 // 4))  # 0.75 of the bound
        other = mode.from_tensor(torch.zeros(2**20 // 4 * 3 // 4))
    factory = (aten.zeros.default, ([2**20],), {"dtype": torch.float32, "device": torch.device("cpu")})
    table_grad = (aten.embedding_dense_backward.default, (grad, ids, 2**16, -1, False), {})  # 2 MiB out
    with torch_compat.AllocationTrace() as trace, torch.profiler.record_function("sizes"):
        sizes = [workspace._output_bytes(*call) for call in (factory, table_grad)]
    assert sizes == [4 * 2**20, 2**16 * 8 * 4]
    assert trace.peaks("sizes", "cpu").get("sizes", (0, 0))[0] < 2**16  # the 4 MiB and 2 MiB were not made
    assert workspace.probe(*factory, workspace.TABLE) is None
    assert workspace.probe(*table_grad, workspace.TABLE) is None
    assert workspace.probe(aten.add_.Tensor, (small, other), {}, workspace.TABLE) is None  # inputs 1.5x the bound
    assert workspace.probe(aten.mul_.Tensor, (small, 2.0), {}, workspace.TABLE) == 0  # in place: 0.75, not 1.5
    tiny = (aten.zeros.default, ([16],), {"dtype": torch.float32, "device": torch.device("cpu")})
    assert workspace.probe(*tiny, workspace.TABLE) == 0  # a small factory is still measured
