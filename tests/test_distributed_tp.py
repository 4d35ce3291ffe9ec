"""Tensor parallelism (and its combinations: FSDP2+TP, HSDP) on the fake process group: each
rank's ledger against a real gloo run of the same step, activations counted by their local
shards, and the schemes memfit does not model refused."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from conftest import gloo_ranks, needs, rank_differences, settled, skip_without_fake_collectives, train_ranks

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)
pytestmark = needs("transformers")  # looked up, not imported: the tests import it when they run

import memfit  # noqa: E402
from memfit import Workload, zoo  # noqa: E402
from memfit.compat import torch_compat as _torch_compat  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.measure import _distributed  # noqa: E402
from memfit.measure.distributed import CURRENT_GROUP, profile_rank, profile_ranks, without_backend_buffers  # noqa: E402
from memfit.measure.ledger import Category, Ledger, Phase  # noqa: E402
from memfit.plan.distributed import plan_ranks  # noqa: E402
from memfit.workload import Parallel  # noqa: E402

SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def _llama(parallel: str, **extra: object) -> Workload:
    return zoo.build("llama", **{"vocab_size": 256, "seq_len": 16, "batch_size": 2, "parallel": parallel, **SIZES, **extra})


def _real_rank(rank: int, world_size: int, parallel: str) -> dict:
    return profile_rank(_llama(parallel), CURRENT_GROUP).ledger.to_dict()


def _tensors(ledger: Ledger) -> Ledger:
    """Without kernel workspaces (measured on real tensors only, with ticks of their own)."""
    return Ledger([b for b in ledger.blocks if b.category is not Category.WORKSPACE], ledger.ticks)


def _gloo_run(parallel: str, world_size: int) -> list[Ledger]:
    """Each rank's ledger from a real gloo run of ``world_size`` processes, gloo's own copies left out."""
    return [_tensors(without_backend_buffers(Ledger.from_dict(d))) for d in gloo_ranks(_real_rank, world_size, parallel)]


def _compare(parallel: str, world_size: int) -> None:
    """Each rank's fake-group ledger equals the real one, block for block; a real run whose peak
    is higher is run again (at most twice), as gloo's worker thread can let go of a finished
    collective's buffer late (see tests/test_distributed.py's _settled_gloo_run)."""
    fake = profile_ranks(_llama(parallel), world_size=world_size, ranks=range(world_size))
    predicted = [_tensors(fake.profiles[r].ledger) for r in range(world_size)]
    best = settled(lambda: _gloo_run(parallel, world_size), lambda L: L.peak_bytes, [p.peak_bytes for p in predicted], slack=16)
    for r in range(world_size):
        mine, theirs = predicted[r], best[r]
        # Blocks differ by a few bytes only: the real step's flags of transformers'
        # data-dependent checks (padding, packed sequences), as on the FSDP2 Llama step; the
        # fake step's scalar constants of the vocabulary-sharded embedding (torch.tensor,
        # made outside any dispatch on a real rank, lifted into fake tensors on a fake one).
        mine_blocks = Counter((b.category, b.nbytes) for b in mine.blocks)
        theirs_blocks = Counter((b.category, b.nbytes) for b in theirs.blocks)
        differ = (theirs_blocks - mine_blocks) + (mine_blocks - theirs_blocks)
        assert all(cat is Category.TEMPORARY and n <= 8 for cat, n in differ), f"rank {r}: {differ}"
        assert abs(theirs.peak_bytes - mine.peak_bytes) <= 16, (r, mine.peak_bytes, theirs.peak_bytes)


def test_tp_ledger_equals_real_gloo_run():
    _compare("tp", 2)

    # FSDP2+TP and HSDP at 4 real ranks take 20 s here: benchmarks/distributed_gloo.py
    # compares them (docs/benchmarks/distributed.md), and the fake-only tests below profile them.


# -- what a rank holds under tensor parallelism ---------------------------------------------------


def test_tp_activations_are_local_shards():
    # q_proj is column-wise: each of 2 ranks computes half the heads, and what it keeps of
    # the projection is its half (B x S x hidden/2 floats), never the DTensor's global size
    prof = profile_ranks(_llama("tp"), world_size=2).profiles[0]
    ledger = prof.ledger
    q = [
        b
        for b in ledger.blocks
        if b.module == "model.layers.0.self_attn.q_proj"
        and b.phase is Phase.FORWARD
        and b.category is not Category.GRAPH
        and ledger.ticks[b.born].op == "mm"
    ]
    assert [b.nbytes for b in q] == [2 * 16 * 64 // 2 * 4]


@pytest.mark.parametrize(
    "parallel, world_size, share",
    [
        ("tp", 2, lambda big, norms: big // 2 + norms),  # norms replicated, the rest halved
        ("fsdp2+tp", 4, lambda big, norms: big // 4 + norms // 2),  # TP's halves sharded again over dp=2
        ("hsdp", 4, lambda big, norms: (big + norms) // 2),  # sharded within each group of 2
    ],
)
def test_parameters_per_rank(parallel, world_size, share):
    if parallel != "tp":  # FSDP2's all-gather has no fake kernel on torch 2.6
        skip_without_fake_collectives()
    model = _llama("none").model
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    big = sum(p.numel() * 4 for p in model.parameters()) - norms
    prof = profile_ranks(_llama(parallel), world_size=world_size, ranks=(world_size - 1,)).profiles[world_size - 1]
    assert prof.breakdown["parameters"] == share(big, norms)


def test_wait_tensor_output_is_its_input():
    # on fake tensors a functional collective's wait makes a new tensor where a real rank hands
    # back its input (_distributed.ALIAS_OPS): one block, alive while either is
    from memfit.measure.recorder import Recorder
    from memfit.measure.scope import Scope

    op = torch.ops._c10d_functional.wait_tensor
    assert op._qualified_op_name in _distributed.ALIAS_OPS
    model = torch.nn.Linear(4, 4)
    with _torch_compat.new_fake_mode() as mode, Scope(model) as scope:
        x = mode.from_tensor(torch.zeros(256))
        with Recorder(scope, fake=True) as rec:
            y = (x + 1).clone()
            z = op.default(y)
            del y
            w = z * 2
            del z, w
        blocks = rec.ledger().blocks
    made = [b for b in blocks if b.nbytes == 1024]
    assert len(made) == 3  # x + 1, its clone (waited on: no block of its own), z * 2
    assert made[1].died > made[2].born  # the clone lives on as z


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["ep", "moe"])
def test_expert_parallel_refused(scheme, capsys):
    # (pipeline parallelism is measured: tests/test_pipeline.py)
    from memfit.cli import main

    with pytest.raises(MemfitError, match="parallelism is not modeled by memfit") as info:
        _llama(scheme)
    assert "\n" not in str(info.value)
    assert main(["profile", "llama", "--size", f"parallel={scheme}", "--world-size", "2", "--device", "fake"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not modeled" in err and "\n" not in err


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: profile_ranks(_llama("tp"), world_size=3), "num_attention_heads=4 does not split over 3-way"),
        (lambda: profile_ranks(_llama("fsdp2+tp"), world_size=3), "multiple of 2"),
        (lambda: _llama("ddp", tp=2), "tp=2 is a degree of parallel=tp or fsdp2+tp"),
        (lambda: _llama("hsdp", replicate=0), "replicate must be a positive integer"),
    ],
)
def test_bad_tensor_parallel_input(call, words):
    with pytest.raises(MemfitError) as info:
        call()
    assert words in str(info.value) and "\n" not in str(info.value)
    assert not torch_dist.is_initialized()


def test_mesh_with_one_inferred_dimension():
    p = Parallel(lambda m, mesh: m, mesh_shape=(-1, 2))
    assert p.mesh(8) == (4, 2) and p.mesh(2) == (1, 2)
    with pytest.raises(MemfitError, match="one -1 dimension"):
        Parallel(lambda m, mesh: m, mesh_shape=(-1, -1)).mesh(4)


def test_cli_profile_fsdp2_tp(tmp_path, capsys):
    from memfit.cli import main

    out = tmp_path / "p.json"
    argv = ["profile", "llama", "--size", "parallel=fsdp2+tp", "--size", "tp=2", "--size", "vocab_size=256"]
    argv += ["--size", "seq_len=16", "--batch-size", "2", *[f"--size={k}={v}" for k, v in SIZES.items()]]
    assert main([*argv, "--world-size", "4", "--device", "fake", "--ranks", "0,3", "--json", str(out)]) == 0
    assert "rank 0 of 4 (fsdp2+tp)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["parallel"] == "fsdp2+tp" and [r["rank"] for r in data["ranks"]] == [0, 3]
    # rank 3 measured after rank 0 in this one process: DTensor's caches, keyed by equal meshes,
    # must not hand rank 3 rank 0's tp group (see _distributed.forget_meshes)
    assert data["ranks"][0]["peak_bytes"] == data["ranks"][1]["peak_bytes"] > 0
    assert data["ranks"][1]["breakdown"]["unsharded_parameters"] > 0


# -- a plan on the tensor-parallel step -------------------------------------------------------------


def _planned_rank(rank: int, world_size: int, plan_json: str, parallel: str = "tp") -> dict:
    from memfit.measure.distributed import _mesh

    plan = memfit.Plan.from_json(plan_json)
    torch.manual_seed(0)  # the same weights and batch on every rank, as tensor parallelism needs
    work = _llama(parallel, seq_len=64)
    mesh = _mesh(work.parallel, world_size)
    reference = work.parallel.parallelize(copy.deepcopy(work.model), mesh)
    planned = copy.deepcopy(work.model)
    memfit.apply(planned, plan)  # before parallelize_module, as plan_ranks verified it
    planned = work.parallel.parallelize(planned, mesh)

    def loss_of(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        return model(**inputs).loss

    batches = [work.inputs] * 3
    result = rank_differences(train_ranks(planned, batches, loss_of), train_ranks(reference, batches, loss_of))
    measured = _llama(parallel, seq_len=64)
    memfit.apply(measured.model, plan)
    result["peak_bytes"] = without_backend_buffers(profile_rank(measured, CURRENT_GROUP).ledger).peak_bytes
    return result


def test_plan_under_tp_trains_bitwise_and_each_rank_fits():
    plan = plan_ranks(_llama("tp", seq_len=64), "60%", world_size=2, ranks=(0, 1))
    assert plan.checkpointed and max(plan.rank_peak_bytes.values()) <= plan.budget_bytes < plan.none_peak_bytes
    # each rank's lowest real peak of up to three runs (conftest.settled); 8 bytes: transformers' flags
    runs = settled(
        lambda: gloo_ranks(_planned_rank, 2, plan.to_json()),
        lambda got: got["peak_bytes"],
        [plan.rank_peak_bytes[r] for r in range(2)],
        slack=8,
    )
    for r, got in enumerate(runs):
        assert got["losses_equal"], f"rank {r}: losses differ"
        assert got["grads_differ"] == [] and got["params_differ"] == [], f"rank {r}: {got}"
        # the real step's extra bytes are transformers' flags (see _compare)
        assert 0 <= got["peak_bytes"] - plan.rank_peak_bytes[r] <= 8 and got["peak_bytes"] <= plan.budget_bytes


def test_cli_sizes_after_one_flag(capsys):
    # as issue 15 writes it: several KEY=VALUE after one --size
    from memfit.cli import main

    sizes = [f"{k}={v}" for k, v in SIZES.items()]
    argv = ["profile", "llama", "--size", "parallel=tp", "vocab_size=256", "seq_len=16", *sizes, "--batch-size", "2"]
    assert main([*argv, "--world-size", "2", "--device", "fake"]) == 0
    assert "rank 0 of 2 (tp)" in capsys.readouterr().out


def test_adapter_finds_torch_internals():
    # what _distributed leans on for tensor parallelism; a torch that moves any fails here
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.tensor import debug

    if _torch_compat.torch_version() >= (2, 11):
        assert callable(debug._clear_sharding_prop_cache)  # forget_meshes
    else:  # torch 2.6: forget_meshes empties the propagator's lru_cache itself
        from torch.distributed.tensor import DTensor

        assert callable(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear)
    act = funcol.AsyncCollectiveTensor(torch.zeros(4))
    assert _distributed.local_tensor(act) is act.elem  # counted by what it wraps
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if _torch_compat.torch_version() < (2, 11) and not hasattr(DeviceMesh, "_concatenate"):
        pytest.skip(f"torch {torch.__version__} has no DeviceMesh._concatenate (its FSDP2 joins no meshes inside the fake mode)")
    with _distributed.fake_process_group(3, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # FSDP2 over a TP model joins the dp and tp meshes inside FakeTensorMode
        with _torch_compat.new_fake_mode(), _distributed.real_device_meshes():
            joined = DeviceMesh._concatenate([mesh["dp"], mesh["tp"]])
        assert list(joined.get_coordinate()) == [1, 1]
