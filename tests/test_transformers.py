"""Real-world models from transformers, and modules that change state in forward.

Each transformers model is built from a tiny config with random weights (nothing is
downloaded) and dropout on, so the recompute must replay the RNG. memfit plans it, the
plan is applied to a copy, and three AdamW steps end bitwise where they end without it.

Modules whose forward changes state outside their tensors (transformers' KV cache, on by
default in training; a call counter; a list appended to) would have it changed again by a
recompute: the planner excludes them, and everything containing them, with the reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_equivalent, assert_same, snapshot
from torch import nn

import memfit

tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()

BATCH, SEQ, VOCAB = 2, 16, 96
DROP = 0.1


def _ids(n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, n))


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def _bert() -> tuple[nn.Module, Any, Callable]:
    cfg = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=DROP,
        attention_probs_dropout_prob=DROP,
        attn_implementation="eager",
    )
    ids = _ids()
    return tf.BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids.clone()}, _loss


def _gpt2() -> tuple[nn.Module, Any, Callable]:
    cfg = tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=DROP,
        embd_pdrop=DROP,
        attn_pdrop=DROP,
        attn_implementation="eager",
    )
    ids = _ids()
    return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids.clone()}, _loss


def _llama(**config: Any) -> tuple[nn.Module, Any, Callable]:
    cfg = tf.LlamaConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": SEQ,
            "attention_dropout": DROP,
            "attn_implementation": "eager",
            **config,
        }
    )
    ids = _ids()
    return tf.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}, _loss


def _t5() -> tuple[nn.Module, Any, Callable]:
    cfg = tf.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=DROP,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    # labels make the decoder's inputs (shifted right): encoder and decoder both train
    return tf.T5ForConditionalGeneration(cfg), {"input_ids": _ids(), "labels": _ids(SEQ // 2)}, _loss


def _vit() -> tuple[nn.Module, Any, Callable]:
    cfg = tf.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=10,
        hidden_dropout_prob=DROP,
        attention_probs_dropout_prob=DROP,
        attn_implementation="eager",
    )
    # no labels: the loss is made from the logits, not taken from the output
    return tf.ViTForImageClassification(cfg), torch.randn(BATCH, 3, 16, 16), lambda out: out.logits.logsumexp(-1).mean()


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5, "vit": _vit}
# Modules that update transformers' KV cache (on by default, even in training): each
# attention layer and everything holding one (``model`` in Llama, ``decoder`` in T5).
CACHED = {
    "gpt2": ["transformer", "transformer.h.0", "transformer.h.1.attn"],
    "llama": ["model", "model.layers.0", "model.layers.1.self_attn"],
    "t5": ["decoder", "decoder.block.0", "decoder.block.1.layer.0.SelfAttention", "decoder.block.1.layer.1.EncDecAttention"],
}


def _plans(model: nn.Module, inputs: Any, loss_fn: Callable, budgets=(0.0, 0.5), recomputes: bool = True) -> list[memfit.Plan]:
    """Plans at ``budgets``; planning changes nothing about the model or the optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = snapshot(model, opt)
    plans = [memfit.plan(model, inputs, b, loss_fn=loss_fn, optimizer=opt) for b in budgets]
    assert_same(before, snapshot(model, opt))
    for plan in plans:
        assert plan.checkpointed or not recomputes, "the plan recomputes nothing"
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert not set(plan.checkpointed) & set(plan.excluded)
    return plans


def _trains_alike(model: nn.Module, inputs: Any, loss_fn: Callable, plans: list[memfit.Plan]) -> None:
    distinct = {tuple(sorted(p.checkpointed.items())): p for p in plans}
    for plan in distinct.values():
        assert_equivalent(copy.deepcopy(model), inputs, loss_fn, plan)


@pytest.mark.parametrize("name", MODELS)
def test_plan_apply_and_train_like_without_a_plan(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    plans = _plans(model, inputs, loss_fn)
    for module in CACHED.get(name, []):
        why = plans[0].excluded.get(module, "")
        assert "not reproducible" in why and ("Cache" in why or "contains" in why), (module, why)
    _trains_alike(model, inputs, loss_fn, plans)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_without_the_kv_cache_whole_decoder_layers_are_recomputed(attn):
    torch.manual_seed(0)
    # long enough that tensors, not autograd's per-op host memory, are what recompute frees
    model, _, loss_fn = _llama(attn_implementation=attn, use_cache=False, max_position_embeddings=128)
    ids = _ids(128)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    (plan,) = _plans(model, inputs, loss_fn, budgets=(0.0,))
    assert {"model.layers.0", "model.layers.1"} & set(plan.checkpointed), "no whole decoder layer is recomputed"
    assert not [n for n, why in plan.excluded.items() if "not reproducible" in why]
    _trains_alike(model, inputs, loss_fn, [plan])


# -- modules that change Python state in forward -------------------------------------------


class Body(nn.Module):
    """Holds most of the step's activations, so a plan at the lowest budget recomputes it
    (unless it is excluded); ``kind`` picks the state its forward changes."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(64, 512)
        self.calls = 0
        self.history: list[torch.Tensor] = []
        self.memo: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, log: list | None = None) -> torch.Tensor:
        h = torch.tanh(self.fc(x)).pow(2)
        if self.kind == "counter":  # a counter that changes the result: a recompute would silently differ
            self.calls += 1
            h = h * (1 + self.calls % 2)
        elif self.kind == "history":  # a list grown on every call (a hand-made KV cache)
            self.history.append(h.detach())
        elif self.kind == "argument":  # an object passed in and filled (like past_key_values)
            log.append(h.shape)
        elif self.kind == "memo":  # a bias made on the first call and reused: safe to recompute
            if self.memo is None:
                self.memo = torch.linspace(0, 1, 512)
            h = h + self.memo
        return h


class Host(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.body = Body(kind)
        self.b = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.body(self.a(x), log=[]))


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


@pytest.mark.parametrize("kind", ["stateless", "memo"])
def test_modules_without_per_call_state_are_recomputed(kind):
    torch.manual_seed(0)
    model, x = Host(kind), torch.randn(1024, 64)
    (plan,) = _plans(model, x, _sum, budgets=(0.0,))
    assert "body" in plan.checkpointed and "body" not in plan.excluded
    assert model.body.memo is None, "planning left the memo behind"
    trained = assert_equivalent(model, x, _sum, plan)
    assert trained.body.memo is not None or kind != "memo"


@pytest.mark.parametrize(
    ("kind", "what"), [("counter", "attribute 'calls'"), ("history", "attribute 'history'"), ("argument", "argument 'log'")]
)
def test_modules_changing_state_in_forward_are_excluded_with_the_reason(kind, what):
    torch.manual_seed(0)
    model, x = Host(kind), torch.randn(1024, 64)
    (plan,) = _plans(model, x, _sum, budgets=(0.0,), recomputes=False)
    assert "body" not in plan.checkpointed
    assert what in plan.excluded["body"] and "not reproducible" in plan.excluded["body"]
    assert model.body.calls == 0 and model.body.history == [], "planning left state behind"
    trained = assert_equivalent(model, x, _sum, plan)
    if kind == "counter":
        assert trained.body.calls == model.body.calls == 3  # once per step: no recompute bumped it
    if kind == "history":
        assert len(trained.body.history) == len(model.body.history) == 3
