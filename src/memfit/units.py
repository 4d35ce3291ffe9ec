"""Byte amounts: parsed once at the edge, integers everywhere inside.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB)
are powers of 1000, as the IEC and SI prefixes say. A bare number is bytes.
"""

from __future__ import annotations

import math
import re

from memfit.errors import BudgetError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMOUNT = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse ``"6GiB"``, ``"800MB"``, ``"1.5 GiB"`` or a non-negative number of bytes.

    >>> parse_bytes("1.5KiB")
    1536
    """
    if isinstance(text, bool):
        raise BudgetError(f"byte amount must be a number or a string like '6GiB', got {text!r}")
    if isinstance(text, (int, float)):
        if isinstance(text, float) and not math.isfinite(text):
            raise BudgetError(f"byte amount must be finite, got {text!r}")
        if text < 0:
            raise BudgetError(f"byte amount must be >= 0, got {text!r}")
        return int(text)
    if not isinstance(text, str):
        raise BudgetError(f"byte amount must be a number or a string like '6GiB', got {type(text).__name__}")
    match = _AMOUNT.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetError(
            f"cannot parse byte amount {text!r}: expected a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '6GiB' or '800MB'"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    # The sign is parsed so that "-1GiB" is refused as negative rather than as unparsable,
    # and "1e400" overflows float: refuse both here, not with an OverflowError from int().
    if value < 0:
        raise BudgetError(f"byte amount must be >= 0, got {text!r}")
    if not math.isfinite(value):
        raise BudgetError(f"byte amount {text!r} is too large to be a number of bytes")
    return int(round(value))


def format_bytes(n: int | float, *, signed: bool = False) -> str:
    """Render bytes with a binary unit, three significant figures: ``1.50 GiB``."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{sign}{value:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"
