"""Run torchtitan's own scripts/estimate/estimation.py (torchtitan 238fa99, the last commit that has
it) on a CPU build of torch 2.13, unchanged, from a checkout in TT_DIR:

    TT_DIR=DIR WORLD_SIZE=8 LOCAL_RANK=0 PYTHONPATH=src:TABULATE_DIR \
        python benchmarks/torchtitan_estimation_shim.py \
        --job.config_file ./torchtitan/models/llama3/train_configs/llama3_8b.toml \
        --memory_estimation.enable --training.local_batch_size 2

(the arguments are the script's; WORLD_SIZE and LOCAL_RANK as its run_memory_estimation.sh
exports them; its tables need `tabulate`). See benchmarks/torchtitan_estimation.md.

Shims (all in this file, nothing edited in torchtitan or torch):
1. memfit's fake CUDA (MEMFIT_FAKE_CUDA=1, `import memfit` before torch): a "cuda" device on a CPU
   build, so `torch.cuda.set_device`, `model.to_empty(device="cuda")` and CUDA fake tensors work.
2. torch.cuda.memory_stats(): the CPU build has no caching allocator, so it returns {} and the
   script's last lines raise KeyError. Under FakeTensorMode no tensor reaches the allocator on a
   real GPU either, so the script's "peak active / peak reserved" would be the CUDA context's
   handful of bytes there; here they are reported as 0 (with num_alloc_retries 0).
3. triton: the CPU build has none, and torchtitan.models.moe imports its expert-parallel triton
   kernels at import time. That one module is a stand-in whose functions refuse to run (the dense
   Llama never calls them).

Two read-outs, which change nothing the script computes: each "peak" table it prints is followed
by the same snapshot in bytes; and ESTIMATION_PEAK_FROM_ITER1=1 restarts the tracker's global peak
where the script resets its per-module stats (after iteration 0), so that "Tracker Max" is
iteration 1's peak (without it, it is the higher of the two iterations').
"""

import os
import runpy
import sys
import time
import types

os.environ.setdefault("MEMFIT_FAKE_CUDA", "1")
import memfit  # noqa: E402, F401  (before torch: loads the fake CUDA shim)

# isort: split
import torch  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402

from memfit.cuda import fake  # noqa: E402

_ZERO = {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0}
_display = FSDPMemTracker.display_snapshot
_reset = FSDPMemTracker.reset_mod_stats


def _display_bytes(self, type="current", units="B", tabulate=False):
    # the tables round to 0.01 MiB: the same snapshot in bytes
    _display(self, type, units=units, tabulate=tabulate)
    if type == "peak":
        for dev, snap in self.get_tracker_snapshot("peak").items():
            print(f"[shim] peak snapshot in bytes, {dev}: { {getattr(k, 'value', k): v for k, v in snap.items()} }", flush=True)


def _reset_with_peak(self):
    # the script's `reset_mod_stats()` after iteration 0 ("iter 0 does not have optimizer state")
    # resets only the per-module stats, not the global peak "Tracker Max" reads
    _reset(self)
    self._peak_mem_snap = self.get_tracker_snapshot()
    self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}


def _refuse(*args, **kwargs):
    raise RuntimeError("torchtitan's MoE triton kernels need triton (not on this CPU build)")


def main() -> None:
    assert fake.active(), "fake CUDA did not load: import memfit before torch with MEMFIT_FAKE_CUDA=1"
    tt = os.environ.get("TT_DIR")
    if not tt:
        raise SystemExit("set TT_DIR to a torchtitan checkout that has scripts/estimate/estimation.py")
    torch.cuda.memory_stats = lambda device=None: dict(_ZERO)
    FSDPMemTracker.display_snapshot = _display_bytes
    if os.environ.get("ESTIMATION_PEAK_FROM_ITER1") == "1":
        FSDPMemTracker.reset_mod_stats = _reset_with_peak
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = kernels.fill_indices_wrapper = _refuse
    sys.modules[kernels.__name__] = kernels
    sys.path.insert(0, tt)
    os.chdir(tt)
    sys.argv = ["scripts/estimate/estimation.py"] + sys.argv[1:]
    t0 = time.process_time()
    try:
        runpy.run_module("scripts.estimate.estimation", run_name="__main__", alter_sys=True)
    finally:
        print(f"[shim] process CPU {time.process_time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
