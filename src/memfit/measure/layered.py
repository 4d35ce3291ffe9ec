"""A fake step of L identical layers answered from fake steps of k, k+1 and k+2 layers.

:class:`LayeredSession` asks :class:`~memfit.measure.profile.FakeSession`'s questions (the
profile, the peak at other inputs or micro-batch counts) of a model of ``total`` identical
layers. Each answer records the same step of the same model built with k, k+1 and k+2
layers (three small fake sessions, each warmed up once), synthesizes the (k+2)-layer ledger
from the first two and requires it equal to the recorded one
(:func:`memfit.measure.extrapolate.extrapolate`), then synthesizes the ledger of ``total``
layers and answers from it. Where anything differs, or a small step is not steady, that
answer and every later one come from a fake session of the whole model (made when first
needed), and :attr:`LayeredSession.note` says why.

Which models have identical layers, and how their k-layer versions are built, is the
caller's (:mod:`memfit.integrations.finetune` for a transformers config).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from memfit.measure.checked import Step
from memfit.measure.extrapolate import Layers, NotPeriodic, extrapolate, grow_counts
from memfit.measure.profile import FakeSession, Profile, Progress, Recorded, model_cuda_memory, recorded_profile

__all__ = ["LayeredSession"]


class LayeredSession:
    """:class:`~memfit.measure.profile.FakeSession`'s :meth:`profile` and :meth:`peak` for
    ``step`` (``total`` identical layers named by ``layers``), from ``small``: sessions of
    the same step with ``first``, ``first + 1`` and ``first + 2`` layers. ``whole()`` opens
    the session of the whole step, for the answers that cannot be extrapolated; ``refused``:
    why none can be (the layers are not identical), and ``small`` is then empty."""

    def __init__(
        self,
        step: Step,
        small: Sequence[FakeSession],
        layers: Layers,
        first: int,
        total: int,
        whole: Callable[[], AbstractContextManager[FakeSession]],
        *,
        refused: str | None = None,
    ) -> None:
        self.step, self.small, self.layers, self.first, self.total = step, list(small), layers, first, total
        self._whole, self._stack, self._full = whole, ExitStack(), None
        self.note: str | None = refused
        """Why an answer came from the whole step's session (None: every answer was extrapolated)."""
        self.extrapolated = 0
        """Answers given from an extrapolated ledger."""

    def __enter__(self) -> LayeredSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @property
    def words(self) -> str:
        """How the answers were made, in a line."""
        k = self.first
        how = f"extrapolated from {k}- and {k + 1}-layer steps, checked at {k + 2} layers"
        if self.note is None:
            return f"the {self.total}-layer step's ledger {how}"
        if self.extrapolated:
            return f"the first {self.extrapolated} answers {how}; then the whole {self.total}-layer step recorded: {self.note}"
        return f"the whole {self.total}-layer step recorded: {self.note}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": self.total,
            "from_layers": [self.first, self.first + 1],
            "checked_at": self.first + 2,
            "extrapolated_answers": self.extrapolated,
            "note": self.note,
            "words": self.words,
        }

    def full(self) -> FakeSession:
        """The whole step's session (made on first use)."""
        if self._full is None:
            self._full = self._stack.enter_context(self._whole())
        return self._full

    def _recorded(self, batch: Any, labels: Any, micro_batches: int | None) -> Recorded | None:
        """The whole step's recorded step at these inputs, synthesized; None (and :attr:`note`) where not."""
        if self.note is not None:
            return None
        recs = [s.record(s.at(batch, labels, micro_batches=micro_batches)) for s in self.small]
        if any(r is None for r in recs):
            self.note = "a step of fewer layers is not the steady step a fresh profile records"
            return None
        got: list[Recorded] = recs  # type: ignore[assignment]
        k, n = self.first, self.total
        try:
            ledger = extrapolate([r.ledger for r in got], self.layers, k, n)
            flops = grow_counts([r.flops for r in got], self.layers, k, n)
            calls = grow_counts([r.calls for r in got], self.layers, k, n)
        except NotPeriodic as exc:
            self.note = str(exc)
            return None
        if len({r.use_cache_off for r in got}) != 1:
            self.note = "the modules whose cache is turned off differ with the number of layers"
            return None
        self.extrapolated += 1
        return Recorded(ledger, flops, calls, got[0].use_cache_off)

    def profile(self, progress: Progress | None = None, *, capacity: int | None = None) -> Profile:
        """The step's :class:`~memfit.measure.profile.Profile` at its own inputs."""
        rec = self._recorded(None, None, None)
        if rec is None:
            return self.full().profile(progress, capacity=capacity)
        return recorded_profile(self.step, rec, capacity)

    def peak(self, batch: Any = None, labels: Any = None, *, micro_batches: int | None = None) -> int:
        """:attr:`Profile.budget_peak_bytes` of the step at inputs ``batch`` cut into ``micro_batches``."""
        rec = self._recorded(batch, labels, micro_batches)
        if rec is None:
            return self.full().peak(batch, labels, micro_batches=micro_batches)
        settings = self.small[0].settings
        return model_cuda_memory(rec.ledger, settings).reserved_peak_bytes if settings is not None else rec.ledger.peak_bytes
