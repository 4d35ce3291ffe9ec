"""Rendering (memfit.report.console) at 80 columns, the width of a log or a CI job, and the
plain progress lines for output that is not a terminal."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.cells import cell_len
from rich.console import Console
from torch import nn

import memfit
from memfit import Choice, Plan
from memfit.bench.runner import Row
from memfit.levers.max_batch import BatchLimit, MaxBatch
from memfit.levers.recipe import Recipe, WhatIf
from memfit.measure.step import StepOptions
from memfit.report import console as rc
from memfit.report import progress as rp

MiB = 1 << 20


def render(fn, *args, width: int = 80, **kwargs) -> str:
    buf = io.StringIO()
    fn(*args, Console(width=width, file=buf, color_system=None), **kwargs)
    text = buf.getvalue()
    # the code snippet fit prints is not wrapped: it is for copying
    for line in text.partition("in your training loop")[0].splitlines():
        assert cell_len(line) <= width, line
    return text


def row_of(text: str, first: str, *, prefix: bool = False) -> str:
    """The one line of ``text`` whose first cell is ``first`` (or starts with it)."""
    cells = [(re.split(r"\s{2,}", line.strip())[0], line) for line in text.splitlines()]
    lines = [line for cell, line in cells if (cell.startswith(first) if prefix else cell == first)]
    assert len(lines) == 1, (first, text)
    return lines[0]


LONG = [
    "bert.encoder.layer.10.attention.output.dense_projection_long",
    "bert.encoder.layer.11.attention.output.dense_projection_long",
    "transformer.h.0.attn",
]
EXCLUDED = {
    "layer1.0.relu": "called 3 times in a step (memfit plans modules called once)",
    "layer2.0.relu": "called 3 times in a step (memfit plans modules called once)",
    "model.counter": (
        "recompute not reproducible: its forward changes attribute 'calls', state outside its tensors "
        "(a cache, a counter) that a recompute would change again"
    ),
    "model": "recompute not reproducible: contains 'model.counter', whose forward changes attribute 'calls'",
    "h.3:selective": "selective recompute not reproducible: RuntimeError: boom",
    "odd": "a reason this renderer has no words for",
}


def make_plan(**kw) -> Plan:
    return Plan(
        400 * MiB,
        399 * MiB,
        100 * MiB,
        624 * MiB,
        276 * MiB,
        {
            LONG[0]: Choice("selective", ("addmm", "ones", "scalar_tensor", "tril")),
            LONG[1]: Choice("selective", ("bmm", "some_new_op")),
            LONG[2]: Choice("full"),
        },
        0.09,
        10**9,
        0.9,
        budget="400MiB",
        **kw,
    )


def make_recipe(plan: Plan | None = None) -> Recipe:
    return Recipe(
        400 * MiB,
        ("recompute", "microbatch"),
        StepOptions(micro_batches=4),
        plan,
        300 * MiB,
        0.823,
        300 * MiB,
        0.861,
        624 * MiB,
        0.811,
        what_if=[
            WhatIf(
                "micro-batches x4 + recompute (3 modules)",
                ("recompute", "microbatch"),
                300 * MiB,
                0.823,
                True,
                300 * MiB,
                0.861,
                chosen=True,
            ),
            WhatIf("zero_grad(set_to_none=True)", ("set_to_none",), 500 * MiB, 0.8, False),
            WhatIf("recompute", ("recompute",), None, None, True, note="not needed: the step fits as it is"),
        ],
        left_out={
            "amp": "changes the numerics: opt in with allow='amp' (--allow amp)",
            "8bit": "changes the numerics (quantised optimizer state): opt in with allow='8bit' (--allow 8bit)",
            "offload": "activations offloaded to host memory (save_on_cpu) save nothing when the step runs on the host already",
        },
        batch_size=12,
        model_type="GPT",
        budget="400MiB",
    )


def test_shorten_name_keeps_the_index_and_the_last_part():
    for name in LONG:
        for width in (12, 20, 28, 40):
            short = rc.shorten_name(name, width)
            assert cell_len(short) <= width
            assert short == name or short.startswith("…")
    assert rc.shorten_name("transformer.h.0.attn", 40) == "transformer.h.0.attn"
    short = rc.shorten_name("vit.encoder.layer.11.attention.attention.query", 28)
    assert short.startswith("…11…") and short.endswith("attention.query")
    shorts = {rc.shorten_name(f"bert.encoder.layer.{i}.attention.self.query", 26) for i in range(12)}
    assert len(shorts) == 12  # still tells the layers apart


def test_plan_table_at_80_columns_names_whole_or_shortened_and_op_kinds_in_words():
    text = render(rc.render_plan, make_plan())
    # every module is on one line with its mode: never wrapped
    assert "transformer.h.0.attn" in row_of(text, "transformer.h.0.attn") and "full" in row_of(text, "transformer.h.0.attn")
    for i in (10, 11):
        line = row_of(text, f"…{i}" if f"…{i}" in text else f"bert.encoder.layer.{i}", prefix=True)
        assert "selective" in line and "dense_projection_long" in line
    # what selective recompute keeps, in words; an op with no words stays its aten name
    assert "matrix products" in text and "constants" in text and "masks" in text and "some_new_op" in text
    for aten in ("addmm", "scalar_tensor", "tril", "bmm"):
        assert not re.search(rf"\b{aten}\b", text)


def test_plan_lists_what_was_left_out_grouped_by_reason():
    text = render(rc.render_plan, make_plan(excluded=EXCLUDED))
    flat = " ".join(text.split())
    assert "left out of the plan (6 modules" in flat
    assert "called more than once per step (2): layer1.0.relu (3 calls), layer2.0.relu (3 calls)" in flat
    assert "model.counter (attribute 'calls')" in flat
    assert "model (contains model.counter)" in flat
    assert "h.3 (selective, RuntimeError)" in flat
    assert "a reason this renderer has no words for (1): odd" in flat
    assert "left out" not in render(rc.render_plan, make_plan())


def test_left_out_names_at_most_a_few_per_reason():
    many = {f"model.layers.{i}.rotary": "called 2 times in a step (memfit plans modules called once)" for i in range(30)}
    flat = " ".join(render(rc.render_left_out, many).split())
    assert "called more than once per step (30): model.layers.0.rotary (2 calls)" in flat and "... and 24 more" in flat
    assert "model.layers.29.rotary" not in flat


def test_max_batch_table_at_80_columns_keeps_its_label_column():
    limits = [
        BatchLimit((), 4, 61_400_000, 120_000_000, 4, 380_000_000, 4),
        BatchLimit(("recompute",), 12, 17_900_000, 150_000_000, 12, 390_000_000, 5),
        BatchLimit(("recompute", "8bit"), 20, 9_000_000, 120_000_000, 20, 380_000_000, 4),
    ]
    found = MaxBatch(400 * MiB, 12, 8, limits, make_recipe(), 12.3)
    text = render(rc.render_max_batch, found, title="gpt")
    assert "levers" in text
    for lim in limits:
        line = row_of(text, lim.label)
        cells = line.split()
        assert str(lim.max_batch) in cells and str(lim.measurements) == cells[-1]
        assert memfit.format_bytes(lim.bytes_per_sample) in line and memfit.format_bytes(lim.fixed_bytes) in line


def test_fit_at_80_columns_rows_whole_and_lever_reasons():
    text = render(rc.render_fit, make_recipe(make_plan(excluded=EXCLUDED)), title="gpt")
    flat = " ".join(text.split())
    for label in ("zero_grad(set_to_none=True)", "recompute"):
        assert label in text  # whole, on one line
    # a long label wraps between words, its row's figures on its first line
    lines = text.splitlines()
    chosen = lines.index(row_of(text, "micro-batches x4 +"))
    assert re.search(r"300 MiB\s+0\.823 s\s+\+1%\s+yes\s+300 MiB,", lines[chosen])
    assert "recompute (3 modules)" in lines[chosen + 1] and "0.861 s" in lines[chosen + 1]
    assert "left out amp, 8bit: they change the numerics; --allow amp,8bit weighs them" in flat
    assert "left out offload: activations offloaded" in flat
    assert "left out of recompute (6 modules" in flat


def test_fit_snippet_says_where_its_recipe_is():
    recipe = make_recipe(make_plan())
    unsaved = render(rc.render_fit, recipe, title="gpt")
    assert "this run did not write" in unsaved and "--json recipe.json" in unsaved
    saved = render(rc.render_fit, recipe, title="gpt", path="out/r.json")
    assert 'open("out/r.json")' in saved and "did not write" not in saved
    # a step that fits as it is has no file to read
    fits = make_recipe()
    fits.levers, fits.plan = (), None
    assert "did not write" not in render(rc.render_fit, fits, title="gpt")


def test_bench_table_at_80_columns():
    rows = [
        Row("none", None, "no checkpointing", 624 * MiB, None, 0.85, 0),
        Row("sequential", None, "checkpoint_sequential", 300 * MiB, None, 1.1, 5 * 10**9),
        Row("memfit", 0.25, "memfit 25%", 350 * MiB, 349 * MiB, 0.95, 10**10, 12.3),
        Row("memfit+compile", 0.75, "memfit 75% + compile", 350 * MiB, None, 0.95, None),
        Row("recipe", None, "recipe: layer1+layer2", error="[boom]"),
    ]
    text = render(rc.render_bench, rows, {"target": "gpt", "device": "cpu", "torch": torch.__version__})
    for r in rows[:-1]:
        line = row_of(text, r.label)
        assert memfit.format_bytes(r.measured_peak_bytes) in line and f"{r.step_time_s:.3f}s" in line
    assert "12.3s" in row_of(text, "memfit 25%") and "+12%" in row_of(text, "memfit 25%")
    assert "failed recipe: layer1+layer2: [boom]" in text


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = lambda: nn.ModuleDict({"a_rather_long_projection_name": nn.Sequential(nn.Linear(16, 16), nn.Tanh())})  # noqa: E731
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList([block() for _ in range(12)])})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder["layer"]:
            x = layer["a_rather_long_projection_name"](x)
        return x


def test_profile_table_at_80_columns_tells_modules_apart():
    prof = memfit.profile(_Deep(), torch.randn(4, 16), fake=True)
    text = render(rc.render_profile, prof, top=12)
    table = text.split("module ")[1].split("times omitted")[0].splitlines()[2:]
    names = [line.split()[0] for line in table if line.strip()]
    assert len(names) == 12 and len(set(names)) == 12  # shortened, still apart
    blocks = [re.fullmatch(r"…(\d+)…\w+_projection_name", name) for name in names]
    assert sorted(int(m[1]) for m in blocks if m) == list(range(1, 12))  # block 0 saves less: its input needs no grad


def test_zoo_shows_extras_in_brackets():
    text = render(rc.render_zoo, {"bert-base": "BERT (needs [hf])"}, "gpt")
    assert "(needs [hf])" in text


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_are_rate_limited():
    clock, out = _Clock(), []
    lines = rc.ProgressLines("fitting gpt", clock=clock, write=out.append)
    lines.update("warm-up step", 0, 3)
    assert out == []  # nothing in the first seconds
    for i in range(1000):  # a stage every 0.1 s for 100 s
        clock.t = 0.1 * i
        lines.update(f"timing: lever {i}", i, None)
        lines.update("done", 3, 3)  # an inner step's end is not a stage
    assert 1 <= len(out) <= 100 / rp._GAP_S + 1
    assert all(re.fullmatch(r"memfit: fitting gpt: timing: lever \d+, \d+\.\d s\n", line) for line in out)
    times = [float(line.rsplit(", ", 1)[1].split()[0]) for line in out]
    assert times[0] >= rp._QUIET_S and all(b - a >= rp._GAP_S for a, b in zip(times, times[1:]))
    # one long stage: a heartbeat now and then, not a line per tick
    out.clear()
    lines.update("cheapest plan within the budget", 1, 2)
    for _ in range(1200):
        clock.t += 0.5
        lines.tick()
    assert 1 + 600 / rp._HEARTBEAT_S - 2 <= len(out) <= 1 + 600 / rp._HEARTBEAT_S + 1
    assert all("cheapest plan within the budget (1/2)" in line for line in out)
    lines.finish()
    assert out[-1].startswith("memfit: fitting gpt: finished, ")


def test_progress_lines_quiet_for_a_quick_command():
    clock, out = _Clock(), []
    lines = rc.ProgressLines("profiling x", clock=clock, write=out.append)
    lines.update("warm-up step", 0, 3)
    clock.t = 1.0
    lines.update("recorded step", 2, 3)
    lines.finish()
    assert out == []


@pytest.mark.parametrize("tty", [False, True])
def test_progress_goes_to_stderr_and_lines_only_off_a_terminal(tty, monkeypatch):
    monkeypatch.setattr(rp, "_live", lambda err: tty)
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    with rc.progress_bar(Console(file=out), "planning x") as progress:
        progress("warm-up step", 0, 3)
    assert out.getvalue() == ""


def test_fit_shows_the_prediction_at_the_hosts_speed_when_it_was_timed_again():
    recipe = make_recipe(make_plan())
    plain = " ".join(render(rc.render_fit, recipe, title="gpt").split())
    assert "predicted 0.823 s, measured 0.861 s" in plain and "host's speed" not in plain
    recipe.host_speed = 1.2
    flat = " ".join(render(rc.render_fit, recipe, title="gpt").split())
    assert "predicted 0.823 s (0.988 s at the host's speed then), measured 0.861 s" in flat
