"""torchtitan's own job as a memfit target: ``torchtitan:MODULE:CONFIG``.

``torchtitan:llama3:llama3_debugmodel`` names the config function ``llama3_debugmodel`` of
``torchtitan.models.llama3.config_registry``, loaded by torchtitan's own ``ConfigManager``
(as ``--module llama3 --config llama3_debugmodel`` on its command line). ``--size
training.seq_len=512`` sets one of the config's fields, as torchtitan's
``--training.seq_len 512`` would; ``--batch-size`` sets ``training.local_batch_size``.

What is torchtitan's own, called rather than rewritten:

- the model: ``model_spec.model.update_from_config(config)`` then ``build()`` on meta, under
  ``training.dtype`` as the Trainer does;
- its parallelisms: ``model_spec.parallelize_fn`` (tensor parallel, activation
  checkpointing, FSDP2 with its mixed precision) over ``ParallelDims.from_config``'s meshes,
  built on memfit's fake process group;
- its loss (``config.loss.build``; ``ChunkedLossWrapper`` runs lm_head and the loss chunk by
  chunk, with a backward per chunk), the model's prediction dropped before backward (the
  Trainer's ``del pred``);
- its optimizer (``config.optimizer.build``) with ``clip_grad_norm_(..., max_norm,
  foreach=True)`` before each step, as ``Trainer.train_step``.

What is not torchtitan's:

- the data: tokens and labels of the configured shape (local batch x seq len), no loader;
- FlexAttention: torchtitan compiles it (inductor, triton), which fake tensors cannot run.
  memfit runs torch's causal scaled-dot-product attention in its place: on CUDA the flash
  or memory-efficient kernel, which saves what flex saves (output and logsumexp). Without a
  data loader there are no document positions, so the mask is plain causal.

Pipeline parallelism (``parallelism.pipeline_parallel_degree > 1``) is torchtitan's too: its
``model_spec.pipelining_fn`` (``pipeline_llm``: the split, each part parallelized, torch's stages and
the schedule) as ``Trainer.__init__`` calls it, and ``pp_forward_backward_step``'s schedule step over
the microbatches the data loader would hand over (:class:`TitanPipelineRank`). Its stages are given
their shapes, worked out on meta (:func:`_stage_metas`), in place of the first step's exchange.

Refused in one line (not modelled): CUDA graphs (torchtitan's default; add
``--size training.disable_cuda_graphs=True`` to measure the eager step), ``torch.compile``,
context and expert parallelism, gradient accumulation, float8/MX converters; under pipeline
parallelism the zero-bubble and V schedules, CSV schedules, and tensor parallelism beside it.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import TargetError
from memfit.measure.pipeline import on_fake_group, phased, schedule_step, stage_buffers, static_stage
from memfit.measure.step import OwnPasses
from memfit.workload import Parallel, Workload

__all__ = ["PREFIX", "build", "is_torchtitan", "peak_names"]

PREFIX = "torchtitan:"

# torchtitan's DeviceMemoryMonitor names: what its metrics log calls a rank's peaks.
PEAK_NAMES = {"allocated": "memory/max_active(GiB)", "reserved": "memory/max_reserved(GiB)"}


def is_torchtitan(target: str) -> bool:
    return isinstance(target, str) and target.startswith(PREFIX)


def peak_names() -> dict[str, str]:
    """How torchtitan's memory monitor names the peaks memfit reports (its metrics' keys)."""
    return dict(PEAK_NAMES)


KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


@contextlib.contextmanager
def _triton_for_import() -> Iterator[None]:
    """torchtitan's model package imports its expert-parallel triton kernels at import time,
    even for dense models that never run them; a CPU build of torch has no triton. Without
    triton, that one module of torchtitan's is a stand-in whose kernels refuse to run
    (memfit models no expert parallelism). torch never sees a stand-in triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        if KERNELS not in sys.modules:
            stub = types.ModuleType(KERNELS)
            stub.__getattr__ = _no_kernel  # type: ignore[method-assign]
            sys.modules[KERNELS] = stub
    yield


