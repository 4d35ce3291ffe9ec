"""``memfit bench``: memfit's plans against the baselines, each measured in fresh processes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit import zoo
from memfit.cli.common import require_device
from memfit.cli.options import device_arg, json_arg, target_args
from memfit.errors import MemfitError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="memfit's plans against the baselines, each measured in fresh processes")
    target_args(p)
    p.add_argument(
        "--budgets", default="0.25,0.5,0.75", help="budget fractions for memfit and torch.compile (default 0.25,0.5,0.75)"
    )
    device_arg(p, None, choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median; default 5)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument(
        "--scenario", help="a named worked example: resnet152-layer1-layer2 (TARGET resnet152) or bert-per-layer (bert-base)"
    )
    json_arg(p, "write the rows as JSON")
    # the chart of the rows, not a step's timeline (options.picture_args)
    p.add_argument("--plot", metavar="PATH.png", help="write the memory-vs-throughput chart")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.bench.runner import run_bench
    from memfit.report.chart import bench_html, pareto_png
    from memfit.report.console import progress_bar, render_bench

    try:
        budgets = [float(b) for b in ns.budgets.split(",") if b.strip()]
    except ValueError:
        raise MemfitError(f"--budgets takes fractions separated by commas (e.g. 0.25,0.5,0.75), got {ns.budgets!r}") from None
    for b in budgets:
        memfit.parse_budget(b)
    require_device(ns.device)
    if ns.scenario:
        from memfit.bench.methods import SCENARIOS

        if ns.scenario not in SCENARIOS:
            raise MemfitError(f"unknown scenario {ns.scenario!r}; choose one of {', '.join(SCENARIOS)}")
        expected = SCENARIOS[ns.scenario][0]
        if ns.target != expected:
            raise MemfitError(f"scenario {ns.scenario!r} runs on zoo model {expected!r}, not {ns.target!r}")
    with progress_bar(console, f"bench {ns.target}") as progress:
        rows, context = run_bench(
            ns.target,
            budgets,
            batch_size=ns.batch_size,
            sizes=zoo.parse_sizes(ns.size),
            device=ns.device,
            steps=ns.steps,
            compile=not ns.no_compile,
            scenario=ns.scenario,
            progress=progress,
        )
    render_bench(rows, context, console)
    if ns.json:
        Path(ns.json).write_text(json.dumps({**context, "rows": [r.to_dict() for r in rows]}, indent=1))
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        png = pareto_png(rows, context)
        if ns.plot:
            Path(ns.plot).write_bytes(png)
            console.print(f"wrote {ns.plot}")
        if ns.html:
            Path(ns.html).write_text(bench_html(rows, context, png))
            console.print(f"wrote {ns.html}")
    return 0
