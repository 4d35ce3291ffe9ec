"""memfit with Hugging Face accelerate: fit a step that ``Accelerator`` prepared to a memory
budget, and estimate a model's training memory activations included.

::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fitted = fit_accelerator(accelerator, model, optimizer, next(iter(loader)), "6GiB")
    for batch in loader:                           # the user's own loop, unchanged
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()

What is measured is the step as accelerate runs it: the prepared model, whose ``forward``
accelerate wrapped in autocast (``mixed_precision="bf16"`` / ``"fp16"``) and a cast of its
outputs to float32; the loss outside autocast, divided by ``gradient_accumulation_steps``
as ``accelerator.backward`` divides it, scaled by the GradScaler with fp16; the user's
optimizer inside the ``AcceleratedOptimizer``. With ``k > 1`` accumulation steps, the step
planned and measured is one micro-batch of ``batch`` (what one ``accumulate`` block sees)
starting with the gradients the micro-batches before it left: the last and highest of the
``k`` (the optimizer steps after it), as :func:`memfit.fit` plans micro-batches.

The recipe is a recompute plan (:func:`memfit.plan`), applied to the model in place and
undone by :meth:`AcceleratorFit.remove` (or ``memfit.remove(model)``). It does not change
what training computes (memfit's recompute replays dropout's random numbers), nor the
model's, optimizer's or RNG's state when it is made.

:func:`estimate_memory` is ``accelerate estimate-memory`` with the step measured: the
model built from a config (never downloaded, never given weights: its parameters are
allocated untouched and only their shapes are read) and one training step run on fake
tensors, beside accelerate's own numbers for the same model, which count parameters,
gradients and Adam's state but no activations.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.utils._pytree import tree_map

from memfit.apply import apply, remove
from memfit.errors import PlanError, TargetError, WorkloadError
from memfit.integrations._common import first_batch_of, say
from memfit.measure.ledger import Category
from memfit.measure.profile import Profile, profile
from memfit.measure.step import StepOptions
from memfit.plan.planner import plan as make_plan
from memfit.plan.result import Plan
from memfit.recompute.checkpoint import applied_choices, unwrap
from memfit.units import format_bytes
from memfit.workload import Where

__all__ = [
    "AcceleratorFit",
    "fit_accelerator",
    "accelerator_step",
    "Estimate",
    "EstimateRow",
    "estimate_memory",
    "ESTIMATE_DTYPES",
]


# -- fitting a prepared step ---------------------------------------------------------------


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # memfit restores and copies the user's optimizer; accelerate's wrapper only forwards to it
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def accelerator_step(accelerator: accelerate.Accelerator) -> StepOptions:
    """The step one ``accelerator.accumulate`` block runs, as :class:`StepOptions`. The
    autocast is not among them: it is in the prepared model's forward already."""
    if accelerator.num_processes > 1:
        raise WorkloadError(
            f"fit_accelerator measures a single process's step; this accelerator runs {accelerator.num_processes} "
            "(memfit.integrations.accelerate does not model gradient synchronisation)"
        )
    if accelerator.mixed_precision not in ("no", "bf16", "fp16"):
        raise WorkloadError(
            f"mixed_precision={accelerator.mixed_precision!r}: memfit measures 'no', 'bf16' and 'fp16' (torch's autocast)"
        )
    k = accelerator.gradient_accumulation_steps
    if k == 1:
        return StepOptions(grad_scaler=accelerator.scaler is not None)
    # the last micro-batch: the gradients of the k - 1 before it alive when it starts
    return StepOptions(loss_scale=1.0 / k, set_to_none=False, grad_scaler=accelerator.scaler is not None)


