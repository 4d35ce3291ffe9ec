"""memfit in Lightning: fit the training step to a memory budget, and find the largest
batch without running a step that does not fit.

::

    trainer = L.Trainer(callbacks=[MemfitCallback("6GiB")])                 # recompute plan
    trainer = L.Trainer(callbacks=[MemfitBatchSizeFinder("6GiB", mode="binsearch")])
    trainer.fit(module, datamodule)

What is measured is Lightning's own step: the LightningModule's ``training_step`` on the
first batch of the train dataloader (its return value, or its ``"loss"``, is the loss),
the optimizer ``configure_optimizers`` made (automatic optimization, one optimizer).
``self.log`` calls inside ``training_step`` do nothing while memfit measures (the loop's
result collection is not running then).

:class:`MemfitCallback` works at ``on_fit_start``, before the train dataloader is built:
``mode="plan"`` (default) applies a recompute plan to the module; ``mode="fit"`` may also
choose micro-batches, as ``accumulate_grad_batches`` with the module's (or datamodule's)
``batch_size`` divided alike, so the effective batch is unchanged.

:class:`MemfitBatchSizeFinder` answers what Lightning's ``BatchSizeFinder`` answers (the
same ``mode``, ``init_val``, ``max_val``, ``margin``, ``batch_arg_name``), from exact
peaks on fake tensors (:func:`memfit.levers.max_batch.largest_batch`) instead of training
steps run until one runs out of memory: no step that does not fit is ever run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from torch import nn

from memfit.apply import apply, remove
from memfit.errors import PlanError, WorkloadError
from memfit.integrations._common import generators, rng_kept, say
from memfit.levers.fit import fit, fit_budget
from memfit.levers.max_batch import BatchLimit, largest_batch
from memfit.levers.recipe import Recipe
from memfit.measure.step import StepOptions
from memfit.plan.planner import plan as make_plan
from memfit.plan.result import Plan
from memfit.units import format_bytes
from memfit.workload import Where

__all__ = [
    "MemfitCallback",
    "MemfitBatchSizeFinder",
    "TrainingStep",
    "training_loss",
    "first_batch",
    "lightning_answer",
    "LIGHTNING_STEP",
]

_NO_SWITCH = {
    "offload": "Lightning's Trainer has no switch for activation offload (save_on_cpu)",
    "set_to_none": "Lightning zeroes the gradients itself, inside the next step's closure",
}
LIGHTNING_STEP = StepOptions(set_to_none=False)
"""Lightning's step as memfit measures it. Lightning's automatic optimization zeroes the
gradients inside the next step's closure, after ``training_step`` and before ``backward``:
the last step's gradients are alive through the forward, as in a loop that calls
``zero_grad(set_to_none=False)``. (A bound a little high in backward, where Lightning's
gradients are made as they are computed; without it, steps after the first peaked over the
budget by up to the gradients' bytes, recorded on Lightning's own steps in the tests.)"""


class TrainingStep(nn.Module):
    """A LightningModule's ``training_step`` as a module memfit can measure and plan:
    ``TrainingStep(module)(batch)`` is ``module.training_step(batch, 0)``. Its only child
    is the module, so a plan made on it names the module's submodules (``module.encoder``)
    and, applied to it, checkpoints those very submodules where Lightning calls them."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> Any:
        with _logging_muted(self.module):
            return self.module.training_step(batch, 0)


def training_loss(output: Any) -> torch.Tensor:
    """The loss of what ``training_step`` returned: the tensor, or its ``"loss"``."""
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise WorkloadError("training_step returned a dict without 'loss': Lightning (and memfit) train on output['loss']")
        return output["loss"]
    return output


