"""A LoRA fine-tune (peft) of a transformers model, from its ``config.json`` alone: the step
``memfit finetune`` measures on fake CUDA (issue 27, item 3).

The model is built on the meta device (no weights made, nothing initialised), its base cast
to the frozen dtype, wrapped by peft's ``get_peft_model`` there, then given CPU memory that is
never touched (:func:`memfit.integrations.accelerate.estimate_memory`'s way): fake tensors are
made from it, and only shapes, dtypes and strides are read. So a 7-8B config costs no memory
and no initialisation time. The step is the one a peft recipe runs: ``input_ids`` and
``labels`` of ``batch x seq_len`` tokens, ``outputs.loss``, AdamW over the adapters only.

QLoRA (``quant="4bit"``): the base's linear layers (all but the output head, as transformers'
``BitsAndBytesConfig(load_in_4bit=True)`` converts them) become bitsandbytes ``Linear4bit``
layers quantized on meta by bitsandbytes itself (:mod:`memfit.compat.bnb4bit`): their packed
weights and quantization state in the ledger, and peft wraps them with its 4-bit LoRA layer.
8-bit (``quant="8bit"``, ``BitsAndBytesConfig(load_in_8bit=True)``): the same linears become
LLM.int8 ``Linear8bitLt`` layers (int8 weights and float32 row scales,
:mod:`memfit.compat.bnb8bit`), wrapped by peft's 8-bit LoRA layer; their matmul's outlier
columns are assumed none (:func:`memfit.compat.bnb8bit.assume_outliers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from memfit.compat import bnb4bit, bnb8bit, optim8bit
from memfit.errors import BudgetInfeasibleError, TargetError
from memfit.integrations.accelerate import _config, _materialize, _model_on_meta
from memfit.levers.max_batch import BatchLimit, largest_size
from memfit.measure.checked import Step, checked_step
from memfit.measure.extrapolate import Layers
from memfit.measure.layered import LayeredSession
from memfit.measure.profile import FakeSession, fake_session
from memfit.measure.step import StepOptions, first_micro_batches
from memfit.plan.planner import plan as make_plan
from memfit.workload import Where, Workload, resize_batch

__all__ = [
    "LoraSpec",
    "lora_workload",
    "lora_session",
    "layer_stack",
    "EXTRAPOLATE_FROM",
    "largest_batch",
    "largest_seq_len",
    "levers_that_fit",
    "BASE_DTYPES",
    "QUANTS",
    "PAGED_MIN_NUMEL",
]

PAGED_MIN_NUMEL = optim8bit.PAGED_MIN_NUMEL

BASE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTS = ("none", "4bit", "8bit")
ATTNS = ("sdpa", "flash_attention_2")
FLASH2 = "memfit_flash_attention_2"
"""The name the flash-attn stand-in is registered under in transformers (the package itself
needs a CUDA build, so it is never imported here)."""


@dataclass(frozen=True)
class LoraSpec:
    """What peft's ``LoraConfig`` is given (and the frozen base's dtype)."""

    rank: int = 16
    alpha: float | None = None
    """peft's ``lora_alpha`` (default: the rank); a scale on the adapters' output, no memory."""
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    """Module names as peft's ``target_modules`` (suffixes of the model's module names), or ``("all-linear",)``."""
    dropout: float = 0.0
    base_dtype: str = "bfloat16"
    quant: str = "none"
    quant_type: str = "nf4"
    """4-bit only: ``bnb_4bit_quant_type``, nf4 or fp4."""
    double_quant: bool = True
    """4-bit only: ``bnb_4bit_use_double_quant`` (the absmax quantized to 8 bits, QLoRA's default)."""
    compute_dtype: str | None = None
    """4-bit only: ``bnb_4bit_compute_dtype`` (default: the base dtype); what the weight is dequantized to."""
    kbit_prep: bool = False
    """4-bit or 8-bit: the base prepared by peft's ``prepare_model_for_kbit_training`` before the
    adapters go on, as TRL's ``SFTTrainer`` and QLoRA's scripts do: every parameter that is not
    4-bit or int8 (embeddings, norms, the output head) cast to float32."""
    int8_outliers: int = 0
    """8-bit only: outlier columns assumed in each int8 matmul's input (LLM.int8's
    decomposition; data-dependent, so assumed: 0, or the widest input, ``intermediate_size``, for the upper bound)."""
    attn: str = "sdpa"
    """The attention: ``sdpa`` (transformers' default, torch's kernel choice) or
    ``flash_attention_2`` (what the flash-attn package's path in transformers keeps)."""
    autocast_adapter_dtype: bool = True
    """peft's ``get_peft_model(..., autocast_adapter_dtype=...)``: True (peft's default) keeps
    16-bit adapters in float32; False leaves them in the dtype peft makes them in, the base
    layer's where it is floating point (bfloat16 over a bfloat16 base; float32 over a 4-bit one)."""

    def check(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise TargetError(f"the LoRA rank is a positive integer (8, 16, 64), got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise TargetError(f"the LoRA dropout is a probability in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in BASE_DTYPES:
            raise TargetError(f"the base dtype is one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}")
        if self.quant not in QUANTS:
            raise TargetError(f"quant is none, 4bit or 8bit, got {self.quant!r}")
        if self.quant != "none":
            why = bnb4bit.unavailable()
            if why:
                raise TargetError(f"--quant {self.quant} needs bitsandbytes: {why}")
        if self.quant_type not in bnb4bit.QUANT_TYPES:
            raise TargetError(f"the 4-bit quant type is nf4 or fp4, got {self.quant_type!r}")
        if self.compute_dtype is not None and self.compute_dtype not in BASE_DTYPES:
            raise TargetError(f"the 4-bit compute dtype is one of {', '.join(BASE_DTYPES)}, got {self.compute_dtype!r}")
        if self.kbit_prep and self.quant == "none":
            raise TargetError("prepare_model_for_kbit_training (--kbit-prep) prepares a quantized base: give --quant 4bit or 8bit too")
        if isinstance(self.int8_outliers, bool) or not isinstance(self.int8_outliers, int) or self.int8_outliers < 0:
            raise TargetError(f"the int8 outlier columns are a non-negative integer, got {self.int8_outliers!r}")
        if self.int8_outliers and self.quant != "8bit":
            raise TargetError("outlier columns (--int8-outliers) are LLM.int8's: give --quant 8bit too")
        if self.attn not in ATTNS:
            raise TargetError(f"the attention is one of {', '.join(ATTNS)}, got {self.attn!r}")
        if not self.targets or any(not t for t in self.targets):
            raise TargetError("give the LoRA target modules, e.g. q_proj,v_proj (or all-linear)")


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise TargetError("a LoRA fine-tune needs peft: pip install 'memfit[hf,peft]'") from exc
    return peft


def _linear_names(model: nn.Module) -> list[str]:
    """The last part of the name of each Linear-like leaf (GPT-2's Conv1D too): what a
    ``target_modules`` entry is matched against."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if not list(m.children()) and n}
    kinds = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    return sorted(kinds & names)


def _check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Each target names at least one module (peft only refuses when none of them does)."""
    if tuple(targets) == ("all-linear",):
        return
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise TargetError(
            f"LoRA target module {missing[0]!r} is not in {type(model).__name__}: its linear layers are "
            f"{', '.join(_linear_names(model))} (or give all-linear)"
        )


def lora_model(config: str, spec: LoraSpec, *, sizes: Mapping[str, Any] | None = None, checkpointing: bool = False) -> nn.Module:
    """The peft model for ``config`` (a local config.json, its folder, or a model type):
    the base on meta in ``spec.base_dtype``, wrapped by ``get_peft_model`` (adapters in
    float32, as peft keeps them), then given untouched CPU memory."""
    spec.check()
    peft = _peft()
    cfg = _config(config, dict(sizes or {}))
    base = _model_on_meta(cfg)
    _check_targets(base, spec.targets)
    base.to(BASE_DTYPES[spec.base_dtype])
    if spec.quant == "4bit":
        compute = BASE_DTYPES[spec.compute_dtype or spec.base_dtype]
        bnb4bit.quantize_linears(base, quant_type=spec.quant_type, double_quant=spec.double_quant, compute_dtype=compute)
        if spec.kbit_prep:
            # peft's own function, on the meta base (no memory moves): its casts are what it does
            # on a GPU; checkpointing is switched on below, as the caller asked
            peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False, auto_clear_cache=False)
    elif spec.quant == "8bit":
        bnb8bit.quantize_linears(base)
        if spec.kbit_prep:  # int8 weights are not cast: everything else goes to float32, as for 4-bit
            peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False, auto_clear_cache=False)
    targets: Any = "all-linear" if tuple(spec.targets) == ("all-linear",) else list(spec.targets)
    lora = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha if spec.alpha is not None else spec.rank,
        target_modules=targets,
        lora_dropout=spec.dropout,
    )
    try:
        model = peft.get_peft_model(base, lora, autocast_adapter_dtype=spec.autocast_adapter_dtype)
    except ValueError as exc:  # peft's own refusals (a target that is not a layer it can wrap)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise TargetError(f"peft refused the LoRA config: {first}") from exc
    _materialize(model)
    if spec.quant == "4bit":
        bnb4bit.materialize(model)
    elif spec.quant == "8bit":
        bnb8bit.materialize(model)
    if spec.attn == "flash_attention_2":
        _use_flash2(base, BASE_DTYPES[spec.base_dtype])
    if checkpointing:
        # as peft's recipes turn it on (prepare_model_for_kbit_training, the Trainer)
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
    return model


