"""Per-rank memory of distributed steps (FSDP2, DDP) on the fake process group, checked
against a real two-process gloo run; and the torch.distributed internals it relies on."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import gloo_ranks, needs_fake_collectives, settled, skip_without_fake_collectives
from torch import nn

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

from memfit import Workload  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.measure import _distributed  # noqa: E402
from memfit.measure.distributed import (  # noqa: E402
    CURRENT_GROUP,
    FakeGroup,
    ddp,
    fsdp2,
    profile_rank,
    profile_ranks,
    without_backend_buffers,
)
from memfit.measure.ledger import START_TICK, Category, Ledger  # noqa: E402
from memfit.workload import Parallel  # noqa: E402

WIDTH, DEPTH, BATCH = 64, 3, 8


class Blocks(nn.Module):
    """A stack of blocks, each a module FSDP2 shards on its own; no data-dependent branch,
    so fake and real steps run the same ops."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def users_ddp(model: nn.Module, mesh) -> nn.Module:
    """A parallelize as a user writes it: their own DistributedDataParallel over the mesh's
    group, none of memfit's helpers (issue 26 item 4: its construction failed on the fake group)."""
    from torch.nn.parallel import DistributedDataParallel

    model.to_empty(device="cpu")
    return DistributedDataParallel(model, process_group=mesh.get_group())


def users_ddp_bucket_views(model: nn.Module, mesh) -> nn.Module:
    """As :func:`users_ddp`, the gradients views into DDP's buckets (no separate copy)."""
    from torch.nn.parallel import DistributedDataParallel

    model.to_empty(device="cpu")
    return DistributedDataParallel(model, process_group=mesh.get_group(), gradient_as_bucket_view=True)


SCHEMES = {"ddp": ddp, "users_ddp": users_ddp, "users_ddp_bucket_views": users_ddp_bucket_views}


def _workload(parallel: str, world_size: int | None = None) -> Workload:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Blocks()
    scheme = (
        Parallel(fsdp2(lambda m: m.blocks, param_dtype=None, reduce_dtype=None), world_size=world_size, name="fsdp2")
        if parallel == "fsdp2"
        else Parallel(SCHEMES[parallel], world_size=world_size, name=parallel)
    )
    return Workload(model, torch.randn(BATCH, WIDTH), parallel=scheme)


PARAM_BYTES = (DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH + 1) * 4


# -- the adapter's torch internals --------------------------------------------------------------


def test_fake_process_group_and_dtensor_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with _distributed.fake_process_group(rank=1, world_size=4):
        assert torch_dist.get_world_size() == 4 and torch_dist.get_rank() == 1
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
        local = _distributed.local_tensor(d)
        assert local.shape == (16, 8)  # what rank 1 holds
        assert d.shape == (64, 8)
    assert not torch_dist.is_initialized()
    plain = torch.zeros(3)
    assert _distributed.local_tensor(plain) is plain


def test_resize_is_tracked_and_restored():
    seen = []
    original = torch.UntypedStorage.resize_
    t = torch.zeros(100)
    with _distributed.tracking_resize(lambda s: seen.append(s.nbytes())):
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(400)
    assert seen == [0, 400]
    assert torch.UntypedStorage.resize_ is original


def test_ddp_private_checks_exist():
    # fake_ddp skips these two by name; a torch that renames them must fail here
    from torch.nn.parallel import distributed as ddp_mod

    assert callable(ddp_mod._verify_param_shape_across_processes)
    assert callable(ddp_mod._sync_module_states)
    with _distributed.fake_ddp():
        assert ddp_mod._sync_module_states(None) is None
    assert ddp_mod._sync_module_states.__name__ == "_sync_module_states"


# -- per-rank ledgers on the fake group ----------------------------------------------------------


@needs_fake_collectives()
def test_fsdp2_counts_local_shards_and_resize_frees():
    prof = profile_ranks(_workload("fsdp2"), world_size=4).profiles[0]
    ledger = prof.ledger
    params = sum(b.nbytes for b in ledger.blocks if b.born == START_TICK and b.category is Category.PARAMETER)
    # each rank holds a quarter of every parameter (padded to a multiple of 4 rows: head's
    # 1-row weight and bias are padded to one row per rank), never the DTensor's global size
    assert params < PARAM_BYTES / 4 + 2 * 4 * WIDTH
    assert params >= PARAM_BYTES / 4
    unsharded = [b for b in ledger.blocks if b.category is Category.UNSHARDED]
    # each block's full parameters are all-gathered in forward and again in backward, and
    # freed (resize_(0)) after each: every one dies within the step
    assert len(unsharded) >= 2 * 2 * DEPTH
    assert all(b.died is not None for b in unsharded)
    cats = {b.category for b in ledger.blocks}
    assert {Category.ALL_GATHER, Category.REDUCE_SCATTER, Category.GRADIENT, Category.OPTIMIZER} <= cats
    assert prof.meta["world_size"] == 4 and prof.meta["rank"] == 0


