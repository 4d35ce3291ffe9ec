"""What ``memfit.profile``, ``plan``, ``fit`` and ``max_batch`` hand the per-rank functions
(``api.World.per_rank``: one place for what all four pass): the world's size and asked-for
ranks, the progress callback, fake tensors on the CPU unless fake CUDA is asked, and each
question's own arguments, nothing else."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import memfit
from memfit import api
from memfit.workload import Where


def _workload() -> memfit.Workload:
    parallel = memfit.Parallel(lambda model, mesh: model, world_size=4, name="none")
    return memfit.Workload(nn.Linear(4, 4), torch.randn(2, 4), parallel=parallel)


@pytest.mark.parametrize("fake, where", [(False, Where.FAKE), (True, Where.FAKE), ("cuda", Where.FAKE_CUDA)])
def test_each_question_hands_the_per_rank_function_the_world_and_its_own_arguments(monkeypatch, fake, where):
    calls: dict[str, tuple] = {}

    def stand_in(name, result):
        def run(work, *args, **kwargs):
            calls[name] = (work, args, kwargs)
            return result
        return run

    answer = types.SimpleNamespace(recipe=None, plan=None)
    for name in ("profile_ranks", "plan_ranks", "fit_ranks", "max_batch_ranks"):
        monkeypatch.setattr(api, name, stand_in(name, answer))
    work, progress = _workload(), (lambda desc, done, total: None)
    world = dict(world_size=4, ranks=(1, 3), progress=progress, fake=where)
    memfit.profile(work, fake=fake, progress=progress, ranks=[1, 3], gpu="A100-80GB", capacity="1GiB")
    assert calls["profile_ranks"][1:] == ((), {**world, "gpu": "A100-80GB", "capacity": "1GiB"})
    memfit.plan(work, budget="1GiB", fake=fake, progress=progress, ranks=[1, 3], objective="memory")
    assert calls["plan_ranks"][1:] == (("1GiB",), {**world, "objective": "memory"})
    memfit.fit(work, budget="1GiB", fake=fake, progress=progress, ranks=[1, 3], allow="bf16", exclude={"a": "b"})
    assert calls["fit_ranks"][1:] == (("1GiB",), {**world, "allow": "bf16", "exclude": {"a": "b"}})
    memfit.max_batch(work, budget="1GiB", fake=fake, progress=progress, ranks=[1, 3], multiple_of=8, allow="bf16")
    assert calls["max_batch_ranks"][1:] == (("1GiB",), {**world, "multiple_of": 8, "allow": "bf16"})
    assert all(call[0] is work for call in calls.values())  # the Workload as given (it carries its Parallel)
