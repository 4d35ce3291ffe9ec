"""Per-rank fake CUDA: each rank's step on fake CUDA tensors over the fake process group, its
ledger replayed through the caching-allocator model. Checked against the same rank on fake CPU
tensors: the allocated peak is the CPU ledger's in CUDA's terms, every difference named. The
shim must load before torch, so the steps run in the session's fake-CUDA interpreter
(tests/conftest.py's ``fake_cuda``; tests/test_fake_cuda.py)."""

from __future__ import annotations

import json
import textwrap

import pytest

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
    for arg in SCHEMES:
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
                     "--json", BASE + ".json"])
    out["cli"] = {"code": code, "stdout": text.getvalue(), "json": json.load(open(BASE + ".json"))}
    # how many ranks for a GPU's memory: NCCL's estimate comes off the budget at each size tried
    from memfit.cuda.gpu import CUDA_CONTEXT
    from memfit.measure.distributed import nccl_outside
    nccl2 = nccl_outside(work("fsdp2").parallel, 2).bytes  # on the H100, the default GPU
    out["nccl2"] = nccl2
    capacity = out["cli"]["json"]["reserved_peak_bytes"] + CUDA_CONTEXT.bytes + nccl2  # just fits 2 ranks
    with redirect_stdout(io.StringIO()):
        code = main(["plan", "llama", "--size", "vocab_size=256", "--size", "seq_len=16", "--batch-size", "2", *sizes,
                     "--min-world-size", "--world-sizes", "2,4", "--device", "fake-cuda", "--capacity", f"{capacity}B",
                     "--json", BASE + ".mws.json"])
    out["mws"] = {"code": code, "capacity": capacity, "context": CUDA_CONTEXT.bytes,
                  "json": json.load(open(BASE + ".mws.json"))}
    # a plan per rank whose budget is a GPU's memory (--capacity): less the CUDA context and NCCL estimates
    # (activations large enough for recompute to matter against the 2 x 32 MiB cuBLAS workspaces)
    big = dict(SIZES, hidden_size=256, intermediate_size=1024, vocab_size=256, seq_len=1024)
    unplanned = profile_ranks(memfit.load_target("llama", batch_size=4, sizes=big), world_size=2, fake="cuda")
    none = unplanned.profiles[0].reserved_peak_bytes  # H100, the default GPU
    capacity = 512 * 2**20 + nccl2 + none * 9 // 10
    with redirect_stdout(io.StringIO()):
        code = main(["plan", "llama", *(a for k, v in big.items() for a in ("--size", f"{k}={v}")), "--batch-size", "4",
                     "--world-size", "2", "--device", "fake-cuda", "--capacity", f"{capacity}B",
                     "--json", BASE + ".plan.json"])
    plan = json.load(open(BASE + ".plan.json"))
    # the plan's rank-0 figures (the run that verified it) against rank 0 profiled afresh with it
    from memfit.plan.distributed import planned
    w = memfit.load_target("llama", batch_size=4, sizes=big)
    fresh = profile_ranks(planned(w, memfit.Plan.from_dict(plan)), world_size=2, fake="cuda").profiles[0]
    out["plan"] = {"code": code, "capacity": capacity, "plan": plan, "unplanned": none,
                   "fresh": [fresh.reserved_peak_bytes, fresh.peak_bytes]}
    # fit per rank on fake CUDA: the budget bounds each rank's reserved peak (here the step's own)
    import os
    from memfit.cuda.allocator import AllocatorSettings
    from memfit.levers.rank_fit import fit_ranks
    # (the plan's workload: keeping every block unsharded is over its reserved peak as it is)
    w, as_is = memfit.load_target("llama", batch_size=4, sizes=big), unplanned
    expandable = AllocatorSettings.parse("expandable_segments:True")
    recipe = fit_ranks(w, as_is.budget_peak_bytes, world_size=2, fake="cuda", exclude={"recompute": "none"})
    fsdp = dataclasses.replace(w.parallel.parallelize, root_reshard_after_forward=recipe.fsdp["root_reshard_after_forward"],
                               keep_last=recipe.fsdp["block_reshard_after_forward"].count(False))
    chosen = profile_ranks(dataclasses.replace(w, parallel=dataclasses.replace(w.parallel, parallelize=fsdp)), world_size=2,
                           fake="cuda")
    if "expandable_segments" in recipe.levers:
        chosen = chosen.under(expandable)
    # every block kept unsharded after forward: a plan's figure for the step as it is, the profile's
    from memfit.plan.distributed import plan_ranks
    kept = dataclasses.replace(w.parallel.parallelize, root_reshard_after_forward=False, keep_last=2)
    kept = dataclasses.replace(w, parallel=dataclasses.replace(w.parallel, parallelize=kept))
    kept_plan = plan_ranks(kept, 2**40, world_size=2, fake="cuda")
    kept_profile = profile_ranks(kept, world_size=2, fake="cuda")
    small = work("fsdp2")
    replayed = profile_ranks(small, world_size=2, fake="cuda").under(expandable)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # a process started with it
    started = profile_ranks(small, world_size=2, fake="cuda")
    on = fit_ranks(small, "1GiB", world_size=2, fake="cuda", exclude={"recompute": "none"})
    del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    out["fit"] = {
        "as_is": [as_is.budget_peak_bytes, as_is.peak_bytes],
        "recipe": recipe.to_dict(), "snippet": recipe.snippet(),
        "chosen": [chosen.budget_peak_bytes, chosen.peak_bytes],
        "replayed": [replayed.budget_peak_bytes, replayed.peak_bytes],
        "started": [started.budget_peak_bytes, started.peak_bytes],
        "on": {"left_out": on.left_out["expandable_segments"].why.name, "conf": on.allocator_conf},
        "kept": [[kept_plan.none_peak_bytes, kept_plan.allocated_peak_bytes],
                 [kept_profile.budget_peak_bytes, kept_profile.peak_bytes]],
    }
    print("RESULT" + json.dumps(out))
    """
)

SCHEMES = ("fsdp2:2", "ddp:2", "tp:2", "hsdp:4")
MiB = 2**20


@pytest.fixture(scope="module")
def result(fake_cuda, tmp_path_factory) -> dict:
    # in the session's fake-CUDA interpreter (conftest; PYTORCH_CUDA_ALLOC_CONF unset there, as
    # the script needs): not a fresh one, whose start-up of torch, memfit and transformers was
    # a tenth of this fixture's CPU seconds
    pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("ranks") / "ranks"
    done = fake_cuda.script(f"SCHEMES = {list(SCHEMES)!r}\nBASE = {str(base)!r}\n" + SCRIPT, timeout=1200)
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


# one communicator of 2 ranks on A100s (memfit.cuda.nccl): the ring's 24 channels x (10 + 2) MiB of
# connection buffers, and 2 MiB blocks of bookkeeping, 3 for each of 32 channels and 2 more
A100_2 = 24 * 12 * MiB + (32 * 3 + 2) * 2 * MiB
# on H100s NVLS too: 16 channels x 2 x 1 MiB x 2 ranks of buffers, 16 + 1 blocks of 2 MiB
H100_2 = A100_2 + 16 * 2 * 2 * MiB + 17 * 2 * MiB


def test_nccl_estimate_per_communicator(result):
    assert result["fsdp2:2"]["outside"] == {"cuda_context": 512 * MiB, "nccl": A100_2} and A100_2 == 484 * MiB
    # DDP all-reduces, but with 2 ranks the tree's peers are the ring's: the same connections
    assert result["ddp:2"]["outside"]["nccl"] == A100_2
    # HSDP on 4 ranks as (2 replicate, 2 shard): two communicators of two ranks
    assert result["hsdp:4"]["outside"]["nccl"] == 2 * A100_2
    assert result["nccl2"] == H100_2 == 582 * MiB


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
    # the budget: the capacity less the CUDA context (512 MiB) and one NCCL communicator of 2 H100s
    assert plan["budget_bytes"] == r["capacity"] - 512 * MiB - H100_2
    # each rank's reserved peak, profiled afresh with the plan applied, within it; without the plan, over it
    assert plan["predicted_peak_bytes"] == plan["rank_peak_bytes"]["0"] <= plan["budget_bytes"] < r["unplanned"]
    assert plan["checkpointed"] and plan["allocated_peak_bytes"] <= plan["predicted_peak_bytes"]
    # the figures come from the run that verified the plan: a fresh profile of the rank has them too
    assert r["fresh"] == [plan["predicted_peak_bytes"], plan["allocated_peak_bytes"]]


def test_fit_per_rank_bounds_each_ranks_reserved_peak(result):
    r = result["fit"]
    recipe = r["recipe"]
    budget = r["as_is"][0]  # the reserved peak as it is, exactly
    assert budget > r["as_is"][1]  # reserved over allocated: the budget is not the tensors'
    assert recipe["device"].startswith("fake:cuda") and recipe["base_peak_bytes"] == budget
    # the recipe's figures are a fresh fake-CUDA profile's of the configuration it chose
    assert recipe["predicted_peak_bytes"] == r["chosen"][0] == recipe["rank_peak_bytes"]["0"] <= budget
    assert recipe["allocated_peak_bytes"] == r["chosen"][1]
    # the budget bound the step (keeping every block is over it), so expandable segments were weighed
    assert any(not row["fits"] and "expandable" not in row["label"] for row in recipe["what_if"])
    assert any("expandable segments" in row["label"] for row in recipe["what_if"])
    if "expandable_segments" in recipe["levers"]:
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in r["snippet"]


def test_expandable_segments_judged_as_a_process_started_with_them(result):
    r = result["fit"]
    assert r["replayed"] == r["started"]
    # already on in this process: not a lever to weigh
    assert r["on"] == {"left_out": "NOT_NEEDED", "conf": "expandable_segments:True"}


def test_plan_per_rank_starts_from_the_step_a_training_loop_runs(result):
    # The plan's stateful check runs a forward without backward: FSDP2 modules that keep their
    # parameters unsharded after forward stayed unsharded, and the step recorded next all-gathered
    # none of them (30 MiB less reserved here); resharded, it is the profile's step to the byte.
    plan, profile = result["fit"]["kept"]
    assert plan == profile


def test_min_world_size_takes_nccls_estimate_off_each_size(result):
    r = result["mws"]
    found = r["json"]
    assert r["code"] == 0 and found["without_recompute"] == 2 == found["with_recompute"]
    row = found["rows"][0]
    # the GPU's memory less the CUDA context and NCCL's 2-rank communicator: the step's own
    # reserved peak exactly, which fits
    assert row["budget_bytes"] == r["capacity"] - r["context"] - H100_2 == row["none_peak_bytes"]
