"""torch_remat and memory: two checks against the RSS rise of a fresh process (CPU).

1. A selective plan (every block keeps its ``addmm`` outputs) of
   ``benchmarks/workloads/remat_user.py:plain``, under each mechanism: the step peak in
   memfit's ledger, against the step run in a fresh process with the plan applied by
   ``memfit.apply`` (``MEMFIT_RECOMPUTE`` picks the mechanism there; its measured step, the
   second, is the first through torch_remat).
2. ``remat_user.py:workload``, a model that uses torch_remat itself: memfit's profile against
   the fresh process, and who made and who keeps the saved projection outputs.

    python benchmarks/remat_memory.py [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import memfit
from memfit.bench.child import measure_step_peak
from memfit.recompute.checkpoint import apply_choices, remove
from memfit.recompute.remat import ENV

USER = str(Path(__file__).resolve().parent / "workloads" / "remat_user.py")
MiB = 2**20


def _profile(work: memfit.Workload) -> memfit.Profile:
    return memfit.profile(work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer())


def plan_rows(batch: int) -> list[str]:
    """The plan's step under each mechanism: memfit's ledger, and a fresh process's RSS rise
    (the child applies the plan with memfit.apply; MEMFIT_RECOMPUTE picks the mechanism)."""
    choices = {f"blocks.{i}": ("selective", ("addmm",)) for i in range(4)}
    plan = {
        "format": "memfit.plan", "version": 2, "budget_bytes": 0, "predicted_peak_bytes": 0, "start_bytes": 0,
        "none_peak_bytes": 0, "min_peak_bytes": 0, "extra_compute_s": None, "extra_flops": 0, "step_time_s": None,
        "checkpointed": {k: {"mode": m, "save_ops": list(ops)} for k, (m, ops) in choices.items()},
    }  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(json.dumps(plan))
        for mech, label in (("sac", "the selective-checkpoint policy"), ("remat", "torch_remat")):
            work = memfit.load_target(f"{USER}:plain", batch_size=batch)
            apply_choices(work.model, choices, mechanism=mech)
            ledger = _profile(work).step_peak_bytes
            remove(work.model)
            os.environ[ENV] = mech
            try:
                measured = measure_step_peak(f"{USER}:plain", batch_size=batch, plan_path=str(path))["step_peak_bytes"]
            finally:
                del os.environ[ENV]
            rows.append(
                f"| selective plan (addmm kept) through {label} | {ledger / MiB:.2f} MiB | {measured / MiB:.2f} MiB | "
                f"{(ledger - measured) / measured:+.2%} |"
            )
    return rows


def user_row(batch: int) -> str:
    work = memfit.load_target(f"{USER}:workload", batch_size=batch)
    prof = _profile(work)
    measured = measure_step_peak(f"{USER}:workload", batch_size=batch)["step_peak_bytes"]
    kept = sorted(
        (b.module, b.savers)
        for b in prof.ledger.blocks
        if b.category is memfit.Category.ACTIVATION and b.module and b.module.endswith(".fc1")
    )
    print("kept projection outputs (made by, kept by):", kept)
    return (
        f"| the model's own torch_remat checkpoints | {prof.step_peak_bytes / MiB:.2f} MiB | {measured / MiB:.2f} MiB | "
        f"{(prof.step_peak_bytes - measured) / measured:+.2%} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args()
    print("| step | memfit's step peak | RSS rise, fresh process | error |")
    print("| --- | --- | --- | --- |")
    for row in plan_rows(a.batch_size):
        print(row, flush=True)
    print(user_row(a.batch_size), flush=True)


if __name__ == "__main__":
    main()