@needs_fake_collectives()
def test_ddp_buckets_visible():
    prof = profile_ranks(_workload("ddp"), world_size=2).profiles[0]
    buckets = sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.DDP_BUCKET)
    assert buckets == PARAM_BYTES  # one fp32 bucket slot per gradient element
    assert prof.breakdown["ddp_buckets"] == PARAM_BYTES


@needs_fake_collectives()
def test_users_own_ddp_on_the_fake_group():
    # the user's DistributedDataParallel, built inside their parallelize, runs on the fake
    # group as memfit's ddp does: the same ledger, the same peak
    ours = profile_ranks(_workload("ddp"), world_size=2)
    theirs = profile_ranks(_workload("users_ddp"), world_size=2)
    for r in (0,):
        a, b = ours.profiles[r].ledger, theirs.profiles[r].ledger
        assert [(x.category, x.nbytes, x.born, x.died) for x in a.blocks] == [
            (x.category, x.nbytes, x.born, x.died) for x in b.blocks
        ]
    # gradients as views of the buckets: one bucket's worth of memory for both, not two
    views = profile_ranks(_workload("users_ddp_bucket_views"), world_size=2).profiles[0]
    assert views.breakdown["ddp_buckets"] == PARAM_BYTES
    assert views.breakdown.get("gradients", 0) == 0
    assert views.peak_bytes < theirs.profiles[0].peak_bytes


def _meta_ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=mesh.get_group())


def _unused_ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel

    model.to_empty(device="cpu")
    return DistributedDataParallel(model, process_group=mesh.get_group(), find_unused_parameters=True)


@pytest.mark.parametrize(
    "fn, words",
    [
        (_meta_ddp, "built over parameters on the meta device: materialise"),
        (_unused_ddp, "find_unused_parameters=True is not measured"),
    ],
)
def test_users_ddp_refused_in_one_line(fn, words):
    work = Workload(_workload("ddp").model, torch.randn(BATCH, WIDTH), parallel=Parallel(fn, name="mine"))
    with pytest.raises(MemfitError, match=words) as info:
        profile_ranks(work, world_size=2)
    assert "\n" not in str(info.value) and str(info.value).startswith("mine: ")
    assert not torch_dist.is_initialized()


@needs_fake_collectives()
def test_worst_rank_and_spread():
    res = profile_ranks(_workload("fsdp2"), world_size=2, ranks=(0, 1))
    assert set(res.profiles) == {0, 1}
    assert res.peak_bytes == max(p.peak_bytes for p in res.profiles.values())
    assert res.spread_bytes == abs(res.profiles[0].peak_bytes - res.profiles[1].peak_bytes)
    d = res.to_dict(ledger=False)
    assert [r["rank"] for r in d["ranks"]] == [0, 1] and all("peak_bytes" in r for r in d["ranks"])


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: Parallel(ddp, world_size=6, mesh_shape=(4, 2)), "8 ranks but the world size is 6"),
        (lambda: Parallel(ddp, world_size=0), "positive integer"),
        (lambda: profile_ranks(_workload("ddp")), "no world size"),
        (lambda: FakeGroup(2, rank=2), "not a rank of a world of 2"),
        (lambda: profile_ranks(Workload(nn.Linear(2, 2), torch.zeros(1, 2)), world_size=2), "says nothing about how"),
        (
            lambda: profile_ranks(Workload(nn.Linear(2, 2), torch.zeros(1, 2), parallel=Parallel(_raises)), world_size=2),
            "parallelize(model, mesh) raised ValueError: no",
        ),
    ],
)
def test_bad_distributed_input(call, words):
    with pytest.raises(MemfitError) as info:
        call()
    assert words in str(info.value) and "\n" not in str(info.value)
    assert not torch_dist.is_initialized()


def _raises(model, mesh):
    raise ValueError("no")


@needs_fake_collectives()
def test_profile_leaves_the_users_model():
    work = _workload("fsdp2")
    before = type(work.model)
    profile_ranks(work, world_size=2)
    assert type(work.model) is before and next(work.model.parameters()).device.type == "meta"


# -- against a real two-process gloo run ---------------------------------------------------------


def _llama() -> Workload:
    from memfit import zoo

    sizes = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return zoo.build("llama", vocab_size=256, seq_len=16, batch_size=2, **sizes)


def _real_rank(rank: int, world_size: int, parallel: str) -> dict:
    prof = profile_rank(_llama() if parallel == "llama" else _workload(parallel), CURRENT_GROUP)
    return prof.ledger.to_dict()


