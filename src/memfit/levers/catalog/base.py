"""What a lever is, as data: :class:`Lever`, the :class:`Reason` one is not used, the
:class:`Combo` of levers a step is run with, and the :class:`Situation` they are judged in.

Each lever lives in a module of its own beside this one (``amp.py``, ``offload.py``, ...),
as one :class:`Lever` record named ``LEVER``; :mod:`memfit.levers.catalog` lists them in
order. :func:`memfit.fit` loops over that list: nothing about a lever is written anywhere else.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memfit.cuda.allocator import AllocatorSettings
from memfit.measure.checked import Step
from memfit.measure.step import StepOptions
from memfit.plan.result import Plan

__all__ = ["Why", "Reason", "Combo", "Situation", "Lever", "Lines"]


class Why(enum.Enum):
    """Why a lever is not in a recipe: the kind of reason, which the report groups by."""

    OPT_IN = "opt_in"
    """It changes the numerics and the caller did not allow it."""
    NOT_APPLICABLE = "not_applicable"
    """This step cannot use it (a BatchNorm model and micro-batches, an optimizer with no 8-bit twin)."""
    UNAVAILABLE = "unavailable"
    """It cannot be weighed here (a device it is not modelled for, a probe that failed)."""
    ALREADY_ON = "already_on"
    """The step uses it already."""
    EXCLUDED = "excluded"
    """The caller's training loop has no way to use it (a framework's loop)."""
    NOT_NEEDED = "not_needed"
    """The step fits without it."""
    NOT_CHOSEN = "not_chosen"
    """Weighed, and a faster recipe fits without it."""


class Reason(str):
    """A reason a lever is not used: its sentence (a ``str``, as the recipe's JSON and every
    reader of ``recipe.left_out`` has always had it) and its :class:`Why`, which is data the
    report renders by instead of reading the sentence."""

    why: Why

    def __new__(cls, why: Why, text: str) -> Reason:
        reason = super().__new__(cls, text)
        reason.why = why
        return reason

    def __reduce__(self) -> tuple:  # copies and pickles keep the kind
        return (Reason, (self.why, str(self)))


@dataclass(frozen=True)
class Combo:
    """One combination of levers (recompute aside, which is planned per combination). Each
    field is one lever's setting (amp and bf16 share ``precision``); the defaults are the step
    as it is, but for ``set_to_none``, which is what the training loop does now."""

    micro_batches: int = 1
    precision: str = "fp32"
    foreach: bool | None = None
    set_to_none: bool = True
    eight_bit: bool = False
    offload: bool = False
    expandable: bool = False
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: the same step (same ledger, same
    time), other segments: its peak is the ledger replayed under that setting."""


class Situation:
    """What decides whether a lever may be used on this step: the step, what the caller
    allowed and excluded, the device."""

    def __init__(
        self,
        *,
        step: Step,
        allowed: set[str],
        exclude: Mapping[str, str],
        set_to_none: bool,
        settings: AllocatorSettings | None,
    ) -> None:
        self.step = step
        self.allowed = allowed
        self.exclude = dict(exclude)
        self.set_to_none = set_to_none
        """What the training loop calls now: ``zero_grad(set_to_none=...)``."""
        self.settings = settings
        """On CUDA (real or fake): the process's allocator settings (``PYTORCH_CUDA_ALLOC_CONF``), which
        peaks are judged under; None elsewhere."""
        self.probes: dict[str, Any] = {}
        """What a lever measured on the real step to judge it, kept for the search (the micro-batch
        lever's loss scales): probed once."""

    # the step's parts, as the levers read them
    model = property(lambda self: self.step.model)
    args = property(lambda self: self.step.args)
    kwargs = property(lambda self: self.step.kwargs)
    loss_fn = property(lambda self: self.step.loss_fn)
    optimizer = property(lambda self: self.step.optimizer)
    targets = property(lambda self: self.step.targets)
    device = property(lambda self: self.step.device)
    fake_cuda = property(lambda self: self.step.fake_cuda)
    cuda = property(lambda self: self.step.cuda)


