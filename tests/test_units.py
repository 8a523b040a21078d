"""Units: SI and binary formatting of exact ints (past a float, past 4,300 digits) and the
strict size parser behind --gpu-memory."""

from __future__ import annotations

import pytest

from gptcalc.units import binary_bytes, parse_bytes, si


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("1024B", 1024), ("1.5KiB", 1536),
    (" 2 tib ", 2 * 2**40), ("1.25KB", 1250), (".5KiB", 512), ("3mib", 3 * 2**20),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", [
    "24",          # no unit: bytes or GiB? refused rather than guessed
    "0.5",         # the same, and not a whole number of bytes
    "0.5B",        # half a byte
    "0.3KiB",      # 307.2 bytes
    "0GiB", "0B",  # not positive
    "-1GiB", "inf", "infGiB", "nanGB", "1e999GiB", "1e3GB",
    "", "GiB", "80 GiB GiB", "80PiB", "80gibibytes", "8" * 100 + "B",
])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("value,text", [
    (0, "0"), (999, "999"), (1000, "1.00 k"), (124_439_808, "124.44 M"),
    (10**24, "1.00e24"), (768 * 10**400 + 5, "7.68e402"), (-1_234_567, "-1.23 M"),
])
def test_si(value, text):
    assert si(value) == text


def test_si_and_bytes_of_ints_past_the_printable_limit():
    # Python refuses str() of ints over 4,300 digits; the formatters do not need it
    assert si(3 * 10**5000 + 10**4999) == "3.10e5000"
    assert binary_bytes(10**5000) == "1.00e5000 B"


@pytest.mark.parametrize("value,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * 2**30, "3.00 GiB"),
    (2**1100, "1.35e331 B"),  # past a float (~1.8e308): exact digits, no OverflowError
])
def test_binary_bytes(value, text):
    assert binary_bytes(value) == text
