import math

import pytest

from memfit import BudgetError, format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", 6 * 2**30),
        ("800MB", 800 * 10**6),
        ("1.5 KiB", 1536),
        ("  12 ", 12),
        ("2tib", 2 * 2**40),
        ("1e3", 1000),
        (4096, 4096),
        (10.0, 10),
    ],
)
def test_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "6 GiBs", "-5MB", "abc", "1.2.3GB", -1, math.nan, math.inf, True, None, [1]])
def test_parse_rejects(bad):
    with pytest.raises(BudgetError):
        parse_bytes(bad)


def test_format():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(6 * 2**30) == "6.00 GiB"
    assert format_bytes(123 * 2**20) == "123 MiB"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_bytes(2048, signed=True) == "+2.00 KiB"
