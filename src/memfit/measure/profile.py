"""``memfit.profile``: measure where the memory (and time) of one training step goes.

Steps run, each the same :func:`~memfit.measure.step.train_step`:

1. a warm-up step (real tensors always, so kernels and the optimizer state exist; fake
   tensors only when the optimizer has no state yet);
2. a timed step: no dispatch mode, module hooks stamp a clock (real tensors only);
3. the recorded step under :class:`~memfit.measure.recorder.Recorder`, which yields the
   ledger and FLOPs.

Everything the steps change is put back (see :mod:`memfit.measure.sandbox`).
"""

from __future__ import annotations

import gc
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from memfit.compat import bnb4bit, bnb8bit, optim8bit, torch_compat
from memfit.cuda import gpu as gpus
from memfit.cuda.allocator import AllocatorConfigError, AllocatorSettings
from memfit.errors import ForwardError, MemfitError, WorkloadError
from memfit.measure import determinism, workspace
from memfit.measure.checked import Step, checked_step
from memfit.measure.ledger import START_TICK, Category, Ledger, Phase, ancestors
from memfit.measure.recorder import BOOKKEEPING_OPS, Recorder
from memfit.measure.replay import replay_training
from memfit.measure.sandbox import Sandbox, fake_device, step_sandbox
from memfit.measure.scope import Clock, Scope
from memfit.measure.step import OwnPasses, StepOptions
from memfit.recompute.cache import turned_off
from memfit.recompute.checkpoint import CHECKPOINTED
from memfit.units import parse_bytes
from memfit.workload import Where

__all__ = [
    "profile",
    "Profile",
    "ModuleStats",
    "CudaMemory",
    "PROFILE_FORMAT",
    "fake_session",
    "FakeSession",
    "fake_peaks",
    "Recorded",
    "recorded_profile",
]

PROFILE_FORMAT = "memfit.profile/1"

Progress = Callable[[str, int, int], None]
"""``progress(description, done, total)``, called as the profile advances."""


@dataclass
class ModuleStats:
    """One module of the tree, every figure inclusive of its children."""

    name: str
    """Qualified name as in ``named_modules()``; ``""`` is the root."""
    type: str
    calls: int = 0
    """Forward calls in the step (0 for containers such as ModuleList that are never called)."""
    saved_bytes: int = 0
    """Distinct activation bytes that ops inside this module saved for backward."""
    self_saved_bytes: int = 0
    """The part saved by ops directly in this module, not in a child."""
    forward_time_s: float | None = None
    backward_time_s: float | None = None
    forward_flops: int = 0
    backward_flops: int = 0
    parameter_bytes: int = 0