@contextlib.contextmanager
def _logging_muted(module: pl.LightningModule) -> Iterator[None]:
    # self.log outside the fit loop raises (no result collection): while memfit measures, it does nothing
    had = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.log = lambda *a, **k: None
    module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in had:
                module.__dict__[name] = had[name]
            else:
                module.__dict__.pop(name, None)


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the trainer's train dataloader, on the module's device, drawn
    without moving any random generator (the run's data order and dropout stay as they were)."""
    with rng_kept():
        source = trainer.fit_loop._data_source
        loader = source.dataloader()
        if isinstance(loader, (list, tuple)) or isinstance(loader, Mapping):
            raise WorkloadError("memfit measures a step of one train dataloader; this trainer has several")
        with rng_kept(*generators(loader)):
            batch = next(iter(loader), None)
    if batch is None:
        raise WorkloadError("the train dataloader is empty: there is no batch to measure a step on")
    return trainer.strategy.batch_to_device(batch)


def _optimizer(trainer: pl.Trainer, module: pl.LightningModule) -> torch.optim.Optimizer:
    if not module.automatic_optimization:
        raise WorkloadError("memfit measures Lightning's automatic optimization; this module steps its optimizers itself")
    if len(trainer.optimizers) != 1:
        raise WorkloadError(f"memfit measures a step with one optimizer; configure_optimizers gave {len(trainer.optimizers)}")
    return trainer.optimizers[0]


class MemfitCallback(pl.Callback):
    """Fits the LightningModule's training step to ``budget`` at ``on_fit_start``.

    ``mode="plan"``: recompute only (:func:`memfit.plan`; ``fake=True`` plans on fake
    tensors). ``mode="fit"``: :func:`memfit.fit` weighs recompute and micro-batches (the
    latter as ``accumulate_grad_batches``, ``batch_arg_name`` divided alike). The plan is
    removed again at ``on_fit_end`` and the batch size and accumulation put back, leaving
    the module and trainer as they were given.
    """

    def __init__(
        self,
        budget: int | str,
        *,
        mode: str = "plan",
        fake: bool | str | Where = False,
        batch_arg_name: str = "batch_size",
        log: Callable[[str], None] | None = None,
    ) -> None:
        if mode not in ("plan", "fit"):
            raise PlanError(f"mode is 'plan' (recompute only) or 'fit' (micro-batches too), got {mode!r}")
        where = Where.of(fake)
        if where.fake and mode == "fit":
            raise PlanError("fake=True is for mode='plan': fit times real steps to choose the fastest recipe")
        self.budget = budget
        self.mode = mode
        self.where = where
        self.fake = where.fake
        self.batch_arg_name = batch_arg_name
        self.say = log or say
        self.plan: Plan | None = None
        self.recipe: Recipe | None = None
        self.predicted_peak_bytes: int | None = None
        self.measured_peak_bytes: int | None = None
        """The recorder's ledger peak of the chosen step run for real (None when planned on fake tensors)."""
        self.step_peaks: list[int] = []
        """CUDA: ``torch.cuda.max_memory_allocated`` of each training batch."""
        self._wrapper: TrainingStep | None = None
        self._device: torch.device | None = None
        self._undo: tuple[int, int] | None = None
        """Fit mode with micro-batches: the batch size and accumulate_grad_batches to put back."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = pl_module.device
        optimizer = _optimizer(trainer, pl_module)
        batch = first_batch(trainer)
        step = TrainingStep(pl_module)
        if self.mode == "plan":
            found = make_plan(
                step, (batch,), self.budget, loss_fn=training_loss, optimizer=optimizer, fake=self.where, step=LIGHTNING_STEP
            )
            self.plan, self.predicted_peak_bytes = found, found.predicted_peak_bytes
            self.measured_peak_bytes = None if self.fake else found.predicted_peak_bytes  # verified by running it
            chose = f"recompute {len(found.checkpointed)} module{'s' if len(found.checkpointed) != 1 else ''}"
            base = found.none_peak_bytes
        else:
            exclude = dict(_NO_SWITCH)
            try:
                size = lightning_getattr(pl_module, self.batch_arg_name)
            except (AttributeError, ValueError):
                size = None
            if not isinstance(size, int):
                exclude["microbatch"] = f"no {self.batch_arg_name!r} attribute on the module or datamodule to divide"
            recipe = fit(
                step, (batch,), self.budget, loss_fn=training_loss, optimizer=optimizer, exclude=exclude, set_to_none=False
            )
            self.recipe, self.plan = recipe, recipe.plan
            self.predicted_peak_bytes, self.measured_peak_bytes = recipe.predicted_peak_bytes, recipe.measured_peak_bytes
            chose, base = recipe.summary(), recipe.base_peak_bytes
            k = recipe.step.micro_batches
            if k > 1:
                self._undo = (size, trainer.accumulate_grad_batches)
                lightning_setattr(pl_module, self.batch_arg_name, size // k)
                trainer.fit_loop._combined_loader = None  # built from the new batch size
                trainer.accumulate_grad_batches *= k
                chose += (
                    f" ({self.batch_arg_name} {size} -> {size // k}, accumulate_grad_batches={trainer.accumulate_grad_batches})"
                )
        if self.plan is not None and self.plan.checkpointed:
            apply(step, self.plan)
            self._wrapper = step
        measured = (
            "" if self.measured_peak_bytes is None else f", measured {format_bytes(self.measured_peak_bytes)} (memfit's ledger)"
        )
        self.say(
            f"budget {format_bytes(self.plan.budget_bytes if self.recipe is None else self.recipe.budget_bytes)}: {chose}; "
            f"peak as it is {format_bytes(base)}, predicted {format_bytes(self.predicted_peak_bytes or 0)}{measured}"
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._device is not None and self._device.type == "cuda":
            self.step_peaks.append(torch.cuda.max_memory_allocated(self._device))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wrapper is not None:
            remove(self._wrapper)
            self._wrapper = None
        if self._undo is not None:  # the batch size and accumulation fit mode changed
            size, accumulate = self._undo
            lightning_setattr(pl_module, self.batch_arg_name, size)
            trainer.accumulate_grad_batches = accumulate
            self._undo = None


def power_ladder(init_val: int, max_val: int) -> list[int]:
    """The batch sizes Lightning's finder in power mode can settle on: ``init_val`` doubled
    up to ``max_val``, and halved down to 1 (where it goes when ``init_val`` does not fit)."""
    sizes = {init_val}
    size = init_val
    while size > 1:
        size //= 2
        sizes.add(size)
    size = init_val
    while size * 2 <= max_val:
        size *= 2
        sizes.add(size)
    return sorted(sizes)


def lightning_answer(largest: int, mode: str, init_val: int = 2, max_val: int = 8192, margin: float = 0.05) -> int:
    """What Lightning's ``BatchSizeFinder`` settles on when ``largest`` is the largest batch
    whose step fits: ``"power"`` doubles from ``init_val`` while it fits (halving until one
    fits when even ``init_val`` does not), ``"binsearch"`` then bisects to ``largest`` and
    takes ``margin`` off it; both stop at ``max_val``. Two differences, both on the safe
    side: Lightning stops at ``max_val`` without trying it, and settles there even if it
    does not fit, where this keeps to ``largest``; and the finder also stops doubling at
    the dataset's length, which this does not model."""
    if mode not in ("power", "binsearch"):
        raise PlanError(f"mode is 'power' or 'binsearch' (as Lightning's BatchSizeFinder), got {mode!r}")
    if largest < 1:  # no batch size to settle on: 1 would not fit either
        raise PlanError(f"largest is the largest batch whose step fits, at least 1; got {largest} (not even a batch of 1 fits)")
    if init_val > largest:
        size = init_val if mode == "power" else largest
        while mode == "power" and size > largest:  # Lightning halves after each failure
            size //= 2
    elif mode == "power":
        size = init_val
        while size < max_val and size * 2 <= largest:
            size *= 2
        size = min(size, max_val)
    else:
        size = min(largest, max_val)
    if mode == "binsearch" and margin > 0:
        size = max(1, int(size * (1 - margin)))
    return size


class MemfitBatchSizeFinder(pl.Callback):
    """Lightning's ``BatchSizeFinder``, answered by memfit: the largest batch whose step
    (as it is: no recompute, no micro-batches) peaks within ``budget``, found on fake
    tensors from the first batch, then the batch ``mode`` would settle on
    (:func:`lightning_answer`), set on the module (or datamodule) as ``batch_arg_name``."""

    def __init__(
        self,
        budget: int | str,
        *,
        mode: str = "power",
        init_val: int = 2,
        max_val: int = 8192,
        margin: float = 0.05,
        batch_arg_name: str = "batch_size",
        fake: bool | str | Where = True,
        log: Callable[[str], None] | None = None,
    ) -> None:
        lightning_answer(1, mode)  # refuses an unknown mode before anything runs
        self.budget = budget
        self.mode = mode
        self.init_val = init_val
        self.max_val = max_val
        self.margin = margin
        self.batch_arg_name = batch_arg_name
        self.fake = fake
        self.say = log or say
        self.optimal_batch_size: int | None = None
        self.limit: BatchLimit | None = None
        self.search_time_s: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.perf_counter()
        optimizer = _optimizer(trainer, pl_module)
        batch = first_batch(trainer)
        self.limit = largest_batch(
            TrainingStep(pl_module),
            (batch,),
            self.budget,
            loss_fn=training_loss,
            optimizer=optimizer,
            fake=self.fake,
            step=LIGHTNING_STEP,
            ladder=power_ladder(self.init_val, self.max_val) if self.mode == "power" else None,
        )
        self.optimal_batch_size = lightning_answer(self.limit.max_batch, self.mode, self.init_val, self.max_val, self.margin)
        lightning_setattr(pl_module, self.batch_arg_name, self.optimal_batch_size)
        trainer.fit_loop._combined_loader = None  # built from the new batch size
        self.search_time_s = time.perf_counter() - started
        lim = self.limit
        which = "largest batch" if self.mode != "power" else f"largest of {self.init_val} doubled or halved"
        self.say(
            f"{which} within {format_bytes(fit_budget(self.budget))}: {lim.max_batch} (step peak "
            f"{format_bytes(lim.peak_bytes)}; {format_bytes(lim.bytes_per_sample)} per sample, {lim.measurements} fake-tensor "
            f"profiles); {self.batch_arg_name}={self.optimal_batch_size} as BatchSizeFinder(mode={self.mode!r}) would "
            f"settle; {self.search_time_s:.1f} s"
        )
