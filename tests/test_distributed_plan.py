"""Plans per rank of a distributed step (FSDP2, DDP) made on the fake process group: the plan applied
before fully_shard or DistributedDataParallel trains bitwise as the unplanned step on real gloo
ranks, and each rank's recorded peak is the planned figure, within the budget; the smallest world
size that fits."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import gloo_ranks, rank_differences, settled, train_ranks
from torch import nn

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

import memfit  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.measure.distributed import CURRENT_GROUP, ddp, fsdp2, profile_rank, profile_ranks, without_backend_buffers  # noqa: E402
from memfit.plan.distributed import min_world_size, plan_ranks  # noqa: E402
from memfit.recompute.checkpoint import applied_choices  # noqa: E402
from memfit.workload import Parallel, Workload  # noqa: E402

WIDTH, DEPTH, BATCH = 64, 4, 128


class Net(nn.Module):
    """Blocks whose activations outweigh their parameters, so that recompute matters per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(DEPTH)
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).square().mean()


PARALLEL = Parallel(fsdp2(lambda m: m.blocks, param_dtype=None, reduce_dtype=None), name="fsdp2")


def _workload(width: int = WIDTH, parallel: Parallel = PARALLEL) -> Workload:
    with torch.device("meta"):
        model = Net()
    return Workload(model, torch.randn(BATCH, WIDTH), parallel=parallel)


def _rank(rank: int, world_size: int, plan_json: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    plan = memfit.Plan.from_json(plan_json)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = Net()
    reference = PARALLEL.parallelize(copy.deepcopy(base), mesh)
    planned = copy.deepcopy(base)
    memfit.apply(planned, plan)  # before fully_shard, as plan_ranks verified it
    planned = PARALLEL.parallelize(planned, mesh)
    torch.manual_seed(100 + rank)  # each rank its own batches
    xs = [torch.randn(BATCH, WIDTH) for _ in range(3)]
    ref = train_ranks(reference, xs, lambda m, x: m(x))
    got = train_ranks(planned, xs, lambda m, x: m(x))
    # the planned step's memory on this real rank, recorded (gloo's own copies left out)
    work = _workload()
    memfit.apply(work.model, plan)
    ledger = without_backend_buffers(profile_rank(work, CURRENT_GROUP).ledger)
    result = {**rank_differences(got, ref), "peak_bytes": ledger.peak_bytes}
    return result


def _gloo_run(fn, plan: memfit.Plan) -> list[dict]:  # type: ignore[no-untyped-def]
    """What ``fn`` returned on each rank of real two-process gloo runs given ``plan``: each
    rank's lowest recorded peak of up to three runs, against the plan's figure for it (conftest.settled)."""
    predicted = [plan.rank_peak_bytes[r] for r in range(2)]
    return settled(lambda: gloo_ranks(fn, 2, plan.to_json()), lambda got: got["peak_bytes"], predicted)


@pytest.fixture(scope="module")
def fsdp_plan() -> memfit.Plan:
    """The toy's FSDP2 plan at 50% for both of 2 ranks (shared: two tests check it)."""
    return plan_ranks(_workload(), "50%", world_size=2, ranks=(0, 1))


def test_plan_under_fully_shard_trains_bitwise_and_each_rank_fits(fsdp_plan):
    plan = fsdp_plan
    assert plan.checkpointed and plan.world_size == 2
    assert set(plan.rank_peak_bytes) == {0, 1}
    assert max(plan.rank_peak_bytes.values()) <= plan.budget_bytes < plan.none_peak_bytes
    results = _gloo_run(_rank, plan)
    for r, got in enumerate(results):
        assert got["losses_equal"], f"rank {r}: losses differ"
        assert got["grads_differ"] == [] and got["params_differ"] == [], f"rank {r}: {got}"
        assert got["peak_bytes"] == plan.rank_peak_bytes[r] <= plan.budget_bytes


def test_min_world_size_with_and_without_recompute():
    work = _workload()
    budget = profile_ranks(work, world_size=4).peak_bytes
    # a budget the unplanned step meets at 4 ranks, not at 2 (parameters, gradients and AdamW
    # state shrink with ranks; activations do not); recompute brings it within at fewer
    found = min_world_size(work, budget, max_world_size=8)
    assert [row["world_size"] for row in found.rows] == [1, 2, 4]
    peaks = [row["none_peak_bytes"] for row in found.rows]
    assert peaks[0] > peaks[1] > peaks[2] == budget
    assert found.without_recompute == 4
    assert found.with_recompute is not None and found.with_recompute < 4
    assert found.plan is not None and max(found.plan.rank_peak_bytes.values()) <= budget
    # the workload's model is left as it was: unplanned, on meta, unsharded
    assert applied_choices(work.model) is None
    assert type(work.model) is Net and next(work.model.parameters()).device.type == "meta"
    # a budget nothing reaches up to 2 ranks: no answer, said as None
    none = min_world_size(work, 1000, max_world_size=1)
    assert none.without_recompute is None and none.with_recompute is None
    # (the parameters alone exceed it: that size is not profiled)
    assert none.rows[-1]["skipped"] == "profile" and none.rows[-1]["lower_bound_bytes"] > 1000


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: plan_ranks(_workload(), "50%", world_size=2, objective="speed"), "objective must be one of"),
        (lambda: plan_ranks(_workload(), "50%", world_size=2, ranks=(2,)), "rank 2"),
        (lambda: plan_ranks(Workload(Net(), torch.randn(2, WIDTH)), "50%", world_size=2), "parallelized"),
        (lambda: min_world_size(_workload(), "50%"), "fraction"),
    ],
)
def test_bad_input(call, words):
    with pytest.raises(MemfitError, match=words):
        call()


