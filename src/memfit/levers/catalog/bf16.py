"""bfloat16 parameters (``bf16``): parameters, gradients and optimizer state in bfloat16.
Changes the numerics: weighed only when allowed, and only for a float32 model."""

from __future__ import annotations

from memfit.levers.catalog.base import Lever, Lines, float32_only, opt_in


def _settings(s):
    if "bf16" not in s.allowed:
        return opt_in("bf16", "")
    return float32_only(s) or ("bf16",)


LEVER = Lever(
    name="bf16",
    exact=False,
    does="parameters, gradients and optimizer state in bfloat16",
    settings=_settings,
    used=lambda combo, plan, s: combo.precision == "bf16",
    step=lambda combo, s: {"param_dtype": "bfloat16" if combo.precision == "bf16" else None},
    words=lambda step, plan, optimizer_type: "bf16 parameters",
    lines=lambda recipe: Lines(
        applied=("parameters cast to bfloat16",),
        batch=("batch = run.cast(batch)  # floating-point inputs to bfloat16, like the parameters",),
        micro_batch=", cast to bfloat16",
    ),
    field="precision",
)
