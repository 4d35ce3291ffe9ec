"""Predicted step peak against physical ground truth, measured in a fresh process.

On CPU the ground truth is the process's RSS high-water mark over the step, with
MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the OS (see
memfit/bench/child.py). The issue's bar: within 3% on zoo models with over
~100 MiB of activations. The zoo models run at half their default size (SIZES): still
well over that bar, at half the CPU seconds.
"""

from __future__ import annotations

import sys

import pytest

import memfit
from memfit import zoo
from memfit.bench.child import measure_step_peak, run_child

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS ground truth reads /proc")


SIZES = {"resnet": {"batch_size": 8}, "mlp-deep": {"depth": 50}}
"""Half the default sizes, for time: resnet's activations are 240 MiB at batch 8 (478 MiB at
the default 16), over twice the issue's 100 MiB; mlp-deep's step peak (gradients and AdamW
temporaries) is over 200 MiB at 50 layers. RSS noise (pages, the interpreter's own small
allocations) is a few MiB at most: the 3% bars stay as strict."""


def _sized(name: str) -> dict:
    """measure_step_peak's keywords for ``name`` at its SIZES (zoo.build takes SIZES as they are)."""
    sizes = dict(SIZES.get(name, {}))
    return {"batch_size": sizes.pop("batch_size", None), "sizes": sizes}


