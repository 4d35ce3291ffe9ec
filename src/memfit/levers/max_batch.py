"""``memfit.max_batch``: the largest batch whose training step fits a budget, and the
fastest recipe for it, found without running a step that does not fit.

For each set of levers that changes how memory grows with the batch (as it is; recompute
at its lowest reachable peak; on CUDA, activation offload; with ``allow``, autocast,
bfloat16 parameters or 8-bit optimizer state, each also with recompute), the step's peak is a function of the batch size. Two exact fake-tensor
measurements (the example batch and twice it) give the bytes per sample and the fixed
bytes; the line predicts the largest batch under the budget. Fake-tensor measurements
at the prediction and one sample-step above it confirm it (a peak can move from the
backward to the optimizer step, so the line is a guess until checked); where it is off,
a bisection between a batch that fits and one that does not settles it. No real tensor
of a batch that does not fit is ever allocated.

The largest batch over the lever sets is then handed to :func:`memfit.fit`, which picks the
fastest recipe at that batch and measures it for real: the verification step. Micro-
batching is left to that recipe: it makes the effective batch as large as one likes, so
the batch here is what one forward and backward hold.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memfit.compat import optim8bit
from memfit.errors import BudgetInfeasibleError, WorkloadError
from memfit.levers.fit import fit, fit_budget, parse_allow
from memfit.levers.recipe import Recipe
from memfit.measure.checked import Step, checked_step
from memfit.measure.profile import Progress, fake_peaks
from memfit.measure.step import StepOptions
from memfit.plan.planner import plan as make_plan
from memfit.units import format_bytes
from memfit.workload import Where, batch_size_of, resize_batch, resize_targets

if TYPE_CHECKING:
    from memfit.levers.recipe import RankRecipe

__all__ = ["max_batch", "largest_batch", "largest_size", "MaxBatch", "BatchLimit"]

_LIMIT = 1 << 20  # a step whose peak does not grow with the batch stops here


@dataclass(frozen=True)
class BatchLimit:
    """How one set of levers scales with the batch, and the largest batch it fits."""

    levers: tuple[str, ...]
    max_batch: int
    """0: not even a batch of ``multiple_of`` fits."""
    bytes_per_sample: int
    fixed_bytes: int
    predicted_batch: int
    """What the line through two measurements predicted, before the checks."""
    peak_bytes: int
    """The exact (fake-tensor) peak at ``max_batch`` (on CUDA, real or fake: the caching
    allocator's reserved peak, which the budget bounds); 0 when it is 0."""
    measurements: int

    @property
    def label(self) -> str:
        return " + ".join(self.levers) or "as it is"

    def to_dict(self) -> dict[str, Any]:
        return {
            "levers": list(self.levers),
            "max_batch": self.max_batch,
            "bytes_per_sample": self.bytes_per_sample,
            "fixed_bytes": self.fixed_bytes,
            "predicted_batch": self.predicted_batch,
            "peak_bytes": self.peak_bytes,
            "measurements": self.measurements,
        }


@dataclass
class MaxBatch:
    budget_bytes: int
    batch_size: int
    example_batch: int
    limits: list[BatchLimit]
    recipe: Recipe | RankRecipe | None
    """The fastest recipe at ``batch_size``, measured for real; None on fake CUDA (no step
    can be timed or verified there)."""
    search_time_s: float
    multiple_of: int = 1
    model_type: str = ""
    device: str = ""
    world_size: int | None = None
    """A distributed step's world size: the batch and budget are per rank, and :attr:`recipe`
    is a :class:`memfit.levers.recipe.RankRecipe` (:func:`memfit.levers.rank_fit.max_batch_ranks`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "batch_size": self.batch_size,
            "example_batch": self.example_batch,
            "limits": [lim.to_dict() for lim in self.limits],
            "recipe": self.recipe.to_dict() if self.recipe is not None else None,
            "device": self.device,
            "predicted_only": self.recipe is None,
            "search_time_s": self.search_time_s,
            "multiple_of": self.multiple_of,
            "world_size": self.world_size,
        }


def largest_of(limits: Sequence[BatchLimit], budget: int, multiple: int, world_size: int | None = None) -> int:
    """The largest batch over ``limits``; refused when not even a batch of ``multiple`` fits,
    naming the lowest peak there (per rank of ``world_size`` ranks, for a distributed step)."""
    batch = max(lim.max_batch for lim in limits)
    if batch == 0:
        low = min(limits, key=lambda lim: lim.fixed_bytes + lim.bytes_per_sample * multiple)
        at = low.fixed_bytes + low.bytes_per_sample * multiple
        per, ranks = ("", "") if world_size is None else (" per rank", f" per rank at {world_size} ranks")
        raise BudgetInfeasibleError(
            f"budget {format_bytes(budget)}{per} does not hold even a batch of {multiple}{ranks}: "
            f"the lowest peak there is about {format_bytes(at)} ({low.label})",
            min_peak_bytes=at,
            budget_bytes=budget,
        )
    return batch


def _largest(
    peak: Callable[[int], int], budget: int, start: int, multiple: int, levers: tuple[str, ...] = (), limit: int = _LIMIT
) -> BatchLimit:
    """Largest multiple of ``multiple`` (up to ``limit``) whose ``peak`` is within ``budget``,
    searched from the line through the peaks at ``start`` and twice it."""
    seen: dict[int, int] = {}

    def at(b: int) -> int:
        if b not in seen:
            seen[b] = peak(b)
        return seen[b]

    b1 = max(multiple, start // multiple * multiple)
    b2 = b1 + max(multiple, b1)
    if b2 > limit:  # the line through two sizes at or below the cap
        b2 = max(multiple, limit // multiple * multiple)
        b1 = max(multiple, b2 // 2 // multiple * multiple)
    if b1 == b2:  # one size only
        fits = at(b1) <= budget
        return BatchLimit(levers, b1 if fits else 0, 0, at(b1), b1, at(b1) if fits else 0, len(seen))
    slope = (at(b2) - at(b1)) / (b2 - b1)
    fixed = at(b1) - slope * b1
    guess = limit if slope <= 0 else int((budget - fixed) // slope)
    guess = max(multiple, min(limit, guess) // multiple * multiple)
    # Gallop from the guess (usually right, or a step off) to a bracket: lo fits (0:
    # nothing does), hi does not (None: the cap fits).
    step = multiple
    if at(guess) <= budget:
        lo, hi = guess, None
        while lo + step <= limit and at(lo + step) <= budget:
            lo, step = lo + step, step * 2
        if lo + step <= limit:
            hi = lo + step
    else:
        lo, hi = 0, guess
        while hi - step >= multiple and at(hi - step) > budget:
            hi, step = hi - step, step * 2
        lo = hi - step if hi - step >= multiple else 0  # fits, or nothing checked fits yet
    if hi is None:  # fits at the cap: the peak does not grow with the batch
        return BatchLimit(levers, lo, round(slope), round(fixed), guess, at(lo), len(seen))
    while hi - lo > multiple:  # bisect on multiples
        mid = max(lo + multiple, (lo + hi) // 2 // multiple * multiple)
        if at(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return BatchLimit(levers, lo, round(slope), round(fixed), guess, at(lo) if lo else 0, len(seen))


def _largest_on(ladder: Sequence[int], peak: Callable[[int], int], budget: int, start: int = 1) -> BatchLimit:
    """:func:`_largest` when only the batch sizes of ``ladder`` (sorted) are wanted, as
    Lightning's finder in power mode tries only powers of two: the line through the peaks at
    the rung of ``start`` (the largest rung not above it) and the next guesses the rung, then
    single rungs up or down settle it (usually one or two more profiles: the rung guessed,
    and the one above it)."""
    seen: dict[int, int] = {}

    def at(i: int) -> int:
        if ladder[i] not in seen:
            seen[ladder[i]] = peak(ladder[i])
        return seen[ladder[i]]

    first = max(0, min(len(ladder) - 2, bisect.bisect_right(ladder, start) - 1))
    second = min(first + 1, len(ladder) - 1)
    slope = (at(second) - at(first)) / max(1, ladder[second] - ladder[first])
    fixed = at(first) - slope * ladder[first]
    guess = _LIMIT if slope <= 0 else int((budget - fixed) // slope)
    rung = max(0, bisect.bisect_right(ladder, guess) - 1)
    if at(rung) <= budget:
        while rung + 1 < len(ladder) and at(rung + 1) <= budget:
            rung += 1
    else:
        while rung >= 0 and at(rung) > budget:
            rung -= 1
    batch = ladder[rung] if rung >= 0 else 0
    return BatchLimit((), batch, round(slope), round(fixed), guess, seen[batch] if batch else 0, len(seen))


def max_batch(
    model: nn.Module,
    inputs: Any,
    budget: int | str,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    allow: str | Iterable[str] | None = None,
    set_to_none: bool = True,
    multiple_of: int = 1,
    progress: Progress | None = None,
    targets: Any = None,
    fake: bool | str | Where = False,
) -> MaxBatch:
    """The largest batch whose training step peaks within ``budget``, with the fastest recipe for it.

    Args:
        model, inputs, loss_fn, optimizer, targets: the step, as for :func:`memfit.profile`;
            ``inputs`` is an example batch: every tensor whose dim 0 is its batch size (in
            the inputs and the targets) is tiled or cut to the batch sizes tried.
        budget: bytes bounding the whole step's peak (``"6GiB"``); on CUDA (real or fake) its reserved peak.
        allow: opt-in levers that change the numerics (``"amp"``, ``"bf16"``, ``"8bit"``), as for :func:`memfit.fit`.
        set_to_none: what the training loop calls now, as for :func:`memfit.fit`.
        multiple_of: only batch sizes that are multiples of this (8 for tensor cores, say).
        fake: ``"cuda"``: the peaks on fake CUDA (a model on the CPU, as for
            :func:`memfit.profile`); the batch is then a prediction and no recipe is timed or
            verified (``MaxBatch.recipe`` is None). Activation offload is not tried there.

    Returns:
        A :class:`MaxBatch`: the batch size, how each lever set scales (bytes per sample,
        fixed bytes, its largest batch) and the :class:`Recipe` at that batch, measured.
        The model, its gradients and buffers, the optimizer and the RNG are left as they were.

    Raises:
        BudgetInfeasibleError: not even a batch of ``multiple_of`` fits with the levers allowed.
    """
    started = time.perf_counter()
    target = fit_budget(budget)
    allowed = parse_allow(allow)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise WorkloadError(f"multiple_of must be a positive integer, got {multiple_of!r}")
    the = checked_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=fake, targets=targets, unwrapped=True)
    model, optimizer, device = the.model, the.optimizer, the.device
    example = batch_size_of(the.args, the.kwargs)
    if example is None:
        raise WorkloadError("no input tensor has a batch dimension: there is no batch size to grow")
    report = progress or (lambda desc, done, total: None)
    fake_cuda = the.fake_cuda
    if the.where is Where.FAKE:
        raise WorkloadError("max_batch runs its peaks on fake tensors already: fake takes only 'cuda' (a simulated GPU)")
    cuda = the.cuda
    on = Where.FAKE_CUDA if fake_cuda else Where.FAKE

    variants = _variants(model, optimizer, allowed, cuda=cuda, fake_cuda=fake_cuda)
    limits = _limits(the, variants, inputs, targets, target, multiple_of, report, loss_fn=loss_fn, on=on)
    batch = largest_of(limits, target, multiple_of)

    def answer(batch: int, recipe: Recipe | None, device: str) -> MaxBatch:
        return MaxBatch(
            budget_bytes=target,
            batch_size=batch,
            example_batch=example,
            limits=limits,
            recipe=recipe,
            search_time_s=time.perf_counter() - started,
            multiple_of=multiple_of,
            model_type=type(model).__name__,
            device=device,
        )

    if fake_cuda:
        return answer(batch, None, "fake:cuda:0")
    fit_at = partial(fit, model, loss_fn=loss_fn, optimizer=optimizer, allow=allowed, set_to_none=set_to_none, progress=progress)
    batch, recipe = _fastest_at(batch, target, multiple_of, report, fit_at, inputs, targets)
    recipe.budget = str(budget)
    return answer(batch, recipe, str(device))


def _fastest_at(
    batch: int, target: int, multiple_of: int, report: Progress, fit_at: Callable[..., Recipe], inputs: Any, targets: Any
) -> tuple[int, Recipe]:
    """The fastest recipe at ``batch``, measured (``fit_at`` is :func:`fit` on the step, which runs it for real).
    fit plans on real tensors, whose figures can differ from the fake ones by a few bytes: a
    batch that then does not fit steps down, at most twice."""
    for _ in range(3):
        report(f"fastest recipe at batch {batch}", 0, 0)
        try:
            recipe = fit_at(resize_batch(inputs, batch), target, targets=resize_targets(targets, inputs, batch))
            return batch, recipe
        except BudgetInfeasibleError:
            if batch <= multiple_of:
                raise
            batch -= multiple_of
    raise BudgetInfeasibleError(
        f"no recipe fits batch {batch + multiple_of} or the two below it when measured, though fake tensors said so",
        min_peak_bytes=target + 1,
        budget_bytes=target,
    )


def _variants(
    model: nn.Module, optimizer: torch.optim.Optimizer, allowed: set[str], *, cuda: bool, fake_cuda: bool
) -> dict[str, StepOptions]:
    """The step as it is and each lever that changes how its peak grows with the batch (each
    alone; recompute is weighed on every one of them by :func:`_limits`)."""
    variants = {"": StepOptions()}
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if "amp" in allowed and dtypes == {torch.float32}:
        variants["amp"] = StepOptions(autocast="float16" if cuda else "bfloat16", grad_scaler=cuda)
    if "bf16" in allowed and dtypes == {torch.float32}:
        variants["bf16"] = StepOptions(param_dtype="bfloat16")
    if "8bit" in allowed and optim8bit.unavailable(optimizer) is None:
        variants["8bit"] = StepOptions(optimizer_8bit=True)
    if cuda and not fake_cuda:  # an exact lever, weighed by fit on CUDA; not combined with recompute (as in fit)
        variants["offload"] = StepOptions(offload=True)
    return variants


def _limits(
    the: Step,
    variants: dict[str, StepOptions],
    inputs: Any,
    targets: Any,
    target: int,
    multiple_of: int,
    report: Progress,
    *,
    loss_fn: Callable[..., torch.Tensor] | None,
    on: Where,
) -> list[BatchLimit]:
    """Each variant's largest batch within ``target``, without recompute and with its lowest
    recompute peak, from fake-tensor peaks at the batches the search asks for."""
    model, optimizer, example = the.model, the.optimizer, batch_size_of(the.args, the.kwargs)

    def plain(peak_at: Callable[[Any, Any], int]) -> Callable[[int], int]:
        def peak(b: int) -> int:
            report(f"fake-tensor profile at batch {b}", 0, 0)
            return peak_at(resize_batch(inputs, b), resize_targets(targets, inputs, b))

        return peak

    def recomputed(step: StepOptions) -> Callable[[int], int]:
        def peak(b: int) -> int:
            report(f"lowest recompute peak at batch {b}", 0, 0)
            batch, labels = resize_batch(inputs, b), resize_targets(targets, inputs, b)
            return make_plan(
                model, batch, 0.0, loss_fn=loss_fn, optimizer=optimizer, fake=on, step=step, targets=labels
            ).min_peak_bytes

        return peak

    limits = []
    for name, step in variants.items():
        for recompute in (False,) if step.offload else (False, True):
            levers = (("recompute",) if recompute else ()) + ((name,) if name else ())
            if recompute:
                limits.append(_largest(recomputed(step), target, example, multiple_of, levers))
                continue
            # one fake copy of the step, warmed once, recorded at each batch the search asks for
            with fake_peaks(the.on(on, step)) as at:
                limits.append(_largest(plain(at), target, example, multiple_of, levers))
    return limits


def largest_size(
    peak: Callable[[int], int], budget: int | str, start: int, multiple_of: int = 1, limit: int = _LIMIT
) -> BatchLimit:
    """The largest size (a multiple of ``multiple_of``, up to ``limit``) whose ``peak(size)``
    is within ``budget``: :func:`max_batch`'s search (a line through the peaks at ``start`` and
    twice it, checked at its guess and one step above, bisected where it is off) along any
    dimension, a sequence length say. ``max_batch`` of the answer is that size (0: none fits)."""
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise WorkloadError(f"multiple_of must be a positive integer, got {multiple_of!r}")
    return _largest(peak, fit_budget(budget), start, multiple_of, limit=max(multiple_of, limit))


def largest_batch(
    model: nn.Module,
    inputs: Any,
    budget: int | str,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    targets: Any = None,
    step: StepOptions | None = None,
    multiple_of: int = 1,
    fake: bool | str | Where = True,
    ladder: Sequence[int] | None = None,
) -> BatchLimit:
    """The largest batch (a multiple of ``multiple_of``) whose step, exactly as it is (no
    lever: what a framework's batch-size finder tries), peaks within ``budget``: the search
    of :func:`max_batch` for one lever set, on fake tensors only (``fake="cuda"``: fake
    CUDA), no step timed or run for real. ``max_batch`` 0: not even ``multiple_of`` fits.
    ``ladder``: the only batch sizes wanted (Lightning's powers of two, say), positive and
    increasing; ``max_batch`` is then the largest of them that fits, found with fewer profiles."""
    target = fit_budget(budget)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise WorkloadError(f"multiple_of must be a positive integer, got {multiple_of!r}")
    if ladder is not None:
        ladder = list(ladder)
        if (
            not ladder
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in ladder)
            or ladder != sorted(set(ladder))
        ):
            raise WorkloadError(f"ladder must be batch sizes, positive integers in increasing order, got {ladder!r}")
    the = checked_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, fake=fake, options=step, targets=targets)
    example = batch_size_of(the.args, the.kwargs)
    if example is None:
        raise WorkloadError("no input tensor has a batch dimension: there is no batch size to grow")
    on = Where.FAKE_CUDA if the.fake_cuda else Where.FAKE

    with fake_peaks(the.on(on)) as peak_at:

        def peak(b: int) -> int:
            return peak_at(resize_batch(inputs, b), resize_targets(targets, inputs, b))

        if ladder is not None:
            return _largest_on(ladder, peak, target, example)
        return _largest(peak, target, example, multiple_of)
