"""memfit's FakeTensorMode builds torch's dispatch-cache key faster (memfit.compat.fake_key):
every key of parallelized fake steps, and of ops with nested, keyword and odd arguments,
is checked element for element (and type for type) against torch's own code."""

from __future__ import annotations

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

from torch._subclasses import fake_tensor as ft  # noqa: E402

from memfit.compat import fake_key, torch_compat  # noqa: E402

if not fake_key.fast_key_applies() and tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
    # torch 2.6's _prep_args_for_hash takes no id_hashed_objects and writes no list's length:
    # memfit keeps torch's own key there. On 2.11 and 2.13 (run) the fast key must apply.
    pytest.skip(f"torch {torch.__version__} keeps its own dispatch-cache key (the fast key copies 2.11's)", allow_module_level=True)

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture
def checked(monkeypatch):
    """Every key memfit's fake mode builds, built by torch's code beside it and compared."""
    cls = type(torch_compat.new_fake_mode())
    fast = cls.__dict__["_prep_args_for_hash"]
    counts = {"equal": 0, "bypassed": 0}

    def both(mode, result, args, state, ids):
        outs, reasons = [], []
        for impl in (fast, ft.FakeTensorMode._prep_args_for_hash):
            out = list(result)
            try:
                impl(mode, out, args, state, [])
                reasons.append(None)
            except ft._BypassDispatchCache as e:
                reasons.append(e.reason)
            outs.append(out)
        assert reasons[0] == reasons[1]
        if reasons[0] is None:
            assert outs[0] == outs[1] and [type(x) for x in outs[0]] == [type(x) for x in outs[1]]
            counts["equal"] += 1
        else:
            counts["bypassed"] += 1
        return fast(mode, result, args, state, ids)

    monkeypatch.setattr(cls, "_prep_args_for_hash", both)
    return counts


def test_the_fast_key_is_installed():
    assert fake_key.fast_key_applies()
    assert "_prep_args_for_hash" in type(torch_compat.new_fake_mode()).__dict__


@pytest.mark.parametrize("parallel", ["fsdp2", "tp", "ddp"])
def test_every_key_of_a_rank_step_is_torchs(checked, parallel):
    from memfit import zoo
    from memfit.measure.distributed import profile_ranks

    work = zoo.build("llama", vocab_size=256, seq_len=32, batch_size=2, parallel=parallel, attn_implementation="eager", **SIZES)
    profile_ranks(work, world_size=2)
    assert checked["equal"] > 1000


def test_odd_arguments_take_torchs_key(checked):
    mode = torch_compat.new_fake_mode()
    with mode:
        x = torch.empty(4, 6)
        y = torch.empty(6, 4).t()  # not contiguous
        z = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        torch.cat([x, y], dim=0)  # a list of tensors
        torch.sum(x, dim=(0, 1), keepdim=True, dtype=torch.float64)  # keywords, a tuple, a dtype
        x.new_zeros((2, 2), device="cpu")
        z * 2.5
        (x + y.contiguous()).addcmul_(x, x, value=0.5)
        x[torch.tensor([0, 2])]  # a real tensor made under the mode (a constant)
    assert checked["equal"] >= 6
