"""What every recipe reader shares: `Recipe` (the options a training recipe stands for, the
keys it read, the keys it knowingly ignored, the keys it does not know, the values gptcalc does
not model), `Reading`, the builder a reader fills key by key, and the entries of a reader's one
table of keys: `READ`, `ignored(why)`, `off(value)` (changes nothing at that value, refused at
any other) and `refused(why)`. Only a refused value stops the command; a key missing from the
table is listed as unread.

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
SHOWN = 60  # characters of a value quoted in an error line; a recipe's values can be huge

# the entries of a reader's table of keys; a key "section.*" stands for every key under it
READ = ("read",)


def ignored(why: str) -> tuple[str, str]:
    """A key that changes neither the memory nor the time of a step, and why."""
    return ("ignored", why)


def off(value: Any, why: str = NOT_MODELLED) -> tuple[str, Any, str]:
    """A key that changes nothing at `value` (or when empty), and is refused at any other."""
    return ("off", value, why)


def refused(why: str) -> tuple[str, str]:
    """A key whose every value changes the step in a way gptcalc does not model."""
    return ("refused", why)


def shown(value: Any) -> str:
    """A recipe's value as an error line quotes it: its repr, cut to SHOWN characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit for str()
        text = "<a number of more than 4300 digits>"
    text = " ".join(text.split())
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def entry(table: dict[str, tuple], key: str) -> tuple | None:
    """`key`'s entry in a reader's table: its own, else its nearest section's ("a.*")."""
    if key in table:
        return table[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        section = ".".join(parts[:n]) + ".*"
        if section in table:
            return table[section]
    return None


def empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, dict, str)) and not value)


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
    unread: tuple[str, ...] = ()
    launcher: bool = False  # a launcher's config: its engine and precision win over a recipe's
    parts: tuple[Recipe, ...] = ()  # a recipe with its launcher's config: the two files


class Reading:
    """The builder a reader fills: `set` an option from a key, `ignore` a key with its reason,
    `refuse` a value; `recipe()` is the result."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self.values: dict[str, Any] = {}
        self.read: list[tuple[str, str]] = []
        self.ignored: list[tuple[str, str]] = []
        self.refused: dict[str, tuple[str, str]] = {}
        self.unread: list[str] = []
        self.launcher = False

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
        text = f"{key} = {shown(value)}: {why}"
        if option is None:
            raise self.fail(text)
        self.refused[option] = (key, text + f" (give {OPTIONS[option].cli} to count another)")

    def count(self, key: str, value: Any, low: int = 1) -> int:
        """A whole number of the recipe, at least `low`."""
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE:
            raise self.fail(f"{key} must be a whole number >= {low}, got {shown(value)}")
        return value

    def adapter_options(self, keys: dict[str, Any], dropout_key: str, dora_key: str,
                        dropout_default: float = 0.0, default_source: str = "") -> None:
        """LoRA's dropout (--lora-dropout; `dropout_default`, from `default_source`, where
        the file is silent) and DoRA (--dora) of a recipe's adapters."""
        value = keys.get(dropout_key, dropout_default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 <= value < 1):
            raise self.fail(f"{dropout_key} must be a probability in [0, 1), got "
                            f"{shown(value)}")
        if value:
            label = dropout_key if dropout_key in keys else f"{dropout_key} ({default_source})"
            self.set(label, "lora_dropout", float(value))
        if self.flag(dora_key, keys.get(dora_key, False)):
            self.set(dora_key, "dora", True)

    def flag(self, key: str, value: Any) -> bool:
        """true/false; YAML and argument files also spell them "true"/"false" (any case)."""
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise self.fail(f"{key} must be true or false, got {shown(value)}")
        return value

    def text(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise self.fail(f"{key} must be a non-empty string, got {shown(value)}")
        return value.strip()

    def world(self, key: str, value: Any, given: dict[str, Any], parts: int = 1) -> int:
        """The data-parallel ranks a placeholder (`value`: -1, "auto", a launcher's process
        count) stands for: --gpus over the `parts` ranks each replica spans; asked for when
        --gpus is not given, never taken as 1."""
        gpus = given.get("gpus")
        if gpus is None:
            raise self.fail(f"{key} = {shown(value)} is the world's ranks, which the file does "
                            f"not give: give --gpus N (or --dp)")
        if gpus % parts:
            raise self.fail(f"{key} = {shown(value)}: --gpus {gpus} is not a multiple of the "
                            f"{parts} ranks each data-parallel replica spans")
        return gpus // parts

    def walk(self, keys: dict[str, Any], table: dict[str, tuple]) -> None:
        """Every key by its entry in `table`: ignored ones recorded with their reason, a value
        the table refuses an error, keys not in it listed as unread; READ keys are left to the
        reader."""
        for key, value in keys.items():
            key = str(key)  # YAML allows numbers as keys
            e = entry(table, key)
            if e is None:
                self.unread.append(key)
            elif e[0] == "ignored":
                self.ignore(key, e[1])
            elif e[0] == "off":
                if not (empty(value) or value == e[1] or (value is False and e[1] == 0)):
                    raise self.fail(f"{key} = {shown(value)}: {e[2]}")
                self.ignore(key, "off")
            elif e[0] == "refused":
                raise self.fail(f"{key} = {shown(value)}: {e[1]}")

    def recipe(self) -> Recipe:
        return Recipe(self.path, self.kind, dict(self.values), tuple(self.read),
                      tuple(self.ignored), dict(self.refused), tuple(self.unread),
                      self.launcher)


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


__all__ = ["NOT_MODELLED", "READ", "Reading", "Recipe", "entry", "flatten", "ignored", "off",
           "refused", "section_of", "shown"]


@dataclass(frozen=True)
class RecipeFormat:
    """One kind of recipe file: the suffixes it is written with (`TEXT` for a file read as text,
    not parsed), whether a parsed document is of this kind (`claims`), the reader, and `order`:
    formats sharing a suffix are asked in increasing order, the first that claims it reads it.
    A new format is a module that calls `register_format` and its test."""

    kind: str
    suffixes: tuple[str, ...]
    claims: Any  # Callable[[document], bool]
    read: Any  # Callable[[document, Path, given options], Recipe]
    order: int = 50


TEXT = ("",)  # a recipe read as text: any suffix the parsed formats do not take
FORMATS: dict[str, RecipeFormat] = {}


def register_format(fmt: RecipeFormat) -> RecipeFormat:
    """Add a recipe format to the registry (by kind; a kind registered again is replaced)."""
    FORMATS[fmt.kind] = fmt
    return fmt


def unregister_format(kind: str) -> None:
    FORMATS.pop(kind, None)


def formats_for(suffix: str) -> list[RecipeFormat]:
    """The formats a file with `suffix` may be, in the order they are asked."""
    parsed = {s for f in FORMATS.values() for s in f.suffixes if s}
    key = suffix if suffix in parsed else ""
    return sorted((f for f in FORMATS.values() if key in f.suffixes), key=lambda f: f.order)
