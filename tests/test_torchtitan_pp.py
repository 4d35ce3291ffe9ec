"""torchtitan's own pipeline parallelism (issue 26 items 2 and 5): ``torchtitan:llama3:llama3_debugmodel``
with ``parallelism.pipeline_parallel_degree=2``, built by torchtitan's ``pipeline_llm`` (its split, its
stages, its schedule) and stepped as its ``pp_forward_backward_step``, on the fake process group.

Each stage rank's ledger is that stage's: its layers' parameters only, the last stage the norm, the
head and the loss; its receive buffers one microbatch each; under pp x FSDP the stage's parameters
sharded over the stage's FSDP group. Checked against real gloo runs of the same job (2 ranks: pp 2;
4 ranks: pp 2 x FSDP 2; every block, its size and category, each stage's peak), and the schedules against theory (GPipe holds
every microbatch's activations, 1F1B at most pp - stage of them). Skips without torchtitan."""

from __future__ import annotations

import json

import pytest
from conftest import gloo_ranks, most_alive, skip_without_torchtitans_torch

import memfit
from memfit.errors import MemfitError
from memfit.measure.distributed import CURRENT_GROUP, profile_rank, profile_ranks, without_backend_buffers
from memfit.measure.ledger import Category, Ledger

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'memfit[torchtitan]')")
skip_without_torchtitans_torch()

TARGET = "torchtitan:llama3:llama3_debugmodel"
SEQ, BATCH = 64, 4
SIZES = {
    "training.disable_cuda_graphs": True,
    "parallelism.spmd_backend": "partial_dtensor",
    "training.seq_len": SEQ,
    "parallelism.pipeline_parallel_degree": 2,
    "parallelism.pipeline_parallel_schedule": "1F1B",
}
DIM = 256  # the debugmodel's hidden size: what a stage sends, one microbatch (1 row) at a time, in bf16
MICROBATCH_HIDDEN = 1 * SEQ * DIM * 2
# torchtitan's split of the 6 layers over 2 stages (the embedding and the norm+head weigh a layer each)
STAGE_MODULES = {0: ["tok_embeddings", "layers.0", "layers.1", "layers.2"], 1: ["layers.3", "layers.4", "layers.5", "norm", "lm_head"]}


def _job(**sizes):
    return memfit.load_target(TARGET, batch_size=BATCH, sizes={**SIZES, **sizes})


def _params(ledger: Ledger) -> int:
    return sum(b.nbytes for b in ledger.blocks if b.category is Category.PARAMETER)




@pytest.fixture(scope="module")
def stages() -> dict:
    return {s: profile_ranks(_job(**{"parallelism.pipeline_parallel_schedule": s}), world_size=2, ranks=(0, 1)).profiles for s in ("1F1B", "GPipe")}


def test_each_stage_holds_its_own_layers_head_and_loss(stages):
    whole = _job().model.model  # torchtitan's decoder, on meta
    for rank, prof in stages["1F1B"].items():
        mine = STAGE_MODULES[rank]
        assert {m for m in prof.modules if m.count(".") <= 1 and m not in ("", "layers")} == set(mine)
        # fp32 parameters of this stage's modules only (no FSDP at pp 2 of 2 ranks)
        expected = sum(p.numel() * 4 for name, p in whole.named_parameters() if any(name.startswith(m + ".") for m in mine))
        assert _params(prof.ledger) == expected
        ops = {t.op for t in prof.ledger.ticks}
        # the loss (torchtitan's chunked cross-entropy) runs on the last stage only
        assert any("nll_loss" in op or "log_softmax" in op for op in ops) == (rank == 1)
        # receive buffers, one microbatch each (4): activations on the last stage, gradients on the first
        assert prof.breakdown[Category.PIPELINE] == BATCH * MICROBATCH_HIDDEN
        assert prof.meta["parallel"] == "torchtitan" and prof.meta["world_size"] == 2
    assert stages["1F1B"][0].peak_bytes != stages["1F1B"][1].peak_bytes


def test_schedules_hold_the_microbatches_theory_says(stages):
    # GPipe: every stage holds all 4 microbatches' saved activations (of its decoder layers)
    # before its first backward; 1F1B: stage s of pp holds at most pp - s of them (2 on the
    # first stage, 1 on the last). The last stage's chunked loss keeps pieces of its own, one
    # microbatch at a time under either schedule: the layers' activations are the theory's.
    gpipe, one = ({r: most_alive(p.ledger, Category.ACTIVATION, "layers.") for r, p in stages[s].items()} for s in ("GPipe", "1F1B"))
    assert gpipe[0] == 2 * one[0] > 0 and gpipe[1] == 4 * one[1] > 0


PP_FSDP = {"parallelism.data_parallel_shard_degree": 2}


@pytest.fixture(scope="module")
def pp_fsdp() -> dict:
    # 4 ranks: pp 2 (outer) x FSDP 2; ranks 0, 1 hold stage 0, ranks 2, 3 stage 1
    return profile_ranks(_job(**PP_FSDP), world_size=4, ranks=(0, 1, 2, 3)).profiles


