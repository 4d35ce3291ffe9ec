"""`memfit demo` on a machine too busy to time: no contradictory step times, one plain
sentence in their place (the times themselves are not asserted)."""

from __future__ import annotations

import dataclasses

import torch
from conftest import TinyNet, make_plan
from rich.console import Console

import memfit
from memfit.cli.demo import DemoTiming
from memfit.report.console import render_before_after, render_plan, render_profile


def _console() -> Console:
    return Console(record=True, width=100, force_terminal=False)


def test_the_host_too_busy_is_said_once_in_place_of_the_times():
    console = _console()
    timing = DemoTiming(console)
    assert timing.judge([15.40, 15.9])  # steady so far: times shown
    timing.say()
    assert console.export_text() == ""
    assert not timing.judge([53.0])  # the same step, 3.4x slower later: the host's load
    for _ in range(3):
        timing.say()
    text = " ".join(console.export_text().split())
    assert text.count("step times not shown") == 1 and "15.400 s to 53.000 s" in text
    assert not timing.judge([15.4])  # and stays so: no time shown after
    rows = [("no plan", 100, 101, 15.4), ("plan at 50%", 80, 81, 53.0)]
    render_before_after(rows, console, times=False)
    table = console.export_text()
    assert "step time" not in table and "+244" not in table and "53.0" not in table


def test_profile_and_plan_without_times():
    torch.manual_seed(0)
    prof = memfit.profile(TinyNet(), torch.randn(32, 64))
    console = _console()
    render_profile(prof, console, times=False)
    text = console.export_text()
    assert "step time" not in text and " ms" not in text and "times omitted" not in text
    plan = dataclasses.replace(make_plan(), extra_compute_s=0.001, step_time_s=0.1, timing_note="step times too noisy")
    render_plan(plan, console, times=False)
    text = console.export_text()
    assert "ms per step" not in text and "too noisy" not in text and "time not shown" in text
