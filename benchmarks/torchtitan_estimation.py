"""memfit beside torchtitan's own estimation script (issue 26, item 2): memfit's figures for the job
the script estimates, from the same TOML, on the same torchtitan checkout.

    TT_DIR=DIR [TT_CONFIG=torchtitan/models/llama3/train_configs/llama3_8b.toml] \\
        python benchmarks/torchtitan_estimation.py WORLD_SIZE [LOCAL_BATCH]

Prints rank 0's allocated and reserved peaks (default allocator settings and
``expandable_segments:True``, the same ledger replayed), the breakdown at the peak, the phase
peaks, and the CPU seconds. How to get DIR and run the script itself beside it:
benchmarks/torchtitan_estimation.md.
"""

import os
import sys
import time

os.environ.setdefault("MEMFIT_FAKE_CUDA", "1")
import memfit  # noqa: E402, F401  (before torch: loads the fake CUDA shim)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads"))
from torchtitan_toml import workload  # noqa: E402

from memfit.cuda.allocator import AllocatorSettings  # noqa: E402
from memfit.measure.distributed import profile_ranks  # noqa: E402


def main(argv: list[str]) -> None:
    if not argv or len(argv) > 2:
        raise SystemExit("usage: TT_DIR=DIR python benchmarks/torchtitan_estimation.py WORLD_SIZE [LOCAL_BATCH]")
    world = int(argv[0])
    batch = int(argv[1]) if len(argv) > 1 else None
    t0 = time.process_time()
    w = workload(batch_size=batch)
    p = profile_ranks(w, world_size=world, ranks=(0,), fake="cuda", gpu="H100-80GB").profiles[0]
    exp = p.under(AllocatorSettings.parse("expandable_segments:True"))
    gib = 2**30
    print(f"{w.name}, rank 0 of {world}, local batch {w.inputs[0].shape[0]}, seq {w.inputs[0].shape[1]}")
    for label, q in (("default settings", p), ("expandable_segments:True", exp)):
        a, r = q.cuda_memory.allocated_peak_bytes, q.cuda_memory.reserved_peak_bytes
        print(f"  {label}: allocated {a:,} B ({a / gib:.2f} GiB), reserved {r:,} B ({r / gib:.2f} GiB)")
    print(f"  ledger peak {p.peak_bytes:,} B at {p.peak}")
    print("  breakdown at the peak (B):", {k: v for k, v in p.breakdown.items() if v})
    print("  phase peaks (B):", {ph.value: n for ph, n in p.ledger.phase_peaks().items()})
    print(f"  CPU {time.process_time() - t0:.1f} s (this process)")


if __name__ == "__main__":
    main(sys.argv[1:])