def test_pp_by_fsdp_shards_within_each_stage(stages, pp_fsdp):
    both = pp_fsdp
    for rank, stage in ((0, 0), (3, 1)):
        alone = stages["1F1B"][stage]
        assert 2 * _params(both[rank].ledger) == _params(alone.ledger)
        assert {m for m in both[rank].modules if m.count(".") <= 1} == {m for m in alone.modules if m.count(".") <= 1}
        assert both[rank].breakdown[Category.PIPELINE] == BATCH * MICROBATCH_HIDDEN
        # the stage's FSDP group reduce-scatters its gradients (the gradient of a stage alone is whole)
        assert any(b.category is Category.REDUCE_SCATTER for b in both[rank].ledger.blocks)


def _real_rank(rank: int, world_size: int, sizes: dict | None = None) -> dict:
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def summed(module, factor: float) -> None:
        # torchtitan sets FSDP2's gradient divide factor to 1.0 (its loss is already divided by
        # the global token count), for which FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM(1.0),
        # which gloo does not implement: the same sum as a plain SUM (no division either way, no
        # tensor more or less). Only in these real gloo ranks; the fake ranks run torchtitan's own.
        set_factor(module, factor)
        if factor == 1.0:
            module.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = summed  # a forked child's own copy of the class
    return profile_rank(_job(**(sizes or {})), CURRENT_GROUP).ledger.to_dict()


def _tensors(ledger: Ledger) -> Ledger:
    return Ledger([b for b in ledger.blocks if b.category is not Category.WORKSPACE], ledger.ticks)


def test_fake_group_stages_equal_real_gloo_run(stages):
    # the same torchtitan 1F1B step on two real gloo ranks, recorded on their real tensors: every
    # block in the order made, its size, its category, whether it outlives the step, and each
    # stage's tensor peak and what is alive there, as the fake group's. Not the ticks: the real
    # step records more ops (its bf16 matmuls' oneDNN reorders, as workspaces, which fake
    # tensors do not run), so births and deaths are counted on other clocks.
    _equal_to_real(stages["1F1B"], gloo_ranks(_real_rank, 2))


def test_pp_by_fsdp_equals_real_gloo_run(pp_fsdp):
    # the same on four real gloo ranks, pp 2 x FSDP 2: each stage's FSDP group all-gathers and
    # reduce-scatters over gloo while the stages send and receive
    _equal_to_real(pp_fsdp, gloo_ranks(_real_rank, 4, PP_FSDP))


def _equal_to_real(fake: dict, real: list) -> None:
    for r, ledger in enumerate(real):
        mine, theirs = _tensors(fake[r].ledger), _tensors(without_backend_buffers(Ledger.from_dict(ledger)))
        assert [(b.category, b.nbytes, b.died is None) for b in mine.blocks] == [
            (b.category, b.nbytes, b.died is None) for b in theirs.blocks
        ]
        assert mine.peak_bytes == theirs.peak_bytes
        assert mine.breakdown() == theirs.breakdown()


def test_cli_profiles_interleaved_stages_on_fake_cuda(fake_cuda, tmp_path):
    out = tmp_path / "p.json"
    sizes = [a for k, v in {**SIZES, "parallelism.pipeline_parallel_schedule": "Interleaved1F1B"}.items() for a in ("--size", f"{k}={v}")]
    argv = ["profile", TARGET, *sizes, "--batch-size", str(BATCH), "--world-size", "2", "--ranks", "all"]
    done = fake_cuda.cli([*argv, "--device", "fake-cuda", "--gpu", "H100-80GB", "--json", str(out)])
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert set(ranks) == {0, 1}
    for r in ranks.values():
        # two stages a rank (0 and 2; 1 and 3): receive buffers for both, both ways but at the ends
        assert r["breakdown"]["pipeline_buffers"] >= 3 * BATCH * MICROBATCH_HIDDEN
        assert r["reserved_peak_bytes"] >= r["allocated_peak_bytes"] > 0
        assert f"rank {r['rank']} as torchtitan logs it:" in done.stdout
        # both parts' optimizer state (fused AdamW: two moments a parameter, and a step count),
        # each read from the optimizer of its part
        params = r["breakdown"]["parameters"]
        assert 2 * params <= r["breakdown"]["optimizer_state"] < 2.01 * params
        # each stage rank judged against the GPU on its own reserved peak
        fit = r["device_fit"]
        assert fit["reserved_peak_bytes"] == r["reserved_peak_bytes"] and fit["capacity_bytes"] == fit["gpu"]["total_memory"]
    # the last stage (on rank 1) holds the head and the loss: the ranks differ
    assert ranks[0]["allocated_peak_bytes"] != ranks[1]["allocated_peak_bytes"]
    assert data["reserved_peak_bytes"] == max(r["reserved_peak_bytes"] for r in ranks.values())


@pytest.mark.parametrize(
    ("sizes", "says"),
    [
        ({"parallelism.pipeline_parallel_schedule": "ZBVZeroBubble"}, "pipeline_parallel_schedule=ZBVZeroBubble: not modelled"),
        ({"parallelism.tensor_parallel_degree": 2}, "pipeline parallelism with tensor parallelism"),
        ({"parallelism.pipeline_parallel_microbatch_size": 3}, "microbatch_size=3 does not divide"),
    ],
)
def test_what_torchtitans_pp_needs_and_memfit_lacks_is_one_line(sizes, says):
    with pytest.raises(MemfitError) as info:
        profile_ranks(_job(**sizes), world_size=4 if "tensor" in str(sizes) else 2)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_plan_under_torchtitans_pp_refused_in_one_line():
    with pytest.raises(MemfitError, match="plan under pipeline parallelism") as info:
        memfit.plan(_job(), budget="50%", world_size=2)
    assert "\n" not in str(info.value)
