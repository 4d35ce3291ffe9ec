"""One fake copy of a step recorded many times (``memfit.measure.profile.FakeSession``), and
its light warm-up: the optimizer's state made without a forward and backward, checked against
what a warm-up step leaves (issue 27: ``memfit finetune`` under 30 s for a 7-8B config)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measure import profile as profile_module
from memfit.measure.checked import checked_step
from memfit.measure.profile import fake_session, light_warm_up_held, live_fake_storages, profile_step
from memfit.measure.step import StepOptions, first_micro_batches
from memfit.workload import resize_batch


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


class _Unused(nn.Module):
    """A trainable parameter the forward never uses: a warm-up step gives it no gradient, so
    AdamW makes no state for it; a light warm-up would."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.spare = nn.Parameter(torch.zeros(64, 64))

    def forward(self, x):
        return self.lin(x)


class _MakesStateOnFirstCall(nn.Module):
    """A buffer made by the first forward and kept: the warm-up step makes it, a light warm-up does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.ones(128, 16, device=x.device)
        return self.lin(x) + self.table[: x.shape[0]]


class _Frozen(nn.Module):
    """A frozen base and a small trainable head, as a LoRA model is."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 64).requires_grad_(False)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


def _rows(prof) -> list[tuple]:
    return [(b.nbytes, b.category, b.phase, b.module, b.born, b.died) for b in prof.ledger.blocks]


