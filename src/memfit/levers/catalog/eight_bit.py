"""8-bit optimizer state (``8bit``): bitsandbytes' AdamW8bit / Adam8bit in place of torch's
AdamW / Adam. Changes the numerics (quantised state): weighed only when allowed."""

from __future__ import annotations

from memfit.compat import optim8bit
from memfit.levers.catalog.base import Lever, Lines, Reason, Why, opt_in


def _settings(s):
    if "8bit" not in s.allowed:
        return opt_in("8bit", " (quantised optimizer state)")
    why_not = optim8bit.unavailable(s.optimizer)
    return Reason(Why.NOT_APPLICABLE, why_not) if why_not is not None else (True,)


LEVER = Lever(
    name="8bit",
    exact=False,
    does="8-bit optimizer state: bitsandbytes AdamW8bit / Adam8bit in place of torch's AdamW / Adam",
    settings=_settings,
    used=lambda combo, plan, s: combo.eight_bit,
    step=lambda combo, s: {"optimizer_8bit": combo.eight_bit},
    words=lambda step, plan, optimizer_type: f"8-bit {optimizer_type or 'optimizer'} state (bitsandbytes)",
    field="eight_bit",
    lines=lambda recipe: Lines(
        optimizer=f"a new bitsandbytes {recipe.optimizer_type}8bit: same parameters and hyperparameters, "
        "state from its first step (build any LR scheduler on it)"
    ),
    # foreach is a flag of torch's optimizers: the 8-bit one (bitsandbytes') has none
    allows=lambda combo: not (combo.eight_bit and combo.foreach is not None),
)
