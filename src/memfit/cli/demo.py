"""``memfit demo``: end to end on the default model, on the CPU: profiled, measured in a fresh
process, planned at 50%, the plan measured, and a batch too big to try profiled on fake tensors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit import zoo
from memfit.cli.common import profile_work
from memfit.cli.options import json_arg


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="end to end on the default model, on the CPU")
    json_arg(p, "also write the numbers as JSON")
    p.set_defaults(func=run)


class DemoTiming:
    """The demo's step times, shown while the host is steady enough to time them. Once two
    timings of the same step disagree by more than :data:`~memfit.measure.timing.NOISY_STEPS`
    (a loaded machine: 15.4 s in one section, 53.0 s in the next), no time is shown from
    there on, and why is said once, plainly, where the first would have been."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.seen: list[float] = []
        self.noisy = False
        self.said = False

    def judge(self, seconds: Any, note: str = "") -> bool:
        """Take more timings of the unplanned step (and the planner's own verdict, ``note``):
        True while times may be shown."""
        from memfit.measure.timing import too_noisy

        self.seen += [s for s in seconds if s]
        self.noisy = self.noisy or bool(note) or too_noisy(self.seen)
        return not self.noisy

    def say(self) -> None:
        from memfit.report.console import render_untimed

        if self.noisy and not self.said and self.seen:
            render_untimed(self.console, self.seen)
            self.said = True


def run(ns: argparse.Namespace, console: Console) -> int:
    import tempfile

    from memfit.bench.child import measure_step_peak
    from memfit.report.console import (
        progress_bar,
        render_before_after,
        render_groundtruth,
        render_plan,
        render_profile,
        status,
    )

    timing = DemoTiming(console)
    console.rule(f"[bold]1. Where the memory of a training step goes: zoo '{zoo.DEFAULT}' on cpu")
    work = zoo.build(zoo.DEFAULT)
    optimizer = work.make_optimizer()
    with progress_bar(console, f"profiling {work.name}") as progress:
        prof = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=optimizer, progress=progress)
    shown = timing.judge(prof.step_times_s)
    render_profile(prof, console, title=f"{work.name} (batch {work.meta['batch_size']})", times=shown)
    timing.say()
    with status(console, "measuring the same step in a fresh process (RSS high-water mark)"):
        measured = measure_step_peak(zoo.DEFAULT)
    render_groundtruth(prof, measured, console)

    console.rule("[bold]2. Fit it in 50% of the way from the lowest reachable peak to no plan")
    with progress_bar(console, "planning") as progress:
        plan = memfit.plan(
            work.model, work.inputs, "50%", loss_fn=work.loss_fn, optimizer=optimizer, profile=prof, progress=progress
        )
    render_plan(plan, console, top=8, times=timing.judge((), plan.timing_note))
    timing.say()

    console.rule("[bold]3. Applied to the model, measured")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(plan.to_json())
        with status(console, "measuring the planned step in a fresh process"):
            planned = measure_step_peak(zoo.DEFAULT, plan_path=str(path))
    before_s, after_s, shown = _step_times(work, optimizer, plan, console, timing)
    render_before_after(
        [
            ("no plan", prof.peak_bytes, prof.start_bytes + measured["step_peak_bytes"], before_s),
            (
                f"plan at 50% ({memfit.format_bytes(plan.budget_bytes)})",
                plan.predicted_peak_bytes,
                plan.start_bytes + planned["step_peak_bytes"],
                after_s,
            ),
        ],
        console,
        times=shown,
    )
    timing.say()
    console.print("measured peak = tensors alive at the start + the step's RSS rise over it (fresh process)")
    _big_batch(work, console)
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {
                    "profile": prof.to_dict(ledger=False),
                    "measured": measured,
                    "plan": plan.to_dict(),
                    "planned_measured": planned,
                    "step_time_s": {"no_plan": before_s, "plan": after_s},
                    "timing_too_noisy": timing.noisy,
                }
            )
        )
    return 0


def _step_times(
    work: memfit.Workload, optimizer: Any, plan: memfit.Plan, console: Console, timing: DemoTiming
) -> tuple[float, float, bool]:
    """Steps timed without and with the plan: their medians, and whether times may be shown
    (the unplanned steps agree with each other and with the profile's, the planned ones too:
    else a "+x%" would be the host's load, not the plan's cost)."""
    import statistics

    from memfit.measure.timing import time_steps, too_noisy
    from memfit.report.console import status

    with status(console, "timing steps without and with the plan"):
        before = time_steps(work.model, work.inputs, work.loss_fn, optimizer, steps=3).seconds
        memfit.apply(work.model, plan)
        try:
            after = time_steps(work.model, work.inputs, work.loss_fn, optimizer, steps=3).seconds
        finally:
            memfit.remove(work.model)
    shown = timing.judge(before)
    if too_noisy(after):
        timing.noisy, shown = True, False
    return statistics.median(before), statistics.median(after), shown


def _big_batch(work: memfit.Workload, console: Console) -> None:
    """The demo's last section: a batch too big to try, profiled on fake tensors."""
    big = 8 * work.meta["batch_size"]
    console.rule(f"[bold]4. A step too big to try: batch {big} on fake tensors (no memory used)")
    big_work = zoo.build(zoo.DEFAULT, batch_size=big)
    big_prof = profile_work(big_work, "fake", console)
    console.print(
        f"batch {big}: step peak [bold]{memfit.format_bytes(big_prof.peak_bytes)}[/] "
        f"({memfit.format_bytes(big_prof.step_peak_bytes)} above the start), peak during {big_prof.peak['phase']}; "
        f"activations at the peak {memfit.format_bytes(big_prof.breakdown['activations'])}"
    )