# -- DDP: the plan applied before wrapping in DistributedDataParallel ----------------------------

# DDP's own options that change how its reducer meets a checkpointed step's backward (planned
# without them: the fake group cannot run them)
DDP = {
    name: Parallel(functools.partial(ddp, **options), name="ddp")
    for name, options in {
        "plain": {},
        "find_unused_parameters": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True},
    }.items()
}


def _ddp_rank(rank: int, world_size: int, plan_json: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    plan = memfit.Plan.from_json(plan_json)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = Net()
    torch.manual_seed(100 + rank)  # each rank its own batches
    xs = [torch.randn(BATCH, WIDTH) for _ in range(3)]
    result: dict = {}
    for variant, parallel in DDP.items():
        parallelize = parallel.parallelize
        reference = parallelize(copy.deepcopy(base), mesh)
        planned = copy.deepcopy(base)
        memfit.apply(planned, plan)  # before wrapping in DDP, as plan_ranks verified it
        planned = parallelize(planned, mesh)
        ref, got = train_ranks(reference, xs, lambda m, x: m(x)), train_ranks(planned, xs, lambda m, x: m(x))
        result[variant] = rank_differences(got, ref)
    # the planned step's memory on this real rank, recorded (gloo's own copies left out)
    work = _workload(parallel=DDP["plain"])
    memfit.apply(work.model, plan)
    result["peak_bytes"] = without_backend_buffers(profile_rank(work, CURRENT_GROUP).ledger).peak_bytes
    return result


def test_ddp_plan_trains_bitwise_and_each_rank_fits():
    work = _workload(parallel=DDP["plain"])
    plan = plan_ranks(work, "50%", world_size=2, ranks=(0, 1))
    assert plan.checkpointed and plan.world_size == 2
    assert all(name.startswith("blocks.") for name in plan.checkpointed)  # the unwrapped model's names
    assert max(plan.rank_peak_bytes.values()) <= plan.budget_bytes < plan.none_peak_bytes
    assert applied_choices(work.model) is None and type(work.model) is Net  # left as it was
    for r, got in enumerate(_gloo_run(_ddp_rank, plan)):
        for variant in DDP:  # under each of DDP's reducer options, the plan trains bitwise alike
            same = got[variant]
            assert same["losses_equal"] and same["grads_differ"] == [] and same["params_differ"] == [], (r, variant, same)
        assert got["peak_bytes"] == plan.rank_peak_bytes[r] <= plan.budget_bytes


@pytest.mark.parametrize("variant", ["find_unused_parameters", "static_graph"])
def test_ddp_reducer_options_refused_on_the_fake_group(variant):
    with pytest.raises(MemfitError, match=f"{variant}=True is not measured on the fake process group") as info:
        plan_ranks(_workload(parallel=DDP[variant]), "50%", world_size=2)
    assert "\n" not in str(info.value)


def test_cli_plan_world_size(tmp_path, capsys):
    from memfit.cli import main

    out = tmp_path / "p.json"
    argv = ["plan", "llama", "--size", "num_hidden_layers=1", "--size", "hidden_size=64", "--size", "intermediate_size=128"]
    argv += ["--size", "num_attention_heads=4", "--size", "vocab_size=256", "--size", "seq_len=64", "--batch-size", "2"]
    assert main([*argv, "--world-size", "2", "--device", "fake", "--budget", "50%", "--json", str(out)]) == 0
    plan = memfit.Plan.from_json(out.read_text())
    assert plan.world_size == 2 and plan.rank_peak_bytes[0] <= plan.budget_bytes
    assert "per rank of 2" in capsys.readouterr().out
    assert main([*argv, "--world-size", "2", "--budget", "50%"]) == 2  # not on the fake group
    assert "--device fake" in capsys.readouterr().err
    assert main([*argv, "--max-world-size", "8", "--device", "fake", "--budget", "1GiB"]) == 2
    assert "--min-world-size" in capsys.readouterr().err
    assert main([*argv, "--min-world-size", "--device", "fake", "--budget", "50%"]) == 2
    assert "fraction" in capsys.readouterr().err


def test_fsdp2_state_is_found_where_the_adapter_looks():
    # the stateful check skips FSDP2's state (changed by its hooks, never by a recompute) by the
    # keys torch's composable contract stores it under: a torch that moves it fails here
    from memfit.compat import torch_compat as _torch_compat
    from memfit.measure.distributed import FakeGroup, rank_sandbox

    with rank_sandbox(_workload(), FakeGroup(2, 0)) as box:
        keys = _torch_compat.composable_state_keys()
        assert keys and any(k in keys for k in vars(box.model.blocks[0]))



def test_planned_rank_figure_is_its_fresh_profile(fsdp_plan):
    """plan_ranks takes the planned rank's figure from the run that verified the plan on its open
    step (the plan applied after parallelizing); the old path profiled that rank afresh with the
    plan applied before parallelizing (afresh=True). The same plan and figures, to the byte."""
    fast = fsdp_plan
    old = plan_ranks(_workload(), "50%", world_size=2, ranks=(0, 1), afresh=True)
    got, want = fast.to_dict(), old.to_dict()
    got.pop("planning_time_s"), want.pop("planning_time_s")
    assert fast.checkpointed and set(fast.rank_peak_bytes) == {0, 1}
    assert got == want
