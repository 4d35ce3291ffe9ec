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

__all__ = [
    "unavailable",
    "eight_bit",
    "make_maps_fake",
    "eight_bit_name",
    "OPTIMIZERS",
    "by_name",
    "is_bitsandbytes",
    "fake_paged_state",
    "is_paged_state",
    "paged_state_bytes",
    "PAGED_MIN_NUMEL",
]

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


# -- the fine-tuner's optimizers by the Trainer's names (``TrainingArguments(optim=...)``) ----------

OPTIMIZERS = {
    "adamw_torch": None,
    "adamw_bnb_8bit": "AdamW8bit",
    "paged_adamw_8bit": "PagedAdamW8bit",
    "paged_adamw_32bit": "PagedAdamW32bit",
}
"""The Trainer's ``optim`` names memfit finetune takes, to the bitsandbytes class (None: torch's AdamW)."""

PAGED_MIN_NUMEL = 100_000
"""bitsandbytes' ``Optimizer8bit.get_state_buffer``: a parameter of fewer elements gets ordinary
device memory for its state even in a paged optimizer (``p.numel() < 1e5``)."""


def by_name(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer the Trainer builds for ``optim=name``, over ``params``."""
    kind = OPTIMIZERS[name]
    if kind is None:
        return torch.optim.AdamW(params, lr=lr)
    import bitsandbytes as bnb

    return getattr(bnb.optim, kind)(params, lr=lr)


def is_bitsandbytes(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("bitsandbytes.")


def is_paged_state(t: torch.Tensor) -> bool:
    """Whether ``t`` is a paged optimizer's state made by :func:`fake_paged_state` (not the step's device memory)."""
    return bool(getattr(t, "memfit_paged", False))


def fake_paged_state(optimizer: torch.optim.Optimizer) -> None:
    """On fake CUDA, a paged optimizer's paged state as what it is: CUDA unified memory
    (``cudaMallocManaged``, outside the caching allocator), which the step's allocated and
    reserved bytes do not hold. bitsandbytes' own ``get_state_buffer`` would call into its
    CUDA library; here a paged buffer is a fake tensor made without dispatching an op (so
    no recorder counts it), marked :func:`is_paged_state`. Smaller parameters' state is
    ordinary device memory, as in bitsandbytes."""
    if not getattr(optimizer, "is_paged", False):
        return
    from torch._subclasses.fake_tensor import FakeTensor

    from memfit.compat import torch_compat

    def get_state_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if p.numel() < PAGED_MIN_NUMEL:
            return torch.zeros_like(p, dtype=dtype, device=p.device)
        with torch_compat.no_dispatch_modes():
            meta = torch.empty(p.shape, dtype=dtype, device="meta")
        buf = FakeTensor(p.fake_mode, meta, p.device)
        buf.memfit_paged = True
        return buf

    optimizer.get_state_buffer = get_state_buffer  # type: ignore[method-assign]


def paged_state_bytes(params: Any, name: str) -> int:
    """Bytes of the paged state of optimizer ``name`` (0 unless paged) over ``params``: its two
    moments of every parameter of at least :data:`PAGED_MIN_NUMEL` elements, uint8 (8-bit) or
    float32 (32-bit); their 8-bit absmax and the smaller parameters' state are device memory."""
    if not name.startswith("paged_"):
        return 0
    per_value = 2 * (1 if name.endswith("8bit") else 4)
    return sum(per_value * p.numel() for p in params if p.numel() >= PAGED_MIN_NUMEL)
