"""The same accuracy bar on a GPU: runs where CUDA is available, skips elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import zoo
from memfit.bench.child import measure_step_peak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_cuda_peak_matches_max_memory_allocated(name):
    work = zoo.build(name)
    model = work.model.cuda()
    inputs = torch.utils._pytree.tree_map(lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, work.inputs)
    prof = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
    assert prof.device.startswith("cuda") and prof.step_time_s > 0
    measured = measure_step_peak(name, device="cuda")
    error = (prof.step_peak_bytes - measured["step_peak_bytes"]) / measured["step_peak_bytes"]
    assert abs(error) < 0.03, f"{name}: predicted {prof.step_peak_bytes}, measured {measured['step_peak_bytes']}"
    assert abs(prof.peak_bytes - measured["peak_bytes"]) / measured["peak_bytes"] < 0.03


def test_cuda_profile_leaves_state_untouched():
    work = zoo.build("gpt", n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=256, batch_size=2)
    model = work.model.cuda()
    inputs = {k: v.cuda() for k, v in work.inputs.items()}
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.cuda.get_rng_state()
    memfit.profile(model, inputs)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert torch.equal(rng, torch.cuda.get_rng_state())