def _tensors(ledger: Ledger) -> Ledger:
    """The ledger without kernel workspaces (a fresh process's fake step has none measured
    yet; a real step measures them, with ticks of their own: blocks are compared in order)."""
    return Ledger([b for b in ledger.blocks if b.category is not Category.WORKSPACE], ledger.ticks)


def _gloo_run(parallel: str) -> list[Ledger]:
    """Each rank's ledger from a real two-process gloo run, gloo's own copies and kernel workspaces left out."""
    return [_tensors(without_backend_buffers(Ledger.from_dict(d))) for d in gloo_ranks(_real_rank, 2, parallel)]


def _settled_gloo_run(parallel: str, predicted: list[int], slack: int = 0) -> list[Ledger]:
    """Each rank's lowest-peak ledger of up to three real runs (conftest.settled says why)."""
    return settled(lambda: _gloo_run(parallel), lambda L: L.peak_bytes, predicted, slack)


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp", "users_ddp", "users_ddp_bucket_views"])
def test_fake_group_ledger_equals_real_gloo_run(parallel):
    skip_without_fake_collectives()  # DDP's all-reduce and FSDP2's all-gather
    fake = profile_ranks(_workload(parallel), world_size=2, ranks=(0, 1))
    predicted = [_tensors(fake.profiles[r].ledger) for r in range(2)]
    real = _settled_gloo_run(parallel, [L.peak_bytes for L in predicted])
    for r in range(2):
        measured = real[r]
        assert [(b.category, b.nbytes) for b in predicted[r].blocks] == [(b.category, b.nbytes) for b in measured.blocks]
        assert predicted[r].peak_bytes == measured.peak_bytes
        assert predicted[r].breakdown() == measured.breakdown()


def test_fake_group_llama_peak_equals_real_gloo_run():
    # transformers' Llama (GQA, SDPA): the fake step must not build the attention mask a real
    # step skips (measure/_hf_fake.py); the real step's only extra tensors are a few bytes of flags
    # of transformers' data-dependent checks (padding, packed sequences)
    pytest.importorskip("transformers")
    predicted = _tensors(profile_ranks(_llama(), world_size=2).profiles[0].ledger)
    measured = _settled_gloo_run("llama", [predicted.peak_bytes] * 2, slack=8)[0]
    from collections import Counter

    assert 0 <= measured.peak_bytes - predicted.peak_bytes <= 8
    mine, theirs = (
        Counter((b.category, b.nbytes) for b in predicted.blocks),
        Counter((b.category, b.nbytes) for b in measured.blocks),
    )
    assert not mine - theirs
    assert all(cat is Category.TEMPORARY and n <= 8 for cat, n in theirs - mine)


# -- the zoo and the command line ----------------------------------------------------------------

TINY_LLAMA = ["--size", "num_hidden_layers=1", "--size", "hidden_size=64", "--size", "intermediate_size=128"]
TINY_LLAMA += ["--size", "num_attention_heads=4", "--size", "vocab_size=256", "--size", "seq_len=16", "--batch-size", "2"]