def _flash2(dtype: torch.dtype) -> Callable[..., tuple[torch.Tensor, None]]:
    """transformers' ``flash_attention_2`` path, as it holds memory, for an unpadded causal
    batch: a float32 query, key and value cast to 16 bits (flash-attn takes nothing else;
    transformers casts to the autocast dtype, else a quantized model's ``config.dtype``, which
    is ``dtype`` here), grouped K/V passed as they are, and flash attention's kernel, which
    keeps the output and its log-sum-exp, never the S x S scores. torch's flash kernel is the
    same FlashAttention-2 algorithm and saves the same tensors; fake CUDA picks it for 16-bit,
    unmasked, causal inputs."""

    def forward(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            # padding would go through flash-attn's varlen path (unpad, attend, pad): not modelled
            raise TargetError("the flash_attention_2 stand-in takes unpadded batches only (no attention mask)")
        if query.dtype == torch.float32:
            device = query.device.type
            target = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype
            query, key, value = query.to(target), key.to(target), value.to(target)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=query.size(2) > 1, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    return forward


def _use_flash2(base: nn.Module, dtype: torch.dtype) -> None:
    """Attention through :func:`_flash2`'s function, registered with flash-attn's mask
    function (no mask for an unpadded batch), on every config of ``base``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(FLASH2, _flash2(dtype))
    AttentionMaskInterface.register(FLASH2, flash_attention_mask)
    for module in base.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = FLASH2


def lora_inputs(model: nn.Module, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` (a separate tensor, as a collator makes them) of ``batch_size x seq_len`` tokens."""
    if batch_size < 1 or seq_len < 1:
        raise TargetError(f"the batch size and the sequence length are positive, got {batch_size} and {seq_len}")
    vocab = getattr(model.config, "vocab_size", None) or 2
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    # use_cache=False as peft's recipes train (the config says so too): memfit's plan then needs
    # no real-tensor check that turning the cache off changes nothing, which would touch the
    # never-written weights of a model too big for this host
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)  # the Trainer's default optimizer and learning rate


