"""The memory of a ``torch.compile``d training step: measured as the compiled step runs.

What a compiled step allocates is decided in three places, none of which memfit's recorder
(a dispatch mode) can watch without changing it: dynamo's graphs (a mode active while a
compiled function runs is a reason to recompile or graph-break), AOTAutograd's min-cut
partitioner (which tensors the forward graph returns for backward; ``torch._functorch.config.
activation_memory_budget`` trades them for recompute) and inductor's generated wrapper (fused
kernels, ``empty_strided`` buffers it reuses and ``del``s). So memfit runs the compiled step
itself, on real tensors, and reads every allocation and free of c10's CPU allocator from
torch's profiler (``profile_memory=True``: the allocator reports each one, with its size and
address, whoever calls it; inductor's ``empty_strided_cpu`` included). The profiler adds no
mode and no guard: the recorded step runs the graphs the warm-up compiled, which this module
checks (a compile during the recorded step is a fallback, labelled).

The figure is the allocator's live bytes: their peak over the step's start is the step's peak,
as memfit's eager profile reports it. On fake CUDA, the same allocation sequence is replayed
through the caching allocator model (:mod:`memfit.cuda.allocator`), which adds CUDA's rounding
and segments; what it cannot add is what depends on the backend (see ``docs/benchmarks/compile.md``):
inductor's CPU (C++/OpenMP) code fuses differently from its Triton code. Attention is CUDA's: a
fake-CUDA step is compiled with the kernel a CUDA build picks
(:func:`memfit.cuda.fake.host_attention_as_cuda`).

A fake step (fake CPU or fake CUDA) is compiled and run on fake host tensors, inductor's kernels
not run (:mod:`memfit.compat.inductor_fake`); what kernels allocate inside themselves is counted as
memfit's eager fake profile counts it (:class:`_Scratch`). Where this torch cannot do that, a fake
CPU step falls back to the eager profile, labelled as such.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.compat import inductor_fake, torch_compat, triton_fake
from memfit.cuda import fake as cuda_fake
from memfit.cuda.allocator import Alloc, AllocatorSettings, Free, replay
from memfit.errors import BudgetError, MemfitError
from memfit.measure import workspace
from memfit.measure.checked import Step, checked_step
from memfit.measure.ledger import Phase
from memfit.measure.recorder import kernel_scratch
from memfit.measure.sandbox import step_sandbox
from memfit.measure.step import StepOptions
from memfit.units import parse_bytes
from memfit.workload import Where

__all__ = [
    "unavailable_on_fake",
    "CompiledProfile",
    "profile_compiled",
    "profile_compiled_step",
    "budget_sweep",
    "fit_memory_budget",
    "fit_memory_budget_step",
    "BACKENDS",
    "DEFAULT_SWEEP",
]

BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")
"""Backends whose step memfit measures: inductor (fusion, buffer reuse), and the two AOTAutograd
backends without code generation (the same partitioner; ``aot_eager`` with its default one)."""

DEFAULT_SWEEP = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
"""``activation_memory_budget`` values :func:`fit_memory_budget` tries, most saved first."""


@dataclass(frozen=True)
class CompiledProfile:
    """One compiled training step's memory (or the eager step's, when :attr:`fallback` says why)."""

    backend: str
    memory_budget: float
    """``torch._functorch.config.activation_memory_budget`` the step was compiled with (1.0: torch's min-cut)."""
    start_bytes: int
    """Alive when the step starts: parameters, buffers, optimizer state, inputs and targets."""
    step_peak_bytes: int
    """Peak over the start: what the step's own allocations add at their highest."""
    saved_bytes: int
    """Alive when the forward and the loss are done, over the start: what the compiled forward
    left for backward (saved tensors), with the output and the loss."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Each phase's peak over the start (``forward``, ``backward``, ``optimizer``)."""
    graphs: int = 0
    """Graphs dynamo compiled for the step (1 without graph breaks)."""
    graph_breaks: int = 0
    compile_cpu_s: float = 0.0
    """CPU seconds (this process, user+system) of the warm-up step, which compiles."""
    fallback: str | None = None
    """Why these are the eager step's figures; None for a compiled step's."""
    allocated_peak_bytes: int | None = None
    """On fake CUDA: the caching allocator model's allocated peak (start included)."""
    reserved_peak_bytes: int | None = None
    """On fake CUDA: the model's reserved peak."""
    events: tuple[tuple[int, int], ...] = ()
    """The step's allocations and frees in order: (key, +bytes) and (key, -bytes)."""
    unmeasured_ops: int = 0
    """A fake step: op calls whose kernel's own scratch is not in the figures (no measurement
    of its kind, too large to run on zeros, or on fake CUDA no estimate), as the eager profile's
    :attr:`~memfit.measure.ledger.Ledger.unmeasured_ops`."""
    code: str = ""
    """The code inductor generated for the step: ``"triton"`` (its CUDA code, on fake CUDA with
    Triton installed: :mod:`memfit.compat.triton_fake`), ``"c++"`` (its CPU code, the host's, which
    a fake-CUDA step without Triton runs too); ``""`` for the backends that generate none."""

    @property
    def peak_bytes(self) -> int:
        return self.start_bytes + self.step_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the fields without the event list, with the label and peak."""
        out = {k: v for k, v in asdict(self).items() if k != "events"}
        return {**out, "peak_bytes": self.peak_bytes, "label": self.label}

    @property
    def label(self) -> str:
        """What the figures are, in a few words (for a report's heading)."""
        if self.fallback:
            return f"eager step (not compiled: {self.fallback})"
        return f"compiled step ({self.backend}{self.code_words}, activation_memory_budget={self.memory_budget:g})"

    @property
    def code_words(self) -> str:
        """``", Triton code"``, ``", C++ code"`` or nothing: which code inductor generated, for a label."""
        return {"triton": ", Triton code", "c++": ", C++ code"}.get(self.code, "")


def unavailable_on_fake() -> str | None:
    """Why a compiled step cannot be run on fake tensors with this torch (None: it can)."""
    return inductor_fake.unavailable()


def _fresh_backend(name: str) -> Callable[..., Any]:
    """A backend object no compiled code has seen: dynamo guards each cached graph on its
    backend, so memfit's compiles neither reuse the user's graphs (compiled with another memory
    budget, say) nor are reused by the user's later ``torch.compile``."""
    if name not in BACKENDS:
        raise MemfitError(f"backend {name!r} is not one memfit measures: use one of {', '.join(BACKENDS)}")
    if name == "inductor":
        inner: Any = torch._TorchCompileInductorWrapper(None, None, None)
    else:
        inner = torch._dynamo.lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        return inner(gm, example_inputs)

    return backend


@contextlib.contextmanager
def _configured(memory_budget: float, no_caches: bool) -> Iterator[None]:
    """torch's configs as a compile at ``memory_budget`` needs them, restored on the way out
    (``config.patch`` puts back exactly what was there). The recompile limit is raised: each
    budget memfit tries is a compile of the same code. ``no_caches``: the compile caches off
    (the code generated is the same, compiled afresh), for two reasons. With fake CUDA loaded,
    torch believes a GPU is there, and the caches' keys read properties of it that the fake one
    lacks. On fake tensors the kernels are not run, and no graph compiled without them may be
    kept for a compile of the user's."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    limits = {k: 10**6 for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit") if hasattr(dynamo_config, k)}
    caches = {"fx_graph_cache": False, "fx_graph_remote_cache": False} if no_caches else {}
    autograd_cache = {"enable_autograd_cache": False} if no_caches else {}
    with (
        functorch_config.patch(activation_memory_budget=memory_budget, **autograd_cache),
        dynamo_config.patch(**limits),
        inductor_config.patch(**caches),
    ):
        yield


def _storages(values: Any) -> dict[int, Any]:
    """Distinct storages among the tensors in ``values`` (nested containers): key -> storage."""
    from torch._subclasses.fake_tensor import FakeTensor

    out: dict[int, Any] = {}
    for t in torch.utils._pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            # a real storage by its address; a fake one (no address) by the storage object,
            # which torch keeps one of per live storage
            out.setdefault(id(s) if isinstance(t, FakeTensor) else s.data_ptr(), s)
    return out


def _start_storages(box: Any) -> dict[int, Any]:
    state = [list(s.values()) for s in box.optimizer.state.values()]
    grads = [p.grad for p in box.model.parameters() if p.grad is not None]
    return _storages([list(box.model.parameters()), list(box.model.buffers()), grads, state, box.args, box.kwargs, box.targets])


def _sizes(storages: dict[int, Any]) -> dict[int, int]:
    return {k: s.nbytes() for k, s in storages.items()}


def _allocations(prof: Any) -> list[tuple[int, int, int]]:
    """(time ns, address, +/- bytes) of every CPU allocator event the profiler saw, in order."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                out.append((node.start_time_ns, f.ptr, f.alloc_size))
        stack.extend(node.children)
    out.sort(key=lambda e: e[0])
    return out


def _phase_marks(prof: Any) -> list[tuple[int, str]]:
    """(start ns, phase) of the markers :func:`_recorded_step` opened."""
    marks = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name.startswith("memfit::phase::"):
            marks.append((node.start_time_ns, node.name.rsplit("::", 1)[1]))
        stack.extend(node.children)
    return sorted(marks)


@dataclass
class _Recorded:
    events: list[tuple[int, int, int]]
    marks: list[tuple[int, str]]
    unmeasured: int = 0
    """Fake steps: op calls whose kernel's scratch has no figure (:class:`_Scratch`)."""


def _recorded_step(box: Any, loss_fn: Any) -> _Recorded:
    """One step under torch's profiler with memory on; a marker at each phase's start."""
    from torch.profiler import ProfilerActivity, profile

    open_marks: list[Any] = []

    def on_phase(phase: Phase) -> None:
        while open_marks:
            torch.ops.profiler._record_function_exit._RecordFunction(open_marks.pop())
        open_marks.append(torch.ops.profiler._record_function_enter_new(f"memfit::phase::{phase.value}", None))

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        box.step(loss_fn, on_phase)
        while open_marks:
            torch.ops.profiler._record_function_exit._RecordFunction(open_marks.pop())
    return _Recorded(_allocations(prof), _phase_marks(prof))


class _Scratch:
    """What a kernel allocates for itself and frees before it returns, for each op a fake
    compiled step runs (inductor's extern and fallback kernels, the eager optimizer), by the
    eager recorder's rule (:func:`memfit.measure.recorder.kernel_scratch`, which says where
    and why a compiled step's arguments differ):

    - a fake CPU step: the figure a real step of this process measured for the op's kind
      (:data:`memfit.measure.workspace.TABLE`), else the op run once on real zeros of its
      shapes (:func:`memfit.measure.workspace.probe`: oneDNN's convolution backward scratch);
    - a fake CUDA step (compiled on host tensors, so the host's figures are not CUDA's): the
      estimate from torch's sources for SDPA's backward kernels, nothing for the rest.

    An op left without a figure is counted in :attr:`unmeasured`."""

    def __init__(self, fake_cuda: bool) -> None:
        self.fake_cuda = fake_cuda
        self.unmeasured = 0

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        known, _ = kernel_scratch(
            func,
            args,
            kwargs,
            # compiled on host tensors: their signatures would find the host's figures, not CUDA's
            table=None if self.fake_cuda else workspace.TABLE,
            attention=self.fake_cuda,
            probe=not self.fake_cuda,
            # this dispatch mode is off inside an op: what bitsandbytes' Python kernels run is not seen
            inside=False,
            as_cuda=False,
            tensorless=True,  # the wrapper's empty_strided and other factories: nothing but their output
        )
        if known is None:
            self.unmeasured += 1
        return known or 0


class _FakeAllocations(TorchDispatchMode):
    """Every storage a fake step makes, and its end, in order: the fake counterpart of the
    allocator events the profiler reports on real tensors. With ``ignore_compile_internals``
    dynamo leaves the mode off while it compiles and on while the compiled code runs, so it
    sees what inductor's wrapper runs (its buffers, extern kernels, views), not the eager ops
    a dispatch mode would otherwise make dynamo fall back to."""

    def __init__(self, start: dict[int, Any], scratch: _Scratch) -> None:
        super().__init__()
        self.events: list[tuple[float, int, int]] = []
        self.scratch = scratch
        self.live = {k: s.nbytes() for k, s in start.items()}
        self.open = True
        for k, st in start.items():  # a start storage freed in the step (a gradient set to None) is an event too
            weakref.finalize(st, self._end, k)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def mark(self) -> float:
        """A time between the last event and the next: where a phase starts."""
        return len(self.events) + 0.5

    def _end(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None and self.open:
            self.events.append((len(self.events) + 1, key, -nbytes))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        scratch = self.scratch(func, args, kwargs)
        if scratch:  # alive across the op's outputs, as the eager ledger's workspace block
            held = -3 - len(self.events)  # below the cuBLAS workspaces' keys; no storage's id
            self.events.append((len(self.events) + 1, held, scratch))
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = id(s)
                if key not in self.live:
                    self.live[key] = s.nbytes()
                    self.events.append((len(self.events) + 1, key, self.live[key]))
                    weakref.finalize(s, self._end, key)
        if scratch:
            self.events.append((len(self.events) + 1, held, -scratch))
        return out


def _fake_recorded_step(box: Any, loss_fn: Any, start: dict[int, Any], fake_cuda: bool) -> _Recorded:
    """One step of a fake sandbox, its storages' births and ends in order (times are their
    order), kernels' scratch among them, and a mark at each phase's start."""
    marks: list[tuple[float, str]] = []
    seen = _FakeAllocations(start, _Scratch(fake_cuda))
    with seen:
        box.step(loss_fn, lambda phase: marks.append((seen.mark(), phase.value)))
    seen.open = False  # what the sandbox frees when it closes is not the step's
    return _Recorded(list(seen.events), marks, seen.scratch.unmeasured)  # type: ignore[arg-type]


def _timeline(rec: _Recorded) -> tuple[int, int, dict[str, int]]:
    """Step peak over the start, bytes alive over the start when backward begins, and each phase's peak."""
    live = peak = 0
    saved = None
    phases: dict[str, int] = {}
    marks = list(rec.marks)
    phase = "forward"
    for t, _, nbytes in rec.events:
        while marks and marks[0][0] <= t:
            phase = marks.pop(0)[1]
            if phase == Phase.BACKWARD.value and saved is None:
                saved = live
        live += nbytes
        peak = max(peak, live)
        phases[phase] = max(phases.get(phase, 0), live)
    return peak, live if saved is None else saved, phases


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _cublas_workspaces() -> dict[int, int]:
    """The cuBLAS workspaces a CUDA step holds from its first matmul on (the host's step has
    none): one for the forward's thread and one for autograd's CUDA thread, as memfit's eager
    recorder counts them, at the size the simulated GPU's capability gives. Keyed by addresses
    no host allocation has (negative). Assumed: the step runs a matmul forward and backward."""
    from memfit.cuda.gpu import cublas_workspace_bytes

    size = cublas_workspace_bytes(tuple(torch.cuda.get_device_capability()))  # type: ignore[arg-type]
    return {-1: size, -2: size}


def _cuda_replay(start: dict[int, int], events: list[tuple[int, int, int]], settings: AllocatorSettings) -> tuple[int, int, list]:
    """The step's allocations through the caching allocator model: the start storages first,
    then each allocation and free in order (a free's address names the newest allocation there)."""
    seq: list[Alloc | Free] = []
    at: dict[int, int] = {}
    for n, (ptr, nbytes) in enumerate(start.items()):
        seq.append(Alloc(n, nbytes, 0))
        at[ptr] = n
    ids = len(seq)
    keyed: list[tuple[int, int]] = []
    for _, ptr, nbytes in events:
        if nbytes > 0:
            at[ptr] = ids
            seq.append(Alloc(ids, nbytes, 0))
            keyed.append((ids, nbytes))
            ids += 1
        elif ptr in at:  # a free of something allocated before the profiler started is not the step's
            seq.append(Free(at.pop(ptr)))
            keyed.append((seq[-1].id, nbytes))
    stats = replay(seq, settings)
    return stats.allocated_peak_bytes, stats.reserved_peak_bytes, keyed


def profile_compiled_step(
    step: Step,
    *,
    backend: str = "inductor",
    memory_budget: float | None = None,
    allocator: AllocatorSettings | None = None,
) -> CompiledProfile:
    """The memory of ``step`` with its model under ``torch.compile(backend=...)``, compiled at
    ``memory_budget`` (``activation_memory_budget``; None: the value torch's config holds).

    A real step runs on the user's own model and optimizer, restored afterwards (the sandbox of
    a real profile). A fake one (fake CPU or fake CUDA) is compiled and run on fake host
    tensors, inductor's kernels not run (:mod:`memfit.compat.inductor_fake`): the allocations
    are its wrapper's, with no memory used. On fake CUDA they are then replayed through the
    caching allocator model (``allocator`` settings). Where this torch cannot run compiled
    code on fake tensors, a fake-CUDA step runs on the host at its full size and a fake CPU
    step's eager profile is returned, labelled."""
    import torch._functorch.config as functorch_config

    budget = float(functorch_config.activation_memory_budget if memory_budget is None else memory_budget)
    if not 0.0 <= budget <= 1.0:
        raise BudgetError(f"activation_memory_budget {budget!r} is out of range: use a fraction from 0 to 1")
    compile_fn = _fresh_backend(backend)
    why = inductor_fake.unavailable() if step.fake else None
    if step.fake and not step.fake_cuda and why:
        return _eager_fallback(step, backend, budget, f"fake host tensors cannot run compiled code here: {why}")
    if step.fake_cuda or cuda_fake.active():
        # fake CUDA loaded in this process (MEMFIT_FAKE_CUDA=1) breaks any host compile's cache key,
        # a fake CPU or real CPU step's too
        torch_compat.host_compile_system_info()
    # inductor's CUDA code where it can be generated (fake CUDA tensors, Triton installed); else the
    # step runs on the host, as fake host tensors where it can, compiled as the host's code
    triton = backend == "inductor" and step.fake_cuda and why is None and triton_fake.unavailable() is None
    run_on = Where.FAKE if step.fake and why is None else Where.REAL
    host = step.on(run_on) if step.fake_cuda and not triton else step
    if step.fake_cuda and not triton and step.options.foreach is None:
        # CUDA's optimizers default to foreach (one kernel over every tensor, with temporaries
        # over all of them); the host's to a loop per tensor
        host = host.on(run_on, replace(step.options, foreach=True))
    ran = _run_compiled(host, step.loss_fn, compile_fn, budget, step.fake_cuda, triton)
    if isinstance(ran, str):
        return _eager_fallback(step, backend, budget, ran)
    start, rec, graphs, breaks, compile_s = ran
    peak, saved, phases = _timeline(rec)
    out = CompiledProfile(
        backend=backend,
        memory_budget=budget,
        start_bytes=sum(start.values()),
        step_peak_bytes=peak,
        saved_bytes=saved,
        phase_peaks=phases,
        graphs=graphs,
        graph_breaks=breaks,
        compile_cpu_s=compile_s,
        unmeasured_ops=rec.unmeasured,
        code=("triton" if triton else "c++") if backend == "inductor" else "",
    )
    if step.fake_cuda:
        allocated, reserved, keyed = _cuda_replay({**start, **_cublas_workspaces()}, rec.events, allocator or AllocatorSettings())
        out = replace(out, allocated_peak_bytes=allocated, reserved_peak_bytes=reserved, events=tuple(keyed))
    return out


def _run_compiled(
    step: Step, loss_fn: Any, compile_fn: Callable[..., Any], budget: float, fake_cuda: bool, triton: bool = False
) -> tuple[dict[int, int], _Recorded, int, int, float] | str:
    """Compile ``step``'s model in its sandbox, run a warm-up step (it compiles, and makes the
    optimizer state) and a recorded one: the start storages' sizes, the record, the graphs and
    graph breaks compiled and the warm-up's CPU seconds; or why the record is not a compiled
    step's. ``triton``: the step is on fake CUDA tensors, compiled to inductor's CUDA code."""
    fake = step.fake
    kernels = _stubbed(fake, triton)
    # fake CUDA compiled on host tensors: attention must be the kernel a CUDA build picks, or the
    # partitioner saves what the CPU's kernel needs (math with dropout: every T x T weight)
    attention = cuda_fake.host_attention_as_cuda() if fake and fake_cuda and not triton else contextlib.nullcontext()
    with step_sandbox(step.where, step.model, step.args, step.kwargs, step.optimizer, step=step.options, targets=step.targets) as box:
        run = replace(box, model=torch.compile(box.model, backend=compile_fn))
        graphs0, breaks0 = _dynamo_counts()
        with box.active(), kernels, attention, _configured(budget, no_caches=fake_cuda or fake):
            t0 = time.process_time()
            run.step(loss_fn)
            compile_s = time.process_time() - t0
            graphs1, breaks1 = _dynamo_counts()
            start = _start_storages(run)
            rec = _fake_recorded_step(run, loss_fn, start, fake_cuda) if fake else _recorded_step(run, loss_fn)
        if _dynamo_counts()[0] != graphs1:
            return "the recorded step compiled again (dynamic shapes or a guard that failed)"
    return _sizes(start), rec, graphs1 - graphs0, breaks1 - breaks0, compile_s


@contextlib.contextmanager
def _stubbed(fake: bool, triton: bool) -> Iterator[None]:
    """Inductor's kernels not run (fake tensors), its CUDA code generated (``triton``)."""
    with (
        inductor_fake.stubbed_kernels() if fake else contextlib.nullcontext(),
        triton_fake.cuda_codegen() if triton else contextlib.nullcontext(),
    ):
        yield


def _eager_fallback(step: Step, backend: str, budget: float, why: str) -> CompiledProfile:
    from memfit.measure.profile import profile_step

    prof = profile_step(step)
    ledger = prof.ledger
    cm = prof.cuda_memory
    return CompiledProfile(
        backend=backend,
        memory_budget=budget,
        start_bytes=ledger.start_bytes,
        step_peak_bytes=prof.step_peak_bytes,
        saved_bytes=0,
        fallback=why,
        allocated_peak_bytes=cm.allocated_peak_bytes if cm else None,
        reserved_peak_bytes=cm.reserved_peak_bytes if cm else None,
    )


def budget_sweep(step: Step, values: Sequence[float] = DEFAULT_SWEEP, *, backend: str = "inductor") -> list[CompiledProfile]:
    """The compiled step at each ``activation_memory_budget`` in ``values`` (one compile each)."""
    return [profile_compiled_step(step, backend=backend, memory_budget=v) for v in values]


def fit_memory_budget_step(
    step: Step, byte_budget: int, values: Sequence[float] = DEFAULT_SWEEP, *, backend: str = "inductor"
) -> tuple[CompiledProfile | None, list[CompiledProfile]]:
    """The largest ``activation_memory_budget`` among ``values`` (the least recompute) whose
    compiled step's peak (allocated on fake CUDA, else the step's peak with its start) is within
    ``byte_budget``, and every value's profile. Each value is measured: the peak is not monotonic
    in the budget (pytorch#197838), so none is skipped by bisection."""
    for v in values:
        if not 0.0 <= v <= 1.0:
            raise BudgetError(f"activation_memory_budget {v!r} is out of range: use fractions from 0 to 1")
    tried = budget_sweep(step, sorted(set(values), reverse=True), backend=backend)
    fits = [p for p in tried if _peak(p) <= byte_budget and not p.fallback]
    return (fits[0] if fits else None), tried


def _peak(p: CompiledProfile) -> int:
    return p.allocated_peak_bytes if p.allocated_peak_bytes is not None else p.peak_bytes


def profile_compiled(
    model: torch.nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    targets: Any = None,
    fake: bool | str | Where = False,
    step: StepOptions | None = None,
    backend: str = "inductor",
    memory_budget: float | None = None,
) -> CompiledProfile:
    """The memory of one training step of ``torch.compile(model, backend=backend)`` compiled
    with ``torch._functorch.config.activation_memory_budget = memory_budget`` (None: as torch's
    config holds it). The step's parts as :func:`memfit.profile` takes them; ``fake="cuda"``
    runs the compiled step on the host at full size and replays its allocations through the
    caching allocator model. The model, optimizer, RNG and torch's configs are left as they were."""
    the = checked_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=fake, options=step, targets=targets)
    return profile_compiled_step(the, backend=backend, memory_budget=memory_budget, allocator=_settings(the))


def fit_memory_budget(
    model: torch.nn.Module,
    inputs: Any,
    budget: int | str,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    targets: Any = None,
    fake: bool | str | Where = False,
    values: Sequence[float] = DEFAULT_SWEEP,
    backend: str = "inductor",
) -> tuple[CompiledProfile | None, list[CompiledProfile]]:
    """The ``activation_memory_budget`` (the largest of ``values``) whose compiled step fits
    ``budget`` bytes (``"6GiB"``), and every value's profile; None when none fits."""
    limit = parse_bytes(budget) if isinstance(budget, str) else int(budget)
    the = checked_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=fake, targets=targets)
    return fit_memory_budget_step(the, limit, values, backend=backend)


def _settings(step: Step) -> AllocatorSettings | None:
    if not step.fake_cuda:
        return None
    from memfit.measure.profile import allocator_settings_from_env

    return allocator_settings_from_env()
