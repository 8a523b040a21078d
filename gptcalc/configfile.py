"""Configuration files: read `--config FILE` (TOML or JSON), write `--save-config FILE`.

A file holds the model, the workload, and sections that later commands read:

    [model]                 # any GPTConfig field, and optionally preset, arch, hf_config
    preset = "llama2-7b"
    n_kv_head = 8           # optional sizes take "auto" (JSON: null) for their rule
    [workload]
    batch_size = 4
    seq_len = 2048
    [precision]             # stored as written; `gptcalc memory` reads it
    mode = "mixed"

Model and workload keys may also sit at the top level. `SECTIONS` lists the tables a command
reads (`gptcalc.schema.TABLES`): the training set-up's, one per section of `TrainingSetup`
([precision], [optimizer], [parallel], [stack], [finetune]), and the flat [training] that
earlier releases wrote. They are kept verbatim here (and written back by --save-config) for
the commands that read them, which check their keys (`gptcalc.training`). Any other table
is an error, as is an unknown key in [model] or [workload] (a typo must not silently leave a
default in place). A relative `hf_config` is taken from the file's directory
(a Hub id, org/name, when nothing there has that name).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .coerce import coerce_field, field_kinds
from .config import GPTConfig
from .errors import ConfigError, positive_int
from .workload import Workload
from .documents import parse_document, read_text_file
from .hf import HUB_ID
from .schema import TABLES, table_keys

SECTIONS = TABLES
MODEL_SOURCES = ("preset", "arch", "hf_config")  # keys of [model] that are not GPTConfig fields
WORKLOAD_KEYS = table_keys("workload")
FORMATS = (".toml", ".json")


@dataclass(frozen=True)
class ConfigFile:
    """A parsed configuration file; values are typed, keys in the file's order."""

    path: Path | None = None
    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig fields + MODEL_SOURCES
    workload: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)  # the set-up's tables


def _fail(path: Path | None, message: str) -> ConfigError:
    return ConfigError("config", f"{path}: {message}" if path else message)


def _load_text(path: Path) -> dict[str, Any]:
    text = read_text_file(path, "config")
    doc = parse_document(text, path.suffix.lower() == ".json", "config", path)
    if not isinstance(doc, dict):
        raise _fail(path, f"must hold a table (object), got {type(doc).__name__}")
    return doc


def parse_config(doc: Mapping[str, Any], path: Path | None = None) -> ConfigFile:
    """Check and type a configuration document (the dict a TOML or JSON file holds)."""
    fields = field_kinds()
    model: dict[str, Any] = {}
    workload: dict[str, Any] = {}
    sections: dict[str, Any] = {}

    def put(target: dict, key: str, value: Any, where: str) -> None:
        if key in target:
            raise _fail(path, f"{key} is set twice ({where} and another place)")
        target[key] = value

    def model_value(key: str, value: Any, where: str) -> None:
        if key in MODEL_SOURCES:
            if not isinstance(value, str) or not value.strip():
                raise _fail(path, f"{where}{key} must be a non-empty string, got {value!r}")
            if key == "hf_config" and path is not None and not Path(value).is_absolute() and (
                    (path.parent / value).exists() or not HUB_ID.match(value)):
                value = str(path.parent / value)  # beside the file; else a Hub id (org/name)
            put(model, key, value, where)
        elif key in fields:
            try:
                put(model, key, coerce_field(key, value), where)
            except ConfigError as e:
                raise _fail(path, f"{where}{e.message}") from None
        else:
            raise _fail(path, f"unknown key {where}{key!r}; model keys: "
                              f"{', '.join((*MODEL_SOURCES, *fields))}")

    def workload_value(key: str, value: Any, where: str) -> None:
        if key not in WORKLOAD_KEYS:
            raise _fail(path, f"unknown key {where}{key!r}; workload keys: "
                              f"{', '.join(WORKLOAD_KEYS)}")
        try:
            positive_int(key, value)
        except ConfigError:  # the file's wording: one rule for the table's three keys
            raise _fail(path, f"{where}{key} must be a positive integer, got {value!r}") from None
        put(workload, key, value, where)

    for key, value in doc.items():
        if isinstance(value, dict):
            if key == "model":
                for k, v in value.items():
                    model_value(k, v, "[model] ")
            elif key == "workload":
                for k, v in value.items():
                    workload_value(k, v, "[workload] ")
            elif key in SECTIONS:
                sections[key] = value
            else:
                raise _fail(path, f"unknown section [{key}]; sections: {', '.join(SECTIONS)}")
        elif key in WORKLOAD_KEYS:
            workload_value(key, value, "")
        elif key in SECTIONS:
            raise _fail(path, f"{key} must be a table ([{key}]), got {value!r}")
        else:
            model_value(key, value, "")
    return ConfigFile(path=path, model=model, workload=workload, sections=sections)


def read_config_file(path: str | Path) -> ConfigFile:
    """Parse a TOML (any extension but .json) or JSON configuration file."""
    p = Path(path)
    return parse_config(_load_text(p), p)


# --- writing -------------------------------------------------------------------------------------


def config_document(cfg: GPTConfig, workload: Workload,
                    sections: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The effective configuration as a document: every GPTConfig field (so the file does not
    depend on a preset or a config.json), the workload, and the stored sections."""
    doc: dict[str, Any] = {"model": dataclasses.asdict(cfg),
                           "workload": dataclasses.asdict(workload)}
    for name, value in (sections or {}).items():
        doc[name] = value
    return doc


def _toml_key(key: str) -> str:
    bare = key and all(c.isalnum() or c in "-_" for c in key) and key.isascii()
    return key if bare else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form, always with '.' or 'e'
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a valid TOML basic string
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} to TOML")


def _toml_table(name: str, table: Mapping[str, Any], out: list[str]) -> None:
    out.append(f"[{name}]")
    subtables = []
    for key, value in table.items():
        if value is None:
            out.append(f'{_toml_key(key)} = "auto"')  # TOML has no null; coerce_field reads it
        elif isinstance(value, dict):
            subtables.append((key, value))
        else:
            out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in subtables:
        out.append("")
        _toml_table(f"{name}.{_toml_key(key)}", value, out)


def dumps_toml(doc: Mapping[str, Any]) -> str:
    out = ["# gptcalc configuration (written by --save-config); read it back with --config FILE"]
    for name, table in doc.items():
        out.append("")
        _toml_table(name, table, out)
    return "\n".join(out) + "\n"


def write_config_file(path: str | Path, cfg: GPTConfig, workload: Workload,
                      sections: Mapping[str, Any] | None = None) -> Path:
    """Write the effective configuration to `path`: TOML for .toml, JSON for .json."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise ConfigError("save_config", f"{p}: the file name must end in .toml or .json")
    doc = config_document(cfg, workload, sections)
    if p.suffix.lower() == ".json":
        text = json.dumps(doc, indent=2, default=str) + "\n"
    else:
        text = dumps_toml(doc)
    try:
        p.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError("save_config", f"cannot write {p}: {e}") from None
    return p


__all__ = ["FORMATS", "SECTIONS", "ConfigFile", "config_document", "dumps_toml", "parse_config",
           "read_config_file", "write_config_file"]
