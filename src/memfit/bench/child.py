"""Measure one configuration of a training step in a fresh process: the bench's child.

    python -m memfit.bench.child TARGET --method M --measure memory|time|flops|time+flops
        [--batch-size N] [--size K=V] [--device cpu|cuda] [--steps 5]

It prints one JSON object, on its own stdout: the workload's own output (a ``print`` in the
user's model or setup, a C library's) goes to stderr, so the JSON is the only thing there. Methods are those of :mod:`memfit.bench.methods`, and
``fit:PATH``: the :class:`~memfit.Recipe` saved at PATH (``memfit fit --json``) applied to
the model and optimizer, each step run as the recipe says (micro-batches, autocast, the
8-bit optimizer, ...).

memory: on CPU the process's resident-set high-water mark, with
``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor of 64 KiB or more is its own mapping,
returned to the OS when freed, and RSS follows live tensor bytes. glibc reads the variable
when the process starts, so a child started without it (``python -m memfit.bench.child``
by hand) runs itself again with it (without it, freed tensors stay in the heap and the peak
read 7-24% high).
After a warm-up step (which creates the optimizer state) freed heap pages are returned to
the OS (glibc ``malloc_trim``) and the high-water mark is reset by writing ``5`` to
``/proc/self/clear_refs``; the step's peak over its start is
``VmHWM - VmRSS(before)``. On CUDA, ``max_memory_allocated`` after
``reset_peak_memory_stats``.

time: the median of ``--steps`` steps after two warm-up steps, without the allocator
setting (it makes every large allocation fault in fresh pages); synchronised on CUDA.

flops: FlopCounterMode over one step after warm-up; recompute shows up as extra FLOPs.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from memfit.errors import MemfitError

__all__ = ["run_child", "measure_step_peak"]

_MMAP_THRESHOLD = "65536"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise MemfitError(f"/proc/self/status has no {field}: RSS ground truth needs Linux")


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to return, RSS is what it is
        pass


def run_child(
    target: str,
    *,
    method: str = "none",
    measure: str = "memory",
    batch_size: int | None = None,
    sizes: Mapping[str, Any] | None = None,
    device: str = "cpu",
    steps: int = 5,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Run the child for one (method, measure); its JSON, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "memfit.bench.child", target, "--method", method, "--measure", measure]
    cmd += ["--device", device, "--steps", str(steps)]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    for k, v in (sizes or {}).items():
        cmd += ["--size", f"{k}={v!r}"]
    env = dict(os.environ)
    if measure == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.stdout.strip():  # the child's stdout holds its JSON alone (the workload's output goes to stderr)
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError:
            pass
    tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
    return {"error": tail[0]}


def measure_step_peak(
    target: str,
    *,
    batch_size: int | None = None,
    sizes: Mapping[str, Any] | None = None,
    device: str = "cpu",
    plan_path: str | None = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    """The physical peak of one step of ``target`` (with the plan at ``plan_path`` applied,
    if given), measured in a fresh process: ``step_peak_bytes`` (over the step's start),
    ``start_bytes`` and ``method``."""
    out = run_child(
        target,
        method=f"plan:{plan_path}" if plan_path else "none",
        batch_size=batch_size,
        sizes=sizes,
        device=device,
        timeout=timeout,
    )
    if "error" in out:
        raise MemfitError(f"ground-truth run of {target} failed: {out['error']}")
    return out


def _with_mmap_threshold(ns: argparse.Namespace) -> None:
    """Run this command again, in this process, with ``MALLOC_MMAP_THRESHOLD_`` set when a
    CPU memory measurement was started without it: glibc's allocator reads it once, at the
    process's start, so setting it now would change nothing."""
    if ns.measure != "memory" or ns.device != "cpu" or os.environ.get("MALLOC_MMAP_THRESHOLD_") == _MMAP_THRESHOLD:
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "memfit.bench.child", *sys.argv[1:]], env)


