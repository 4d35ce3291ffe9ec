"""Check that turning transformers' KV cache off leaves the training step's numbers as they are.

A plan turns the cache off while training (:mod:`memfit.recompute.cache`) so that the layers
writing it can be recomputed. That is only sound if the step computes bitwise the same
with the cache off, and for some models it does not: BART's and T5's attention (transformers
5.x) hand the cache a transposed view of the keys and values, ``DynamicLayer.update``
returns ``torch.cat([empty, keys])``, a contiguous copy, and the attention's matmuls on a
contiguous key round differently from the same matmuls on the strided view the step
without a cache uses (gradients off by ~1e-9). Whisper copies its keys contiguous itself
and is unchanged. Which models are which is measured, not listed: one forward and
backward with the cache as the model has it and one with it off, from the same RNG state,
whose loss and gradients must be ``torch.equal``. Both run under
``torch.use_deterministic_algorithms``: some CPU kernels are not reproducible even
without memfit (``index_put_`` with ``accumulate=True``, the backward of
``weight[positions]`` in Whisper's decoder, adds with atomics across threads once it has
32768 elements), and their noise must not pass for the cache's. If they differ, memfit keeps the cache on
(its writers are then never recomputed) and says why in one line.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from memfit.compat import torch_compat
from memfit.measure.sandbox import Sandbox, real_sandbox
from memfit.measure.step import StepOptions, train_step
from memfit.recompute import cache

__all__ = ["switch_changes_numbers", "real_switch_check", "host_available_bytes"]

# The check's real steps may take at most this share of the host's available memory,
# judged by the parameters and their gradients alone (activations come on top): a fake plan
# of a model too large for this host (a 1.1B Llama at 8 x 2048 on a 24 GiB machine) would
# otherwise be killed, or spend minutes, on two CPU steps it exists to avoid.
_HOST_SHARE = 0.25


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (not judged)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _too_large(model: torch.nn.Module) -> str | None:
    need = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters and their gradients
    available = host_available_bytes()
    if available is None or need <= _HOST_SHARE * available:
        return None
    return (
        f"could not be checked on real tensors: the step's parameters and gradients alone take {need / 2**30:.1f} GiB, "
        f"over a quarter of this host's {available / 2**30:.1f} GiB available"
    )


class _NoStep:
    """Stands in for the optimizer: the check compares gradients, it does not train."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _forward_backward(box: Sandbox, loss_fn: Any) -> tuple[float, dict[str, torch.Tensor | None]]:
    o = box.options
    # no scaler: the sandbox's GradScaler scales by 1, which changes no gradient bit
    loss = train_step(
        box.model,
        box.args,
        box.kwargs,
        loss_fn,
        _NoStep(),  # type: ignore[arg-type]
        micro_batches=o.micro_batches,
        loss_scale=o.loss_scale,
        autocast=o.autocast_dtype,
        offload=o.offload,
        targets=box.targets,
    )
    return loss, {n: p.grad for n, p in box.model.named_parameters()}


def _differs(on: tuple[float, dict], off: tuple[float, dict]) -> str | None:
    if on[0] != off[0] and not (on[0] != on[0] and off[0] != off[0]):  # (nan: no loss value)
        return f"changes the loss ({on[0]!r} to {off[0]!r})"
    for name, g in on[1].items():
        h = off[1][name]
        if (g is None) != (h is None):
            return f"changes which parameters get gradients ({name})"
        if g is not None and not torch.equal(g, h):
            gap = (g.double() - h.double()).abs().max().item() if g.shape == h.shape else float("nan")
            return f"changes the gradient of {name} (by up to {gap:.1e})"
    return None


def switch_changes_numbers(box: Sandbox, loss_fn: Any, off: tuple[str, ...]) -> str | None:
    """What turning the cache off in ``off`` changes in the step on ``box`` (real tensors),
    in a few words (``"changes the gradient of ..."``), or None if the loss and every gradient are bitwise the same. Leaves the
    box's gradients, buffers and RNG state as it found them."""
    model = box.model
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run(switch: Callable[[], Any]) -> tuple[float, dict]:
        for p in params:
            p.grad = None  # a fresh step: gradients made, not accumulated into
        torch.set_rng_state(rng)  # the same dropout masks both times
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with switch(), box.active():
            result = _forward_backward(box, loss_fn)
        with torch.no_grad():
            for b, saved in buffers:  # both runs start from the same buffers
                b.copy_(saved)
        return result

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an op without a deterministic kernel: warn_only's warning
            on = run(lambda: cache.switched_off(model, ()))
            return _differs(on, run(lambda: cache.switched_off(model, off)))
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        for p, g in zip(params, grads):
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def real_switch_check(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    off: tuple[str, ...],
    *,
    step: StepOptions | None = None,
    targets: Any = None,
) -> str | None:
    """:func:`switch_changes_numbers` on the user's own model, in a real sandbox (restored
    after): for a plan verified on fake tensors, which carry no values to compare. A step
    that cannot run for real here (or is too large for this host) keeps the cache on, with the reason."""
    too_large = _too_large(model)
    if too_large is not None:
        return too_large
    try:
        # called from inside a fake step (its FakeTensorMode active): the check's step is real
        with torch_compat.no_dispatch_modes(), real_sandbox(model, args, kwargs, optimizer, step=step, targets=targets) as box:
            return switch_changes_numbers(box, loss_fn, off)
    except Exception as exc:  # (out of memory, a meta model): unchecked, so not switched
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        return f"could not be checked on real tensors ({type(exc).__name__}: {first})"
