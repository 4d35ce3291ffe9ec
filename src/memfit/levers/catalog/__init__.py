"""Every memory lever memfit knows, one module each, in the order recipes name them.

A lever is a :class:`~memfit.levers.catalog.base.Lever` record: its name, whether it is
exact, what it does, the settings it offers on a step or the typed :class:`Reason` it is not
weighed, whether a combination uses it, the :class:`~memfit.measure.step.StepOptions` it sets
(how it changes the step; the step's runner, :func:`memfit.measure.step.train_step`, is its
mechanism) and its words in a recipe's summary. :func:`memfit.fit` loops over :data:`ALL`.
Adding a lever: a module here with its ``LEVER``, its entry in :data:`ALL`, and a test
(docs/architecture.md, "Adding a lever")."""

from __future__ import annotations

from memfit.levers.catalog import (
    amp,
    bf16,
    eight_bit,
    expandable_segments,
    foreach,
    microbatch,
    offload,
    recompute,
    set_to_none,
)
from memfit.levers.catalog.base import Combo, Lever, Lines, Reason, Situation, Why

__all__ = ["ALL", "BY_NAME", "EXACT", "OPT_IN", "Combo", "Lever", "Lines", "Reason", "Situation", "Why"]

ALL: tuple[Lever, ...] = (
    recompute.LEVER,
    microbatch.LEVER,
    set_to_none.LEVER,
    offload.LEVER,
    amp.LEVER,
    bf16.LEVER,
    foreach.LEVER,
    eight_bit.LEVER,
    expandable_segments.LEVER,
)
BY_NAME: dict[str, Lever] = {lever.name: lever for lever in ALL}
EXACT: tuple[str, ...] = tuple(lever.name for lever in ALL if lever.exact)
"""Levers that leave what training computes as it was: always weighed."""
OPT_IN: tuple[str, ...] = tuple(lever.name for lever in ALL if not lever.exact)
"""Levers that change the numerics: weighed only when ``allow`` names them."""