def _no_kernel(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise TargetError(f"torchtitan's triton kernel {name} needs triton; expert parallelism is not modelled")

    return kernel


def _import_torchtitan() -> None:
    try:
        with _triton_for_import():
            import torchtitan.trainer  # noqa: F401
            from torchtitan.config import ConfigManager  # noqa: F401
    except ImportError as exc:
        import importlib.util

        # installed but failing to import: most often a torch older than the one it was built
        # against (torchtitan 0.3.0 imports torch.distributed.fsdp names torch 2.11 lacks)
        if importlib.util.find_spec("torchtitan") is not None:
            raise TargetError(
                f"torchtitan is installed but does not import beside torch {torch.__version__} "
                f"({type(exc).__name__}: {exc}): install the torch its release needs, or an older torchtitan"
            ) from exc
        raise TargetError(
            f"torchtitan targets need torchtitan: pip install 'memfit[torchtitan]' ({type(exc).__name__}: {exc})"
        ) from exc


def _load_config(spec: str) -> Any:
    parts = spec[len(PREFIX) :].split(":")
    if len(parts) != 2 or not all(p.isidentifier() for p in parts):
        raise TargetError(f"target {spec!r}: expected torchtitan:MODULE:CONFIG, e.g. torchtitan:llama3:llama3_debugmodel")
    module, name = parts
    from torchtitan.config import ConfigManager

    with _triton_for_import(), _quiet():
        try:
            return ConfigManager().parse_args(["--module", module, "--config", name])
        except (ValueError, ImportError, AttributeError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise TargetError(f"target {spec!r}: torchtitan could not load --module {module} --config {name}: {first}") from exc


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchtitan logs through its own logger at INFO; a memfit run prints its own report."""
    import logging

    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _set_field(config: Any, key: str, value: Any) -> None:
    """``training.seq_len=512`` on torchtitan's config tree, checked against the field's type."""
    node = config
    path = key.split(".")
    for part in path[:-1]:
        if not hasattr(node, part):
            raise TargetError(f"--size {key}: torchtitan's config has no section {part!r}")
        node = getattr(node, part)
    leaf = path[-1]
    if not is_dataclass(node) or leaf not in {f.name for f in fields(node)}:
        known = ", ".join(f.name for f in fields(node)) if is_dataclass(node) else ""
        raise TargetError(f"--size {key}: torchtitan's config has no field {leaf!r}" + (f" (fields: {known})" if known else ""))
    current = getattr(node, leaf)
    if isinstance(current, bool) and not isinstance(value, bool):
        raise TargetError(f"--size {key}={value!r}: expected True or False")
    if isinstance(current, (int, float)) and not isinstance(current, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TargetError(f"--size {key}={value!r}: expected a number")
    if isinstance(current, str) and not isinstance(value, str):
        value = str(value)
    if isinstance(current, list) and isinstance(value, str):
        value = [v for v in value.split(",") if v]  # compile.components=model, as torchtitan's --compile.components model
    setattr(node, leaf, value)


def _refuse_unmodelled(config: Any) -> None:
    t, p = config.training, config.parallelism
    if not t.disable_cuda_graphs:
        raise TargetError(
            "torchtitan's CUDA-graph step (training.disable_cuda_graphs=False, its default) is not modelled; "
            "add --size training.disable_cuda_graphs=True to measure its eager step"
        )
    if p.spmd_backend == "spmd_types":
        # torch 2.13's fully_shard wants DTensor parameters where spmd_types gives plain local ones
        raise TargetError(
            "parallelism.spmd_backend='spmd_types' (torchtitan's default) is refused by this torch's fully_shard; "
            "add --size parallelism.spmd_backend=partial_dtensor (the same FSDP2 shards, as DTensors)"
        )
    if config.compile.enable:
        _refuse_unmodelled_compile(config)
    if p.pipeline_parallel_degree > 1:
        _refuse_unmodelled_pp(config)
    for field_name, what in (
        ("context_parallel_degree", "context"),
        ("expert_parallel_degree", "expert"),
    ):
        if getattr(p, field_name) != 1:
            raise TargetError(f"parallelism.{field_name}={getattr(p, field_name)}: {what} parallelism is not modelled; give 1")
    if t.global_batch_size > 0:
        raise TargetError(
            f"training.global_batch_size={t.global_batch_size}: gradient accumulation is not modelled; give -1 "
            "(one pass of the local batch)"
        )
    if t.enable_cpu_offload:
        raise TargetError("training.enable_cpu_offload=True is not modelled; give False")


def _refuse_unmodelled_compile(config: Any) -> None:
    """torchtitan's ``compile.enable``: its per-block compile (and its loss's) runs on fake
    tensors with inductor's kernels not run (:func:`memfit.compat.triton_fake.compiles_on_fake`,
    which refuses in one line where it cannot: on fake CUDA without Triton). What is not modelled
    beside it is refused here."""
    c, p = config.compile, config.parallelism
    if c.enable_async_tensor_parallel:
        raise TargetError("compile.enable_async_tensor_parallel=True (symmetric memory) is not modelled; give False")
    if p.pipeline_parallel_degree > 1:
        raise TargetError("torch.compile with pipeline parallelism is not modelled yet; add --size compile.enable=False")


# torch's schedules memfit runs as torchtitan builds them (by torchtitan's name, lower case);
# the zero-bubble and V schedules run weight gradients apart from input gradients (a
# microbatch's graph outlives its first backward), which memfit's pipeline step does not follow yet
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs")


def _refuse_unmodelled_pp(config: Any) -> None:
    p = config.parallelism
    if p.pipeline_parallel_schedule.lower() not in PP_SCHEDULES:
        raise TargetError(
            f"parallelism.pipeline_parallel_schedule={p.pipeline_parallel_schedule}: not modelled; "
            "give one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS"
        )
    b, mb = config.training.local_batch_size, p.pipeline_parallel_microbatch_size
    if mb < 1 or b % mb:
        # torchtitan's Trainer.Config refuses it too, when it parses the job
        raise TargetError(
            f"parallelism.pipeline_parallel_microbatch_size={mb} does not divide training.local_batch_size={b}; "
            "give a microbatch size dividing the batch"
        )
    if p.pipeline_parallel_schedule_csv:
        raise TargetError("parallelism.pipeline_parallel_schedule_csv: a schedule read from a file is not modelled; give ''")
    if p.tensor_parallel_degree > 1:
        # the stages would send DTensors, whose metadata memfit does not yet work out for them
        raise TargetError(
            f"pipeline parallelism with tensor parallelism (tensor_parallel_degree={p.tensor_parallel_degree}) "
            "is not modelled; give 1 (pp with FSDP is)"
        )


class _CausalSdpaAttention(nn.Module):
    """Stands in for torchtitan's FlexAttention (which only runs compiled): torch's causal
    scaled-dot-product attention on the same (B, L, N, H) tensors, with grouped-query heads."""

    def forward(  # type: ignore[override]
        self,
        q_BLNH: torch.Tensor,  # FlexAttention.forward's names: torchtitan maps its shardings by them
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any = None,
        score_mod: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if score_mod is not None or out_transform is not None:
            raise TargetError("this torchtitan model's attention uses a score_mod or out_transform, which memfit does not model")
        out = nn.functional.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


def _replace_flex(model: nn.Module) -> int:
    from torchtitan.models.common.attention import FlexAttention

    n = 0
    for module in model.modules():
        if isinstance(module, FlexAttention):
            module.__class__ = _as_sdpa(type(module))
            n += 1
    return n


_AS_SDPA: dict[type, type] = {}


def _as_sdpa(flex: type) -> type:
    """One stand-in class per FlexAttention class, shared by every block: dynamo guards a
    compiled block on its modules' types, so a class per block would compile each block anew
    (torchtitan's per-block compile reuses one graph across its identical blocks)."""
    if flex not in _AS_SDPA:
        _AS_SDPA[flex] = type("FlexAttentionAsSdpa", (_CausalSdpaAttention, flex), {"forward": _CausalSdpaAttention.forward})
    return _AS_SDPA[flex]


class TitanStep(nn.Module):
    """torchtitan's forward and loss as one module, so that the prediction is dropped before
    backward as in ``Trainer._forward_backward_body`` (``del pred``). Returns the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_fn: Any = None  # torchtitan's loss, built per rank on the parallelized model
        self.context: Any = contextlib.nullcontext  # torchtitan's train_context
        # torchtitan's compile.enable: its blocks compile themselves, its loss is a compiled
        # function (memfit.measure.scope.compiles: the rank's step compiles on fake tensors)
        self.compiles = False

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            raise TargetError("the torchtitan step runs on a parallelized model only: give --world-size N")
        with self.context():
            pred = self.model(tokens)
            loss, _ = self.loss_fn(pred, labels, global_valid_tokens)
            del pred
        return loss


def _ac_name(ac: Any) -> str:
    return "none" if ac is None else type(ac).__qualname__.split(".")[0]


def _loss_of(output: torch.Tensor) -> torch.Tensor:
    return output


class _Job:
    """torchtitan's parallelize and optimizer for one job's config: ``parallelize(model, mesh)``
    for :class:`memfit.Parallel`, and ``optimizer(params)`` for the workload, which builds
    torchtitan's optimizer over the model the last parallelize returned."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.decoder: nn.Module | None = None
        self.parts: list[nn.Module] = []  # under pipeline parallelism: this rank's model parts
        self.pp_mesh: Any = None

    @property
    def compiles(self) -> bool:
        """torchtitan's compile on (what memfit profiles but does not plan yet: :func:`memfit.measure.pipeline.refuse_pipelined`)."""
        return bool(self.config.compile.enable)

    @property
    def pipelined(self) -> bool:
        """Pipeline parallel (what memfit does not plan yet: :func:`memfit.measure.pipeline.refuse_pipelined`)."""
        return bool(self.config.parallelism.pipeline_parallel_degree > 1)

    def __call__(self, model: nn.Module, mesh: Any) -> nn.Module:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torchtitan.components.loss import ChunkedLossWrapper
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils

        config, spec = self.config, self.config.model_spec
        assert isinstance(model, TitanStep)
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        with _mesh_device(mesh.device_type), _quiet():
            dims = ParallelDims.from_config(config.parallelism, mesh.size())
            with unset_fake_temporarily():
                # as memfit builds its own mesh: outside fake tensors, whose setup runs
                # collectives on real tensors
                dims.build_mesh()
            if dims.pp_enabled:
                return self._pipelined(model, dims, mesh)
            decoder = spec.parallelize_fn(
                model.model,
                parallel_dims=dims,
                training=config.training,
                parallelism=config.parallelism,
                compile_config=config.compile,
                ac_config=config.activation_checkpoint,
                dump_folder=config.dump_folder,
            )
            model.context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
        model.model = decoder
        self.parts, self.pp_mesh = [], None
        loss = config.loss.build(compile_config=config.compile)
        if isinstance(loss, ChunkedLossWrapper):
            loss.set_lm_head(decoder.lm_head)
            decoder._skip_lm_head = True
        model.loss_fn = loss
        self.decoder = decoder
        return model

    def _pipelined(self, model: TitanStep, dims: Any, mesh: Any) -> nn.Module:
        """torchtitan's ``pipelining_fn`` (``pipeline_llm``: its split, its stages, each part
        parallelized by its ``parallelize_fn``, its schedule), as ``Trainer.__init__`` calls it."""
        from torchtitan.components.loss import ChunkedLossWrapper
        from torchtitan.distributed import utils as dist_utils

        config, spec = self.config, self.config.model_spec
        if spec.pipelining_fn is None:
            raise TargetError(f"torchtitan's {spec.name} does not support pipelining (its model spec has no pipelining_fn)")
        loss = config.loss.build(compile_config=config.compile)
        device = torch.device("cuda", 0) if mesh.device_type == "cuda" else torch.device("cpu")
        metas = _stage_metas(model.model, config, dims, isinstance(loss, ChunkedLossWrapper))
        try:
            with _split_outside_fake():
                schedule, parts, first, last = spec.pipelining_fn(
                    model.model,
                    parallel_dims=dims,
                    training=config.training,
                    parallelism=config.parallelism,
                    compile_config=config.compile,
                    ac_config=config.activation_checkpoint,
                    dump_folder=config.dump_folder,
                    device=device,
                    model_config=spec.model,
                    parallelize_fn=spec.parallelize_fn,
                    loss_fn=loss,
                )
        except (ValueError, AssertionError) as exc:
            raise TargetError(f"torchtitan's pipeline_llm refused the config: {str(exc).strip().splitlines()[0][:300]}") from exc
        if isinstance(loss, ChunkedLossWrapper) and last:
            # Trainer.__init__: the last stage's lm_head runs inside the chunked loss
            loss.set_lm_head(parts[-1].lm_head)
            parts[-1]._skip_lm_head = True
        stages = _schedule_stages(schedule)
        for stage in stages:
            static_stage(stage, *metas[stage.stage_index])
        on_fake_group(schedule, dims.get_mesh("pp").get_group())
        self.decoder, self.parts, self.pp_mesh = None, parts, dims.get_mesh("pp")
        context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
        return TitanPipelineRank(parts, schedule, stages, first, last, dims, config, context)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if self.parts:
            return self._optimizer(self.parts)
        if self.decoder is None:
            raise TargetError("the torchtitan step's optimizer is built on a parallelized model only: give --world-size N")
        return self._optimizer([self.decoder])

    def _optimizer(self, parts: list[nn.Module]) -> torch.optim.Optimizer:
        from torchtitan.distributed import utils as dist_utils

        container = self.config.optimizer.build(model_parts=parts)
        # memfit counts optimizer state from `.state`: the container's own is empty (its
        # optimizers hold it), so it reads theirs.
        inner = [o.state for o in container.optimizers]
        container.state = inner[0] if len(inner) == 1 else _States(inner)  # type: ignore[assignment]
        max_norm = self.config.training.max_norm
        pp_mesh = self.pp_mesh

        def clip(optimizer: Any, args: Any, kwargs: Any) -> None:
            # Trainer.train_step: clip_grad_norm_ over the model parts' parameters (the norm
            # summed over the pipeline's ranks), then optimizers.step()
            params = [p for m in parts for p in m.parameters()]
            dist_utils.clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=pp_mesh, ep_enabled=False)

        container.register_step_pre_hook(clip)
        return container


