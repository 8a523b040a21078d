"""Reading the small text documents gptcalc takes (its TOML/JSON configuration files and
Hugging Face config.json files): one line naming the option for anything that is not one."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from .errors import ConfigError

MAX_FILE_BYTES = 16 * 2**20  # a configuration is a few kB; anything near this is not one
MAX_DEPTH = 16  # tables within tables; gptcalc's own files use 2


def read_text_file(path: Path, field: str) -> str:
    """The UTF-8 text of a small regular file; ConfigError(field) for anything else.

    A device (/dev/zero), a FIFO or a directory is refused before it is opened (reading one
    would hang or never end), and so is a file over MAX_FILE_BYTES."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(field, f"no such file: {path}") from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(field, f"{path} is not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise ConfigError(field, f"{path} is {st.st_size:,} bytes, more than a configuration "
                                 f"file holds (at most {MAX_FILE_BYTES // 2**20} MiB)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(field, f"{path} grew past {MAX_FILE_BYTES // 2**20} MiB while read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field, f"{path} is not UTF-8 text: {e.reason} at byte {e.start}") \
            from None


def nesting_depth(doc: Any) -> int:
    """How deeply lists and dicts nest in `doc` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else (
            value if isinstance(value, list) else None)
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_DEPTH:
            stack.extend((child, depth + 1) for child in children)
    return deepest


class _NotFinite(ValueError):
    """A number a document spells that no setting can hold: NaN, an infinity, or a float
    literal too large for a float (1e400)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _constant(text: str) -> float:
    raise _NotFinite(text)  # JSON's NaN, Infinity, -Infinity: not JSON at all


def parse_document(text: str, is_json: bool, field: str, path: Path) -> Any:
    """JSON or TOML text as Python values; nesting over MAX_DEPTH is an error (a parser
    recursing through thousands of brackets would otherwise fail with a RecursionError), and
    so is a JSON number that is not finite (NaN, Infinity, 1e400: not JSON) or an integer of
    more digits than Python converts."""
    import tomllib

    try:
        # TOML spells nan and inf as floats, which each setting's own check refuses by name
        doc = (json.loads(text, parse_float=_finite, parse_constant=_constant) if is_json
               else tomllib.loads(text))
    except _NotFinite as e:
        raise ConfigError(field, f"{path}: {e} is not a finite number") from None
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{path} is not valid JSON: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(field, f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(field, f"{path} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # int() of more than sys.get_int_max_str_digits() digits
        raise ConfigError(field, f"{path} holds a number too long to read (over "
                                 "4,300 digits)") from None
    if nesting_depth(doc) > MAX_DEPTH:
        raise ConfigError(field, f"{path} nests deeper than {MAX_DEPTH} levels")
    return doc
