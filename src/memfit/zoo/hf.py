"""Real-world architectures from transformers, built from configs with random weights.

Nothing is downloaded: each model is constructed from its config class. Needs the
``[hf]`` extra (``pip install memfit[hf]``).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
from typing import Any

import torch

from memfit.errors import TargetError
from memfit.workload import LayerStack, Parallel, Workload


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise TargetError("this zoo model needs transformers: pip install 'memfit[hf]'") from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _config(cls: Any, ours: dict[str, Any], fields: dict[str, Any]) -> Any:
    """``cls(**ours, **fields)``, refusing a field (the user's size) the config class does not
    have: transformers keeps any keyword as an attribute, so a misspelt size would build the
    default model silently. ``ours``, memfit's defaults, are not judged (rope_theta moved into
    rope_parameters in transformers 5, and is still taken)."""
    default = cls()
    # a keyword the constructor reads but keeps privately (attn_implementation as
    # _attn_implementation) or as a signature argument counts
    takes = {
        k
        for c in cls.__mro__
        if "__init__" in vars(c)
        for k, p in inspect.signature(c.__init__).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and k != "self"
    }
    unknown = [k for k in fields if not (hasattr(default, k) or hasattr(default, f"_{k}") or k in takes)]
    if unknown:
        known = [k for k in default.to_dict() if not k.startswith("_")] + list(getattr(cls, "attribute_map", {}))
        near = difflib.get_close_matches(unknown[0], known, n=3)
        hint = f"did you mean {' or '.join(near)}?" if near else f"give a field of transformers' {cls.__name__}"
        raise TargetError(f"{cls.__name__} has no field {unknown[0]!r} (a --size here is a config field): {hint}")
    return cls(**{**ours, **fields})


def build_bert(batch_size: int = 8, seq_len: int = 128, **config: Any) -> Workload:
    tf = _transformers()
    cfg = _config(tf.BertConfig, {}, config)
    model = tf.BertForMaskedLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    meta = {"batch_size": batch_size, "seq_len": seq_len, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, name="bert-base", meta=meta)


def build_gpt2(batch_size: int = 4, seq_len: int = 256, **config: Any) -> Workload:
    tf = _transformers()
    # A training step keeps no KV cache (transformers turns it off for gradient
    # checkpointing, and a memfit plan does too: plan.use_cache_off); off here, the step
    # is the same with and without a plan.
    cfg = _config(tf.GPT2Config, {"use_cache": False}, config)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    meta = {"batch_size": batch_size, "seq_len": seq_len, "layers": cfg.n_layer, "hidden": cfg.n_embd}
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, name="gpt2", meta=meta)


LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # A small Llama (RMSNorm, rotary, SwiGLU, SDPA): 8 x 512, a 8k vocabulary so that the
    # blocks' activations, not the logits, dominate, as in the larger models of the family.
    "tiny": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=8192),
    # Llama-3-8B and -70B's dimensions (their config.json), at 4096 tokens, batch 1.
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
}
_LLAMA_SEQ = {"tiny": (4, 256), "8b": (1, 4096), "70b": (1, 4096)}
LLAMA_PARALLEL = ("fsdp2", "ddp", "tp", "fsdp2+tp", "hsdp", "pp", "none")
NOT_MODELED = {"ep": "expert", "expert": "expert", "moe": "expert"}
"""Schemes memfit does not measure (issue 15): asked for, they are refused by name."""


def build_llama(
    batch_size: int | None = None,
    seq_len: int | None = None,
    preset: str = "tiny",
    parallel: str = "fsdp2",
    gradient_checkpointing: bool = False,
    tp: int | None = None,
    replicate: int | None = None,
    pp: int | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    **config: Any,
) -> Workload:
    """Llama from transformers. ``preset``: ``tiny`` (8 x 512, built on the CPU), ``8b`` or
    ``70b`` (Llama-3's dimensions, 4096 tokens, built on the meta device: measure them per
    rank, ``--world-size N``). ``parallel``: how ``--world-size`` runs the step: ``fsdp2``
    (``fully_shard`` per decoder layer and the root, bf16 parameters, fp32 reduction, as
    torchtitan), ``ddp``, ``tp`` (tensor parallel over all ranks, torchtitan's Llama plan
    without sequence parallelism), ``fsdp2+tp`` (a (dp, tp) mesh: ``tp``-way tensor parallel,
    default 2, then FSDP2 over dp), ``hsdp`` (a (replicate, shard) mesh: FSDP2 sharding
    within groups, ``replicate`` of them, default 2), ``pp`` (pipeline parallel over ``pp``
    ranks, default all: the decoder layers split evenly into stages, the embedding on the
    first, norm, head and loss on the last; ``schedule`` gpipe, 1f1b (default),
    interleaved1f1b, ...; ``microbatches``, default ``pp``), or ``none``."""
    tf = _transformers()
    if preset not in LLAMA_PRESETS:
        raise TargetError(f"llama has no preset {preset!r}; choose one of {', '.join(LLAMA_PRESETS)}")
    if parallel in NOT_MODELED:
        raise TargetError(
            f"parallel={parallel}: {NOT_MODELED[parallel]} parallelism is not modeled by memfit; "
            f"choose one of {', '.join(LLAMA_PARALLEL)}"
        )
    if parallel not in LLAMA_PARALLEL:
        raise TargetError(f"llama has no parallel={parallel!r}; choose one of {', '.join(LLAMA_PARALLEL)}")
    pipelined = (("pp", pp, ("pp",)), ("schedule", schedule, ("pp",)), ("microbatches", microbatches, ("pp",)))
    for key, value, scheme in (("tp", tp, ("tp", "fsdp2+tp")), ("replicate", replicate, ("hsdp",)), *pipelined):
        if value is not None and parallel not in scheme:
            raise TargetError(
                f"{key}={value} is {'a setting' if key in ('schedule', 'microbatches') else 'a degree'} of parallel={' or '.join(scheme)}, not of parallel={parallel}"
            )
        if key != "schedule" and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TargetError(f"{key} must be a positive integer, got {value!r}")
    batch, seq = _LLAMA_SEQ[preset]
    batch_size = batch if batch_size is None else batch_size
    seq_len = seq if seq_len is None else seq_len
    cfg = _config(tf.LlamaConfig, {**LLAMA_PRESETS[preset], "use_cache": False}, config)
    with torch.device("meta") if preset != "tiny" else contextlib.nullcontext():
        # too big to build for real (8B is 32 GB of float32): on meta, materialised per rank
        model = tf.LlamaForCausalLM(cfg)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()

    def rebuild(n: int) -> Any:
        # the same config with n decoder layers, on meta: a rank's fewer-layer steps need its structure only
        with torch.device("meta"):
            small = tf.LlamaForCausalLM(_config(tf.LlamaConfig, {**LLAMA_PRESETS[preset], "use_cache": False}, {**config, "num_hidden_layers": n}))
        if gradient_checkpointing:
            small.gradient_checkpointing_enable()
        return small

    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    meta = {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "preset": preset,
    }
    scheme = _llama_parallel(parallel, tp=tp, replicate=replicate, pp=pp, schedule=schedule, microbatches=microbatches)
    if scheme is not None and scheme.name == "pp":
        meta.update(schedule=schedule or "1f1b", microbatches=microbatches or "pp")
    layers = LayerStack("model.layers.", cfg.num_hidden_layers, rebuild)
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, name="llama", meta=meta, parallel=scheme, layers=layers)


def _llama_parallel(
    parallel: str,
    *,
    tp: int | None = None,
    replicate: int | None = None,
    pp: int | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
) -> Parallel | None:
    from memfit.errors import MemfitError
    from memfit.measure import distributed
    from memfit.measure.pipeline import Pipeline

    layers = lambda m: m.model.layers  # noqa: E731
    if parallel == "fsdp2":
        return Parallel(distributed.fsdp2(layers), name="fsdp2")
    if parallel == "ddp":
        return Parallel(distributed.ddp, name="ddp")
    if parallel == "tp":
        return Parallel(distributed.tensor_parallel(llama_tp_plan), mesh_shape=(tp,) if tp else None, name="tp")
    if parallel == "fsdp2+tp":
        scheme = distributed.compose(
            distributed.tensor_parallel(llama_tp_plan, mesh_dims="tp"), distributed.fsdp2(layers, mesh_dims="dp")
        )
        return Parallel(scheme, mesh_shape=(-1, tp or 2), mesh_dim_names=("dp", "tp"), name="fsdp2+tp")
    if parallel == "hsdp":
        # fully_shard over the whole 2-D mesh: replicated over its first dimension, sharded over its second
        shape = (replicate or 2, -1)
        return Parallel(distributed.fsdp2(layers), mesh_shape=shape, mesh_dim_names=("replicate", "shard"), name="hsdp")
    if parallel == "pp":
        try:
            spec = Pipeline(llama_stages, llama_loss, schedule=schedule or "1f1b", microbatches=microbatches, target="labels")
        except MemfitError as exc:
            raise TargetError(str(exc)) from exc
        return Parallel(spec, mesh_shape=(pp,) if pp else None, name="pp")
    return None


class LlamaStage(torch.nn.Module):
    """Decoder layers of one pipeline stage of transformers' Llama, run as ``LlamaModel.forward``
    runs them: the embedding first on the first stage, positions and rotary embeddings on each
    stage (every stage computes its own, as torchtitan's stages do), norm and head on the last.
    The causal mask is SDPA's own (``attention_mask=None``: what ``create_causal_mask`` gives
    SDPA for a batch without padding)."""

    def __init__(self, model: Any, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(inner.layers[str(i)] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def llama_stages(model: Any, indices: list[int], num_stages: int) -> list[LlamaStage]:
    """transformers' Llama pruned to the pipeline stages ``indices`` of ``num_stages`` (its
    decoder layers split evenly; the embedding on stage 0; norm and head on the last), as
    torchtitan's manual split prunes its model: the modules kept keep their names
    (``model.layers.3``); one :class:`LlamaStage` per index."""
    n = len(model.model.layers)
    if n % num_stages:
        raise TargetError(
            f"parallel=pp: {num_stages} pipeline stages do not split the {n} decoder layers evenly; "
            f"give pp (times the schedule's stages per rank) dividing {n}"
        )
    per = n // num_stages
    keep = [i for s in indices for i in range(s * per, (s + 1) * per)]
    inner = model.model
    if not isinstance(inner.layers, torch.nn.ModuleDict):
        inner.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in keep})
    if 0 not in indices:
        inner.embed_tokens = None
    if num_stages - 1 not in indices:
        inner.norm = None
        model.lm_head = None
    return [LlamaStage(model, list(range(s * per, (s + 1) * per)), s == 0, s == num_stages - 1) for s in indices]


def llama_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss, as ``LlamaForCausalLM`` computes it from its logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def llama_tp_plan(model: Any, tp: int) -> dict[str, Any]:
    """torchtitan's tensor-parallel plan for Llama on transformers' module names, without
    sequence parallelism: q/k/v and gate/up column-wise (each rank computes ``1/tp`` of the
    heads and of the MLP's width), o and down row-wise (their outputs all-reduced), the
    embedding sharded over the vocabulary and the head over it too, its logits all-gathered
    for transformers' loss. Norms and residuals stay replicated. Attention reshapes its
    projections as (..., -1, head_dim), so each rank runs its ``heads/tp`` local heads, and
    ``heads/kv_heads`` (GQA's groups) is the same locally: both head counts must divide by ``tp``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cfg = model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(cfg, key) % tp:
            raise ValueError(
                f"{key}={getattr(cfg, key)} does not split over {tp}-way tensor parallelism: give a tp that divides it"
            )
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        at = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[at + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[at + name] = RowwiseParallel()
    return plan


def build_vit(batch_size: int = 8, image_size: int = 224, **config: Any) -> Workload:
    tf = _transformers()
    # ViT-S/16 dims (timm's vit_small_patch16_224): 12 x 384, 6 heads, 197 tokens.
    defaults = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, num_labels=1000)
    cfg = _config(tf.ViTConfig, {**defaults, "image_size": image_size}, config)
    model = tf.ViTForImageClassification(cfg)
    pixels = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, cfg.num_labels, (batch_size,))
    meta = {"batch_size": batch_size, "image_size": image_size, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}
    return Workload(model, {"pixel_values": pixels, "labels": labels}, name="vit", meta=meta)


def build_resnet152(batch_size: int = 8, image_size: int = 224, **config: Any) -> Workload:
    tf = _transformers()
    defaults = dict(depths=[3, 8, 36, 3], layer_type="bottleneck", hidden_sizes=[256, 512, 1024, 2048], num_labels=1000)
    cfg = _config(tf.ResNetConfig, defaults, config)
    model = tf.ResNetForImageClassification(cfg)
    pixels = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, cfg.num_labels, (batch_size,))
    meta = {"batch_size": batch_size, "image_size": image_size, "depths": list(cfg.depths)}
    return Workload(model, {"pixel_values": pixels, "labels": labels}, name="resnet152", meta=meta)