def _optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    if name not in optim8bit.OPTIMIZERS:
        raise TargetError(f"the optimizer is one of {', '.join(optim8bit.OPTIMIZERS)} (the Trainer's optim names), got {name!r}")
    if name == "adamw_torch":
        return _adamw
    why = bnb4bit.unavailable()
    if why:
        raise TargetError(f"optim {name} needs bitsandbytes: {why}")
    return lambda params: optim8bit.by_name(name, params, 1e-4)


def lora_workload(
    config: str,
    spec: LoraSpec,
    *,
    batch_size: int = 1,
    seq_len: int = 512,
    sizes: Mapping[str, Any] | None = None,
    checkpointing: bool = False,
    optim: str = "adamw_torch",
    accumulate: int = 1,
    autocast: str | None = None,
) -> Workload:
    """The LoRA fine-tune's training step as a :class:`memfit.Workload`: the peft model of
    :func:`lora_model`, ``batch_size x seq_len`` tokens, ``outputs.loss``, the optimizer the
    Trainer's ``optim`` names (torch's AdamW; bitsandbytes' 8-bit or paged AdamW) over the
    adapters (the Workload's optimizer takes the trainable parameters only). A paged
    optimizer's paged state is not in the step's ledger (unified memory, outside the
    allocator): ``meta["paged_optimizer_state_bytes"]`` holds it. ``accumulate``: the Trainer's
    ``gradient_accumulation_steps``, passes of the whole batch before the optimizer step
    (:attr:`memfit.StepOptions.accumulate`; the step of every session made from it). ``autocast``:
    the Trainer's ``bf16=True`` (``"bfloat16"``) or ``fp16=True`` (``"float16"``, with a GradScaler):
    forward and loss under ``torch.autocast``."""
    if autocast not in (None, "bfloat16", "float16"):
        raise TargetError(f"autocast is bfloat16 or float16 (the Trainer's bf16 or fp16), got {autocast!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise TargetError(f"the gradient accumulation steps are a positive integer, got {accumulate!r}")
    make_optimizer = _optimizer(optim)
    model = lora_model(config, spec, sizes=sizes, checkpointing=checkpointing)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(bnb4bit.values(p) for p in model.parameters())
    name = (
        f"{type(model.base_model.model).__name__} ({total / 1e9:.2f}B parameters) LoRA r={spec.rank} on "
        f"{','.join(spec.targets)} ({trainable / 1e6:.2f}M trainable), {_base_words(spec)}, "
        + ("flash_attention_2 (stand-in), " if spec.attn == "flash_attention_2" else "")
        + ("" if spec.autocast_adapter_dtype else "adapters not autocast to float32, ")
        + f"batch {batch_size} x {seq_len}"
        + (f", {accumulate} accumulated passes" if accumulate > 1 else "")
        + (f", {autocast} autocast" if autocast else "")
    )
    meta = {"config": config, "batch_size": batch_size, "seq_len": seq_len, "lora_rank": spec.rank, "trainable": trainable}
    meta["quant"] = spec.quant
    if spec.quant == "8bit":
        meta["int8_outliers"] = spec.int8_outliers
    meta["checkpointing"] = checkpointing
    meta["optim"] = optim
    meta["accumulate"] = accumulate
    meta["autocast"] = autocast
    adapters = [p for p in model.parameters() if p.requires_grad]
    meta["paged_optimizer_state_bytes"] = optim8bit.paged_state_bytes(adapters, optim)
    return Workload(model, lora_inputs(model, batch_size, seq_len), optimizer=make_optimizer, name=name, meta=meta)


def _base_words(spec: LoraSpec) -> str:
    elsewhere = "float32 elsewhere: prepare_model_for_kbit_training" if spec.kbit_prep else f"{spec.base_dtype} elsewhere"
    if spec.quant == "8bit":
        return f"8-bit LLM.int8 base (threshold {bnb8bit.THRESHOLD:g}, {spec.int8_outliers} outlier columns assumed, {elsewhere})"
    if spec.quant != "4bit":
        return f"{spec.base_dtype} base"
    double = "double quant" if spec.double_quant else "no double quant"
    return f"4-bit {spec.quant_type.upper()} base ({double}, {spec.compute_dtype or spec.base_dtype} compute, {elsewhere})"


def _cut(inputs: Mapping[str, Any], seq_len: int) -> dict[str, Any]:
    """The inputs at ``seq_len`` tokens: cut, or tiled along the sequence (the token ids do not change memory)."""
    out: dict[str, Any] = {}
    for key, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            out[key] = t
            continue
        reps = -(-seq_len // t.shape[1])
        out[key] = t.repeat(1, reps)[:, :seq_len].contiguous()
    return out


EXTRAPOLATE_FROM = 2
"""The fewest layers of the steps a ledger is extrapolated from (k): layer 0 follows the
embeddings, not a layer, so the layer before the one inserted is a middle layer from k = 2.
With transformers' (reentrant) gradient checkpointing, 3: a layer's backward frees the
gradient the layer after it made only in the backward of the layer before it, so a middle
layer's blocks reach two layers back, and layer 0 is not a middle layer."""

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def layer_stack(model: nn.Module) -> tuple[Layers, int] | str:
    """The model's decoder layers, if identical: how their modules are named and how many;
    else why not (the layers differ by config, or share modules or parameters)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        return "the config gives no num_hidden_layers"
    types = getattr(config, "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return f"config.layer_types are not all the same ({', '.join(sorted(set(map(str, types))))})"
    moe = [k for k in MOE_KEYS if getattr(config, k, None)]
    if moe:
        return f"a mixture of experts ({moe[0]}={getattr(config, moe[0])}): its sparse-layer schedule is not checked"
    listed = [k for k, v in config.to_dict().items() if isinstance(v, (list, tuple)) and len(v) == n and k != "layer_types"]
    if listed:
        return f"config.{listed[0]} is a per-layer list"
    stacks = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(stacks) != 1:
        return f"{len(stacks)} module lists of {n} layers in the model, not one"
    name, stack = stacks[0]
    if len({id(m) for m in stack}) != n or len({type(m) for m in stack}) != 1:
        return "the layers are not distinct modules of one type"
    mine = {id(p) for m in stack for p in m.parameters()}
    uses = [id(p) for _, p in model.named_parameters(remove_duplicate=False) if id(p) in mine]
    if len(uses) != len(mine):  # a parameter under two names: tied or shared with another module
        return "the layers share parameters (tied or shared layers)"
    return Layers(name + "."), n


@contextmanager
def lora_session(
    work: Workload, *, fake: bool | str | Where = Where.FAKE_CUDA, rebuild: Callable[[int], Workload] | None = None
) -> Iterator[FakeSession | LayeredSession]:
    """One fake copy of the fine-tune's step for every question asked of it (its profile, the
    largest batch or sequence, the levers): copied and warmed up once, each answer one
    recorded step (:class:`memfit.measure.profile.FakeSession`). Warmed up lightly (the
    optimizer's state made without a forward and backward: :func:`~memfit.measure.profile.light_warm_up`),
    checked against what a warm-up step leaves; where it is not the same, fresh profiles.
    A fake step of a 7-8B model is ~10,000 dispatched ops and most of the answer's time.
    Not with transformers' (reentrant) gradient checkpointing: its steps leave the last layer
    call's arguments alive after them, which the check cannot tell from state a first forward
    makes, so a light warm-up would only add a fresh profile; the warm-up step is run there.

    With ``rebuild`` (the same workload at a given number of layers), a
    :class:`~memfit.measure.layered.LayeredSession`: each answer from steps of
    :data:`EXTRAPOLATE_FROM` (with checkpointing one more), one and two more layers, the whole step's ledger extrapolated
    and checked (:mod:`memfit.measure.extrapolate`); the whole step where the layers are not
    identical (:func:`layer_stack`) or the check fails, its ``note`` saying why.

    An 8-bit base's steps inside assume ``work.meta["int8_outliers"]`` outlier columns per int8
    matmul (:func:`memfit.compat.bnb8bit.assume_outliers`)."""
    with bnb8bit.assume_outliers(work.meta.get("int8_outliers", 0)), bnb8bit.quiet_cast_warning():
        with _session(work, fake, rebuild) as session:
            yield session


@contextmanager
def _session(
    work: Workload, fake: bool | str | Where, rebuild: Callable[[int], Workload] | None
) -> Iterator[FakeSession | LayeredSession]:
    step = _checked(work, fake)
    light = not work.meta.get("checkpointing", False)
    if rebuild is None:
        with fake_session(step, light=light) as session:
            yield session
        return
    k = EXTRAPOLATE_FROM + (1 if work.meta.get("checkpointing") else 0)
    stack = layer_stack(work.model)
    if isinstance(stack, tuple) and stack[1] <= k + 2:
        stack = f"{stack[1]} layers: no fewer to extrapolate from"
    with ExitStack() as open_:
        small: list[FakeSession] = []
        if isinstance(stack, tuple):
            for n in (k, k + 1, k + 2):
                small.append(open_.enter_context(fake_session(_checked(rebuild(n), fake), light=light)))
        layers, total = stack if isinstance(stack, tuple) else (Layers(""), 0)
        refused = stack if isinstance(stack, str) else None
        whole = lambda: fake_session(step, light=light)  # noqa: E731
        with LayeredSession(step, small, layers, k, total, whole, refused=refused) as session:
            yield session


def _checked(work: Workload, fake: bool | str | Where) -> Step:
    # the Trainer's step: compute_loss returns the loss alone, so the logits are gone before backward
    autocast = work.meta.get("autocast")
    options = StepOptions(
        accumulate=work.meta.get("accumulate", 1), drops_output=True, autocast=autocast, grad_scaler=autocast == "float16"
    )
    return checked_step(
        work.model, work.inputs, loss_fn=work.loss_fn, optimizer=work.make_optimizer(), fake=fake, options=options, targets=work.targets
    )


def _seeded(peak: Callable[[int], int], known: Mapping[int, int] | None) -> Callable[[int], int]:
    """``peak``, answering the sizes already measured (the profile's own) without a step."""
    seen = dict(known or {})
    return lambda n: seen[n] if n in seen else peak(n)


def largest_batch(
    session: FakeSession | LayeredSession, work: Workload, budget: int, *, multiple_of: int = 1, known: Mapping[int, int] | None = None
) -> BatchLimit:
    """The largest batch (at the workload's sequence length) whose step, as it is, peaks within
    ``budget``: :func:`memfit.levers.max_batch.largest_batch`'s search on ``session``;
    ``known``: peaks measured already, by batch (the profile's)."""
    inputs = work.inputs
    return largest_size(
        _seeded(lambda b: session.peak(resize_batch(inputs, b)), known), budget, inputs["input_ids"].shape[0], multiple_of
    )


def largest_seq_len(
    session: FakeSession | LayeredSession,
    work: Workload,
    budget: int,
    *,
    multiple_of: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
    limit: int | None = None,
    known: Mapping[int, int] | None = None,
) -> BatchLimit:
    """The longest sequence (a multiple of ``multiple_of``) whose step, as it is, at the
    workload's batch peaks within ``budget`` (on CUDA, real or fake: the reserved peak), from
    exact fake-tensor peaks on ``session``: the search of :func:`memfit.levers.max_batch.largest_batch`
    along the sequence, up to ``limit`` tokens (the model's ``max_position_embeddings``, say).
    ``max_batch`` of the answer is that length (0: not even ``multiple_of`` fits); ``known``:
    peaks measured already, by length (the profile's)."""
    inputs = work.inputs
    start = inputs["input_ids"].shape[1]
    report = progress or (lambda desc, done, total: None)

    def peak(n: int) -> int:
        report(f"fake-tensor profile at {n} tokens", 0, 0)
        return session.peak(_cut(inputs, n))

    if limit is None:
        return largest_size(_seeded(peak, known), budget, start, multiple_of)
    return largest_size(_seeded(peak, known), budget, start, multiple_of, limit=limit)


def levers_that_fit(
    session: FakeSession | LayeredSession, work: Workload, budget: int, *, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """The cheapest levers that make the step fit ``budget``, on fake tensors only: micro-batches
    first (the same compute, in pieces), the fewest that fit, each one recorded step on
    ``session`` (of 4 or more, its first three: :func:`memfit.measure.step.first_micro_batches`,
    the whole step's peak); else memfit's recompute plan at the most micro-batches tried (the
    least extra compute that fits). Not :func:`memfit.fit`: that one probes the loss and times
    candidates on real tensors, which for a model built from a config would touch weights never
    written (16 GB for an 8B base) and time garbage.

    Returns ``{"micro_batches": k, "peak_bytes": ..., "tried": [...]}`` and, with a plan,
    ``"plan"`` (its dict); ``{"fits": False, "why": ...}`` when nothing tried fits."""
    report = progress or (lambda desc, done, total: None)
    batch = work.meta.get("batch_size") or work.inputs["input_ids"].shape[0]
    tried: list[dict[str, int]] = []
    k = 1
    for k in (n for n in (2, 4, 8, 16, 32, 64, 128) if n <= batch and batch % n == 0):
        report(f"micro-batches x{k} on fake tensors", 0, 0)
        with first_micro_batches(3):
            peak = session.peak(micro_batches=k)
        tried.append({"micro_batches": k, "peak_bytes": peak})
        if peak <= budget:
            return {"fits": True, "micro_batches": k, "peak_bytes": peak, "tried": tried}
    report("recompute plan on fake tensors", 0, 0)
    step = replace(session.step.options, micro_batches=k)  # the Trainer's step (accumulation, output dropped), cut
    try:
        plan = make_plan(
            work.model, work.inputs, budget, optimizer=work.make_optimizer(), fake=session.step.where, step=step
        )
    except BudgetInfeasibleError as exc:
        return {"fits": False, "why": str(exc), "tried": tried}
    return {"fits": True, "micro_batches": k, "peak_bytes": plan.predicted_peak_bytes, "tried": tried, "plan": plan.to_dict()}
