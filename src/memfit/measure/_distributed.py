"""The corners of ``torch.distributed`` that memfit's per-rank measurement leans on, in one place.

Private or fragile pieces only live here: the fake process group (from
``torch.testing._internal``), DTensor's local shard, device meshes made on fake tensors
(``torch._subclasses``' ``unset_fake_temporarily``), the monkey-patch of
``UntypedStorage.resize_`` (FSDP2 frees and re-allocates its unsharded parameters with it,
which no dispatch mode sees), FSDP2's chunking of a parameter into its shards, and DDP's
private construction checks.
``tests/test_distributed.py`` exercises each (the chunking: ``tests/test_min_world_size.py``),
so a torch release that moves them fails there first.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from memfit.measure.ledger import Category

__all__ = [
    "dtensor_types",
    "local_tensor",
    "ALIAS_OPS",
    "COLLECTIVE_ROLES",
    "fake_process_group",
    "real_device_meshes",
    "forget_meshes",
    "tracking_resize",
    "chunks_when_indexed",
    "fake_ddp",
    "ddp_comm_hook",
    "keep_ddp_buckets",
    "no_runtime_stats",
    "static_pipeline_stages",
    "fake_pipeline_step",
]


def dtensor_types() -> tuple[type, ...]:
    """Tensor subclasses whose memory is another tensor's: DTensor (its local shard) once
    torch.distributed.tensor is imported, and the AsyncCollectiveTensor a functional
    collective returns on real ranks (the collective's output it wraps: tensor parallelism's
    all-reduces and all-gathers). None exists before its module is imported (importing
    DTensor costs a second, which memfit does not spend on steps that have none). Their
    wrappers' own storages report a size but hold nothing."""
    global _FOUND
    if len(_FOUND) == 2:  # both imported: asked per tensor (400k times in an 8B plan), looked up once
        return _FOUND
    out = []
    for module, name in (("torch.distributed.tensor", "DTensor"), (_FUNCOL, "AsyncCollectiveTensor")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            out.append(cls)
    _FOUND = tuple(out)
    return _FOUND


_FUNCOL = "torch.distributed._functional_collectives"
_FOUND: tuple[type, ...] = ()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s memory on this rank: a DTensor's local shard (its wrapper's
    storage reports the global size: world-size times too much under FSDP), an
    AsyncCollectiveTensor's result, else ``t``."""
    if type(t) is not torch.Tensor:
        types = dtensor_types()
        if types and isinstance(t, types):
            inner = getattr(t, "_local_tensor", None)
            return local_tensor(inner if inner is not None else t.elem)  # type: ignore[attr-defined]
    return t


ALIAS_OPS = frozenset({"_c10d_functional::wait_tensor"})
"""Ops whose output is their input on a real rank (waiting on a functional collective hands
back the tensor it was given) but a new tensor on fake ones (tracing, torch waits at once
and the fake kernel makes its output afresh): the output is the input's memory."""


