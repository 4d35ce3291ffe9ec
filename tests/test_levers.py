"""The levers as data (memfit.levers.catalog): one module, one record each; fit, the recipe
and the report read them and nothing else. Cheap: no step runs."""

import dataclasses
import json
import pkgutil

import pytest
import torch
from torch import nn

from memfit.levers import catalog
from memfit.levers.catalog import Combo, Reason, Situation, Why
from memfit.levers.catalog.base import read_reason
from memfit.levers.recipe import LEVERS, Recipe, describe
from memfit.measure.checked import Step
from memfit.measure.step import StepOptions
from memfit.workload import Where


def _situation(*, allowed=(), exclude=None, set_to_none=True, device="cpu", fake_cuda=False, model=None, opt=None):
    model = model or nn.Linear(4, 4)
    step = Step(
        model,
        (torch.randn(8, 4),),
        {},
        None,
        opt or torch.optim.AdamW(model.parameters(), foreach=False),
        None,
        StepOptions(),
        Where.FAKE_CUDA if fake_cuda else Where.REAL,
        torch.device(device),
    )
    return Situation(step=step, allowed=set(allowed), exclude=exclude or {}, set_to_none=set_to_none, settings=None)


def test_every_module_of_the_catalog_is_one_lever_in_the_list():
    modules = {m.name for m in pkgutil.iter_modules(catalog.__path__)} - {"base"}
    assert len(catalog.ALL) == len(modules) == len(catalog.BY_NAME)  # one record per module, names unique
    for name in modules:
        module = __import__(f"memfit.levers.catalog.{name}", fromlist=["LEVER"])
        assert module.LEVER in catalog.ALL, f"catalog/{name}.py's LEVER is not in catalog.ALL"
    assert list(LEVERS) == [lever.name for lever in catalog.ALL]
    assert all(LEVERS[lever.name] == lever.does and lever.does for lever in catalog.ALL)
    fields = {f.name for f in dataclasses.fields(Combo)}
    assert {lever.field for lever in catalog.ALL if lever.field} == fields  # every Combo field is some lever's
    assert set(catalog.EXACT) | set(catalog.OPT_IN) == set(LEVERS) and not set(catalog.EXACT) & set(catalog.OPT_IN)


@pytest.mark.parametrize("name", catalog.OPT_IN)
def test_a_lever_that_changes_the_numerics_waits_for_allow(name):
    lever = catalog.BY_NAME[name]
    why = lever.reason(_situation())
    assert isinstance(why, Reason) and why.why is Why.OPT_IN and f"allow={name!r}" in why
    assert lever.reason(_situation(allowed={name})) is None or lever.reason(_situation(allowed={name})).why is not Why.OPT_IN


def test_reasons_are_typed_by_the_lever_not_read_from_sentences():
    s = _situation(set_to_none=True)
    assert catalog.BY_NAME["set_to_none"].reason(s).why is Why.ALREADY_ON
    assert catalog.BY_NAME["offload"].reason(s).why is Why.NOT_APPLICABLE  # on the host already
    assert catalog.BY_NAME["offload"].reason(_situation(fake_cuda=True)).why is Why.UNAVAILABLE
    excluded = _situation(set_to_none=False, exclude={"set_to_none": "the framework zeroes gradients"})
    assert catalog.BY_NAME["set_to_none"].reason(excluded) == "the framework zeroes gradients"
    assert catalog.BY_NAME["set_to_none"].reason(excluded).why is Why.EXCLUDED
    half = nn.Linear(4, 4).to(torch.bfloat16)
    amp = catalog.BY_NAME["amp"].reason(_situation(allowed={"amp"}, model=half))
    assert amp.why is Why.NOT_APPLICABLE and "bfloat16, not float32" in amp
    assert catalog.BY_NAME["expandable_segments"].settings(_situation()) == ()  # not a lever off CUDA
    assert catalog.BY_NAME["expandable_segments"].settings(_situation(fake_cuda=True)) == (True,)


