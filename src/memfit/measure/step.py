"""The training step memfit measures, shared by the profiler and the ground-truth runs.

One steady-state step: forward, loss, backward (the model's output stays alive through
backward, as it does in a loop that writes ``out = model(x); out.loss.backward()``),
then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. Gradients are ``None``
when it starts and when it ends. With :attr:`StepOptions.holds_output`, the output outlives
the step as the loop's name for it keeps it (:class:`HeldOutput`).

:class:`StepOptions` describes the variants :func:`memfit.fit` weighs (micro-batches,
autocast with or without a GradScaler, ``zero_grad(set_to_none=False)``, parameters in
another dtype, the optimizer's foreach flag, 8-bit optimizer state); the defaults are the step above. The
sandboxes (:mod:`memfit.measure.sandbox`) apply the options that change the objects the
step runs on (dtype, foreach, the 8-bit optimizer, gradients alive at the start, the scaler); :func:`train_step`
the ones that change the step itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import WorkloadError
from memfit.measure.ledger import Phase
from memfit.workload import call_loss, check_loss, split_batch

__all__ = [
    "train_step",
    "StepOptions",
    "HeldOutput",
    "FakeGradScaler",
    "eval_mode",
    "offload_saved",
    "first_micro_batches",
    "OwnPasses",
]

_RUN_MICRO_BATCHES: ContextVar[int | None] = ContextVar("memfit_run_micro_batches", default=None)


@contextlib.contextmanager
def first_micro_batches(n: int) -> Iterator[None]:
    """Inside, a step of more than ``n >= 3`` micro-batches runs only its first ``n``, then
    the optimizer step. From the third on, every micro-batch starts with the same tensors
    alive (parameters, optimizer state, the whole batch's inputs, the accumulated
    gradients, the running loss and the last micro-batch's loss: in the second, the running
    loss is still the first's) and allocates the same shapes, so the ones after the third
    repeat its memory exactly: the peak of the short step is the whole step's.
    :func:`memfit.fit` profiles steps of many micro-batches on fake tensors this way,
    whose cost is per op dispatched (``tests/test_fit.py`` checks the peaks are equal)."""
    if n < 3:
        raise ValueError("micro-batches repeat each other's memory from the third on: keep at least 3")
    token = _RUN_MICRO_BATCHES.set(n)
    try:
        yield
    finally:
        _RUN_MICRO_BATCHES.reset(token)


_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class StepOptions:
    """How one training step runs. The defaults are memfit's usual step."""

    micro_batches: int = 1
    """Forward and backward once per micro-batch (gradients accumulate), then one optimizer step."""
    accumulate: int = 1
    """Gradient accumulation as a training loop writes it: forward and backward over the
    whole given batch this many times, no ``zero_grad`` between the passes, then one
    optimizer step (the loop's next batches are the same size; the profiler has one, so
    every pass runs on it). Unlike ``micro_batches`` the batch is not split: each pass holds
    the activations of the whole batch given. With ``micro_batches`` too, each pass is split."""
    loss_scale: float | None = None
    """Factor on each pass's loss; None: ``1 / (micro_batches * accumulate)`` (a mean loss
    stays the mean over everything the optimizer step sees), and no multiplication at all
    for a single pass."""
    autocast: str | None = None
    """``"bfloat16"`` or ``"float16"``: forward and loss under ``torch.autocast``."""
    grad_scaler: bool = False
    """Backward and optimizer step through a ``torch.amp.GradScaler`` (float16 autocast)."""
    set_to_none: bool = True
    """The loop's ``zero_grad(set_to_none=...)``; False keeps gradients allocated between
    steps, so the measured step starts with them."""
    param_dtype: str | None = None
    """Parameters, floating buffers, optimizer state and floating inputs cast to this dtype
    (``"bfloat16"``): measured on a cast copy, the user's model is not touched."""
    foreach: bool | None = None
    """Set the optimizer's ``foreach`` flag for the step; None leaves it as it is."""
    optimizer_8bit: bool = False
    """The optimizer replaced by its bitsandbytes 8-bit counterpart (AdamW -> AdamW8bit,
    Adam -> Adam8bit) with the same groups and hyperparameters; its state is created by
    the warm-up step. The user's optimizer is not touched."""
    offload: bool = False
    """Tensors autograd saves for backward are copied to pinned host memory as the forward
    saves them and back as backward needs them (``torch.autograd.graph.save_on_cpu``): the
    device holds them only while they are in use. For a CUDA step; on the host it saves nothing."""
    inference: bool = False
    """An evaluation step instead: the model in eval mode, forward and loss under
    ``torch.inference_mode()``, no backward and no optimizer step."""
    forward_before_loop: bool = False
    """The program runs the model's forward once after building it and before its loop,
    keeping nothing of it (a target computed with the model, a shape check): what the forward
    makes for itself and keeps, the forward thread's cuBLAS workspace or a cache a module
    fills, exists before the loop's first step instead of being made in it, which changes
    where the caching allocator places the loop's blocks (CUDA steps). The blocks that
    forward made and freed are not replayed."""
    holds_output: bool = False
    """The loop binds the model's output to a name (``output = model(x)``, ``out = model(x);
    loss = loss_fn(out, y)``) and does not ``del`` it, so the previous step's output is alive
    until the next step's forward returns and the name is rebound: the step starts with it
    and frees it when its forward returns, and ends with its own output alive. What is held
    is the whole object the model returns (a transformers ``ModelOutput``: its logits, and
    its loss in training), with, on a CPU step, the autograd graph its tensors keep after
    backward (the nodes, not the saved tensors backward freed). With micro-batches or
    ``accumulate``, each pass's output is held until the next pass's forward returns, as a
    loop ``for mb in batch: out = model(mb); ...`` holds it, and the step ends holding its last
    pass's. memfit runs it so: the step before the measured one leaves its output alive, and
    the measured step drops it right after its forward returns. Values are not touched. The
    loss a loop binds beside it (``loss = ...``, a scalar and its node) is not held."""
    drops_output: bool = False
    """The loop keeps only the loss, ``loss = model(**batch).loss``, as transformers' Trainer
    (its ``compute_loss`` returns the loss alone) and TRL's trainers do: the model's output
    (a transformers ``ModelOutput``'s logits) is dropped once the loss is computed, before
    backward, instead of living through it. Not with ``holds_output``."""

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise WorkloadError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise WorkloadError(f"accumulate must be a positive integer, got {self.accumulate!r}")
        if self.inference and (
            self.micro_batches > 1
            or self.accumulate > 1
            or self.grad_scaler
            or not self.set_to_none
            or self.foreach is not None
            or self.optimizer_8bit
            or self.offload
        ):
            raise WorkloadError(
                "an inference step has no backward or optimizer step: micro_batches, accumulate, grad_scaler, "
                "set_to_none=False, foreach, optimizer_8bit and offload do not apply to it"
            )
        if self.drops_output and self.holds_output:
            raise WorkloadError("drops_output and holds_output contradict each other: the loop drops its output or holds it")
        if self.optimizer_8bit and self.foreach is not None:
            raise WorkloadError("foreach is a flag of torch's optimizers; with optimizer_8bit the optimizer is bitsandbytes'")
        for name in ("autocast", "param_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise WorkloadError(f"{name} must be one of {', '.join(_DTYPES)} or None, got {value!r}")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.autocast) if self.autocast else None

    @property
    def cast_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.param_dtype) if self.param_dtype else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        # Left out at their defaults (fields added later): the JSON of such a step stays
        # readable by a memfit from before them, while one that uses them is refused there.
        if self.accumulate == 1:
            del data["accumulate"]
        if not self.forward_before_loop:
            del data["forward_before_loop"]
        if not self.holds_output:
            del data["holds_output"]
        if not self.drops_output:
            del data["drops_output"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepOptions:
        return cls(**data)


class HeldOutput:
    """The name a training loop binds the model's output to (:attr:`StepOptions.holds_output`):
    :func:`train_step` hands it each forward's output right after the forward returns, which
    drops the output held before, as ``output = model(x)`` rebinds ``output``. What it holds
    outlives the step, so the next step starts with it. ``on_replace(dropped, output)``, when
    set, is called after each replacement: whether an output was held (and is now dropped), and
    the one now held (memfit's recorder listens)."""

    def __init__(self) -> None:
        self.value: Any = None
        self.filled = False
        """A forward's output has been held: a step ran (the next one starts holding it)."""
        self.on_replace: Callable[[bool, Any], None] | None = None

    def replace(self, output: Any) -> None:
        """Hold ``output``; the output held until now is dropped here (its tensors freed
        unless something else keeps them)."""
        had = self.filled
        self.value, self.filled = output, True
        # The old object's last reference was the one just overwritten: it is freed above,
        # before the listener hears of it, as the loop frees it when the name is rebound.
        if self.on_replace is not None:
            self.on_replace(had, output)

    def clear(self) -> None:
        """Drop what is held (the loop ended, or the next step runs at another batch)."""
        self.value, self.filled = None, False


class FakeGradScaler:
    """What ``torch.amp.GradScaler`` does to memory, on fake tensors, which it cannot run:
    it reads ``found_inf`` with ``.item()`` before stepping (a fake tensor has no value).
    Same ops, same allocations (a scalar product in backward, in-place unscaling, two
    scalars per step); the optimizer always steps."""

    def __init__(self, device: torch.device, init_scale: float = 2.0**16) -> None:
        # Created in the sandbox before the measured step, as a real scaler's are by the warm-up.
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), 0, dtype=torch.int32, device=device)
        self._found_inf: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for same in grads.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
        self._found_inf = found_inf
        optimizer.step()

    def update(self) -> None:
        if self._found_inf is not None:
            torch._amp_update_scale_(self._scale, self._growth_tracker, self._found_inf, 2.0, 0.5, 2000)
            self._found_inf = None


