"""The optimizer's other implementation (``foreach``): torch's foreach or for-loop step, whose
temporaries differ. Changes the numerics (another summation order): weighed only when allowed."""

from __future__ import annotations

from memfit.compat import torch_compat
from memfit.levers.catalog.base import Lever, Lines, Reason, Why, opt_in


def _settings(s):
    if "foreach" not in s.allowed:
        return opt_in("foreach", " (another summation order)")
    now = torch_compat.uses_foreach(s.optimizer)
    if now is None:
        return Reason(
            Why.NOT_APPLICABLE,
            f"{type(s.optimizer).__name__} has no foreach choice here (no flag, fused, or groups that differ)",
        )
    return (not now,)


LEVER = Lever(
    name="foreach",
    exact=False,
    does="the optimizer's other implementation (foreach or for-loop), whose step has other temporaries",
    settings=_settings,
    used=lambda combo, plan, s: combo.foreach is not None,
    step=lambda combo, s: {"foreach": combo.foreach},
    words=lambda step, plan, optimizer_type: f"{optimizer_type or 'optimizer'} foreach={step.foreach}",
    field="foreach",
    lines=lambda recipe: Lines(optimizer="the same object, foreach flag set"),
)