def test_llama_presets_are_built_on_meta():
    from memfit import zoo

    pytest.importorskip("transformers")
    work = zoo.build("llama", preset="8b")
    params = list(work.model.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert 8.0e9 < sum(p.numel() for p in params) < 8.1e9  # Llama-3-8B: 8.03 B parameters
    assert work.inputs["input_ids"].shape == (1, 4096)
    assert work.parallel is not None and work.parallel.name == "fsdp2"
    from memfit.zoo.hf import _llama_parallel

    assert _llama_parallel("ddp").name == "ddp" and _llama_parallel("none") is None
    with pytest.raises(MemfitError, match="no preset '9b'"):
        zoo.build("llama", preset="9b")


def test_cli_profile_world_size(tmp_path, capsys):
    from memfit.cli import main

    pytest.importorskip("transformers")
    out = tmp_path / "p.json"
    page = tmp_path / "p.html"
    argv = ["profile", "llama", *TINY_LLAMA, "--world-size", "2", "--ranks", "all", "--device", "fake", "--json", str(out)]
    assert main([*argv, "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert "rank 0 of 2 (fsdp2)" in text and "Per-rank peak" in text
    # the worst rank's timeline, its collective buffers among the categories
    data = json.loads(out.read_text())
    html = page.read_text()
    assert f"rank {data['worst_rank']} of 2" in html and "unsharded_parameters" in html
    assert data["world_size"] == 2 and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert all(r["peak_bytes"] > 0 and r["meta"]["world_size"] == 2 for r in data["ranks"])
    assert data["peak_bytes"] == max(r["peak_bytes"] for r in data["ranks"])


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--world-size", "2"], "give --device fake"),
        (["--world-size", "2", "--device", "fake", "--ranks", "2"], "2 is not a rank of a world of 2"),
        (["--ranks", "0"], "give --world-size N too"),
    ],
)
def test_cli_world_size_bad_input(extra, words, capsys):
    from memfit.cli import main

    pytest.importorskip("transformers")
    assert main(["profile", "llama", *TINY_LLAMA, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


@pytest.mark.parametrize("command", [["profile"], ["plan", "--budget", "40GiB"]])
def test_cli_big_preset_without_world_size(command, capsys):
    from memfit.cli import main

    pytest.importorskip("transformers")
    assert main([*command, "llama", "--size", "preset=8b", "--device", "fake"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--world-size N --device fake" in err and "\n" not in err


@needs_fake_collectives()
def test_uneven_shards_profiled_per_rank():
    # 64 rows over 3 ranks: FSDP2 gives ranks 0 and 1 22 rows each and rank 2 the last 20,
    # so rank 2 holds less parameter and optimizer memory than rank 0
    res = profile_ranks(_workload("fsdp2"), world_size=3, ranks=(0, 2))
    start = {r: p.ledger.start_bytes for r, p in res.profiles.items()}
    assert start[2] < start[0]
    assert res.worst_rank == 0 and res.spread_bytes > 0


@needs_fake_collectives()
def test_file_target_returns_a_distributed_workload(tmp_path, capsys):
    from memfit.cli import main

    target = tmp_path / "train_setup.py"
    target.write_text(
        "import torch, memfit\n"
        "from memfit.measure.distributed import fsdp2\n"
        "def workload():\n"
        "    with torch.device('meta'):\n"
        "        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))\n"
        "    par = memfit.Parallel(fsdp2(lambda m: [m[0]], param_dtype=None, reduce_dtype=None), name='fsdp2')\n"
        "    return memfit.Workload(model, torch.randn(4, 32), parallel=par)\n"
    )
    out = tmp_path / "p.json"
    assert main(["profile", f"{target}:workload", "--world-size", "2", "--device", "fake", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ranks"][0]["breakdown"]["parameters"] > 0 and data["parallel"] == "fsdp2"


@needs_fake_collectives()
def test_cli_file_target_with_users_own_ddp(tmp_path):
    # issue 26 item 4: a parallelize building its own DistributedDataParallel, profiled and
    # planned per rank from the command line
    from memfit.cli import main

    target = tmp_path / "train_setup.py"
    target.write_text(
        "import torch, memfit\n"
        "from torch.nn.parallel import DistributedDataParallel\n"
        "def parallelize(model, mesh):\n"
        "    model.to_empty(device='cpu')\n"
        "    return DistributedDataParallel(model, process_group=mesh.get_group(), gradient_as_bucket_view=True)\n"
        "def workload():\n"
        "    with torch.device('meta'):\n"
        "        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU())\n"
        "    return memfit.Workload(model, torch.randn(64, 32), parallel=memfit.Parallel(parallelize, name='mine'))\n"
    )
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    argv = [f"{target}:workload", "--world-size", "2", "--ranks", "all", "--device", "fake"]
    assert main(["profile", *argv, "--json", str(prof)]) == 0
    data = json.loads(prof.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["parallel"] == "mine"
    assert all(r["breakdown"]["ddp_buckets"] == (2 * (32 * 32 + 32)) * 4 for r in data["ranks"])
    assert main(["plan", *argv, "--budget", "50%", "--json", str(plan)]) == 0
    planned = json.loads(plan.read_text())
    assert planned["world_size"] == 2 and set(planned["rank_peak_bytes"]) == {"0", "1"}


def test_transformers_still_finds_fake_positions_packed():
    # Why measure/_hf_fake.py exists: on fake tensors transformers cannot read the positions
    # and answers "packed" (builds a mask per layer). If this fails, transformers decides
    # otherwise now and the adapter may go.
    mu = pytest.importorskip("transformers.masking_utils")
    from memfit.compat import hf_fake as _hf_fake
    from memfit.compat import torch_compat as _torch_compat

    mode = _torch_compat.new_fake_mode()
    with mode:
        positions = torch.arange(16).unsqueeze(0)
        assert mu.find_packed_sequence_indices(positions) is not None
        with _hf_fake.unpacked_positions({"input_ids": None}):
            assert mu.find_packed_sequence_indices(positions) is None
        with _hf_fake.unpacked_positions({"position_ids": positions}):  # the user's own positions: theirs
            assert mu.find_packed_sequence_indices(positions) is not None
    assert mu.find_packed_sequence_indices(torch.arange(16).unsqueeze(0)) is None  # real: read, not packed
