"""Every error memfit raises on purpose derives from :class:`MemfitError`.

The CLI prints such an error as one line and exits non-zero; anything else
escaping is a bug in memfit and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "MemfitError",
    "TargetError",
    "WorkloadError",
    "ForwardError",
    "LossError",
    "BudgetError",
    "BudgetInfeasibleError",
    "PlanError",
]


class MemfitError(Exception):
    """Base class of the errors memfit raises for bad input or an impossible request."""


class TargetError(MemfitError):
    """A TARGET (zoo name or ``file.py:function``) cannot be found or built."""


class WorkloadError(MemfitError, TypeError):
    """A workload's parts (model, inputs, loss, optimizer) are of the wrong kind."""


class ForwardError(MemfitError):
    """The model's forward raised; the message names the innermost module running."""


class LossError(MemfitError, ValueError):
    """The loss function raised, the loss is not a scalar tensor that requires grad, or
    without a loss function the output holds no one loss to train on."""


class BudgetError(MemfitError, ValueError):
    """A memory amount or budget does not parse or is out of range."""


class BudgetInfeasibleError(BudgetError):
    """The budget is below the lowest peak memfit can reach; the message states that peak."""

    def __init__(self, message: str, *, min_peak_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes
        self.budget_bytes = budget_bytes


class PlanError(MemfitError, ValueError):
    """A plan cannot be applied or removed as asked (wrong model, applied twice, corrupt file)."""