class TitanPipelineRank(OwnPasses):
    """One pipeline rank of torchtitan's job: its model parts (``module``: the one part, or
    the parts of an interleaved schedule as a ModuleList) and torchtitan's schedule over their
    stages, run as ``Trainer.pp_forward_backward_step`` runs it (memfit's train step calls
    :meth:`passes`, then the optimizer, clipped as torchtitan clips)."""

    def __init__(
        self, parts: list[nn.Module], schedule: Any, stages: list[Any], first: bool, last: bool, dims: Any, config: Any, context: Any
    ) -> None:
        super().__init__()
        self.module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        # not children: the stages hold the parts, named under ``module``
        self.__dict__.update(_schedule=schedule, _stages=stages, _group=dims.get_mesh("pp").get_group(), _context=context)
        self.first, self.last = first, last
        self.microbatch_size = config.parallelism.pipeline_parallel_microbatch_size
        self._on_phase: Any = lambda phase: None
        for stage in stages:
            phased(stage, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TargetError("a torchtitan pipeline rank's step runs through its schedule (memfit's train step), not by calling it")

    def held_buffers(self) -> list[torch.Tensor]:
        return stage_buffers(self._stages)

    def passes(self, args: tuple, kwargs: dict, targets: Any, on_phase: Any) -> torch.Tensor | None:
        """``Trainer.train_step`` with pipeline parallelism: the local batch as the data loader
        gives it (``local_batch_size / microbatch_size`` microbatches of ``microbatch_size``
        rows each), then ``pp_forward_backward_step``: the schedule's step over them."""
        tokens, labels, global_valid_tokens = args
        n = tokens.shape[0] // self.microbatch_size
        arg_mbs = [(t,) for t in tokens.split(self.microbatch_size)] if self.first else None
        target_mbs = list(labels.split(self.microbatch_size)) if self.last else None
        losses: list[torch.Tensor] | None = [] if self.last else None
        self._on_phase = on_phase
        try:
            with self._context(), schedule_step(self._group):
                _microbatch_step(
                    self._schedule,
                    arg_mbs=arg_mbs,
                    kwarg_mbs=[{} for _ in range(n)],
                    target_mbs=target_mbs,
                    losses=losses,
                    loss_kwargs={"global_valid_tokens": global_valid_tokens},
                )
        finally:
            self._on_phase = lambda phase: None
        return None


@contextlib.contextmanager
def _split_outside_fake() -> Iterator[None]:
    """torchtitan's split deep-copies the whole model (on meta) for each stage; memfit
    parallelizes under FakeTensorMode, which cannot deep-copy a meta parameter. The copies are
    made outside it (as memfit copies models), the rest of ``pipeline_llm`` runs inside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchtitan.distributed import pipeline_parallel as titan_pp

    def deepcopy(x: Any, memo: Any = None) -> Any:
        with unset_fake_temporarily():
            return copy.deepcopy(x, memo)

    saved = titan_pp.copy
    titan_pp.copy = types.SimpleNamespace(deepcopy=deepcopy)  # type: ignore[assignment]
    try:
        yield
    finally:
        titan_pp.copy = saved


def _microbatch_step(schedule: Any, **mbs: Any) -> None:
    """``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...,
    return_outputs=False)`` as torchtitan's ``pp_forward_backward_step`` calls it. A torch
    whose ``step`` takes no ``arg_mbs`` (2.13: it would hand them to the model as keywords)
    gets what a step with them does: the stages reset, then the schedule's own
    ``_step_microbatches`` over the microbatches given."""
    import inspect

    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        schedule.step(**mbs, return_outputs=False)
        return
    stages = _schedule_stages(schedule)
    for stage in stages:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    loss_kwargs = mbs.pop("loss_kwargs")
    schedule._step_microbatches(**mbs, return_outputs=False, loss_kwargs=loss_kwargs)


def _schedule_stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def _stage_metas(decoder: nn.Module, config: Any, dims: Any, chunked: bool) -> dict[int, tuple[tuple, tuple]]:
    """Each pipeline stage's (inputs, outputs) for one microbatch, as meta tensors: torchtitan's
    own split of the model (``_generate_llm_fqn_per_model_part``, ``_split_module``) run stage
    by stage on meta, its parameters in FSDP2's forward dtype (torchtitan always applies its
    MixedPrecisionPolicy, ``training.mixed_precision_param``), the last stage's lm_head skipped
    where the chunked loss runs it. No memory, no communication: torchtitan's stages, built
    without example tensors, would infer this by sending it between ranks in their first step."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import pipeline_parallel as titan_pp

    p, t = config.parallelism, config.training
    names = p.module_fqns_per_model_part
    if names is None:
        num_stages, layers, first_weight, last_weight = titan_pp._get_pipeline_metadata(dims, p, config.model_spec.model)
        names = titan_pp._generate_llm_fqn_per_model_part(num_stages, layers, first_weight, last_weight)
    dtype = TORCH_DTYPE_MAP[t.mixed_precision_param]
    out: dict[int, tuple[tuple, tuple]] = {}
    with _disable_current_modes(), torch.enable_grad():
        x: tuple = (torch.empty((p.pipeline_parallel_microbatch_size, t.seq_len), dtype=torch.int64, device="meta"),)
        for i, modules in enumerate(names):
            part = titan_pp._split_module(decoder, modules)
            for param in part.parameters():
                param.data = param.data.to(dtype)
            part._skip_lm_head = chunked and i == len(names) - 1
            if i:
                x = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in x)
            y = part(*x)
            y = y if isinstance(y, tuple) else (y,)
            out[i] = (x, tuple(a.detach().requires_grad_(a.requires_grad) for a in y))
            x = y
    return out


