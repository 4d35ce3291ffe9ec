"""Verifying plans: a recompute plan run on the step, for its exact peak (the mechanism
:func:`memfit.plan` searches with; what to try next is its policy, :mod:`memfit.plan.planner`).

A :class:`Verifier` holds a sandboxed step (the user's model restored after; on fake
copies when planning from a fake profile) and runs it with each plan the search asks for:
applied (:mod:`memfit.recompute`), recorded, replayed through the allocator model on CUDA.
Before the first plan it finds the modules a recompute could not repeat safely and the
modules whose KV cache goes off (:meth:`Verifier.stateful`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from memfit.compat import torch_compat
from memfit.cuda.allocator import AllocatorSettings
from memfit.measure.cache_check import switch_changes_numbers
from memfit.measure.distributed import FakeGroup, named_model, rank_sandbox, record_rank
from memfit.measure.ledger import Ledger, Phase
from memfit.measure.profile import Profile, record_step, step_errors
from memfit.measure.replay import replay_training
from memfit.measure.sandbox import Sandbox, fake_device, step_sandbox
from memfit.measure.scope import Scope
from memfit.measure.step import StepOptions
from memfit.recompute import cache
from memfit.recompute.checkpoint import apply_choices, last_recompute, remove, unwrap
from memfit.recompute.stateful import CACHE_HINT, checking_forward, stateful_modules
from memfit.workload import Where, Workload

__all__ = ["Verifier", "Run", "RecomputeFailed", "SwitchCheck", "Chosen", "step_verifier", "rank_verifier", "record_rank_on"]


class Chosen(Protocol):
    """One module of a plan, as a verifier runs it (:class:`memfit.plan.candidates.Option`)."""

    module: str
    mode: str
    """``"full"`` or ``"selective"``."""
    save_ops: tuple[str, ...]


SwitchCheck = Callable[[tuple[str, ...]], "str | None"]
"""Why turning the KV cache off in these modules changes the step's numbers (or None), on
a real step: what a verifier on fake tensors asks (:meth:`Verifier.stateful`)."""


@dataclass(frozen=True)
class Run:
    """What one run of a plan measured (:meth:`Verifier.run`)."""

    peak_bytes: int
    """What the budget bounds: on CUDA the caching allocator's reserved peak, else the tensor peak."""
    tensor_bytes: int
    """The ledger's peak; on CUDA the allocator model's allocated peak."""
    step_flops: int
    ledger: Ledger | None = field(default=None, compare=False, repr=False)
    """The run's recorded step (None for the unplanned step, which the profile is): what
    ``memfit plan --plot`` draws as the planned step, so the picture is the run the plan's
    predicted peak came from, and costs no profile of its own."""
    fake: bool = field(default=False, compare=False)
    """Whether the run was on fake tensors (a fake copy may verify a real profile's plans)."""


class RecomputeFailed(Exception):
    """A module's recompute failed while a plan ran: the search leaves ``module`` (a name, or
    ``"name:selective"``) out with ``reason`` and starts over."""

    def __init__(self, module: str, reason: str) -> None:
        super().__init__(reason)
        self.module = module
        self.reason = reason