class OwnPasses(nn.Module):
    """A model whose forward and backward passes run together, in an order of its own: a
    pipeline rank, whose schedule runs its microbatches' forwards and backwards interleaved
    (:class:`memfit.measure.pipeline.PipelineRank`). :func:`train_step` hands it the batch,
    the targets and the phase callback (it says which pass runs as it goes) in place of
    calling it, its loss and the loss's backward; the optimizer step is the step's as usual."""

    def passes(self, args: tuple, kwargs: dict, targets: Any, on_phase: Callable[[Phase], None]) -> torch.Tensor | None:
        """Run every forward and backward of the step; the loss, or None where this rank has none."""
        raise NotImplementedError

    def held_buffers(self) -> list[torch.Tensor]:
        """Tensors it keeps from step to step besides parameters and buffers (a pipeline
        stage's receive buffers): alive at a step's start."""
        return []


def _own_passes_step(
    model: OwnPasses,
    args: tuple,
    kwargs: dict,
    targets: Any,
    optimizer: torch.optim.Optimizer,
    on_phase: Callable[[Phase], None],
    set_to_none: bool,
    others: dict[str, Any],
) -> float:
    """:func:`train_step` for an :class:`OwnPasses` model: its passes, then the optimizer."""
    refused = [k for k, v in others.items() if v]
    if refused:
        # the schedule cuts the batch into its own microbatches and runs the passes itself:
        # memfit's step variants (micro-batches, autocast, a GradScaler, offload) do not reach in
        raise WorkloadError(
            f"a pipelined step runs its schedule's microbatches and passes itself: {refused[0]} is not measured on it; "
            "measure it with the step's defaults"
        )
    loss = model.passes(args, kwargs, targets, on_phase)
    on_phase(Phase.OPTIMIZER)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    try:
        return float(loss)  # type: ignore[arg-type]
    except Exception:  # no loss on this rank, or fake tensors
        return float("nan")


