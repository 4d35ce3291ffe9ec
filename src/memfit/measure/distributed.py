"""Per-rank memory of a distributed training step, measured from one CPU process.

A :class:`~memfit.workload.Workload` with a :class:`~memfit.workload.Parallel` says how its
step is parallelized. :func:`profile_ranks` runs that step as each asked-for rank on torch's
fake process group (collectives move no data) and fake tensors (no memory used): the device
mesh is built outside FakeTensorMode, the model (on meta) is parallelized and materialised
inside it, and the usual recorder measures the step. What a rank holds is counted by its
local shards (a DTensor's wrapper reports the global size), FSDP2's ``resize_`` frees and
re-allocations are seen, and collective buffers get their own categories (unsharded
parameters, all-gather and reduce-scatter buffers, DDP buckets).

The process group is given (:class:`FakeGroup`, or :data:`CURRENT_GROUP`: one already
initialised, e.g. gloo in a real multi-process run, which is how the fake figures are
checked against real ones); nothing elsewhere in memfit branches on it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.compat import torch_compat
from memfit.cuda import gpu as gpus
from memfit.cuda import nccl
from memfit.cuda.allocator import AllocatorSettings
from memfit.errors import MemfitError, WorkloadError
from memfit.measure import _distributed, rank_layers
from memfit.measure.inputs import map_shared
from memfit.measure.ledger import START_TICK, Category, Ledger
from memfit.measure.profile import (
    ModuleStats,
    Profile,
    Progress,
    _device_fit,
    _model_device,
    _module_stats,
    _register_start,
    _simulated,
    allocator_settings_from_env,
    model_cuda_memory,
    module_figures,
    record_step,
    run_step,
)
from memfit.measure.recorder import Recorder
from memfit.measure.sandbox import Sandbox, copy_model, fake_device
from memfit.measure.scope import Scope
from memfit.recompute.checkpoint import apply_choices
from memfit.units import parse_bytes
from memfit.workload import Parallel, Where, Workload, default_optimizer, split_inputs

__all__ = [
    "with_recompute",
    "FakeGroup",
    "CURRENT_GROUP",
    "RankProfiles",
    "profile_ranks",
    "profile_rank",
    "layered_rank",
    "layered_profile",
    "StartOverLimit",
    "held_at_start",
    "rank_device",
    "mesh_device",
    "nccl_outside",
    "nccl_communicators",
    "rank_device_fit",
    "world_size_of",
    "named_model",
    "RankState",
    "rank_state",
    "box_state",
    "rank_sandbox",
    "record_rank",
    "fsdp2",
    "FSDP2",
    "ddp",
    "tensor_parallel",
    "compose",
    "DISTRIBUTED_FORMAT",
    "without_backend_buffers",
]

DISTRIBUTED_FORMAT = "memfit.distributed_profile/1"


@dataclass(frozen=True)
class FakeGroup:
    """Run as ``rank`` of ``world_size`` on torch's fake process group (one process)."""

    world_size: int
    rank: int = 0
    device: str = "cpu"
    """Where the rank's fake tensors live: ``"cpu"``, or ``"cuda"`` (fake CUDA,
    :mod:`memfit.cuda.fake`: CUDA's kernels and allocator rounding, a CUDA device mesh, and
    the ledger replayed through the caching-allocator model for the reserved peak)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise WorkloadError(f"a fake rank's device is 'cpu' or 'cuda' (fake CUDA), got {self.device!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise WorkloadError(f"the world size must be a positive integer, got {self.world_size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise WorkloadError(
                f"rank {self.rank!r} is not a rank of a world of {self.world_size}: give 0 to {self.world_size - 1}"
            )


CURRENT_GROUP = "current"
"""Measure on the default process group already initialised in this process (real ranks)."""


@dataclass
class RankProfiles:
    """One profile per measured rank of a distributed step."""

    world_size: int
    parallel: str
    profiles: dict[int, Profile] = field(default_factory=dict)
    layers: dict[int, str | None] = field(default_factory=dict)
    """Per rank: None where its step was synthesized from fewer layers (checked), else why the
    whole model's step ran (:func:`layered_rank`). Not in the JSON: the figures are the same."""

    @property
    def worst_rank(self) -> int:
        """The rank whose budget peak is highest (fake CUDA: its reserved peak)."""
        return max(self.profiles, key=lambda r: (self.profiles[r].budget_peak_bytes, self.profiles[r].peak_bytes, -r))

    @property
    def peak_bytes(self) -> int:
        """The highest per-rank tensor peak among the measured ranks (on fake CUDA: the
        allocated peak, blocks rounded as the caching allocator rounds them)."""
        return max(p.peak_bytes for p in self.profiles.values())

    @property
    def budget_peak_bytes(self) -> int:
        """What each GPU must hold: the highest per-rank reserved peak on fake CUDA (the
        caching-allocator model's segments), else :attr:`peak_bytes`."""
        return max(p.budget_peak_bytes for p in self.profiles.values())

    @property
    def spread_bytes(self) -> int:
        """Highest minus lowest per-rank peak among the measured ranks."""
        peaks = [p.peak_bytes for p in self.profiles.values()]
        return max(peaks) - min(peaks)

    def under(self, settings: AllocatorSettings) -> RankProfiles:
        """The same ranks judged under other caching-allocator settings (fake CUDA): each rank's
        :meth:`Profile.under`."""
        return dataclasses.replace(self, profiles={r: p.under(settings) for r, p in self.profiles.items()})

    def to_dict(self, *, ledger: bool = True) -> dict[str, Any]:
        out = {
            "format": DISTRIBUTED_FORMAT,
            "world_size": self.world_size,
            "parallel": self.parallel,
            "peak_bytes": self.peak_bytes,
            "worst_rank": self.worst_rank,
            "spread_bytes": self.spread_bytes,
        }
        if any(p.cuda_memory is not None for p in self.profiles.values()):
            out["reserved_peak_bytes"] = self.budget_peak_bytes
        out["ranks"] = [{"rank": r, **p.to_dict(ledger=ledger)} for r, p in sorted(self.profiles.items())]
        return out

    def to_json(self, *, ledger: bool = True) -> str:
        return json.dumps(self.to_dict(ledger=ledger))