def _on_device(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


@dataclass
class AcceleratorFit:
    """What :func:`fit_accelerator` chose and measured."""

    plan: Plan
    step: StepOptions
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    """The recorder's ledger peak of the planned step run for real on the model (None when planned on fake tensors)."""
    model: nn.Module = field(repr=False)

    def remove(self) -> None:
        """Undo the recompute plan on the model (nothing else was changed)."""
        if applied_choices(unwrap(self.model)) is not None:
            remove(self.model)


def fit_accelerator(
    accelerator: accelerate.Accelerator,
    model: nn.Module,
    optimizer: Any,
    batch: Any,
    budget: int | float | str,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Any = None,
    fake: bool | str | Where = False,
    log: Callable[[str], None] | None = None,
) -> AcceleratorFit:
    """Plan recompute so the step ``accelerator`` runs on ``model`` and ``optimizer``
    (both as ``accelerator.prepare`` returned them) peaks within ``budget``, and apply it.

    Args:
        batch: one batch as the prepared dataloader yields it (what the model is called
            with: a dict of keyword arguments, a tuple or a tensor), or the dataloader
            itself: its first batch is taken without moving any random generator, so the
            run's data order and dropout stay as they would be without memfit.
        budget: bytes (``"6GiB"``) or a fraction (``"50%"``), as for :func:`memfit.plan`.
        loss_fn, targets: as for :func:`memfit.profile` (default ``output.loss``).
        fake: plan on fake tensors (no memory used; nothing is measured for real).
        log: where the one-line report goes (default stderr, ``memfit: ...``).

    Returns:
        An :class:`AcceleratorFit` (plan, predicted and measured peak); the plan is applied
        to ``model``, in place: ``.remove()`` undoes it.
    """
    tell = log or say
    where = Where.of(fake)
    step = accelerator_step(accelerator)
    if applied_choices(unwrap(model)) is not None:
        raise PlanError("the model already has a memfit plan applied; call memfit.remove(model) first")
    inner = _inner_optimizer(optimizer)
    if isinstance(batch, torch.utils.data.DataLoader):
        batch = first_batch_of(batch)
        if batch is None:
            raise WorkloadError("the dataloader is empty: there is no batch to measure a step on")
    device = next((p.device for p in model.parameters()), accelerator.device)
    batch, targets = _on_device(batch, device), _on_device(targets, device)
    found = make_plan(model, batch, budget, loss_fn=loss_fn, optimizer=inner, fake=where, step=step, targets=targets)
    measured = None
    if found.checkpointed:
        apply(model, found)
    if not where.fake:
        # measured apart from the planner's verification: the step with the plan on the model
        try:
            measured = profile(model, batch, loss_fn=loss_fn, optimizer=inner, step=step, targets=targets).peak_bytes
        except BaseException:
            if found.checkpointed:
                remove(model)  # an error leaves the model as it was given
            raise
    n = len(found.checkpointed)
    k = accelerator.gradient_accumulation_steps
    how = f"mixed_precision={accelerator.mixed_precision!r}" + (f", the last of {k} accumulated micro-batches" if k > 1 else "")
    tell(
        f"budget {format_bytes(found.budget_bytes)}: recompute {n} module{'s' if n != 1 else ''} "
        f"(no plan {format_bytes(found.none_peak_bytes)}); predicted peak {format_bytes(found.predicted_peak_bytes)}"
        + (" on fake tensors" if measured is None else f", measured {format_bytes(measured)}")
        + f" ({how})"
    )
    return AcceleratorFit(found, step, found.predicted_peak_bytes, measured, model)


# -- estimate-memory, activations included -------------------------------------------------

ESTIMATE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
"""accelerate estimate-memory's dtypes, and bfloat16 (which its estimator also knows)."""
_TRAINED = {
    "float32": StepOptions(),
    # what Accelerator(mixed_precision="fp16") / "bf16" run: fp32 weights and Adam state, autocast forward
    "float16": StepOptions(autocast="float16", grad_scaler=True),
    "bfloat16": StepOptions(autocast="bfloat16"),
}
_LOAD_DIVISOR = {"float32": 1, "float16": 2, "bfloat16": 2, "int8": 4, "int4": 8}
"""accelerate's gather_data: the size in a dtype is the float32 size divided by this."""


@dataclass(frozen=True)
class EstimateRow:
    dtype: str
    largest_layer_bytes: int
    """accelerate's: the largest module's parameters in ``dtype``."""
    total_bytes: int
    """accelerate's: the parameters in ``dtype`` (loading the model)."""
    accelerate_training_bytes: int | None
    """accelerate's "Training using Adam": the largest of its model / gradients / optimizer /
    step terms; None where it has none (int8, int4)."""
    memfit_peak_bytes: int | None
    """memfit: the peak of one training step (AdamW, activations included) measured on fake
    tensors; None where memfit does not train in this dtype (int8, int4)."""
    memfit_breakdown: dict[str, int] = field(default_factory=dict)
    """memfit: bytes alive at that peak: parameters, gradients, optimizer_state, activations (saved for backward), other."""
    memfit_peak_phase: str | None = None
    """Where in the step memfit's peak is (forward, backward, optimizer)."""
    step: dict[str, Any] | None = None
    """How memfit's step ran (:class:`StepOptions` as a dict)."""


@dataclass(frozen=True)
class Estimate:
    model: str
    """The config it was built from and the model class."""
    batch_size: int
    seq_len: int
    device: str
    rows: tuple[EstimateRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "device": self.device,
            "rows": [asdict(row) for row in self.rows],
        }


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the hf extra installs both
        raise TargetError("memfit estimate builds transformers models: pip install 'memfit[hf]'") from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _config(spec: str, sizes: Mapping[str, Any]) -> Any:
    """A local config.json (or a folder holding one), or a model type with its default sizes."""
    tf = _transformers()
    path = Path(spec)
    if path.is_dir() and not (path / "config.json").is_file():
        raise TargetError(f"{spec}: the folder has no config.json; give a config.json or a model type such as 'llama'")
    if path.is_file() or path.is_dir():
        try:
            with _offline():
                return tf.AutoConfig.from_pretrained(str(path), **sizes)
        except _size_errors() as exc:
            raise _bad_sizes(spec, sizes, exc) from exc
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise TargetError(f"{spec} is not a transformers config ({type(exc).__name__}: {first})") from exc
    types = tf.models.auto.configuration_auto.CONFIG_MAPPING
    if spec in types:
        try:
            return tf.AutoConfig.for_model(spec, **sizes)
        except (*_size_errors(), TypeError, ValueError) as exc:
            if not sizes:  # the model type's own defaults failed: not the user's sizes
                raise
            raise _bad_sizes(spec, sizes, exc) from exc
    raise TargetError(
        f"{spec!r} is neither a local config.json (or a folder with one) nor a transformers model type (llama, gpt2, "
        "t5, ...); memfit downloads nothing: save the Hub model's config.json and give its path"
    )


def _size_errors() -> tuple[type[Exception], ...]:
    """What a config raises for a field of the wrong type: transformers 5's configs are
    huggingface_hub strict dataclasses (older ones raise nothing of their own)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _bad_sizes(spec: str, sizes: Mapping[str, Any], exc: Exception) -> TargetError:
    said = " ".join(str(exc).split())[:200]
    given = ", ".join(f"{k}={v!r}" for k, v in sizes.items())
    return TargetError(
        f"{spec}: the config refused the sizes {given} ({said}); give one KEY=VALUE per --size (--size a=1 --size b=2)"
    )


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    # a local path only: never reach for the Hub, even when the path also looks like a repo id
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def _model_on_meta(config: Any) -> nn.Module:
    tf = _transformers()
    config.use_cache = False  # a training step keeps no KV cache
    autos = [tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM, tf.AutoModelForMaskedLM]
    if getattr(config, "is_encoder_decoder", False):
        autos.insert(0, autos.pop(1))
        if getattr(config, "decoder_start_token_id", None) is None:
            # the labels are shifted right into the decoder's inputs from this token; which
            # token it is changes no memory
            config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    tried = []
    for auto in autos:
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel"
            tried.append(auto.__name__)
    raise TargetError(
        f"{type(config).__name__} has no language-model head ({', '.join(tried)}): memfit estimate and finetune train token models; "
        "measure others with memfit profile path/to/file.py:workload --device fake"
    )


def _materialize(model: nn.Module) -> None:
    """CPU tensors for the meta model's, their memory never touched (so never resident):
    fake tensors are made from real ones, and only shapes, dtypes and strides are read."""
    meta_count = sum(p.numel() for p in model.parameters())  # tied weights once
    model.to_empty(device="cpu")
    # to_empty gives each module its own tensor, untying shared weights (GPT-2's lm_head and
    # wte): a step with a second copy, its gradient and its Adam state. Tie them again.
    model.tie_weights()
    count = sum(p.numel() for p in model.parameters())
    if count != meta_count:
        raise TargetError(
            f"{type(model).__name__}: {count} parameters once built, {meta_count} as configured; memfit cannot tell which "
            "weights this model shares"
        )


def _accelerate_rows(model: nn.Module, dtypes: tuple[str, ...]) -> dict[str, tuple[int, int, int | None]]:
    """accelerate estimate-memory's numbers for ``model``, with its own functions: the
    meta model stands in for the one it would build from the Hub."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, (largest, _) = calculate_maximum_sizes(model)
    out = {}
    for dtype in dtypes:
        usage = max(estimate_training_usage(total, dtype).values())
        div = _LOAD_DIVISOR[dtype]
        out[dtype] = (int(largest // div), int(total // div), None if usage == -1 else int(usage))
    return out


def estimate_memory(
    config: str,
    *,
    dtypes: tuple[str, ...] | list[str] = ("float32", "float16", "int8", "int4"),
    batch_size: int = 1,
    seq_len: int = 512,
    sizes: Mapping[str, Any] | None = None,
    fake: bool | str | Where = True,
    progress: Callable[[str], None] | None = None,
) -> Estimate:
    """accelerate's estimate-memory numbers and memfit's measured training-step peak per
    dtype, for the model ``config`` describes.

    Args:
        config: a local ``config.json`` (or a folder with one), or a transformers model type
            (``"llama"``: its config class's default sizes, Llama-2-7B's for llama).
        dtypes: as accelerate's ``--dtypes`` (float32, float16, int8, int4), and bfloat16.
            memfit trains float32 as it is and float16 / bfloat16 as accelerate's mixed
            precision does (float32 weights and AdamW state, the forward under autocast).
        batch_size, seq_len: the step's ``input_ids`` (and ``labels``); accelerate's
            numbers are for any batch: they have no activations.
        sizes: config overrides (``num_hidden_layers=4``).
        fake: ``True`` (fake CPU tensors) or ``"cuda"`` (fake CUDA: CUDA's autocast and kernels).
    """
    bad = [d for d in dtypes if d not in ESTIMATE_DTYPES]
    if bad or not dtypes:
        raise TargetError(f"dtypes are among {', '.join(ESTIMATE_DTYPES)}, got {', '.join(bad) or 'none'}")
    where = Where.of(fake)
    if not where.fake:
        raise TargetError(f"estimate_memory runs on fake tensors: fake is True or 'cuda', got {fake!r}")
    if batch_size < 1 or seq_len < 1:
        raise TargetError(f"batch_size and seq_len are positive, got {batch_size} and {seq_len}")
    instead = {
        "batch_size": "--batch-size N (in Python, batch_size=)",
        "seq_len": "--seq-len N (in Python, seq_len=)",
        "model_type": "the model type as CONFIG (in Python, config=)",
    }
    clash = [k for k in (sizes or {}) if k in instead]
    if clash:
        # the step's shape or the config's kind, not config fields: as sizes they would be a
        # config attribute nothing reads (batch_size, seq_len) or a clash of arguments (model_type)
        raise TargetError(f"{clash[0]} is not a config override (--size): give {instead[clash[0]]}")
    tell = progress or (lambda message: None)
    cfg = _config(config, dict(sizes or {}))
    model = _model_on_meta(cfg)
    theirs = _accelerate_rows(model, tuple(dtypes))
    # Real CPU tensors whose memory is never touched (so never resident): fake tensors are
    # made from real ones, and only shapes, dtypes and strides are read from these.
    _materialize(model)
    vocab = getattr(cfg, "vocab_size", None) or 2
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    rows = []
    for dtype in dtypes:
        options = _TRAINED.get(dtype)
        largest, total, usage = theirs[dtype]
        if options is None:
            rows.append(EstimateRow(dtype, largest, total, usage, None))
            continue
        tell(f"profiling a {dtype} training step on fake tensors")
        prof: Profile = profile(model, inputs, fake=where, step=options)
        at_peak = _breakdown(prof.breakdown)
        rows.append(EstimateRow(dtype, largest, total, usage, prof.peak_bytes, at_peak, prof.peak["phase"], options.to_dict()))
    count = sum(p.numel() for p in model.parameters())
    name = (
        f"{config} ({type(model).__name__}, {count / 1e9:.2f}B parameters)"
        if count >= 1e8
        else (f"{config} ({type(model).__name__}, {count / 1e6:.1f}M parameters)")
    )
    device = where.value
    return Estimate(name, batch_size, seq_len, device, tuple(rows))


def _breakdown(at_peak: Mapping[str, int]) -> dict[str, int]:
    """The three terms accelerate counts, the activations it leaves out, and the rest
    (inputs, buffers, temporaries, kernel workspace; on CPU autograd's graph)."""
    kept = (Category.PARAMETER.value, Category.GRADIENT.value, Category.OPTIMIZER.value, Category.ACTIVATION.value)
    out = {name: at_peak.get(name, 0) for name in kept}
    out["other"] = sum(n for name, n in at_peak.items() if name not in kept)
    return out
