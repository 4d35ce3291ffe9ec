"""``zero_grad(set_to_none=True)``: no gradients kept between steps. A lever only for a loop
that calls ``zero_grad(set_to_none=False)`` today."""

from __future__ import annotations

from memfit.levers.catalog.base import Lever, Reason, Why


def _settings(s):
    if s.set_to_none:
        return Reason(Why.ALREADY_ON, "the loop already calls zero_grad(set_to_none=True): no gradients are kept between steps")
    if "set_to_none" in s.exclude:
        return Reason(Why.EXCLUDED, s.exclude["set_to_none"])
    return (True,)


LEVER = Lever(
    name="set_to_none",
    exact=True,
    does="zero_grad(set_to_none=True): no gradients kept between steps",
    settings=_settings,
    used=lambda combo, plan, s: combo.set_to_none != s.set_to_none,
    step=lambda combo, s: {"set_to_none": combo.set_to_none},
    words=lambda step, plan, optimizer_type: "zero_grad(set_to_none=True)",
    field="set_to_none",
)
