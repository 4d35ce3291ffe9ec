"""The :class:`Recipe`: which memory levers :func:`memfit.fit` chose (its :class:`Decision`),
what it predicted (:class:`Prediction`) and measured (:class:`Measurement`), and what it was
fit for and weighed (:class:`Provenance`). Plain data, saved and loaded as versioned JSON; it prints
as a code snippet for an existing training loop. Putting it on a model is mechanism, not
data: :func:`memfit.apply_recipe` (:mod:`memfit.apply.recipe`), which this module does not import."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

from memfit.errors import PlanError
from memfit.levers import catalog
from memfit.levers.catalog.base import Reason, read_reason, reason_json
from memfit.levers.records import Sectioned
from memfit.measure.step import StepOptions
from memfit.plan.result import Plan, parse_json, read_versioned
from memfit.units import format_bytes

__all__ = [
    *("FitRecipe", "Recipe", "Decision", "Prediction", "Measurement", "Provenance"),
    *("RankRecipe", "RankDecision", "RankPrediction", "RankProvenance"),
    *("WhatIf", "RECIPE_FORMAT", "RECIPE_VERSION", "LEVERS", "RANK_LEVERS"),
]

RECIPE_FORMAT = "memfit.recipe"
RECIPE_VERSION = 2
"""2: ``left_out`` gives each reason as ``{"why": kind, "text": sentence}`` (1: the sentence alone; still read)."""

LEVERS: dict[str, str] = {lever.name: lever.does for lever in catalog.ALL}
"""Every lever memfit knows, with what it does."""


@dataclass
class WhatIf:
    """One row of the what-if table: a configuration, its predicted (and for the chosen
    one, measured) peak and step time."""

    label: str
    levers: tuple[str, ...]
    predicted_peak_bytes: int | None
    """Exact peak of the step in this configuration (fake tensors; with recompute, the
    verified plan's peak)."""
    predicted_step_time_s: float | None
    """Predicted time of the step in this configuration (from the few steps :func:`memfit.fit`
    measures and the fitted cost model), plus the plan's predicted recompute time."""
    fits: bool
    measured_peak_bytes: int | None = None
    measured_step_time_s: float | None = None
    note: str = ""
    chosen: bool = False


class _Reasons:
    """A decision's ``left_out`` read into :class:`~memfit.levers.catalog.Reason` values once,
    where the record is made: from recipe JSON (v2 objects, v1 sentences) or a caller's strings."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "left_out", {lever: read_reason(why) for lever, why in self.left_out.items()})  # type: ignore[attr-defined]


R = TypeVar("R", bound="FitRecipe")


class FitRecipe(Sectioned):
    """What a fit chose, on one device (:class:`Recipe`) or for each rank of a world
    (:class:`RankRecipe`): the same records under the same names (:attr:`decision`:
    ``budget_bytes``, ``levers``, ``plan``, ``left_out``, ``budget``, ``allocator_conf``;
    :attr:`prediction`: ``predicted_peak_bytes``, ``predicted_step_time_s``,
    ``base_peak_bytes``, ``allocated_peak_bytes``, ``what_if``; :attr:`provenance`:
    ``batch_size``, ``device``, ``fit_time_s``, ``notes``, ``search``), saved as versioned JSON
    alike. What differs is what the levers are (:data:`LEVERS` or :data:`RANK_LEVERS`), the
    per-rank rows and ``fully_shard``'s arguments of a rank's recipe, and a single device's
    measurement (a rank's step runs on a fake process group: nothing is measured)."""

    FORMAT: ClassVar[str]
    VERSION: ClassVar[int]
    KNOWN: ClassVar[Collection[str]]
    """The levers its JSON may name."""
    WHAT: ClassVar[str]
    """What its JSON is called in a refusal: ``"recipe"``, ``"per-rank recipe"``."""

    def to_dict(self) -> dict[str, Any]:
        data = self.flat()
        plan: Plan | None = data["plan"]
        data["levers"] = list(data["levers"])
        data["plan"] = plan.to_dict() if plan is not None else None
        data["what_if"] = [{**asdict(w), "levers": list(w.levers)} for w in data["what_if"]]
        data["left_out"] = {lever: reason_json(why) for lever, why in data["left_out"].items()}
        self._write(data)
        return {"format": self.FORMAT, "version": self.VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        body = read_versioned(data, cls.FORMAT, cls.VERSION, cls.WHAT)
        try:
            body["levers"] = tuple(body["levers"])
            unknown = [lever for lever in body["levers"] if lever not in cls.KNOWN]
            if unknown:
                raise PlanError(f"{cls.WHAT} JSON names unknown lever {unknown[0]!r}")
            body["plan"] = Plan.from_dict(body["plan"]) if body.get("plan") is not None else None
            body["what_if"] = [WhatIf(**{**w, "levers": tuple(w["levers"])}) for w in body.get("what_if", [])]
            cls._read(body)
            return cls(**body)
        except PlanError:
            raise
        except Exception as exc:  # a corrupt file: missing keys, wrong types
            raise PlanError(f"{cls.WHAT} JSON is missing or has malformed fields ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def from_json(cls: type[R], text: str) -> R:
        return cls.from_dict(parse_json(text, cls.WHAT))

    def _write(self, data: dict[str, Any]) -> None:
        """The JSON of the fields that are not plain values, in place."""

    @classmethod
    def _read(cls, body: dict[str, Any]) -> None:
        """:meth:`_write` undone, in place; a bad value raises."""


@dataclass(frozen=True)
class Decision(_Reasons):
    """What :func:`memfit.fit` decided: the levers, the training step they make, the plan, and
    why every other lever was left out; for the budget it meets."""

    budget_bytes: int
    levers: tuple[str, ...]
    """The levers used, in :data:`LEVERS` order; empty when the step fits as it is."""
    step: StepOptions
    """The training step the recipe makes (micro-batches, autocast, dtype, ...)."""
    plan: Plan | None
    """What to recompute, or None."""
    left_out: dict[str, Reason] = field(default_factory=dict)
    """Levers not used, each with the reason (not allowed, not applicable, not available): a
    :class:`~memfit.levers.catalog.Reason`, the sentence with its kind (``.why``)."""
    precision: str = "fp32"
    """``"fp32"``, ``"amp"`` (autocast) or ``"bf16"`` (parameters cast)."""
    budget: str = ""
    """The budget as given."""
    allocator_conf: str = ""
    """On CUDA: the ``PYTORCH_CUDA_ALLOC_CONF`` the predicted peak assumes (with the
    ``expandable_segments`` lever, the process's settings plus it)."""


@dataclass(frozen=True)
class Prediction:
    """What the recipe's step is predicted to do (exact peaks on fake tensors, times from the
    cost model), beside the step as it is and every configuration weighed."""

    predicted_peak_bytes: int
    """What the budget bounds: on CUDA (real or fake) the caching allocator's reserved peak
    (memfit's model of it), else the step's tensor peak."""
    predicted_step_time_s: float | None
    base_peak_bytes: int
    """The step as it is, without any lever."""
    allocated_peak_bytes: int | None = None
    """On CUDA: the recipe's allocated peak (``max_memory_allocated``), beside the reserved
    :attr:`predicted_peak_bytes`."""
    what_if: list[WhatIf] = field(default_factory=list)
    """Every configuration weighed, with its predicted (for the chosen one, also measured) peak and time."""


@dataclass(frozen=True)
class Measurement:
    """What running the recipe's step on the real model measured."""

    measured_peak_bytes: int | None
    """Peak of the recipe's step run on the real model (recorder ledger; model restored after)."""
    measured_step_time_s: float | None
    """Median of the recipe's real steps after a warm-up; when that parted from the prediction
    by more than 15%, the median of its steps timed again between two runs of the step as it
    is (see :attr:`host_speed`)."""
    base_step_time_s: float | None
    """The step as it is, timed (predicted when :attr:`times_predicted`)."""
    times_predicted: bool = False
    """Step times only predicted (fake CUDA: nothing could be timed); the recipe was chosen by them."""
    host_speed: float | None = None
    """When the recipe's steps parted from its prediction by more than 15%: the step as it is,
    timed just before and just after the recipe's steps were timed again, over its time when
    the predictions were made (0.9: the host ran 10% faster by then); the prediction at the
    host's speed then is ``predicted_step_time_s * host_speed``. None: not timed again
    (prediction and measurement agreed)."""


@dataclass(frozen=True)
class Provenance:
    """Where the recipe came from: the step it was fit for, the device, and how the search went."""

    batch_size: int | None = None
    inputs_kind: str = "tensor"
    """How the inputs are passed: ``"tensor"``, ``"args"`` (a tuple) or ``"kwargs"`` (a dict)."""
    default_loss: bool = False
    """No ``loss_fn`` was given: the loss was memfit's default (``output.loss``, else the output's sum)."""
    targets: bool = False
    """The loss took targets: ``loss_fn(output, targets)``, cut into micro-batches with the inputs."""
    model_type: str = ""
    fingerprint: str = ""
    optimizer_type: str = ""
    device: str = "cpu"
    fit_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    """Warnings about the search: prediction and measurement that part by more than 15%,
    timings too noisy to rank the candidates, a lever stopped for being slow."""
    search: dict[str, int] = field(default_factory=dict)
    """How much fit ran: ``combinations`` considered, ``weighed`` (exact peak profiled),
    ``planned``, ``timed`` for real (with their plan), ``probes`` (configurations run for
    real to predict times from), ``fake_profiles``."""


@dataclass(init=False)
class Recipe(FitRecipe):
    """What :func:`memfit.fit` chose, as four frozen records: :attr:`decision` (what to do),
    :attr:`prediction` (what it should do), :attr:`measurement` (what it did, run for real) and
    :attr:`provenance` (what it was fit for, and how the search went). Memory in bytes, times
    in seconds. Every record's field also reads by its own name (``recipe.levers``,
    ``recipe.predicted_peak_bytes``), and ``Recipe(...)`` takes the four records or those
    fields (by name, or by position in :attr:`FLAT`'s order). Setting a field by its name replaces the record holding it."""

    decision: Decision
    prediction: Prediction
    measurement: Measurement
    provenance: Provenance

    FORMAT: ClassVar[str] = RECIPE_FORMAT
    VERSION: ClassVar[int] = RECIPE_VERSION
    KNOWN: ClassVar[Collection[str]] = LEVERS
    WHAT: ClassVar[str] = "recipe"
    RECORDS: ClassVar[dict[str, type]] = {
        "decision": Decision,
        "prediction": Prediction,
        "measurement": Measurement,
        "provenance": Provenance,
    }
    FLAT: ClassVar[tuple[str, ...]] = (
        # the order of the fields when Recipe was one flat record: positional calls and the JSON keep it
        "budget_bytes", "levers", "step", "plan", "predicted_peak_bytes", "predicted_step_time_s",
        "measured_peak_bytes", "measured_step_time_s", "base_peak_bytes", "base_step_time_s", "what_if",
        "left_out", "precision", "batch_size", "inputs_kind", "default_loss", "targets", "model_type",
        "fingerprint", "optimizer_type", "device", "budget", "fit_time_s", "notes", "allocated_peak_bytes",
        "allocator_conf", "times_predicted", "host_speed", "search",
    )  # fmt: skip

    # One device is rank 0 of a world of one: read as a per-rank recipe's rows are
    # (:class:`RankRecipe`), as :class:`~memfit.measure.profile.Profile` reads as a world's profiles.
    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank_peak_bytes(self) -> dict[int, int]:
        """Per rank, the predicted peak: rank 0's, this device's."""
        return {0: self.predicted_peak_bytes}

    @property
    def micro_batches(self) -> int:
        return self.step.micro_batches

    @property
    def loss_scale(self) -> float:
        """Factor on each micro-batch's loss (``1 / micro_batches`` for a mean loss, 1 for a sum)."""
        if self.step.loss_scale is not None:
            return self.step.loss_scale
        return 1.0 / self.step.micro_batches

    # -- transformers' TrainingArguments -----------------------------------------------------

    def training_arguments(self, gradient_accumulation_steps: int = 1) -> dict[str, Any]:
        """The recipe as ``transformers.TrainingArguments`` keywords, for a Trainer whose
        per-device batch is :attr:`batch_size` and which accumulates
        ``gradient_accumulation_steps`` batches now: micro-batches become a smaller
        per-device batch and more accumulation steps (the effective batch is unchanged),
        ``amp`` becomes ``bf16`` or ``fp16``, ``8bit`` becomes ``optim="adamw_bnb_8bit"``.
        Recompute is memfit's plan, which no TrainingArguments express: transformers' own
        all-or-nothing ``gradient_checkpointing`` goes off (``fit_trainer`` applies the plan).
        Levers the Trainer has no argument for are listed by :meth:`training_arguments_missing`."""
        out: dict[str, Any] = {}
        k = self.step.micro_batches
        if k > 1 and self.batch_size:
            out["per_device_train_batch_size"] = self.batch_size // k
            out["gradient_accumulation_steps"] = gradient_accumulation_steps * k
        if self.plan is not None and self.plan.checkpointed:
            out["gradient_checkpointing"] = False
        if "amp" in self.levers:
            out["fp16" if self.step.autocast == "float16" else "bf16"] = True
        if "8bit" in self.levers and self.optimizer_type == "AdamW":
            out["optim"] = "adamw_bnb_8bit"
        return out

    def training_arguments_missing(self) -> list[str]:
        """Levers of the recipe no ``TrainingArguments`` keyword expresses (recompute aside,
        which :func:`memfit.integrations.transformers.fit_trainer` applies)."""
        missing = [lever for lever in self.levers if lever in ("bf16", "foreach", "offload", "expandable_segments")]
        if "8bit" in self.levers and self.optimizer_type != "AdamW":
            missing.append("8bit")
        return missing

    # -- the snippet --------------------------------------------------------------------------

    def summary(self) -> str:
        """The levers in words: ``"micro-batches x4 + recompute (3 modules)"``."""
        return describe(self.levers, self.step, self.plan, optimizer_type=self.optimizer_type) or "no lever"

    def snippet(self, path: str = "recipe.json") -> str:
        """Lines to paste into an existing training loop; ``path`` is where the recipe's JSON
        is (``memfit fit ... --json PATH``)."""
        fits = "fits" if self.predicted_peak_bytes <= self.budget_bytes else "is over"
        head = (
            f"# memfit fit: {self.summary()}; predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"({fits} the budget {format_bytes(self.budget_bytes)})"
        )
        if self.predicted_step_time_s is not None:
            head += f", {self.predicted_step_time_s:.3f} s/step"
        parts = [catalog.BY_NAME[lever].lines(self) for lever in self.levers]
        environment = [line for p in parts for line in p.environment]
        if self.levers == ("expandable_segments",):
            return "\n".join([head, *environment, "# nothing else changes: keep your training loop"]) + "\n"
        if not self.levers:
            return f"{head}\n# the step fits as it is: keep your training loop unchanged\n"
        applied = "; ".join(words for p in parts for words in p.applied)
        optimizer = "; ".join(p.optimizer for p in parts if p.optimizer)
        lines = [
            head,
            *environment,
            f'recipe = memfit.Recipe.from_json(open("{path}").read())',
            "run = memfit.apply_recipe(recipe, model, optimizer)  # in place" + (f": {applied}" if applied else ""),
            "optimizer = run.optimizer" + (f"  # {optimizer}" if optimizer else ""),
            *(line for p in parts for line in p.setup),
        ]
        loop = "batch, targets" if self.targets else "batch"
        lines.append(f"for {loop} in loader:  # batch: inputs like the ones memfit measured")
        indent = self._micro_batches(lines, parts)
        lines += self._forward(indent, parts)
        lines.append(f"{indent}{next((p.backward for p in parts if p.backward), 'loss.backward()')}")
        lines += [f"    {line}" for line in next((p.step for p in parts if p.step), ("optimizer.step()",))]
        lines.append(f"    optimizer.zero_grad(set_to_none={self.step.set_to_none})")
        if self.default_loss:
            lines.insert(
                1, "from memfit.workload import default_loss  # what memfit measured: output.loss, else the output's sum"
            )
        return "\n".join(lines) + "\n"

    def _micro_batches(self, lines: list[str], parts: list[catalog.Lines]) -> str:
        """The loop over micro-batches (or the levers' lines on each whole batch); the indent inside."""
        k = self.step.micro_batches
        if k == 1:
            lines += [f"    {line}" for p in parts for line in p.batch]
            return "    "
        words = f" of {self.batch_size // k}" + "".join(p.micro_batch for p in parts) if self.batch_size else ""
        split = "micro, micro_targets in run.split(batch, targets)" if self.targets else "micro in run.split(batch)"
        lines.append(f"    for {split}:  # {k} micro-batches{words}")
        return "        "

    def _forward(self, indent: str, parts: list[catalog.Lines]) -> list[str]:
        """The forward and the loss, in the contexts the levers ask for."""
        k = self.step.micro_batches
        name = "micro" if k > 1 else "batch"
        call = {"tensor": f"model({name})", "args": f"model(*{name})", "kwargs": f"model(**{name})"}[self.inputs_kind]
        if self.default_loss:
            forward = f"loss = default_loss({call})"
        elif self.targets:
            forward = f"loss = loss_fn({call}, {'micro_targets' if k > 1 else 'targets'})"
        else:
            forward = f"loss = loss_fn({call})"
        if k > 1:
            forward += f" * {self.loss_scale:g}"
            forward += "  # gradients add up to the full batch's" + (" mean" if self.loss_scale != 1 else "")
        contexts = [p.context for p in parts if p.context is not None]
        if not contexts:
            return [f"{indent}{forward}"]
        with_ = ", ".join(c for c, _ in contexts)
        return [f"{indent}with {with_}:  # {'; '.join(w for _, w in contexts)}", f"{indent}    {forward}"]

    # -- JSON ---------------------------------------------------------------------------------

    def _write(self, data: dict[str, Any]) -> None:
        data["step"] = self.step.to_dict()

    @classmethod
    def _read(cls, body: dict[str, Any]) -> None:
        body["step"] = StepOptions.from_dict(body["step"])
        for name in ("budget_bytes", "predicted_peak_bytes", "base_peak_bytes"):
            if isinstance(body[name], bool) or not isinstance(body[name], int):
                raise PlanError(f"recipe JSON: {name} must be an integer, got {body[name]!r}")


def describe(levers: tuple[str, ...], step: StepOptions, plan: Plan | None, *, optimizer_type: str = "") -> str:
    """Levers in words, in the order of :data:`LEVERS`."""
    return " + ".join(
        catalog.BY_NAME[lever].words(step, plan, optimizer_type) if lever in catalog.BY_NAME else lever for lever in levers
    )


RANK_RECIPE_FORMAT = "memfit.rank_recipe"
RANK_RECIPE_VERSION = 2
"""2: ``left_out`` as in :data:`RECIPE_VERSION` 2 (1 still read)."""

RANK_LEVERS: dict[str, str] = {
    "recompute": "recompute activations in backward instead of keeping them (memfit's plan, applied before fully_shard)",
    "reshard_after_forward": "FSDP2 reshard_after_forward=False on the root and the last blocks: their unsharded "
    "parameters stay from forward to backward, which then all-gathers them no more (the same numerics)",
    "reduce_bf16": "FSDP2 MixedPrecisionPolicy(reduce_dtype=torch.bfloat16): gradients reduce-scattered in bfloat16 "
    "(changes the numerics: opt in)",
    "expandable_segments": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in each rank's environment: the caching "
    "allocator grows segments in place instead of leaving gaps between them (the same tensors; CUDA only)",
}
"""The levers a per-rank fit weighs, with what each does."""


def describe_reshards(root: bool, blocks: Sequence[bool]) -> str:
    """reshard_after_forward in words: where it is False."""
    n = len(blocks)
    kept = sum(1 for b in blocks if not b)
    if root and not kept:
        return "reshard_after_forward=True everywhere"
    where = ["the root"] if not root else []
    if kept == n:
        where.append(f"all {n} blocks")
    elif kept and tuple(blocks[n - kept :]) == (False,) * kept:
        where.append(f"the last {kept} of {n} blocks")
    elif kept:
        where.append(f"{kept} of {n} blocks")
    return "reshard_after_forward=False on " + " and ".join(where)


# -- a distributed step's recipe, per rank ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankDecision(_Reasons):
    """What :func:`fit_ranks` decided for every rank: the levers, ``fully_shard``'s arguments,
    the plan, and why the other levers were left out; for the per-rank budget it meets."""

    budget_bytes: int
    levers: tuple[str, ...]
    """The levers used (keys of :data:`RANK_LEVERS`); empty when the step fits as it is."""
    fsdp: dict[str, Any] | None
    """The ``fully_shard`` arguments to use: ``blocks`` (module names, in order),
    ``block_reshard_after_forward`` (one bool per block), ``root_reshard_after_forward``,
    ``param_dtype``, ``reduce_dtype`` (dtype names; None: FSDP's default). None: the
    workload's ``parallelize`` is not memfit's FSDP2, whose arguments fit cannot vary."""
    plan: Plan | None
    """What to recompute (apply before ``fully_shard``), or None."""
    left_out: dict[str, Reason] = field(default_factory=dict)
    """As :attr:`Decision.left_out`."""
    budget: str = ""
    """The budget as given."""
    allocator_conf: str | None = None
    """Fake CUDA: the caching-allocator settings the reserved peaks are judged under (with the
    ``expandable_segments`` lever, the process's plus it)."""


@dataclass(frozen=True)
class RankPrediction:
    """What every rank's step is predicted to do: exact peaks on the fake process group, times
    from the cost model (nothing runs there, so nothing is measured), beside the step as it is."""

    predicted_peak_bytes: int
    """The highest verified peak among :attr:`rank_peak_bytes`."""
    rank_peak_bytes: dict[int, int]
    predicted_step_time_s: float
    base_peak_bytes: int
    """The step as it is (the workload's parallelize, no plan), highest rank."""
    base_step_time_s: float
    all_gathers: int
    """All-gathers per step of the chosen configuration (rank's ledger), beside :attr:`base_all_gathers`."""
    base_all_gathers: int
    what_if: list[WhatIf] = field(default_factory=list)
    times_predicted: bool = True
    allocated_peak_bytes: int | None = None
    """Fake CUDA: the highest rank's allocated peak beside the reserved peaks the budget bounds."""


@dataclass(frozen=True)
class RankProvenance:
    """What the per-rank recipe was fit for (the world, its parallelism, the device), and how the search went."""

    world_size: int
    parallel: str
    device: str = "fake:cpu"
    batch_size: int | None = None
    fit_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    search: dict[str, int] = field(default_factory=dict)
    """``profiles`` (exact fake-group profiles) and ``plans`` made."""


@dataclass(init=False)
class RankRecipe(FitRecipe):
    """What :func:`fit_ranks` chose for each rank of a distributed step, as three frozen
    records: :attr:`decision`, :attr:`prediction` and :attr:`provenance` (no measurement:
    nothing runs on the fake process group). Memory in bytes (per rank), times in seconds.
    Fields read, and ``RankRecipe(...)`` takes them, by their own names as :class:`Recipe`'s do."""

    decision: RankDecision
    prediction: RankPrediction
    provenance: RankProvenance

    FORMAT: ClassVar[str] = RANK_RECIPE_FORMAT
    VERSION: ClassVar[int] = RANK_RECIPE_VERSION
    KNOWN: ClassVar[Collection[str]] = RANK_LEVERS
    WHAT: ClassVar[str] = "per-rank recipe"
    RECORDS: ClassVar[dict[str, type]] = {"decision": RankDecision, "prediction": RankPrediction, "provenance": RankProvenance}
    FLAT: ClassVar[tuple[str, ...]] = (
        # the order of the fields when RankRecipe was one flat record: positional calls and the JSON keep it
        "budget_bytes", "world_size", "parallel", "levers", "fsdp", "plan", "predicted_peak_bytes",
        "rank_peak_bytes", "predicted_step_time_s", "base_peak_bytes", "base_step_time_s", "all_gathers",
        "base_all_gathers", "what_if", "left_out", "notes", "budget", "device", "batch_size", "fit_time_s",
        "times_predicted", "search", "allocated_peak_bytes", "allocator_conf",
    )  # fmt: skip

    def summary(self) -> str:
        words = []
        if "reshard_after_forward" in self.levers and self.fsdp is not None:
            words.append(describe_reshards(self.fsdp["root_reshard_after_forward"], self.fsdp["block_reshard_after_forward"]))
        if "reduce_bf16" in self.levers:
            words.append("reduce in bfloat16")
        if "expandable_segments" in self.levers:
            words.append("expandable segments")
        if "recompute" in self.levers and self.plan is not None:
            n = len(self.plan.checkpointed)
            words.append(f"recompute ({n} module{'s' if n != 1 else ''})")
        return " + ".join(words) or "no lever"

    def snippet(self, path: str = "recipe.json") -> str:
        """Lines for the training script: the plan applied before ``fully_shard``, and the
        ``fully_shard`` calls with the chosen arguments; ``path``: the recipe's JSON."""
        fits = "fits" if self.predicted_peak_bytes <= self.budget_bytes else "is over"
        lines = [
            f"# memfit fit, per rank of {self.world_size}: {self.summary()}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} per rank ({fits} the budget {format_bytes(self.budget_bytes)}), "
            f"{self.predicted_step_time_s:.3f} s/step predicted"
        ]
        if not self.levers:
            return lines[0] + "\n# the step fits as it is on every rank: keep your parallelize and training loop\n"
        if "expandable_segments" in self.levers:
            lines.append(
                f"# launch each rank with PYTORCH_CUDA_ALLOC_CONF={self.allocator_conf} (set before CUDA starts, e.g. in torchrun's environment)"
            )
        if self.plan is not None and self.plan.checkpointed:
            n = len(self.plan.checkpointed)
            lines += [
                "import memfit",
                "from memfit.levers.recipe import RankRecipe",
                f'recipe = RankRecipe.from_json(open("{path}").read())',
                f"memfit.apply(model, recipe.plan)  # before parallelizing: recompute {n} module{'s' if n != 1 else ''}",
            ]
        if self.fsdp is None:
            lines.append("# then parallelize the model as you do now")
            return "\n".join(lines) + "\n"
        f = self.fsdp
        lines += [
            "import torch",
            "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
            f"mp = MixedPrecisionPolicy(param_dtype={_torch_dtype(f['param_dtype'])}, reduce_dtype={_torch_dtype(f['reduce_dtype'])})",
        ]
        names, reshards = f["blocks"], f["block_reshard_after_forward"]
        container = _container(names)
        if container is not None:
            lines.append(f'blocks = model.get_submodule("{container}")' if container else "blocks = list(model.children())")
        else:
            lines.append(f"blocks = [model.get_submodule(n) for n in {names!r}]")
        kept = sum(1 for r in reshards if not r)
        if all(reshards) or not any(reshards):
            arg, comment = repr(bool(reshards and reshards[0])), ""
        elif list(reshards) == [True] * (len(reshards) - kept) + [False] * kept:
            arg = f"i < {len(reshards) - kept}"
            which = "the last block keeps its" if kept == 1 else f"the last {kept} blocks keep their"
            comment = f"  # {which} parameters unsharded from forward to backward"
        else:
            lines.append(f"reshard = {list(reshards)!r}")
            arg, comment = "reshard[i]", ""
        lines += [
            "for i, block in enumerate(blocks):",
            f"    fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward={arg}){comment}",
            f"fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward={f['root_reshard_after_forward']})",
        ]
        return "\n".join(lines) + "\n"

    def _write(self, data: dict[str, Any]) -> None:
        data["rank_peak_bytes"] = {str(r): b for r, b in self.rank_peak_bytes.items()}

    @classmethod
    def _read(cls, body: dict[str, Any]) -> None:
        body["rank_peak_bytes"] = {int(r): int(b) for r, b in body["rank_peak_bytes"].items()}


def _torch_dtype(name: str | None) -> str:
    return "None" if name is None else f"torch.{name}"


def _container(names: list[str]) -> str | None:
    """The module holding the blocks as its children ``0 .. n-1`` in order (a ModuleList's
    name), if they are; None otherwise."""
    if not names:
        return None
    prefixes = {n.rpartition(".")[0] for n in names}
    if len(prefixes) != 1 or [n.rpartition(".")[2] for n in names] != [str(i) for i in range(len(names))]:
        return None
    return prefixes.pop()
