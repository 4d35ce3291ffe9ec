"""Recompute: activations recomputed in backward instead of kept (memfit's plan). Planned per
combination of the other levers (:func:`memfit.plan`), so it has no setting of its own here."""

from __future__ import annotations

from memfit.levers.catalog.base import Lever, Lines


def _words(step, plan, optimizer_type):
    n = len(plan.checkpointed) if plan is not None else 0
    return f"recompute ({n} module{'s' if n != 1 else ''})"


def _lines(recipe):
    n = len(recipe.plan.checkpointed) if recipe.plan is not None else 0
    if not n:
        return Lines()
    off = " with use_cache=False while training" if recipe.plan.use_cache_off else ""
    applied = [f"recompute {n} module{'s' if n != 1 else ''}{off} (memfit.remove(model) undoes it)"]
    if any(getattr(c, "mode", None) == "selective" for c in recipe.plan.checkpointed.values()):
        # how those run is decided on the user's machine (is torch_remat installed?), so say where to look
        applied.append("selective ones through torch_remat where installed, else a checkpoint policy: memfit.mechanisms(model)")
    return Lines(applied=tuple(applied))


LEVER = Lever(
    name="recompute",
    exact=True,
    does="recompute activations in backward instead of keeping them (memfit.plan)",
    settings=lambda s: (),
    used=lambda combo, plan, s: plan is not None and bool(plan.checkpointed),
    step=lambda combo, s: {},
    words=_words,
    lines=_lines,
)
