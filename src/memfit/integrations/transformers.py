"""memfit in transformers' ``Trainer``: fit the training step to a memory budget in one line.

::

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    fit_trainer(trainer, "6GiB")        # before train(): recompute plan, batch / accumulation
    trainer.train()

or, recompute only, as a callback: ``Trainer(..., callbacks=[MemfitCallback("6GiB")])``.

What is measured is the Trainer's own step: its model, the first batch of its train
dataloader (through its collator and ``_prepare_inputs``), its loss (``model(**batch)``
then ``outputs.loss``, as ``Trainer.compute_loss`` takes it) and its optimizer (the one it
was given, or the one ``Trainer.create_optimizer`` builds from its arguments, made once to
be measured and then dropped so the Trainer builds its own as usual).

:func:`fit_trainer` runs before ``train()``, so it may change the batch layout: a recipe
with micro-batches becomes a smaller ``per_device_train_batch_size`` and a larger
``gradient_accumulation_steps`` (the effective batch is unchanged; the sampler's order of
samples does not depend on the batch size). :class:`MemfitCallback` on its own plans at
``on_train_begin``, when the dataloader is built already: recompute only.

Recompute is memfit's plan (:func:`memfit.apply` on the model) instead of transformers'
all-or-nothing ``gradient_checkpointing``: if that was asked for, it is turned off (on the
arguments, and on the model if ``train()`` had already enabled it) and said so; the plan
recomputes what the budget needs at the least extra compute, or nothing when the step fits.
Neither changes what training computes (memfit's recompute replays dropout's random numbers).

Measured peak: on CUDA, ``torch.cuda.max_memory_allocated`` of every training step (the
callback's ``step_peaks``); on CPU, the recorder's ledger peak of the recipe's (or plan's)
step run for real on the model, as :func:`memfit.fit` / :func:`memfit.plan` measure it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from memfit.apply import apply
from memfit.errors import PlanError, WorkloadError
from memfit.integrations._common import first_batch_of, rng_kept, say
from memfit.levers.fit import fit, parse_allow
from memfit.levers.recipe import Recipe
from memfit.plan.planner import plan as make_plan
from memfit.plan.result import Plan
from memfit.recompute.checkpoint import applied_choices, unwrap
from memfit.units import format_bytes
from memfit.workload import Where

__all__ = ["MemfitCallback", "fit_trainer", "trainer_step", "step_inputs", "fused_lm_head"]

_TRAINER_LEVERS = ("8bit",)
"""Opt-in levers fit_trainer can still set on a built Trainer (``optim``, read when train()
builds the optimizer). Not ``amp``: the Trainer fixes its mixed precision when it builds
its accelerator, in ``__init__``: set ``bf16=True`` in the TrainingArguments instead."""
_NO_SWITCH = {"offload": "transformers' Trainer has no switch for activation offload (save_on_cpu)"}


def _first_batch(trainer: Any, loader: Iterable | None = None) -> dict[str, Any]:
    with rng_kept():  # building the dataloader may draw from the generators too
        batch = first_batch_of(trainer.get_train_dataloader() if loader is None else loader)
    if batch is None:
        raise WorkloadError("the trainer's train dataloader is empty: there is no batch to measure a step on")
    batch = trainer._prepare_inputs(batch)  # to the device, as training_step does
    if not isinstance(batch, Mapping):
        raise WorkloadError(
            f"the trainer's batches are {type(batch).__name__}, not a dict of keyword arguments: memfit measures the step "
            "Trainer.compute_loss runs, model(**batch)"
        )
    return dict(batch)  # a BatchEncoding is a UserDict


def fused_lm_head(model: torch.nn.Module) -> bool:
    """Whether TRL has patched the model's forward with its fused LM head
    (``trl.trainer.utils.add_fused_lm_head``, which ``SFTTrainer`` applies to the model it
    trains, under peft's wrapper if any): ``model(..., fused_lm_head=True)`` then scores the
    labels in chunks of the vocabulary instead of making the logits, which is the step
    ``SFTTrainer.compute_loss`` runs, and other memory than ``model(**batch).loss``."""
    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    forward = vars(base).get("forward")
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    return code is not None and "fused_lm_head" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def step_inputs(model: torch.nn.Module, batch: dict[str, Any], trainer: Any = None) -> dict[str, Any]:
    """The keyword arguments the trainer's ``compute_loss`` calls the model with, from a
    batch of its dataloader: the batch itself for transformers' Trainer; for TRL's
    ``SFTTrainer`` (a model with its fused LM head) also ``use_cache=False`` and
    ``fused_lm_head=True`` (and ``output_router_logits`` for a MoE's auxiliary loss), whose
    output's ``loss`` is the loss it trains on. ``trainer``, when known, is checked for the
    SFTTrainer losses that run the model otherwise (a ``compute_loss_func``, label smoothing,
    ``loss_type="dft"``): refused in one line."""
    if not fused_lm_head(model):
        return batch
    if trainer is not None:
        kind = type(trainer).__name__
        if kind != "SFTTrainer":
            raise WorkloadError(
                f"{kind} (TRL) runs another step than model(**batch).loss (several forwards, a reference model): memfit "
                "measures transformers' Trainer and TRL's SFTTrainer"
            )
        if getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "label_smoother", None) is not None:
            raise WorkloadError(
                "this SFTTrainer computes its loss from the full logits (compute_loss_func or label_smoothing_factor): "
                "memfit measures SFTTrainer's default loss, its fused LM head; drop them to measure"
            )
        loss_type = getattr(trainer.args, "loss_type", "nll")
        if loss_type != "nll":
            raise WorkloadError(f"SFTConfig(loss_type={loss_type!r}): memfit measures SFTTrainer's default loss_type='nll'")
    out = {**batch, "use_cache": False, "fused_lm_head": True}
    if getattr(trainer, "aux_loss_enabled", False):
        out["output_router_logits"] = True
    return out


def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # accelerate wraps the optimizer in train(); memfit restores and copies the inner one's state
    while type(optimizer).__name__ == "AcceleratedOptimizer" and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _optimizer(trainer: Any) -> tuple[torch.optim.Optimizer, str]:
    if trainer.optimizer is not None:
        return _plain_optimizer(trainer.optimizer), f"the trainer's {type(_plain_optimizer(trainer.optimizer)).__name__}"
    try:
        optimizer = trainer.create_optimizer()
    finally:
        trainer.optimizer = None  # train() builds its own from the same arguments
    name = type(optimizer).__name__
    return (
        optimizer,
        f"{name} as Trainer.create_optimizer builds it from the TrainingArguments (optim={getattr(trainer.args.optim, 'value', trainer.args.optim)!r})",
    )


def trainer_step(trainer: Any) -> tuple[torch.nn.Module, dict[str, Any], torch.optim.Optimizer, str]:
    """The step a Trainer runs, as memfit measures it: the model, the first batch of the
    train dataloader (on the device; for TRL's SFTTrainer with the keywords its
    ``compute_loss`` adds: :func:`step_inputs`), the optimizer and what that optimizer is.
    The loss is memfit's default, ``output.loss``, as ``Trainer.compute_loss`` takes it."""
    optimizer, what = _optimizer(trainer)
    return trainer.model, step_inputs(trainer.model, _first_batch(trainer), trainer), optimizer, what


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model that owns the checkpointing switch: the model itself, or the
    one inside a wrapper such as peft's ``PeftModel`` (whose attribute lookups forward to it,
    through deprecated aliases, but whose class has no switch of its own)."""
    inner = unwrap(model)
    for mod in inner.modules():
        if hasattr(type(mod), "gradient_checkpointing_disable") or hasattr(type(mod), "activation_checkpointing_disable"):
            return mod
    return inner


def _input_grads_off(model: torch.nn.Module) -> bool:
    """Removes transformers' ``enable_input_require_grads`` hooks (which transformers'
    checkpointing, the Trainer and peft add so that reentrant checkpointing of a frozen
    base has an input that requires grad), returning whether there were any. memfit's
    checkpoints are not reentrant and need none; left on, they keep the embeddings' output
    and its gradient alive for nothing."""
    found = False
    for mod in model.modules():
        own = vars(mod)
        if (own.get("_require_grads_hooks") or "_require_grads_hook" in own) and hasattr(mod, "disable_input_require_grads"):
            mod.disable_input_require_grads()
            own.pop("_require_grads_hook", None)  # transformers < 5 removes the hook and keeps the attribute
            found = True
    return found


def _checkpointing_off(trainer_args: Any, model: torch.nn.Module, say: Callable[[str], None]) -> None:
    """transformers' own checkpointing recomputes every layer, whatever the budget: memfit's
    plan replaces it (two checkpoints around one layer would recompute it twice)."""
    asked = bool(getattr(trainer_args, "activation_checkpointing", None) or getattr(trainer_args, "gradient_checkpointing", None))
    inner = _transformers_model(model)
    on_model = (
        bool(getattr(inner, "is_activation_checkpointing", False))
        if hasattr(type(inner), "is_activation_checkpointing")
        else bool(getattr(inner, "is_gradient_checkpointing", False))
    )
    if not (asked or on_model):
        return
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(trainer_args, name, None):
            setattr(trainer_args, name, False)
    if on_model:
        disable = getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable
        disable()
    hooks = (
        " and its enable_input_require_grads hook removed (memfit's checkpoints do not need it)"
        if _input_grads_off(model)
        else ""
    )
    say(
        f"gradient_checkpointing=True recomputes every layer whatever the budget: turned off{hooks}; memfit's plan recomputes "
        "only what the budget needs (nothing if the step fits as it is)"
    )


class MemfitCallback(TrainerCallback):
    """Fits the Trainer's step to ``budget`` at ``on_train_begin`` (recompute only: the
    dataloader is built by then) and reports predicted and measured peak.

    :func:`fit_trainer` does the fitting before ``train()`` (micro-batches too) and adds
    one of these, already fitted, to report.
    """

    def __init__(self, budget: int | str, *, fake: bool | str | Where = False, log: Callable[[str], None] | None = None) -> None:
        self.budget = budget
        self.where = Where.of(fake)
        self.fake = self.where.fake
        self.say = log or say
        self.plan: Plan | None = None
        self.recipe: Recipe | None = None
        self.predicted_peak_bytes: int | None = None
        self.measured_peak_bytes: int | None = None
        """The recorder's ledger peak of the chosen step run for real (None when planned on fake tensors)."""
        self.step_peaks: list[int] = []
        """CUDA: ``torch.cuda.max_memory_allocated`` of each training step."""
        self._device: torch.device | None = None
        self._fitted = False

    # -- fitting ---------------------------------------------------------------------------

    def _fit_plan(self, args: Any, model: torch.nn.Module, optimizer: Any, loader: Any, trainer: Any) -> None:
        _checkpointing_off(args, model, self.say)
        if applied_choices(unwrap(model)) is not None:
            raise PlanError("the trainer's model already has a memfit plan applied; call memfit.remove(model) first")
        batch = step_inputs(model, _first_batch(trainer, loader))
        opt = _plain_optimizer(optimizer)
        found = make_plan(model, batch, self.budget, optimizer=opt, fake=self.where)
        self.plan = found
        self.predicted_peak_bytes = found.predicted_peak_bytes
        self.measured_peak_bytes = None if self.fake else found.predicted_peak_bytes  # verified by running it
        if found.checkpointed:
            apply(model, found)
        n = len(found.checkpointed)
        self.say(
            f"budget {format_bytes(found.budget_bytes)}: recompute {n} module{'s' if n != 1 else ''} "
            f"(no plan {format_bytes(found.none_peak_bytes)}); predicted peak {format_bytes(found.predicted_peak_bytes)}"
            + (" on fake tensors" if self.fake else ", measured the same (memfit's ledger of the planned step run on the model)")
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if not self._fitted:
            self._fit_plan(args, model, kwargs["optimizer"], kwargs.get("train_dataloader"), _TrainerView(args, kwargs))
            self._fitted = True

    # -- measuring -------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._device is None or self._device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(self._device)
        self.step_peaks.append(peak)
        if len(self.step_peaks) == 1 or peak > max(self.step_peaks[:-1]):
            over = " OVER the budget" if self.predicted_peak_bytes and peak > self._budget_bytes() else ""
            self.say(
                f"step {state.global_step}: measured peak {format_bytes(peak)} (torch.cuda.max_memory_allocated), "
                f"predicted {format_bytes(self.predicted_peak_bytes or 0)}{over}"
            )

    def _budget_bytes(self) -> int:
        if self.recipe is not None:
            return self.recipe.budget_bytes
        return self.plan.budget_bytes if self.plan is not None else 0


class _TrainerView:
    """What :func:`_first_batch` needs of a Trainer, from a callback's arguments: the
    dataloader is given, and batches go to the device as ``Trainer._prepare_inputs`` puts them."""

    def __init__(self, args: Any, kwargs: dict[str, Any]) -> None:
        self.args = args

    def get_train_dataloader(self) -> Any:  # pragma: no cover - the callback always passes the loader
        raise WorkloadError("the Trainer passed no train_dataloader to the callback")

    def _prepare_inputs(self, batch: Any) -> Any:
        device = self.args.device
        if isinstance(batch, Mapping):
            return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch


def fit_trainer(
    trainer: Any,
    budget: int | str,
    *,
    mode: str = "fit",
    allow: str | Iterable[str] | None = None,
    fake: bool | str | Where = False,
    log: Callable[[str], None] | None = None,
) -> MemfitCallback:
    """Fit ``trainer``'s training step to ``budget`` (bytes: ``"6GiB"``; ``mode="plan"``
    also takes a fraction) before ``trainer.train()``, in the Trainer's own terms.

    ``mode="fit"`` (default): :func:`memfit.fit` weighs recompute and micro-batches (and
    ``allow="8bit"``, set as ``optim="adamw_bnb_8bit"``), timing real steps. ``mode="plan"``: recompute
    only (:func:`memfit.plan`; ``fake=True`` plans on fake tensors, no memory used).

    Changes, in place: the model (the recompute plan, undone by ``memfit.remove(model)``),
    ``trainer.args`` (batch size, accumulation steps, precision, optimizer, checkpointing off).
    Returns the :class:`MemfitCallback` it added to the trainer, which holds the recipe or
    plan and the predicted and measured peaks, and logs CUDA step peaks while training.
    """
    if mode not in ("fit", "plan"):
        raise PlanError(f"fit_trainer's mode is 'fit' (every exact lever) or 'plan' (recompute only), got {mode!r}")
    allowed = parse_allow(allow)
    other = sorted(allowed - set(_TRAINER_LEVERS))
    if other:
        why = "amp: the Trainer fixes its mixed precision in __init__; pass bf16=True (or fp16=True) in its TrainingArguments"
        raise PlanError(
            f"fit_trainer cannot set {', '.join(other)} on a built Trainer"
            + (f" ({why})" if "amp" in other else " (the TrainingArguments have no argument for it)")
            + f"; it may allow {', '.join(_TRAINER_LEVERS)}"
        )
    if mode == "plan" and allowed:
        raise PlanError("allow= is for mode='fit': mode='plan' only recomputes")
    if Where.of(fake).fake and mode == "fit":
        raise PlanError("fake=True is for mode='plan': fit times real steps to choose the fastest recipe")
    callback = MemfitCallback(budget, fake=fake, log=log)
    say = callback.say
    args = trainer.args
    model = trainer.model
    _checkpointing_off(args, model, say)
    if applied_choices(unwrap(model)) is not None:
        raise PlanError("the trainer's model already has a memfit plan applied; call memfit.remove(model) first")
    model_, batch, optimizer, what = trainer_step(trainer)
    say(_measuring(model_, batch, what))
    if mode == "plan":
        callback._fit_plan(args, model, optimizer, [batch], _NoMove())
        callback._fitted = True
        trainer.add_callback(callback)
        return callback
    recipe = fit(model, batch, budget, optimizer=optimizer, allow=allowed, exclude=_NO_SWITCH)
    callback.recipe = recipe
    callback.plan = recipe.plan
    callback.predicted_peak_bytes = recipe.predicted_peak_bytes
    callback.measured_peak_bytes = recipe.measured_peak_bytes
    callback._fitted = True
    kwargs = recipe.training_arguments(args.gradient_accumulation_steps)
    kwargs.pop("gradient_checkpointing", None)  # off already
    batch_before = args.per_device_train_batch_size
    for key, value in kwargs.items():
        setattr(args, key, value)
    if "per_device_train_batch_size" in kwargs:
        # the Trainer keeps its own copy from __init__; the dataloader is built from it
        trainer._train_batch_size = args.train_batch_size
    if recipe.plan is not None and recipe.plan.checkpointed:
        apply(model, recipe.plan)
    trainer.add_callback(callback)
    settings = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "none changed"
    batch_note = ""
    if "per_device_train_batch_size" in kwargs:
        batch_note = f" (per-device batch {batch_before} -> {kwargs['per_device_train_batch_size']}: effective batch unchanged)"
    measured = recipe.measured_peak_bytes
    say(
        f"budget {format_bytes(recipe.budget_bytes)}: {recipe.summary()}; TrainingArguments: {settings}{batch_note}; "
        f"peak as it is {format_bytes(recipe.base_peak_bytes)}, predicted {format_bytes(recipe.predicted_peak_bytes)}"
        + (f", measured {format_bytes(measured)} (memfit's ledger of the recipe's step run on the model)" if measured else "")
    )
    return callback


def _measuring(model: torch.nn.Module, batch: Mapping[str, Any], what: str) -> str:
    head = " with TRL's fused LM head (fused_lm_head=True, as SFTTrainer.compute_loss calls it)" if batch.get("fused_lm_head") else ""
    return (
        f"measuring the trainer's step: {type(unwrap(model)).__name__}{head}, first batch of its dataloader, "
        f"loss = outputs.loss, {what}"
    )


class _NoMove:
    """The batch handed over is on the device already."""

    def _prepare_inputs(self, batch: Any) -> Any:
        return batch
