"""Per-rank fit and max_batch of an FSDP2 step on the fake process group: reshard_after_forward
weighed against the budget on exact per-rank peaks, the reduce dtype only when allowed, the
largest per-rank batch consistent with profile_ranks, and a real two-process gloo run showing
that reshard_after_forward=False trains bitwise as the default."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import gloo_ranks, needs, rank_differences, train_ranks

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)
pytestmark = needs("transformers")  # looked up, not imported: the tests import it when they run

from memfit import Workload  # noqa: E402
from memfit.errors import BudgetError, BudgetInfeasibleError, MemfitError, PlanError  # noqa: E402
from memfit.levers.rank_fit import fit_ranks, max_batch_ranks  # noqa: E402
from memfit.levers.recipe import RankRecipe  # noqa: E402
from memfit.measure.distributed import FSDP2, ddp, profile_ranks  # noqa: E402
from memfit.workload import Parallel  # noqa: E402

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def _llama(layers: int = 2, seq_len: int = 64, batch_size: int = 4, **fsdp: object) -> Workload:
    from memfit import zoo

    work = zoo.build("llama", seq_len=seq_len, batch_size=batch_size, num_hidden_layers=layers, **SIZES)
    if fsdp:
        return _with(work, **fsdp)
    return work


def _with(work: Workload, **settings: object) -> Workload:
    """``work`` with its FSDP2's settings changed (plain data: dataclasses.replace)."""
    assert work.parallel is not None and isinstance(work.parallel.parallelize, FSDP2)
    fsdp = dataclasses.replace(work.parallel.parallelize, **settings)
    return dataclasses.replace(work, parallel=dataclasses.replace(work.parallel, parallelize=fsdp))


def _peak(work: Workload) -> int:
    return profile_ranks(work, world_size=2).peak_bytes


def _as_chosen(work: Workload, recipe: RankRecipe) -> Workload:
    """The workload parallelized with the recipe's fully_shard arguments (the family's shape:
    root, then the last blocks kept unsharded)."""
    assert recipe.fsdp is not None
    blocks = recipe.fsdp["block_reshard_after_forward"]
    kept = blocks.count(False)
    assert blocks == [True] * (len(blocks) - kept) + [False] * kept
    return _with(work, root_reshard_after_forward=recipe.fsdp["root_reshard_after_forward"], keep_last=kept)


def test_fit_keeps_parameters_unsharded_when_the_budget_has_room():
    work = _llama()
    room = _peak(_with(work, reshard_after_forward=False))  # the root and every block kept
    recipe = fit_ranks(work, room, world_size=2)
    assert room > recipe.base_peak_bytes  # keeping every block unsharded costs memory here
    assert recipe.levers == ("reshard_after_forward",) and recipe.plan is None
    assert recipe.fsdp is not None and recipe.fsdp["root_reshard_after_forward"] is False
    assert not any(recipe.fsdp["block_reshard_after_forward"])
    assert recipe.predicted_peak_bytes == room == recipe.rank_peak_bytes[0]
    assert recipe.all_gathers < recipe.base_all_gathers  # backward all-gathers no block again
    assert recipe.predicted_step_time_s < recipe.base_step_time_s
    assert "reshard_after_forward=False)" in recipe.snippet()


def test_fit_keeps_no_more_than_the_budget_holds():
    work = _llama()
    budget = _peak(work)  # the step as it is, exactly: no room beyond what is free at the peak
    # recompute excluded: the choice is reshard_after_forward's alone (with it, a plan that makes
    # room for more unsharded blocks may be predicted faster: the next test)
    recipe = fit_ranks(work, budget, world_size=2, exclude={"recompute": "the script checkpoints nothing"})
    assert recipe.plan is None and recipe.left_out["recompute"] == "the script checkpoints nothing"
    chosen = _as_chosen(work, recipe)
    assert _peak(chosen) == recipe.predicted_peak_bytes <= budget
    # one more block kept unsharded is over the budget: the lever went as far as memory allows
    more = chosen.parallel.parallelize.keep_last + 1
    assert more <= 2, "every block kept within the step's own peak: nothing here tests the budget"
    assert _peak(_with(work, root_reshard_after_forward=False, keep_last=more)) > budget


