"""The bench harness end to end on a tiny model (seconds): it runs and reports; it asserts
no speed (benchmarks report, tests check behaviour)."""

from __future__ import annotations

import argparse
import json

import pytest

import memfit
from memfit.bench import runner
from memfit.bench.child import _measure
from memfit.bench.methods import applicable, setup
from memfit.cli import main
from memfit.zoo import build

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab_size": 64}


def test_sequential_only_for_chains():
    assert applicable("sequential", build("mlp-deep", depth=3, width=8).model) is None
    assert "not an nn.Sequential" in applicable("sequential", build("gpt", **TINY).model)


def test_plan_then_compile_method(tmp_path):
    """``plan+compile:PATH``: the plan goes on the model, and the model is compiled after."""
    import torch

    work = build("gpt", **TINY)
    plan = memfit.plan(work.model, work.inputs, 0.0, loss_fn=work.loss_fn, fake=True)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    wrapped = setup(f"plan+compile:{path}", work.model)
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule) and wrapped._orig_mod is work.model
    assert plan.checkpointed and all("forward" in work.model.get_submodule(n).__dict__ for n in plan.checkpointed)


def _child_in_process(target, *, method="none", measure="memory", batch_size=None, sizes=None, device="cpu", steps=5, **_):
    """``run_child`` without the fresh process: the child's own measurement (``_measure``) on
    the arguments ``run_child`` would have given it. Here the harness is under test (its
    rows, JSON, plot and page), not the child's process: a fresh process per configuration
    is a start-up of torch each (10 of them, ~80 of this test's ~85 CPU seconds). The child
    run as a process is tested in test_bench_child.py (its JSON on stdout, the allocator
    setting), test_cli.py (time+flops) and test_accuracy.py (RSS against predictions)."""
    ns = argparse.Namespace(
        target=target,
        method=method,
        measure=measure,
        batch_size=batch_size,
        size=[f"{k}={v!r}" for k, v in (sizes or {}).items()],
        device=device,
        steps=steps,
    )
    return {**_measure(ns), "target": target, "method": method, "measure": measure}


def test_bench_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_child", _child_in_process)
    out, png, page = tmp_path / "bench.json", tmp_path / "b.png", tmp_path / "b.html"
    argv = ["bench", "mlp-deep", "--size", "depth=4", "--size", "width=64", "--batch-size", "8", "--budgets", "0.5"]
    assert main([*argv, "--steps", "2", "--no-compile", "--json", str(out), "--plot", str(png), "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert "checkpoint_sequential" in text and "memfit 50%" in text
    data = json.loads(out.read_text())
    assert data["format"] == "memfit.bench/1"
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["none", "every", "every-other", "sequential", "memfit"]
    for r in rows.values():
        assert r["error"] is None and r["measured_peak_bytes"] > 0 and r["step_time_s"] > 0
        for key in (
            "method",
            "budget",
            "measured_peak_bytes",
            "predicted_peak_bytes",
            "step_time_s",
            "recompute_flops",
            "plan_time_s",
        ):
            assert key in r
    # checkpointing a lone Linear recomputes nothing (its input is the checkpoint input);
    # checkpoint_sequential recomputes whole segments
    assert rows["none"]["recompute_flops"] == 0 and rows["sequential"]["recompute_flops"] > 0
    assert rows["memfit"]["predicted_peak_bytes"] > 0 and rows["memfit"]["plan_time_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in page.read_text()


def test_bench_rejects_bad_budgets(capsys):
    assert main(["bench", "gpt", "--budgets", "half"]) == 2
    assert "--budgets takes fractions" in capsys.readouterr().err


def test_named_scenarios_point_at_real_modules():
    pytest.importorskip("transformers")
    from memfit.bench.methods import SCENARIOS, setup

    sizes = {
        "resnet152": {"depths": [1, 1, 1, 1], "hidden_sizes": [16, 32, 64, 128], "embedding_size": 16, "image_size": 32},
        "bert-base": {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "seq_len": 16,
        },
    }
    for model_name, method, _ in SCENARIOS.values():
        work = build(model_name, batch_size=2, **sizes[model_name])
        model = setup(method, work.model)  # raises if a named module is missing
        if method.startswith("modules:"):  # each named module now runs under a checkpoint
            names = method.split(":", 1)[1].split(",")
            assert all("forward" in model.get_submodule(n).__dict__ for n in names), method
        else:  # transformers' own recipe, switched on
            assert model.is_gradient_checkpointing, method
        out = model(**work.inputs)
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_scenario_needs_its_model(capsys):
    assert main(["bench", "gpt", "--scenario", "bert-per-layer"]) == 2
    assert "runs on zoo model 'bert-base'" in capsys.readouterr().err
    assert main(["bench", "gpt", "--scenario", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
