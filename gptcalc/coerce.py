"""Typed `GPTConfig` field values from text (--set) and from TOML/JSON scalars."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import GPTConfig
from .errors import ConfigError

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_UNSET = ("none", "null", "auto")  # an optional size left to its rule (n_kv_head = H, ...)


def field_kinds() -> dict[str, str]:
    """Each GPTConfig field's kind: int, optional_int, float, bool or str."""
    kinds = {}
    for f in dataclasses.fields(GPTConfig):
        t = str(f.type).replace(" ", "")
        kinds[f.name] = {"int": "int", "int|None": "optional_int", "float": "float",
                         "bool": "bool", "str": "str"}[t]
    return kinds


def coerce_field(name: str, value: Any) -> Any:
    """`value` (text or a TOML/JSON scalar) as the type of GPTConfig field `name`.

    Raises ConfigError(name) for a value of the wrong kind; ranges are left to validate_config.
    """
    kinds = field_kinds()
    if name not in kinds:
        raise ConfigError(name, f"unknown field {name!r}; fields: {', '.join(kinds)}")
    kind = kinds[name]
    text = value.strip().lower() if isinstance(value, str) else None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(name, f"{name} must be true or false, got {value!r}")
    if kind == "str":
        if isinstance(value, str):
            return value.strip()
        raise ConfigError(name, f"{name} must be a name, got {value!r}")
    if kind == "optional_int" and (value is None or text in _UNSET):
        return None
    if kind in ("int", "optional_int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text is not None:
            try:
                return int(text)
            except ValueError:
                pass
        raise ConfigError(name, f"{name} must be an integer, got {value!r}")
    # float
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if text is not None:
        try:
            return float(text)
        except ValueError:
            pass
    raise ConfigError(name, f"{name} must be a number, got {value!r}")
