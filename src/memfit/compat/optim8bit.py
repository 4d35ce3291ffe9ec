"""8-bit optimizer state: bitsandbytes' counterpart of the user's torch optimizer.

The ``8bit`` lever (:attr:`memfit.StepOptions.optimizer_8bit`) swaps ``torch.optim.AdamW``
for ``bitsandbytes.optim.AdamW8bit`` (``Adam`` for ``Adam8bit``) with the same parameter
groups and hyperparameters. Its two moments are uint8 with a float32 scale per block of
256 values (about 2 bytes per parameter instead of 8); tensors of fewer than 4096
elements keep float32 moments (bitsandbytes' ``min_8bit_size``). It changes the numerics
(quantised moments), so it is opt-in.

The one private corner used, ``Optimizer8bit.name2qmap``, is exercised by
``tests/test_fit.py``: bitsandbytes builds its quantisation maps with data-dependent
code that cannot run on fake tensors, so they are built for real and then made fake.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from memfit.errors import WorkloadError

__all__ = ["unavailable", "eight_bit", "make_maps_fake", "eight_bit_name"]

# torch optimizer -> bitsandbytes 8-bit optimizer with the same update rule
_COUNTERPARTS = {torch.optim.AdamW: "AdamW8bit", torch.optim.Adam: "Adam8bit"}
_HYPER = ("lr", "betas", "eps", "weight_decay")

PYTHON_CPU_KERNELS = frozenset({"bitsandbytes::optimizer_update_8bit_blockwise", "bitsandbytes::optimizer_update_32bit"})
"""bitsandbytes ops whose CPU kernel is Python made of torch ops, which allocate: the 8-bit
update dequantises both moments (and the gradient) to float32 temporaries before it
quantises them back. The recorder runs them with itself on, so those are in the ledger
(the CUDA kernels are fused and allocate nothing)."""


def eight_bit_name(optimizer: torch.optim.Optimizer) -> str:
    """``"bitsandbytes AdamW8bit"`` for an AdamW (the counterpart's name, for messages and snippets)."""
    return f"bitsandbytes {_COUNTERPARTS.get(type(optimizer), '8-bit optimizer')}"


def unavailable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot get 8-bit state here, or None when it can."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'memfit[8bit]' or pip install bitsandbytes)"
    kind = type(optimizer)
    if kind not in _COUNTERPARTS:
        return (
            f"{kind.__name__} has no 8-bit counterpart memfit knows (torch.optim.AdamW -> AdamW8bit, "
            "torch.optim.Adam -> Adam8bit)"
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                return f"the optimizer has {flag}=True, which bitsandbytes' 8-bit {kind.__name__} does not do"
        if isinstance(group.get("lr"), torch.Tensor):
            return "the optimizer's learning rate is a tensor, which bitsandbytes' optimizers do not take"
        if kind is torch.optim.Adam and group.get("weight_decay") and not group.get("decoupled_weight_decay"):
            # torch's Adam adds weight decay to the gradient (L2); bitsandbytes decays the weights (AdamW's rule)
            return "torch Adam's weight_decay is an L2 term on the gradient; bitsandbytes' Adam8bit decouples it (AdamW's rule)"
    return None


def eight_bit(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new bitsandbytes 8-bit optimizer over ``optimizer``'s parameter groups, with their
    hyperparameters and no state (it is created by the first step, as at the start of
    training). ``optimizer`` itself is not touched."""
    why = unavailable(optimizer)
    if why is not None:
        raise WorkloadError(f"8-bit optimizer state: {why}")
    import bitsandbytes as bnb

    kind = getattr(bnb.optim, _COUNTERPARTS[type(optimizer)])
    groups = [{"params": list(g["params"]), **{k: g[k] for k in _HYPER if k in g}} for g in optimizer.param_groups]
    return kind(groups)


def make_maps_fake(optimizer: torch.optim.Optimizer, mode: Any) -> None:
    """Turn the quantisation maps bitsandbytes built at construction into fake tensors of
    ``mode``, so the state a fake step creates is all fake (a real map would be moved to
    the parameters' device: a CUDA one on a host without CUDA)."""
    maps = getattr(optimizer, "name2qmap", None)
    if isinstance(maps, dict):
        for key, value in list(maps.items()):
            if isinstance(value, torch.Tensor):
                maps[key] = mode.from_tensor(value)
