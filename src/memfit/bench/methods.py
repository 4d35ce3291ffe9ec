"""What each benchmarked configuration does to the model (mechanism, in the child process).

A method is a string: ``none``; ``every`` / ``every-other`` (full recompute of every /
every second block, or transformers' own ``gradient_checkpointing_enable`` for every
block of a transformers model); ``sequential`` (``checkpoint_sequential`` with sqrt(n)
segments, for models that are an ``nn.Sequential``); ``compile:F`` (``torch.compile`` with
``torch._functorch.config.activation_memory_budget = F``); ``plan:PATH`` (a memfit plan);
``plan+compile:PATH`` (a memfit plan, then ``torch.compile`` with its default budget: how
the two compose, and the fair counterpart of the compile rows);
``modules:A,B`` (full recompute of the named modules, as in hand-picked recipes).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from memfit.errors import MemfitError
from memfit.plan.baselines import every_block, every_other_block
from memfit.recompute.checkpoint import apply_choices

__all__ = ["setup", "applicable", "describe", "BASELINES", "SCENARIOS"]

BASELINES = ("none", "every", "every-other", "sequential")

SCENARIOS = {
    # The two classic worked examples, as (zoo model, method, row label). ResNet-152 with
    # layer1 and layer2 checkpointed is reported elsewhere as ~34% memory saved for ~10%
    # throughput lost; BERT-base with every layer checkpointed is the per-layer recipe.
    "resnet152-layer1-layer2": ("resnet152", "modules:resnet.encoder.stages.0,resnet.encoder.stages.1", "layer1+layer2"),
    "bert-per-layer": ("bert-base", "every", "every layer"),
}


class _Sequential(nn.Module):
    """Runs an ``nn.Sequential`` through ``checkpoint_sequential`` with ``segments`` segments."""

    def __init__(self, seq: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.seq = seq
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


def _is_transformers(model: nn.Module) -> bool:
    return hasattr(model, "gradient_checkpointing_enable") and getattr(model, "supports_gradient_checkpointing", False)


def applicable(method: str, model: nn.Module) -> str | None:
    """None if ``method`` applies to ``model``, else why not."""
    if method == "sequential" and not isinstance(model, nn.Sequential):
        return "the model is not an nn.Sequential chain"
    if method in ("every", "every-other") and not every_block(model):
        return "the model has no repeated blocks"
    return None


def setup(method: str, model: nn.Module) -> nn.Module:
    """The model to train for ``method`` (the same object, changed in place, or a wrapper)."""
    if method == "none":
        return model
    why = applicable(method, model)
    if why:
        raise MemfitError(f"method {method!r} does not apply: {why}")
    if method == "every":
        if _is_transformers(model):
            # transformers' own recipe; renamed activation_checkpointing_enable in v5
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model
        return apply_choices(model, every_block(model))
    if method == "every-other":
        return apply_choices(model, every_other_block(model))
    if method == "sequential":
        return _Sequential(model, max(1, round(math.sqrt(len(model)))))
    if method.startswith("compile:"):
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(method.split(":", 1)[1])
        return torch.compile(model)
    if method.startswith("modules:"):
        names = [n for n in method.split(":", 1)[1].split(",") if n]
        return apply_choices(model, {n: ("full", ()) for n in names})
    if method.startswith(("plan:", "plan+compile:")):
        import memfit

        kind, path = method.split(":", 1)
        with open(path) as f:
            model = memfit.apply(model, memfit.Plan.from_json(f.read()))
        return torch.compile(model) if kind == "plan+compile" else model
    raise MemfitError(f"unknown method {method!r}")


def describe(method: str) -> str:
    return {
        "none": "no checkpointing",
        "every": "every block",
        "every-other": "every other block",
        "sequential": "checkpoint_sequential",
    }.get(method, method)
