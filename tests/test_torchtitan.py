"""torchtitan's own job as a target (``torchtitan:MODULE:CONFIG``), on its debugmodel flavor at
2 ranks: its model, parallelize, loss and optimizer on the fake process group; each rank's
peaks on fake CUDA against the same rank on fake CPU; bad targets refused in one line.
Skips without torchtitan (``pip install 'memfit[torchtitan]'``)."""

from __future__ import annotations

import io
import json
import textwrap
from contextlib import redirect_stderr, redirect_stdout

import pytest
from conftest import skip_without_torchtitans_torch

import memfit
from memfit.cli import main

TARGET = "torchtitan:llama3:llama3_debugmodel"
EAGER = ["--size", "training.disable_cuda_graphs=True", "--size", "parallelism.spmd_backend=partial_dtensor"]
SIZES = {"training.disable_cuda_graphs": True, "parallelism.spmd_backend": "partial_dtensor", "training.seq_len": 64}

SCRIPT = textwrap.dedent(
    """
    import dataclasses, io, json
    from contextlib import redirect_stdout
    import memfit, torch
    from memfit.cli import main
    from memfit.measure.distributed import profile_ranks
    from memfit.measure.ledger import Category, Ledger
    from memfit.measure.profile import Profile
    from memfit.measure.recorder import storage_bytes

    cpu = profile_ranks(memfit.load_target("torchtitan:llama3:llama3_debugmodel", batch_size=2, sizes=SIZES), world_size=2,
                        ranks=(0,))
    text = io.StringIO()
    with redirect_stdout(text):
        code = main(["profile", "torchtitan:llama3:llama3_debugmodel", *EAGER, "--size", "training.seq_len=64",
                     "--batch-size", "2", "--world-size", "2", "--ranks", "all", "--device", "fake-cuda",
                     "--gpu", "H100-80GB", "--json", OUT])
    cli = {"code": code, "stdout": text.getvalue(), "json": json.load(open(OUT))}
    # rank 0 on fake CUDA as the command wrote it: the same job, sizes and GPU as profile_ranks(...,
    # fake="cuda", gpu="H100-80GB") gives (every figure below equal), not profiled a second time
    c, g = cpu.profiles[0].ledger, Profile.from_dict(cli["json"]["ranks"][0])
    # the fake-CPU ledger in CUDA's terms: autograd's graph is host memory (out), storages in
    # 512 B blocks (torchtitan's fused AdamW keeps its `step` counters on the device: they stay),
    # and the cuBLAS workspaces alive from the start
    dev = torch.device("cuda", 0)
    kept = Ledger([dataclasses.replace(b, nbytes=storage_bytes(b.nbytes, dev)) for b in c.blocks
                   if b.category is not Category.GRAPH], c.ticks)
    cublas = g.ledger.cublas_workspaces * g.ledger.cublas_workspace_bytes

    def saved(ledger):
        # activations by the op that made them, at the peak and over the step: the attention
        # kernel's outputs differ by device (torchtitan's SAC saves CUDA's flash kernel's, not
        # the CPU's), the matmuls' do not
        t = ledger.peak_tick
        acts = [b for b in ledger.blocks if b.category is Category.ACTIVATION]
        live = [b for b in acts if b.born <= t and (b.died is None or b.died > t)]
        op = lambda b: ledger.ticks[b.born].op if b.born >= 0 else ""
        attention = sum(b.nbytes for b in live if op(b).startswith("_scaled_dot_product"))
        return {"rest": sum(b.nbytes for b in live) - attention, "mm": sum(b.nbytes for b in acts if op(b) == "mm")}

    out = {
        "cpu_saved": saved(kept), "gpu_saved": saved(g.ledger),
        "device": g.device, "meta": g.meta,
        "expected": kept.peak_bytes + cublas, "allocated": g.allocated_peak_bytes, "reserved": g.reserved_peak_bytes,
        "cpu_at_peak": {k.value: v for k, v in kept.breakdown().items()},
        "gpu_at_peak": {k.value: v for k, v in g.ledger.breakdown().items()},
        "cublas": cublas,
        "cpu_categories": sorted({b.category.value for b in c.blocks}),
    }
    out["cli"] = cli
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def titan() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'memfit[torchtitan]')")
    skip_without_torchtitans_torch()


@pytest.fixture(scope="module")
def result(titan, fake_cuda, tmp_path_factory) -> dict:
    # in the session's fake-CUDA interpreter (conftest; PYTORCH_CUDA_ALLOC_CONF unset there, as
    # the script needs): a fresh one's start-up of torch and memfit was some 4 CPU s of this fixture
    out = tmp_path_factory.mktemp("titan") / "titan.json"
    head = f"SIZES, EAGER, OUT = {SIZES!r}, {EAGER!r}, {str(out)!r}\n"
    done = fake_cuda.script(head + SCRIPT, timeout=1200)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("RESULT") :])


def test_builds_torchtitans_own_step(result):
    assert result["device"] == "fake:cuda:0"
    meta = result["meta"]
    assert meta["flavor"] == "debugmodel" and meta["world_size"] == 2 and meta["parallel"] == "torchtitan"
    assert meta["activation_checkpoint"] == "SelectiveAC" and meta["attention"] == "flex as causal sdpa"
    # torchtitan's FSDP2 (its fully_shard calls), not memfit's: its collective buffers are in the ledger
    assert {"all_gather_buffers", "reduce_scatter_buffers", "unsharded_parameters"} <= set(result["cpu_categories"])


def test_allocated_peak_is_the_cpu_ledger_in_cuda_terms(result):
    cpu, gpu = result["cpu_at_peak"], result["gpu_at_peak"]
    # at the peak every category but the attention kernels' temporaries, workspaces and saved
    # outputs is the same on both devices, to the byte (CUDA's flash/efficient kernels against
    # the CPU's own)
    for category in cpu:
        if category not in ("temporaries", "kernel_workspace", "activations"):
            assert gpu[category] == cpu[category], category
    cs, gs = result["cpu_saved"], result["gpu_saved"]
    assert gs["rest"] == cs["rest"]
    # what torchtitan's per-op SAC keeps in its own cache (every other matmul's output) is an
    # activation, on both devices
    assert gs["mm"] == cs["mm"] > 0
    assert gpu["kernel_workspace"] >= result["cublas"] > 0
    assert abs(result["allocated"] - result["expected"]) <= 0.005 * result["expected"]
    assert result["reserved"] >= result["allocated"]


def test_cli_names_peaks_as_torchtitan_logs_them(result):
    cli = result["cli"]
    assert cli["code"] == 0
    ranks = cli["json"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["meta"]["peak_names"] == {"allocated": "memory/max_active(GiB)", "reserved": "memory/max_reserved(GiB)"}
        gib = f"{r['reserved_peak_bytes'] / 2**30:.2f}"
        assert f"rank {r['rank']} as torchtitan logs it:" in cli["stdout"]
        assert f"memory/max_reserved(GiB) {gib}" in " ".join(cli["stdout"].split())
    # under default allocator settings, where torchtitan's launcher sets expandable segments: said
    said = (
        "run_train.sh runs with PYTORCH_ALLOC_CONF=expandable_segments:True; these peaks are under the default allocator settings"
    )
    assert said in " ".join(cli["stdout"].split())


def _one_line_error(args: list[str], capsys) -> str:
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
        code = main(args)
    assert code == 2
    lines = [x for x in err.getvalue().splitlines() if x.startswith("memfit: error:")]
    assert len(lines) == 1, err.getvalue()
    return lines[0]


@pytest.mark.parametrize(
    ("target", "sizes", "says"),
    [
        ("torchtitan:llama3", [], "expected torchtitan:MODULE:CONFIG"),
        ("torchtitan:llama3:no_such_config", [], "Config function 'no_such_config' not found"),
        ("torchtitan:no_such_model:x", [], "could not load --module no_such_model"),
        (TARGET, ["--size", "training.no_such_field=1"], "has no field 'no_such_field'"),
        (TARGET, ["--size", "training.seq_len=long"], "expected a number"),
        (TARGET, [], "training.disable_cuda_graphs=True"),
        (TARGET, ["--size", "training.disable_cuda_graphs=True"], "parallelism.spmd_backend=partial_dtensor"),
        (TARGET, [*EAGER, "--size", "parallelism.context_parallel_degree=2"], "context parallelism is not modelled"),
        # torchtitan's compile is (tests/test_torchtitan_compile.py), but not its async tensor parallelism
        (
            TARGET,
            [*EAGER, "--size", "compile.enable=True", "--size", "compile.enable_async_tensor_parallel=True"],
            "compile.enable_async_tensor_parallel=True (symmetric memory) is not modelled",
        ),
        # pipeline parallelism is (tests/test_torchtitan_pp.py), but not with a schedule of its zero-bubble kind
        (
            TARGET,
            [*EAGER, "--size", "parallelism.pipeline_parallel_degree=2", "--size", "parallelism.pipeline_parallel_schedule=ZBVZeroBubble"],
            "pipeline_parallel_schedule=ZBVZeroBubble: not modelled",
        ),
    ],
)
def test_bad_targets_are_one_line_errors(titan, target, sizes, says, capsys):
    line = _one_line_error(["profile", target, *sizes, "--world-size", "2", "--device", "fake"], capsys)
    assert says in line


def test_plan_per_rank_names_torchtitans_modules_and_holds_on_its_model(titan):
    """A plan of torchtitan's job under tensor parallelism (tp 2 of 2 ranks; torchtitan's AC
    off so there is something to plan) names torchtitan's own modules and carries its model's
    fingerprint, not memfit's TitanStep wrapper's; applied to a fresh model of the job as the
    user would (before its parallelize), each rank's step peaks at the plan's verified figure."""
    from memfit.plan.result import fingerprint

    # 256 tokens: activations enough that recompute lowers the peak (at 64 it is the optimizer step's)
    sizes = {**SIZES, "training.seq_len": 256, "activation_checkpoint": None, "parallelism.tensor_parallel_degree": 2}
    work = memfit.load_target(TARGET, batch_size=2, sizes=sizes)
    # torchtitan wraps its modules' forwards in a redistribution when it parallelizes: the plan's
    # figure is then the user's order (applied before), not the search's (applied after: 0.9% lower here)
    plan = memfit.plan(work, budget="70%", world_size=2)
    assert plan.checkpointed and all(name.startswith("layers.") for name in plan.checkpointed)
    assert all(not name.startswith("model.") for name in plan.excluded)
    assert plan.fingerprint == fingerprint(work.model.model) and plan.model_type == type(work.model.model).__name__
    fresh = memfit.load_target(TARGET, batch_size=2, sizes=sizes)
    memfit.apply(fresh.model.model, plan)  # the model torchtitan's Trainer holds
    assert set(memfit.mechanisms(fresh.model.model)) == set(plan.checkpointed)
    planned = memfit.profile(fresh, world_size=2)
    assert planned.profiles[0].peak_bytes == plan.rank_peak_bytes[0] < plan.none_peak_bytes
