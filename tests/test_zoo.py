"""Every zoo model builds, is reproducible, and profiles; sizes are checked."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import zoo

SMALL = {
    "gpt": dict(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=256, batch_size=2),
    "mlp-deep": dict(depth=4, width=64, batch_size=8),
    "heavy": dict(n_ops=600, ops_per_block=60, batch_size=2),
    "resnet": dict(image_size=16, base=8, batch_size=4),
    "convnext": dict(pixels=32, dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), batch_size=2),
    "resnext": dict(pixels=16, dims=(64, 128), depths=(1, 1), batch_size=2),
    "mobilenet": dict(pixels=32, batch_size=2),
    "convmixer": dict(pixels=16, dim=16, depth=2, batch_size=2),
    "bert-base": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, seq_len=16, batch_size=2
    ),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=2, seq_len=16, batch_size=2),
    "llama": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        vocab_size=256,
        seq_len=16,
        batch_size=2,
    ),
    "vit": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, image_size=32, batch_size=2),
    "resnet152": dict(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], embedding_size=16, image_size=32, batch_size=2),
}


def test_every_zoo_model_has_a_small_size():
    assert set(SMALL) == set(zoo.names())


@pytest.mark.parametrize("name", list(SMALL))
def test_builds_reproducibly_and_profiles(name):
    if zoo._ZOO[name].extra == "hf":
        pytest.importorskip("transformers")
    rng = torch.get_rng_state()
    a, b = zoo.build(name, **SMALL[name]), zoo.build(name, **SMALL[name])
    assert torch.equal(rng, torch.get_rng_state()), "building must not move the caller's RNG"
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    prof = memfit.profile(a.model, a.inputs, loss_fn=a.loss_fn, optimizer=a.make_optimizer(), fake=True)
    assert prof.peak_bytes > prof.start_bytes > 0
    assert any(b.category is memfit.Category.ACTIVATION for b in prof.ledger.blocks)


def test_heavy_is_many_tiny_ops():
    work = zoo.build("heavy", n_ops=3000, ops_per_block=300)
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn)
    tensors = [b for b in prof.ledger.blocks if b.category is not memfit.Category.GRAPH]
    forward_allocs = sum(1 for b in tensors if b.phase is memfit.Phase.FORWARD)
    assert forward_allocs >= 2000  # two new tensors per tanh(x * w[i]) step
    assert max(b.nbytes for b in tensors if b.phase is memfit.Phase.FORWARD) <= 64


def test_unknown_name_and_size():
    with pytest.raises(memfit.TargetError, match="unknown zoo model 'nope'"):
        zoo.build("nope")
    with pytest.raises(memfit.TargetError, match="has no size 'layers'"):
        zoo.build("gpt", layers=3)
    with pytest.raises(memfit.TargetError, match="cannot build"):
        zoo.build("resnet", depths=(1, 1))
