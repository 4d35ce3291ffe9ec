"""Autocast (``amp``): bfloat16 on CPU; float16 with a GradScaler on CUDA. Changes the
numerics: weighed only when allowed, and only for a float32 model."""

from __future__ import annotations

from memfit.levers.catalog.base import Lever, Lines, float32_only, opt_in


def _settings(s):
    if "amp" not in s.allowed:
        return opt_in("amp", "")
    return float32_only(s) or ("amp",)


def _step(combo, s):
    amp = combo.precision == "amp"
    return {"autocast": ("float16" if s.cuda else "bfloat16") if amp else None, "grad_scaler": amp and s.cuda}


def _lines(recipe):
    context = ("run.autocast()", f"torch.autocast(dtype=torch.{recipe.step.autocast})")
    if not recipe.step.grad_scaler:
        return Lines(context=context)
    return Lines(
        setup=("scaler = run.scaler  # torch.amp.GradScaler for float16",),
        context=context,
        backward="scaler.scale(loss).backward()",
        step=("scaler.step(optimizer)", "scaler.update()"),
    )


LEVER = Lever(
    name="amp",
    exact=False,
    does="torch.autocast: bfloat16 on CPU; float16 with a GradScaler on CUDA",
    settings=_settings,
    used=lambda combo, plan, s: combo.precision == "amp",
    step=_step,
    words=lambda step, plan, optimizer_type: f"amp ({step.autocast} autocast{' + GradScaler' if step.grad_scaler else ''})",
    field="precision",
    lines=_lines,
)