def offload_saved() -> contextlib.AbstractContextManager:
    """What the ``offload`` lever puts around forward and loss: torch's own
    ``save_on_cpu(pin_memory=True)`` (it pins only where a CUDA device is present)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def _device_type(model: nn.Module) -> str:
    for t in model.parameters():
        return t.device.type
    return "cpu"


def train_step(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer: torch.optim.Optimizer,
    on_phase: Callable[[Phase], None] = lambda phase: None,
    *,
    micro_batches: int = 1,
    accumulate: int = 1,
    loss_scale: float | None = None,
    autocast: torch.dtype | None = None,
    scaler: Any = None,
    set_to_none: bool = True,
    inference: bool = False,
    offload: bool = False,
    targets: Any = None,
    held: HeldOutput | None = None,
    drops_output: bool = False,
) -> float:
    """Run one step; returns the loss value (a float, or nan on fake tensors). With
    micro-batches or ``accumulate`` passes, the sum of the scaled losses of the passes (their
    mean, by default); each micro-batch's loss sees its own slice of ``targets``.
    With ``inference``, an evaluation step (see :attr:`StepOptions.inference`). With ``held``,
    each forward's output is handed to it as the forward returns (:attr:`StepOptions.holds_output`).
    With ``drops_output``, the output is dropped once the loss is computed (:attr:`StepOptions.drops_output`)."""
    if isinstance(model, OwnPasses):
        others = {
            "micro_batches": micro_batches > 1,
            "accumulate": accumulate > 1,
            "loss_scale": loss_scale is not None,
            "autocast": autocast is not None,
            "scaler": scaler is not None,
            "inference": inference,
            "offload": offload,
            "holds_output": held is not None,
            "drops_output": drops_output,
        }
        return _own_passes_step(model, args, kwargs, targets, optimizer, on_phase, set_to_none, others)
    if inference:
        return _inference_step(model, args, kwargs, loss_fn, on_phase, autocast, targets, held)
    if loss_scale is None and micro_batches * accumulate > 1:
        loss_scale = 1.0 / (micro_batches * accumulate)
    total: torch.Tensor | None = None
    # every accumulation pass runs the same batch's micro-batches: no zero_grad between them
    parts = split_batch(args, kwargs, targets, micro_batches) * accumulate
    limit = _RUN_MICRO_BATCHES.get()
    for margs, mkwargs, mtargets in parts[:limit] if limit else parts:
        on_phase(Phase.FORWARD)
        with (
            torch.autocast(_device_type(model), dtype=autocast) if autocast is not None else contextlib.nullcontext(),
            offload_saved() if offload else contextlib.nullcontext(),
        ):
            output = model(*margs, **mkwargs)
            if held is not None:
                held.replace(output)  # `output = model(x)`: the previous output goes now
            loss = check_loss(call_loss(loss_fn, output, mtargets))
            if loss_scale is not None:
                loss = loss * loss_scale
            if drops_output:
                output = None  # `loss = model(**batch).loss`: nothing else keeps the output
        on_phase(Phase.BACKWARD)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        value = loss.detach()
        total = value if total is None else total + value
        del output, loss
    on_phase(Phase.OPTIMIZER)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    try:
        return float(total)  # type: ignore[arg-type]
    except Exception:  # fake tensors have no value
        return float("nan")


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` for the block; every module's own training flag restored after
    (``model.train()`` would switch on modules the user had put in eval mode)."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def _inference_step(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    loss_fn: Callable[..., torch.Tensor] | None,
    on_phase: Callable[[Phase], None],
    autocast: torch.dtype | None,
    targets: Any,
    held: HeldOutput | None = None,
) -> float:
    """Forward and loss as an evaluation loop runs them; the modules' training flags are restored."""
    on_phase(Phase.FORWARD)
    with eval_mode(model), torch.inference_mode():
        with torch.autocast(_device_type(model), dtype=autocast) if autocast is not None else contextlib.nullcontext():
            output = model(*args, **kwargs)
            if held is not None:
                held.replace(output)
            loss = call_loss(loss_fn, output, targets)
        del output
    try:
        return float(loss)
    except Exception:  # fake tensors have no value; a loss that is not a scalar
        return float("nan")