def _json_out() -> Any:
    """The process's stdout kept for the JSON alone: file descriptor 1 (Python's ``print``
    and C code's ``printf`` alike) is pointed at stderr for the rest of the run, and the
    returned file writes to the stdout it had."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    return out


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfit.bench.child")
    parser.add_argument("target")
    parser.add_argument("--method", default="none")
    parser.add_argument("--measure", default="memory", choices=["memory", "time", "flops", "time+flops"])
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--size", action="append", default=[])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5)
    ns = parser.parse_args(argv)
    if argv is None:  # the process's own command line: it can be run again
        _with_mmap_threshold(ns)
    json_out = _json_out()
    try:
        out = _measure(ns)
    except Exception as exc:  # a configuration that fails is a result, reported as such
        first = (str(exc).strip().splitlines() or [""])[0]
        out = {"error": f"{type(exc).__name__}: {first}"[:500]}
    out.update(target=ns.target, method=ns.method, measure=ns.measure)
    if ns.measure == "memory" and ns.device == "cpu":
        out["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")  # what this measurement ran with
    sys.stdout.flush()
    json_out.write(json.dumps(out) + "\n")
    json_out.flush()
    return 0


def _measure(ns: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    from memfit.bench.methods import setup
    from memfit.measure.step import train_step
    from memfit.target import load_target
    from memfit.workload import split_inputs
    from memfit.zoo import parse_sizes

    torch.manual_seed(0)
    work = load_target(ns.target, batch_size=ns.batch_size, sizes=parse_sizes(ns.size))
    inputs, targets = tree_map(lambda x: x.to(ns.device) if isinstance(x, torch.Tensor) else x, (work.inputs, work.targets))
    args, kwargs = split_inputs(inputs)
    if ns.method.startswith("fit:"):
        from memfit.apply.recipe import apply_recipe
        from memfit.levers.recipe import Recipe

        with open(ns.method.split(":", 1)[1]) as f:
            run = apply_recipe(Recipe.from_json(f.read()), work.model.to(ns.device), work.make_optimizer())

        def step() -> None:
            run.step(inputs, work.loss_fn, targets)
    else:
        model = setup(ns.method, work.model.to(ns.device))
        optimizer = work.make_optimizer()

        def step() -> None:
            train_step(model, args, kwargs, work.loss_fn, optimizer, targets=targets)

    def sync() -> None:
        if ns.device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: creates the optimizer state (and compiles, for torch.compile)
    gc.collect()
    out: dict[str, Any] = {}
    if ns.measure in ("time", "time+flops"):
        step()
        times = []
        for _ in range(ns.steps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        out.update(step_time_s=statistics.median(times), step_times_s=times)
    if ns.measure in ("flops", "time+flops"):
        # After the timed steps, never before them: the counting mode must not slow what is timed.
        # One process for both saves a start-up of torch per configuration.
        from memfit.compat.torch_compat import CORRECTED_FLOPS

        with FlopCounterMode(display=False, custom_mapping=CORRECTED_FLOPS) as counter:
            step()
        out["step_flops"] = int(counter.get_total_flops())
    if out:
        return out
    if ns.device == "cuda":
        sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        out = {"method_used": "cuda.max_memory_allocated", "start_bytes": before, "peak_bytes": torch.cuda.max_memory_allocated()}
    else:
        # Freed heap pages go back to the OS first (glibc malloc_trim): else the step's small
        # allocations (autograd's graph, tensors under the mmap threshold) reuse pages the
        # warm-up left resident and the RSS rise misses them.
        _trim_heap()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_bytes("VmRSS")
        step()
        out = {"method_used": "rss_hwm", "start_bytes": before, "peak_bytes": _status_bytes("VmHWM")}
    out["step_peak_bytes"] = out["peak_bytes"] - out["start_bytes"]
    return out


if __name__ == "__main__":
    sys.exit(_main())