def test_fit_recomputes_below_the_step_as_it_is():
    work = _llama(layers=1)
    budget = int(_peak(work) * 0.85)
    recipe = fit_ranks(work, budget, world_size=2)
    assert "recompute" in recipe.levers and recipe.plan is not None
    assert max(recipe.plan.rank_peak_bytes.values()) == recipe.predicted_peak_bytes <= budget
    assert _peak(_as_chosen(work, recipe)) > budget  # that configuration needed the plan
    assert "memfit.apply(model, recipe.plan)" in recipe.snippet()


def test_reduce_dtype_only_when_allowed():
    work = _llama(layers=1)
    budget = 2 * _peak(work)
    plain = fit_ranks(work, budget, world_size=2)
    assert "reduce_bf16" not in plain.levers and plain.fsdp["reduce_dtype"] == "float32"
    assert "reduce_bf16" in plain.left_out and "opt in" in plain.left_out["reduce_bf16"]
    assert not any("bfloat16" in row.label for row in plain.what_if)
    allowed = fit_ranks(work, budget, world_size=2, allow="reduce_bf16")
    assert any("reduce in bfloat16" in row.label for row in allowed.what_if)  # weighed
    # within 5% of the fastest exact configuration, a lever that changes the numerics is not taken
    if "reduce_bf16" not in allowed.levers:
        assert allowed.fsdp["reduce_dtype"] == "float32"
    else:
        exact = min(r.predicted_step_time_s for r in allowed.what_if if r.fits and "reduce_bf16" not in r.levers)
        assert allowed.predicted_step_time_s < exact / 1.05


def test_fit_ddp_weighs_recompute_alone():
    work = _llama(layers=1, seq_len=32)
    work = dataclasses.replace(work, parallel=Parallel(ddp, name="ddp"))
    budget = int(_peak(work) * 0.9)
    recipe = fit_ranks(work, budget, world_size=2)
    assert recipe.levers == ("recompute",) and recipe.fsdp is None and recipe.predicted_peak_bytes <= budget
    assert "not memfit's FSDP2" in recipe.left_out["reshard_after_forward"]
    assert "memfit.apply(model, recipe.plan)" in recipe.snippet() and "fully_shard" not in recipe.snippet()


