"""Micro-batching: the batch split into micro-batches whose gradients accumulate. Exact when
each micro-batch's loss, scaled, adds up to the batch's: probed on the real model (evaluation
mode, restored) before it is weighed; left out for a model that normalises with batch
statistics (BatchNorm) and for a loss that couples samples."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.compat import torch_compat
from memfit.errors import LossError
from memfit.levers.catalog.base import Lever, Reason, Situation, Why
from memfit.measure.sandbox import real_sandbox
from memfit.measure.step import eval_mode
from memfit.workload import batch_size_of, call_loss, split_batch

MICRO_BATCHES = (2, 4, 8)
"""The micro-batch counts weighed (those that divide the batch)."""
_LOSS_RTOL = 1e-4


def loss_scales(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, optimizer: torch.optim.Optimizer, ks: list[int], targets: Any
) -> tuple[dict[int, float], str | None]:
    """Per micro-batch count, the factor on each micro-batch's loss that makes the
    accumulated gradient the full batch's: ``1/k`` for a mean over samples, 1 for a sum.
    Found by comparing the full batch's loss with its micro-batches' (real tensors,
    evaluation mode so dropout does not blur it, no grad, all restored). A loss that is
    neither couples the samples (a mean over the valid tokens of the whole batch, a
    contrastive loss): micro-batches would change the gradient, so that count is left out."""
    scales: dict[int, float] = {}
    why = None
    with real_sandbox(model, args, kwargs, optimizer, targets=targets) as box, torch.no_grad(), eval_mode(box.model):
        try:
            full = float(call_loss(loss_fn, box.model(*box.args, **box.kwargs), box.targets))
        except Exception as exc:  # the training step itself is checked elsewhere; this only probes
            return {}, f"the loss could not be probed in evaluation mode ({type(exc).__name__}: {str(exc)[:120]})"
        for k in ks:
            try:
                parts = [
                    float(call_loss(loss_fn, box.model(*a, **kw), t))
                    for a, kw, t in split_batch(box.args, box.kwargs, box.targets, k)
                ]
            except Exception as exc:
                cause = exc.__cause__ if isinstance(exc, LossError) and exc.__cause__ is not None else exc
                why = (
                    f"the loss of a micro-batch cannot be computed ({type(cause).__name__}: {str(cause)[:120]}); "
                    "a loss_fn that holds the whole batch's targets sees only a micro-batch's outputs: pass the targets "
                    "as targets= and take them as loss_fn(output, targets)"
                )
                break
            mean, total = sum(parts) / k, sum(parts)
            tol = _LOSS_RTOL * max(abs(full), 1e-6)
            if abs(full - mean) <= tol:
                scales[k] = 1.0 / k
            elif abs(full - total) <= tol:
                scales[k] = 1.0
            else:
                why = (
                    f"the batch's loss ({full:.6g}) is neither the mean ({mean:.6g}) nor the sum ({total:.6g}) of its {k} "
                    "micro-batches' losses: the loss couples samples, so micro-batches would change the gradient"
                )
    return scales, why


def probe(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, optimizer: torch.optim.Optimizer, targets: Any = None
) -> tuple[dict[int, float], str | None]:
    norms = [name for name, m in model.named_modules() if torch_compat.uses_batch_statistics(m)]
    if norms:
        return {}, (
            f"the model normalises with batch statistics ({type(model.get_submodule(norms[0])).__name__} {norms[0]!r}"
            + (f" and {len(norms) - 1} more" if len(norms) > 1 else "")
            + "): each micro-batch would be normalised with its own, so training would differ"
        )
    batch = batch_size_of(args, kwargs)
    if batch is None:
        return {}, "no input tensor has a batch dimension to split"
    ks = [k for k in MICRO_BATCHES if batch % k == 0]
    if not ks:
        return {}, f"a batch of {batch} does not split into {', '.join(map(str, MICRO_BATCHES))} equal micro-batches"
    scales, why = loss_scales(model, args, kwargs, loss_fn, optimizer, ks, targets)
    return scales, (why if not scales else None)


def scales(s: Situation) -> tuple[dict[int, float], str | None]:
    """Per micro-batch count the factor on each micro-batch's loss, and why micro-batches
    cannot be used when none can: :func:`probe`, run once per situation."""
    if "loss_scales" not in s.probes:
        excluded = s.exclude.get("microbatch")
        s.probes["loss_scales"] = (
            ({}, excluded) if excluded is not None else probe(s.model, s.args, s.kwargs, s.loss_fn, s.optimizer, s.targets)
        )
    return s.probes["loss_scales"]


def _settings(s):
    by_count, why = scales(s)
    if not by_count:
        kind = Why.EXCLUDED if "microbatch" in s.exclude else Why.NOT_APPLICABLE
        return Reason(kind, why or "no micro-batch count applies")
    return tuple(sorted(by_count))


def _step(combo, s):
    k = combo.micro_batches
    return {"micro_batches": k, "loss_scale": scales(s)[0][k] if k > 1 else None}


LEVER = Lever(
    name="microbatch",
    exact=True,
    does="split the batch into micro-batches and accumulate their gradients",
    settings=_settings,
    used=lambda combo, plan, s: combo.micro_batches > 1,
    step=_step,
    words=lambda step, plan, optimizer_type: f"micro-batches x{step.micro_batches}",
    field="micro_batches",
)
