"""Cuts in a distributed plan's work that must leave its answer as it was: the planned rank's
recorded step is the stateful check's second forward (no forward of its own), checked against
the plan made from an unplanned profile recorded on its own (the check then runs its own
forward), to the byte of the plan's JSON but its timing."""

from __future__ import annotations

import json

import pytest

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

from memfit import zoo  # noqa: E402
from memfit.measure.distributed import profile_ranks  # noqa: E402
from memfit.plan.distributed import plan_ranks  # noqa: E402

# two layers: the folded and the separate plan are the same search at any depth, and each
# rank's profile and plan cost per op (three took half as long again)
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _json(plan) -> str:  # type: ignore[no-untyped-def]
    out = plan.to_dict()
    out.pop("planning_time_s")
    return json.dumps(out, sort_keys=True)


@pytest.mark.parametrize("parallel, world_size", [("fsdp2", 2), ("tp", 2)])
def test_the_recorded_step_as_the_checks_forward_plans_as_a_profile_of_its_own(parallel, world_size):
    work = zoo.build("llama", vocab_size=256, seq_len=64, batch_size=2, parallel=parallel, attn_implementation="eager", **SIZES)
    unplanned = profile_ranks(work, world_size=world_size)
    budget = unplanned.peak_bytes * 9 // 10
    folded = plan_ranks(work, budget, world_size=world_size)
    apart = plan_ranks(work, budget, world_size=world_size, unplanned=unplanned)
    assert folded.checkpointed and folded.predicted_peak_bytes <= budget
    assert _json(folded) == _json(apart)