def profile_ranks(
    workload: Workload,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] = (0,),
    progress: Progress | None = None,
    fake: bool | str | Where = True,
    gpu: str | gpus.GpuSpec | None = None,
    capacity: int | str | None = None,
    start_limit: int | None = None,
    on_state: Callable[[RankState], None] | None = None,
) -> RankProfiles:
    """Measure the distributed step of ``workload`` as each rank in ``ranks`` (default rank 0:
    FSDP2 and DDP ranks hold the same memory when the shards are even) on the fake process
    group, each rank on fake tensors in this one process.

    ``world_size`` overrides the workload's :attr:`Parallel.world_size`. ``fake``: ``True``
    (or ``"cpu"``) runs each rank on fake CPU tensors; ``"cuda"`` on fake CUDA (as
    :func:`memfit.profile`'s ``fake="cuda"``: the shim loaded before torch), where each
    rank's profile also has its allocated and reserved peaks from the caching-allocator
    model and ``device_fit`` against ``gpu`` (a name from :data:`memfit.cuda.gpu.GPUS`;
    default the simulated GPU, H100-80GB) or ``capacity`` (bytes, ``"80GiB"``). Each rank's
    ``device_fit`` takes off, besides the CUDA context, an estimate of NCCL's buffers for
    the communicators its mesh needs (:func:`nccl_outside`), as a line of its own.
    ``start_limit``: as :func:`profile_rank`'s (:class:`StartOverLimit` from the first rank over it);
    ``on_state``: as :func:`profile_rank`'s, for the first of ``ranks``."""
    parallel = _parallel_of(workload)
    n = world_size_of(workload, world_size)
    if not ranks:
        raise WorkloadError("ranks is empty: give the ranks to measure, e.g. (0,)")
    device = rank_device(fake)
    spec = gpus.find_gpu(gpu) if isinstance(gpu, str) else gpu
    if spec is not None and device != "cuda":
        raise gpus.GpuError(f"gpu={spec.key!r} is the GPU fake CUDA simulates: pass fake='cuda' (--device fake-cuda)")
    capacity_bytes = None if capacity is None else parse_bytes(capacity)
    if device == "cuda":
        nccl.settings_from_env()  # a bad NCCL variable is refused in one line before any rank runs
    out = RankProfiles(n, parallel.name)
    with _simulated(spec):
        for i, r in enumerate(dict.fromkeys(ranks)):
            hook = on_state if i == 0 else None
            prof = _one_rank(out, workload, FakeGroup(n, r, device), progress, start_limit, hook)
            if capacity_bytes is not None:
                prof.device_fit = rank_device_fit(prof, parallel, n, capacity_bytes, spec)
            out.profiles[r] = prof
    return out


