"""The Recipe as four frozen records (decision, prediction, measurement, provenance) and the
RankRecipe as three: recipe JSON written by main before the split (commit 8a5454b, tests/data)
still loads and writes back byte for byte, and the flat names users' scripts use still read,
build and set."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import memfit
from memfit.levers.recipe import (
    Decision,
    Measurement,
    Prediction,
    Provenance,
    RankDecision,
    RankPrediction,
    RankProvenance,
    RankRecipe,
    Recipe,
)
from memfit.measure.step import StepOptions

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("cls, name", [(Recipe, "recipe_v2_main_8a5454b.json"), (RankRecipe, "rank_recipe_v2_main_8a5454b.json")])
def test_json_written_before_the_split_loads_and_writes_back_the_same(cls, name):
    text = (DATA / name).read_text()
    recipe = cls.from_json(text)
    data = json.loads(text)
    # fields added since (within version 2: the per-rank recipe's fake-CUDA peaks) write their defaults
    added = {"allocated_peak_bytes": None, "allocator_conf": None} if cls is RankRecipe else {}
    assert recipe.to_json() == json.dumps({**data, **added}, indent=1)
    assert cls.from_json(recipe.to_json()) == recipe
    for key, value in data.items():  # every field of the old file is in exactly one record
        if key not in ("format", "version", "step", "plan", "what_if", "left_out", "levers", "rank_peak_bytes"):
            assert getattr(getattr(recipe, cls.WHERE[key]), key) == value == getattr(recipe, key)
    assert recipe.decision.levers == tuple(data["levers"]) and recipe.decision.plan == recipe.plan


def test_a_recipe_from_main_reads_as_before():
    recipe = Recipe.from_json((DATA / "recipe_v2_main_8a5454b.json").read_text())
    assert recipe.levers == ("recompute",) and recipe.plan is not None and recipe.plan.checkpointed
    assert recipe.decision.budget == "3.5MiB" and recipe.budget_bytes == 3670016
    assert recipe.prediction.predicted_peak_bytes <= recipe.budget_bytes
    assert recipe.measurement.measured_peak_bytes == recipe.measured_peak_bytes is not None
    assert recipe.provenance.model_type == "GPT" and recipe.provenance.search["combinations"] >= 1
    assert "memfit.apply_recipe(recipe, model, optimizer)" in recipe.snippet()
    assert recipe.left_out["amp"].why is memfit.levers.catalog.Why.OPT_IN


def _records() -> tuple[Decision, Prediction, Measurement, Provenance]:
    return (
        Decision(
            100,
            ("microbatch",),
            StepOptions(micro_batches=2, loss_scale=0.5),
            None,
            left_out={"amp": "changes the numerics: opt in with allow='amp' (--allow amp)"},
        ),
        Prediction(90, 0.5, 150),
        Measurement(91, 0.6, 0.4),
        Provenance(batch_size=8, model_type="Net", notes=["a note"]),
    )


def test_the_flat_fields_build_read_and_set_through_the_records():
    decision, prediction, measurement, provenance = _records()
    recipe = Recipe(decision, prediction, measurement, provenance)
    assert recipe == Recipe(decision=decision, prediction=prediction, measurement=measurement, provenance=provenance)
    flat = recipe.flat()
    assert list(flat) == list(Recipe.FLAT) and len(Recipe.FLAT) == 29
    assert Recipe(**flat) == recipe == Recipe(*flat.values())  # by name, and by position in the old order
    assert recipe.levers is decision.levers and recipe.micro_batches == 2 and recipe.loss_scale == 0.5
    assert recipe.left_out["amp"].why is memfit.levers.catalog.Why.OPT_IN  # the reason got its kind in Decision
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.decision.budget = "x"  # type: ignore[misc]
    recipe.budget = "100B"  # as the CLI does: a new Decision, the old one unchanged
    assert recipe.decision.budget == "100B" and decision.budget == "" and recipe.decision.levers is decision.levers
    changed = dataclasses.replace(recipe, measured_step_time_s=0.7)
    assert changed.measurement.measured_step_time_s == 0.7 and recipe.measured_step_time_s == 0.6
    assert changed.decision is recipe.decision and changed.provenance is recipe.provenance


def test_a_wrong_field_is_one_line_naming_the_fields():
    recipe = Recipe(*_records())
    for call, words in [
        (lambda: Recipe(**{**recipe.flat(), "levers_": ()}), "no field 'levers_'"),
        (lambda: setattr(recipe, "predicted_peak", 1), "no field 'predicted_peak' to set"),
        (lambda: Recipe(recipe.decision, recipe.prediction), "measurement, provenance missing"),
        (lambda: Recipe(1, (), StepOptions(), None, 1, None, None, None, 1, None, budget_bytes=2), "twice"),
    ]:
        with pytest.raises((TypeError, AttributeError), match=words) as info:
            call()
        assert "\n" not in str(info.value)


def test_every_field_lives_in_one_record():
    for cls in (Recipe, RankRecipe):
        names = [f.name for record in cls.RECORDS.values() for f in dataclasses.fields(record)]
        assert sorted(names) == sorted(cls.FLAT) and len(set(names)) == len(names)
    assert RankRecipe.RECORDS == {"decision": RankDecision, "prediction": RankPrediction, "provenance": RankProvenance}
    assert memfit.Recipe is Recipe and "Recipe" in memfit.__all__
