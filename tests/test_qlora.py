"""QLoRA: peft's LoRA on a base whose linear layers are bitsandbytes 4-bit (issue 27 item 2).

- bitsandbytes' ops memfit relies on still look as :mod:`memfit.compat.bnb4bit` says
  (fake kernels, the CPU matmul a Python kernel, the CUDA dequantize threshold);
- the ledger holds each 4-bit weight's packed bytes and its quantization state, equal to
  the closed form (NF4 and FP4, double quantization on and off), on CPU (real = fake) and
  on fake CUDA (512-byte blocks), from ``memfit finetune --quant 4bit`` (meta-built) as from
  the model quantized by bitsandbytes on the CPU by hand;
- the dequantized weight of each matmul is a temporary of the step on CPU (bitsandbytes'
  CPU kernel) and on fake CUDA past 1536 rows (its CUDA fallback), not below;
- a recompute plan on a QLoRA model trains bitwise as without it (CPU, real bitsandbytes);
- a paged optimizer's paged state is outside the ledger, on a line of its own.
"""

from __future__ import annotations

import copy
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY_LLAMA_CONFIG, LazyModule, adapter_adamw, assert_equivalent, needs, tiny_llama_inputs

import memfit
from memfit.cli import main
from memfit.measure.ledger import Category, Phase

pytestmark = needs("transformers", "peft", "bitsandbytes")
tf = LazyModule("transformers", then=lambda tf: tf.logging.set_verbosity_error())
peft = LazyModule("peft")  # imported when a test first uses it: collecting this file imports none of the three
bnb = LazyModule("bitsandbytes")

CONFIG = TINY_LLAMA_CONFIG


def qlora(quant_type: str = "nf4", double: bool = True, rank: int = 4, seed: int = 0) -> torch.nn.Module:
    """The usual way on a CPU: real bf16 weights, each linear but the head quantized by
    bitsandbytes (``Linear4bit(...).to("cpu")``), then peft (its 4-bit LoRA layer)."""
    cfg = tf.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}, use_cache=False)
    torch.manual_seed(seed)
    base = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    for parent in list(base.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                q = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16,
                    compress_statistics=double, quant_type=quant_type,
                )
                q.weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, compress_statistics=double, quant_type=quant_type, module=q
                )
                setattr(parent, name, q.to("cpu"))  # bitsandbytes quantizes here
    base.is_loaded_in_4bit = True  # as transformers' 4-bit loader marks it: peft then wraps with its 4-bit layer
    return peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"]))


_inputs, _adamw = tiny_llama_inputs, adapter_adamw  # (the scripts run in fake-CUDA children import them from here)