def _one_rank(
    out: RankProfiles,
    workload: Workload,
    group: FakeGroup,
    progress: Progress | None,
    start_limit: int | None,
    on_state: Callable[[RankState], None] | None,
) -> Profile:
    """One rank's profile: from fewer layers where that is shown exact (:func:`layered_rank`),
    else the whole model's step (:func:`profile_rank`); ``out.layers`` says which and why."""
    got = layered_rank(workload, group, progress) if on_state is None else "its state was asked for"
    if isinstance(got, rank_layers.RankStep):
        out.layers[group.rank] = None
        return layered_profile(workload, group, got, start_limit)
    out.layers[group.rank] = got
    return profile_rank(workload, group, progress=progress, start_limit=start_limit, on_state=on_state)


def layered_rank(workload: Workload, group: FakeGroup, progress: Progress | None = None) -> rank_layers.RankStep | str:
    """The rank's whole recorded step synthesized from its steps with 2, 3 and 4 layers
    (:mod:`memfit.measure.rank_layers`: checked at 4), or why it is not."""
    if group.device == "cuda":
        # fake CUDA numbers streams per process: each fewer-layer step's FSDP2 streams would be
        # new ones (no two steps alike), and the whole model's after them numbered otherwise than alone
        return "fake CUDA: its streams are numbered per process, so no two steps of fewer layers are alike"
    where = f"rank {group.rank} of {group.world_size}: "
    return rank_layers.rank_layers(workload, lambda n: _small_step(workload, group, n), where, progress)


def _small_step(workload: Workload, group: FakeGroup, n: int) -> rank_layers.RankStep | str:
    """The rank's step with ``n`` layers, as :func:`profile_rank` runs it: parallelized, a
    warm-up step, a recorded one."""
    from torch.nn.parallel import DistributedDataParallel

    stack = workload.layers
    assert stack is not None
    model = stack.rebuild(n)
    why = rank_layers.small_signature(workload, model, n)
    if why is not None:
        return why
    with rank_sandbox(dataclasses.replace(workload, model=model, layers=None), group) as box:
        if any(isinstance(m, DistributedDataParallel) for m in box.model.modules()):
            return "DistributedDataParallel: its buckets group parameters across layers, by bytes"
        state = box_state(box)
        with Scope(named_model(box.model)) as scope:
            run_step(box, scope, workload.loss_fn)
            ledger, flops = record_step(box, scope, workload.loss_fn)
            types = {name: type(m).__name__ for m, name in scope.names.items()}
            return rank_layers.RankStep(ledger, flops, dict(scope.calls), types, state.resident_bytes, state.layout)


def layered_profile(workload: Workload, group: FakeGroup, got: rank_layers.RankStep, start_limit: int | None = None) -> Profile:
    """The rank's :class:`Profile` from its synthesized step, as :func:`record_rank` makes one
    from a recorded step (``start_limit``: as :func:`profile_rank`'s, on the step's start)."""
    ledger, parallel = got.ledger, _parallel_of(workload)
    if start_limit is not None and ledger.start_bytes > start_limit:
        raise StartOverLimit(group.rank, ledger.start_bytes, start_limit)
    sizes = {name: sum(p.numel() * p.element_size() for p in mod.parameters()) for name, mod in workload.model.named_modules()}
    stats = {name: ModuleStats(name, kind, calls=got.calls.get(name, 0)) for name, kind in got.types.items()}
    for name, st in stats.items():
        st.parameter_bytes = sizes.get(name, 0)
    cuda = group.device == "cuda"
    prof = Profile(
        ledger=ledger,
        modules=module_figures(stats, ledger, got.flops),
        device="fake:cuda:0" if cuda else "fake:cpu",
        fake=True,
        time_source="omitted",
        step_time_s=None,
        model_type=type(workload.model).__name__,
        step_flops=sum(got.flops.values()),
        meta={**workload.meta, "world_size": group.world_size, "rank": group.rank, "parallel": parallel.name},
        cuda_memory=model_cuda_memory(ledger, allocator_settings_from_env()) if cuda else None,
    )
    prof.device_fit = rank_device_fit(prof, parallel, group.world_size, None)
    return prof


NODE_SIZE = 8
"""GPUs a node, for what NCCL keeps per communicator (NVLS spans a node's ranks): an HGX board's."""