class _States(Mapping):
    """The optimizers' ``state`` dicts of several model parts (an interleaved pipeline rank's)
    read as one, each parameter's from the optimizer that holds it. Not a ChainMap: torch's
    ``state`` is a defaultdict, whose lookup of another optimizer's parameter would answer (and
    keep) an empty state instead of passing the lookup on."""

    def __init__(self, states: list[Any]) -> None:
        self._states = states

    def __getitem__(self, key: Any) -> Any:
        for state in self._states:
            if key in state:
                return state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for state in self._states:
            yield from state

    def __len__(self) -> int:
        return sum(len(state) for state in self._states)


@contextlib.contextmanager
def _mesh_device(device_type: str) -> Iterator[None]:
    """torchtitan builds its meshes on the device type it detected at import ("cuda" when it
    finds no accelerator); memfit's rank runs on the mesh's device (the CPU under --device fake)."""
    from torchtitan.distributed import parallel_dims

    saved = parallel_dims.device_type
    parallel_dims.device_type = device_type
    try:
        yield
    finally:
        parallel_dims.device_type = saved


def _mesh_shape(config: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """memfit's mesh for the job (its NCCL estimate counts one communicator per dimension
    wider than one rank): (pp, dp_replicate, dp_shard, tp) as torchtitan orders them, the
    unset ones left out."""
    p = config.parallelism
    shape, names = [], []
    if p.pipeline_parallel_degree > 1:
        shape.append(p.pipeline_parallel_degree)
        names.append("pp")
    if p.data_parallel_replicate_degree > 1:
        shape.append(p.data_parallel_replicate_degree)
        names.append("dp_replicate")
    shape.append(p.data_parallel_shard_degree)
    names.append("dp_shard")
    if p.tensor_parallel_degree > 1:
        shape.append(p.tensor_parallel_degree)
        names.append("tp")
    return tuple(shape), tuple(names)


def build(target: str, batch_size: int | None = None, **sizes: Any) -> Workload:
    """The workload of torchtitan's job ``torchtitan:MODULE:CONFIG`` (see the module's text)."""
    _import_torchtitan()
    config = _load_config(target)
    if batch_size is not None:
        config.training.local_batch_size = batch_size
    for key, value in sizes.items():
        _set_field(config, key, value)
    _refuse_unmodelled(config)
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils as titan_utils

    spec = config.model_spec
    model_config = spec.model
    with _quiet():
        try:
            model_config.update_from_config(config=config)
        except (ValueError, AssertionError) as exc:
            raise TargetError(f"{target}: torchtitan refused the config: {str(exc).strip().splitlines()[0][:300]}") from exc
        with torch.device("meta"), titan_utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
            decoder = model_config.build()
    replaced = _replace_flex(decoder)
    job = _Job(config)
    shape, names = _mesh_shape(config)
    b, s = config.training.local_batch_size, config.training.seq_len
    vocab = int(getattr(model_config, "vocab_size", 2))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (b, s), generator=gen)
    labels = torch.randint(vocab, (b, s), generator=gen)
    # Trainer.train_step: the count of labels not ignored over the batch mesh, a 0-dim tensor on the device
    global_valid_tokens = torch.tensor(b * s, dtype=torch.int64)
    meta = {
        "torchtitan": target[len(PREFIX) :],
        "flavor": spec.flavor,
        "local_batch_size": b,
        "seq_len": s,
        "activation_checkpoint": _ac_name(config.activation_checkpoint),
        "attention": "flex as causal sdpa" if replaced else "torchtitan's",
        "compile": ",".join(config.compile.components) if config.compile.enable else "off",
        "peak_names": peak_names(),
    }
    step = TitanStep(decoder)
    step.compiles = bool(config.compile.enable)
    return Workload(
        model=step,
        inputs=(tokens, labels, global_valid_tokens),
        loss_fn=_loss_of,
        optimizer=job.optimizer,
        name=f"torchtitan {spec.name} {spec.flavor}" + (f" compiled ({meta['compile']})" if config.compile.enable else ""),
        meta=meta,
        parallel=Parallel(job, mesh_shape=shape, mesh_dim_names=names, name="torchtitan"),
        plan_root="model",  # the Trainer's model: plans name torchtitan's modules, not TitanStep's
    )
