"""`ConfigError`, and the checks of one value that raise it.

The lowest floor of gptcalc: every module that checks an input imports it, and it imports no
other gptcalc module.
"""

from __future__ import annotations

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


def positive_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"{field} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(field, f"{field} must be positive, got {value}")
    if value > MAX_SIZE:
        raise ConfigError(field, f"{field} must be at most 10^300, got a {value.bit_length()}-bit "
                                 "integer")


def one_of(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, f"{field} must be one of {', '.join(choices)}; got {value!r}")


def nonneg_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"{field} must be an integer, got {value!r}")
    if value < 0:
        raise ConfigError(field, f"{field} must not be negative, got {value}")

