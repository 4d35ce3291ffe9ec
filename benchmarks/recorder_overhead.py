"""What memfit's recorder costs per op it records, and what it records, as a hash.

    python benchmarks/recorder_overhead.py [--cases gpt,llama,resnet,gpt-fake,gpt-fake-cuda,llama-fsdp2-8] [--profiles 3]
                                           [--json FILE]

Each case runs in a fresh process (one torch thread, so that CPU seconds are the work and
not idle threads spinning; the workspace table starts empty, as in a new ``memfit`` command)
and calls ``memfit.profile`` ``--profiles`` times on one zoo workload. Per profile it reads:

- the CPU seconds of the recorded step: from the recorder's ``__enter__`` to its ``ledger()``
  returned (the step's own kernels included: on fake tensors they are FakeTensorMode's);
- the ops recorded: calls of ``Recorder.__torch_dispatch__`` (a fake tensor's metadata
  queries, prim.device, count too; a DTensor op counts twice: handed on to DTensor, then for
  its local shard);
- a hash of the profile's JSON with its ledger, every measured time left out (the step and
  module times of a real profile): what must not move when the recorder gets cheaper.

It prints one row per case: ops, the first profile's recorded CPU s (the workspace table is
empty: each op kind's kernel is measured under torch's profiler) and the best of the others
(the kinds known), both per op; the fastest step the later profiles ran without the recorder
(their warm-up or timed steps) and from it the recorder's own CPU per op (recorded minus
unrecorded); and the hashes (one when every profile's is the same).
The cases: zoo ``gpt`` (nanoGPT-style) and ``llama`` (transformers, 8 x 512) and ``resnet``
on the CPU; ``gpt`` on fake CPU tensors and on fake CUDA (``MEMFIT_FAKE_CUDA=1``, an H100); zoo llama at 4 x 256
per rank under FSDP2 on 8 ranks of the fake process group (fake CPU tensors).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import memfit  # before torch: with MEMFIT_FAKE_CUDA=1 it loads the fake-CUDA shim first

CASES: dict[str, dict[str, Any]] = {
    "gpt": {"model": "gpt", "sizes": {}, "fake": False},
    "llama": {"model": "llama", "sizes": {"parallel": "none"}, "fake": False},
    "resnet": {"model": "resnet", "sizes": {}, "fake": False},
    "gpt-fake": {"model": "gpt", "sizes": {}, "fake": True},
    "gpt-fake-cuda": {"model": "gpt", "sizes": {}, "fake": "cuda"},
    "llama-fsdp2-8": {
        "model": "llama",
        "sizes": {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "seq_len": 128},
        "fake": True,
        "world_size": 8,
    },
}


def _without_times(value: Any) -> Any:
    """The profile's dict with every measured time dropped (they differ from run to run)."""
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if not (k.endswith("_time_s") or k.endswith("_times_s"))}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class _Meter:
    """Wraps the recorder's entry, ledger and dispatch, and the sandbox's step, to count ops
    and CPU seconds: of the recorded step, and of the fastest step run without the recorder."""

    def __init__(self) -> None:
        from memfit.measure.recorder import Recorder
        from memfit.measure.sandbox import Sandbox

        self.ops = 0
        self.cpu = 0.0
        self.plain: float | None = None
        self._start = 0.0
        self._recording = False
        enter, ledger, dispatch, step = Recorder.__enter__, Recorder.ledger, Recorder.__torch_dispatch__, Sandbox.step
        meter = self

        def entering(rec):
            meter._start = time.process_time()
            meter._recording = True
            return enter(rec)

        def ledgered(rec):
            out = ledger(rec)
            meter.cpu += time.process_time() - meter._start
            meter._recording = False
            return out

        def stepping(box, *args, **kwargs):
            start = time.process_time()
            out = step(box, *args, **kwargs)
            if not meter._recording:
                cpu = time.process_time() - start
                meter.plain = cpu if meter.plain is None else min(meter.plain, cpu)
            return out

        def dispatching(rec, func, types, args=(), kwargs=None):
            meter.ops += 1
            return dispatch(rec, func, types, args, kwargs)

        Recorder.__enter__, Recorder.ledger, Recorder.__torch_dispatch__ = entering, ledgered, dispatching
        Sandbox.step = stepping

    def take(self) -> tuple[int, float, float | None]:
        out = (self.ops, self.cpu, self.plain)
        self.ops, self.cpu, self.plain = 0, 0.0, None
        return out


def run_case(name: str, profiles: int) -> dict[str, Any]:
    """One case in this process: what the parent prints."""
    import torch

    from memfit import zoo

    torch.set_num_threads(1)
    case = CASES[name]
    meter = _Meter()
    work = zoo.build(case["model"], **case["sizes"])
    rows = []
    for _ in range(profiles):
        start = time.process_time()
        if "world_size" in case:
            prof = memfit.profile(work, world_size=case["world_size"], fake=case["fake"])
        else:
            prof = memfit.profile(
                work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), targets=work.targets,
                fake=case["fake"],
            )
        total = time.process_time() - start
        ops, cpu, plain = meter.take()
        if "world_size" in case:
            plain = None  # a rank's unrecorded step is its first (FSDP2's lazy set-up): not comparable
        data = _without_times(prof.to_dict(ledger=True))
        ledgers = [r["ledger"] for r in data["ranks"]] if "ranks" in data else [data["ledger"]]
        rows.append({"ops": ops, "cpu": cpu, "plain_cpu": plain, "profile_cpu": total, "hash": _digest(data), "ledger": _digest(ledgers)})
    return {"case": name, "profiles": rows}


def _child(name: str, profiles: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if CASES[name]["fake"] == "cuda":
        env["MEMFIT_FAKE_CUDA"] = "1"
    done = subprocess.run(
        [sys.executable, __file__, "--child", name, "--profiles", str(profiles)],
        env=env, capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(result: dict[str, Any]) -> str:
    runs = result["profiles"]
    first, rest = runs[0], runs[1:] or runs[:1]
    best = min(rest, key=lambda r: r["cpu"])
    plain = min((r["plain_cpu"] for r in rest if r["plain_cpu"] is not None), default=None)
    over = "-" if plain is None else f"{(best['cpu'] - plain) / best['ops'] * 1e3:.3f}"
    hashes = sorted({r["hash"] for r in runs})
    ledgers = sorted({r["ledger"] for r in runs})
    return (
        f"| {result['case']} | {first['ops']:,} | {first['cpu']:.2f} | {first['cpu'] / first['ops'] * 1e3:.3f} "
        f"| {best['cpu']:.2f} | {best['cpu'] / best['ops'] * 1e3:.3f} | {'-' if plain is None else f'{plain:.2f}'} | {over} "
        f"| {first['profile_cpu']:.1f} | {' '.join(hashes)} | {' '.join(ledgers)} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--profiles", type=int, default=3)
    ap.add_argument("--json", default=None, help="write every profile's figures and hashes here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(run_case(ns.child, ns.profiles)))
        return
    names = [c for c in ns.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    results = [_child(name, ns.profiles) for name in names]
    print(f"load {os.getloadavg()[0]:.2f} (1 min), {ns.profiles} profiles a case, one torch thread")
    print()
    print(
        "| case | ops recorded | first: recorded CPU s | ms/op | later: recorded CPU s | ms/op "
        "| later: step without recorder, CPU s | recorder's own ms/op | first profile CPU s | profile hash | ledger hash |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for result in results:
        print(_row(result))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
