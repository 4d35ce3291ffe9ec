"""memfit's compiled step on fake CUDA against a GPU's measured peaks at several
``activation_memory_budget`` values (issue 27 item 4).

    MEMFIT_FAKE_CUDA=1 python benchmarks/compile_published.py [--backends eager,aot_eager,inductor]
        [--budgets 0,0.05,0.1,0.15,0.2,0.25,0.3,0.35,1] [--out FILE.md]

The measurements are siddddd17/ackaudit's (commit 29d506f and the ones before it), made with its
``experiments/measured_backward/run_d.py`` on an NVIDIA GeForce GTX 1650 (compute capability 7.5)
with torch 2.14.0+cu130: the llama of ``ackaudit/hf_models.py`` at scale 8
(``benchmarks/workloads/ackaudit_llama.py`` builds the same model), compiled with
``torch.compile(model, backend=..., dynamic=False)`` at each budget, one warm-up step, the
gradients zeroed in place, then ``torch.cuda.max_memory_allocated()`` over
``compiled(ids).backward()`` (five repetitions, all equal). The figures below are the JSON files'
``measured_peaks`` (bytes, the resident 221,613,056 B of parameters, gradients, token ids and
cuBLAS workspaces included):

- ``results/measured_backward/fine/llama_scale8.json`` (aot_eager, 0.05 to 0.35),
- ``results/measured_backward/endpoints/llama_scale8.json`` (aot_eager, 0 and 1),
- ``results/measured_backward/endpoints/llama_scale8_eager.json`` (no compile),
- ``results/measured_backward/inductor/llama_scale8_inductor.json`` (inductor, 0.05 to 0.3).

memfit's side: ``memfit.measure.compiled.profile_compiled`` on fake CUDA as a T4 (the GTX 1650's
compute capability, which picks the attention kernel and the cuBLAS workspace size), the step with
gradients kept (``StepOptions(set_to_none=False)``) and SGD with lr 0 (allocates nothing): its
``allocated_peak_bytes``. The eager row is ``memfit.profile`` of the same step, the allocated peak of
its measured step in the loop replay (``memfit.measure.replay.ledger_series``): the script resets the
peak after its warm-up step, and the profile's ``allocated_peak_bytes`` includes the first step. The inductor rows are
inductor's CUDA (Triton) code where Triton is importable (``memfit.compat.triton_fake``), else its
host C++ code; the heading says which.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# isort: off
import memfit  # noqa: F401  (first: with MEMFIT_FAKE_CUDA=1 it loads fake CUDA before anything imports torch)
from _table import emit  # benchmarks/_table.py, beside this script

# isort: on

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
import ackaudit_llama  # noqa: E402

MEASURED = {  # (backend, budget) -> max_memory_allocated on the GTX 1650, bytes
    ("eager", None): 1_642_860_544,
    ("aot_eager", 0.0): 1_652_962_816,
    ("aot_eager", 0.05): 1_367_012_864,
    ("aot_eager", 0.1): 729_847_296,
    ("aot_eager", 0.15): 496_384_000,
    ("aot_eager", 0.2): 546_846_720,
    ("aot_eager", 0.25): 581_056_512,
    ("aot_eager", 0.3): 632_698_880,
    ("aot_eager", 0.35): 678_180_864,
    ("aot_eager", 1.0): 1_335_940_096,
    ("inductor", 0.05): 1_125_715_968,
    ("inductor", 0.1): 805_578_752,
    ("inductor", 0.15): 605_235_200,
    ("inductor", 0.2): 636_676_096,
    ("inductor", 0.3): 695_347_200,
}
RESIDENT = 221_613_056


def predicted(backend: str, budget: float | None) -> tuple[int, float]:
    """memfit's allocated peak for one row, and the CPU seconds it took."""
    from memfit.measure.compiled import profile_compiled

    work = ackaudit_llama.workload()
    step = memfit.StepOptions(set_to_none=False)
    t0 = time.process_time()
    if backend == "eager":
        from memfit.measure.replay import ledger_series

        prof = memfit.profile(
            work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake="cuda", step=step
        )
        # The script resets the peak after its warm-up step (reset_peak_memory_stats before each
        # measured step); memfit's allocated_peak_bytes is the whole loop's, its first step
        # included, whose gradients the replay places otherwise. The measured step's own peak is
        # the loop's last step over its ticks (the start included).
        series = ledger_series(prof.ledger, prof.cuda_memory.settings)
        got = max(series.start_allocated_bytes, *series.allocated)
    else:
        comp = profile_compiled(
            work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake="cuda", step=step,
            backend=backend, memory_budget=budget,
        )  # fmt: skip
        got = comp.allocated_peak_bytes
    return int(got), time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="eager,aot_eager,inductor")
    ap.add_argument("--budgets", default=None, help="comma-separated; default every measured one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from memfit.cuda import fake as fake_cuda
    from memfit.cuda import gpu as gpus

    fake_cuda.set_gpu(gpus.find_gpu("T4"))
    wanted = None if args.budgets is None else {float(b) for b in args.budgets.split(",")}
    rows = [
        "| backend | activation_memory_budget | GPU measured (B) | memfit allocated (B) | error | over the resident: GPU / memfit (MB) | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (backend, budget), gpu in MEASURED.items():
        if backend not in args.backends.split(",") or (budget is not None and wanted is not None and budget not in wanted):
            continue
        got, cpu = predicted(backend, budget)
        shown = "-" if budget is None else f"{budget:g}"
        rows.append(
            f"| {backend} | {shown} | {gpu:,} | {got:,} | {100 * (got - gpu) / gpu:+.2f}% | "
            f"{(gpu - RESIDENT) / 1e6:.1f} / {(got - RESIDENT) / 1e6:.1f} | {cpu:.1f} |"
        )
        print(rows[-1], flush=True)
    from memfit.compat import triton_fake

    why = triton_fake.unavailable()
    code = "inductor's Triton code" if why is None else f"inductor's host C++ code ({why})"
    emit(rows, f"fake-cuda (T4: compute capability 7.5, as the GTX 1650), {code}", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
