"""The same accuracy bar on a GPU: runs where CUDA is available, skips elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import zoo
from memfit.bench.child import measure_step_peak
from memfit.workload import call_loss

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


def _small_gpt_on_cuda():
    work = zoo.build("gpt", n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024, batch_size=8)
    model = work.model.cuda()
    inputs = {k: v.cuda() for k, v in work.inputs.items()}
    return work, model, inputs


def test_cuda_offload_predicted_peak_matches_max_memory_allocated():
    from memfit.measure.step import train_step

    work, model, inputs = _small_gpt_on_cuda()
    opt = work.make_optimizer()
    offload = memfit.StepOptions(offload=True)
    real = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=opt, step=offload)
    fake = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=opt, step=offload, fake=True)
    plain = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True)
    assert real.ledger.host_peak_bytes > 0 and real.peak_bytes < plain.peak_bytes
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    train_step(model, (), inputs, work.loss_fn, opt, offload=True)  # warm-up: the optimizer state
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, (), inputs, work.loss_fn, opt, offload=True)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    predicted = real.step_peak_bytes
    print(f"offload gpt on cuda: predicted {predicted}, measured {measured}, host {real.ledger.host_peak_bytes}")
    assert abs(predicted - measured) <= 0.05 * measured


def test_cuda_fit_weighs_offload():
    work, model, inputs = _small_gpt_on_cuda()
    opt = work.make_optimizer()
    plain = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True)
    offloaded = memfit.profile(
        model, inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True, step=memfit.StepOptions(offload=True)
    )
    # on CUDA budgets and predicted peaks are reserved bytes (the allocator model's)
    budget = (plain.budget_peak_bytes + offloaded.budget_peak_bytes) // 2
    recipe = memfit.fit(model, inputs, budget, loss_fn=work.loss_fn, optimizer=opt)
    assert "offload" not in recipe.left_out or recipe.left_out["offload"].startswith("the chosen")
    rows = [w for w in recipe.what_if if "offload" in w.levers]
    assert rows and rows[0].predicted_peak_bytes == offloaded.budget_peak_bytes and "host memory" in rows[0].note
    if "offload" in recipe.levers:
        assert "run.offload()" in recipe.snippet()
        assert abs(recipe.allocated_peak_bytes - recipe.measured_peak_bytes) <= 0.05 * recipe.measured_peak_bytes


def test_cuda_plan_for_a_reserved_budget_reserves_within_it():
    """A plan for a budget under the step's reserved peak, applied: torch's own
    max_memory_reserved over real steps stays within it (2% for the allocator model)."""
    work, model, inputs = _small_gpt_on_cuda()
    opt = work.make_optimizer()
    plain = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True)
    budget = plain.allocated_peak_bytes - (plain.allocated_peak_bytes - plain.start_bytes) // 4
    plan = memfit.plan(model, inputs, budget, loss_fn=work.loss_fn, optimizer=opt)
    assert plan.peak_basis == "reserved_peak_bytes" and plan.predicted_peak_bytes <= budget
    memfit.apply(model, plan)
    try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            call_loss(work.loss_fn, model(**inputs), work.targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert torch.cuda.max_memory_reserved() <= budget * 1.02
    finally:
        memfit.remove(model)


def test_cuda_profile_reports_the_allocators_measured_peaks():
    """On a real GPU allocated/reserved are torch.cuda's own peaks over the unrecorded step; the
    allocator model's replay of the recorded ledger is kept beside them and must agree."""
    work, model, inputs = _small_gpt_on_cuda()
    prof = memfit.profile(model, inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
    c = prof.cuda_memory
    assert c is not None and c.source == "torch.cuda.max_memory_allocated/reserved"
    assert prof.allocated_peak_bytes >= prof.peak_bytes * 0.97 and prof.reserved_peak_bytes >= prof.allocated_peak_bytes
    data = prof.to_dict(ledger=False)
    assert data["allocated_peak_bytes"] == prof.allocated_peak_bytes and "allocator_settings" in data
    # the model replays one step from an empty cache; the GPU's cache holds the warm-up's segments too
    assert abs(c.model["allocated_peak_bytes"] - c.allocated_peak_bytes) <= 0.03 * c.allocated_peak_bytes
    assert c.model["reserved_peak_bytes"] <= c.reserved_peak_bytes * 1.02
