"""LLM.int8: peft's LoRA on a base whose linear layers are bitsandbytes ``Linear8bitLt``
(``BitsAndBytesConfig(load_in_8bit=True)``; issue 27 item 2, extended).

- bitsandbytes' int8 corners memfit copies still look as :mod:`memfit.compat.bnb8bit` says
  (kernel names and sources, ``MatMul8bitLt``'s forward and backward, the CPU/CUDA dispatch);
- the ledger holds each int8 weight (``n*m`` bytes) and its float32 row scales, equal to the
  closed form, on CPU (real = fake, the meta-built model of ``memfit finetune`` the same as
  the one bitsandbytes quantized by hand) and on fake CUDA (512-byte blocks);
- on fake CUDA, a one-layer model's peak is the hand count of ``MatMul8bitLt``'s forward
  (float16 copy, int8 rows, row scales, outlier search, int32 product, float16 and bfloat16
  outputs), with no outlier columns and with 8 assumed;
- ``prepare_model_for_kbit_training`` casts all but the int8 weights; gradient checkpointing
  runs; a recompute plan's predicted peak is the planned model's on fake CUDA, and the plan
  trains bitwise (CPU, real bitsandbytes);
- bad input is refused in one line.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY_LLAMA_CONFIG, LazyModule, adapter_adamw, assert_equivalent, needs, tiny_llama_inputs

import memfit
from memfit.cli import main
from memfit.errors import TargetError
from memfit.measure.ledger import Category, Phase

pytestmark = needs("transformers", "peft", "bitsandbytes")
tf = LazyModule("transformers", then=lambda tf: tf.logging.set_verbosity_error())
peft = LazyModule("peft")
bnb = LazyModule("bitsandbytes")

CONFIG = TINY_LLAMA_CONFIG
Q = "base_model.model.model.layers.1.self_attn.q_proj.base_layer"


def int8(rank: int = 4, seed: int = 0) -> torch.nn.Module:
    """The usual way: real bf16 weights, each linear but the head a ``Linear8bitLt``
    (``has_fp16_weights=False``, threshold 6.0, as transformers' ``load_in_8bit=True`` makes
    it) quantized by bitsandbytes on ``.to(device)``, then peft (its 8-bit LoRA layer)."""
    cfg = tf.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}, use_cache=False)
    torch.manual_seed(seed)
    base = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    for parent in list(base.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False, has_fp16_weights=False, threshold=6.0)
                q.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
                setattr(parent, name, q.to("cpu"))  # bitsandbytes quantizes here
    base.is_loaded_in_8bit = True  # as transformers' 8-bit loader marks it: peft then wraps with its 8-bit layer
    return peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"]))


_inputs, _adamw = tiny_llama_inputs, adapter_adamw  # (the scripts run in fake-CUDA children import them from here)


def closed_form(block: int = 1) -> int:
    """Bytes of the parameters of :data:`CONFIG`'s 8-bit LoRA (rank 4 on q_proj, v_proj) from
    shapes alone: bf16 embeddings, head and norms; float32 adapters; per int8 weight ``n*k``
    bytes and ``n`` float32 row scales. ``block``: the allocator's rounding (512 on CUDA)."""
    h, i, v, layers, kv = 64, 128, 128, 2, 64 * 2 // 4
    r = lambda n: -(-n // block) * block  # noqa: E731
    total = 2 * r(v * h * 2) + r(h * 2)  # embeddings, head, final norm
    linears = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down: (out, in)
    for _ in range(layers):
        total += 2 * r(h * 2)  # two norms
        total += r(4 * h * 4) + r(h * 4 * 4) + r(4 * h * 4) + r(kv * 4 * 4)  # float32 adapters: q_proj's A, B; v_proj's
        total += sum(r(n * k) + r(n * 4) for n, k in linears)
    return total


def _parameter_bytes(prof: memfit.Profile) -> int:
    return sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.PARAMETER)


