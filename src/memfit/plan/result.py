"""The :class:`Plan`: what to recompute, what it predicts, and how it was made. Plain data,
saved and loaded as versioned JSON."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from torch import nn

from memfit.errors import MemfitError, PlanError
from memfit.measure.step import StepOptions

__all__ = ["Plan", "Choice", "PLAN_FORMAT", "fingerprint"]

PLAN_FORMAT = "memfit.plan"
PLAN_VERSION = 2
"""2 adds ``step``, the options of the step the plan was verified on; a version 1 plan was
verified on the usual step (:class:`StepOptions` defaults), and reads as that."""


@dataclass(frozen=True)
class Choice:
    """How one module is recomputed."""

    mode: str
    """``"full"``: checkpoint the whole module; ``"selective"``: keep the outputs of
    ``save_ops`` (aten op names) and recompute the rest."""
    save_ops: tuple[str, ...] = ()


def _class_name(mod: nn.Module) -> str:
    """The user's class of ``mod``: FSDP2's ``fully_shard`` swaps a module's class for a
    generated subclass (``FSDPBlock``), which must not make a plan look foreign."""
    for cls in type(mod).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls.__name__
    return type(mod).__name__


def fingerprint(model: nn.Module) -> str:
    """Identifies a model's structure: module names and types, parameter shapes and dtypes."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"{name}:{_class_name(mod)};".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def parse_json(text: str, what: str) -> Any:
    """``text`` parsed, or PlanError naming ``what`` file it was meant to be."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise PlanError(f"{what} JSON does not parse: {exc}") from exc


def read_versioned(data: Any, fmt: str, version: int, what: str) -> dict[str, Any]:
    """The body of a ``{"format": fmt, "version": N, ...}`` object that this memfit reads."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise PlanError(f'not a memfit {what}: the JSON has no "format": "{fmt}"')
    got = data.get("version")
    # A version that is not a positive integer is a corrupt file, not a newer format.
    if isinstance(got, bool) or not isinstance(got, int) or got < 1:
        raise PlanError(f"{what} JSON has no valid format version (got {got!r}; expected an integer such as {version})")
    if got > version:
        raise PlanError(f"{what} format version {got!r} is newer than this memfit reads ({version}); upgrade memfit")
    return {k: v for k, v in data.items() if k not in ("format", "version")}


def check_fingerprint(model: nn.Module, made_for: str, model_type: str, what: str, remedy: str) -> None:
    """PlanError unless a plan or recipe with fingerprint ``made_for`` (empty: hand-made) fits ``model``."""
    if made_for and made_for != fingerprint(model):
        raise PlanError(
            f"this {what} was made for another model ({model_type}, fingerprint {made_for}); "
            f"this {type(model).__name__} has fingerprint {fingerprint(model)}: {remedy}"
        )


