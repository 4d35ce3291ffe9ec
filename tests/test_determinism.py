"""memfit.measure.determinism: a step that is not bitwise equal to itself, memfit or not,
is noted in its profile and plan (JSON and console), and only then."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
from rich.console import Console
from torch import nn

import memfit
from memfit import Plan
from memfit.measure import determinism
from memfit.report.console import render_plan, render_profile


class Positions(nn.Module):
    """A learned position table read by indexing, as Whisper's decoder does
    (``self.weight[position_ids]``): its backward is ``index_put(accumulate=True)``."""

    def __init__(self, positions: int = 512, width: int = 64) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(positions, width) * 0.02)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[position_ids]


class PosNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.pos = Positions(width=width)
        self.fc = nn.Linear(width, width)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pos(position_ids))


# 8 x 128 positions of width 64 gathered: 65536 elements, twice torch's GRAIN_SIZE
IDS = torch.arange(128).expand(8, 128)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def deterministic(on: bool = True, warn_only: bool = False):
    before, before_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


def _model() -> PosNet:
    torch.manual_seed(0)
    return PosNet()


def _distinct(fn, runs: int, enough: int | None = None) -> int:
    """Different results among ``runs`` calls (stopping once ``enough`` were seen)."""
    seen: list[torch.Tensor] = []
    for _ in range(runs):
        out = fn()
        if not any(torch.equal(out, s) for s in seen):
            seen.append(out)
        if enough is not None and len(seen) >= enough:
            break
    return len(seen)


@pytest.mark.timing  # two threads must race: another worker on the other core makes that rare
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the host has one CPU: torch's threads never add concurrently")
def test_index_put_accumulate_really_is_nondeterministic_here():
    """The table's CPU entry, checked on this host: the same call, run again, sums in
    another order; with deterministic algorithms, never. (16 x 512 x 256 gathered elements:
    at Whisper's 4 x 32 x 256 the two threads race less often on a busy host, yet 30 runs of
    16 x 512 x 256 gave 30 different sums here.)"""
    torch.manual_seed(0)
    grad = torch.randn(16, 512, 256)
    ids = torch.arange(512).expand(16, 512)

    def once() -> torch.Tensor:
        return torch.zeros(512, 256).index_put_((ids,), grad, accumulate=True)

    with threads(2):
        assert _distinct(once, 16, enough=2) > 1
        with deterministic():
            assert _distinct(once, 4) == 1


def test_check_follows_torchs_conditions():
    big = torch.zeros(512, 64), (IDS,), torch.randn(8, 128, 64), True
    with threads(2):
        assert determinism.check("index_put", "cpu", big, {}) is not None
        assert determinism.check("index_put", "cpu", (*big[:3], False), {}) is None  # no accumulate
        small = (big[0], (IDS[:2, :64],), torch.randn(2, 64, 64), True)  # 8192 elements
        assert determinism.check("index_put", "cpu", small, {}) is None
        double = (big[0].double(), big[1], big[2].double(), True)  # torch's atomic path is float32's
        assert determinism.check("index_put", "cpu", double, {}) is None
        assert determinism.check("index_put", "cuda", big, {}) is None  # CUDA's accumulate sorts
        with deterministic():
            assert determinism.check("index_put", "cpu", big, {}) is None
    with threads(1):
        assert determinism.check("index_put", "cpu", big, {}) is None
    # a CUDA op with no deterministic kernel stays nondeterministic under warn_only
    grad = torch.zeros(2, 3, 8, 8, 8)
    with deterministic():
        assert determinism.check("avg_pool3d_backward", "cuda", (grad,), {}) is None
    with deterministic(warn_only=True):
        assert determinism.check("avg_pool3d_backward", "cuda", (grad,), {}) is not None
        assert determinism.check("index_add", "cuda", (grad,), {}) is None  # made deterministic
    # a backward index_put is named by the forward x[idx] that made it
    weight, grad = torch.zeros(512, 64), torch.randn(8, 128, 64)
    site = determinism.forward_site("index", (weight, [IDS]))
    assert site is not None and site == determinism.backward_site("index_put", (weight, [IDS], grad, True))
    assert determinism.backward_site("index_put", (weight, [IDS[:, :64]], grad, True)) != site
    for rule in determinism.TABLE:
        assert rule.ops and rule.label and rule.why and rule.device in ("cpu", "cuda")


def test_profile_and_plan_note_the_step():
    with threads(2):
        prof = memfit.profile(_model(), IDS)
    [found] = prof.ledger.nondeterministic
    assert (found.op, found.phase, found.module) == ("index_put_ (accumulate)", "backward", "pos")
    assert "on 2 threads" in found.why
    note = prof.reproducibility_note
    assert note.startswith("this step is not bitwise reproducible even without memfit: index_put_ (accumulate) in pos")
    assert "torch.use_deterministic_algorithms(True)" in note
    data = json.loads(prof.to_json())
    assert data["reproducibility_note"] == note and data["nondeterministic"][0]["module"] == "pos"
    assert memfit.Profile.from_dict(data).reproducibility_note == note
    out = io.StringIO()
    render_profile(prof, Console(file=out, width=200), times=False)
    assert "not bitwise reproducible" in out.getvalue()

    with threads(2):
        plan = memfit.plan(_model(), IDS, 0.5, profile=prof)
    assert plan.reproducibility_note == note
    assert Plan.from_json(plan.to_json()).reproducibility_note == note
    out = io.StringIO()
    render_plan(plan, Console(file=out, width=200), times=False)
    assert "not bitwise reproducible" in out.getvalue()


def test_no_note_with_deterministic_algorithms_or_one_thread():
    with threads(2), deterministic():
        prof = memfit.profile(_model(), IDS)
    assert prof.ledger.nondeterministic == [] and prof.reproducibility_note == ""
    assert "reproducibility_note" not in memfit.plan(_model(), IDS, 0.5, profile=prof).to_dict()
    with threads(1):
        assert memfit.profile(_model(), IDS).reproducibility_note == ""


def test_fake_profile_notes_it_from_shapes():
    with threads(2):
        prof = memfit.profile(_model(), IDS, fake=True)
    assert [f.module for f in prof.ledger.nondeterministic] == ["pos"]