def test_bitsandbytes_int8_corners_are_as_memfit_expects():
    """What :mod:`memfit.compat.bnb8bit` copies: fails when a bitsandbytes release changes it."""
    pytest.importorskip("bitsandbytes")
    from memfit.compat import bnb8bit

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in bnb8bit.FAKE_CUDA_KERNELS:
        assert has(name, "Meta"), f"{name} has no fake/meta kernel"
    # the mixed and scaled matmuls and the dequantize are Python "default" kernels on CUDA too (copied line for line)
    for op in ("int8_mixed_scaled_mm", "int8_scaled_mm", "int8_vectorwise_dequant"):
        assert not has(f"bitsandbytes::{op}", "CUDA") and has(f"bitsandbytes::{op}", "CompositeExplicitAutograd"), op
    root = Path(bnb.__file__).parent
    cuda, default = (root / "backends" / "cuda" / "ops.py").read_text(), (root / "backends" / "default" / "ops.py").read_text()
    autograd = (root / "autograd" / "_functions.py").read_text()
    for line in (
        "outliers = A.abs() >= threshold",
        "outlier_cols = torch.argwhere(outliers.any(dim=0)).view(-1)",
        "outlier_cols = torch.empty(0, device=A.device, dtype=torch.int64)",
        "out_row[:, outlier_cols] = 0",
        "out = torch.empty_like(A, dtype=torch.float16)",
        "return out.to(dtype or torch.float16)",
        "if lda % 4 != 0:",
    ):
        assert line in cuda, line
    for line in (
        "subA = A[:, outlier_cols].contiguous()",
        "torch.ops.bitsandbytes.int8_vectorwise_dequant.default(CB[:, outlier_cols].contiguous(), SCB)",
        "subA = torch.empty(0, device=A.device, dtype=A.dtype)",
        "output = output.addmm(subA, subB)",
        "out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(A, B)",
    ):
        assert line in default, line
    assert "return A * stats.view(-1, 1) * 7.874015718698502e-3" in (root / "_ops.py").read_text()
    for line in (
        "CA, SCA, outlier_cols = F.int8_vectorwise_quant(A.to(torch.float16), threshold=state.threshold)",
        "ctx.tensors = (CAt, subA, A)",
        "CB = state.CB.to(ctx.dtype_A, copy=True).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))",
        'if A.device.type in ("cpu", "xpu"):\n            return MatMul8bitFp.apply(A, B, out, bias, state)',
    ):
        assert line in autograd, line
    layer = bnb.nn.Linear8bitLt(8, 4, has_fp16_weights=False, threshold=6.0)
    assert layer.state.threshold == 6.0 and type(layer.state).__name__ == "MatmulLtState"
    assert {"CB", "SCB", "has_fp16_weights"} <= set(vars(layer.weight))


@pytest.mark.slow
def test_cpu_ledger_holds_int8_weights_and_row_scales_real_equals_fake(tmp_path):
    from memfit.integrations.finetune import LoraSpec, lora_model

    model = int8()
    inputs = _inputs(2, 16)
    real = memfit.profile(model, inputs, optimizer=_adamw(model))
    fake = memfit.profile(model, inputs, optimizer=_adamw(model), fake=True)
    assert _parameter_bytes(real) == _parameter_bytes(fake) == closed_form()
    assert real.peak_bytes == fake.peak_bytes and real.breakdown == fake.breakdown
    # on the CPU, bitsandbytes trains through MatMul8bitFp: the weight dequantized to bf16 in the forward
    sizes = [b.nbytes for b in real.ledger.blocks if b.module == Q and b.phase is Phase.FORWARD]
    assert 64 * 64 * 2 in sizes, sizes
    # the meta-built model of memfit finetune is the one bitsandbytes quantized, byte for byte
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    built = lora_model(str(cfg), LoraSpec(4, None, ("q_proj", "v_proj"), quant="8bit"))
    assert built.base_model.model.is_loaded_in_8bit
    assert type(built.get_submodule(Q.rsplit(".", 1)[0])).__name__ == "Linear8bitLt"  # peft's 8-bit LoRA layer
    meta = memfit.profile(built, {**inputs, "use_cache": False}, optimizer=_adamw(built), fake=True)
    assert (meta.peak_bytes, meta.breakdown) == (fake.peak_bytes, fake.breakdown)


