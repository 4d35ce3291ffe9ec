"""Models for demos, tests and benchmarks: random weights, nothing downloaded.

``build(name, batch_size=None, **sizes)`` returns a :class:`~memfit.Workload`; sizes are
the builder's keyword arguments (``n_layer=24`` for ``gpt``, ``depth=50`` for
``mlp-deep``, any config field for the transformers models). Builds are seeded, so the
same call gives the same weights and inputs in every process, and the caller's RNG is
left as it was.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from memfit.errors import TargetError
from memfit.workload import Workload
from memfit.zoo import cnn, gpt, hf, small

__all__ = ["build", "names", "describe", "parse_sizes", "DEFAULT"]

DEFAULT = "gpt"


@dataclass(frozen=True)
class _Entry:
    build: Callable[..., Workload]
    about: str
    extra: str | None = None
    sizes: tuple[str, ...] = ()
    """Size names when the builder takes them as ``**sizes`` (else its signature says)."""


_ZOO: dict[str, _Entry] = {
    "gpt": _Entry(
        gpt.build, "nanoGPT-style decoder, 12 x 256 wide, 128 tokens, batch 8", sizes=tuple(f.name for f in fields(gpt.GPTConfig))
    ),
    "mlp-deep": _Entry(small.build_mlp, "100 x Linear(1024)+ReLU, batch 128"),
    "heavy": _Entry(small.build_heavy, "~100k tiny scalar ops: per-op overhead"),
    "resnet": _Entry(small.build_resnet, "bottleneck CNN with BatchNorm and Dropout, 64px, batch 16"),
    "convnext": _Entry(cnn.convnext, "depthwise 7x7 + LayerNorm over channels, 4 stages, 128px, batch 8"),
    "resnext": _Entry(cnn.resnext, "grouped 3x3 convolutions (32 groups) with BatchNorm, 96px, batch 8"),
    "mobilenet": _Entry(cnn.mobilenet, "inverted residuals around depthwise 3x3, 128px, batch 16"),
    "convmixer": _Entry(cnn.convmixer, "depthwise 9x9 + pointwise with GELU and BatchNorm, 96px, batch 8"),
    "bert-base": _Entry(hf.build_bert, "transformers BertForMaskedLM, 128 tokens, batch 8", "hf"),
    "gpt2": _Entry(hf.build_gpt2, "transformers GPT2LMHeadModel, 256 tokens, batch 4", "hf"),
    "llama": _Entry(
        hf.build_llama,
        "transformers LlamaForCausalLM, 8 x 512, 256 tokens, batch 4 (preset=8b|70b: Llama-3 dims, 4096 tokens, on meta; parallel=fsdp2|ddp|tp|fsdp2+tp|hsdp for --world-size)",
        "hf",
    ),
    "vit": _Entry(hf.build_vit, "transformers ViT-S/16, 224px, batch 8", "hf"),
    "resnet152": _Entry(hf.build_resnet152, "transformers ResNet-152, 224px, batch 8", "hf"),
}


def names() -> list[str]:
    return list(_ZOO)


def describe() -> dict[str, str]:
    return {name: e.about + (f" (needs [{e.extra}])" if e.extra else "") for name, e in _ZOO.items()}


def parse_sizes(items: list[str]) -> dict[str, Any]:
    """Sizes as the command line gives them (``--size KEY=VALUE``), for :func:`build`:
    ``["n_layer=24", "dropout=0.0"]`` -> ``{"n_layer": 24, "dropout": 0.0}``; a value that is
    not a Python literal stays a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        # dotted keys name a field of a section: torchtitan's training.seq_len
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise TargetError(f"--size takes KEY=VALUE (e.g. n_layer=24, training.seq_len=512), got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def build(name: str, /, batch_size: int | None = None, **sizes: Any) -> Workload:
    """Build zoo model ``name`` as a workload on the CPU. ``name`` is positional only, so
    that a size called ``name`` is judged as any other size, not a clash of arguments."""
    entry = _ZOO.get(name)
    if entry is None:
        raise TargetError(f"unknown zoo model {name!r}; choose one of {', '.join(_ZOO)} or give path/to/file.py:function")
    params = [k for k, p in inspect.signature(entry.build).parameters.items() if p.kind is not p.VAR_KEYWORD]
    known = [k for k in (*params, *entry.sizes) if k != "batch_size"]
    takes_any = entry.extra == "hf"  # any transformers config field
    unknown = [k for k in sizes if k not in known and not takes_any]
    if unknown:
        raise TargetError(f"zoo model {name!r} has no size {unknown[0]!r}; its sizes are {', '.join(known)}")
    if batch_size is not None:
        sizes["batch_size"] = batch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            return entry.build(**sizes)
        except (TypeError, ValueError) as exc:
            raise TargetError(f"cannot build {name!r} with {sizes}: {exc}") from exc
