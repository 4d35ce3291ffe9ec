"""Ranks are a dimension of a result, not a second type beside it: a single device's profile is
rank 0 of a world of one, a fit's recipe on one device and per rank share a base (the same
records' names, one JSON reader and writer), and the renderers take either."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import memfit
from memfit.errors import PlanError
from memfit.levers.recipe import FitRecipe, RankRecipe, Recipe
from memfit.measure.distributed import RankProfiles
from memfit.report import console as rc

DATA = Path(__file__).parent / "data"
FILES = {Recipe: "recipe_v2_main_8a5454b.json", RankRecipe: "rank_recipe_v2_main_8a5454b.json"}
SHARED = (
    "budget_bytes", "levers", "plan", "left_out", "budget", "allocator_conf", "predicted_peak_bytes",
    "predicted_step_time_s", "base_peak_bytes", "allocated_peak_bytes", "what_if", "batch_size", "device",
    "fit_time_s", "notes", "search",
)  # fmt: skip


def _text(fn, *args, **kwargs) -> str:
    buf = io.StringIO()
    fn(*args, Console(width=100, file=buf, color_system=None), **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("cls", [Recipe, RankRecipe])
def test_both_recipes_are_one_kind_with_the_same_names_in_the_same_records(cls):
    recipe = FitRecipe.from_json.__func__(cls, (DATA / FILES[cls]).read_text())  # the base's reader, as the class's
    assert isinstance(recipe, cls) and issubclass(cls, FitRecipe)
    for name in SHARED:
        assert name in cls.WHERE, name
    assert {cls.WHERE[n] for n in ("budget_bytes", "levers", "plan", "left_out")} == {"decision"}
    assert {cls.WHERE[n] for n in ("predicted_peak_bytes", "base_peak_bytes", "what_if")} == {"prediction"}
    assert {cls.WHERE[n] for n in ("device", "notes", "search", "fit_time_s")} == {"provenance"}
    assert cls.from_json(recipe.to_json()) == recipe


@pytest.mark.parametrize("cls, what", [(Recipe, "recipe"), (RankRecipe, "per-rank recipe")])
def test_a_bad_recipe_file_is_refused_in_one_line_naming_its_kind(cls, what):
    data = json.loads((DATA / FILES[cls]).read_text())
    for broken, words in (
        ({**data, "levers": ["no_such_lever"]}, f"{what} JSON names unknown lever 'no_such_lever'"),
        ({k: v for k, v in data.items() if k != "budget_bytes"}, f"{what} JSON is missing or has malformed fields"),
        ({**data, "format": "memfit.plan"}, f"not a memfit {what}: the JSON has no \"format\": \"{data['format']}\""),
    ):
        with pytest.raises(PlanError, match=words) as info:
            cls.from_dict(broken)
        assert "\n" not in str(info.value)
    # a file of the other kind is not read as this one
    other = RankRecipe if cls is Recipe else Recipe
    with pytest.raises(PlanError):
        cls.from_json((DATA / FILES[other]).read_text())


def test_render_fit_takes_a_recipe_per_rank_too():
    recipe = RankRecipe.from_json((DATA / FILES[RankRecipe]).read_text())
    assert _text(rc.render_fit, recipe, title="llama") == _text(rc.render_rank_fit, recipe, title="llama")


def test_one_device_is_rank_0_of_a_world_of_one():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prof = memfit.profile(model, torch.randn(4, 8), fake=True)
    assert (prof.world_size, prof.worst_rank, prof.profiles) == (1, 0, {0: prof})
    # read as a world's profiles are: the same figures through the same names
    world = RankProfiles(world_size=1, parallel="one device", profiles={0: prof})
    assert world.profiles[world.worst_rank] is prof.profiles[prof.worst_rank]
    assert world.peak_bytes == prof.peak_bytes and world.budget_peak_bytes == prof.budget_peak_bytes
    # one renderer for both: ranks get render_ranks' rows, one device its profile alone
    assert _text(rc.render_profile, world, title="mlp") == _text(rc.render_ranks, world, title="mlp")
    alone = _text(rc.render_profile, prof, title="mlp")
    assert alone.startswith("mlp on fake:cpu") and "per rank" not in alone


@pytest.mark.parametrize("cls", [Recipe, RankRecipe])
def test_a_recipe_reads_its_per_rank_peaks_alike_one_device_as_rank_0_of_1(cls):
    recipe = cls.from_json((DATA / FILES[cls]).read_text())
    assert recipe.world_size >= 1 and recipe.rank_peak_bytes
    assert max(recipe.rank_peak_bytes.values()) == recipe.predicted_peak_bytes
    assert set(recipe.rank_peak_bytes) <= set(range(recipe.world_size))
    if cls is Recipe:
        assert (recipe.world_size, recipe.rank_peak_bytes) == (1, {0: recipe.predicted_peak_bytes})
        assert "world_size" not in recipe.to_dict() and cls.from_json(recipe.to_json()) == recipe  # JSON unchanged