@pytest.mark.slow
def test_plan_on_an_int8_model_trains_bitwise():
    model = int8()
    inputs = {**_inputs(2, 16), "use_cache": False}
    plan = memfit.plan(model, inputs, 0.0, optimizer=_adamw(model))
    assert plan.checkpointed and plan.predicted_peak_bytes < plan.none_peak_bytes
    trained = assert_equivalent(copy.deepcopy(model), inputs, lambda out: out.loss, plan)
    assert {n for n, p in trained.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }


def test_kbit_prep_casts_all_but_the_int8_weights(tmp_path):
    from memfit.integrations.finetune import LoraSpec, lora_inputs, lora_model

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    spec = LoraSpec(4, None, ("q_proj", "v_proj"), quant="8bit", kbit_prep=True)
    prepared, plain = lora_model(str(cfg), spec), lora_model(str(cfg), dataclasses.replace(spec, kbit_prep=False))
    before = {n: p for n, p in plain.named_parameters()}
    changed = {n: p for n, p in prepared.named_parameters() if p.dtype != before[n].dtype}
    assert changed and all(before[n].dtype == torch.bfloat16 and p.dtype == torch.float32 for n, p in changed.items())
    assert all(any(w in n for w in ("embed_tokens", "norm", "lm_head")) for n in changed), sorted(changed)
    assert sum(p.dtype == torch.int8 for p in prepared.parameters()) == 2 * 7  # every linear of both layers
    figures = [_parameter_bytes(memfit.profile(m, lora_inputs(m, 1, 16), fake=True)) for m in (prepared, plain)]
    assert figures[0] - figures[1] == sum(2 * p.numel() for p in changed.values())