class Net(torch.nn.Module):
    """Blocks whose activations grow with the batch (a plain step: fewer ops than Llama's, so
    the plans at each batch tried stay quick)."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x.square().mean()


def test_max_batch_per_rank_agrees_with_profile_ranks():
    from memfit.levers.rank_fit import _at_batch
    from memfit.measure.distributed import fsdp2

    with torch.device("meta"):
        model = Net()
    work = Workload(model, torch.randn(16, 32), parallel=Parallel(fsdp2(lambda m: m.blocks, param_dtype=None), name="fsdp2"))

    def peak(b: int) -> int:
        return _peak(_at_batch(work, b))

    budget = (peak(20) + peak(21)) // 2
    found = max_batch_ranks(work, budget, world_size=2, multiple_of=4)
    plain = next(lim for lim in found.limits if lim.levers == ())
    assert plain.max_batch == 20 and plain.peak_bytes == peak(20) <= budget < peak(21) <= peak(24)
    recompute = next(lim for lim in found.limits if lim.levers == ("recompute",))
    assert recompute.max_batch > plain.max_batch and recompute.peak_bytes <= budget
    assert found.batch_size == recompute.max_batch and found.world_size == 2
    # the recipe at that batch: recompute, within the budget on the rank
    assert found.recipe is not None and found.recipe.batch_size == found.batch_size
    assert "recompute" in found.recipe.levers and found.recipe.predicted_peak_bytes <= budget


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda w: fit_ranks(w, "1GiB", world_size=2, allow="amp"), PlanError, "per rank"),
        (lambda w: fit_ranks(w, "1GiB", world_size=2, allow="reduce_bf16,8bit"), PlanError, "8bit"),
        (lambda w: fit_ranks(w, "50%", world_size=2), BudgetError, "bytes"),
        (lambda w: fit_ranks(w, "1GiB", world_size=2, ranks=(2,)), MemfitError, "rank 2"),
        (
            lambda w: fit_ranks(
                dataclasses.replace(w, parallel=Parallel(ddp, name="ddp")), "1GiB", world_size=2, allow="reduce_bf16"
            ),
            PlanError,
            "not memfit's FSDP2",
        ),
        (
            lambda w: fit_ranks(_with(w, reduce_dtype=torch.bfloat16), "1GiB", world_size=2, allow="reduce_bf16"),
            PlanError,
            "already",
        ),
        (lambda w: max_batch_ranks(w, "1GiB", world_size=2, multiple_of=0), MemfitError, "multiple_of"),
        (lambda w: fit_ranks(w, 1000, world_size=2, exclude={"recompute": "none"}), BudgetInfeasibleError, "lowest peak"),
        (lambda w: fit_ranks(w, "1GiB", world_size=2, exclude={"amp": "no"}), PlanError, "can exclude"),
    ],
)
def test_bad_input(call, error, words):
    with pytest.raises(error, match=words) as info:
        call(_llama(layers=1, seq_len=16, batch_size=2))
    assert "\n" not in str(info.value)


TINY = ["--size", "num_hidden_layers=1", "--size", "hidden_size=64", "--size", "intermediate_size=128"]
TINY += ["--size", "num_attention_heads=4", "--size", "vocab_size=256", "--size", "seq_len=16", "--batch-size", "2"]


def test_cli_fit_world_size(tmp_path, capsys):
    from memfit.cli import main

    out = tmp_path / "r.json"
    assert main(["fit", "llama", *TINY, "--world-size", "2", "--device", "fake", "--budget", "1GiB", "--json", str(out)]) == 0
    recipe = RankRecipe.from_json(out.read_text())
    assert recipe.world_size == 2 and recipe.predicted_peak_bytes <= recipe.budget_bytes
    assert RankRecipe.from_json(recipe.to_json()) == recipe
    text = capsys.readouterr().out
    assert "fully_shard(model, mesh=mesh" in text and "per rank" in text
    for argv, words in [
        (["--world-size", "2", "--budget", "1GiB"], "--device fake"),
        (["--device", "fake", "--budget", "1GiB"], "--world-size"),
        (["--world-size", "2", "--device", "fake", "--budget", "1GiB", "--allow", "amp"], "per rank"),
        (["--world-size", "2", "--device", "fake", "--budget", "1GiB", "--keep-grads"], "--keep-grads"),
        (["--world-size", "2", "--device", "fake", "--budget", "50%"], "bytes"),
    ]:
        assert main(["fit", "llama", *TINY, *argv]) == 2
        assert words in capsys.readouterr().err


# -- against a real two-process gloo run -----------------------------------------------------------


def _real_rank(rank: int, world_size: int) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    work = _llama(layers=2, seq_len=16, batch_size=2)  # built on the CPU: the same weights on both ranks
    default = work.parallel.parallelize
    kept = dataclasses.replace(default, reshard_after_forward=False)  # root and every block keep theirs
    torch.manual_seed(100 + rank)  # each rank its own batches
    batches = [torch.randint(0, SIZES["vocab_size"], (2, 16)) for _ in range(3)]

    def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    ref, got = (train_ranks(fsdp(copy.deepcopy(work.model), mesh), batches, loss_of) for fsdp in (default, kept))
    return {**rank_differences(got, ref), "params": len(ref[2])}


def test_reshard_after_forward_false_trains_bitwise_as_the_default():
    for r, got in enumerate(gloo_ranks(_real_rank, 2)):
        assert got["params"] > 0 and got["losses_equal"], f"rank {r}: {got}"
        assert got["grads_differ"] == [] and got["params_differ"] == [], f"rank {r}: {got}"


def test_max_batch_ranks_never_answers_a_batch_without_its_recipe(monkeypatch):
    """The lowest peaks said a batch fits, but no recipe verified on every rank fits it or
    the two below: refused in one line, as memfit.max_batch does (not a batch with no recipe)."""
    from memfit.levers import rank_fit

    def never(*args, **kwargs):
        raise BudgetInfeasibleError("no recipe", min_peak_bytes=1, budget_bytes=0)

    from memfit.measure.distributed import fsdp2

    monkeypatch.setattr(rank_fit, "fit_ranks", never)
    # Net, not Llama: the search's lowest peaks are plans at each batch tried, and what is
    # refused does not depend on the model (a third of Llama's CPU seconds)
    with torch.device("meta"):
        model = Net()
    work = Workload(model, torch.randn(16, 32), parallel=Parallel(fsdp2(lambda m: m.blocks, param_dtype=None), name="fsdp2"))
    budget = _peak(rank_fit._at_batch(work, 6))  # batch 6 fits as it is
    with pytest.raises(BudgetInfeasibleError, match="or the two below it") as info:
        max_batch_ranks(work, budget, world_size=2, multiple_of=2)
    assert "\n" not in str(info.value)