def nccl_communicators(parallel: Parallel, world_size: int, node_size: int = NODE_SIZE) -> list[nccl.Communicator]:
    """The NCCL communicators one rank of ``parallel`` at ``world_size`` holds: one per dimension
    of its mesh wider than one rank (FSDP2 or DDP: one over all ranks; FSDP2+TP: the dp and the
    tp groups; HSDP: the replicate and the shard groups; a pipeline: the pp group). A dimension
    spans ``node_size // (the ranks of the dimensions after it)`` ranks of a node."""
    shape = parallel.mesh(world_size)
    names = parallel.mesh_dim_names or (parallel.name,) * len(shape)
    out = []
    for i, (width, name) in enumerate(zip(shape, names)):
        if width > 1:
            stride = 1
            for d in shape[i + 1 :]:
                stride *= d
            out.append(_communicator(parallel.name, name.lower(), width, min(width, max(1, node_size // stride))))
    return out


def _communicator(scheme: str, dim: str, ranks: int, local: int) -> nccl.Communicator:
    """What a mesh dimension's group runs: FSDP's shard group all-gathers and reduce-scatters (ring,
    NVLS); DDP, HSDP's replicate group and TP all-reduce too (the tree); a pipeline's group sends
    and receives to its two neighbours. torchtitan's step clips gradients: an all-reduce of the norm
    on every group, its pipeline's included."""
    every = scheme == "torchtitan"
    if dim == "pp":
        return nccl.Communicator(ranks, local, allreduce=every, p2p_peers=2, collectives=every)
    shard = dim in ("fsdp2", "dp", "dp_shard", "shard", "dp_shard_cp")
    return nccl.Communicator(ranks, local, allreduce=every or not shard)


def nccl_outside(
    parallel: Parallel,
    world_size: int,
    gpu: gpus.GpuSpec | None = None,
    settings: nccl.NcclSettings | None = None,
    node_size: int = NODE_SIZE,
) -> gpus.Estimate:
    """NCCL's device memory outside the caching allocator for one rank of ``parallel`` at
    ``world_size`` on ``gpu`` (None: H100-80GB): :func:`memfit.cuda.gpu.nccl_estimate` of its
    communicators (:func:`nccl_communicators`), under ``settings`` (None: NCCL's variables as this
    process's environment sets them, read here). A stated estimate, never in the allocator's figures."""
    s = nccl.settings_from_env() if settings is None else settings
    return gpus.nccl_estimate(nccl_communicators(parallel, world_size, node_size), gpu, s)


def rank_device_fit(
    prof: Profile, parallel: Parallel, world_size: int, capacity: int | None, spec: gpus.GpuSpec | None = None
) -> gpus.DeviceFit | None:
    """A rank's step against ``capacity`` (None: the simulated GPU's memory on fake CUDA):
    :func:`memfit.measure.profile.profile`'s answer, with NCCL's estimate for the rank's
    communicators (:func:`nccl_outside`) on CUDA in place of a single process's none."""
    fit = _device_fit(prof, capacity, spec)
    if fit is None or not any(e.name == "nccl" for e in fit.outside):
        return fit
    est = nccl_outside(parallel, world_size, fit.gpu)
    outside = tuple(est if e.name == "nccl" else e for e in fit.outside)
    return dataclasses.replace(fit, outside=outside)


def rank_device(fake: bool | str | Where) -> str:
    """The device of a fake rank for ``fake=`` (``True``/``"cpu"``: ``"cpu"``; ``"cuda"``:
    fake CUDA, switched on here or refused in one line)."""
    where = fake_device(fake)
    if where is Where.REAL:
        raise WorkloadError(
            f"fake={fake!r}: ranks are measured on the fake process group and fake tensors: give fake=True or 'cuda'"
        )
    return "cuda" if where is Where.FAKE_CUDA else "cpu"


def world_size_of(workload: Workload, world_size: int | None = None) -> int:
    """The world size a distributed workload runs at: ``world_size``, else its own; checked
    against its mesh."""
    parallel = _parallel_of(workload)
    n = parallel.world_size if world_size is None else world_size
    parallel.mesh(n)
    assert n is not None
    return n


def _parallel_of(workload: Workload) -> Parallel:
    if not isinstance(workload, Workload):
        raise WorkloadError(f"expected a memfit.Workload, got {type(workload).__name__}")
    if workload.parallel is None:
        raise WorkloadError(
            f"workload {workload.name!r} says nothing about how it is parallelized: give it "
            "parallel=memfit.Parallel(parallelize=...) (zoo llama: --size parallel=fsdp2, ddp, tp, fsdp2+tp or hsdp)"
        )
    return workload.parallel


class StartOverLimit(MemfitError):
    """:func:`profile_rank` with ``start_limit``: after the warm-up step, what the rank holds at
    its recorded step's start is over the limit (its peak is too), so that step was not run."""

    def __init__(self, rank: int, start_bytes: int, limit: int) -> None:
        super().__init__(f"rank {rank} starts its step holding {start_bytes} B, over {limit} B")
        self.rank, self.start_bytes, self.limit = rank, start_bytes, limit


def profile_rank(
    workload: Workload,
    group: FakeGroup | str,
    *,
    progress: Progress | None = None,
    start_limit: int | None = None,
    on_state: Callable[[RankState], None] | None = None,
) -> Profile:
    """One rank's profile of the distributed step: on the fake process group given by a
    :class:`FakeGroup` (fake tensors), or with :data:`CURRENT_GROUP` on the process group this
    process has initialised (real tensors: a real multi-process run's rank).

    ``start_limit``: bytes; when what the rank holds after the warm-up step (parameters,
    buffers, inputs, gradients kept, the optimizer's state: alive at the recorded step's start,
    counted as the recorder counts them there) is over it, :class:`StartOverLimit` is raised
    instead of running the recorded step (its peak is at least that start; half the profile).
    ``on_state``: called with the rank's :func:`rank_state`, read off this profile's own
    parallelized step before its warm-up (no ``parallelize`` of its own); what it raises
    stops the profile there."""
    report = progress or (lambda desc, done, total: None)
    with rank_sandbox(workload, group, progress=report) as box:
        world_size, rank = box_rank(box)
        fake = box.fake_mode is not None
        if on_state is not None:
            on_state(box_state(box))
        with Scope(named_model(box.model)) as scope:
            report(f"rank {rank} of {world_size}: warm-up step", 1, 3)
            # Real ranks: two warm-up steps, as DDP rebuilds its buckets in the second step's
            # forward (in gradient-ready order), once; the fake group keeps the first buckets.
            for _ in range(1 if fake else 2):
                run_step(box, scope, workload.loss_fn)
            if start_limit is not None:
                start = held_at_start(box, scope)
                if start > start_limit:
                    raise StartOverLimit(rank, start, start_limit)
            report(f"rank {rank} of {world_size}: recorded step", 2, 3)
            prof = record_rank(workload, box, scope)
        report("done", 3, 3)
    return prof


def with_recompute(
    workload: Workload, choices: dict[str, tuple[str, tuple[str, ...]]], cache_off: tuple[str, ...] | list[str] = ()
) -> Workload:
    """A copy of ``workload`` whose model (still on meta, unparallelized) recomputes ``choices``
    (``{module: (mode, save_ops)}``) with transformers' KV cache off in ``cache_off``
    (:func:`~memfit.recompute.checkpoint.apply_choices`): a plan applied before parallelizing."""
    model = copy_model(workload.model)
    apply_choices(model, choices, cache_off)
    return dataclasses.replace(workload, model=model, layers=None)  # fewer layers would not carry the plan


def named_model(model: nn.Module) -> nn.Module:
    """The module a rank's ledger names modules of: the model inside DistributedDataParallel's
    wrapper (which calls it every step), so that DDP ranks name modules as the unparallelized
    model does, as FSDP2's do (``fully_shard`` keeps the names), and a plan's names match."""
    from torch.nn.parallel import DistributedDataParallel

    from memfit.measure.step import OwnPasses

    # a pipeline rank's model pruned to its stages keeps the whole model's names
    return model.module if isinstance(model, (DistributedDataParallel, OwnPasses)) else model


@dataclass(frozen=True)
class RankState:
    """What one rank holds before its first step, from parallelizing alone (no step runs)."""

    resident_bytes: int
    """Its parameters, buffers and inputs, counted as the recorder counts them at a recorded
    step's start: a lower bound on that step's peak, with or without recompute (a step
    starts holding them, and a plan changes neither them nor the optimizer state)."""
    layout: tuple[tuple[str, tuple[int, ...], str], ...]
    """(name, local shape, dtype) of each parameter and buffer: ranks of equal layouts hold
    the same shards (with uneven FSDP2 shards, the last ranks' are shorter)."""


def rank_state(workload: Workload, group: FakeGroup) -> RankState:
    """One rank's :class:`RankState`: its step parallelized and materialised on fake tensors,
    about a tenth of the cost of its profile (no warm-up and no recorded step)."""
    with rank_sandbox(workload, group) as box:
        return box_state(box)


def box_state(box: Sandbox) -> RankState:
    """The :class:`RankState` of an open :func:`rank_sandbox` (a verifier's too) on which no step has run."""
    with Scope(box.model) as scope:
        resident = held_at_start(box, scope)  # no step yet: no gradients, no optimizer state
    named = [*box.model.named_parameters(), *box.model.named_buffers()]
    layout = tuple((name, tuple(_distributed.local_tensor(t).shape), str(t.dtype)) for name, t in named)
    return RankState(resident, layout)


def held_at_start(box: Sandbox, scope: Scope) -> int:
    """Bytes a recorded step on ``box`` would find alive at its start, as the recorder counts
    them there (each storage once; on CUDA as the allocator rounds it): the parameters,
    buffers, gradients, optimizer state and inputs the sandbox holds now. No step runs."""
    recorder = Recorder(scope, device=_model_device(box.model), fake=box.fake_mode is not None)
    try:
        _register_start(recorder, box)
        return sum(r.nbytes for r in recorder.records)
    finally:
        recorder.close()


def box_rank(box: Sandbox) -> tuple[int, int]:
    """(world size, rank) of the process group a :func:`rank_sandbox` runs on."""
    import torch.distributed as dist

    return dist.get_world_size(), dist.get_rank()


def record_rank(workload: Workload, box: Sandbox, scope: Scope) -> Profile:
    """The profile of one recorded step on an open :func:`rank_sandbox` (warmed up: the
    optimizer's state exists), its modules named as ``scope`` names them. On fake CUDA the
    ledger is replayed through the caching-allocator model (allocated and reserved peaks,
    ``device_fit`` against the simulated GPU)."""
    world_size, rank = box_rank(box)
    fake = box.fake_mode is not None
    device = _model_device(box.model)
    ledger, flops = record_step(box, scope, workload.loss_fn)
    modules = _module_stats(box.model, scope.names, scope.calls, ledger, flops, None)
    meta = {**workload.meta, "world_size": world_size, "rank": rank, "parallel": _parallel_of(workload).name}
    cuda = fake and device.type == "cuda"
    prof = Profile(
        ledger=ledger,
        modules=modules,
        device=f"fake:{device}" if fake else str(device),
        fake=fake,
        time_source="omitted",
        step_time_s=None,
        model_type=type(workload.model).__name__,
        step_flops=sum(flops.values()),
        meta=meta,
        cuda_memory=model_cuda_memory(ledger, allocator_settings_from_env()) if cuda else None,
    )
    prof.device_fit = rank_device_fit(prof, _parallel_of(workload), world_size, None)
    return prof


@contextmanager
def rank_sandbox(workload: Workload, group: FakeGroup | str, *, progress: Progress | None = None) -> Iterator[Sandbox]:
    """The parallelized step of one rank, open for as many steps as the caller runs: the
    process group (the fake one a :class:`FakeGroup` names, set up here and torn down on
    exit; or :data:`CURRENT_GROUP`), the rank's model (a copy of the workload's, from meta:
    a plan applied to the workload's model is carried into it), optimizer and inputs. No
    step has run yet."""
    parallel = _parallel_of(workload)
    report = progress or (lambda desc, done, total: None)
    fake = group != CURRENT_GROUP
    device = "cpu"
    with ExitStack() as stack:
        if fake:
            if not isinstance(group, FakeGroup):
                raise WorkloadError(f"group must be a FakeGroup or {CURRENT_GROUP!r}, got {group!r}")
            world_size, rank, device = group.world_size, group.rank, rank_device(group.device)
            stack.enter_context(_distributed.fake_process_group(rank, world_size))
            stack.enter_context(_distributed.real_device_meshes())
            stack.enter_context(_distributed.chunks_when_indexed())  # fake tensors: a rank's shard, not all
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise WorkloadError("group='current' measures on this process's process group, but none is initialised")
            world_size, rank = dist.get_world_size(), dist.get_rank()
        report(f"rank {rank} of {world_size}: parallelizing", 0, 3)
        mesh = _mesh(parallel, world_size, device)  # outside FakeTensorMode: its setup runs collectives on real tensors
        mode = torch_compat.new_fake_mode() if fake else None
        box = _parallel_sandbox(workload, parallel, mesh, mode)
        yield box


def without_backend_buffers(ledger: Ledger) -> Ledger:
    """A real rank's ledger without the communication backend's own copies: on gloo (CPU)
    a reduce-scatter or all-reduce works on a copy of its input that gloo allocates on its
    own thread, where no mode sees it being made; the recorder first meets it mid-step
    (split and copied out) and takes it for something alive before the step. NCCL keeps
    such buffers outside any tensor too; memfit's prediction leaves them out, like
    kernel workspaces of collectives. These are the blocks of :attr:`Category.OTHER`
    alive at the start that die within the step."""
    kept = [b for b in ledger.blocks if not (b.category is Category.OTHER and b.born == START_TICK and b.died is not None)]
    return Ledger(kept, ledger.ticks, ledger.spans, ledger.ops, ledger.host_peak_bytes, ledger.unmeasured_ops)


def _mesh(parallel: Parallel, world_size: int, device: str = "cpu") -> Any:
    """The rank's device mesh; on fake CUDA a CUDA mesh, so that FSDP2 and DDP put the
    rank's shards, buckets and collective buffers on ``cuda:0`` and use CUDA streams."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = parallel.mesh(world_size)
    return init_device_mesh(device, shape, mesh_dim_names=parallel.mesh_dim_names)


def mesh_device(mesh: Any) -> torch.device:
    """Where a rank's tensors go on ``mesh``: ``cuda:0`` on a CUDA mesh (fake CUDA has one
    device), else the CPU."""
    return torch.device("cuda", 0) if mesh.device_type == "cuda" else torch.device("cpu")


def _parallel_sandbox(workload: Workload, parallel: Parallel, mesh: Any, mode: Any) -> Sandbox:
    """This rank's model (parallelized, materialised), optimizer and inputs; fake under ``mode``."""
    # A copy: the user's model is left as it was (parallelizing changes modules' classes).
    # Every rank starts from meta, as a model too big to build does.
    model = copy_model(workload.model).to(device="meta")
    with mode if mode is not None else nullcontext(), _distributed.fake_ddp() if mode is not None else nullcontext():
        try:
            out = parallel.parallelize(model, mesh)
        except MemfitError:
            raise  # already says what is wrong (memfit's own parallelize functions)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise WorkloadError(f"{parallel.name}: parallelize(model, mesh) raised {type(exc).__name__}: {first}") from exc
        model = model if out is None else out
        if not isinstance(model, nn.Module):
            raise WorkloadError(f"{parallel.name}: parallelize returned {type(model).__name__}; expected the nn.Module to train")
        if mode is not None:
            # any DistributedDataParallel the parallelize built (memfit's ddp or the user's own)
            for module in model.modules():
                _fake_group_ddp(module, parallel.name)
        device = mesh_device(mesh)
        if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
            model.to_empty(device=device)
            if mode is None:
                _initialise(model)
        args, kwargs = split_inputs(workload.inputs)
        if device.type == "cuda":
            # together: inputs and targets sharing storage (labels=ids) stay one block on the device
            args, kwargs, targets = map_shared(lambda t: mode.from_tensor(t).to(device), (args, kwargs, workload.targets))
        else:
            on_rank = (lambda t: mode.from_tensor(t)) if mode is not None else (lambda t: t)
            args, kwargs, targets = tree_map(
                lambda t: on_rank(t) if isinstance(t, torch.Tensor) else t, (args, kwargs, workload.targets)
            )
        optimizer = (workload.optimizer or default_optimizer)([p for p in model.parameters() if p.requires_grad])
    return Sandbox(model, args, kwargs, optimizer, mode, targets=targets)


def _initialise(model: nn.Module) -> None:
    """Finite values for a real rank's parameters materialised from meta (``to_empty`` leaves
    whatever was in memory): memory does not depend on them, NaNs in a loss would only confuse."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            local = _distributed.local_tensor(t)
            if local.is_floating_point():
                local.copy_(torch.randn(local.shape, generator=gen, dtype=local.dtype) * 0.02)


# -- parallelize functions for common schemes -------------------------------------------------


def _submesh(mesh: Any, dims: str | tuple[str, ...] | None) -> Any:
    """The part of ``mesh`` a scheme runs over: its dimensions named ``dims`` (all: None)."""
    return mesh if dims is None else mesh[dims]


@dataclass(frozen=True)
class FSDP2:
    """A ``parallelize`` applying FSDP2 as torchtitan does: ``fully_shard`` on each of
    ``blocks(model)`` (the decoder layers) and on the root, with a MixedPrecisionPolicy.
    Plain settings, so that :func:`memfit.levers.rank_fit.fit_ranks` can weigh variants of
    them (``dataclasses.replace``) and say which ``fully_shard`` arguments to use."""

    blocks: Callable[[nn.Module], Sequence[nn.Module]]
    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    reshard_after_forward: bool = True
    """The blocks' ``reshard_after_forward`` (but the last :attr:`keep_last`)."""
    root_reshard_after_forward: bool | None = None
    """The root's; None: as :attr:`reshard_after_forward`."""
    keep_last: int = 0
    """The last this-many blocks get ``reshard_after_forward=False``: their parameters stay
    unsharded from their forward to their backward (no all-gather in backward), as
    torchtitan does for the last block, which backward all-gathers again at once."""
    mesh_dims: str | tuple[str, ...] | None = None
    """The mesh dimensions it shards over (FSDP+TP: the data-parallel one); a 2-D mesh of
    (replicate, shard) is HSDP. None: the whole mesh."""

    def __post_init__(self) -> None:
        if not callable(self.blocks):
            raise WorkloadError(f"fsdp2: blocks must be a function model -> blocks, got {type(self.blocks).__name__}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise WorkloadError(f"fsdp2: keep_last must be an integer >= 0, got {self.keep_last!r}")

    def block_reshards(self, n: int) -> list[bool]:
        """Each of ``n`` blocks' ``reshard_after_forward``, in order."""
        return [self.reshard_after_forward and i < n - self.keep_last for i in range(n)]

    @property
    def root_reshards(self) -> bool:
        return self.reshard_after_forward if self.root_reshard_after_forward is None else self.root_reshard_after_forward

    def __call__(self, model: nn.Module, mesh: Any) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = _submesh(mesh, self.mesh_dims)
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        blocks = list(self.blocks(model))
        for block, reshard in zip(blocks, self.block_reshards(len(blocks))):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=self.root_reshards)
        return model


def fsdp2(
    blocks: Callable[[nn.Module], Sequence[nn.Module]],
    *,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    root_reshard_after_forward: bool | None = None,
    keep_last: int = 0,
    mesh_dims: str | tuple[str, ...] | None = None,
) -> FSDP2:
    """A ``parallelize`` applying FSDP2 as torchtitan does (see :class:`FSDP2`); ``mesh_dims``:
    the mesh dimensions it shards over (FSDP+TP: the data-parallel one); a 2-D mesh of
    (replicate, shard) is HSDP."""
    return FSDP2(blocks, param_dtype, reduce_dtype, reshard_after_forward, root_reshard_after_forward, keep_last, mesh_dims)


def ddp(model: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    """A ``parallelize`` wrapping the model in DistributedDataParallel, materialised first
    (its buckets are made from the parameters it is built over). On the fake process group
    the rank's sandbox makes it runnable, as any DDP a ``parallelize`` builds (see
    :func:`_fake_group_ddp`)."""
    from torch.nn.parallel import DistributedDataParallel

    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=mesh_device(mesh))
        if not torch_compat.is_fake(next(model.parameters(), torch.empty(0))):
            _initialise(model)
    return DistributedDataParallel(model, process_group=mesh.get_group(), **kwargs)


def _fake_group_ddp(module: nn.Module, name: str) -> None:
    """Make a DistributedDataParallel built on the fake process group runnable on fake tensors,
    whoever built it: its construction's cross-rank checks were skipped
    (:func:`_distributed.fake_ddp`, around the ``parallelize``), its reducer keeps its first
    buckets, and, unless the user registered a comm hook of their own, one that all-reduces
    each bucket in place (the fake group's futures carry nothing the reducer can read). The
    buckets, and gradients as their views with ``gradient_as_bucket_view``, are DDP's own."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return
    if any(t.device.type == "meta" for t in module.parameters()):
        raise WorkloadError(
            f"{name}: DistributedDataParallel was built over parameters on the meta device: "
            "materialise the model first (model.to_empty(device='cpu'), as memfit.measure.distributed.ddp does)"
        )
    dynamic = [k for k in ("find_unused_parameters", "static_graph") if getattr(module, k, False)]
    if dynamic:
        # the reducer reads which parameters the step used (a tensor's value: .item()), which
        # fake tensors do not have; a plan made without the option trains bitwise alike with it
        raise WorkloadError(
            f"{name}: DDP's {dynamic[0]}=True is not measured on the fake process group (DDP's reducer reads which "
            "parameters were used, a value fake tensors do not have): measure and plan with it off"
        )
    if not module._comm_hooks:
        module.register_comm_hook(None, _distributed.ddp_comm_hook)
    _distributed.keep_ddp_buckets(module)
    if any(p.device.type == "cuda" for p in module.parameters()):
        _distributed.no_runtime_stats(module)  # a CPU build of torch has no CUDA timer for DDP's logger


def tensor_parallel(
    plan: Callable[[nn.Module, int], dict[str, Any]], *, mesh_dims: str | None = None
) -> Callable[[nn.Module, Any], nn.Module]:
    """A ``parallelize`` applying tensor parallelism: ``parallelize_module(model, mesh,
    plan(model, tp))`` with ``plan`` naming each submodule's ColwiseParallel / RowwiseParallel
    style for a tensor-parallel degree ``tp`` (the size of the mesh, or of its ``mesh_dims``
    dimension). Parameters become DTensors whose local shards are what a rank holds."""
    from torch.distributed.tensor.parallel import parallelize_module

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        mesh = _submesh(mesh, mesh_dims)
        return parallelize_module(model, mesh, plan(model, mesh.size()))

    return parallelize


def compose(*parallelizes: Callable[[nn.Module, Any], nn.Module | None]) -> Callable[[nn.Module, Any], nn.Module]:
    """One ``parallelize`` applying each of ``parallelizes`` in turn on the same mesh (tensor
    parallel, then FSDP2 over the data-parallel dimension: FSDP+TP, as torchtitan orders them)."""

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        for fn in parallelizes:
            out = fn(model, mesh)
            model = model if out is None else out
        return model

    return parallelize