# What a block is on a distributed step, told by the op that makes it (FSDP2's custom ops:
# their outputs) or communicates through it (c10d's collectives as a dispatch mode sees
# them, which write into their arguments: all of them). Blocks the step made and nothing
# else claimed get the category; FSDP's unsharded gradients, the inputs of chunk_cat,
# stay temporaries.
COLLECTIVE_ROLES: dict[str, tuple[Category, bool]] = {
    "fsdp::all_gather_copy_in": (Category.ALL_GATHER, False),
    "c10d::_allgather_base_": (Category.ALL_GATHER, True),
    "c10d::allgather_into_tensor_coalesced_": (Category.ALL_GATHER, True),
    "fsdp::chunk_cat": (Category.REDUCE_SCATTER, False),
    "c10d::_reduce_scatter_base_": (Category.REDUCE_SCATTER, True),
    "c10d::reduce_scatter_tensor_coalesced_": (Category.REDUCE_SCATTER, True),
    "c10d::allreduce_": (Category.DDP_BUCKET, True),
}
"""Op -> (category, whether its arguments too, not only its outputs)."""


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[Any]:
    """The default process group as rank ``rank`` of ``world_size`` on torch's fake backend:
    collectives return at once and move no data, so one process runs one rank's step.
    Refuses to replace a process group already initialised."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    forget_meshes()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribute plans. They are keyed by
    device meshes, and two meshes of the same shape are equal whatever rank made them, but
    each holds its rank's process-group names: rank 2 of a (dp, tp) mesh measured after
    rank 0 in this process would all-gather over rank 0's tp group (gone with its process
    group). One real rank per process never meets this."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute, debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)  # python and C++ fast-path caches
    if clear is not None:
        clear()
    else:  # torch 2.6: one Python cache, an lru_cache per thread behind LocalLRUCache
        from torch.distributed.tensor import DTensor

        cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache", None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    for name in ("clear_redistribute_planner_cache",):
        fn = getattr(_redistribute, name, None)
        if fn is not None:
            fn()
    gen = getattr(_redistribute, "_gen_transform_infos", None)
    if gen is not None and hasattr(gen, "cache_clear"):
        gen.cache_clear()


@contextmanager
def real_device_meshes() -> Iterator[None]:
    """DeviceMeshes made inside FakeTensorMode built on real tensors: FSDP2 over a
    tensor-parallel model joins the dp and tp meshes into one as it shards each parameter,
    and a new mesh finds this rank's coordinates with ``nonzero`` on its (small) tensor of
    ranks, which a fake tensor cannot answer. A mesh is bookkeeping of ranks, not the
    step's memory."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextmanager
