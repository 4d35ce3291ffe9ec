"""Fake CUDA (memfit.cuda.fake): a step on fake CUDA tensors with CUDA's semantics,
on the CPU build of torch. The shim must load before torch, so the fake-CUDA steps run in
another interpreter: the session's one with the shim loaded (conftest's ``fake_cuda``), or a
fresh one where the test is about what a fresh process does; the shim is built once per
session into a temporary cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.cuda import fake as _fake_cuda

SRC = str(Path(memfit.__file__).resolve().parents[1])
# A CUDA build of torch (PyPI's Linux wheels) has CUDA's own hooks: fake CUDA refuses it in
# one line before it looks for a compiler, so the tests of the compiler's absence cannot run.
_CUDA_BUILD = (Path(torch.__file__).parent / "lib" / "libtorch_cuda.so").exists()
_NOT_ON_A_CUDA_BUILD = pytest.mark.skipif(_CUDA_BUILD, reason=f"torch {torch.__version__} is a CUDA build: fake CUDA is for the CPU build")


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(cache), "PYTHONPATH": SRC, **extra}
    env.pop("MEMFIT_FAKE_CUDA", None)
    return {**env, **extra}


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _ops(profile: dict) -> set[str]:
    return {op[1] for op in profile["ledger"]["ops"]}


def test_cli_profiles_a_transformer_on_fake_cuda(shim_cache, tmp_path):
    out = tmp_path / "p.json"
    sizes = ["--size", "n_layer=2", "--size", "n_embd=64", "--size", "n_head=4", "--size", "block_size=64"]
    done = _run(
        ["-m", "memfit", "profile", "gpt", "--batch-size", "2", *sizes, "--device", "fake-cuda", "--json", str(out)],
        _env(shim_cache),
    )
    assert done.returncode == 0, done.stderr  # no abort at exit either
    assert "fake:cuda:0" in done.stdout and "times omitted" in done.stdout
    data = json.loads(out.read_text())
    assert data["device"] == "fake:cuda:0" and data["fake"] is True
    # fp32 on CUDA: the memory-efficient kernel (flash takes half precision only), not the math composite
    assert "_scaled_dot_product_efficient_attention" in _ops(data)
    assert not _ops(data) & {"_safe_softmax", "bmm", "_scaled_dot_product_flash_attention_for_cpu"}
    # the CUDA allocator's 512-byte blocks, and no CPU autograd-graph estimate
    assert all(b["nbytes"] % 512 == 0 for b in data["ledger"]["blocks"]) and data["breakdown"]["autograd_graph"] == 0
    # SDPA's backward temporaries, no tensor of which shows: one estimated workspace block per
    # layer at the backward kernel. fp32, (batch 2, heads 4, seq 64, dim 16): delta
    # 2*4*64 floats, the dQ accumulator 2*4*64*64 floats (seq and dim rounded to 64); the
    # output's gradient arrives contiguous in the kernel's layout (no copy)
    attention = [
        b
        for b in data["ledger"]["blocks"]
        if b["category"] == "kernel_workspace"
        and b["born"] >= 0
        and "attention_backward" in data["ledger"]["ticks"][b["born"]][2]
    ]
    assert [b["nbytes"] for b in attention] == [2 * 4 * 64 * 4 + 2 * 4 * 64 * 64 * 4] * 2
    ticks = data["ledger"]["ticks"]
    assert data["ledger"]["attention_estimates"] == 2  # freed within the kernel's own op, after its outputs
    assert all(b["died"] > b["born"] + 1 and ticks[b["died"]][2] == ticks[b["born"]][2] for b in attention)
    params = sum(
        p.numel() * 4
        for p in memfit.load_target(
            "gpt", batch_size=2, sizes={"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64}
        ).model.parameters()
    )
    assert params <= data["breakdown"]["parameters"] < params + 512 * 40


SCRIPT = textwrap.dedent(
    """
    import json, memfit, torch
    import torch.nn as nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from memfit.cuda import fake as _fake_cuda
    from memfit.measure.sandbox import fake_sandbox
    from memfit.measure.step import StepOptions
    from memfit.workload import split_inputs

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            self.calls.append((func.overloadpacket.__name__, str(getattr(first, "dtype", "")), list(getattr(first, "shape", []))))
            return out

    result = {"active": _fake_cuda.active(), "accelerator": str(torch.accelerator.current_accelerator())}
    # a bf16 autocast step of a small GPT, every op logged
    L = 64
    work = memfit.load_target("gpt", batch_size=2, sizes={"n_layer": 1, "n_embd": 64, "n_head": 2, "block_size": L})
    args, kwargs = split_inputs(work.inputs)
    log = Log()
    with fake_sandbox(work.model, args, kwargs, work.make_optimizer(), step=StepOptions(autocast="bfloat16"),
                      targets=work.targets, device="cuda") as box:
        result["foreach"] = [g["foreach"] for g in box.optimizer.param_groups]
        with box.active(), log:
            box.step(work.loss_fn)
    result["calls"] = log.calls
    # a checkpointed block with dropout: the recompute must take the forward's kernel
    from torch.utils.checkpoint import checkpoint
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        with torch.device("cuda:0"):
            block = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        x = torch.randn(2, L, 64, device="cuda:0", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.float16):
            y = checkpoint(block, x, use_reentrant=False)
        y.float().sum().backward()
        result["checkpoint_grad"] = list(x.grad.shape)
    # the API path, a CNN
    cnn = memfit.load_target("resnet", batch_size=2, sizes={"image_size": 32, "base": 8, "depths": (1, 1, 1, 1)})
    prof = memfit.profile(cnn.model, cnn.inputs, loss_fn=cnn.loss_fn, targets=cnn.targets, fake="cuda")
    result["cnn"] = {"device": prof.device, "peak": prof.peak_bytes, "ops": sorted({o.op for o in prof.ledger.ops})}
    print("RESULT" + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def semantics(fake_cuda) -> dict:
    done = fake_cuda.script(SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_shim_is_on_in_the_child(semantics):
    assert semantics["active"] is True and semantics["accelerator"] == "cuda"


def test_cuda_autocast_policy(semantics):
    calls = semantics["calls"]
    names = ("addmm", "mm", "native_layer_norm", "_log_softmax", "nll_loss_forward")
    dtypes = {name: {d for n, d, _ in calls if n == name} for name in names}
    # torch's CUDA autocast lists (CPU autocast's differ): matmuls in bfloat16, layer norm in
    # float32; cross_entropy's log_softmax keeps the logits' bfloat16 (it passes their dtype),
    # nll_loss runs in float32
    assert dtypes["addmm"] == {"torch.bfloat16"} and "torch.bfloat16" in dtypes["mm"]
    assert dtypes["native_layer_norm"] == {"torch.float32"}
    assert dtypes["_log_softmax"] == {"torch.bfloat16"} and dtypes["nll_loss_forward"] == {"torch.float32"}


def test_sdpa_takes_flash_and_never_builds_the_score_matrix(semantics):
    names = {n for n, _, _ in semantics["calls"]}
    assert {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"} <= names
    assert not [c for c in semantics["calls"] if c[2][-2:] == [64, 64] and len(c[2]) == 4]  # no (B, H, L, L) tensor


def test_cuda_optimizer_default_is_foreach(semantics):
    assert semantics["foreach"] == [True]
    assert any(n.startswith("_foreach_") for n, _, _ in semantics["calls"])


def test_checkpoint_recompute_and_the_api_on_a_cnn(semantics):
    assert semantics["checkpoint_grad"] == [2, 64, 64]
    cnn = semantics["cnn"]
    assert cnn["device"] == "fake:cuda:0" and cnn["peak"] > 0 and "convolution" in cnn["ops"]


@pytest.mark.parametrize(
    ("dtype", "mask", "heads_kv", "head_dim", "kernel"),
    [
        (torch.bfloat16, False, 8, 64, "flash"),
        (torch.float16, False, 2, 128, "flash"),  # GQA: flash takes it natively
        (torch.bfloat16, True, 8, 64, "efficient"),  # a mask: not flash
        (torch.float32, False, 8, 64, "efficient"),
        (torch.bfloat16, False, 8, 512, "efficient"),  # head dim over flash's 256
        (torch.float32, False, 2, 64, "math"),  # GQA without flash
    ],
)
def test_sdpa_kernel_choice(dtype, mask, heads_kv, head_dim, kernel):
    q = torch.empty(2, 8, 16, head_dim, dtype=dtype, device="meta")
    kv = torch.empty(2, heads_kv, 16, head_dim, dtype=dtype, device="meta")
    m = torch.empty(16, 16, dtype=torch.bool, device="meta") if mask else None
    assert _fake_cuda.sdpa_kernel(q, kv, kv, m, heads_kv != 8, (9, 0)) == kernel


@pytest.mark.parametrize(
    "argv, asked",
    [
        (["py", "-m", "memfit", "profile", "gpt", "--device", "fake-cuda"], True),
        (["py", "-u", "-X", "dev", "-m", "memfit", "profile", "--device=fake-cuda"], True),
        (["py", "-mmemfit", "plan", "--device", "fake-cuda"], True),
        (["py", "/venv/bin/memfit", "profile", "--device", "fake-cuda"], True),
        (["py", "-m", "other", "--device", "fake-cuda"], False),
        (["py", "script.py", "--device", "fake-cuda"], False),
        (["py", "-m", "memfit", "profile", "gpt"], False),
        (["py", "-m", "memfit", "finetune", "config.json", "--gpu", "L4"], True),  # fake CUDA only
        (["py", "/venv/bin/memfit", "--traceback", "finetune", "config.json"], True),
        (["py", "-m", "memfit", "estimate", "finetune"], False),  # a model type named so, not the command
    ],
)
def test_the_memfit_command_asking_for_fake_cuda_is_recognised(argv, asked):
    assert _fake_cuda._is_fake_cuda_command(argv) is asked  # whatever options the interpreter got first


def test_import_memfit_reads_no_command_line(tmp_path):
    """``import memfit`` decides nothing from the command line: a program whose ``sys.argv`` and
    ``sys.orig_argv`` read like the memfit command asking for fake CUDA imports it as any other
    (the command decides at its edge, :func:`memfit.cli.main`). No shim is built or loaded."""
    code = textwrap.dedent(
        """
        import os, sys
        sys.argv = ["memfit", "profile", "gpt", "--device", "fake-cuda"]
        sys.orig_argv = [sys.executable, "-m", "memfit", "profile", "gpt", "--device", "fake-cuda"]
        import memfit, torch
        from memfit.cuda import fake
        print(fake.active(), torch.accelerator.current_accelerator(), os.environ.get("MEMFIT_FAKE_CUDA"))
        """
    )
    done = _run(["-c", code], _env(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "None"]
    assert not (tmp_path / "cache").exists()  # nothing built


def test_api_after_torch_was_imported_says_what_to_do():
    # this process imported torch without the shim: refused in one line, nothing run
    model = torch.nn.Linear(4, 4)
    with pytest.raises(memfit.MemfitError, match="must be loaded before torch.*--device fake-cuda.*MEMFIT_FAKE_CUDA=1") as info:
        memfit.profile(model, torch.randn(2, 4), fake="cuda")
    assert "\n" not in str(info.value)


def test_cli_in_a_process_with_torch_already_imported(capsys):
    assert main(["profile", "gpt", "--device", "fake-cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfit: error: fake CUDA must be loaded before torch") and "\n" not in err


@_NOT_ON_A_CUDA_BUILD
def test_no_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(_fake_cuda.FakeCudaError, match="is not a program on this machine.*--device fake") as info:
        _fake_cuda.build(cache=tmp_path / "cache")
    assert "\n" not in str(info.value)


@_NOT_ON_A_CUDA_BUILD
def test_cli_without_compiler_exits_2_in_one_line(tmp_path):
    env = _env(tmp_path / "empty-cache", CXX=str(tmp_path / "no-such-g++"))
    done = _run(["-m", "memfit", "profile", "gpt", "--device", "fake-cuda"], env)
    assert done.returncode == 2
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert lines == [lines[0]] and lines[0].startswith("memfit: error: fake CUDA builds a small C++ library")


def test_canary_private_torch_corners():
    """What the shim and its Python side lean on; a torch release that moves one fails here."""
    torch_dir = Path(torch.__file__).parent
    for header in ("ATen/detail/CUDAHooksInterface.h", "c10/core/impl/FakeGuardImpl.h"):
        assert (torch_dir / "include" / header).exists(), header
    text = (torch_dir / "include/ATen/detail/CUDAHooksInterface.h").read_text()
    assert "CUDAHooksRegistry" in text and "virtual bool hasCUDA() const" in text
    assert callable(torch.cuda.amp.common.amp_definitely_not_available)
    assert callable(torch.accelerator.current_accelerator)
    from torch.optim.optimizer import _foreach_supported_types, _get_foreach_kernels_supported_devices

    assert "cuda" in _get_foreach_kernels_supported_devices() and torch.Tensor in _foreach_supported_types
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default._schema
    assert [a.name for a in flash.arguments][:6] == ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"]
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default._schema
    assert [a.name for a in efficient.arguments][:7] == [
        "query",
        "key",
        "value",
        "attn_bias",
        "compute_log_sumexp",
        "dropout_p",
        "is_causal",
    ]
    assert _fake_cuda._cxx11_abi(torch_dir / "lib") == int(torch._C._GLIBCXX_USE_CXX11_ABI)


def test_cxx11_abi_is_read_from_c10s_own_symbols(tmp_path):
    # torch 2.6's wheels (old ABI) carry libstdc++'s __cxx11 symbols too; only c10's own decide
    old = b"\0_ZGTtNSt11logic_errorC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE\0_ZN3c106detail14torchCheckFailEPKcS2_jRKSs\0"
    new = b"\0_ZN3c106detail14torchCheckFailEPKcS2_jRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE\0"
    for data, want in ((old, 0), (new, 1)):
        (tmp_path / "libc10.so").write_bytes(data)
        assert _fake_cuda._cxx11_abi(tmp_path) == want


def test_the_shim_is_cached_per_torch(shim_cache):
    built = list(shim_cache.glob("fake_cuda-torch*.so"))
    assert len(built) == 1 and torch.__version__ in built[0].name
    assert _fake_cuda.build(cache=shim_cache) == built[0]  # no rebuild


# --- what no tensor shows, and a GPU to plan for (issue 14, items 3 and 4) -------------------

TINY = ["gpt", "--batch-size", "2", "--size", "n_layer=2", "--size", "n_embd=64", "--size", "n_head=4", "--size", "block_size=64"]


def _profile_json(fake_cuda, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "p.json"
    done = fake_cuda.cli(["profile", *TINY, "--device", "fake-cuda", "--json", str(out), *args])
    assert done.returncode == 0, done.stderr
    return done, json.loads(out.read_text())


def _cublas_blocks(data: dict) -> list[dict]:
    return [b for b in data["ledger"]["blocks"] if b["category"] == "kernel_workspace" and b["born"] == -1]


def test_training_step_on_an_sm80_gpu_holds_two_cublas_workspaces_and_does_not_fit_a_small_capacity(fake_cuda, tmp_path):
    capacity = 600 * 2**20  # the 512 MiB context estimate and a ~20 MiB peak: fits; 530 MiB: not
    done, data = _profile_json(fake_cuda, tmp_path, "--gpu", "A100-40GB", "--capacity", str(530 * 2**20))
    blocks = _cublas_blocks(data)
    # the forward thread's and autograd's, ":4096:2:16:8" before Hopper
    assert [b["nbytes"] for b in blocks] == [8_519_680, 8_519_680] and all(b["died"] is None for b in blocks)
    assert data["ledger"]["cublas_workspaces"] == 2 and data["breakdown"]["kernel_workspace"] >= 2 * 8_519_680
    assert data["gpu"]["key"] == "A100-40GB" and data["gpu"]["capability"] == [8, 0]
    fit = data["device_fit"]
    context = fit["outside_allocator"][0]
    assert context["name"] == "cuda_context" and "estimate" in context["source"]
    # judged by what the caching allocator reserves (what runs out), not the tensor peak
    assert data["reserved_peak_bytes"] >= data["allocated_peak_bytes"] >= data["peak_bytes"]
    assert data["headroom_bytes"] == 530 * 2**20 - context["bytes"] - data["reserved_peak_bytes"] < 0
    text = " ".join(done.stdout.split())  # the console wraps at 80 columns
    assert data["fits"] is False and "does not fit" in text and "a prediction on fake tensors" in text
    assert 530 * 2**20 < context["bytes"] + data["reserved_peak_bytes"] < capacity  # so the other answer needs only more capacity


def test_forward_only_step_on_hopper_holds_one_32mib_workspace_and_fits(fake_cuda, tmp_path):
    done, data = _profile_json(fake_cuda, tmp_path, "--gpu", "h100-80gb", "--eval")
    assert [b["nbytes"] for b in _cublas_blocks(data)] == [32 * 2**20]
    assert data["capacity_bytes"] == 81559 * 2**20 and data["fits"] is True
    assert data["headroom_bytes"] == data["capacity_bytes"] - 512 * 2**20 - data["reserved_peak_bytes"] > 0
    assert "fits, with" in done.stdout


def test_unknown_gpu_is_a_one_line_error(fake_cuda, capsys):
    done = fake_cuda.cli(["profile", *TINY, "--device", "fake-cuda", "--gpu", "GTX-480"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "unknown GPU 'GTX-480'" in done.stderr and "A100-80GB" in done.stderr and "T4" in done.stderr
    # --gpu without fake CUDA, in this process (no shim)
    try:
        code = main(["profile", *TINY, "--gpu", "T4"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and "--device fake-cuda" in capsys.readouterr().err


def test_max_batch_on_fake_cuda_predicts_from_peaks_without_timing(fake_cuda, tmp_path):
    out = tmp_path / "mb.json"
    budget = 700 * 2**20
    # one layer (the last --size wins): the search's fake-CUDA profiles cost per op, and what
    # a line of peaks says holds at any depth (two layers took about half as long again)
    tiny = [*TINY, "--size", "n_layer=1"]
    args = ["fit", "--max-batch", *tiny, "--device", "fake-cuda", "--gpu", "T4", "--capacity", str(budget)]
    done = fake_cuda.cli([*args, "--json", str(out)])
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["predicted_only"] is True and data["recipe"] is None and data["device"] == "fake:cuda:0"
    assert data["budget_bytes"] == budget - 512 * 2**20  # capacity less the CUDA context estimate
    plain = next(lim for lim in data["limits"] if lim["levers"] == [])
    # the line's own figures put the batch at the budget: one more sample would not fit
    assert plain["peak_bytes"] <= data["budget_bytes"] < plain["peak_bytes"] + 2 * plain["bytes_per_sample"]
    assert data["batch_size"] >= plain["max_batch"] > 2 and "no recipe is timed" in done.stdout


def test_fit_on_fake_cuda_weighs_expandable_segments_by_reserved_and_predicts_times(fake_cuda, tmp_path):
    """The tiny step reserves 113,246,208 B with the default allocator and 109,051,904 B with
    expandable segments (the same ledger, other segments): a budget between them is met by
    the allocator setting alone, at no predicted cost; the budget bounds reserved bytes."""
    out = tmp_path / "r.json"
    budget = 111_000_000
    done = fake_cuda.cli(["fit", *TINY, "--device", "fake-cuda", "--budget", f"{budget}B", "--json", str(out)])
    assert done.returncode == 0, done.stderr
    recipe = json.loads(out.read_text())
    assert recipe["device"] == "fake:cuda:0" and recipe["times_predicted"] is True
    assert recipe["levers"] == ["expandable_segments"] and recipe["allocator_conf"] == "expandable_segments:True"
    assert recipe["base_peak_bytes"] > budget >= recipe["predicted_peak_bytes"] >= recipe["allocated_peak_bytes"]
    assert recipe["measured_peak_bytes"] is None and recipe["measured_step_time_s"] is None
    assert recipe["predicted_step_time_s"] > 0 and recipe["search"]["timed"] == 0 and recipe["search"]["probes"] == 0
    text = " ".join(done.stdout.split())
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text and "predicted by the cost model" in text
    # the same step profiled on fake CUDA with that environment reserves what the recipe predicted
    prof = tmp_path / "p.json"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = fake_cuda.cli(["profile", *TINY, "--device", "fake-cuda", "--json", str(prof)], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(prof.read_text())["reserved_peak_bytes"] == recipe["predicted_peak_bytes"]


PLAN_SCRIPT = textwrap.dedent(
    """
    import json, memfit
    w = memfit.load_target("gpt", batch_size=4, sizes={"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 512})
    kw = dict(loss_fn=w.loss_fn, targets=w.targets)
    base = memfit.profile(w.model, w.inputs, optimizer=w.make_optimizer(), fake="cuda", **kw)
    # a budget under the step's reserved peak but over its allocated one: met only if the
    # plan is judged by what it reserves (the reserved peaks replay the training loop from an
    # empty cache: the lowest a plan reaches is over the step's allocated peak here)
    budget = base.reserved_peak_bytes - 8 * 2**20
    planned = []
    plan = memfit.plan(w.model, w.inputs, budget, optimizer=w.make_optimizer(), fake="cuda", on_planned=planned.append, **kw)
    memfit.apply(w.model, plan)
    after = memfit.profile(w.model, w.inputs, optimizer=w.make_optimizer(), fake="cuda", **kw)
    # float16 autocast takes the flash kernel: its softmax_d and float32 dq_accum, estimated
    tiny = memfit.load_target("gpt", batch_size=2, sizes={"n_layer": 1, "n_embd": 64, "n_head": 4, "block_size": 100})
    half = memfit.profile(
        tiny.model, tiny.inputs, loss_fn=tiny.loss_fn, targets=tiny.targets, fake="cuda",
        step=memfit.StepOptions(autocast="float16"),
    )
    led = half.ledger
    flash = [
        b.nbytes for b in led.blocks
        if b.category.value == "kernel_workspace" and b.born >= 0 and "attention_backward" in led.ticks[b.born].op
    ]
    print("RESULT" + json.dumps({
        "flash": flash, "flash_ops": sorted({t.op for t in led.ticks if "attention_backward" in t.op}),
        "budget": budget, "base_reserved": base.reserved_peak_bytes, "base_allocated": base.allocated_peak_bytes,
        "plan": plan.to_dict(), "reserved": after.reserved_peak_bytes, "allocated": after.allocated_peak_bytes,
        "drawn": [planned[0].reserved_peak_bytes, planned[0].allocated_peak_bytes, len(planned[0].ledger.ticks)],
        "ticks": len(after.ledger.ticks),
    }))
    """
)


def test_plan_on_fake_cuda_meets_a_reserved_budget_when_the_planned_step_is_profiled_again(fake_cuda):
    done = fake_cuda.script(PLAN_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    plan = r["plan"]
    assert r["base_reserved"] > r["budget"] > r["base_allocated"] and plan["checkpointed"]
    assert plan["peak_basis"] == "reserved_peak_bytes" and plan["none_peak_bytes"] == r["base_reserved"]
    # the planned step, profiled again with the plan applied, reserves exactly what the plan predicted
    assert r["reserved"] == plan["predicted_peak_bytes"] <= r["budget"]
    assert r["allocated"] == plan["allocated_peak_bytes"] < plan["predicted_peak_bytes"]
    # what `memfit plan --plot` draws as the planned step (the run that verified the plan) is that profile
    assert r["drawn"] == [r["reserved"], r["allocated"], r["ticks"]]
    # flash backward at (batch 2, heads 4, seq 100, dim 16): softmax_d 2*4*128 floats and
    # dq_accum 2*128*4*32 floats (seq rounded to 128, dim to 32), each in 512 B blocks
    assert r["flash_ops"] == ["_scaled_dot_product_flash_attention_backward"]
    assert r["flash"] == [2 * 4 * 128 * 4 + 2 * 128 * 4 * 32 * 4]


def test_fit_on_fake_cuda_predicts_step_times_at_the_chosen_gpus_rates(fake_cuda, tmp_path):
    """A T4 (65 dense half TFLOP/s, 320 GB/s) runs the same step slower than an H100 (989, 3,350 GB/s)."""
    times = {}
    for name in ("T4", "H100-80GB"):
        out = tmp_path / f"{name}.json"
        done = fake_cuda.cli(["fit", *TINY, "--device", "fake-cuda", "--gpu", name, "--json", str(out)])
        assert done.returncode == 0, done.stderr
        times[name] = json.loads(out.read_text())["base_step_time_s"]
    assert times["T4"] > times["H100-80GB"] > 0
