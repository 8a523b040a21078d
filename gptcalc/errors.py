"""`ConfigError`, and the checks of one value that raise it.

The lowest floor of gptcalc: every module that checks an input imports it, and it imports no
other gptcalc module. Each check takes the field (or option) it checks first and raises
ConfigError(field, one line) for a bad value; the command line prints that line naming the
option. A bool is never an integer or a number here (`True == 1` in Python).
"""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; `field` names the offending field (or option)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


# The largest size accepted. Products of a handful of sizes (FLOPs of a step, bytes of a
# tensor) then stay far below the 4,300 digits Python will print, and exact.
MAX_SIZE = 10**300


def integer(field: str, value: Any, min: int = 1, max: int = MAX_SIZE) -> int:
    """`value` if it is an int (not a bool) in [min, max]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"{field} must be an integer, got {value!r}")
    if value < min:
        rule = {1: "must be positive", 0: "must not be negative"}.get(min, f"must be >= {min}")
        raise ConfigError(field, f"{field} {rule}, got {value}")
    if value > max:
        limit = "10^300" if max == MAX_SIZE else f"{max:,}"
        shown = f"a {value.bit_length()}-bit integer" if value > MAX_SIZE else f"{value:,}"
        raise ConfigError(field, f"{field} must be at most {limit}, got {shown}")
    return value


def positive_int(field: str, value: Any) -> int:
    """An integer >= 1 (a size, a count of devices)."""
    return integer(field, value, min=1)


def nonneg_int(field: str, value: Any) -> int:
    """An integer >= 0 (a rank, a count that may be none)."""
    return integer(field, value, min=0)


def boolean(field: str, value: Any) -> bool:
    """`value` if it is True or False (not 1, not "true")."""
    if not isinstance(value, bool):
        raise ConfigError(field, f"{field} must be true or false, got {value!r}")
    return value


def number(field: str, value: Any, low: float = 0.0, high: float | None = 1.0,
           low_open: bool = True, high_open: bool = False) -> float:
    """A finite int or float in the interval low..high (`high` None: no upper end); `*_open`
    leaves that end out. The defaults, (0, 1], are a fraction."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (value <= low if low_open else value < low)
            or (high is not None and (value >= high if high_open else value > high))):
        if high is None:
            rule = f"must be a number {'>' if low_open else '>='} {low:g}"
        else:
            rule = f"must be in {'(' if low_open else '['}{low:g}, {high:g}" \
                   f"{')' if high_open else ']'}"
        raise ConfigError(field, f"{field} {rule}, got {value!r}")
    return value


def fraction(field: str, value: Any) -> float:
    """A share in (0, 1]: a utilisation, an efficiency, an MFU."""
    return float(number(field, value))


def probability(field: str, value: Any) -> float:
    """A probability in [0, 1) (dropout: 1 would drop everything)."""
    return number(field, value, low_open=False, high_open=True)


def one_of(field: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """`value` if it is one of `choices`."""
    if isinstance(value, bool) or value not in choices:
        shown = ", ".join(map(str, choices))
        raise ConfigError(field, f"{field} must be one of {shown}; got {value!r}")
    return value


choice = one_of