def tracking_resize(on_resize: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``on_resize(storage)`` after every ``UntypedStorage.resize_`` inside (FSDP2
    frees its unsharded parameters and all-gather outputs with ``resize_(0)`` and brings
    them back with ``resize_(n)``: the Python storage object, which owns nothing a
    dispatch mode sees, lives on). torch's MemTracker patches it the same way."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        on_resize(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


class _Chunks(Sequence):
    """``torch.chunk(tensor, n, dim)`` padded to ``n`` with empty tensors, as FSDP2's
    ``_chunk_with_empty`` returns it, each chunk made when indexed: the same view (torch.chunk
    splits into pieces of ``ceil(size / n)``, the last shorter, fewer when they run out)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self.step = -(-size // num_chunks)
        self.made = -(-size // self.step)  # chunks torch.chunk returns
        self._first: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        if i < 0:
            i += self.num_chunks
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        if i >= self.made:
            return self[0].new_empty(0)
        if i == 0 and self._first is not None:
            return self._first
        start = i * self.step
        out = self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))
        if i == 0:
            self._first = out
        return out


def _fsdp_param_module() -> Any:
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:  # torch without FSDP2 (or moved): chunks are made as torch makes them
        return None
    return _fsdp_param if callable(getattr(_fsdp_param, "_chunk_with_empty", None)) else None


@contextmanager
def chunks_when_indexed() -> Iterator[None]:
    """FSDP2 makes a rank's shard of each parameter by chunking the whole of it into
    world-size pieces and keeping its own (and the first's size: the padded one). On fake
    tensors every piece is a FakeTensor built in Python: at 64 ranks a Llama-3-70B
    ``fully_shard`` made 93k of them (8 of a profile's 30 CPU seconds), growing with the
    world size. Within this context only the pieces FSDP2 indexes are made, as the same views
    (``narrow``: the offset, sizes and strides torch.chunk gives them; tested against it)."""
    module = _fsdp_param_module()
    if module is None:
        yield
        return
    original = module._chunk_with_empty

    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
        if tensor.size(dim) == 0:
            return original(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)

    module._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        module._chunk_with_empty = original


@contextmanager
def fake_ddp() -> Iterator[None]:
    """DistributedDataParallel constructible and runnable on the fake process group under
    FakeTensorMode: its construction broadcasts and compares parameter shapes through
    private helpers that read tensor values (skipped: one process has nothing to compare).
    The reducer's default all-reduce returns the fake group's empty future; a comm hook
    that all-reduces the bucket and returns it is registered by :func:`ddp_comm_hook`."""
    from torch.nn.parallel import distributed as ddp_mod

    saved = {name: getattr(ddp_mod, name) for name in ("_verify_param_shape_across_processes", "_sync_module_states")}
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None  # type: ignore[attr-defined]
    ddp_mod._sync_module_states = lambda *a, **k: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ddp_mod, name, fn)


class _KeptBuckets:
    """DDP's reducer with its one bucket rebuild (second step) turned down: the rebuild
    agrees bucket indices across ranks by reading a tensor the fake group never filled.
    The buckets stay in construction order (the same bytes in all, grouped otherwise)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def keep_ddp_buckets(ddp: Any) -> None:
    ddp.reducer = _KeptBuckets(ddp.reducer)


class _NoRuntimeStats:
    """DDP's logger without its runtime statistics: on CUDA they are timed by a CUDA timer
    the reducer takes from a registry that a CPU build of torch leaves empty (fake CUDA), and
    the logger asserts it exists. Timing fake kernels would measure nothing anyway."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def set_runtime_stats_and_log(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def no_runtime_stats(ddp: Any) -> None:
    ddp.logger = _NoRuntimeStats(ddp.logger)


def ddp_comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses any annotation but its own
    """A DDP comm hook that all-reduces the bucket's buffer (in place, as the default one
    does) and returns a completed future holding it: the fake group's own future holds None,
    which the reducer cannot read."""
    import torch.distributed as dist

    buf = bucket.buffer()
    buf.div_(dist.get_world_size())  # the default hook's average, in place
    dist.all_reduce(buf)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def static_pipeline_stages(schedule: Any) -> None:
    """A ``torch.distributed.pipelining`` schedule on the fake process group: its first step
    opens with a vote (each stage sends the product of the stages' "my metadata is complete"
    flags down the pipeline and the answer back up, then reads it with ``.item()``), which on the
    fake group receives nothing and reads a fake tensor. memfit gives every stage complete
    metadata, so every real rank votes "static": that answer is set here, on this schedule
    only, and a stage whose metadata is incomplete is refused in one line."""
    import types

    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # torch 2.6 and 2.11: their schedules hold no such vote, nothing to answer
        return

    def warmup_p2p(self: Any, stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} has incomplete input/output metadata")
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = types.MethodType(warmup_p2p, schedule)


class _HeldWork:
    """A fake group's point-to-point work that holds its tensors, as gloo's send and receive
    works do (``ProcessGroupGloo::SendWork`` keeps the tensor) until the work object is
    dropped, waited or not: a pipeline schedule that keeps the works of its last sends in a
    list keeps the activations it sent alive that long. The fake group's works hold nothing."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextmanager
def fake_pipeline_step() -> Iterator[None]:
    """Around a ``torch.distributed.pipelining`` schedule's step on the fake group: the works it
    gets for its sends and receives (its ``_batch_p2p``) hold their tensors (:class:`_HeldWork`);
    and its first step's RNG fork (around shape inference, which memfit's static stages skip)
    forks the CPU generator only: fake CUDA has no device generator to read, and a generator's
    state is no device memory."""
    from torch.distributed.pipelining import schedules

    original, fork_rng = schedules._batch_p2p, torch.random.fork_rng

    def batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        works = original(p2p_ops, desc)
        if len(works) == len(p2p_ops):
            return [_HeldWork(w, [p.tensor]) for w, p in zip(works, p2p_ops)]
        return [_HeldWork(w, [p.tensor for p in p2p_ops]) for w in works]

    def cpu_fork_rng(devices: Any = None, enabled: bool = True, *args: Any, device_type: Any = None, **kwargs: Any) -> Any:
        return fork_rng([], enabled, *args, device_type="cuda", **kwargs)

    schedules._batch_p2p = batch_p2p
    torch.random.fork_rng = cpu_fork_rng  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = original
        torch.random.fork_rng = fork_rng  # type: ignore[assignment]
