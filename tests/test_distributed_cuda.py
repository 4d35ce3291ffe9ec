"""Per-rank fake CUDA: each rank's step on fake CUDA tensors over the fake process group, its
ledger replayed through the caching-allocator model. Checked against the same rank on fake CPU
tensors: the allocated peak is the CPU ledger's in CUDA's terms, every difference named. The
shim must load before torch, so the steps run in one fresh interpreter (tests/test_fake_cuda.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memfit

SRC = str(Path(memfit.__file__).resolve().parents[1])

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import dataclasses, io, json, sys
    from contextlib import redirect_stdout
    import memfit, torch
    from memfit import zoo
    from memfit.cli import main
    from memfit.measure.distributed import profile_ranks
    from memfit.measure.ledger import Category, Ledger
    from memfit.measure.profile import allocator_settings_from_env
    from memfit.measure.recorder import storage_bytes
    from memfit.measure.replay import replay_training

    SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)

    def work(parallel):
        # eager attention: the same ops on both devices (CUDA's SDPA would take the memory-efficient
        # kernel, CPU's the math one); AdamW's single-tensor step on both (CUDA defaults to foreach)
        w = zoo.build("llama", vocab_size=256, seq_len=16, batch_size=2, parallel=parallel, attn_implementation="eager", **SIZES)
        return dataclasses.replace(w, optimizer=lambda ps: torch.optim.AdamW(ps, foreach=False))

    def in_cuda_terms(cpu, cuda):
        # the fake-CPU ledger as the CUDA allocator sees it: autograd's graph is host memory (out),
        # storages in 512 B blocks, AdamW's 0-dim `step` counters stay on the host on CUDA (out),
        # and the cuBLAS workspaces (one per thread running matmuls) alive from the start
        dev = torch.device("cuda", 0)
        steps = [b for b in cpu.blocks if b.category is Category.OPTIMIZER and b.nbytes == 4]
        kept = [dataclasses.replace(b, nbytes=storage_bytes(b.nbytes, dev)) for b in cpu.blocks
                if b.category is not Category.GRAPH and b not in steps]
        params = sum(1 for b in cpu.blocks if b.category is Category.PARAMETER)
        return Ledger(kept, cpu.ticks).peak_bytes + cuda.cublas_workspaces * cuda.cublas_workspace_bytes, len(steps), params

    def on_one_stream(ledger):
        return Ledger([dataclasses.replace(b, stream=0) for b in ledger.blocks], ledger.ticks)

    out = {}
    for arg in sys.argv[1:]:
        parallel, n = arg.split(":")
        n = int(n)
        cpu = profile_ranks(work(parallel), world_size=n, ranks=(0,))
        gpu = profile_ranks(work(parallel), world_size=n, ranks=(0,), fake="cuda", gpu="A100-80GB")
        c, g = cpu.profiles[0].ledger, gpu.profiles[0]
        expected, steps, params = in_cuda_terms(c, g.ledger)
        settings = allocator_settings_from_env()
        out[arg] = {
            "device": g.device,
            "expected": expected, "steps": steps, "params": params,
            "allocated": g.allocated_peak_bytes, "ledger_peak": g.peak_bytes, "reserved": g.reserved_peak_bytes,
            "replayed": replay_training(g.ledger, settings).stats.reserved_peak_bytes,
            "one_stream": replay_training(on_one_stream(g.ledger), settings).stats.reserved_peak_bytes,
            "streams": sorted({(b.stream, b.category.value) for b in g.ledger.blocks if b.stream}),
            "cublas": g.ledger.cublas_workspaces,
            "outside": {e["name"]: e["bytes"] for e in g.device_fit.to_dict()["outside_allocator"]},
            "gpu": g.device_fit.gpu.key,
            "json_reserved": json.loads(gpu.to_json(ledger=False))["reserved_peak_bytes"],
        }
    sizes = [a for k, v in SIZES.items() for a in ("--size", f"{k}={v}")]
    text = io.StringIO()
    with redirect_stdout(text):
        code = main(["profile", "llama", "--size", "vocab_size=256", "--size", "seq_len=16", "--batch-size", "2", *sizes,
                     "--world-size", "2", "--ranks", "all", "--device", "fake-cuda", "--gpu", "H100-80GB",
                     "--json", sys.argv[0] + ".json"])
    out["cli"] = {"code": code, "stdout": text.getvalue(), "json": json.load(open(sys.argv[0] + ".json"))}
    # a plan per rank whose budget is a GPU's memory (--capacity): less the CUDA context and NCCL estimates
    # (activations large enough for recompute to matter against the 2 x 32 MiB cuBLAS workspaces)
    big = dict(SIZES, hidden_size=256, intermediate_size=1024, vocab_size=256, seq_len=1024)
    unplanned = profile_ranks(memfit.load_target("llama", batch_size=4, sizes=big), world_size=2, fake="cuda")
    none = unplanned.profiles[0].reserved_peak_bytes  # H100, the default GPU
    capacity = 512 * 2**20 + 544 * 2**20 + none * 9 // 10
    with redirect_stdout(io.StringIO()):
        code = main(["plan", "llama", *(a for k, v in big.items() for a in ("--size", f"{k}={v}")), "--batch-size", "4",
                     "--world-size", "2", "--device", "fake-cuda", "--capacity", f"{capacity}B",
                     "--json", sys.argv[0] + ".plan.json"])
    plan = json.load(open(sys.argv[0] + ".plan.json"))
    # the plan's rank-0 figures (the run that verified it) against rank 0 profiled afresh with it
    from memfit.plan.distributed import planned
    w = memfit.load_target("llama", batch_size=4, sizes=big)
    fresh = profile_ranks(planned(w, memfit.Plan.from_dict(plan)), world_size=2, fake="cuda").profiles[0]
    out["plan"] = {"code": code, "capacity": capacity, "plan": plan, "unplanned": none,
                   "fresh": [fresh.reserved_peak_bytes, fresh.peak_bytes]}
    print("RESULT" + json.dumps(out))
    """
)