def test_bad_input_is_refused_in_one_line(tmp_path, capsys):
    from memfit.compat import bnb8bit
    from memfit.integrations.finetune import LoraSpec

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    for argv, words in (
        (["--int8-outliers", "4"], "--quant 8bit"),
        (["--quant", "8bit", "--int8-outliers", "-1"], "non-negative"),
        (["--kbit-prep"], "--quant 4bit or 8bit"),
    ):
        assert main(["finetune", str(cfg), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, (argv, err)
    with pytest.raises(TargetError, match="non-negative"):
        LoraSpec(quant="8bit", int8_outliers=True).check()
    with pytest.raises(ValueError, match="non-negative"):
        with bnb8bit.assume_outliers(-2):
            pass
    assert bnb8bit.assumed_outliers() == 0


ONE_LAYER = textwrap.dedent(
    """
    import copy, json, sys, memfit, torch, bitsandbytes as bnb
    from torch import nn
    sys.path.insert(0, TESTS)
    from memfit.cli import main
    from memfit.compat import bnb8bit
    from memfit.measure.ledger import Category, Phase
    from test_int8 import int8, _inputs, _adamw, Q
    R, H, N = 1024, 256, 512

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(H, dtype=torch.bfloat16))  # trainable: the 8-bit layer's input needs grad
            fc = bnb.nn.Linear8bitLt(H, N, bias=False, has_fp16_weights=False, threshold=6.0)
            fc.weight = bnb.nn.Int8Params(torch.randn(N, H, dtype=torch.bfloat16), requires_grad=False, has_fp16_weights=False)
            self.fc = fc.to("cpu")

        def forward(self, x):
            return self.fc(x * self.scale)

    one, out = One(), {}
    for n in (0, 8):
        with bnb8bit.assume_outliers(n):
            prof = memfit.profile(one, torch.randn(R, H, dtype=torch.bfloat16), loss_fn=lambda y: y.float().sum(),
                                  optimizer=torch.optim.AdamW([one.scale]), fake="cuda", gpu="A100-80GB")
        blocks = prof.ledger.blocks
        out[n] = {"allocated": prof.cuda_memory.allocated_peak_bytes,
                  "workspaces": [b.nbytes for b in blocks if b.category is Category.WORKSPACE and b.phase is Phase.START],
                  "fc": [[b.nbytes, b.phase.name] for b in blocks if b.module == "fc"]}
    assert main(["finetune", CFG, "--quant", "8bit", "--seq-len", "1024", "--batch-size", "2", "--lora-rank", "4",
                 "--gpu", "A100-80GB", "--json", OUT]) == 0
    model = int8()
    trainer = memfit.StepOptions(drops_output=True)  # memfit finetune's step: the Trainer's, the logits dropped before backward
    prof = memfit.profile(model, _inputs(2, 1024), optimizer=_adamw(model), fake="cuda", gpu="A100-80GB", step=trainer)
    out["hand"] = {"allocated": prof.cuda_memory.allocated_peak_bytes, "reserved": prof.cuda_memory.reserved_peak_bytes,
                   "breakdown": prof.breakdown,
                   "parameters": sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.PARAMETER)}
    # a recompute plan on fake CUDA: its predicted reserved peak is the one the planned model measures
    inputs = {**_inputs(2, 1024), "use_cache": False}
    plan = memfit.plan(model, inputs, 0.0, optimizer=_adamw(model), fake="cuda")
    planned = memfit.apply(copy.deepcopy(model), plan)
    measured = memfit.profile(planned, inputs, optimizer=_adamw(planned), fake="cuda").cuda_memory.reserved_peak_bytes
    out["plan"] = {"checkpointed": len(plan.checkpointed), "predicted": plan.predicted_peak_bytes, "measured": measured}
    assert main(["finetune", CFG, "--quant", "8bit", "--kbit-prep", "--gradient-checkpointing", "--seq-len", "256",
                 "--int8-outliers", "64", "--json", OUT + ".prep"]) == 0
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_fake_cuda_one_layer_peak_is_the_hand_count_and_the_cli_is_the_hand_built_model(fake_cuda, tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    answer = tmp_path / "answer.json"
    script = ONE_LAYER.replace("TESTS", repr(str(Path(__file__).parent))).replace("CFG", repr(str(cfg)))
    done = fake_cuda.script(script.replace("OUT", repr(str(answer))), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    R, H, N = 1024, 256, 512
    start = H * 2 + N * H + N * 4 + 2 * H * 2 + R * H * 2  # scale, int8 weight, row scales, AdamW's two moments, input
    # the forward's peak, in int8_mm_dequant's cast: x * scale (kept by MatMul8bitLt for backward), the int8
    # rows and row scales of the input, the int32 product, its float16 dequantized form, the bf16 output
    forward = R * H * 2 + R * H + R * 4 + R * N * 4 + R * N * 2 + R * N * 2
    plain = got["0"]
    assert plain["allocated"] == start + sum(plain["workspaces"]) + forward, plain
    # before it, freed: the input's float16 copy, |x| (float16) and |x| >= 6 (bool), .any() (one 512-byte block)
    assert [n for n, phase in plain["fc"] if phase == "FORWARD"][:6] == [R * H * 2, R * 4, R * H, R * H * 2, R * H, 512]
    # backward: the weight dequantized to bf16 (and the scales / 127, float32) for the input's gradient
    assert [n for n, phase in plain["fc"] if phase == "BACKWARD"] == [N * H * 2, N * 4, R * H * 2]
    # 8 outlier columns: their index (int64), the input's columns (bf16, kept for backward), the weight's
    # (dequantized to bf16) alive at the peak; addmm adds the outliers' product (cuBLAS in the forward too)
    eight = got["8"]
    assert eight["allocated"] == start + sum(eight["workspaces"]) + forward + 512 + R * 8 * 2 + N * 8 * 2, eight
    assert len(eight["workspaces"]) == len(plain["workspaces"]) + 1
    # memfit finetune's meta-built model is the one bitsandbytes quantized on the CPU, byte for byte
    cli, hand = json.loads(answer.read_text()), got["hand"]
    assert hand["parameters"] == closed_form(block=512)
    assert (cli["profile"]["allocated_peak_bytes"], cli["profile"]["reserved_peak_bytes"]) == (hand["allocated"], hand["reserved"])
    assert cli["profile"]["breakdown"] == hand["breakdown"]
    assert cli["int8_outliers_assumed"] == 0 and "0 outlier columns assumed" in cli["workload"]
    plan = got["plan"]
    assert plan["checkpointed"] > 0 and plan["predicted"] == plan["measured"], plan
    prep = json.loads(Path(str(answer) + ".prep").read_text())
    assert prep["int8_outliers_assumed"] == 64 and "float32 elsewhere" in prep["workload"]
    assert "assumed: 64 outlier columns" in done.stdout
