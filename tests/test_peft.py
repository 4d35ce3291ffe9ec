"""LoRA fine-tunes (peft, issue 27 item 1): ``get_peft_model(model, LoraConfig(...))`` on a
transformers model built from a tiny config (random weights, nothing downloaded).

- the profile counts the frozen base in its dtype (bfloat16 here), the adapters, their
  gradients and their AdamW state in theirs (peft keeps adapters in float32), and no
  gradient for a frozen weight; on CPU (real and fake) and on fake CUDA;
- transformers' gradient checkpointing as peft's recipes turn it on
  (``gradient_checkpointing_enable`` + ``enable_input_require_grads``) is profiled as it runs,
  and planning it excludes no attention layer for a KV cache the step never writes;
- plans keep peft's module names (``base_model.model.model.layers.0...``) and training with
  one applied is bitwise training without it (parameters, gradients, AdamW state), with
  micro-batches too;
- transformers' Trainer with a PeftModel through ``fit_trainer`` and ``MemfitCallback``.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LazyModule, assert_equivalent, needs

import memfit
from memfit.measure.ledger import Category
from memfit.measure.step import StepOptions

pytestmark = needs("transformers", "peft")
tf = LazyModule("transformers", then=lambda tf: tf.logging.set_verbosity_error())
peft = LazyModule("peft")  # imported when a test first uses it: collecting this file imports neither

BATCH, SEQ, VOCAB = 2, 16, 96
PREFIX = "base_model.model."  # what peft's PeftModel (base_model) and LoraModel (model) put before the base's names


def _base(dtype: torch.dtype, hidden: int, seq: int) -> torch.nn.Module:
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=seq,
        attention_dropout=0.1,
        attn_implementation="eager",
    )
    return tf.LlamaForCausalLM(cfg).to(dtype)


def _lora(
    dtype: torch.dtype = torch.bfloat16, checkpointing: bool = False, hidden: int = 32, seq: int = SEQ, batch: int = BATCH
) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    base = _base(dtype, hidden, seq)
    if checkpointing:  # as peft's recipes do (prepare_model_for_kbit_training, the Trainer)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        base.enable_input_require_grads()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    ids = torch.randint(0, VOCAB, (batch, seq))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _totals(prof: memfit.Profile) -> dict[Category, int]:
    out = dict.fromkeys(Category, 0)
    for b in prof.ledger.blocks:
        out[b.category] += b.nbytes
    return out


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow
def test_profile_counts_the_frozen_base_and_the_adapters_in_their_dtypes():
    model, inputs = _lora()
    adapters = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16} and {p.dtype for p in adapters} == {torch.float32}
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    peaks = []
    for fake in (True, False):
        prof = memfit.profile(model, inputs, optimizer=_adamw(model), fake=fake)
        totals = _totals(prof)
        assert totals[Category.PARAMETER] == _bytes(frozen) + _bytes(adapters)
        # a gradient for each adapter, none for the frozen base
        assert totals[Category.GRADIENT] == _bytes(adapters)
        # AdamW: exp_avg and exp_avg_sq in the adapters' float32, and a float32 step per adapter
        assert totals[Category.OPTIMIZER] == 2 * _bytes(adapters) + 4 * len(adapters)
        assert all(p.grad is None for p in model.parameters())  # the profile leaves the model as it was
        peaks.append(prof.peak_bytes)
    assert peaks[0] == peaks[1]  # fake tensors: the same bytes as the real step


@pytest.mark.slow
def test_transformers_checkpointing_as_peft_enables_it_is_profiled_and_planned():
    model, inputs = _lora(checkpointing=True)
    plain, _ = _lora()
    fake = memfit.profile(model, inputs, optimizer=_adamw(model), fake=True)
    real = memfit.profile(model, inputs, optimizer=_adamw(model))
    assert fake.peak_bytes == real.peak_bytes
    # the layers' activations are recomputed in backward: less saved at the peak, a lower peak
    unchecked = memfit.profile(plain, inputs, optimizer=_adamw(plain), fake=True)
    assert real.ledger.breakdown()[Category.ACTIVATION] < unchecked.ledger.breakdown()[Category.ACTIVATION]
    assert real.peak_bytes < unchecked.peak_bytes
    # Under no_grad transformers runs these layers unchecked with the KV cache on; the
    # stateful check must look at the step as it trains, where the cache is off.
    plan = memfit.plan(model, inputs, 0.5, optimizer=_adamw(model), fake=True)
    assert not [n for n, why in plan.excluded.items() if "Cache" in why], plan.excluded


@pytest.mark.slow
def test_plans_keep_peft_names_and_train_bitwise():
    model, inputs = _lora()
    loss = lambda out: out.loss  # noqa: E731
    plan = memfit.plan(model, inputs, 0.0, optimizer=_adamw(model))  # the lowest peak: the most recomputed
    assert plan.checkpointed and all(n.startswith(PREFIX) for n in plan.checkpointed), plan.checkpointed
    assert plan.use_cache_off == ("base_model.model",)
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.none_peak_bytes
    trained = assert_equivalent(copy.deepcopy(model), inputs, loss, plan)
    assert {n for n, p in trained.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    # micro-batches: profiled as they run, and trained with the plan as without it
    half = [{k: v[i : i + 1] for k, v in inputs.items()} for i in range(BATCH)]
    split = [
        memfit.profile(model, inputs, optimizer=_adamw(model), fake=f, step=StepOptions(micro_batches=2)) for f in (True, False)
    ]
    assert (
        split[0].peak_bytes == split[1].peak_bytes < memfit.profile(model, inputs, optimizer=_adamw(model), fake=True).peak_bytes
    )
    assert_equivalent(copy.deepcopy(model), inputs, loss, plan, micro_batches=half)


SCRIPT = textwrap.dedent(
    """
    import json, sys, memfit, torch
    sys.path.insert(0, TESTS)
    from test_peft import _lora, _adamw
    from memfit.measure.ledger import Category
    model, inputs = _lora(hidden=256, seq=128, batch=8)  # on fake CUDA, large enough to be more than cuBLAS's workspaces
    prof = memfit.profile(model, inputs, optimizer=_adamw(model), fake="cuda")
    totals = {c.value: 0 for c in Category}
    for b in prof.ledger.blocks:
        totals[b.category.value] += b.nbytes
    # the KV cache off in the inputs: the switch memfit would turn it off with is checked on CPU tests
    plan = memfit.plan(model, {**inputs, "use_cache": False}, 0.5, optimizer=_adamw(model), fake="cuda")
    print("RESULT" + json.dumps({"device": prof.device, "totals": totals, "reserved": prof.cuda_memory.reserved_peak_bytes,
                                 "checkpointed": sorted(plan.checkpointed), "predicted": plan.predicted_peak_bytes,
                                 "budget": plan.budget_bytes}))
    """
)


def _cuda_bytes(tensors) -> int:
    return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)  # the caching allocator's 512-byte blocks


@pytest.mark.slow
def test_fake_cuda_counts_the_bf16_base_and_plans_with_peft_names(fake_cuda):
    done = fake_cuda.script(SCRIPT.replace("TESTS", repr(str(Path(__file__).parent))), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    model, _ = _lora(hidden=256, seq=128, batch=8)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert got["device"] == "fake:cuda:0"
    assert got["totals"]["parameters"] == _cuda_bytes(model.parameters())
    assert got["totals"]["gradients"] == _cuda_bytes(adapters)
    # AdamW's state: two float32 tensors per adapter (its steps live on the host on CUDA)
    assert got["totals"]["optimizer_state"] == 2 * _cuda_bytes(adapters)
    assert got["predicted"] <= got["budget"] and got["checkpointed"]
    assert all(n.startswith(PREFIX) for n in got["checkpointed"])


# -- transformers' Trainer ----------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path: Path, model: torch.nn.Module, **extra: Any) -> Any:
    pytest.importorskip("accelerate")
    args = tf.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    return tf.Trainer(model=model, args=args, train_dataset=_Tokens())


def _float_lora() -> torch.nn.Module:
    model, _ = _lora(torch.float32)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plan", "callback"])
def test_trainer_fits_a_peft_model_and_trains_as_by_hand(tmp_path, mode):
    """``plan``: fit_trainer before train(); ``callback``: MemfitCallback with
    gradient_checkpointing=True, which the Trainer turns on inside the PeftModel with
    enable_input_require_grads' hook: memfit turns both off and plans instead."""
    from memfit.integrations.transformers import MemfitCallback, fit_trainer

    data = _Tokens()
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    probe = _float_lora()
    # the step as memfit plans it: transformers' KV cache off (plan.use_cache_off), as its checkpointing does
    none = memfit.profile(probe, {**batch, "use_cache": False}, optimizer=_adamw(probe), fake=True)
    budget = none.start_bytes + (none.peak_bytes - none.start_bytes) * 8 // 10
    said: list[str] = []
    if mode == "plan":
        trainer = _trainer(tmp_path / "a", _float_lora())
        callback = fit_trainer(trainer, budget, mode="plan", log=said.append)
    else:
        callback = MemfitCallback(budget, log=said.append)
        trainer = _trainer(tmp_path / "a", _float_lora(), gradient_checkpointing=True)
        trainer.add_callback(callback)
    trainer.train()
    plan = callback.plan
    assert plan.checkpointed and all(n.startswith(PREFIX) for n in plan.checkpointed)
    # the same step with the callback: no enable_input_require_grads hook keeping the embeddings' output and gradient
    assert callback.predicted_peak_bytes <= budget and plan.none_peak_bytes == none.peak_bytes
    if mode == "callback":
        assert any("enable_input_require_grads hook removed" in line for line in said), said
        inner = trainer.model.base_model.model
        assert not inner.is_activation_checkpointing and not getattr(inner, "_require_grads_hooks", None)
    by_hand = _float_lora()
    memfit.apply(by_hand, plan)
    reference = _trainer(tmp_path / "b", by_hand)
    reference.train()
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (trainer, reference)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    for (n, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p, q), n
