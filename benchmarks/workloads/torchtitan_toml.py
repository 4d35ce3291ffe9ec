"""torchtitan of the TOML era (before commit 9810191bb, 2026-02-23) as a memfit workload: the
job that torchtitan's own ``scripts/estimate/estimation.py`` estimates, built from the same TOML
file with the same calls, so that memfit and the script measure one step.

torchtitan 0.3.0 (what ``torchtitan:MODULE:CONFIG`` runs) has neither the TOML files nor the
script; this file takes an older checkout from ``TT_DIR`` (see
benchmarks/torchtitan_estimation.md for how to get it) and must run in a process that has not
imported torchtitan 0.3.0.

    TT_DIR=/tmp/tt [TT_CONFIG=torchtitan/models/llama3/train_configs/llama3_8b.toml] \\
    memfit profile benchmarks/workloads/torchtitan_toml.py:workload --batch-size 2 \\
        --world-size 8 --device fake-cuda --gpu H100-80GB

What is the script's, called the way it calls it: the TOML through torchtitan's
``ConfigManager``, ``model_args.update_from_config``, the model built on meta,
``train_spec.parallelize_fn`` (selective AC, FSDP2 with bf16 parameters and fp32 reduction),
``build_optimizers`` (fused AdamW), ``train_spec.build_loss_fn`` (cross-entropy on the float32
logits, sum), ``pred = model(input_ids); loss = loss_fn(pred, labels); del pred``, then
``clip_grad_norm_(..., max_norm, foreach=True)`` before the optimizer step. Not the script's:
its learning-rate scheduler (no tensors) and its tracker.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import ChainMap
from typing import Any

import torch
from torch import nn

import memfit


def _import_old_torchtitan(folder: str) -> None:
    loaded = sys.modules.get("torchtitan")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(folder):
        raise memfit.TargetError(f"torchtitan is already imported from {loaded.__file__}; run in a fresh process")
    sys.path.insert(0, folder)
    try:
        import triton  # noqa: F401
    except ImportError:
        # a CPU build has no triton; the MoE package imports its triton kernels at import time,
        # which the dense Llama never calls: a stand-in module that refuses if it were
        import types

        stub = types.ModuleType("torchtitan.models.moe.kernels")
        stub.generate_permute_indices = stub.fill_indices_wrapper = _no_triton  # type: ignore[attr-defined]
        sys.modules.setdefault(stub.__name__, stub)


def _no_triton(*args: Any, **kwargs: Any) -> Any:
    raise memfit.TargetError("torchtitan's MoE triton kernels need triton (not on this CPU build)")


class Step(nn.Module):
    """estimation.py's train step up to backward: ``pred = model(input_ids)``,
    ``loss = loss_fn(pred, labels)``, ``del pred``; returns the loss."""

    def __init__(self, model: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.context: Any = contextlib.nullcontext

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.context():
            pred = self.model(input_ids)
            loss = self.loss_fn(pred, labels)
            del pred
        return loss


class _Job:
    def __init__(self, config: Any, spec: Any) -> None:
        self.config, self.spec = config, spec
        self.dims: Any = None
        self.model: nn.Module | None = None

    def __call__(self, step: nn.Module, mesh: Any) -> nn.Module:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torchtitan.distributed import ParallelDims, parallel_dims
        from torchtitan.distributed import utils as dist_utils

        p = self.config.parallelism
        dims = ParallelDims(
            dp_shard=p.data_parallel_shard_degree,
            dp_replicate=p.data_parallel_replicate_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            world_size=mesh.size(),
        )
        # torchtitan builds its meshes on the device type it found at import ("cuda" with no
        # accelerator); memfit's rank runs on the mesh's. The script builds them outside fake mode.
        parallel_dims.device_type = mesh.device_type
        with unset_fake_temporarily():
            _ = dims.world_mesh
        self.spec.parallelize_fn(step.model, dims, self.config)
        step.context = dist_utils.get_train_context(False)
        self.dims, self.model = dims, step.model
        return step

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        assert self.model is not None, "parallelize runs first"
        container = self.spec.build_optimizers_fn([self.model], self.config.optimizer, self.dims)
        inner = [o.state for o in container.optimizers]
        # memfit counts optimizer state from `.state`; the container's optimizers hold it
        container.state = inner[0] if len(inner) == 1 else ChainMap(*inner)
        model, max_norm = self.model, self.config.training.max_norm

        def clip(optimizer: Any, args: Any, kwargs: Any) -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)

        container.register_step_pre_hook(clip)
        return container


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output


def workload(batch_size: int | None = None) -> memfit.Workload:
    """The job of ``TT_CONFIG`` (a TOML path under ``TT_DIR``, default the Llama 3 8B one), its
    local batch ``batch_size`` (default the TOML's), for the world size memfit is given."""
    config = os.environ.get("TT_CONFIG", "torchtitan/models/llama3/train_configs/llama3_8b.toml")
    folder = os.environ.get("TT_DIR")
    if not folder:
        raise memfit.TargetError("set TT_DIR to a torchtitan checkout of the TOML era (see this file's docstring)")
    folder = os.path.abspath(folder)
    _import_old_torchtitan(folder)
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    args = ["--job.config_file", os.path.join(folder, config)]
    if batch_size is not None:
        args += ["--training.local_batch_size", str(batch_size)]
    job_config = ConfigManager().parse_args(args)
    job_config.compile.enable = False  # as the script does
    spec = get_train_spec(job_config.model.name)
    model_args = spec.model_args[job_config.model.flavor]
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    loss_fn = spec.build_loss_fn(job_config)
    b, s = job_config.training.local_batch_size, model_args.max_seq_len
    gen = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(model_args.vocab_size, (b, s), generator=gen),
        torch.randint(model_args.vocab_size, (b, s), generator=gen),
    )
    job = _Job(job_config, spec)
    return memfit.Workload(
        model=Step(model, loss_fn),
        inputs=batch,
        loss_fn=_loss,
        optimizer=job.optimizer,
        name=f"torchtitan (TOML) {job_config.model.name} {job_config.model.flavor}",
        parallel=memfit.Parallel(job, name="torchtitan-toml"),
    )