def test_each_lever_sets_only_its_own_step_options():
    s = _situation()
    s.probes["loss_scales"] = ({2: 0.5}, None)  # as the micro-batch probe would find for a mean loss
    base = Combo()
    for lever in catalog.ALL:
        if not lever.field:
            assert lever.step(base, s) == {}
            continue
        value = {"micro_batches": 2, "precision": "amp" if lever.name == "amp" else "bf16"}.get(lever.field, True)
        combo = dataclasses.replace(base, **{lever.field: value})
        assert lever.used(combo, None, _situation(set_to_none=False)) or lever.name == "set_to_none"
        changed = {k for k, v in lever.step(combo, s).items() if v != getattr(StepOptions(), k)}
        others = {k for other in catalog.ALL if other is not lever and other.field != lever.field for k in other.step(combo, s)}
        assert not changed & others, f"{lever.name} sets another lever's step options: {changed & others}"
    assert catalog.BY_NAME["microbatch"].step(Combo(micro_batches=2), s) == {"micro_batches": 2, "loss_scale": 0.5}


def test_describe_is_each_levers_words():
    step = StepOptions(micro_batches=4, autocast="bfloat16", optimizer_8bit=True)
    assert describe(("microbatch", "amp", "8bit"), step, None, optimizer_type="AdamW") == (
        "micro-batches x4 + amp (bfloat16 autocast) + 8-bit AdamW state (bitsandbytes)"
    )


def _recipe(**left_out):
    return Recipe(
        budget_bytes=1,
        levers=(),
        step=StepOptions(),
        plan=None,
        predicted_peak_bytes=1,
        predicted_step_time_s=None,
        measured_peak_bytes=None,
        measured_step_time_s=None,
        base_peak_bytes=1,
        base_step_time_s=None,
        left_out=left_out,
    )


def test_a_reason_keeps_its_kind_through_the_recipes_json_and_old_json_still_reads():
    recipe = _recipe(amp=Reason(Why.OPT_IN, "changes the numerics: opt in with allow='amp' (--allow amp)"))
    data = recipe.to_dict()
    assert data["version"] == 2 and data["left_out"]["amp"] == {"why": "opt_in", "text": str(recipe.left_out["amp"])}
    back = Recipe.from_json(json.dumps(data))
    assert back.left_out["amp"] == recipe.left_out["amp"] and back.left_out["amp"].why is Why.OPT_IN
    # version 1 wrote the sentence alone: its kind is read from its words, at the edge only
    old = {**data, "version": 1, "left_out": {"amp": str(recipe.left_out["amp"]), "offload": "save nothing on the host"}}
    back = Recipe.from_dict(old)
    assert back.left_out["amp"].why is Why.OPT_IN and back.left_out["offload"].why is Why.NOT_APPLICABLE
    # a hand-made recipe with bare sentences gets kinds too; a Reason survives a copy
    assert _recipe(set_to_none="the loop already calls zero_grad").left_out["set_to_none"].why is Why.ALREADY_ON
    assert read_reason(dataclasses.replace(recipe).left_out["amp"]).why is Why.OPT_IN


def test_each_lever_writes_its_own_lines_into_the_snippet():
    """A lever's snippet lines are its record's (``Lever.lines``): a recipe using it alone shows
    each of them in a snippet that is valid Python, and a recipe without it shows none."""
    import ast
    import types

    plan = types.SimpleNamespace(checkpointed={"h.0": None, "h.1": None}, use_cache_off=())
    steps = {
        "microbatch": StepOptions(micro_batches=2),
        "offload": StepOptions(offload=True),
        "amp": StepOptions(autocast="float16", grad_scaler=True),
        "bf16": StepOptions(param_dtype="bfloat16"),
        "foreach": StepOptions(foreach=True),
        "8bit": StepOptions(optimizer_8bit=True),
    }
    for lever in catalog.ALL:
        recipe = dataclasses.replace(
            _recipe(),
            levers=(lever.name,),
            step=steps.get(lever.name, StepOptions()),
            plan=plan if lever.name == "recompute" else None,
            optimizer_type="AdamW",
            allocator_conf="expandable_segments:True",
        )
        text = recipe.snippet()
        ast.parse(text)
        lines = lever.lines(recipe)
        pieces = [
            *lines.environment,
            *lines.applied,
            *([lines.optimizer] if lines.optimizer else []),
            *lines.setup,
            *lines.batch,
            *([lines.backward] if lines.backward else []),
            *lines.step,
            *(lines.context or ()),
        ]
        for piece in pieces:
            assert piece in text, f"{lever.name}: {piece!r} not in its snippet"
            assert piece not in _recipe().snippet()
    assert catalog.BY_NAME["recompute"].lines(_recipe()) == catalog.Lines()  # no plan: nothing to say
