"""Per-rank memory of FSDP2 and DDP steps: memfit's fake-process-group prediction against
real multi-process gloo runs on this CPU.

Each real rank runs in its own process (torch.multiprocessing spawn, gloo backend) and is
measured with memfit's recorder on real tensors (the same step: warm-up, then a recorded
step), and its RSS rise over the recorded step is taken as a second, recorder-free check.
The prediction is memfit's profile of that rank on the fake process group, fake tensors,
one process. Usage:

    python benchmarks/distributed_gloo.py [--world-sizes 2,4] [--parallel fsdp2,ddp] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

# A zoo-like Llama small enough for 4 real ranks on 2 cores, big enough that tensors dominate.
SIZES = dict(
    num_hidden_layers=4,
    hidden_size=512,
    intermediate_size=1376,
    num_attention_heads=8,
    vocab_size=8192,
    seq_len=256,
    batch_size=2,
)


def workload(parallel: str, sizes: dict | None = None):
    from memfit import zoo

    return zoo.build("llama", parallel=parallel, **(SIZES if sizes is None else sizes))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, parallel: str, sizes: dict | None, port: int, out: str) -> None:
    import torch.distributed as dist

    from memfit.measure.distributed import CURRENT_GROUP, profile_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        prof = profile_rank(workload(parallel, sizes), CURRENT_GROUP)
        with open(f"{out}.{rank}", "w") as f:
            f.write(prof.to_json())
    finally:
        dist.destroy_process_group()


def real_ranks(world_size: int, parallel: str, sizes: dict | None = None) -> list[dict]:
    """Every rank's profile from a real gloo run of ``world_size`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_rank, args=(world_size, parallel, sizes, _free_port(), out), nprocs=world_size, join=True)
        ranks = []
        for r in range(world_size):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
        return ranks


def _ledger_tools():
    from memfit.measure.distributed import without_backend_buffers
    from memfit.measure.ledger import Ledger

    return Ledger, without_backend_buffers


def fake_ranks(world_size: int, parallel: str, sizes: dict | None = None) -> dict:
    from memfit.measure.distributed import profile_ranks

    return profile_ranks(workload(parallel, sizes), world_size=world_size, ranks=range(world_size)).to_dict()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--parallel", default="fsdp2,ddp")
    ap.add_argument("--json")
    ns = ap.parse_args()
    rows = []
    for parallel in ns.parallel.split(","):
        for n in map(int, ns.world_sizes.split(",")):
            t = time.perf_counter()
            fake = fake_ranks(n, parallel)
            t_fake = time.perf_counter() - t
            real = real_ranks(n, parallel)
            Ledger, without_backend_buffers = _ledger_tools()
            for r in range(n):
                pred, meas = fake["ranks"][r], real[r]
                raw = Ledger.from_dict(meas["ledger"])
                tensors = without_backend_buffers(raw)
                err = (pred["peak_bytes"] - tensors.peak_bytes) / tensors.peak_bytes
                rows.append(
                    dict(
                        parallel=parallel,
                        world_size=n,
                        rank=r,
                        predicted_peak_bytes=pred["peak_bytes"],
                        measured_peak_bytes=tensors.peak_bytes,
                        measured_with_gloo_copies_bytes=raw.peak_bytes,
                        error=err,
                        fake_seconds=t_fake,
                        breakdown_predicted=pred["breakdown"],
                        breakdown_measured=meas["breakdown"],
                    )
                )
                print(
                    f"{parallel:6s} world {n} rank {r}: predicted {pred['peak_bytes']:,} B, measured (recorder, real gloo) "
                    f"{tensors.peak_bytes:,} B (with gloo's own copies {raw.peak_bytes:,} B), error {err:+.3%}; "
                    f"fake profile of all ranks {t_fake:.1f} s",
                    flush=True,
                )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(abs(r["error"]) <= 0.03 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
