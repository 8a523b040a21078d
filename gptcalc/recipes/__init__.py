"""A user's own training recipe read as gptcalc's options (`--recipe FILE`): a torchtitan job
config (TOML), a torchtune or axolotl config (YAML), Hugging Face TrainingArguments (JSON) or a
Megatron-LM argument file. One module per kind; `read_recipe` tells them apart, `apply_recipe`
fills the options a user did not type.

YAML is read with PyYAML (imported when a YAML recipe is read; transformers depends on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..documents import MAX_DEPTH, nesting_depth, parse_document, read_text_file
from ..errors import ConfigError
from ..schema import OPTIONS
from .axolotl import read_axolotl
from .base import Recipe
from .hf_trainer import read_hf_trainer
from .megatron import read_megatron
from .torchtitan import read_torchtitan
from .torchtune import read_torchtune

KINDS = ("torchtitan", "torchtune", "axolotl", "Hugging Face TrainingArguments", "Megatron-LM")


def _yaml(text: str, path: Path) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - transformers installs it
        raise ConfigError("recipe", f"{path}: reading YAML needs PyYAML (pip install pyyaml)") \
            from None
    try:
        # an alias repeats a node by reference: a few lines of them expand to more keys than
        # memory holds ("billion laughs"); no recipe of these projects uses them
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text)):
            raise ConfigError("recipe", f"{path}: YAML aliases (*name) are not read; write "
                                        f"the values out")
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("recipe", f"{path} is not valid YAML: "
                                    f"{' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError("recipe", f"{path} nests deeper than {MAX_DEPTH} levels") from None
    if nesting_depth(doc) > MAX_DEPTH:
        raise ConfigError("recipe", f"{path} nests deeper than {MAX_DEPTH} levels")
    return doc


def read_recipe(path: str | Path, given: dict[str, Any] | None = None) -> Recipe:
    """The recipe at `path` as options. The kind follows the file: .toml torchtitan; .json
    TrainingArguments; .yaml/.yml torchtune when its model names a `_component_`, axolotl when
    it names a `base_model`; anything else a Megatron-LM argument file. `given`: the options
    typed beside the recipe, for what the file leaves to the launcher (the data-parallel size)."""
    p = Path(path)
    given = given or {}
    text = read_text_file(p, "recipe")
    suffix = p.suffix.lower()
    if suffix in (".toml", ".json"):
        doc = parse_document(text, suffix == ".json", "recipe", p)
        if not isinstance(doc, dict):
            raise ConfigError("recipe", f"{p}: must hold a table (object)")
        reader = read_torchtitan if suffix == ".toml" else read_hf_trainer
        return reader(doc, p, given)
    if suffix in (".yaml", ".yml"):
        doc = _yaml(text, p)
        if not isinstance(doc, dict):
            raise ConfigError("recipe", f"{p}: must hold a mapping")
        if isinstance(doc.get("model"), dict) and "_component_" in doc["model"]:
            return read_torchtune(doc, p, given)
        if "base_model" in doc:
            return read_axolotl(doc, p, given)
        raise ConfigError("recipe", f"{p}: neither a torchtune config (model._component_) nor "
                                    f"an axolotl config (base_model)")
    return read_megatron(text, p, given)


def _typed(given: dict[str, Any], option: str) -> bool:
    return given.get(OPTIONS[option].keyword) not in (None, ())


def apply_recipe(recipe: Recipe, given: dict[str, Any]) -> dict[str, Any]:
    """The recipe's values by keyword (`Option.keyword`) for the options not typed (`given`,
    by keyword: typed options win); --set takes the recipe's switches before the typed ones. A
    value the recipe asks for that gptcalc does not model is an error unless its option is
    typed."""
    for option, (_key, why) in recipe.refused.items():
        if not _typed(given, option):
            raise ConfigError("recipe", f"{recipe.path}: {why}")
    out = {}
    for option, value in recipe.values.items():
        keyword = OPTIONS[option].keyword
        if OPTIONS[option].multiple:
            out[keyword] = (*value, *(given.get(keyword) or ()))
        elif not _typed(given, option):
            out[keyword] = value
    return out


def recipe_line(recipe: Recipe, given: dict[str, Any]) -> str:
    """One line: the file, its kind, and each key read with the option it set (or the typed
    option that overrides it)."""
    parts = []
    for key, setting in recipe.read:
        cli = setting.split(" ", 1)[0]
        option = next(o for o in OPTIONS.values() if o.cli == cli)
        typed = _typed(given, option.name) and not option.multiple
        parts.append(f"{key} -> {setting}" + (f" (overridden by {cli})" if typed else ""))
    return f"recipe: {recipe.path} ({recipe.kind}): " + "; ".join(parts)


__all__ = ["KINDS", "Recipe", "apply_recipe", "read_recipe", "recipe_line"]
