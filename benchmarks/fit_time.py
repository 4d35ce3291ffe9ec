"""How long ``memfit fit`` takes, and where the time goes.

    python benchmarks/fit_time.py [--model gpt] [--size KEY=VALUE ...] [--budget 400MiB]
                                  [--allow amp,bf16,foreach,8bit] [--repeat 1] [--json recipe.json]
    python benchmarks/fit_time.py [--model gpt] [--size ...] --compare a.json b.json [--rounds 4]

Runs :func:`memfit.fit` on a zoo model and prints its wall time, the chosen recipe, the
predicted against the measured step time, and a breakdown of the work by phase: how many
real and fake-tensor training steps (``Sandbox.step`` calls) each phase ran and the wall
time spent in it. The phases are fit's stages (probing which levers apply, fake-tensor
profiles, timing steps, recompute planning, measuring the chosen recipe), found by
wrapping the functions fit calls; this works on any version of fit.

``--compare`` times two recipes' steps (``Recipe.to_json`` files, e.g. from this script's
``--json`` run on two versions of memfit) on the same model, alternating rounds of 3 steps
after a warm-up each, and prints each one's median: which choice is faster, measured in the
same conditions.

The nanoGPT-style case in docs/benchmarks/fit.md is nanoGPT's shakespeare-char model:
``--size n_layer=6 n_head=6 n_embd=384 block_size=256 vocab_size=65 dropout=0.2 --batch-size 8``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import memfit
from memfit import zoo
from memfit.levers import fit as fit_mod
from memfit.measure import sandbox as sandbox_mod
from memfit.plan import planner as planner_mod

_stack: list[str] = ["other"]
_steps: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # phase -> [real, fake]
_seconds: dict[str, float] = defaultdict(float)


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    outer = _stack[-1]
    if outer != "other":  # nested: counted in the outer phase
        yield
        return
    _stack.append(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _seconds[name] += time.perf_counter() - t0
        _stack.pop()


def _wrap(module: Any, attr: str, phase: Any) -> None:
    fn = getattr(module, attr, None)
    if fn is None:
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        name = phase(*args, **kwargs) if callable(phase) else phase
        with _phase(name):
            return fn(*args, **kwargs)

    setattr(module, attr, wrapped)


def instrument() -> None:
    original = sandbox_mod.Sandbox.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _steps[_stack[-1]][0 if self.fake_mode is None else 1] += 1
        return original(self, *args, **kwargs)

    sandbox_mod.Sandbox.step = step  # type: ignore[method-assign]
    search = fit_mod._Search
    _wrap(fit_mod, "_micro_batching", "1 which levers apply")
    # this version: probes, then peaks and plans, then the few candidates timed
    _wrap(search, "probe", "2 timing probes (real steps)")
    _wrap(search, "peak", "3 fake-tensor profiles (exact peaks)")
    _wrap(search, "plan", "4 recompute plans")
    _wrap(search, "overhead", "4 recompute plans")
    _wrap(fit_mod, "_time_candidates", "5 timing the candidates (+ recorded peak)")
    # the version before: each lever timed, every combination's step timed, then the chosen measured
    _wrap(search, "time", "2 timing each combination (real steps)")
    _wrap(fit_mod, "_measure", "5 measuring the chosen recipe")
    _wrap(planner_mod, "selective_overhead_s", "4 recompute plans")


def _sizes(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", nargs="*", default=[])
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--budget", default="400MiB")
    parser.add_argument("--allow", default=None)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the (last) recipe here")
    parser.add_argument("--compare", nargs=2, default=None, metavar="RECIPE_JSON")
    parser.add_argument("--rounds", type=int, default=4)
    ns = parser.parse_args()
    work = zoo.build(ns.model, batch_size=ns.batch_size, **_sizes(ns.size))
    if ns.compare:
        compare(work, ns.compare, ns.rounds)
        return
    instrument()
    opt = work.make_optimizer()
    for run in range(ns.repeat):
        _steps.clear()
        _seconds.clear()
        log: list[str] = []
        t0 = time.perf_counter()

        def progress(desc: str, done: int, total: int | None, log: list[str] = log, t0: float = t0) -> None:
            log.append(f"{time.perf_counter() - t0:7.1f} s  [{done}/{total}] {desc}")

        recipe = memfit.fit(
            work.model, work.inputs, ns.budget, loss_fn=work.loss_fn, optimizer=opt, allow=ns.allow, progress=progress
        )
        wall = time.perf_counter() - t0
        size = " ".join(ns.size) or "default size"
        print(f"## {ns.model} ({size}, batch {recipe.batch_size}) --budget {ns.budget} --allow {ns.allow or '-'}: run {run + 1}")
        print(f"wall time {wall:.1f} s; chosen: {recipe.summary()}")
        print(
            f"peak predicted {memfit.format_bytes(recipe.predicted_peak_bytes)}, measured "
            f"{memfit.format_bytes(recipe.measured_peak_bytes or 0)}; step predicted {recipe.predicted_step_time_s:.3f} s, "
            f"measured {recipe.measured_step_time_s:.3f} s ({recipe.measured_step_time_s / recipe.predicted_step_time_s - 1:+.1%}); "
            f"as it is {recipe.base_step_time_s:.3f} s"
        )
        speed = getattr(recipe, "host_speed", None)
        if speed is not None:  # the step as it is timed again: the prediction at the host's speed then
            now = recipe.predicted_step_time_s * speed
            print(
                f"host speed: the step as it is ran {speed - 1:+.1%} against fit's probe; at that speed predicted "
                f"{now:.3f} s, measured {recipe.measured_step_time_s:.3f} s ({recipe.measured_step_time_s / now - 1:+.1%})"
            )
        for note in getattr(recipe, "notes", []) or []:
            print(f"note: {note}")
        if getattr(recipe, "search", None):
            print("search: " + ", ".join(f"{k} {v}" for k, v in recipe.search.items()))
        print("| phase | real steps | fake steps | seconds |")
        print("|---|---:|---:|---:|")
        for name in sorted(set(_steps) | set(_seconds)):
            real, fake = _steps.get(name, [0, 0])
            secs = _seconds.get(name, wall - sum(_seconds.values()))
            print(f"| {name.partition(' ')[2] or name} | {real} | {fake} | {secs:.1f} |")
        total = [sum(v[0] for v in _steps.values()), sum(v[1] for v in _steps.values())]
        print(f"| total | {total[0]} | {total[1]} | {wall:.1f} |")
        print("what-if rows:")
        for w in recipe.what_if:
            t = f"{w.predicted_step_time_s:.3f} s" if w.predicted_step_time_s is not None else "-"
            peak = memfit.format_bytes(w.predicted_peak_bytes) if w.predicted_peak_bytes is not None else "-"
            print(f"  {w.label}: {peak}, {t}, fits={w.fits}{' (chosen)' if w.chosen else ''} {w.note}")
        print("progress:")
        for line in log:
            print("  " + line)
        print(flush=True)
        if ns.json:
            with open(ns.json, "w") as f:
                f.write(recipe.to_json())


def compare(work: Any, paths: list[str], rounds: int) -> None:
    runs = []
    for path in paths:
        with open(path) as f:
            recipe = memfit.Recipe.from_json(f.read())
        model = copy.deepcopy(work.model)
        run = memfit.apply_recipe(recipe, model)  # a new AdamW over the copy, as the zoo trains
        runs.append((path, recipe, run, []))
    for _ in range(rounds):
        for _path, _recipe, run, times in runs:
            run.step(work.inputs, work.loss_fn)  # warm-up
            for _ in range(3):
                t0 = time.perf_counter()
                run.step(work.inputs, work.loss_fn)
                times.append(time.perf_counter() - t0)
    for path, recipe, _run, times in runs:
        print(
            f"{path}: {recipe.summary()}: median {statistics.median(times):.3f} s over {len(times)} steps "
            f"(fit measured {recipe.measured_step_time_s:.3f} s, predicted {recipe.predicted_step_time_s:.3f} s)"
        )


if __name__ == "__main__":
    main()
