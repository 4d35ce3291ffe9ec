"""Budgets, parsed once at the edge.

A budget is either absolute (bytes bounding the whole step's peak: ``6442450944``,
``"6GiB"``, ``"800MB"``) or relative: a fraction ``f`` in [0, 1] (``0.5``, ``"50%"``,
``"0.5"``) meaning ``P_min + f * (P_none - P_min)``, where ``P_none`` is the peak with
nothing recomputed and ``P_min`` the lowest peak memfit can reach. Python integers are
bytes; floats and percentages are fractions. A string (a command line's ``--budget``)
needs a unit (``"50B"``, ``"6GiB"``), a ``%`` or a decimal point (``"0.5"``): a bare
``"50"`` is refused, since ``"1"`` would be one byte where ``"1.0"`` is 100%.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from memfit.errors import BudgetError
from memfit.units import parse_bytes

__all__ = ["Budget", "parse_budget"]

# A sign is accepted so that "-50%" is refused as out of range, not as an unparsable byte amount.
_FRACTION = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*(%?)\s*$")
# A number with no unit, %, or plain decimal point ("50", "1e9"): bytes or a fraction? Refused
# (a negative one is refused as negative, further on).
_BARE = re.compile(r"^\s*\+?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?\s*$")


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``bytes`` and ``fraction`` is set."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, min_peak: int, none_peak: int) -> int:
        """Bytes this budget allows, given ``P_min`` and ``P_none``."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(min_peak + self.fraction * (none_peak - min_peak))

    def __str__(self) -> str:
        if self.bytes is not None:
            from memfit.units import format_bytes

            return format_bytes(self.bytes)
        return f"{self.fraction:.0%} (P_min + {self.fraction:g} x (P_none - P_min))"


def _fraction(value: float, text: object) -> Budget:
    if not math.isfinite(value) or value < 0 or value > 1:
        raise BudgetError(f"budget fraction must be in [0, 1] (or 0%..100%), got {text!r}")
    return Budget(fraction=float(value))


def parse_budget(value: object) -> Budget:
    """Parse a budget given as bytes, a byte string, a fraction or a percentage."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or value is None:
        raise BudgetError(f"budget must be bytes (int or '6GiB') or a fraction in [0, 1] ('50%'), got {value!r}")
    # numbers.Integral / Real: numpy and torch scalars (np.int64(6 << 30)) mean what ints and floats do
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise BudgetError(f"budget in bytes must be positive, got {value}")
        return Budget(bytes=int(value))
    if isinstance(value, numbers.Real):
        return _fraction(float(value), value)
    if isinstance(value, str):
        m = _FRACTION.match(value)
        if m and m.group(2):
            return _fraction(float(m.group(1)) / 100, value)
        if m and "." in m.group(1):
            return _fraction(float(m.group(1)), value)
        if _BARE.match(value):
            number = value.strip()
            raise BudgetError(
                f"budget {value!r} has no unit: write '{number}%' for a fraction, '{number}B' or '{number}MiB' for bytes, "
                "or a fraction with a decimal point (0.5 = 50%)"
            )
        n = parse_bytes(value)
        if n <= 0:
            raise BudgetError(f"budget in bytes must be positive, got {value!r}")
        return Budget(bytes=n)
    raise BudgetError(f"budget must be bytes (int or '6GiB') or a fraction in [0, 1] ('50%'), got {type(value).__name__}")
