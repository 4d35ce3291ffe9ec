"""memfit with accelerate (tiny models from configs, CPU, one process).

``fit_accelerator``: a loop run as accelerate runs it (prepared model and optimizer, bf16
autocast, accumulated micro-batches) with memfit's one line and a budget below the step's
unplanned peak, against the same loop with the same plan applied by hand with
``memfit.apply`` and against the loop with no plan: losses and parameters bitwise equal.

``estimate_memory`` / ``memfit estimate``: accelerate's estimate-memory numbers (its own
functions) beside memfit's step peak on fake tensors.
"""

from __future__ import annotations

import functools
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LazyModule, needs

import memfit

pytestmark = needs("accelerate", "transformers")
accelerate = LazyModule("accelerate")  # imported when a test first uses it, not at collection
tf = LazyModule("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _fresh_accelerator():
    """accelerate keeps one process-wide state (mixed precision, accumulation steps) that a
    second Accelerator may not change: start each test from none, and leave none behind
    for the Trainer tests (which build their own). Private, as accelerate's own tests use it."""
    from accelerate.state import AcceleratorState, GradientState

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second OpenMP thread only waits on a shared host
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.set_num_threads(before)


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@functools.cache
def _example() -> dict:
    """examples/accelerate_loop.py's pieces: its tiny GPT-2, data set and training loop."""
    return runpy.run_path(str(EXAMPLES / "accelerate_loop.py"))


def _gpt2():
    tf.logging.set_verbosity_error()
    return _example()["tiny_gpt2"]()


def _run(mixed_precision: str, k: int, *, budget=None, plan=None, said=None):
    """The example's accelerate loop: memfit's line (budget), the plan by hand (plan), or neither."""
    from memfit.integrations.accelerate import fit_accelerator

    _reset()
    acc = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=k)
    model = _gpt2()
    if plan is not None:
        memfit.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_example()["Tokens"](), batch_size=4, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    fitted = None
    if budget is not None:
        fitted = fit_accelerator(acc, model, optimizer, loader, budget, log=said.append)  # the one line
        fitted.loop_peak_bytes = _loop_peak(acc, model, optimizer, loader)
    losses = _example()["train"](acc, model, optimizer, loader)
    return fitted, losses, [p.detach().clone() for p in model.parameters()]


def _loop_peak(acc, model, optimizer, loader) -> int:
    """memfit's ledger of an optimizer step as the loop runs it, apart from the plan's own
    measurement: the prepared model with the plan applied, all ``k`` micro-batches of
    loader batches (the loss of each divided by ``k``, as accelerator.backward divides it)
    and the optimizer inside accelerate's. Every batch has the same shapes: one stands for all."""
    from memfit.integrations._common import first_batch_of

    k = acc.gradient_accumulation_steps
    first = first_batch_of(loader)
    batch = {key: torch.cat([first[key]] * k) for key in first}
    step = memfit.StepOptions(micro_batches=k)
    return memfit.profile(model, batch, optimizer=optimizer.optimizer, step=step).peak_bytes


@pytest.mark.parametrize(("mixed_precision", "k"), [("no", 1), ("bf16", 2)])
def test_fit_accelerator_trains_as_by_hand(mixed_precision, k):
    said: list[str] = []
    fitted, losses, params = _run(mixed_precision, k, budget="50%", said=said)
    plan = fitted.plan
    assert plan.checkpointed, "the budget is below the unplanned peak: something is recomputed"
    assert fitted.predicted_peak_bytes <= plan.budget_bytes < plan.none_peak_bytes
    assert fitted.measured_peak_bytes is not None and fitted.measured_peak_bytes <= plan.budget_bytes
    assert fitted.loop_peak_bytes <= plan.budget_bytes
    assert any("predicted" in line and "measured" in line and mixed_precision in line for line in said), said
    assert fitted.step.set_to_none == (k == 1) and fitted.step.loss_scale == (None if k == 1 else 1 / k)
    _, by_hand, by_hand_params = _run(mixed_precision, k, plan=plan)
    _, unplanned, unplanned_params = _run(mixed_precision, k)
    assert len(losses) == 8
    assert losses == by_hand == unplanned
    for p, q, r in zip(params, by_hand_params, unplanned_params):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_the_step_measured_is_accelerates():
    """With bf16, the prepared model's forward runs under autocast: the step memfit plans
    holds less than the same model's float32 step (its activations are bf16). On fake
    tensors, whose copy of the model keeps accelerate's forward (rebound to the copy)."""
    from memfit.integrations.accelerate import fit_accelerator

    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = _gpt2()
    ids = _example()["Tokens"]().ids[:4]
    batch = {"input_ids": ids, "labels": ids}
    plain = memfit.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()), fake=True).peak_bytes
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    forward = model.forward
    fitted = fit_accelerator(acc, model, optimizer, batch, "50%", fake=True, log=lambda _: None)
    assert fitted.plan.none_peak_bytes < plain
    assert fitted.measured_peak_bytes is None and fitted.predicted_peak_bytes <= fitted.plan.budget_bytes
    with pytest.raises(memfit.PlanError):
        fit_accelerator(acc, model, optimizer, batch, "50%", log=lambda _: None)
    fitted.remove()
    assert model.forward == forward  # accelerate's autocast forward, as prepare left it
    assert not optimizer.optimizer.state  # planning created no optimizer state


