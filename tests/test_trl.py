"""TRL's ``SFTTrainer`` through memfit's transformers integration (issue 27, item 1): a peft
LoRA model on a tiny Llama built from a config, a tokenizer and a dataset made in memory
(nothing downloaded).

SFTTrainer (TRL 1.x) patches the model's forward with its fused LM head and its
``compute_loss`` calls ``model(**batch, use_cache=False, fused_lm_head=True)``: the labels are
scored in chunks of the vocabulary and the logits are never made, another step than
``model(**batch).loss``. memfit's ``trainer_step`` measures that call (``step_inputs``):

- its peak over the start is the RSS rise of SFTTrainer's own ``training_step`` and optimizer
  step in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``, the protocol of measuring.md),
  where the plain Trainer's step of the same model (the logits and the cross-entropy) is not;
- a plan applied by ``fit_trainer`` trains bitwise as SFTTrainer trains without one.

trl is not in any of memfit's extras: ``pip install trl`` would replace the huggingface_hub and
fsspec that transformers and datasets have here (checked with trl 1.16.0, installed with
``--no-deps``), so this file skips without trl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LazyModule, needs

import memfit

pytestmark = needs("transformers", "peft", "trl", "datasets", "tokenizers", "accelerate")
tf = LazyModule("transformers", then=lambda tf: tf.logging.set_verbosity_error())

VOCAB, SEQ, BATCH = 32768, 64, 4
TESTS = Path(__file__).resolve().parent


def sft_trainer(out: str, *, steps: int = 2, **config: Any) -> Any:
    """SFTTrainer on a peft LoRA (r=8 on q/k/v/o) of a 2-layer Llama, seeded: the same
    trainer in any process. ``config``: more SFTConfig arguments."""
    import datasets
    import peft
    import tokenizers
    import trl

    tf.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, VOCAB, (SEQ,), generator=g).tolist() for _ in range(4 * BATCH)]
    args = trl.SFTConfig(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        max_length=SEQ,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **config,
    )
    return trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": ids}), processing_class=tokenizer)


# SFTTrainer's own step in a fresh process: warm-up (the optimizer's state), then the
# step's RSS high-water mark over its start (memfit.bench.child's protocol)
RSS_CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, sys, torch
    sys.path.insert(0, sys.argv[2])
    torch.set_num_threads(1)
    from test_trl import sft_trainer

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    trainer = sft_trainer(sys.argv[1], gradient_checkpointing=False)
    model = trainer.model
    model.train()
    optimizer = trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))

    def step():
        trainer.training_step(model, dict(batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    step()
    print("RESULT" + json.dumps({"step_peak_bytes": status("VmHWM") - before, "optimizer": type(optimizer).__name__}))
    """
)


@pytest.mark.slow
def test_sft_step_is_the_fused_head_step_and_its_rss(tmp_path):
    """memfit's figure for SFTTrainer's step (trainer_step: the fused LM head) is the RSS rise of
    SFTTrainer's own training_step in a fresh process, within 3%; the plain Trainer's step of
    the same model (full logits and cross-entropy), which memfit measured before, is not.
    The vocabulary is one whole chunk of TRL's kernel (32768 columns): its buffer is made with
    torch.empty at that width whatever the vocabulary, and RSS counts only the pages written
    (a GPU's caching allocator reserves it all, as memfit counts it)."""
    from memfit.integrations.transformers import trainer_step

    trainer = sft_trainer(str(tmp_path / "m"), gradient_checkpointing=False)
    model, batch, optimizer, what = trainer_step(trainer)
    assert batch["fused_lm_head"] is True and batch["use_cache"] is False and "attention_mask" in batch
    sft = memfit.profile(model, batch, optimizer=optimizer, fake=True)  # fake tensors: the real step's bytes
    plain_inputs = {k: v for k, v in batch.items() if k != "fused_lm_head"}
    plain = memfit.profile(model, plain_inputs, optimizer=optimizer, fake=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(memfit.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(tmp_path / "c"), str(TESTS)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    assert rss["optimizer"] == type(optimizer).__name__, (rss, what)
    measured = rss["step_peak_bytes"]
    predicted = sft.peak_bytes - sft.start_bytes
    other = plain.peak_bytes - plain.start_bytes
    print(f"SFTTrainer step: memfit {predicted:,} B, RSS rise {measured:,} B; plain Trainer step (memfit) {other:,} B")
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured, other)
    assert abs(other - measured) > 0.1 * measured, (predicted, measured, other)


@pytest.mark.slow
def test_sft_trainer_with_a_plan_trains_as_without(tmp_path):
    """fit_trainer on an SFTTrainer (its default gradient_checkpointing=True turned off, said so)
    plans the fused-head step and applies the plan; training then ends bitwise where the same
    SFTTrainer without memfit ends (losses, every parameter)."""
    from memfit.integrations.transformers import fit_trainer

    said: list[str] = []
    trainer = sft_trainer(str(tmp_path / "a"))
    assert trainer.args.gradient_checkpointing  # SFTConfig's default
    callback = fit_trainer(trainer, "60%", mode="plan", log=said.append)
    assert any("fused LM head" in line for line in said) and any("gradient_checkpointing=True" in line for line in said), said
    plan = callback.plan
    assert plan.checkpointed and all(n.startswith("base_model.model.") for n in plan.checkpointed), plan.checkpointed
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.none_peak_bytes
    trainer.train()
    reference = sft_trainer(str(tmp_path / "b"), gradient_checkpointing=False)
    reference.train()
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (trainer, reference)]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
    for (n, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p, q), n
    memfit.remove(trainer.model)


def test_other_trl_losses_are_refused_in_one_line(tmp_path):
    """SFTTrainer losses that run the model otherwise than its fused head are refused, naming why."""
    from memfit.errors import WorkloadError
    from memfit.integrations.transformers import trainer_step

    trainer = sft_trainer(str(tmp_path / "d"), loss_type="dft")
    with pytest.raises(WorkloadError, match="loss_type='dft'") as got:
        trainer_step(trainer)
    assert len(str(got.value).splitlines()) == 1
