"""What every recipe reader shares: `Recipe` (the options a training recipe stands for, the
keys it read, the keys it knowingly ignored, the values gptcalc does not model) and `Reading`,
the builder a reader fills key by key.

A recipe's value becomes an option's value (`gptcalc.schema.OPTIONS`), as if it had been typed;
an option typed beside `--recipe` wins over it. A value gptcalc does not model is refused with
one line naming the key and the file, at once when no option can stand in for it (compile,
float8), or, when one can, only if that option is not given (`Recipe.refused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MAX_SIZE, ConfigError
from ..schema import OPTIONS

NOT_MODELLED = "not modelled"


@dataclass(frozen=True)
class Recipe:
    """A recipe file read into gptcalc's options.

    `values`: option name -> value, as the option would hold it; `read`: (recipe key, the
    option it set, in command-line words); `ignored`: (recipe key, why it does not change the
    memory of a step); `refused`: option name -> (recipe key, why its value is not modelled),
    settled by giving that option."""

    path: Path
    kind: str
    values: dict[str, Any] = field(default_factory=dict)
    read: tuple[tuple[str, str], ...] = ()
    ignored: tuple[tuple[str, str], ...] = ()
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)


class Reading:
    """The builder a reader fills: `set` an option from a key, `ignore` a key with its reason,
    `refuse` a value; `recipe()` is the result."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self.values: dict[str, Any] = {}
        self.read: list[tuple[str, str]] = []
        self.ignored: list[tuple[str, str]] = []
        self.refused: dict[str, tuple[str, str]] = {}

    def fail(self, message: str) -> ConfigError:
        """The one-line error of a bad recipe, naming the file."""
        return ConfigError("recipe", f"{self.path}: {message}")

    def set(self, key: str, option: str, value: Any) -> None:
        """The option `option` takes `value` from the recipe's `key`."""
        opt = OPTIONS[option]
        if opt.multiple:
            self.values[option] = (*self.values.get(option, ()), value)
        else:
            self.values[option] = value
        shown = ("on" if value else "off") if opt.kind == "flag" else value
        self.read.append((key, f"{opt.cli} {shown}"))

    def ignore(self, key: str, why: str) -> None:
        self.ignored.append((key, why))

    def refuse(self, key: str, value: Any, why: str = NOT_MODELLED,
               option: str | None = None) -> None:
        """The recipe asks for what gptcalc does not model: an error now, or, when `option`
        can stand in for it, an error only if that option is not given."""
        text = f"{key} = {value!r}: {why}"
        if option is None:
            raise self.fail(text)
        self.refused[option] = (key, text + f" (give {OPTIONS[option].cli} to count another)")

    def count(self, key: str, value: Any, low: int = 1) -> int:
        """A whole number of the recipe, at least `low`."""
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE:
            raise self.fail(f"{key} must be a whole number >= {low}, got {value!r}")
        return value

    def flag(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(f"{key} must be true or false, got {value!r}")
        return value

    def text(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{key} must be a non-empty string, got {value!r}")
        return value.strip()

    def unknown(self, key: str, known: Any = None) -> ConfigError:
        hint = f"; {self.kind} keys gptcalc reads or ignores: {', '.join(known)}" if known else ""
        return self.fail(f"unknown key {key!r} of a {self.kind} recipe{hint}")

    def recipe(self) -> Recipe:
        return Recipe(self.path, self.kind, dict(self.values), tuple(self.read),
                      tuple(self.ignored), dict(self.refused))


def flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested document as dotted keys: {"training": {"seq_len": 8}} -> {"training.seq_len":
    8}; a table with no entries stays as itself."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def section_of(key: str, sections: dict[str, str]) -> str | None:
    """The reason a key is ignored when it sits in a section ignored whole ("checkpoint.x" in
    {"checkpoint": why}), else None."""
    for prefix, why in sections.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    return None


__all__ = ["NOT_MODELLED", "Reading", "Recipe", "flatten", "section_of"]