class Verifier:
    """Runs plans on the step and records its exact peak: on a fake-tensor copy (no memory
    used) when planning from a fake profile, else on the real model inside a sandbox
    (faster for models of many tiny ops, whose fake dispatch dominates)."""

    def __init__(self, sandbox: AbstractContextManager[Sandbox], loss_fn: Any) -> None:
        """``sandbox``: the step to run plans on (:func:`~memfit.measure.sandbox.step_sandbox`,
        or one rank's parallelized step: :func:`~memfit.measure.distributed.rank_sandbox`),
        entered here and closed by :meth:`close`."""
        self._stack = ExitStack()
        self.box = self._stack.enter_context(sandbox)
        self.model = named_model(unwrap(self.box.model))
        """The model plans name modules of and are applied to: the sandbox's, or the module
        inside its wrapper (a rank's DistributedDataParallel, which calls it every step; a
        pipeline rank's model pruned to its stages, which its schedule runs)."""
        self.loss_fn = loss_fn
        self.runs = 0
        self._real: Verifier | None = None
        self._open_real: Callable[[], Verifier] | None = None
        self.settings: AllocatorSettings | None = None
        """On CUDA: the allocator settings each run's ledger is replayed under (set once the
        step's profile is known)."""

    def stateful(
        self, real_check: SwitchCheck | None = None, *, second: Callable[[Scope], None] | None = None
    ) -> tuple[dict[str, str], tuple[str, ...]]:
        """Modules whose forward changes Python state (:mod:`memfit.recompute.stateful`), and the
        modules whose KV cache goes off (:mod:`memfit.recompute.cache`). The check's first
        forward is the warm-up step that creates the optimizer's state when it has none
        (runs measure steady state): one forward less to pay for. It runs with probes on
        the modules taking ``use_cache``; those that return a cache get the switch, which
        stays on the sandbox's model for every later run, and the check's second forward,
        the one that counts, runs with it. The switch is used only if the step computes
        bitwise the same with it (:mod:`memfit.measure.cache_check`: on this sandbox if its
        tensors are real, else by ``real_check``); if not, the cache stays on, its writers
        are excluded as stateful, and their reason says why. ``second(scope)``: runs the
        check's second forward instead of a forward of its own, on the check's scope (a whole
        step recorded on it: :func:`record_rank_on`'s, which then costs the check nothing)."""
        box = self.box
        kept: list[str] = []
        # The first step of a plan may be this one: a failing forward is named as the
        # profile names it (step_errors), not left as the model's own traceback.
        with box.active(), Scope(self.model) as scope, step_errors(box, scope):
            probes = cache.install(self.model, cache.cache_modules(self.model), probe=True)
            self._stack.callback(cache.uninstall, self.model, probes)  # if the first forward raises
            off: tuple[str, ...] = ()

            def first() -> None:
                nonlocal off
                if box.optimizer.state:
                    with checking_forward(self.model):
                        box.model(*box.args, **box.kwargs)
                else:
                    box.step(self.loss_fn, scope.set_phase)
                    scope.set_phase(Phase.FORWARD)  # the check's second forward
                off = cache.writers(self.model)
                cache.uninstall(self.model, probes)
                probes.clear()
                why = self._switch_changes(off, real_check) if off else None
                if why is not None:
                    kept.append(why)
                    off = ()
                self._stack.callback(cache.uninstall, self.model, cache.install(self.model, off))

            scope.set_phase(Phase.FORWARD)
            judged = None if second is None else lambda: second(scope)
            reasons = stateful_modules(self.model, box.args, box.kwargs, first=first, second=judged)
            if kept:
                hint = f"; memfit keeps transformers' KV cache on: turning it off {kept[0]}, so training would differ"
                reasons = {n: why.replace(CACHE_HINT, hint) for n, why in reasons.items()}
            return reasons, off

    def _switch_changes(self, off: tuple[str, ...], real_check: SwitchCheck | None) -> str | None:
        """Why the KV cache switch on ``off`` would change the step's numbers, or None."""
        if self.box.fake_mode is None:
            return switch_changes_numbers(self.box, self.loss_fn, off)
        if real_check is None:
            return "could not be checked (the step runs on fake tensors, which carry no values)"
        return real_check(off)

    def instead_of(self, real: Verifier, use_cache_off: tuple[str, ...]) -> Verifier:
        """This (fake) verifier, standing in for ``real``, :meth:`warmed` with the KV cache
        off as :meth:`stateful` found on ``real``'s. A run that meets a kernel whose workspace
        this process has not measured (the profile came from a file) goes to ``real``, and so
        does every later run."""
        self._real = real
        return self.warmed(use_cache_off)

    def falling_back(self, open_real: Callable[[], Verifier]) -> Verifier:
        """This (fake) verifier, checked and warmed by :meth:`stateful` on its own copy,
        with the real step opened by ``open_real`` (warmed, the same KV cache off) only if a
        run meets a kernel whose workspace no one measured: a plan from a saved profile then
        runs no real step at all."""
        self._open_real = open_real
        return self

    def warmed(self, use_cache_off: tuple[str, ...]) -> Verifier:
        """This verifier with the KV cache off as on the verifier it stands beside, after one
        step on its sandbox (the optimizer's state and any state a module makes at its first
        forward exist: runs measure the steady step)."""
        off = [n for n in use_cache_off if n not in cache.switched(self.model)]
        self._stack.callback(cache.uninstall, self.model, cache.install(self.model, off))
        with self.box.active():
            self.box.step(self.loss_fn)
        return self

    def _fallback(self) -> Verifier | None:
        if self._real is None and self._open_real is not None:
            self._real = self._open_real()
            self._real.settings = self.settings
        return self._real

    def close(self) -> None:
        self._stack.close()

    def run(self, chosen: Sequence[Chosen]) -> Run:
        if self._real is not None and self._real.runs:
            return self._real.run(chosen)
        choices = {o.module: (o.mode, o.save_ops) for o in chosen}
        apply_choices(self.model, choices)
        self.runs += 1
        try:
            with Scope(self.model) as scope, self.box.active():
                # a fake copy standing in for the real step: an op kind the real profile never
                # ran (transformers builds masks on fake tensors that it skips on real ones) is
                # measured on its own, for real, rather than sending every run to the real step
                probe = self._real is not None or self._open_real is not None
                ledger, flops = record_step(self.box, scope, self.loss_fn, probe=probe)
        except Exception as exc:
            self._after_failure()
            culprit = last_recompute()
            if culprit in choices:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                mode = choices[culprit][0]
                key = culprit if mode == "full" else f"{culprit}:selective"
                raise RecomputeFailed(key, f"{mode} recompute not reproducible: {type(exc).__name__}: {first}"[:300]) from exc
            raise
        finally:
            remove(self.model)
        if ledger.unmeasured_ops and self._fallback() is not None:
            return self._fallback().run(chosen)
        fake = self.box.fake_mode is not None
        return Run(*_peaks(ledger, self.settings), step_flops=sum(flops.values()), ledger=ledger, fake=fake)

    def _after_failure(self) -> None:
        """The step's state as a finished step leaves it, after a run that raised part way: its
        gradients zeroed as the step's ``zero_grad`` does, and FSDP2's modules resharded (a
        backward that stopped leaves them unsharded, with the unsharded gradients it had
        made). Without it the next run started with the failed one's gradients and unsharded
        parameters alive, and measured another peak (a 4-layer Llama on 2 fake ranks: the same
        plan 273.5 MB before a failed run, 258.8 and 292.5 MB after)."""
        box = self.box
        box.optimizer.zero_grad(set_to_none=box.options.set_to_none)
        torch_compat.reset_fsdp(box.model)


