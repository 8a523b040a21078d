"""Reading the small text documents gptcalc takes (its TOML/JSON configuration files and
Hugging Face config.json files): one line naming the option for anything that is not one."""

from __future__ import annotations

import json
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


def parse_document(text: str, is_json: bool, field: str, path: Path) -> Any:
    """JSON or TOML text as Python values; nesting over MAX_DEPTH is an error (a parser
    recursing through thousands of brackets would otherwise fail with a RecursionError)."""
    import tomllib

    try:
        doc = json.loads(text) if is_json else tomllib.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{path} is not valid JSON: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(field, f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(field, f"{path} nests deeper than {MAX_DEPTH} levels") from None
    if nesting_depth(doc) > MAX_DEPTH:
        raise ConfigError(field, f"{path} nests deeper than {MAX_DEPTH} levels")
    return doc
