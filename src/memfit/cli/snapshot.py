"""``memfit snapshot``: a GPU memory snapshot read (nothing run): peaks, largest allocations, and
what other allocator settings would reserve."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

import memfit
from memfit.cli.common import write_pictures
from memfit.cli.options import json_arg
from memfit.errors import MemfitError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "snapshot", help="a GPU memory snapshot (torch.cuda.memory._dump_snapshot): peaks, largest allocations, other settings"
    )
    p.add_argument("path", metavar="PATH.pickle", help="a snapshot pickle, read without running code from it")
    json_arg(p, "also write allocated_peak_bytes, reserved_peak_bytes and the rest as JSON", metavar="OUT")
    p.add_argument(
        "--expandable-segments", action="store_true", help="compare with expandable_segments:True (the default comparison)"
    )
    p.add_argument("--max-split-size-mb", type=int, metavar="N", help="compare with max_split_size_mb:N (with the above: both)")
    p.add_argument(
        "--capacity", metavar="BYTES", help="the GPU's memory ('80GB'): the comparison releases cached segments and retries there"
    )
    p.add_argument("--device-index", type=int, metavar="N", help="which GPU's trace (default: the one with the most events)")
    p.add_argument("--top", type=int, default=10, help="largest allocations to list (default 10)")
    # the trace's events on the x axis, not a step's ticks (options.picture_args)
    p.add_argument(
        "--plot", metavar="PATH.png", help="write a PNG of allocated and reserved over the trace's events, segments below"
    )
    p.add_argument(
        "--html",
        metavar="PATH.html",
        help="write the same as one self-contained page (hover: a block's frames; the peak's blocks)",
    )
    p.set_defaults(func=run)


def run(ns: argparse.Namespace, console: Console) -> int:
    from memfit.cuda.allocator import MiB
    from memfit.cuda.snapshot import summarize
    from memfit.report.console import render_snapshot

    if ns.max_split_size_mb is not None and ns.max_split_size_mb < 20:
        raise MemfitError(f"--max-split-size-mb must be >= 20 (torch refuses smaller), got {ns.max_split_size_mb}")
    if ns.top < 0:
        raise MemfitError(f"--top takes a count >= 0, got {ns.top}")
    # Over the trace's recorded settings (its rounding, the other option): only what is asked changes.
    changes = {"expandable_segments": True} if ns.expandable_segments else {}
    if ns.max_split_size_mb is not None:
        changes["max_split_size"] = ns.max_split_size_mb * MiB
    what_if = [changes] if changes else None
    capacity = memfit.parse_bytes(ns.capacity) if ns.capacity is not None else None
    if ns.device_index is not None and ns.device_index < 0:
        raise MemfitError(f"--device-index takes a GPU index >= 0, got {ns.device_index}")
    summary = summarize(ns.path, what_if=what_if, top=ns.top, capacity=capacity, device=ns.device_index)
    render_snapshot(summary, console, top=ns.top)
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary.to_dict(), indent=1))
        console.print(f"wrote {ns.json}")
    if ns.plot or ns.html:
        from memfit.cuda.snapshot import load_snapshot, trace_timeline
        from memfit.report.timeline import snapshot_timeline

        tt = trace_timeline(load_snapshot(ns.path), summary.recorded.device)
        write_pictures(ns, console, snapshot_timeline(tt, f"memfit snapshot {Path(ns.path).name}", ns.path))
    return 0