@dataclass
class Plan:
    """What :func:`memfit.plan` chose. Memory in bytes, times in seconds."""

    budget_bytes: int
    """The bound on the step's whole peak that the plan meets."""
    predicted_peak_bytes: int
    """Peak of the step with the plan applied, verified by running the planned step (on fake tensors, or on the real model, restored after)."""
    start_bytes: int
    """Live bytes when the step begins (parameters, optimizer state, inputs)."""
    none_peak_bytes: int
    """``P_none``: the peak with nothing recomputed."""
    min_peak_bytes: int
    """``P_min``: the lowest peak memfit can reach for this step."""
    checkpointed: dict[str, Choice]
    """Qualified module names and how each is recomputed."""
    extra_compute_s: float | None
    """Predicted recompute time per step (from measured module times; None on fake tensors)."""
    extra_flops: int
    """Recomputed FLOPs per step, counted by running the plan (0 for pointwise and CPU ops
    without a FLOP formula)."""
    step_time_s: float | None
    """The unplanned step's measured time, for scale."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Modules memfit would not recompute, with the reason."""
    use_cache_off: tuple[str, ...] = ()
    """Modules (``""``: the root) whose ``use_cache`` argument the plan turns off while the
    model trains, as transformers' own gradient checkpointing does: their forward would
    otherwise write a KV cache that a training step never reads and a recompute would
    write again. The plan was measured with it off; :func:`memfit.apply` turns it off and
    :func:`memfit.remove` back (:mod:`memfit.recompute.cache`). Empty for most models."""
    model_type: str = ""
    fingerprint: str = ""
    device: str = "cpu"
    budget: str = ""
    """The budget as given."""
    objective: str = "time"
    """What the plan minimised: estimated recompute ``"time"`` or recomputed ``"flops"``."""
    planning_time_s: float = 0.0
    allocated_peak_bytes: int | None = None
    """On CUDA (real or fake): the planned step's ``max_memory_allocated`` (its tensors in
    512 B blocks), beside :attr:`predicted_peak_bytes`, which is then its
    ``max_memory_reserved`` (what runs out). ``None`` elsewhere."""
    peak_basis: str = "peak_bytes"
    """What the budget, the predicted peak, ``P_none`` and ``P_min`` count: ``"peak_bytes"``
    (live tensor bytes) or on CUDA ``"reserved_peak_bytes"`` (the caching allocator's
    segments, from memfit's model of it replaying the planned step's allocations)."""
    timing_note: str = ""
    """Why the measured times were set aside, when they were (too noisy to rank options):
    ``extra_compute_s`` is then the cost model's estimate."""
    verify_note: str = ""
    """Why plans were verified on the real step rather than on fake copies of it, when a
    fake copy could not run it (a fake kernel refusing what the real op runs)."""
    world_size: int | None = None
    """A distributed step's ranks (:func:`memfit.plan_ranks`); None: one process."""
    rank_peak_bytes: dict[int, int] | None = None
    """Per rank of a distributed step: its peak with the plan applied, each verified on the
    fake process group (:attr:`predicted_peak_bytes` is the highest)."""
    rank_modules: dict[int, tuple[str, ...]] | None = None
    """Under pipeline parallelism (each rank its own stages' modules, planned on its own): each
    stage rank's share of :attr:`checkpointed`. None where one plan serves every rank."""
    min_peak_verified: bool = True
    """Whether :attr:`min_peak_bytes` was measured by running the lowest plans (as every other
    peak of a plan is); False: priced on the ledger's model of the step instead (MiB-rounded
    rows, not run), because the cheapest plan verified within a budget in bytes without it
    (:func:`memfit.plan_ranks`: two steps of a rank fewer)."""
    step: StepOptions = field(default_factory=StepOptions)
    """How the step the plan was verified on runs (micro-batches, accumulation, autocast, ...)."""
    reproducibility_note: str = ""
    """Why the step is not bitwise equal to itself from run to run, with or without the plan
    (:attr:`memfit.Profile.reproducibility_note`); empty for a reproducible step, whose
    planned training is bitwise equal to unplanned."""

    @property
    def extra_compute_fraction(self) -> float | None:
        """Predicted recompute time as a fraction of the unplanned step time."""
        if self.extra_compute_s is None or not self.step_time_s:
            return None
        return self.extra_compute_s / self.step_time_s

    def under(self, prefix: str, module: nn.Module) -> Plan:
        """This plan for ``module``, the submodule ``prefix`` of the model it was made on: the
        names relative to it, its fingerprint and type. A target that wraps the user's model
        (to run its loss in ``forward``) is planned whole; the user applies the plan to the
        model they hold. Modules outside it (the loss) are dropped from ``excluded``; a plan
        recomputing one, or ``prefix`` itself, is refused (the user's model could not run it)."""
        lead = prefix + "."
        outside = [n for n in self.checkpointed if not n.startswith(lead)]
        if outside:
            raise PlanError(f"the plan recomputes {outside[0]!r}, outside {prefix!r}: it cannot be applied to {prefix!r} alone")

        def inside(names: Any) -> dict[str, Any]:
            return {n[len(lead) :]: v for n, v in names.items() if n.startswith(lead)}

        return replace(
            self,
            checkpointed=inside(self.checkpointed),
            excluded=inside(self.excluded),
            use_cache_off=tuple(n[len(lead) :] for n in self.use_cache_off if n.startswith(lead)),
            model_type=type(module).__name__,
            fingerprint=fingerprint(module),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["checkpointed"] = {k: {"mode": c.mode, "save_ops": list(c.save_ops)} for k, c in self.checkpointed.items()}
        data["use_cache_off"] = list(self.use_cache_off)
        data["step"] = self.step.to_dict()
        if not self.use_cache_off:
            # Left out when empty: such a plan stays readable by a memfit from before the
            # field, while one that needs the cache off is refused there, not applied wrongly.
            del data["use_cache_off"]
        if not self.reproducibility_note:
            del data["reproducibility_note"]  # as use_cache_off: plans read as before
        for key in ("world_size", "rank_peak_bytes", "rank_modules"):
            if data[key] is None:
                del data[key]  # one process's plans read as before
        if not self.verify_note:
            del data["verify_note"]  # readable by a memfit from before the field
        if self.min_peak_verified:
            del data["min_peak_verified"]  # as verify_note
        if self.rank_peak_bytes is not None:
            data["rank_peak_bytes"] = {str(r): b for r, b in sorted(self.rank_peak_bytes.items())}
        if self.rank_modules is not None:
            data["rank_modules"] = {str(r): list(m) for r, m in sorted(self.rank_modules.items())}
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        body = read_versioned(data, PLAN_FORMAT, PLAN_VERSION, "plan")
        # The dataclass checks no types: a corrupt value would surface later, far from the file.
        for f in fields(cls):
            if f.type == "int" and f.name in body and (isinstance(body[f.name], bool) or not isinstance(body[f.name], int)):
                raise PlanError(f"plan JSON: {f.name} must be an integer, got {body[f.name]!r}")
        checkpointed = body.get("checkpointed", {})
        for name, v in checkpointed.items() if isinstance(checkpointed, dict) else ():
            ops = v.get("save_ops", []) if isinstance(v, dict) else []
            if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):  # a str would become letters
                raise PlanError(f"plan JSON: module {name!r} has save_ops {ops!r}; expected a list of aten op names")
        off = body.get("use_cache_off", [])
        if not isinstance(off, list) or not all(isinstance(n, str) for n in off):
            raise PlanError(f"plan JSON: use_cache_off must be a list of module names, got {off!r}")
        body["use_cache_off"] = tuple(off)
        # (version 1 has no step: its plans were verified on the usual step)
        step = body.get("step", {}) if data.get("version", 1) >= 2 else {}
        try:
            body["step"] = StepOptions.from_dict(step)
        except (TypeError, MemfitError) as exc:
            raise PlanError(f"plan JSON: step must hold memfit.StepOptions fields, got {step!r} ({exc})") from None
        ranks = body.get("rank_peak_bytes")
        if ranks is not None:
            try:
                body["rank_peak_bytes"] = {int(r): int(b) for r, b in ranks.items()}
            except (AttributeError, TypeError, ValueError):
                raise PlanError(f"plan JSON: rank_peak_bytes must map ranks to bytes, got {ranks!r}") from None
        shares = body.get("rank_modules")
        if shares is not None:
            try:
                body["rank_modules"] = {int(r): tuple(str(n) for n in m) for r, m in shares.items()}
            except (AttributeError, TypeError, ValueError):
                raise PlanError(f"plan JSON: rank_modules must map ranks to module names, got {shares!r}") from None
        try:
            body["checkpointed"] = {
                k: Choice(v["mode"], tuple(v.get("save_ops", ()))) for k, v in body.get("checkpointed", {}).items()
            }
            plan = cls(**body)
        except (TypeError, KeyError, AttributeError) as exc:
            raise PlanError(f"plan JSON is missing or has malformed fields ({exc})") from exc
        for name, c in plan.checkpointed.items():
            if c.mode not in ("full", "selective"):
                raise PlanError(f"plan JSON: module {name!r} has unknown mode {c.mode!r}")
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(parse_json(text, "plan"))
