"""``memfit finetune``: a LoRA fine-tune from a config.json alone, on fake CUDA (issue 27 item 3).

The command's numbers are checked against a peft model built by hand (real weights, the
usual way) and profiled with ``memfit.profile``; its largest batch and sequence against
fresh profiles one size above and at the answer."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from memfit.cli import main

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.mark.parametrize(
    "args, says",
    [
        (["nowhere/config.json"], "no such file"),
        (["{cfg}", "--lora-rank", "0"], "positive integer"),
        (["{cfg}", "--gpu", "B300"], "B300"),
        (["{cfg}", "--quant", "8bit", "--int8-outliers", "-1"], "non-negative"),
        (["{cfg}", "--batch-size", "0"], "positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    cfg = str(_config(tmp_path))
    assert main(["finetune", *[a.format(cfg=cfg) for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfit: error:") and says in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("target", ["llama", "{cfg}"])
def test_a_size_the_config_refuses_is_one_line(tmp_path, capsys, target):
    """A config field of the wrong type (``--size a=1,b=2`` reads as one string) is memfit's
    one-line error, not huggingface_hub's traceback (progress lines may come before it)."""
    pytest.importorskip("peft")
    args = ["finetune", target.format(cfg=_config(tmp_path)), "--size", "num_hidden_layers=2,hidden_size=64"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith("memfit: error:"), err
    assert "refused the sizes num_hidden_layers='2,hidden_size=64'" in last and "--size a=1 --size b=2" in last, err


def test_unknown_target_module_names_the_linear_layers(tmp_path, capsys):
    pytest.importorskip("peft")
    assert main(["finetune", str(_config(tmp_path)), "--lora-targets", "q_proj,qkv"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'qkv'" in err and "q_proj" in err and "down_proj" in err and len(err.splitlines()) == 1, err


SCRIPT = textwrap.dedent(
    """
    import json, sys, memfit, torch
    import peft, transformers
    from memfit.cli import main
    from memfit.measure.ledger import Category
    common = ["finetune", cfg, "--seq-len", "64", "--batch-size", "2", "--lora-rank", "4", "--lora-targets", "q_proj,v_proj",
              "--gpu", "T4", "--capacity", "536MiB"]
    assert main([*common, "--max", "batch", "--json", out + ".batch"]) == 0
    assert main([*common, "--max", "seq", "--json", out + ".seq"]) == 0
    assert main([*common, "--batch-size", "16", "--json", out + ".over"]) == 0  # does not fit: the levers that do

    def by_hand(batch, seq, micro_batches=1):  # the usual way: real weights, then peft
        config = transformers.AutoConfig.from_pretrained(cfg)
        config.use_cache = False
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        step = memfit.StepOptions(micro_batches=micro_batches, drops_output=True)  # the Trainer's: logits gone before backward
        prof = memfit.profile(model, {"input_ids": ids, "labels": ids.clone()}, optimizer=opt, fake="cuda", gpu="T4", step=step)
        return {"allocated": prof.cuda_memory.allocated_peak_bytes, "reserved": prof.cuda_memory.reserved_peak_bytes,
                "breakdown": prof.breakdown}

    got = {"at": by_hand(2, 64)}
    b = json.load(open(out + ".batch"))["max"]["max_batch"]
    s = json.load(open(out + ".seq"))["max"]["max_batch"]
    got.update(batch=[by_hand(b, 64), by_hand(b + 1, 64)], seq=[by_hand(2, s), by_hand(2, s + 1)])
    k = json.load(open(out + ".over"))["recipe"]["micro_batches"]
    got["micro"] = by_hand(16, 64, k)
    print("RESULT" + json.dumps(got))
    """
)


@pytest.mark.slow
def test_config_json_answers_as_the_peft_model_built_by_hand(tmp_path, fake_cuda):
    pytest.importorskip("peft")
    cfg = _config(tmp_path)
    out = tmp_path / "answer.json"
    # in the session's fake-CUDA interpreter (conftest), not a fresh one: one start-up of torch,
    # memfit, transformers and peft less
    done = fake_cuda.script(f"cfg, out = {str(cfg)!r}, {str(out)!r}\n" + SCRIPT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    answers = {k: json.loads(Path(f"{out}.{k}").read_text()) for k in ("batch", "seq", "over")}
    prof = answers["batch"]["profile"]
    # the meta-built, never-initialised model gives the hand-built model's bytes, category by category
    assert prof["device"] == "fake:cuda:0"
    assert prof["allocated_peak_bytes"] == got["at"]["allocated"] and prof["reserved_peak_bytes"] == got["at"]["reserved"]
    assert prof["breakdown"] == got["at"]["breakdown"]
    budget = answers["batch"]["budget_bytes"]
    assert budget == 24 * 2**20  # --capacity 536MiB less the 512 MiB CUDA context estimate
    assert prof["fits"] and prof["reserved_peak_bytes"] <= budget
    # the largest batch and sequence: the answer fits (by its fresh profile), one more does not
    for what in ("batch", "seq"):
        found, (fits, over) = answers[what]["max"], got[what]
        assert found["max_batch"] > (2 if what == "batch" else 64), found
        assert found["peak_bytes"] == fits["reserved"] <= budget < over["reserved"], (what, found, fits, over)
    # batch 16 does not fit; the fewest micro-batches that do, by the hand-built model's profile with them
    over = answers["over"]
    assert not over["profile"]["fits"] and over["recipe"]["fits"] and "plan" not in over["recipe"]
    *more, fewest = over["recipe"]["tried"]
    assert fewest["micro_batches"] == over["recipe"]["micro_batches"] > 1
    assert (
        fewest["peak_bytes"]
        == got["micro"]["reserved"]
        <= budget
        < min(r["peak_bytes"] for r in more or [{"peak_bytes": budget + 1}])
    )


ACCUM = textwrap.dedent(
    """
    import json, memfit, torch, peft, transformers
    from memfit.cli import main
    assert main(["finetune", cfg, "--seq-len", "64", "--batch-size", "2", "--lora-rank", "4", "--lora-dropout", "0.05",
                 "--grad-accum", "4", "--no-autocast-adapter-dtype", "--gpu", "T4", "--json", out]) == 0

    def by_hand(gpu="T4", **step):  # the usual way, as the notebook of a published run writes it
        config = transformers.AutoConfig.from_pretrained(cfg)
        config.use_cache = False
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        lora = peft.LoraConfig(r=4, lora_alpha=4, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(base, lora, autocast_adapter_dtype=False)
        ids = torch.randint(0, config.vocab_size, (2, 64))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        prof = memfit.profile(model, {"input_ids": ids, "labels": ids.clone()}, optimizer=opt, fake="cuda", gpu=gpu,
                              step=memfit.StepOptions(**step))
        dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
        return {"allocated": prof.cuda_memory.allocated_peak_bytes, "reserved": prof.cuda_memory.reserved_peak_bytes,
                "breakdown": prof.breakdown, "dtypes": dtypes}

    assert main(["finetune", cfg, "--seq-len", "64", "--batch-size", "2", "--lora-rank", "4", "--lora-dropout", "0.05",
                 "--no-autocast-adapter-dtype", "--autocast", "bfloat16", "--gpu", "A100-80GB", "--json", out + ".bf16"]) == 0
    print("RESULT" + json.dumps({"trainer": by_hand(accumulate=4, drops_output=True), "kept": by_hand(accumulate=4),
                                 "bf16": by_hand("A100-80GB", autocast="bfloat16", drops_output=True)}))  # a T4 has no bfloat16
    """
)


@pytest.mark.slow
def test_gradient_accumulation_and_adapters_in_the_base_dtype_answer_as_built_by_hand(tmp_path, fake_cuda):
    """``--grad-accum 4 --no-autocast-adapter-dtype``: four passes of the batch before the
    optimizer step, bfloat16 adapters (peft's ``autocast_adapter_dtype=False``), and the
    Trainer's loop, which keeps only the loss: the hand-built model's profile with the same
    step, byte for byte; the loop that keeps the output through backward holds its logits more.
    ``--autocast bfloat16`` likewise (the Trainer's ``bf16=True``; on an A100, a T4 has no bfloat16)."""
    pytest.importorskip("peft")
    cfg = _config(tmp_path)
    out = tmp_path / "answer.json"
    done = fake_cuda.script(f"cfg, out = {str(cfg)!r}, {str(out)!r}\n" + ACCUM, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    answer = json.loads(out.read_text())
    prof, trainer, kept = answer["profile"], got["trainer"], got["kept"]
    assert trainer["dtypes"] == ["torch.bfloat16"]
    assert "4 accumulated passes" in answer["workload"] and "adapters not autocast" in answer["workload"]
    assert prof["allocated_peak_bytes"] == trainer["allocated"] and prof["reserved_peak_bytes"] == trainer["reserved"]
    assert prof["breakdown"] == trainer["breakdown"]
    # accumulated gradients: the adapters' bfloat16 gradients are alive at the peak (the passes after the first)
    # two layers' q_proj A, B and v_proj A, B: 8 gradients of 256-512 B, each one 512-byte CUDA block
    assert prof["breakdown"]["gradients"] == 8 * 512
    # the logits (2 x 64 x 128 bfloat16, 32 KiB) are what the loop that keeps its output holds more at the peak
    assert kept["allocated"] - trainer["allocated"] >= 2 * 64 * 128 * 2
    # --autocast bfloat16: the Trainer's bf16=True, the hand-built step under torch.autocast
    bf16 = json.loads(Path(f"{out}.bf16").read_text())
    assert "bfloat16 autocast" in bf16["workload"]
    assert (bf16["profile"]["allocated_peak_bytes"], bf16["profile"]["reserved_peak_bytes"]) == (got["bf16"]["allocated"], got["bf16"]["reserved"])
    assert bf16["profile"]["breakdown"] == got["bf16"]["breakdown"]