@pytest.fixture(scope="module")
def zoo_default():
    """Each zoo model's workload (at SIZES), real profile and RSS-measured step, made once
    for the module (a profile and a fresh-process step take seconds at these sizes; several
    tests check different things against the same ones)."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            work = zoo.build(name, **SIZES.get(name, {}))
            prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())
            cache[name] = (work, prof, measure_step_peak(name, **_sized(name)))
        return cache[name]

    return get


# zoo gpt (the default model) meets these bars in test_cli.py's test_demo_runs_end_to_end, on
# the runs `memfit demo` makes of it: the same profile, RSS measurement, plan at 50% and
# planned measurement, made once.


@pytest.mark.parametrize("name, min_activations", [("resnet", 100 * 2**20), ("mlp-deep", 0)])
def test_predicted_peak_within_3_percent_of_rss(name, min_activations, zoo_default):
    # mlp-deep saves only 25 MiB of activations (below the bar) but its peak, in the
    # optimizer step, is over 200 MiB of gradients and AdamW temporaries: checked all the same.
    _, prof, measured = zoo_default(name)
    activations = sum(b.nbytes for b in prof.ledger.blocks if b.category is memfit.Category.ACTIVATION)
    assert activations > min_activations
    error = (prof.step_peak_bytes - measured["step_peak_bytes"]) / measured["step_peak_bytes"]
    assert abs(error) < 0.03, f"{name}: predicted {prof.step_peak_bytes}, measured {measured['step_peak_bytes']} ({error:+.2%})"


def test_fake_prediction_matches_too(zoo_default):
    # the laptop use: a fake-tensor profile predicts the same physical peak
    work, _, measured = zoo_default("resnet")
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake=True)
    error = (prof.step_peak_bytes - measured["step_peak_bytes"]) / measured["step_peak_bytes"]
    assert abs(error) < 0.03, f"predicted {prof.step_peak_bytes}, measured {measured['step_peak_bytes']} ({error:+.2%})"


@pytest.mark.parametrize("name", ["resnet"])
def test_planned_step_stays_within_budget(name, tmp_path, zoo_default):
    # the planner issue's bar: measured peak <= budget (3% allowance for allocator noise)
    # and predicted within 5% of measured, in a fresh process with the plan applied
    work, prof, _ = zoo_default(name)
    plan = memfit.plan(work.model, work.inputs, 0.5, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), profile=prof)
    assert plan.checkpointed
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    measured = plan.start_bytes + measure_step_peak(name, plan_path=str(path), **_sized(name))["step_peak_bytes"]
    assert measured <= plan.budget_bytes * 1.03, f"{name}: measured {measured} over budget {plan.budget_bytes}"
    assert abs(plan.predicted_peak_bytes - measured) / measured < 0.05


def test_eight_bit_recipe_peak_within_3_percent_of_rss(tmp_path):
    # issue 6's 8bit lever against RSS in a fresh process: the recipe applied by the child
    # (memfit.bench.child --method fit:PATH), its optimizer bitsandbytes' AdamW8bit, whose
    # CPU kernel dequantises both moments to float32 temporaries inside one op
    pytest.importorskip("bitsandbytes")
    from memfit import StepOptions
    from memfit.bench.child import run_child

    sizes = {"depth": 10}
    work = zoo.build("mlp-deep", **sizes)
    opt = work.make_optimizer()
    eight = memfit.profile(
        work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt, fake=True, step=StepOptions(optimizer_8bit=True)
    )
    recipe = memfit.fit(work.model, work.inputs, eight.peak_bytes, loss_fn=work.loss_fn, optimizer=opt, allow="8bit")
    assert "8bit" in recipe.levers
    path = tmp_path / "recipe.json"
    path.write_text(recipe.to_json())
    measured = run_child("mlp-deep", method=f"fit:{path}", sizes=sizes)
    assert "error" not in measured, measured
    error = (eight.step_peak_bytes - measured["step_peak_bytes"]) / measured["step_peak_bytes"]
    print(f"{recipe.summary()}: step peak predicted {eight.step_peak_bytes}, RSS {measured['step_peak_bytes']} ({error:+.2%})")
    assert abs(error) < 0.03, f"predicted {eight.step_peak_bytes}, measured {measured['step_peak_bytes']} ({error:+.2%})"
    assert eight.start_bytes + measured["step_peak_bytes"] <= recipe.budget_bytes * 1.03


def test_autograd_graph_estimate_where_it_is_the_whole_step():
    # Zoo heavy at 30k scalar ops: the step's RSS rise is autograd's host memory, not
    # tensors. memfit's graph blocks (counted nodes and saved tensors x constants fitted on
    # other op patterns, whose own figures spread by up to 15%) must carry the prediction:
    # measured +7.7% here, +2.6% at heavy's default 100k ops (docs/benchmarks/accuracy.md).
    sizes = {"n_ops": 30_000}
    out = run_child("heavy", sizes=sizes)
    work = zoo.build("heavy", **sizes)
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn)  # real: 5x faster than fake here
    error = prof.step_peak_bytes / out["step_peak_bytes"] - 1
    print(f"heavy 30k ops: RSS rise {out['step_peak_bytes']}, predicted {prof.step_peak_bytes} ({error:+.2%})")
    assert prof.breakdown["autograd_graph"] > 0.95 * prof.step_peak_bytes
    assert abs(error) < 0.10
    big = zoo.build("gpt")
    gpt = memfit.profile(big.model, big.inputs, loss_fn=big.loss_fn, fake=True)
    assert 0 < gpt.breakdown["autograd_graph"] < 0.01 * gpt.peak_bytes  # noise where tensors are large


def test_kernel_workspace_cnn_profile_and_plan_against_rss(tmp_path):
    # Issue 13: a ConvNeXt-style CNN (depthwise 7x7, LayerNorm over channels) whose peak
    # holds memory oneDNN allocates inside kernels; without it the profile was 16% under
    # and plans ended 16-22% over budget.
    work = zoo.build("convnext", batch_size=4)
    opt = work.make_optimizer()
    prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt)
    assert prof.breakdown["kernel_workspace"] > 0.05 * prof.step_peak_bytes
    measured = measure_step_peak("convnext", batch_size=4)["step_peak_bytes"]
    error = (prof.step_peak_bytes - measured) / measured
    assert abs(error) < 0.03, f"predicted {prof.step_peak_bytes}, measured {measured} ({error:+.2%})"
    plan = memfit.plan(work.model, work.inputs, 0.5, loss_fn=work.loss_fn, optimizer=opt, profile=prof)
    assert plan.checkpointed
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    planned = plan.start_bytes + measure_step_peak("convnext", batch_size=4, plan_path=str(path))["step_peak_bytes"]
    assert planned <= plan.budget_bytes * 1.03, f"measured {planned} over budget {plan.budget_bytes}"
    assert abs(plan.predicted_peak_bytes - planned) / planned < 0.05