def _round(n: int, block: int) -> int:
    return -(-n // block) * block


def closed_form(double: bool, block: int = 1) -> int:
    """Bytes of the parameters of :data:`CONFIG`'s QLoRA (rank 4 on q_proj, v_proj) from
    shapes alone: bf16 embeddings, head and norms; float32 adapters; per 4-bit weight
    ``n*k/2`` packed bytes, its 16-entry float32 code and the absmax of each 64 values (float32;
    doubly quantized: uint8, a float32 offset, a float32 absmax per 256 blocks and the
    256-entry float32 code, which ``quantize_blockwise`` copies for each weight). ``block``: the allocator's rounding (512 on CUDA)."""
    h, i, v, layers, kv = 64, 128, 128, 2, 64 * 2 // 4
    r = lambda n: _round(n, block)  # noqa: E731
    total = 2 * r(v * h * 2) + r(h * 2)  # embeddings, head, final norm
    linears = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down: (out, in)
    for _ in range(layers):
        total += 2 * r(h * 2)  # two norms
        total += r(4 * h * 4) + r(h * 4 * 4) + r(4 * h * 4) + r(kv * 4 * 4)  # float32 adapters: q_proj's A, B; v_proj's
        for n, k in linears:
            blocks = math.ceil(n * k / 64)
            total += r(n * k // 2) + r(16 * 4)
            total += r(blocks) + r(4) + r(math.ceil(blocks / 256) * 4) + r(256 * 4) if double else r(blocks * 4)
    return total


def _parameter_bytes(prof: memfit.Profile) -> int:
    return sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.PARAMETER)


def test_bitsandbytes_ops_are_as_memfit_expects():
    """What :mod:`memfit.compat.bnb4bit` rests on: fails when a bitsandbytes release changes it."""
    pytest.importorskip("bitsandbytes")  # its ops are registered at its import (bnb is imported lazily)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("quantize_4bit", "dequantize_4bit", "dequantize_blockwise", "quantize_blockwise", "gemm_4bit"):
        assert has(f"bitsandbytes::{op}", "Meta"), f"{op} has no fake/meta kernel"
    # the CPU 4-bit matmul is the Python default kernel (recorded inside), not a C++ one
    assert not has("bitsandbytes::gemm_4bit", "CPU") and has("bitsandbytes::gemm_4bit", "CompositeExplicitAutograd")
    source = (Path(bnb.__file__).parent / "backends" / "cuda" / "ops.py").read_text()
    from memfit.compat import bnb4bit

    assert f"_gemm_4bit_custom_max_m = {bnb4bit.CUSTOM_MAX_ROWS}" in source
    assert "return _dequant_linear_fallback(" in source
    import bitsandbytes.functional as F

    assert isinstance(F.name2qmap, dict)


@pytest.mark.parametrize("quant_type, double", [("nf4", True), ("fp4", False)])
def test_cpu_ledger_holds_packed_weights_and_quant_state_real_equals_fake(quant_type, double):
    model = qlora(quant_type, double)
    inputs = _inputs(2, 16)
    real = memfit.profile(model, inputs, optimizer=_adamw(model))
    fake = memfit.profile(model, inputs, optimizer=_adamw(model), fake=True)
    assert _parameter_bytes(real) == _parameter_bytes(fake) == closed_form(double)
    assert real.peak_bytes == fake.peak_bytes and real.breakdown == fake.breakdown
    # bitsandbytes' CPU matmul dequantizes each weight in the forward (and MatMul4Bit's backward again):
    # a bf16 block of the weight's size, born and freed inside the 4-bit layer
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
    sizes = [b.nbytes for b in real.ledger.blocks if b.module == q and b.phase is Phase.FORWARD]
    assert 64 * 64 * 2 in sizes, sizes
    # nothing is saved for backward by a 4-bit layer: MatMul4Bit keeps the packed weight, not its input
    assert not [b for b in real.ledger.blocks if b.category is Category.ACTIVATION and q in b.savers]


@pytest.mark.slow
def test_plan_on_a_qlora_model_trains_bitwise():
    model = qlora()
    inputs = _inputs(2, 16)
    plan = memfit.plan(model, {**inputs, "use_cache": False}, 0.0, optimizer=_adamw(model))
    assert plan.checkpointed and plan.predicted_peak_bytes < plan.none_peak_bytes
    trained = assert_equivalent(copy.deepcopy(model), {**inputs, "use_cache": False}, lambda out: out.loss, plan)
    assert {n for n, p in trained.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }


SCRIPT = textwrap.dedent(
    """
    import json, sys, memfit, torch
    sys.path.insert(0, TESTS)
    from test_qlora import qlora, _inputs, _adamw
    from memfit.cli import main
    from memfit.measure.ledger import Category, Phase
    cfg = sys.argv[1] if len(sys.argv) > 1 else CFG
    out = {}
    for double in (True, False):
        flag = "--double-quant" if double else "--no-double-quant"
        assert main(["finetune", cfg, "--quant", "4bit", flag, "--seq-len", "1024", "--batch-size", "2", "--lora-rank", "4",
                     "--gpu", "A100-80GB", "--json", OUT + flag]) == 0
        model = qlora("nf4", double)
        trainer = memfit.StepOptions(drops_output=True)  # memfit finetune's step: the Trainer's, the logits dropped before backward
        prof = memfit.profile(model, _inputs(2, 1024), optimizer=_adamw(model), fake="cuda", gpu="A100-80GB", step=trainer)
        q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
        dq = lambda p: sorted(b.nbytes for b in p.ledger.blocks if b.module == q and b.phase is Phase.FORWARD)
        small = memfit.profile(model, _inputs(1, 1024), optimizer=_adamw(model), fake="cuda", gpu="A100-80GB", step=trainer)
        out[flag] = {"allocated": prof.cuda_memory.allocated_peak_bytes, "reserved": prof.cuda_memory.reserved_peak_bytes,
                     "breakdown": prof.breakdown, "forward_blocks": dq(prof), "small_forward_blocks": dq(small),
                     "parameters": sum(b.nbytes for b in prof.ledger.blocks if b.category is Category.PARAMETER)}
    wide = json.load(open(cfg))
    wide.update(hidden_size=2048, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16)
    json.dump(wide, open(cfg + ".wide", "w"))
    for optim in ("paged_adamw_8bit", "adamw_bnb_8bit"):
        assert main(["finetune", cfg + ".wide", "--quant", "4bit", "--seq-len", "256", "--lora-rank", "64", "--gpu", "A100-80GB",
                     "--optim", optim, "--json", OUT + optim]) == 0
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_fake_cuda_quant_state_closed_form_and_dequantized_weights(fake_cuda, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    script = SCRIPT.replace("TESTS", repr(str(Path(__file__).parent))).replace("CFG", repr(str(cfg)))
    done = fake_cuda.script(script.replace("OUT", repr(str(tmp_path / "answer"))), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    for flag, double in (("--double-quant", True), ("--no-double-quant", False)):
        by_hand, answer = got[flag], json.loads((tmp_path / f"answer{flag}").read_text())["profile"]
        assert by_hand["parameters"] == closed_form(double, block=512)
        # the meta-built model of memfit finetune is the one bitsandbytes quantized on the CPU, byte for byte
        assert answer["allocated_peak_bytes"] == by_hand["allocated"] and answer["reserved_peak_bytes"] == by_hand["reserved"]
        assert answer["breakdown"] == by_hand["breakdown"]
        # 2 x 1024 rows > 1536: CUDA's fallback dequantizes q_proj's weight (64 x 64 bf16, one 8 KiB block)
        # and, doubly quantized, its absmax (float32, then the offset added: 64 blocks x 4 B, 512 B each)
        fwd = by_hand["forward_blocks"]
        assert 8192 in fwd and 8192 not in by_hand["small_forward_blocks"], (fwd, by_hand["small_forward_blocks"])
        assert fwd.count(512) - by_hand["small_forward_blocks"].count(512) == (2 if double else 0), fwd
    # a paged optimizer: the state of the adapters of 100,000 elements or more (q_proj's A and B, v_proj's A: 2048 x 64)
    # is unified memory, outside allocated and reserved; with the rest it is the non-paged 8-bit optimizer's state
    paged, plain = (json.loads((tmp_path / f"answer{o}").read_text()) for o in ("paged_adamw_8bit", "adamw_bnb_8bit"))
    assert paged["paged_optimizer_state_bytes"] == 3 * 2 * 2048 * 64  # two uint8 moments each
    assert "paged_optimizer_state_bytes" not in plain
    in_ledger = paged["profile"]["breakdown"]["optimizer_state"]
    assert 0 < in_ledger and in_ledger + paged["paged_optimizer_state_bytes"] == plain["profile"]["breakdown"]["optimizer_state"]


def test_kbit_prep_is_pefts_own_cast_of_the_base(tmp_path, capsys):
    # peft's prepare_model_for_kbit_training (TRL's SFTTrainer calls it on a 4-bit base) casts every
    # parameter that is not 4-bit to float32: the embeddings, the norms and the head, 2 bytes more each
    import dataclasses

    from memfit.integrations.finetune import LoraSpec, lora_inputs, lora_model

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    spec = LoraSpec(4, None, ("q_proj", "v_proj"), quant="4bit", kbit_prep=True)
    prepared, plain = lora_model(str(cfg), spec), lora_model(str(cfg), dataclasses.replace(spec, kbit_prep=False))
    before = {n: p for n, p in plain.named_parameters()}
    changed = {n: p for n, p in prepared.named_parameters() if p.dtype != before[n].dtype}
    assert changed and all(before[n].dtype == torch.bfloat16 and p.dtype == torch.float32 for n, p in changed.items())
    assert all(any(w in n for w in ("embed_tokens", "norm", "lm_head")) for n in changed), sorted(changed)
    grown = sum(2 * p.numel() for p in changed.values())
    figures = [_parameter_bytes(memfit.profile(m, lora_inputs(m, 1, 16), fake=True)) for m in (prepared, plain)]
    assert figures[0] - figures[1] == grown
    assert main(["finetune", str(cfg), "--kbit-prep"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quant 4bit" in err, err


FLASH2_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, memfit, torch
    from memfit.integrations.finetune import LoraSpec, lora_inputs, lora_model
    from memfit.measure.ledger import Category
    seq, heads = 512, 4
    out = {}
    for prep in (True, False):
        for attn in ("sdpa", "flash_attention_2"):
            spec = LoraSpec(4, None, ("q_proj", "v_proj"), quant="4bit", kbit_prep=prep, attn=attn)
            model = lora_model(CFG, spec)
            prof = memfit.profile(model, lora_inputs(model, 1, seq), fake="cuda", gpu="A100-80GB")
            blocks = [b for b in prof.ledger.blocks if ".self_attn" in (b.module or "")]
            out[f"{prep}-{attn}"] = {
                "allocated": prof.cuda_memory.allocated_peak_bytes,
                "scores": sum(b.nbytes == heads * seq * seq * 4 for b in blocks),
            }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_flash_attention_2_stand_in_keeps_no_scores(fake_cuda, tmp_path):
    # prepare_model_for_kbit_training makes the residual stream float32: torch's SDPA then has no
    # flash kernel for the grouped float32 query (the math path: S x S scores per head), while
    # transformers' flash_attention_2 path casts q, k, v to 16 bits and runs flash attention
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    done = fake_cuda.script(FLASH2_SCRIPT.replace("CFG", repr(str(cfg))), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    sdpa, flash = got["True-sdpa"], got["True-flash_attention_2"]
    assert sdpa["scores"] > 0 and flash["scores"] == 0, got
    assert flash["allocated"] < sdpa["allocated"], got
    # a bfloat16 stream: SDPA already takes the flash kernel, and the stand-in changes no byte
    assert got["False-sdpa"] == got["False-flash_attention_2"], got