def _peaks(ledger: Ledger, settings: AllocatorSettings | None) -> tuple[int, int]:
    """What a budget bounds for a recorded step, and its tensor peak: on CUDA the reserved and
    allocated peaks of its allocations and frees replayed through the caching allocator model
    (exact for the model: the planned step's own sequence, recompute included, not a bound
    fitted to the unplanned step's), else the ledger's peak twice."""
    if settings is None:
        return ledger.peak_bytes, ledger.peak_bytes
    stats = replay_training(ledger, settings).stats  # as profile's CudaMemory: the loop's steps, not one cold step
    return stats.reserved_peak_bytes, stats.allocated_peak_bytes


def step_verifier(
    where: Where,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    *,
    step: StepOptions,
    targets: Any = None,
) -> Verifier:
    """A verifier on ``model``'s step, in a sandbox restored when it closes: on fake copies
    (on the model's device or on fake CUDA) or on the real model, as ``where`` says."""
    box = step_sandbox(fake_device(where), model, args, kwargs, optimizer, step=step, targets=targets)
    return Verifier(box, loss_fn)


def rank_verifier(workload: Workload, group: FakeGroup) -> Verifier:
    """A verifier on one rank's parallelized step (:func:`~memfit.measure.distributed.rank_sandbox`)."""
    return Verifier(rank_sandbox(workload, group), workload.loss_fn)


def record_rank_on(verifier: Verifier, workload: Workload, scope: Scope | None = None) -> Profile:
    """The profile of one recorded step of ``workload``'s rank on ``verifier``'s sandbox (a
    :func:`rank_verifier`'s, warmed up by :meth:`Verifier.stateful`), named as ``scope`` (a
    scope open on ``verifier.model``; None: one of its own) names modules."""
    if scope is not None:
        return record_rank(workload, verifier.box, scope)
    with Scope(verifier.model) as own:
        return record_rank(workload, verifier.box, own)