@dataclass(frozen=True)
class Lines:
    """What one lever writes into a recipe's snippet, place by place in the training loop;
    :meth:`memfit.Recipe.snippet` puts the levers' pieces into the loop in recipe order (the
    loop itself, micro-batches and ``zero_grad`` included, is the step's, written there)."""

    environment: tuple[str, ...] = ()
    """Lines on how the training script is started (an environment variable)."""
    applied: tuple[str, ...] = ()
    """Words on what ``memfit.apply_recipe`` did to the model."""
    optimizer: str = ""
    """Words on ``optimizer = run.optimizer``."""
    setup: tuple[str, ...] = ()
    """Lines after the optimizer, before the loop."""
    batch: tuple[str, ...] = ()
    """Lines at the top of each batch (when it is not cut into micro-batches)."""
    micro_batch: str = ""
    """Words on each micro-batch."""
    context: tuple[str, str] | None = None
    """``(expression, its words)``: a context the forward and the loss run in."""
    backward: str = ""
    """The backward line, instead of ``loss.backward()``."""
    step: tuple[str, ...] = ()
    """The optimizer's step lines, instead of ``optimizer.step()``."""


@dataclass(frozen=True)
class Lever:
    """One memory lever: what it is, when it may be used, and how it changes the step."""

    name: str
    exact: bool
    """It leaves what training computes as it was; else it is weighed only when allowed."""
    does: str
    """What it does, in one line (``memfit fit --help``, the recipe's lever table)."""
    settings: Callable[[Situation], Reason | tuple]
    """The settings of its :class:`Combo` field to weigh beside the step's own (``(2, 4)``
    micro-batches, ``(True,)``), or the reason it is not weighed at all."""
    used: Callable[[Combo, Plan | None, Situation], bool]
    """Whether a combination (with its plan) uses it, against the step as it is."""
    step: Callable[[Combo, Situation], dict[str, Any]]
    """The :class:`~memfit.measure.step.StepOptions` fields it sets for a combination: how it
    changes the step that runs (recompute and the allocator setting change none)."""
    words: Callable[[StepOptions, Plan | None, str], str]
    """It in a recipe's summary, from the step, the plan and the optimizer's type name."""
    field: str = ""
    """The :class:`Combo` field its settings go to."""
    lines: Callable[[Any], Lines] = lambda recipe: Lines()
    """What it writes into a recipe's snippet (:meth:`memfit.Recipe.snippet`), given the recipe."""
    cuda_only: bool = False
    """Named only for a CUDA step (real or fake): elsewhere it is not a lever at all."""
    allows: Callable[[Combo], bool] = lambda combo: True
    """Whether a combination may hold it with the others' settings (the 8-bit optimizer has no foreach flag)."""

    def reason(self, situation: Situation) -> Reason | None:
        got = self.settings(situation)
        return got if isinstance(got, Reason) else None


def float32_only(s: Situation) -> Reason | None:
    """Why a precision lever (amp, bf16) does not apply: the parameters are not all float32."""
    dtypes = {p.dtype for p in s.model.parameters() if p.is_floating_point()}
    if dtypes == {torch.float32}:
        return None
    names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
    return Reason(Why.NOT_APPLICABLE, f"the parameters are {names}, not float32")


def opt_in(name: str, what: str) -> Reason:
    """The reason a lever that changes the numerics is left out when not allowed."""
    return Reason(Why.OPT_IN, f"changes the numerics{what}: opt in with allow={name!r} (--allow {name})")


def read_reason(value: Any) -> Reason:
    """A reason read back: a :class:`Reason` as it is; ``{"why": ..., "text": ...}`` (recipe
    JSON from version 2); a bare sentence (version 1, or written by hand), whose kind only its
    words can tell: that reading lives here, at the edge, and nowhere else."""
    if isinstance(value, Reason):
        return value
    if isinstance(value, dict):
        return Reason(Why(value["why"]), str(value["text"]))
    text = str(value)
    for words, why in (
        ("opt in with allow=", Why.OPT_IN),
        ("not needed", Why.NOT_NEEDED),
        ("the chosen recipe fits faster", Why.NOT_CHOSEN),
        ("already", Why.ALREADY_ON),
    ):
        if words in text:
            return Reason(why, text)
    return Reason(Why.NOT_APPLICABLE, text)


def reason_json(reason: Reason) -> dict[str, str]:
    return {"why": reason.why.value, "text": str(reason)}
