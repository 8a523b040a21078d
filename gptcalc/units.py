"""Formatting: SI prefixes (powers of 1000) for counts and FLOPs, binary ones for bytes.

Integers are formatted with integer arithmetic, so a count past what a float holds (~1.8e308)
still prints; past the largest prefix it prints in scientific notation.
"""

from __future__ import annotations

import math
import re

_SI = ("", "k", "M", "G", "T", "P", "E", "Z")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _scientific(n: int) -> str:
    """A positive int as `d.dde<exp>`, digits truncated, without str() on a huge int (Python
    refuses to convert ints over 4,300 digits to text)."""
    if n.bit_length() < 10_000:  # about 3,000 digits: str() is exact and allowed
        digits = str(n)
        return f"{digits[0]}.{digits[1:3].ljust(2, '0')}e{len(digits) - 1}"
    exponent = math.floor(math.log10(n))  # math.log10 takes ints of any size
    mantissa = math.floor(10 ** (math.log10(n) - exponent + 2)) / 100
    return f"{mantissa:.2f}e{exponent}"


def _hundredths(n: int, unit: int) -> int:
    """n / unit in hundredths, rounded half up, in integers (no float overflow)."""
    return (200 * n + unit) // (2 * unit)


def _with_unit(text: str, unit: str) -> str:
    return f"{text} {unit}" if unit else text


def si(value: int | float, unit: str = "") -> str:
    """`si(124439808)` -> '124.44 M'; counts and FLOPs use powers of 1000."""
    if isinstance(value, int):
        sign, n = ("-" if value < 0 else ""), abs(value)
        if n >= 1000 ** len(_SI):
            return _with_unit(sign + _scientific(n), unit)
        magnitude = 0
        while n >= 1000 ** (magnitude + 1):
            magnitude += 1
        if magnitude == 0:
            return f"{sign}{n} {unit}".rstrip()
        hundredths = _hundredths(n, 1000 ** magnitude)
        return f"{sign}{hundredths // 100}.{hundredths % 100:02d} {_SI[magnitude]}{unit}".rstrip()
    v, magnitude = float(value), 0
    if not math.isfinite(v):
        return _with_unit(str(v), unit)
    while abs(v) >= 1000 and magnitude < len(_SI) - 1:
        v /= 1000
        magnitude += 1
    text = f"{v:.0f}" if magnitude == 0 and v.is_integer() else f"{v:.2f}"
    return f"{text} {_SI[magnitude]}{unit}".rstrip()


def binary_bytes(n: int | float) -> str:
    """`binary_bytes(3 * 2**30)` -> '3.00 GiB'; bytes use powers of 1024."""
    if isinstance(n, float):
        if not math.isfinite(n):
            return f"{n} B"
        if n.is_integer():
            n = int(n)
    if isinstance(n, int):
        sign, b = ("-" if n < 0 else ""), abs(n)
        if b >= 1024 ** len(_BINARY):  # over 1024 EiB: scientific bytes, exact digits
            return f"{sign}{_scientific(b)} B"
        magnitude = 0
        while b >= 1024 ** (magnitude + 1):
            magnitude += 1
        if magnitude == 0:
            return f"{sign}{b} B"
        hundredths = _hundredths(b, 1024 ** magnitude)
        return f"{sign}{hundredths // 100}.{hundredths % 100:02d} {_BINARY[magnitude]}"
    magnitude, v = 0, n
    while abs(v) >= 1024 and magnitude < len(_BINARY) - 1:
        v /= 1024
        magnitude += 1
    return f"{int(v)} B" if magnitude == 0 else f"{v:.2f} {_BINARY[magnitude]}"


# a size: a decimal amount and a unit, e.g. 80GiB, 40 GB, 1.5TiB, 512B
# the unit's B may be left out: 24G = 24GB, as `si` prints a count ("24.00 G")
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B?|B)\s*", re.IGNORECASE)
BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, exact: bool = True) -> int:
    """A size with its unit as bytes: '80GiB' -> 85899345920, '40GB' -> 40 * 10**9.

    The unit is required (B; KB, MB, GB, TB = 10^3..; KiB, MiB, GiB, TiB = 2^10..; the B may
    be left out: 24G = 24GB, 24Gi = 24GiB); the amount
    is a positive decimal number that makes a whole number of bytes. Anything else (a bare
    number, 0, a negative or non-finite amount, '1e999GiB', '0.5B') raises ValueError."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) and len(text) <= 64 else None
    if m is None:
        raise ValueError(f"not a size: {text!r} (a positive amount and a unit: B, KB, MB, GB, "
                         "TB (or K, M, G, T), KiB, MiB, GiB, TiB; e.g. 80GiB)")
    amount, unit = m.group(1), m.group(2).upper()
    unit = unit if unit.endswith("B") else unit + "B"
    whole, _, frac = amount.partition(".")
    scale = 10 ** len(frac)
    numerator = int(whole or "0") * scale + int(frac or "0")
    total, remainder = divmod(numerator * BYTE_UNITS[unit], scale)
    if remainder and exact:  # exact=False floors: '23.58GiB' as a tool prints it
        raise ValueError(f"{text.strip()!r} is not a whole number of bytes")
    if total <= 0:
        raise ValueError(f"size must be positive: {text.strip()!r}")
    return total
