"""Per-rank peak of a distributed step: without recompute, every decoder layer recomputed, and
memfit's plan at a budget; beside what Megatron's, DeepSpeed's and accelerate's formulas say.

    python benchmarks/distributed_plan.py WORLD_SIZE BUDGET [KEY=VALUE ...]   # zoo llama sizes, e.g. preset=8b

Every peak is rank 0's on the fake process group and fake tensors (memfit's ledger). The formulas
are computed here from the model's dimensions, as their sources write them (cited in docs/benchmarks/distributed.md):
none of them runs the step.
"""

from __future__ import annotations

import json
import resource
import sys
import time

from memfit import zoo
from memfit.measure.distributed import FakeGroup, profile_rank
from memfit.plan.distributed import plan_ranks
from memfit.recompute.checkpoint import apply_choices
from memfit.zoo import parse_sizes


def _every_layer(work):  # type: ignore[no-untyped-def]
    import copy
    import dataclasses

    model = copy.deepcopy(work.model)
    apply_choices(model, {f"model.layers.{i}": ("full", ()) for i in range(len(model.model.layers))})
    return dataclasses.replace(work, model=model)


def formulas(cfg, world: int, seq: int, batch: int, total_params: int, largest_layer_params: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Bytes per rank each estimator gives for this configuration."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    # DeepSpeed, deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs, no offload:
    # 4 bytes x the largest layer's parameters + 18 bytes x parameters / GPUs (model states only)
    deepspeed = 4 * largest_layer_params + int(18 * total_params / world)
    # accelerate estimate-memory: training with Adam ~ 4x the model's size (float32: 16 bytes a
    # parameter), for the whole model (it does not divide by ranks)
    accelerate = 4 * 4 * total_params
    # Megatron-LM megatron/training/theoretical_memory_usage.py (tp = pp = 1, no sequence
    # parallelism: compute_activation_memory_without_sp), distributed optimizer over data-parallel
    # ranks: 6 + 12 / dp bytes a parameter, parameters whole on every rank
    weights = total_params * (6 + 12 / world)
    per_layer = seq * batch * h * (10 + 24)
    act = per_layer * layers + 8 * seq * batch + seq * batch * h + (seq * batch * vocab + seq * batch * h) * 2
    act *= 1.05
    return {
        "deepspeed_zero3_model_states": deepspeed,
        "accelerate_4x_model": accelerate,
        "megatron_weights_optimizer": weights,
        "megatron_activations": act,
        "megatron_total": weights + act,
        "megatron_total_no_distributed_optimizer": total_params * 18 + act,
    }


def main() -> int:
    world, budget = int(sys.argv[1]), sys.argv[2]
    sizes = parse_sizes(sys.argv[3:])
    work = zoo.build("llama", **sizes)
    model = work.model
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    out: dict = {"world_size": world, "budget": budget, "total_params": total, "largest_layer_params": largest}
    start = time.perf_counter()
    out["none_peak_bytes"] = profile_rank(work, FakeGroup(world, 0)).peak_bytes
    out["profile_s"] = time.perf_counter() - start
    out["every_layer_peak_bytes"] = profile_rank(_every_layer(work), FakeGroup(world, 0)).peak_bytes
    start, cpu = time.perf_counter(), time.process_time()
    plan = plan_ranks(work, budget, world_size=world)
    out["plan_s"], out["plan_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    out["plan"] = {
        "peak_bytes": plan.predicted_peak_bytes,
        "min_peak_bytes": plan.min_peak_bytes,
        "budget_bytes": plan.budget_bytes,
        "modules": len(plan.checkpointed),
        "checkpointed": {k: [c.mode, list(c.save_ops)] for k, c in plan.checkpointed.items()},
        "excluded": len(plan.excluded),
    }
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = model.config
    out["formulas"] = formulas(cfg, world, work.meta["seq_len"], work.meta["batch_size"], total, largest)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
