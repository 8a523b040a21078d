"""Formatting: SI prefixes (powers of 1000) for counts and FLOPs, binary ones for bytes."""

from __future__ import annotations

_SI = ("", "k", "M", "G", "T", "P", "E", "Z")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def si(value: float, unit: str = "") -> str:
    """`si(124439808)` -> '124.44 M'; counts and FLOPs use powers of 1000."""
    if isinstance(value, int) and abs(value) >= 1000 ** len(_SI):
        # beyond zetta (and past what a float holds, ~1.8e308): scientific notation, exact digits
        digits = str(abs(value))
        sign = "-" if value < 0 else ""
        return f"{sign}{digits[0]}.{digits[1:3]}e{len(digits) - 1}{' ' + unit if unit else ''}"
    magnitude, v = 0, float(value)
    while abs(v) >= 1000 and magnitude < len(_SI) - 1:
        v /= 1000
        magnitude += 1
    text = f"{v:.0f}" if magnitude == 0 and float(value).is_integer() else f"{v:.2f}"
    return f"{text} {_SI[magnitude]}{unit}".rstrip()


def binary_bytes(n: float) -> str:
    """`binary_bytes(3 * 2**30)` -> '3.00 GiB'; bytes use powers of 1024."""
    magnitude, v = 0, float(n)
    while abs(v) >= 1024 and magnitude < len(_BINARY) - 1:
        v /= 1024
        magnitude += 1
    return f"{int(v)} B" if magnitude == 0 else f"{v:.2f} {_BINARY[magnitude]}"


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920; '80GB' -> 80e9; a bare number is bytes."""
    units = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    suffix = s[len(number):]
    if suffix not in units or not number:
        raise ValueError(f"not a size: {text!r} (use e.g. 80GiB, 40GB, 1024)")
    value = float(number) * units[suffix]
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)
