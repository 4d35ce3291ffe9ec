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
    """The loss is not a scalar tensor that requires grad."""


class BudgetError(MemfitError, ValueError):
    """A memory amount or budget does not parse or is out of range."""