@dataclass(frozen=True)
class CudaMemory:
    """What the CUDA caching allocator holds over the step, everything alive at its start
    included (as ``peak_bytes``): ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``."""

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    fragmentation_bytes: int | None
    """Reserved but not allocated when allocated peaked (``None`` where not known)."""
    settings: AllocatorSettings
    """The ``PYTORCH_CUDA_ALLOC_CONF`` the step ran (or was replayed) under."""
    source: str
    """``"caching allocator model"`` (the ledger replayed through :mod:`memfit.cuda.allocator`)
    or ``"torch.cuda.max_memory_allocated/reserved"`` (measured on a real GPU)."""
    model: dict[str, int] | None = None
    """On a real GPU, the allocator model's replay of the same ledger, beside the measurement."""
    replayed_steps: int | None = None
    """The model: steps replayed as the training loop runs them (:func:`~memfit.measure.replay.replay_training`:
    the model and inputs placed in program order, a first step that makes the optimizer state,
    then the step until the allocator repeats itself); the peaks are over all of them. ``None``
    for a measurement."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "settings": self.settings.to_dict(),
            "source": self.source,
            "model": self.model,
            "replayed_steps": self.replayed_steps,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CudaMemory:
        return cls(
            allocated_peak_bytes=data["allocated_peak_bytes"],
            reserved_peak_bytes=data["reserved_peak_bytes"],
            fragmentation_bytes=data.get("fragmentation_bytes"),
            settings=AllocatorSettings.parse(data["settings"]["PYTORCH_CUDA_ALLOC_CONF"]),
            source=data["source"],
            model=data.get("model"),
            replayed_steps=data.get("replayed_steps"),
        )


def allocator_settings_from_env() -> AllocatorSettings:
    """The caching allocator's settings as the step's process has them: read once, where a CUDA
    step starts (a bad value is a one-line :class:`~memfit.cuda.allocator.AllocatorConfigError`).
    ``PYTORCH_CUDA_ALLOC_CONF``, or else ``PYTORCH_ALLOC_CONF``, torch's device-generic name
    (torch reads either; torchtitan's ``run_train.sh`` sets ``PYTORCH_ALLOC_CONF=expandable_segments:True``).
    Both set and different is refused: torch takes some options from one and some from the other."""
    cuda, generic = os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), os.environ.get("PYTORCH_ALLOC_CONF")
    if cuda and generic and cuda != generic:
        raise AllocatorConfigError(
            f"PYTORCH_CUDA_ALLOC_CONF={cuda!r} and PYTORCH_ALLOC_CONF={generic!r} differ: "
            "torch reads some options from each, which memfit does not model; set one of them"
        )
    return AllocatorSettings.parse(cuda or generic, "PYTORCH_ALLOC_CONF" if generic and not cuda else "PYTORCH_CUDA_ALLOC_CONF")


def model_cuda_memory(ledger: Ledger, settings: AllocatorSettings) -> CudaMemory:
    """The ledger replayed through the caching allocator model as the training loop runs it
    (:func:`~memfit.measure.replay.replay_training`: each block on the stream it was allocated
    on; the program's construction, its first step, steady steps)."""
    run = replay_training(ledger, settings)
    st = run.stats
    return CudaMemory(
        st.allocated_peak_bytes,
        st.reserved_peak_bytes,
        st.fragmentation_bytes,
        settings,
        "caching allocator model",
        replayed_steps=run.steps,
    )


@dataclass
class Profile:
    """The measured step. ``ledger`` holds the whole timeline; the rest summarises it."""

    ledger: Ledger
    modules: dict[str, ModuleStats]
    device: str
    fake: bool
    time_source: str
    """``"measured"`` (wall clock on the device, the faster of two steps after warm-up) or ``"omitted"``
    (fake tensors have no time; FLOPs are still counted)."""
    step_time_s: float | None
    model_type: str
    step_flops: int = 0
    """FLOPs of the whole step (FlopCounterMode's formulas), the loss included."""
    meta: dict[str, Any] = field(default_factory=dict)
    step: StepOptions = field(default_factory=StepOptions)
    """How the measured step ran (micro-batches, autocast, ...); the default is the usual step."""
    use_cache_off: tuple[str, ...] = ()
    """Modules whose ``use_cache`` the measured step turned off (the step a plan trains,
    measured by :func:`memfit.plan`; :mod:`memfit.recompute.cache`). Empty for
    :func:`memfit.profile`, which measures the step as it is."""
    step_times_s: tuple[float, ...] = ()
    """Every timed step's wall time (``step_time_s`` is the fastest): how steady the host was."""
    device_fit: gpus.DeviceFit | None = None
    """On CUDA (real or fake), or with a capacity: does the step fit on the GPU, with how much
    to spare (capacity minus the CUDA context estimate minus the peak)."""
    cuda_memory: CudaMemory | None = None
    """On CUDA (real or fake): the caching allocator's peaks; ``None`` on CPU."""
    workspaces: dict[str, int] = field(default_factory=dict)
    """Kernel workspaces this process had measured when the profile was made (op signature
    text -> bytes; :mod:`memfit.measure.workspace`), saved with it so that a plan made from
    the file in another process can verify on fake copies, which cannot run a kernel. Empty
    for fake profiles."""

    # A single device is rank 0 of a world of one: read as a distributed step's profiles are
    # (:class:`~memfit.measure.distributed.RankProfiles`), so a caller or a renderer reads both alike.
    @property
    def world_size(self) -> int:
        return 1

    @property
    def profiles(self) -> dict[int, Profile]:
        """Per rank, this one: rank 0."""
        return {0: self}

    @property
    def worst_rank(self) -> int:
        return 0

    @property
    def where(self) -> Where:
        """The tensors the step was measured on (a plan made from it verifies on the same)."""
        if not self.fake:
            return Where.REAL
        return Where.FAKE_CUDA if self.device.startswith("fake:cuda") else Where.FAKE

    @property
    def gpu(self) -> gpus.GpuSpec | None:
        """The GPU the step was judged against (:attr:`device_fit`'s; fake CUDA's simulated
        one), whose rates cost it; None without one."""
        return self.device_fit.gpu if self.device_fit is not None else None

    @property
    def allocated_peak_bytes(self) -> int | None:
        """``max_memory_allocated`` over the step on CUDA (blocks rounded to 512 B); ``None`` on CPU."""
        return self.cuda_memory.allocated_peak_bytes if self.cuda_memory else None

    @property
    def reserved_peak_bytes(self) -> int | None:
        """``max_memory_reserved`` over the step on CUDA (the segments: what runs out); ``None`` on CPU."""
        return self.cuda_memory.reserved_peak_bytes if self.cuda_memory else None

    def under(self, settings: AllocatorSettings | None) -> Profile:
        """This profile judged under other caching-allocator settings: its ledger replayed through
        the allocator model with ``settings``, as a process started with them runs the same
        tensors (``expandable_segments`` changes segments, not what is allocated). Itself on CPU,
        or when ``settings`` is None."""
        if settings is None or self.cuda_memory is None:
            return self
        return replace(self, cuda_memory=model_cuda_memory(self.ledger, settings))

    @property
    def budget_peak_bytes(self) -> int:
        """The peak a memory budget bounds: on CUDA (real or fake) the caching allocator's
        reserved peak (its segments: what runs out), elsewhere :attr:`peak_bytes`."""
        return self.cuda_memory.reserved_peak_bytes if self.cuda_memory else self.peak_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest live bytes in the step, everything alive at its start included: tensors,
        and on CPU autograd's graph (:attr:`Category.GRAPH`, estimated)."""
        return self.ledger.peak_bytes

    @property
    def start_bytes(self) -> int:
        """Live tensor bytes when the step begins (parameters, optimizer state, inputs...)."""
        return self.ledger.start_bytes

    @property
    def step_peak_bytes(self) -> int:
        """How far the step rises above its start: ``peak_bytes - start_bytes``."""
        return self.peak_bytes - self.start_bytes

    @property
    def graph_ops(self) -> int:
        """Forward ops of the model and loss, without the recorder's own (the detached alias
        its saved-tensor hook returns) and fake tensors' device queries; most record an
        autograd node."""
        return sum(1 for o in self.ledger.ops if o.op not in BOOKKEEPING_OPS)

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes by category alive at the peak."""
        return {c.value: n for c, n in self.ledger.breakdown().items()}

    @property
    def peak(self) -> dict[str, Any]:
        """When the peak happens: tick, phase, innermost module and op."""
        tick = self.ledger.peak_tick
        if tick == START_TICK:
            return {"tick": tick, "phase": Phase.START.value, "module": None, "op": None}
        t = self.ledger.ticks[tick]
        return {"tick": tick, "phase": t.phase.value, "module": t.module, "op": t.op}

    @property
    def reproducibility_note(self) -> str:
        """Empty, or why this step is not bitwise equal to itself from run to run, memfit
        or not (:mod:`memfit.measure.determinism`): its plans cannot train bitwise alike either."""
        return determinism.note(self.ledger.nondeterministic)

    @property
    def total_flops(self) -> int:
        root = self.modules.get("")
        return root.forward_flops + root.backward_flops if root else 0

    def to_dict(self, *, ledger: bool = True) -> dict[str, Any]:
        out = {
            "format": PROFILE_FORMAT,
            "model": self.model_type,
            "device": self.device,
            "fake": self.fake,
            "time_source": self.time_source,
            "peak_bytes": self.peak_bytes,
            "start_bytes": self.start_bytes,
            "step_peak_bytes": self.step_peak_bytes,
            "peak": self.peak,
            "breakdown": self.breakdown,
            "phase_peaks": {p.value: n for p, n in self.ledger.phase_peaks().items()},
            "step_time_s": self.step_time_s,
            "step_times_s": list(self.step_times_s),
            "step_flops": self.step_flops,
            "modules": [asdict(m) for m in self.modules.values()],
            "meta": self.meta,
            "step": self.step.to_dict(),
            "host_peak_bytes": self.ledger.host_peak_bytes,
            "unmeasured_ops": self.ledger.unmeasured_ops,
            "use_cache_off": list(self.use_cache_off),
            "nondeterministic": [f.to_dict() for f in self.ledger.nondeterministic],
            "reproducibility_note": self.reproducibility_note,
        }
        if self.device_fit is not None:
            fit = self.device_fit
            out.update(
                gpu=fit.gpu.to_dict() if fit.gpu is not None else None,
                capacity_bytes=fit.capacity_bytes,
                fits=fit.fits,
                headroom_bytes=fit.headroom_bytes,
                device_fit=fit.to_dict(),
            )
        if self.cuda_memory is not None:
            c = self.cuda_memory
            out["allocated_peak_bytes"] = c.allocated_peak_bytes
            out["reserved_peak_bytes"] = c.reserved_peak_bytes
            out["allocator_settings"] = c.settings.to_dict()
            out["cuda_memory"] = c.to_dict()
        if ledger:
            out["ledger"] = self.ledger.to_dict()
            out["workspaces"] = self.workspaces
        return out

    def to_json(self, *, ledger: bool = True) -> str:
        return json.dumps(self.to_dict(ledger=ledger))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile :meth:`to_dict` wrote; the kernel workspaces it carries are taught to
        this process's table (:data:`memfit.measure.workspace.TABLE`), where the runs of a
        plan made from it look them up."""
        if data.get("format") != PROFILE_FORMAT or "ledger" not in data:
            raise MemfitError(f"not a {PROFILE_FORMAT} object with a ledger")
        workspaces = {str(k): int(v) for k, v in data.get("workspaces", {}).items()}
        workspace.TABLE.learn(workspaces)
        return cls(
            workspaces=workspaces,
            ledger=Ledger.from_dict(data["ledger"]),
            modules={m["name"]: ModuleStats(**m) for m in data["modules"]},
            device=data["device"],
            fake=data["fake"],
            time_source=data["time_source"],
            step_time_s=data["step_time_s"],
            step_times_s=tuple(data.get("step_times_s", ())),
            model_type=data["model"],
            step_flops=data.get("step_flops", 0),
            meta=data.get("meta", {}),
            step=StepOptions.from_dict(data.get("step", {})),
            use_cache_off=tuple(data.get("use_cache_off", ())),
            device_fit=gpus.DeviceFit.from_dict(data["device_fit"]) if data.get("device_fit") else None,
            cuda_memory=CudaMemory.from_dict(data["cuda_memory"]) if data.get("cuda_memory") else None,
        )


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def run_step(sandbox: Sandbox, scope: Scope, loss_fn: Any, on_phase: Callable[[Phase], None] | None = None) -> None:
    """One step on the sandbox, turning a failing forward into a ForwardError that names
    the module that raised."""
    with sandbox.active(), step_errors(sandbox, scope):
        sandbox.step(loss_fn, on_phase or scope.set_phase)


@contextmanager
def step_errors(sandbox: Sandbox, scope: Scope) -> Iterator[None]:
    """Around a step on ``sandbox`` whose phases ``scope`` follows: a forward that raises
    becomes a ForwardError naming the module, an optimizer step a WorkloadError naming
    the optimizer; the scope is back at the start after."""
    try:
        yield
    except (MemfitError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        refused = torch_compat.collective_refused(exc) if sandbox.fake_mode is not None else None
        if refused is not None:
            raise WorkloadError(refused) from exc
        if scope.phase is Phase.OPTIMIZER:
            raise _optimizer_error(sandbox.optimizer, exc) from exc
        if scope.phase is Phase.BACKWARD and sandbox.fake_mode is not None:
            # on fake tensors, most often a fake kernel refusing a call its real kernel runs
            # (torch's rules lag its kernels): one line, not autograd's traceback
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise WorkloadError(
                f"the backward on fake tensors raised {type(exc).__name__}: {first} (a fake kernel may refuse what "
                "the real op runs: measure on real tensors)"
            ) from exc
        if scope.phase is not Phase.FORWARD:
            raise
        name = scope.module
        where = "the model" if name is None else (f"module {name!r}" if name else "the root module")
        mod = type(sandbox.model.get_submodule(name)).__name__ if name is not None else type(sandbox.model).__name__
        raise ForwardError(f"forward of {where} ({mod}) raised {type(exc).__name__}: {exc}") from exc
    finally:
        scope.set_phase(Phase.START)


def _optimizer_error(optimizer: torch.optim.Optimizer, exc: Exception) -> WorkloadError:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    message = f"the optimizer step ({type(optimizer).__name__}) raised {type(exc).__name__}: {first}"
    if "torch.compile" in str(exc) or type(exc).__module__.startswith("torch._dynamo"):
        # torchao's low-bit optimizers compile their update (fullgraph): dynamo refuses to
        # trace under a dispatch mode (memfit's recorder) and on fake tensors.
        message = (
            f"the optimizer step ({type(optimizer).__name__}) runs torch.compile, which cannot run under memfit's "
            "recorder (a dispatch mode) or on fake tensors; measure with a torch optimizer (torch.optim.AdamW), or "
            "for 8-bit state with bitsandbytes' AdamW8bit (memfit fit --allow 8bit)"
        )
    elif "DataDependent" in type(exc).__name__:
        message += " (it reads tensor values, which fake tensors do not have: measure it on real tensors)"
    return WorkloadError(message)


def profile(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    fake: bool | str | Where = False,
    progress: Progress | None = None,
    step: StepOptions | None = None,
    targets: Any = None,
    gpu: str | gpus.GpuSpec | None = None,
    capacity: int | str | None = None,
) -> Profile:
    """Measure one steady-state training step of ``model`` on ``inputs``.

    Args:
        model: the model, on the device to measure (its parameters' device).
        inputs: what the model is called with: a tensor, a tuple of positional arguments
            or a dict of keyword arguments.
        loss_fn: ``loss_fn(output)`` -> scalar, or ``loss_fn(output, targets)`` when
            ``targets`` are given; default ``output.loss`` if present, else the sum of the
            output (refused for an output of several tensors: pass loss_fn).
        optimizer: the optimizer training uses; default AdamW over the trainable
            parameters. Its state is created by a warm-up step if it has none.
        fake: run on fake tensors (FakeTensorMode): exact memory with no memory used
            and no time measured, for steps that do not fit on this machine. ``True``
            (or ``"cpu"``): on the model's device. ``"cuda"``: on a fake CUDA device with
            CUDA's semantics (autocast policy, SDPA kernels, optimizer defaults) from a
            model on the CPU, on a CPU build of torch; it must be loaded before torch: run
            ``memfit ... --device fake-cuda``, or start Python with ``MEMFIT_FAKE_CUDA=1``
            and import memfit before torch (else a one-line :class:`MemfitError`).
        progress: optional ``progress(description, done, total)`` callback.
        step: how the step runs (:class:`StepOptions`: micro-batches, autocast, a
            GradScaler, ``zero_grad(set_to_none=False)``, parameters cast to another
            dtype, the optimizer's foreach flag); default the usual step.
        targets: what the loss compares the output with (labels: a tensor, or a tuple or
            dict of them), never given to the model; cut into micro-batches with the
            inputs (each tensor whose dim 0 is the inputs' batch size).
        gpu: with ``fake="cuda"``, the GPU to simulate (a name from
            :data:`memfit.cuda.gpu.GPUS`, e.g. ``"A100-80GB"``, or a ``GpuSpec``): its
            compute capability (cuBLAS workspace size, attention kernel, bf16) and memory;
            default H100-80GB.
        capacity: device bytes to judge the step against (``"24GiB"``); default the GPU's
            total memory on CUDA (real or fake), none elsewhere. The answer is
            :attr:`Profile.device_fit`.

    Returns:
        A :class:`Profile`. The model, its gradients and buffers, the optimizer and
        the RNG are left exactly as they were.

    Example::

        >>> import torch, memfit
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        >>> p = memfit.profile(model, torch.randn(32, 64))
        >>> p.peak_bytes >= p.start_bytes
        True
    """
    spec = gpus.find_gpu(gpu) if isinstance(gpu, str) else gpu
    capacity_bytes = None if capacity is None else parse_bytes(capacity)
    if spec is not None and fake_device(fake) is not Where.FAKE_CUDA:
        raise gpus.GpuError(
            f"gpu={spec.key!r} is the GPU fake CUDA simulates: pass fake='cuda' (--device fake-cuda), or capacity= to judge "
            "the step against another memory size"
        )
    with _simulated(spec):
        the = checked_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=fake, options=step, targets=targets)
        prof = profile_step(the, progress=progress)
    if capacity_bytes is not None:
        prof.device_fit = _device_fit(prof, capacity_bytes, spec)
    return prof


@contextmanager
def _simulated(spec: gpus.GpuSpec | None) -> Iterator[None]:
    """Fake CUDA answers for ``spec`` inside (the GPU it answered for before, after)."""
    if spec is None:
        yield
        return
    from memfit.cuda import fake as fake_cuda

    before = fake_cuda.gpu()
    fake_cuda.set_gpu(spec)
    try:
        yield
    finally:
        fake_cuda.set_gpu(before)


def _device_fit(prof: Profile, capacity: int | None, spec: gpus.GpuSpec | None = None) -> gpus.DeviceFit | None:
    """The step against a capacity: the given one, else the (simulated) GPU's memory on CUDA."""
    cuda = prof.device.startswith(("fake:cuda", "cuda"))
    if prof.device.startswith("fake:cuda"):
        from memfit.cuda import fake as fake_cuda

        spec = spec or fake_cuda.gpu()
    elif prof.device.startswith("cuda") and spec is None:
        props = torch.cuda.get_device_properties(torch.device(prof.device))
        spec = gpus.GpuSpec(
            props.name, props.name, int(props.total_memory), (props.major, props.minor), props.multi_processor_count
        )
    if capacity is None and not cuda:
        return None
    return gpus.device_fit(
        prof.peak_bytes,
        capacity_bytes=capacity,
        gpu=spec,
        cuda=cuda,
        allocated_peak_bytes=prof.allocated_peak_bytes,
        reserved_peak_bytes=prof.reserved_peak_bytes,
    )


def profile_step(step: Step, *, progress: Progress | None = None, warm: bool = False, light: bool = False) -> Profile:
    """:func:`profile` of a checked step; with ``warm``, a real profile skips its warm-up step
    when the optimizer has state already and the process has run the step (the planner
    profiles inside its verifier's sandbox, whose first step was that warm-up). With
    ``light``, a fake profile warms up as :func:`light_warm_up` does (the same profile, one
    fake step fewer), and runs again with the whole warm-up step when that cannot be shown
    to be the same."""
    if light and step.fake:
        with fake_session(step, light=True) as session:
            return session.profile(progress)
    model, loss_fn, options, device = step.model, step.loss_fn, step.options, step.device
    fake = step.fake
    if step.cuda:
        allocator_settings_from_env()  # a PYTORCH_CUDA_ALLOC_CONF it cannot read is refused before any step runs
    report = progress or (lambda desc, done, total: None)
    total = 2 if fake else 3

    with ExitStack() as stack:
        box = stack.enter_context(
            step_sandbox(step.where, model, step.args, step.kwargs, step.optimizer, step=options, targets=step.targets)
        )
        scope = stack.enter_context(Scope(box.model))
        clock = Clock(device)
        if not box.optimizer.state or not (fake or warm):
            report("warm-up step", 0, total)
            run_step(box, scope, loss_fn)
        step_time = None
        step_times: list[float] = []
        per_time: dict[tuple[Phase, str], float] = {}
        measured = None
        if not fake:
            # Two timed steps, the faster figure of each (step and every module's phase):
            # on a shared CPU one step's module times move by 30% or more, and a burst of
            # load slows every module of a step at once (zoo gpt: one step in three at 10 s
            # instead of 0.9 s under a busy neighbour). Interference only adds time, so the
            # minimum is the robust statistic; plans rest on these times.
            report("timed step", 1, total)
            scope.clock = clock
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(_TIMED_STEPS):
                start = clock.mark()
                run_step(box, scope, loss_fn)
                seconds = clock.seconds(start, clock.mark())
                step_times.append(seconds)
                step_time = seconds if step_time is None else min(step_time, seconds)
                for key, t in scope.times().items():
                    per_time[key] = min(per_time.get(key, t), t)
            if device.type == "cuda":
                # the unrecorded steps on the GPU itself: the ground truth the model is checked against
                measured = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
            scope.clock = None
        report("recorded step", total - 1, total)
        # probe: on fake CPU tensors, an op kind no real step of this process measured runs once
        # on real zeros for its workspace (a bf16 matmul's float32 buffer on a CPU without bf16
        # instructions), else the fake profile misses what the real step allocates
        ledger, flops = record_step(box, scope, loss_fn, probe=True)
        report("done", total, total)
        modules = _module_stats(box.model, scope.names, scope.calls, ledger, flops, per_time if not fake else None)
        use_cache_off = turned_off(box.model)
    return _profile_of(step, ledger, flops, modules, use_cache_off, (step_time, tuple(step_times)), measured)


def _profile_of(
    step: Step,
    ledger: Ledger,
    flops: dict[tuple[Phase, str | None], int],
    modules: dict[str, ModuleStats],
    use_cache_off: tuple[str, ...],
    times: tuple[float | None, tuple[float, ...]] = (None, ()),
    measured: tuple[int, int] | None = None,
) -> Profile:
    """The :class:`Profile` of ``step`` from its recorded step (``times``: the step time and
    the timed steps' times, real steps only; ``measured``: a real GPU's own peaks)."""
    fake = step.fake
    settings = allocator_settings_from_env() if step.cuda else None
    cuda_memory = None
    if settings is not None:
        cuda_memory = model_cuda_memory(ledger, settings)
        if measured is not None:
            modelled = {
                "allocated_peak_bytes": cuda_memory.allocated_peak_bytes,
                "reserved_peak_bytes": cuda_memory.reserved_peak_bytes,
            }
            cuda_memory = CudaMemory(
                measured[0], measured[1], None, settings, "torch.cuda.max_memory_allocated/reserved", modelled
            )
    out = Profile(
        workspaces={} if fake else workspace.TABLE.texts(),
        ledger=ledger,
        modules=modules,
        device=f"fake:{step.step_device}" if fake else str(step.device),
        fake=fake,
        time_source="omitted" if fake else "measured",
        step_time_s=times[0],
        step_times_s=times[1],
        model_type=type(step.model).__name__,
        step_flops=sum(flops.values()),
        step=step.options,
        use_cache_off=use_cache_off,
        cuda_memory=cuda_memory,
    )
    out.device_fit = _device_fit(out, None)
    return out


@contextmanager
def fake_peaks(step: Step, *, light: bool = False) -> Iterator[Callable[..., int]]:
    """``peak(inputs, targets)``: :attr:`Profile.budget_peak_bytes` of the step at other
    inputs (another batch size), recorded on one fake copy of the step warmed up once
    (:class:`FakeSession`; ``light``: as :func:`light_warm_up` warms it)."""
    with fake_session(step, light=light) as session:
        yield session.peak


@contextmanager
def fake_session(step: Step, *, light: bool = False) -> Iterator[FakeSession]:
    """One fake copy of ``step`` (fake tensors, on its fake device), warmed up once and
    recorded as often as asked: :class:`FakeSession`."""
    if not step.fake:
        raise WorkloadError("fake_peaks records fake copies of the step: give fake=True or 'cuda', not False")
    if step.cuda:
        allocator_settings_from_env()  # refused before any step runs
    with ExitStack() as stack:
        if light:  # before the sandbox makes the session's fake mode: see older_objects_frozen
            stack.enter_context(older_objects_frozen())
        box = stack.enter_context(
            step_sandbox(step.where, step.model, step.args, step.kwargs, step.optimizer, step=step.options, targets=step.targets)
        )
        scope = stack.enter_context(Scope(box.model))
        yield FakeSession(step, box, scope, light)


@contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Inside, every object the process held on entering is out of the garbage collector's
    sight (``gc.freeze``), and back in it on leaving; as it is where something froze objects
    already (``memfit finetune``, the tests' set-up: it is theirs to undo).

    Why: a light session's check (:func:`live_fake_storages`, twice a session) collects garbage
    and scans every object the collector tracks for its fake tensors; with transformers and
    peft imported that is ~480,000 objects, ~0.4 CPU s a scan, more than a small model's step.
    Frozen, only what was made since is scanned. It finds the same: every fake tensor of the
    session's mode is made after the mode, which is made inside (tensors are tracked from
    their making, so none is frozen, and a storage a tensor of the session takes later, by
    ``.data =`` or ``set_``, is found through that tensor). The one difference is a reference
    cycle through an object older than the session that dies inside it: not collected until
    the end, so a fake tensor only it holds is found alive, a storage more, and the check
    says no (fresh profiles, always what :func:`profile` says), never a yes it would not say."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class Recorded:
    """One recorded step: its ledger, FLOPs by (phase, module), forward calls by module, and
    the modules whose ``use_cache`` it turned off."""

    ledger: Ledger
    flops: dict[tuple[Phase, str | None], int]
    calls: dict[str, int]
    use_cache_off: tuple[str, ...]


def recorded_profile(step: Step, rec: Recorded, capacity: int | None = None) -> Profile:
    """The :class:`Profile` of ``step`` whose recorded step is ``rec`` (a fake one; recorded
    on a copy of ``step.model`` or synthesized for it): module figures by ``step.model``'s
    modules, as a profile of it counts them."""
    names: dict[nn.Module, str] = {}
    for name, mod in step.model.named_modules():
        names.setdefault(mod, name)
    modules = _module_stats(step.model, names, rec.calls, rec.ledger, rec.flops, None)
    prof = _profile_of(step, rec.ledger, rec.flops, modules, rec.use_cache_off)
    if capacity is not None:
        prof.device_fit = _device_fit(prof, capacity)
    return prof


class FakeSession:
    """A fake copy of a step recorded at many inputs and micro-batch counts: its profile
    (:meth:`profile`) and its peaks (:meth:`peak`).

    A batch-size search asks for many peaks of one model; a fresh fake profile each time
    copies the model again and runs a warm-up step before the recorded one, half its cost.
    A recorded step leaves the copy as the warm-up would (parameters, gradients, optimizer
    state do not depend on the batch, nor on how many micro-batches it is cut into), so here
    the steps follow one another. Where that does not hold, a step that leaves behind other
    bytes than it found or starts from other bytes than the first did (a module keeping a
    tensor sized by the batch), the answer is a fresh profile's, so it is always what
    :func:`profile` would say.

    With ``light``, the first recorded step follows :func:`light_warm_up` instead of a whole
    warm-up step, and is checked to be the one a warm-up step would have given
    (:func:`light_warm_up_held`); when it cannot be shown, every answer is a fresh profile's."""

    def __init__(self, step: Step, box: Sandbox, scope: Scope, light: bool) -> None:
        self.step, self.box, self.scope, self.light = step, box, scope, light
        self.settings = allocator_settings_from_env() if step.cuda else None
        self.steady: tuple[int, int] | None = None
        """The first recorded step's held bytes: a fresh profile's."""
        self.fresh_only = False
        """The light warm-up could not be shown to be a warm-up step's: fresh profiles only."""

    def _record(self, at: Step) -> tuple[Ledger, dict[tuple[Phase, str | None], int]] | None:
        """The recorded step of ``at`` (other inputs or micro-batches) on this copy, or None
        when only a fresh profile of ``at`` gives what :func:`profile` would."""
        if self.fresh_only:
            return None
        box = self.box
        box.use_inputs(at.args, at.kwargs, at.targets)
        primed, before = None, {}
        if self.steady is None and not box.optimizer.state:
            primed = light_warm_up(box) if self.light else None
            if primed is None:
                run_step(box, self.scope, self.step.loss_fn)  # the warm-up step, once, at the first inputs asked for
            else:
                before = live_fake_storages(box.fake_mode)
        options, box.options = box.options, at.options
        seen: list[nn.Parameter] = []
        try:
            ledger, flops = record_step(box, self.scope, self.step.loss_fn, probe=True, grads_seen=seen)
        finally:
            box.options = options
        held = _held_bytes(ledger)
        if primed is not None and not light_warm_up_held(primed, seen, before, live_fake_storages(box.fake_mode)):
            self.fresh_only = True
            return None
        if self.steady is None:
            self.steady = held
        elif held != self.steady:  # not the steady step a fresh profile records
            return None
        return ledger, flops

    def profile(self, progress: Progress | None = None, *, capacity: int | None = None) -> Profile:
        """The step's :class:`Profile` at its own inputs: :func:`profile`'s (``capacity``:
        device bytes to judge it against, as there; on fake CUDA, the GPU it simulates now)."""
        report = progress or (lambda desc, done, total: None)
        report("recorded step" if self.steady is not None or self.light else "warm-up step", 0, 2)
        got = self._record(self.step)
        if got is None:
            prof = profile_step(self.step, progress=progress)
        else:
            report("done", 2, 2)
            ledger, flops = got
            modules = _module_stats(self.box.model, self.scope.names, self.scope.calls, ledger, flops, None)
            prof = _profile_of(self.step, ledger, flops, modules, turned_off(self.box.model))
        if capacity is not None:
            prof.device_fit = _device_fit(prof, capacity)
        return prof

    def at(self, batch: Any = None, labels: Any = None, *, micro_batches: int | None = None) -> Step:
        """The step at inputs ``batch`` (and targets ``labels``; None: the step's own) cut
        into ``micro_batches`` (None: as the step is)."""
        at = self.step if batch is None else self.step.at(batch, labels)
        if micro_batches is not None and micro_batches != at.options.micro_batches:
            at = at.on(at.where, replace(at.options, micro_batches=micro_batches))
        return at

    def record(self, at: Step) -> Recorded | None:
        """The recorded step of ``at`` on this copy (:meth:`at`), with its FLOPs and module
        calls; None where only a fresh profile gives what :func:`profile` would."""
        got = self._record(at)
        if got is None:
            return None
        return Recorded(got[0], got[1], dict(self.scope.calls), turned_off(self.box.model))

    def peak(self, batch: Any = None, labels: Any = None, *, micro_batches: int | None = None) -> int:
        """:attr:`Profile.budget_peak_bytes` of the step at inputs ``batch`` (and targets
        ``labels``; None: the step's own) cut into ``micro_batches`` (None: as the step is)."""
        at = self.at(batch, labels, micro_batches=micro_batches)
        got = self._record(at)
        if got is None:
            return profile_step(at).budget_peak_bytes
        ledger = got[0]
        return model_cuda_memory(ledger, self.settings).reserved_peak_bytes if self.settings is not None else ledger.peak_bytes


def light_warm_up(box: Sandbox) -> list[nn.Parameter] | None:
    """What a warm-up step leaves on a fake copy, without its forward and backward: a zero
    gradient on every trainable parameter, the optimizer's step (its state made), the
    gradients set to None. A fake step costs per op dispatched (a 7-8B model: ~10,000 ops),
    and of the warm-up step only the optimizer's state outlives it on a steady step. Returns
    the parameters given gradients, for :func:`light_warm_up_held`; None (nothing done)
    where a warm-up step leaves more or other than that: real tensors, an evaluation step, an
    output held into the next step, a GradScaler, gradients kept at the start
    (``set_to_none=False``), trainable parameters the optimizer does not step, lazy modules,
    LLM.int8 layers on CUDA (:func:`memfit.compat.bnb8bit.forward_leaves_state`)."""
    o = box.options
    if box.fake_mode is None or o.inference or box.held is not None or box.scaler is not None or not o.set_to_none:
        return None
    if box.optimizer.state or any(isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) for m in box.model.modules()):
        return None
    if bnb8bit.forward_leaves_state(box.model):  # LLM.int8 layers on CUDA keep their last outlier columns
        return None
    trainable = [p for p in box.model.parameters() if p.requires_grad]
    stepped = {id(p) for group in box.optimizer.param_groups for p in group["params"]}
    if not trainable or any(id(p) not in stepped for p in trainable):
        return None
    with box.active():
        for p in trainable:
            p.grad = torch.zeros_like(p)
        box.optimizer.step()
        box.optimizer.zero_grad(set_to_none=True)
    return trainable


def live_fake_storages(mode: Any) -> dict[int, Any]:
    """Every storage of a fake tensor of ``mode`` that is alive, once garbage is collected
    (reference cycles a step leaves, such as reentrant checkpointing's, included), by id."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    live = (o for o in gc.get_objects() if issubclass(type(o), FakeTensor) and o.fake_mode is mode)  # type(): no __class__ lookup
    return {id(s): s for s in (t.untyped_storage() for t in live)}


def light_warm_up_held(
    primed: list[nn.Parameter], seen: list[nn.Parameter], before: dict[int, Any], after: dict[int, Any]
) -> bool:
    """Whether the step recorded after :func:`light_warm_up` is the one a warm-up step would
    have given: its backward reached exactly the parameters given gradients (so the same
    optimizer state was made), and every fake storage alive after it (``after``,
    :func:`live_fake_storages`) was alive before it (``before``): no state made or replaced
    by a first forward that a later one keeps (the warm-up step would have made it).
    Not caught: a first forward that differs from later ones only in what it frees within
    the step (an initialisation from the data, in place)."""
    if {id(p) for p in primed} != {id(p) for p in seen} or len(primed) != len(seen):
        return False
    return all(key in before for key in after)


def _held_bytes(ledger: Ledger) -> tuple[int, int]:
    """Bytes other than the inputs alive at the step's start and at its end: equal, and equal
    from step to step, in a steady training step. A model output the loop holds is left out
    with the inputs: sized by the batch as they are (``Ledger.held_output``)."""
    outputs = set(ledger.held_output) | {j for j in ledger.held_output.values() if j is not None}
    kept = [b for b in ledger.blocks if b.category is not Category.INPUT and b.id not in outputs]
    return sum(b.nbytes for b in kept if b.born == START_TICK), sum(b.nbytes for b in kept if b.died is None)


_TIMED_STEPS = 2


def record_step(
    box: Sandbox, scope: Scope, loss_fn: Any, *, probe: bool = False, grads_seen: list[nn.Parameter] | None = None
) -> tuple[Ledger, dict[tuple[Phase, str | None], int]]:
    """Run one step on ``box`` under the recorder: its ledger and FLOPs by (phase, module).
    ``probe``: a fake CPU step measures the workspace of op kinds no real step measured by
    running each once on real zeros (the recorder's ``probe``). With ``holds_output`` the step
    starts with the output the step before it left (one unrecorded step runs first when none
    has), frees it as its forward returns, and leaves its own alive (``Ledger.held_output``).
    ``grads_seen`` gets the parameters that have a gradient when the optimizer steps."""
    held = box.held
    if held is not None and not held.filled:
        # StepOptions.holds_output: the loop's steady step starts with the output of the step
        # before it, which no step of this sandbox has made yet (its first, or the first at
        # other inputs): that step runs now, unrecorded
        run_step(box, scope, loss_fn)
    # a plan applied (or being verified), named as the scope names modules: on the model it
    # hooks, which is the one inside a wrapper such as DDP's when the plan is verified per rank
    checkpointed = scope.model.__dict__.get(CHECKPOINTED) or {}
    recorder = Recorder(
        scope,
        device=_model_device(box.model),
        checkpointed=checkpointed,
        fake=box.fake_mode is not None,
        probe=probe,
        forward_before_loop=box.options.forward_before_loop,
    )
    _register_start(recorder, box)
    if held is not None:
        recorder.register_held(held.value)
        held.on_replace = recorder.held_replaced
    try:
        with recorder:
            _run_recorded(box, scope, loss_fn, recorder, grads_seen)
        return recorder.ledger(), dict(recorder.flops)
    finally:
        if held is not None:
            held.on_replace = None
        recorder.close()


def _register_start(recorder: Recorder, box: Sandbox) -> None:
    from torch.utils._pytree import tree_flatten

    for category, tensors in module_tensors_in_to_order(box.model):
        recorder.register_start(tensors, category)
    recorder.register_start((p.grad for p in box.model.parameters() if p.grad is not None), Category.GRADIENT)
    recorder.register_start(_state_tensors(box.optimizer), Category.OPTIMIZER)
    if isinstance(box.model, OwnPasses):
        recorder.register_start(box.model.held_buffers(), Category.PIPELINE)
    leaves, _ = tree_flatten((box.args, box.kwargs, box.targets))
    recorder.register_start((t for t in leaves if isinstance(t, torch.Tensor)), Category.INPUT)


def module_tensors_in_to_order(model: nn.Module) -> Iterator[tuple[Category, list[torch.Tensor]]]:
    """The model's parameters and buffers in the order ``model.to(device)`` allocates them on the
    device, which is the order the caching allocator saw them in (``nn.Module._apply``: a
    module's children first, then its own parameters, then its own buffers): the blocks alive
    at a step's start are placed in the allocator model in this order, not as
    ``model.parameters()`` then ``model.buffers()`` list them (every parameter before any buffer,
    a module's own before its children's), which lays them out differently."""
    for child in model.children():
        yield from module_tensors_in_to_order(child)
    own = list(model.parameters(recurse=False))
    # a 4-bit weight's quantization state (absmax, codes) and an 8-bit one's row scales are
    # neither parameter nor buffer, but are the weight as much as its packed values are
    yield Category.PARAMETER, own + [t for p in own for t in bnb4bit.state_tensors(p)] + bnb8bit.state_tensors(model)
    yield Category.BUFFER, list(model.buffers(recurse=False))


def _run_recorded(
    box: Sandbox, scope: Scope, loss_fn: Any, recorder: Recorder, grads_seen: list[nn.Parameter] | None = None
) -> None:
    """The recorded step. Gradients are recognised when backward is done (zero_grad frees
    them before the step ends); optimizer state it creates, once the step is over."""

    def on_phase(phase: Phase) -> None:
        if scope.phase is Phase.BACKWARD:
            # train_step dropped output and loss: the graph goes (a pipeline's next pass,
            # forward or backward, begins: the graph of the microbatch whose backward ran goes)
            recorder.free_graph()
        if phase is Phase.FORWARD:
            recorder.new_pass()
        if phase is Phase.OPTIMIZER:
            with_grad = [p for p in box.model.parameters() if p.grad is not None]
            if grads_seen is not None:
                grads_seen.extend(with_grad)
            recorder.mark((p.grad for p in with_grad), Category.GRADIENT)
        scope.set_phase(phase)

    run_step(box, scope, loss_fn, on_phase)
    recorder.mark(_state_tensors(box.optimizer), Category.OPTIMIZER)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # a paged optimizer's paged state is CUDA unified memory, outside the allocator: not the step's
    return [
        v
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and not optim8bit.is_paged_state(v)
    ]


def _module_stats(
    model: nn.Module,
    names: Mapping[nn.Module, str],
    calls: Mapping[str, int],
    ledger: Ledger,
    flops: dict[tuple[Phase, str | None], int],
    times: dict[tuple[Phase, str], float] | None,
) -> dict[str, ModuleStats]:
    """Each named module's figures: ``names`` the modules a step ran (by the name the
    profile gives them), ``calls`` how often each was called forward."""
    stats = {name: ModuleStats(name, type(mod).__name__, calls=calls.get(name, 0)) for mod, name in names.items()}
    for name, mod in model.named_modules():
        if name in stats:
            stats[name].parameter_bytes = sum(p.numel() * p.element_size() for p in mod.parameters())
    return module_figures(stats, ledger, flops, times)


def module_figures(
    stats: dict[str, ModuleStats],
    ledger: Ledger,
    flops: dict[tuple[Phase, str | None], int],
    times: dict[tuple[Phase, str], float] | None = None,
) -> dict[str, ModuleStats]:
    """``stats`` (each module's name, type, calls and parameter bytes) with what the step's
    ledger and FLOPs say of each module: the bytes it saved for backward, its FLOPs, its times."""
    saved: dict[str, int] = defaultdict(int)
    for block in ledger.blocks:
        if block.category is not Category.ACTIVATION:
            continue
        owners = {a for s in block.savers for a in ancestors(s)}
        for name in owners:
            saved[name] += block.nbytes
        if block.savers:
            first = block.savers[0]
            if first in stats:
                stats[first].self_saved_bytes += block.nbytes
    for name, n in saved.items():
        if name in stats:
            stats[name].saved_bytes = n
    for (phase, innermost), n in flops.items():
        if innermost is None:
            continue
        for name in ancestors(innermost):
            if name in stats:
                if phase is Phase.FORWARD:
                    stats[name].forward_flops += n
                elif phase is Phase.BACKWARD:
                    stats[name].backward_flops += n
    if times is not None:
        for s in stats.values():
            s.forward_time_s = times.get((Phase.FORWARD, s.name), 0.0)
            s.backward_time_s = times.get((Phase.BACKWARD, s.name), 0.0)
    return stats