SCHEMES = ("fsdp2:2", "ddp:2", "tp:2", "hsdp:4")
MiB = 2**20


@pytest.fixture(scope="module")
def result(shim_cache, tmp_path_factory) -> dict:
    pytest.importorskip("transformers")
    script = tmp_path_factory.mktemp("ranks") / "ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(shim_cache), "PYTHONPATH": SRC, "MEMFIT_FAKE_CUDA": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    done = subprocess.run(
        [sys.executable, str(script), *SCHEMES], env=env, capture_output=True, text=True, timeout=1200
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_allocated_peak_is_the_cpu_ledger_in_cuda_terms(result, scheme):
    r = result[scheme]
    assert r["device"] == "fake:cuda:0" and r["gpu"] == "A100-80GB"
    # to the byte: the fake-CPU rank's tensors in 512 B blocks, its AdamW step counters left on the
    # host (one a parameter), and two cuBLAS workspaces (the forward's thread and autograd's)
    assert r["steps"] == r["params"] > 0 and r["cublas"] == 2
    assert r["allocated"] == r["ledger_peak"] == r["expected"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reserved_is_the_allocator_replay(result, scheme):
    r = result[scheme]
    assert r["reserved"] == r["replayed"] == r["json_reserved"] >= r["allocated"]


def test_fsdp2_collective_buffers_on_their_own_streams(result):
    r = result["fsdp2:2"]
    streams = {}
    for stream, category in r["streams"]:
        streams.setdefault(category, set()).add(stream)
    # all-gather buffers on FSDP2's copy-in stream, the sharded gradients (views of the
    # reduce-scatter output) on its reduce-scatter stream: two streams other than the default
    assert streams["all_gather_buffers"] and streams["gradients"]
    assert not streams["all_gather_buffers"] & streams["gradients"]
    # blocks freed on one stream are not reused by another: more segments than on one stream
    assert r["reserved"] > r["one_stream"]
    assert not result["ddp:2"]["streams"]  # DDP allocates on the default stream only


def test_nccl_estimate_per_communicator(result):
    assert result["fsdp2:2"]["outside"] == {"cuda_context": 512 * MiB, "nccl": 544 * MiB}
    assert result["ddp:2"]["outside"]["nccl"] == 544 * MiB
    # HSDP on 4 ranks as (2 replicate, 2 shard): two communicators of two ranks
    assert result["hsdp:4"]["outside"]["nccl"] == 2 * 544 * MiB


def test_cli_profiles_each_rank_on_fake_cuda(result):
    cli = result["cli"]
    assert cli["code"] == 0
    data = cli["json"]
    assert data["world_size"] == 2 and [r["rank"] for r in data["ranks"]] == [0, 1]
    for rank in data["ranks"]:
        assert rank["device"] == "fake:cuda:0"
        assert rank["reserved_peak_bytes"] >= rank["allocated_peak_bytes"] == rank["peak_bytes"]
        assert rank["device_fit"]["gpu"]["key"] == "H100-80GB"
    assert data["reserved_peak_bytes"] == max(r["reserved_peak_bytes"] for r in data["ranks"])
    out = " ".join(cli["stdout"].split())
    assert "allocated" in out and "reserved" in out and "nccl" in out


def test_plan_per_rank_within_a_gpu_capacity(result):
    r = result["plan"]
    plan = r["plan"]
    assert r["code"] == 0 and plan["device"] == "fake:cuda:0" and plan["peak_basis"] == "reserved_peak_bytes"
    # the budget: the capacity less the CUDA context (512 MiB) and one NCCL communicator of 2 ranks (544 MiB)
    assert plan["budget_bytes"] == r["capacity"] - 512 * MiB - 544 * MiB
    # each rank's reserved peak, profiled afresh with the plan applied, within it; without the plan, over it
    assert plan["predicted_peak_bytes"] == plan["rank_peak_bytes"]["0"] <= plan["budget_bytes"] < r["unplanned"]
    assert plan["checkpointed"] and plan["allocated_peak_bytes"] <= plan["predicted_peak_bytes"]
    # the figures come from the run that verified the plan: a fresh profile of the rank has them too
    assert r["fresh"] == [plan["predicted_peak_bytes"], plan["allocated_peak_bytes"]]
