"""Inputs that share storage are one block of memory wherever memfit copies or counts them
(issue 24, item 3). The README's own pattern, ``{"input_ids": ids, "labels": ids}``, copied
tensor by tensor to fake CUDA, held the ids twice: the profile counted 2048 bytes of inputs
where the step has 1024, and a plan from it was refused ("the profile was made with other
inputs") after the whole profile had run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch

from memfit.compat import torch_compat as _torch_compat
from memfit.measure.inputs import input_bytes, map_shared

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = str(ROOT / "benchmarks" / "workloads" / "llama_same_ids.py")


def test_one_tensor_twice_is_one_copy_and_views_stay_views():
    ids = torch.arange(24).view(4, 6)
    tree = {"input_ids": ids, "labels": ids, "shifted": ids[:, 1:], "mask": torch.ones(3)}
    out = map_shared(lambda t: t.clone(), tree)
    assert out["input_ids"] is out["labels"]
    assert out["shifted"].untyped_storage().data_ptr() == out["input_ids"].untyped_storage().data_ptr()
    assert all(torch.equal(out[k], tree[k]) for k in tree)
    assert out["input_ids"].untyped_storage().data_ptr() != ids.untyped_storage().data_ptr()  # copied
    fake = map_shared(_torch_compat.new_fake_mode().from_tensor, tree)
    assert fake["input_ids"] is fake["labels"] and fake["shifted"].stride() == (6, 1)
    assert fake["shifted"].storage_offset() == 1


def test_slices_of_a_big_storage_copy_only_what_they_reach():
    data = torch.arange(1000.0)
    tree = (data[10:20], data[15:30])
    out = map_shared(lambda t: t.clone(), tree)
    assert torch.equal(out[0], tree[0]) and torch.equal(out[1], tree[1])
    assert out[0].untyped_storage().nbytes() == 20 * 4  # elements 10..29, not the 1000
    # as ledgers count them: the whole storage on its own device, the copies on fake CUDA
    assert input_bytes(tree) == 4000
    assert input_bytes(tree, copied_to=torch.device("cuda")) == 512
    ids = torch.zeros(2, 64, dtype=torch.int64)
    assert input_bytes({"input_ids": ids, "labels": ids}) == 1024
    assert input_bytes({"input_ids": ids, "labels": ids.clone()}) == 2048


def test_on_the_same_device_nothing_is_copied():
    ids = torch.arange(6)
    tree = {"a": ids, "b": ids[1:]}
    out = map_shared(lambda t: t.to("cpu"), tree)
    assert out["a"] is ids and out["b"] is tree["b"]


SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys, memfit
    from memfit.measure.ledger import Category
    spec = importlib.util.spec_from_file_location("wl", WORKLOAD)
    wl = importlib.util.module_from_spec(spec); spec.loader.exec_module(wl)
    w = wl.llama_same_ids()
    prof = memfit.profile(w.model, w.inputs, loss_fn=w.loss_fn, fake="cuda")
    inputs = [b.nbytes for b in prof.ledger.blocks if b.category is Category.INPUT]
    plan = memfit.plan(w.model, w.inputs, "50%", loss_fn=w.loss_fn, profile=prof)
    print("RESULT" + json.dumps({"inputs": inputs, "peak": plan.predicted_peak_bytes, "none": plan.none_peak_bytes,
                                 "prof_peak": prof.budget_peak_bytes}))
    """
)


def test_the_same_tensor_twice_plans_on_fake_cuda(fake_cuda):
    """Fails on the main of 2025-11 (d2092c6): PlanError, 2048 bytes of inputs against 1024."""
    # in the session's fake-CUDA interpreter (conftest), not a fresh one: one start-up of torch
    # and memfit less for a step of milliseconds
    done = fake_cuda.script(f"WORKLOAD = {WORKLOAD!r}\n" + SCRIPT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    assert result["inputs"] == [1024]  # ids (2 x 64 int64) once, as the real step holds them
    assert result["none"] == result["prof_peak"]
