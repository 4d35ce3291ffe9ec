"""Predicted vs measured peak of a torch.compile'd training step (issue 27, item 4).

    python benchmarks/compile_accuracy.py [--models 'gpt:n_layer=2;llama:num_hidden_layers=2'] [--budget 1.0] [--out FILE.md]
    python benchmarks/compile_accuracy.py --models 'gpt:n_layer=2' --sweep 1,0.5,0      # one row per activation_memory_budget
    MEMFIT_FAKE_CUDA=1 python benchmarks/compile_accuracy.py --device fake-cuda         # allocated / reserved (no GPU to compare)

For each model (a zoo name, then ``:K=V,K=V`` sizes): memfit's eager profile on real tensors,
memfit's compiled-step figure (:func:`memfit.measure.compiled.profile_compiled`, inductor, in
this process), and the same compiled step measured in a fresh process (memfit's bench child,
method ``compile:BUDGET``: ``torch.compile(model)`` with ``activation_memory_budget=BUDGET``;
RSS high-water mark with ``MALLOC_MMAP_THRESHOLD_=65536``). The compared figure is the step's
peak over its start. With ``--device fake-cuda`` (start Python with ``MEMFIT_FAKE_CUDA=1``): the
compiled step's allocated and reserved peaks through the caching allocator model, beside the
eager fake-CUDA profile's (no GPU here: nothing measured to compare with).
"""

# ruff: noqa: I001 (memfit is imported before _table, which imports torch: fake CUDA must load first)
from __future__ import annotations

import argparse
import time

import memfit  # first: with MEMFIT_FAKE_CUDA=1, fake CUDA must load before torch (which _table imports)

from _table import emit  # benchmarks/_table.py, beside this script
from memfit.bench.child import run_child
from memfit.measure.checked import checked_step
from memfit.measure.compiled import profile_compiled_step
from memfit.zoo import parse_sizes

MiB = 2**20
MODELS = (
    "mlp-deep:depth=8,batch_size=64",
    "gpt:n_layer=2",
    "resnet:depths=(1,1,1,1)",
    "llama:num_hidden_layers=2",
    "bert-base:num_hidden_layers=2",
)


def _parse(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    items, depth, cur = [], 0, ""
    for ch in rest:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        items.append(cur)
    return name, parse_sizes(items)


def _row(spec: str, budget: float, fake: str | bool) -> str:
    name, sizes = _parse(spec)
    batch = sizes.pop("batch_size", None)
    work = memfit.load_target(name, batch_size=batch, sizes=sizes)
    opt = work.make_optimizer
    eager = memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt(), targets=work.targets, fake=fake)
    step = checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=opt(), targets=work.targets, fake=fake)
    t0 = time.process_time()
    pred = profile_compiled_step(step, memory_budget=budget)
    took = time.process_time() - t0
    if fake:
        cm = eager.cuda_memory
        return (
            f"| {spec} | {cm.allocated_peak_bytes / MiB:.1f} / {cm.reserved_peak_bytes / MiB:.1f} MiB "
            f"| {pred.allocated_peak_bytes / MiB:.1f} / {pred.reserved_peak_bytes / MiB:.1f} MiB "
            f"| {pred.saved_bytes / MiB:.1f} MiB | {pred.graphs} / {pred.graph_breaks} | {took:.0f} s |"
        )
    gt = run_child(name, method=f"compile:{budget}", batch_size=batch, sizes=sizes)
    if "error" in gt:
        return f"| {spec} | {eager.step_peak_bytes / MiB:.1f} MiB | failed: {gt['error']} | | | | |"
    measured = gt["step_peak_bytes"]
    err = (pred.step_peak_bytes - measured) / measured
    return (
        f"| {spec} | {eager.step_peak_bytes / MiB:.1f} MiB | {measured / MiB:.1f} MiB | {pred.step_peak_bytes / MiB:.1f} MiB "
        f"| {err:+.2%} | {pred.saved_bytes / MiB:.1f} MiB | {pred.graphs} / {pred.graph_breaks} | {took:.0f} s |"
    )


def _sweep(ns: argparse.Namespace) -> None:
    rows = [
        "| model | activation_memory_budget | saved for backward | compiled: measured RSS rise | compiled: memfit | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for spec in ns.models.split(";"):
        name, sizes = _parse(spec)
        batch = sizes.pop("batch_size", None)
        work = memfit.load_target(name, batch_size=batch, sizes=sizes)
        step = checked_step(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), targets=work.targets)
        for value in (float(v) for v in ns.sweep.split(",")):
            pred = profile_compiled_step(step, memory_budget=value)
            gt = run_child(name, method=f"compile:{value}", batch_size=batch, sizes=sizes)
            measured = gt.get("step_peak_bytes")
            err = f"{(pred.step_peak_bytes - measured) / measured:+.2%}" if measured else gt.get("error", "")
            row = (
                f"| {spec} | {value:g} | {pred.saved_bytes / MiB:.1f} MiB | {(measured or 0) / MiB:.1f} MiB "
                f"| {pred.step_peak_bytes / MiB:.1f} MiB | {err} |"
            )
            print(row, flush=True)
            rows.append(row)
    emit(rows, "cpu", ns.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=";".join(MODELS), help="zoo specs NAME[:K=V,...] separated by ';'")
    parser.add_argument("--budget", type=float, default=1.0, help="activation_memory_budget (default 1.0, torch's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "fake-cuda"])
    parser.add_argument("--sweep", help="activation_memory_budget values F,F,...: one row per value for each model")
    parser.add_argument("--out")
    ns = parser.parse_args()
    if ns.sweep:
        return _sweep(ns)
    fake: str | bool = "cuda" if ns.device == "fake-cuda" else False
    if fake:
        head = "| model | eager allocated / reserved | compiled allocated / reserved | saved for backward | graphs / breaks | memfit CPU s |"
        rows = [head, "|---|---:|---:|---:|---:|---:|"]
    else:
        head = (
            "| model | eager step peak (memfit) | compiled: measured RSS rise | compiled: memfit | error "
            "| saved for backward | graphs / breaks | memfit CPU s (incl. compile) |"
        )
        rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for spec in ns.models.split(";"):
        row = _row(spec, ns.budget, fake)
        print(row, flush=True)
        rows.append(row)
    emit(rows, ns.device, ns.out)


if __name__ == "__main__":
    main()
