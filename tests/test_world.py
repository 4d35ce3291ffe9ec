"""One entry per question (issue 25, ranks as a dimension): ``memfit.profile``, ``plan``,
``fit`` and ``max_batch`` answer for one device, a world of one, or for ranks of a parallel
step given as ``parallel=`` or a Workload carrying one, with the answers the per-rank
functions give, to the byte; what one form does not take is refused in one line."""

from __future__ import annotations

import json
import types

import pytest
import torch
from conftest import needs_fake_collectives
from torch import nn

import memfit
from memfit.measure.distributed import fsdp2, profile_ranks
from memfit.plan.distributed import plan_ranks

WIDTH, DEPTH, BATCH = 32, 3, 64


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _parallel(world_size: int | None = 2) -> memfit.Parallel:
    return memfit.Parallel(fsdp2(lambda m: m.blocks, param_dtype=None, reduce_dtype=None), world_size=world_size, name="fsdp2")


def _on_shards(params) -> torch.optim.Optimizer:
    """An optimizer factory that, like torchtitan's, can only be made over a rank's materialised shards."""
    params = list(params)
    if any(p.is_meta for p in params):
        raise memfit.WorkloadError("made over the model on meta: the optimizer is made per rank only")
    return torch.optim.AdamW(params)


def _workload() -> memfit.Workload:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Blocks()
    return memfit.Workload(model, torch.randn(BATCH, WIDTH), optimizer=_on_shards, parallel=_parallel())


def _timeless(data):
    """JSON without the seconds a search took (nested plans' too)."""
    if isinstance(data, dict):
        return {k: _timeless(v) for k, v in data.items() if not k.endswith("time_s")}
    return [_timeless(v) for v in data] if isinstance(data, list) else data


def test_profile_per_rank_is_profile_ranks_in_both_forms():
    work = _workload()
    expected = profile_ranks(work, world_size=2, ranks=(0, 1))
    assert memfit.profile(work, ranks="all", fake=True).to_json() == expected.to_json()
    # the loose parts and parallel=: the same step, the same figures; a real-tensor default means fake ones per rank
    loose = memfit.profile(work.model, work.inputs, optimizer=_on_shards, parallel=_parallel(None), world_size=2, ranks=[1])
    assert isinstance(loose, type(expected)) and sorted(loose.profiles) == [1]
    assert loose.profiles[1].to_json() == expected.profiles[1].to_json()


@needs_fake_collectives()
def test_plan_per_rank_is_plan_ranks():
    work = _workload()
    plan = memfit.plan(work, budget="50%")
    assert plan.world_size == 2 and plan.checkpointed
    assert _timeless(plan.to_dict()) == _timeless(plan_ranks(work, "50%").to_dict())


@pytest.mark.parametrize("question", ["fit", "max_batch"])
def test_fit_and_max_batch_per_rank_hand_the_rank_functions_the_world(question, monkeypatch):
    """The dispatch only (the rank functions' answers are tests/test_distributed_fit.py's):
    the workload, its world and every option reach them as given, the budget as bytes."""
    from memfit import api

    seen = []
    answer = types.SimpleNamespace(recipe=None, plan=None)  # what the rank function returned, handed back as it is
    monkeypatch.setattr(api, f"{question}_ranks", lambda *a, **k: seen.append((a, k)) or answer)
    work = _workload()
    extra = {"multiple_of": 4} if question == "max_batch" else {"exclude": {"recompute": "no"}}
    got = getattr(memfit, question)(work, budget="1MiB", ranks=[1], allow="reduce_bf16", fake=True, **extra)
    assert got is answer
    ((args, kwargs),) = seen
    assert args == (work, "1MiB")
    assert kwargs == {
        "world_size": 2,
        "ranks": (1,),
        "allow": "reduce_bf16",
        "progress": None,
        "fake": memfit.Where.FAKE,
        **extra,
    }


def test_a_single_device_workload_is_the_loose_step():
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(BATCH, WIDTH)
    work = memfit.Workload(model, x)
    a = memfit.profile(work, fake=True)
    b = memfit.profile(model, x, fake=True)
    assert isinstance(a, memfit.Profile)
    assert json.loads(a.to_json())["peak_bytes"] == json.loads(b.to_json())["peak_bytes"]
    assert a.ledger.breakdown() == b.ledger.breakdown()
    # a world of one, said so: the same single-device answer
    assert memfit.profile(work, fake=True, world_size=1, ranks="all").peak_bytes == a.peak_bytes


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x, w: memfit.profile(m, x, world_size=2), "give parallel=memfit.Parallel"),
        (lambda m, x, w: memfit.profile(m, x, ranks=[1]), "give parallel=memfit.Parallel"),
        (lambda m, x, w: memfit.profile(w, x), "a memfit.Workload carries its inputs"),
        (lambda m, x, w: memfit.profile(w, loss_fn=lambda o: o), "drop loss_fn="),
        (lambda m, x, w: memfit.profile(m), "no inputs given"),
        (lambda m, x, w: memfit.plan(m, x), "budget must be bytes"),
        (
            lambda m, x, w: memfit.profile(m, x, parallel=_parallel(), optimizer=torch.optim.SGD(m.parameters(), lr=0.1)),
            "give optimizer=None",
        ),
        (lambda m, x, w: memfit.profile(w, step=memfit.StepOptions(micro_batches=2)), "step= is not modelled yet"),
        (lambda m, x, w: memfit.fit(w, budget="1GiB", set_to_none=False), "set_to_none= is not modelled yet"),
        (lambda m, x, w: memfit.profile(w, ranks=[2]), "ranks: 2 is not a rank of a world of 2"),
    ],
)
def test_what_one_form_does_not_take_is_one_line(call, message):
    work = _workload()
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(BATCH, WIDTH)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(memfit.MemfitError, match=message) as info:
        call(model, x, work)
    assert "\n" not in str(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(rng, torch.get_rng_state())