def test_import_loads_no_other_framework():
    code = (
        "import sys, accelerate\n"
        "before = set(sys.modules)\n"
        "import memfit.integrations.accelerate\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} & {'transformers', 'lightning', 'pytorch_lightning'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- estimate -------------------------------------------------------------------------

TINY = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "vocab_size": 512}


def test_estimate_beside_accelerates_rule():
    from memfit.integrations.accelerate import estimate_memory

    est = estimate_memory("llama", sizes=TINY, dtypes=["float32", "bfloat16", "int8"], batch_size=4, seq_len=128)
    f32, bf16, int8 = est.rows
    cfg = tf.LlamaConfig(**TINY)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # accelerate's rule: parameters (and buffers) x dtype bytes; training with Adam 4x in float32
    assert f32.total_bytes == params + buffers and f32.accelerate_training_bytes == 4 * f32.total_bytes
    assert bf16.total_bytes == f32.total_bytes // 2 and bf16.accelerate_training_bytes == 2 * f32.total_bytes
    assert int8.total_bytes == f32.total_bytes // 4 and int8.accelerate_training_bytes is None
    assert int8.memfit_peak_bytes is None
    # memfit: float32 weights, gradients and AdamW state alive at a peak that activations push higher
    assert f32.memfit_breakdown["parameters"] == params
    assert f32.memfit_breakdown["activations"] > 0 and f32.memfit_peak_phase == "backward"
    assert f32.memfit_peak_bytes > f32.accelerate_training_bytes
    assert bf16.memfit_breakdown["activations"] < f32.memfit_breakdown["activations"]


def test_estimate_keeps_tied_weights():
    """GPT-2's lm_head is its token embedding: one tensor, one gradient, one Adam state."""
    from memfit.integrations.accelerate import estimate_memory

    sizes = {"n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 1024}
    (row,) = estimate_memory("gpt2", sizes=sizes, dtypes=["float32"], seq_len=16).rows
    model = tf.GPT2LMHeadModel(tf.GPT2Config(**sizes))
    assert row.memfit_breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())


def test_estimate_command(tmp_path, capsys):
    from memfit.cli import main

    config = tf.LlamaConfig(**TINY)
    config.save_pretrained(tmp_path)  # writes config.json only
    out = tmp_path / "est.json"
    code = main(["estimate", str(tmp_path / "config.json"), "--dtypes", "float32", "--seq-len", "64", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "training" in text and "step" in text and "activa-" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float32"] and rows[0]["memfit_peak_bytes"] > rows[0]["accelerate_training_bytes"]
    t5 = ["--size", "num_layers=2", "--size", "d_model=32", "--size", "d_ff=64", "--size", "num_heads=2", "--size", "d_kv=16"]
    assert main(["estimate", "t5", *t5, "--dtypes", "float32", "--seq-len", "16"]) == 0  # seq2seq: labels into the decoder
    assert "T5ForConditionalGeneration" in capsys.readouterr().out
    for bad, says in (("meta-llama/Llama-2-7b-hf", "downloads nothing"), (str(tmp_path / "nothing"), "config.json")):
        assert main(["estimate", bad]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


def test_example_accelerate_loop(capsys):
    fitted, losses = runpy.run_path(str(EXAMPLES / "accelerate_loop.py"))["main"]()
    assert len(losses) == 8 and fitted.plan.checkpointed
    err = capsys.readouterr().err
    assert "memfit: budget" in err and "predicted" in err and "measured" in err
