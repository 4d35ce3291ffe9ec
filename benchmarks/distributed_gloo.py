"""Per-rank memory of FSDP2 and DDP steps: memfit's fake-process-group prediction against
real multi-process gloo runs on this CPU.

Each real rank runs in its own process (torch.multiprocessing spawn, gloo backend) and is
measured with memfit's recorder on real tensors (the same step: warm-up, then a recorded
step), and its RSS rise over the recorded step is taken as a second, recorder-free check.
The prediction is memfit's profile of that rank on the fake process group, fake tensors,
one process. Usage:

    python benchmarks/distributed_gloo.py [--world-sizes 2,4] [--parallel fsdp2,ddp] [--model llama|resnet] [--batch-size N] [--json PATH]

``--model resnet``: zoo ``resnet`` (a bottleneck CNN with BatchNorm), FSDP2 ``fully_shard`` per
bottleneck and root in fp32, or DDP (``--batch-size``: images per rank). At batch 4 under FSDP2
its peak falls inside a reduce-scatter. gloo's own copy of the input is then alive at the peak.
RSS sees that copy and the convolutions' kernel workspaces; the tensor prediction leaves both out
(issue 26 item 4; docs/benchmarks/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo import gloo_ranks  # noqa: E402  benchmarks/_gloo.py, beside this script

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


# zoo resnet's defaults: batch 16, 64 px, base 32, (2, 2, 2, 2) bottlenecks, 100 classes.
RESNET_SIZES: dict = {}


def _bottlenecks(model):
    return [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage]


def workload(parallel: str, sizes: dict | None = None):
    """zoo ``llama`` at ``sizes`` (default :data:`SIZES`), or with ``sizes={"model": "resnet", ...}``
    zoo ``resnet`` (default :data:`RESNET_SIZES`) under ``parallel`` (fsdp2: fp32, per bottleneck; ddp)."""
    import dataclasses

    import memfit
    from memfit import zoo
    from memfit.measure.distributed import ddp, fsdp2

    sizes = dict(SIZES if sizes is None else sizes)
    if sizes.pop("model", "llama") != "resnet":
        return zoo.build("llama", parallel=parallel, **sizes)
    work = zoo.build("resnet", **{**RESNET_SIZES, **sizes})
    schemes = {"fsdp2": fsdp2(_bottlenecks, param_dtype=None, reduce_dtype=None), "ddp": ddp}
    return dataclasses.replace(work, parallel=memfit.Parallel(schemes[parallel], name=parallel))


def _rank(rank: int, world_size: int, parallel: str, sizes: dict | None) -> dict:
    from memfit.measure.distributed import CURRENT_GROUP, profile_rank

    return profile_rank(workload(parallel, sizes), CURRENT_GROUP).to_dict()


def _rank_rss(rank: int, world_size: int, parallel: str, sizes: dict | None) -> dict:
    """The RSS protocol of memfit.bench.child on one real rank, without the recorder: after two
    warm-up steps, heap trimmed and the high-water mark reset, the step's RSS rise."""
    import gc

    import torch.distributed as dist

    from memfit.bench.child import _status_bytes, _trim_heap
    from memfit.measure.distributed import _mesh, _parallel_sandbox

    work = workload(parallel, sizes)
    box = _parallel_sandbox(work, work.parallel, _mesh(work.parallel, world_size), None)
    for _ in range(2):
        box.step(work.loss_fn)
    gc.collect()
    dist.barrier()
    _trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    box.step(work.loss_fn)
    return {"rss_rise_bytes": _status_bytes("VmHWM") - before}


def real_rss(world_size: int, parallel: str, sizes: dict | None = None) -> list[int]:
    """Every rank's RSS rise over its step in a real gloo run (every tensor of 64 KiB or more its
    own mapping, as the bench's children measure)."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each child starts
    return [r["rss_rise_bytes"] for r in gloo_ranks(_rank_rss, world_size, parallel, sizes)]


def real_ranks(world_size: int, parallel: str, sizes: dict | None = None) -> list[dict]:
    """Every rank's profile from a real gloo run of ``world_size`` processes."""
    return gloo_ranks(_rank, world_size, parallel, sizes)


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
    ap.add_argument("--model", default="llama", choices=("llama", "resnet"))
    ap.add_argument("--batch-size", type=int, help="resnet: images per rank (default 16)")
    ap.add_argument("--json")
    ns = ap.parse_args()
    sizes = None if ns.model == "llama" else {"model": ns.model}
    if ns.batch_size is not None and sizes is not None:
        sizes["batch_size"] = ns.batch_size
    rows = []
    for parallel in ns.parallel.split(","):
        for n in map(int, ns.world_sizes.split(",")):
            t = time.perf_counter()
            fake = fake_ranks(n, parallel, sizes)
            t_fake = time.perf_counter() - t
            real = real_ranks(n, parallel, sizes)
            rss = real_rss(n, parallel, sizes)
            Ledger, without_backend_buffers = _ledger_tools()
            for r in range(n):
                pred, meas = fake["ranks"][r], real[r]
                raw = Ledger.from_dict(meas["ledger"])
                tensors = without_backend_buffers(raw)
                err = (pred["peak_bytes"] - tensors.peak_bytes) / tensors.peak_bytes
                recorded_rise = raw.peak_bytes - raw.start_bytes  # gloo's copies included: RSS sees them
                rows.append(
                    dict(
                        model=ns.model,
                        batch_size=ns.batch_size,
                        parallel=parallel,
                        world_size=n,
                        rank=r,
                        predicted_peak_bytes=pred["peak_bytes"],
                        measured_peak_bytes=tensors.peak_bytes,
                        measured_with_gloo_copies_bytes=raw.peak_bytes,
                        error=err,
                        predicted_step_rise_bytes=pred["step_peak_bytes"],
                        recorded_rise_with_gloo_copies_bytes=recorded_rise,
                        rss_rise_bytes=rss[r],
                        fake_seconds=t_fake,
                        breakdown_predicted=pred["breakdown"],
                        breakdown_measured=meas["breakdown"],
                    )
                )
                print(
                    f"{parallel:6s} world {n} rank {r}: predicted {pred['peak_bytes']:,} B, measured (recorder, real gloo) "
                    f"{tensors.peak_bytes:,} B (with gloo's own copies {raw.peak_bytes:,} B), error {err:+.3%}; "
                    f"fake profile of all ranks {t_fake:.1f} s; step rise: predicted {pred['step_peak_bytes']:,} B, "
                    f"recorded with gloo's copies {recorded_rise:,} B, RSS {rss[r]:,} B",
                    flush=True,
                )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(abs(r["error"]) <= 0.03 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
