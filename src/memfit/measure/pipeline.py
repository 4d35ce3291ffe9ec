"""Pipeline parallelism: one rank of a ``torch.distributed.pipelining`` step, measured as any rank.

:class:`Pipeline` is a ``parallelize`` (for :class:`memfit.Parallel`): on each rank it cuts the
model (on meta) into this rank's stages with the workload's own ``split`` (the model pruned to
the stages' modules, as torchtitan's manual split does), and returns a :class:`PipelineRank`.
That module runs torch's own schedule (GPipe, 1F1B, interleaved 1F1B, ...) for the step: its
``PipelineStage`` objects, its microbatches, its sends and receives. memfit's train step hands it
the batch and the phase callback (:class:`memfit.measure.step.OwnPasses`), and records the
step with the usual recorder: the saved activations of every microbatch in flight on this rank,
the stage's receive buffers (one per microbatch, allocated at the first step and kept, as
torch's stages keep them), the sends, the gradients.

The stages are given complete metadata (the shapes of their inputs and outputs, worked out on
meta tensors by running the microbatch through every stage of the model, no communication), so
torch's stages skip shape inference ("static" mode). On the fake process group, the schedule's
warm-up vote, which reads the value a neighbour sent, is skipped with the answer every rank
reaches here (:func:`memfit.measure._distributed.static_pipeline_stages`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import WorkloadError
from memfit.measure import _distributed
from memfit.measure.ledger import Phase
from memfit.measure.step import OwnPasses

__all__ = ["SCHEDULES", "Pipeline", "PipelineRank", "own_pipeline", "refuse_pipelined", "stage_indices", "phased", "stage_buffers", "static_stage", "on_fake_group", "schedule_step"]

SCHEDULES: dict[str, tuple[str, int, str]] = {
    # name: (torch's class in torch.distributed.pipelining.schedules, stages per rank, placement)
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "loopedbfs": ("ScheduleLoopedBFS", 2, "loop"),
}
"""The schedules memfit runs, by the name ``--size schedule=`` takes (torchtitan's names, lower case).
Not yet: the zero-bubble schedules (their weight-gradient passes run apart from the input-gradient
ones, so a microbatch's graph outlives its first backward pass) and DualPipeV."""


def stage_indices(rank: int, pp: int, per_rank: int, placement: str) -> list[int]:
    """The stages rank ``rank`` of ``pp`` holds: ``loop`` (interleaved): ``rank, rank + pp, ...``;
    ``v`` (ZBV, DualPipeV): ``rank`` and ``2 pp - 1 - rank``."""
    if placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


@dataclass(frozen=True)
class Pipeline:
    """A ``parallelize`` for pipeline parallelism (see the module's text).

    ``split(model, indices, num_stages)`` prunes ``model`` (on meta) to the modules of the stages
    ``indices`` and returns one ``nn.Module`` per index, running that stage (its forward takes
    what the stage before returns; the first stage takes the model's inputs, the last returns
    what ``loss_fn(output, target)`` takes). ``target``: the keyword of the workload's inputs
    that the last stage's loss takes (``"labels"``), popped from what the first stage is given;
    None: the workload's ``targets``."""

    split: Callable[[nn.Module, Sequence[int], int], Sequence[nn.Module]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    schedule: str = "1f1b"
    microbatches: int | None = None
    """None: as many as the pipeline has ranks."""
    stages_per_rank: int | None = None
    """None: the schedule's (1; 2 for the interleaved and V schedules)."""
    target: str | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise WorkloadError(f"pipeline: unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for key in ("microbatches", "stages_per_rank"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise WorkloadError(f"pipeline: {key} must be a positive integer, got {value!r}")
        per_rank, placement = SCHEDULES[self.schedule][1:]
        if self.stages_per_rank is not None and per_rank == 1 and self.stages_per_rank != 1:
            raise WorkloadError(
                f"pipeline: schedule {self.schedule} runs one stage per rank, got stages_per_rank={self.stages_per_rank}; "
                "choose an interleaved schedule (interleaved1f1b) for more"
            )
        if self.stages_per_rank is not None and placement == "v" and self.stages_per_rank != 2:
            raise WorkloadError(f"pipeline: schedule {self.schedule} runs two stages per rank (a V), got {self.stages_per_rank}")

    @property
    def per_rank(self) -> int:
        return self.stages_per_rank or SCHEDULES[self.schedule][1]

    def num_stages(self, pp: int) -> int:
        return pp * self.per_rank

    def __call__(self, model: nn.Module, mesh: Any) -> nn.Module:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        pp = mesh.size()
        n = self.num_stages(pp)
        indices = stage_indices(mesh.get_local_rank(), pp, self.per_rank, SCHEDULES[self.schedule][2])
        with unset_fake_temporarily():
            whole = copy.deepcopy(model)  # on meta: every stage, for the shapes between them
        stages = list(self.split(model, indices, n))
        if len(stages) != len(indices):
            raise WorkloadError(f"pipeline: split returned {len(stages)} stage modules for the {len(indices)} stages {indices}")
        return PipelineRank(model, stages, indices, self, pp, whole, mesh)


class PipelineRank(OwnPasses):
    """One pipeline rank's model: ``module``, the model pruned to this rank's stages (its
    modules keep the whole model's names), run by torch's schedule over its stages."""

    def __init__(
        self, module: nn.Module, stages: list[nn.Module], indices: list[int], spec: Pipeline, pp: int, whole: nn.Module, mesh: Any
    ) -> None:
        super().__init__()
        self.module = module
        # not children: the stages' modules are the pruned model's, named there
        self.__dict__.update(_stages=stages, _whole=whole, _mesh=mesh, _schedule=None, _torch_stages=[])
        self.indices, self.spec, self.pp = indices, spec, pp
        self._on_phase: Callable[[Phase], None] = lambda phase: None

    @property
    def num_stages(self) -> int:
        return self.spec.num_stages(self.pp)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise WorkloadError("a pipeline rank's step runs through its schedule (memfit's train step), not by calling it")

    def held_buffers(self) -> list[torch.Tensor]:
        """The stages' receive buffers (activations from the stage before, gradients from the
        stage after; one per microbatch), made at the first step and kept."""
        return stage_buffers(self._torch_stages)

    def passes(self, args: tuple, kwargs: dict, targets: Any, on_phase: Callable[[Phase], None]) -> torch.Tensor | None:
        kwargs = dict(kwargs)
        if self.spec.target is not None:
            if self.spec.target not in kwargs:
                raise WorkloadError(f"pipeline: the inputs have no {self.spec.target!r} for the last stage's loss")
            targets = kwargs.pop(self.spec.target)
        inputs = (*args, *kwargs.values())
        if self._schedule is None:
            self._build(inputs)
        first, last = 0 in self.indices, self.num_stages - 1 in self.indices
        losses: list[torch.Tensor] | None = [] if last else None
        self._on_phase = on_phase
        try:
            with schedule_step(self._mesh.get_group()):
                self._schedule.step(
                    *(inputs if first else ()), target=targets if last else None, losses=losses, return_outputs=False
                )
        finally:
            self._on_phase = lambda phase: None
        return None

    def _build(self, inputs: tuple) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        m = self.spec.microbatches or self.pp
        batch = inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if batch is None or batch % m:
            raise WorkloadError(
                f"pipeline: {m} microbatches do not divide the batch of {batch}: give a batch size that is a multiple of {m}"
            )
        metas = _stage_metas(self._whole, inputs, batch // m, self.num_stages, self.spec.split)
        device = torch.device("cuda", 0) if self._mesh.device_type == "cuda" else torch.device("cpu")
        group = self._mesh.get_group()
        stages = []
        for index, module in zip(self.indices, self._stages):
            ins, outs = metas[index]
            stage = PipelineStage(module, index, self.num_stages, device, input_args=ins, output_args=outs, group=group)
            phased(stage, self)
            stages.append(stage)
        cls = getattr(schedules, SCHEDULES[self.spec.schedule][0])
        one = issubclass(cls, schedules.PipelineScheduleSingle)  # GPipe, 1F1B: one stage, not a list
        try:
            schedule = cls(stages[0] if one else stages, m, loss_fn=self.spec.loss_fn)
        except ValueError as exc:
            raise WorkloadError(f"pipeline: schedule {self.spec.schedule} refused: {str(exc).splitlines()[0]}") from exc
        on_fake_group(schedule, group)
        self.__dict__.update(_schedule=schedule, _torch_stages=stages)


def stage_buffers(stages: Sequence[Any]) -> list[torch.Tensor]:
    """The receive buffers of torch ``PipelineStage`` objects (activations from the stage
    before, gradients from the stage after; one per microbatch), made at the first step and kept."""
    out: list[torch.Tensor] = []
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
    return out


def on_fake_group(schedule: Any, group: Any) -> None:
    """A schedule built over the fake process group: its warm-up vote answered here (every
    stage's metadata complete: :func:`memfit.measure._distributed.static_pipeline_stages`)."""
    if torch.distributed.get_backend(group) == "fake":
        _distributed.static_pipeline_stages(schedule)


def schedule_step(group: Any) -> contextlib.AbstractContextManager:
    """Around a schedule's step: on the fake group, its sends' works hold their tensors as
    gloo's do (:func:`memfit.measure._distributed.fake_pipeline_step`)."""
    fake = torch.distributed.get_backend(group) == "fake"
    return _distributed.fake_pipeline_step() if fake else contextlib.nullcontext()


def static_stage(stage: Any, inputs: tuple, outputs: tuple) -> None:
    """Give a torch ``PipelineStage`` built without example tensors (torchtitan builds its
    stages so, and lets the first step infer the shapes by sending them between ranks) the
    metadata of its inputs and outputs (meta tensors), as its ``input_args``/``output_args``
    would: its schedule then runs "static", with no shape inference over the process group."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    stage._user_meta = _StageMeta(
        inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs), input_grads=None, output_grads=None
    )


def phased(stage: Any, rank: Any) -> None:
    """Tell memfit's step which pass a stage runs (forward, backward) as the schedule runs it:
    ``rank._on_phase(phase)`` before each."""
    for name, phase in (
        ("forward_one_chunk", Phase.FORWARD),
        ("backward_one_chunk", Phase.BACKWARD),
        ("backward_weight_one_chunk", Phase.BACKWARD),
    ):
        fn = getattr(stage, name)

        def run(*a: Any, _fn: Callable = fn, _phase: Phase = phase, **k: Any) -> Any:
            rank._on_phase(_phase)
            return _fn(*a, **k)

        setattr(stage, name, run)


def _meta(t: Any, rows: int) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta")


def _stage_metas(whole: nn.Module, inputs: tuple, rows: int, num_stages: int, split: Callable) -> dict[int, tuple[tuple, tuple]]:
    """Each stage's (inputs, outputs) for one microbatch, as meta tensors: the microbatch run
    through every stage of the whole model on meta (no memory, no communication)."""
    from torch.utils._python_dispatch import _disable_current_modes

    out: dict[int, tuple[tuple, tuple]] = {}
    with _disable_current_modes(), torch.enable_grad():
        stages = list(split(whole, list(range(num_stages)), num_stages))
        x: tuple = tuple(_meta(t, rows) for t in inputs)
        for i, stage in enumerate(stages):
            if i:
                x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
            y = stage(*x)
            y = y if isinstance(y, tuple) else (y,)
            out[i] = (x, tuple(t.detach().requires_grad_(t.requires_grad) for t in y))
            x = y
    return out


def own_pipeline(workload: Any) -> bool:
    """Whether ``workload`` is pipelined by memfit's own :class:`Pipeline` (``parallel=pp``),
    which :func:`memfit.plan_ranks` plans per stage."""
    parallel = getattr(workload, "parallel", None)
    return parallel is not None and isinstance(parallel.parallelize, Pipeline)


def refuse_pipelined(workload: Any, what: str, own_ok: bool = False) -> None:
    """What is not modelled under pipeline parallelism is refused in one line: ``what``
    (``plan``, ``fit``, ``--min-world-size``, ...) under another's pipeline (torchtitan's job), or
    under memfit's own :class:`Pipeline` unless ``own_ok`` (``plan``, ``fit`` and ``--max-batch``
    work per stage; ``--min-world-size`` does not: more ranks are more stages, another split).
    A step that compiles its own modules (a parallelize that says ``compiles``: torchtitan's
    ``compile.enable``) is refused here too, for every ``what``."""
    from memfit.errors import PlanError

    parallel = getattr(workload, "parallel", None)
    if parallel is not None and getattr(parallel.parallelize, "compiles", False):
        # the searches' one gate: their candidates put memfit's checkpoints on modules inside
        # the compiled blocks, each a new graph, until dynamo's recompile limit
        raise PlanError(
            f"{what} of a step that compiles its own modules ({parallel.name}) is not modelled yet: profile it "
            "(memfit profile ... --device fake-cuda), or plan with compile off (--size compile.enable=False)"
        )
    # a parallelize of another's pipeline (torchtitan's job) says so with ``pipelined``
    own = own_pipeline(workload)
    if parallel is not None and (own or getattr(parallel.parallelize, "pipelined", False)) and not (own and own_ok):
        # what does work: memfit's own Pipeline's plan at a given world size, per stage
        planned = "memfit plan --world-size N plans " + ("each stage; " if own else "memfit's own parallel=pp per stage; ")
        raise PlanError(
            f"{what} under pipeline parallelism ({parallel.name}) is not modelled yet: {planned}profile its stages "
            "(memfit profile ... --world-size N --ranks all; --capacity BYTES or --gpu NAME judges each stage rank's peak "
            "against it) and see docs/limitations.md"
        )
