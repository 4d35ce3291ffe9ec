"""Physical ground truth: the peak of one real training step, measured in a fresh process.

CPU: the process's resident-set high-water mark. The child runs with
``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor of 64 KiB or more is its own mapping,
returned to the OS when freed, and RSS follows live tensor bytes. After a warm-up step
(which creates the optimizer state) the high-water mark is reset by writing ``5`` to
``/proc/self/clear_refs``; the step's peak over its start is ``VmHWM - VmRSS(before)``.

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

Times are not taken here: the allocator setting makes every large allocation fault in
fresh pages, which says nothing about training speed.

Run as ``python -m memfit.measure.groundtruth TARGET [--batch-size N] [--size K=V]
[--device cpu|cuda]``; it prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from memfit.errors import MemfitError

__all__ = ["measure_step_peak"]

_MMAP_THRESHOLD = "65536"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise MemfitError(f"/proc/self/status has no {field}: RSS ground truth needs Linux")


def measure_step_peak(
    target: str,
    *,
    batch_size: int | None = None,
    sizes: Mapping[str, Any] | None = None,
    device: str = "cpu",
    plan_path: str | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Measure one step of ``target`` in a fresh subprocess, with the plan saved at
    ``plan_path`` applied if given.

    Returns a dict with ``step_peak_bytes`` (peak over the step's start), ``start_bytes``
    (RSS or allocated bytes before the step) and ``method``.
    """
    cmd = [sys.executable, "-m", "memfit.measure.groundtruth", target, "--device", device]
    if plan_path is not None:
        cmd += ["--plan", str(plan_path)]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    for k, v in (sizes or {}).items():
        cmd += ["--size", f"{k}={v!r}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise MemfitError(f"ground-truth run of {target} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(argv: list[str] | None = None) -> int:
    from memfit.cli import parse_sizes

    parser = argparse.ArgumentParser(prog="python -m memfit.measure.groundtruth")
    parser.add_argument("target")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--size", action="append", default=[])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--plan", help="a plan JSON to apply first")
    ns = parser.parse_args(argv)

    import torch

    from memfit.measure.step import train_step
    from memfit.workload import load_target, split_inputs

    torch.manual_seed(0)
    work = load_target(ns.target, batch_size=ns.batch_size, sizes=parse_sizes(ns.size))
    model = work.model.to(ns.device)
    if ns.plan:
        import memfit

        with open(ns.plan) as f:
            memfit.apply(model, memfit.Plan.from_json(f.read()))
    args, kwargs = split_inputs(work.inputs)
    args, kwargs = torch.utils._pytree.tree_map(lambda x: x.to(ns.device) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    optimizer = work.make_optimizer()
    train_step(model, args, kwargs, work.loss_fn, optimizer)  # warm-up: creates optimizer state
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_step(model, args, kwargs, work.loss_fn, optimizer)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out = {"method": "cuda.max_memory_allocated", "start_bytes": before, "peak_bytes": peak}
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        train_step(model, args, kwargs, work.loss_fn, optimizer)
        peak = _status_kib("VmHWM")
        out = {"method": "rss_hwm", "start_bytes": before, "peak_bytes": peak}
    out["step_peak_bytes"] = out["peak_bytes"] - out["start_bytes"]
    out["target"] = ns.target
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