def _step(model: nn.Module, x: torch.Tensor, options: StepOptions | None = None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return checked_step(model, (x,), optimizer=opt, loss_fn=lambda out: out.sum(), fake=True, options=options)


@pytest.mark.parametrize(
    "make, light_holds",
    [(_mlp, True), (_Frozen, True), (_Unused, False), (_MakesStateOnFirstCall, False)],
)
def test_light_warm_up_profile_is_the_warm_up_steps(monkeypatch, make, light_holds):
    """The profile after a light warm-up is, block by block, the one after a warm-up step;
    where the light one cannot be shown to be the same (a parameter the backward never
    reaches, state the first forward makes), the answer is a fresh profile's."""
    checks: list[bool] = []
    original = profile_module.light_warm_up_held
    monkeypatch.setattr(profile_module, "light_warm_up_held", lambda *a: checks.append(original(*a)) or checks[-1])
    torch.manual_seed(0)
    model = make()
    x = torch.randn(8, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = profile_step(_step(model, x))
    light = profile_step(_step(model, x), light=True)
    assert checks == [light_holds]
    assert _rows(light) == _rows(full) and light.breakdown == full.breakdown
    assert light.modules.keys() == full.modules.keys() and light.step_flops == full.step_flops
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_light_warm_up_check_can_fail():
    """The check itself: other parameters with gradients, or a fake storage alive after the
    step that was not before it, is not the warm-up step's; garbage is collected first."""
    torch.manual_seed(0)
    model = _mlp()
    params = list(model.parameters())
    with FakeTensorMode() as mode:
        kept = torch.zeros(4)
        before = live_fake_storages(mode)
        cycle: list = [torch.zeros(8)]
        cycle.append(cycle)  # garbage, held by a reference cycle only
        del cycle
        assert light_warm_up_held(params, params, before, live_fake_storages(mode))
        assert not light_warm_up_held(params, params[:-1], before, live_fake_storages(mode))
        made = torch.zeros(16)
        assert not light_warm_up_held(params, params, before, live_fake_storages(mode))
    del kept, made


def test_one_session_answers_as_fresh_profiles():
    """A session's profile, its peaks at other batches and at other micro-batch counts (of 4,
    the first three run) are what fresh fake profiles say."""
    torch.manual_seed(0)
    model = _Frozen()
    x = torch.randn(8, 16)
    with fake_session(_step(model, x), light=True) as session:
        prof = session.profile()
        assert _rows(prof) == _rows(profile_step(_step(model, x)))
        for b in (16, 3):
            xb = resize_batch((x,), b)
            assert session.peak(xb) == profile_step(_step(model, xb[0])).budget_peak_bytes
        with first_micro_batches(3):
            for k in (2, 4):
                fresh = profile_step(_step(model, x, StepOptions(micro_batches=k))).budget_peak_bytes
                assert session.peak(micro_batches=k) == fresh


class _ReplacesBufferStorage(nn.Module):
    """The first forward gives a buffer a storage of its own (``.data =``): a tensor older than
    the step, holding a storage made in it. The warm-up step makes it, a light warm-up does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("buf", torch.zeros(1))

    def forward(self, x):
        if self.buf.numel() == 1:
            self.buf.data = torch.zeros(256, device=x.device)
        return self.lin(x) + self.buf[:1]


_OTHER_MODE: list = []
_KEPT: list = []


class _KeepsAnotherModesTensor(nn.Module):
    """The first forward keeps a fake tensor of another FakeTensorMode than the session's:
    not the session's state, left out of its check."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        from memfit.compat.torch_compat import no_dispatch_modes

        if not _KEPT:
            with no_dispatch_modes():
                _OTHER_MODE[:] = _OTHER_MODE or [FakeTensorMode()]
                _KEPT.append(_OTHER_MODE[0].from_tensor(torch.zeros(512)))
        return self.lin(x)


def _light_findings(monkeypatch, make, *, freeze: bool) -> tuple[list[bool], list[list[int]], list[int]]:
    """A light profile of ``make()``: the check's answers, each scan's fake storages (their
    sizes) and how many objects the collector tracked at each scan."""
    checks: list[bool] = []
    found: list[list[int]] = []
    tracked: list[int] = []
    held, scan = profile_module.light_warm_up_held, profile_module.live_fake_storages

    def counted(mode):
        got = scan(mode)
        found.append(sorted(s.nbytes() for s in got.values()))
        tracked.append(len(gc.get_objects()))
        return got

    monkeypatch.setattr(profile_module, "light_warm_up_held", lambda *a: checks.append(held(*a)) or checks[-1])
    monkeypatch.setattr(profile_module, "live_fake_storages", counted)
    if not freeze:
        monkeypatch.setattr(profile_module, "older_objects_frozen", contextlib.nullcontext)
    _KEPT.clear()
    torch.manual_seed(0)
    profile_step(_step(make(), torch.randn(8, 16)), light=True)
    monkeypatch.undo()
    return checks, found, tracked


def test_a_light_sessions_scan_leaves_out_older_objects_and_finds_what_the_whole_heap_scan_found(monkeypatch):
    """With nothing frozen, a light session freezes what exists when it begins, so its checks
    scan only what was made since, and finds the same fake storages as scanning every object:
    state a first forward makes (a new tensor, or a new storage under a buffer made before the
    step) still fails the check, another FakeTensorMode's tensor kept by the step does not.
    The freeze is undone after; a freeze made before the session is left as it was."""
    gc.unfreeze()  # the tests' set-up froze what existed (conftest): here nothing is
    cases = [(_mlp, True), (_MakesStateOnFirstCall, False), (_ReplacesBufferStorage, False), (_KeepsAnotherModesTensor, True)]
    for make, holds in cases:
        whole = _light_findings(monkeypatch, make, freeze=False)
        assert gc.get_freeze_count() == 0
        frozen = _light_findings(monkeypatch, make, freeze=True)
        assert gc.get_freeze_count() == 0  # undone
        assert frozen[0] == whole[0] == [holds], make
        assert frozen[1] == whole[1] and len(frozen[1]) == 2, make
        assert max(frozen[2]) * 5 < min(whole[2]), (make, frozen[2], whole[2])
    assert _KEPT and _KEPT[0].fake_mode is _OTHER_MODE[0]
    gc.freeze()
    assert _light_findings(monkeypatch, _MakesStateOnFirstCall, freeze=True)[0] == [False]
    assert gc.get_freeze_count() > 0  # someone else's freeze: left to them, not undone
