"""A user's own training recipe read as gptcalc's options (`--recipe FILE`, given once, or
twice for a recipe and its launcher's config): a torchtitan job config (TOML), a torchtune,
axolotl, LLaMA-Factory, TRL or alignment-handbook config (YAML), an accelerate launcher config
(YAML), Hugging Face TrainingArguments (JSON) or a Megatron-LM argument file. One module per
kind; `read_recipe` tells them apart, `read_recipes` reads a recipe with its launcher's config,
`apply_recipe` fills the options a user did not type.

YAML is read with PyYAML (imported when a YAML recipe is read; transformers depends on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..documents import MAX_DEPTH, nesting_depth, parse_document, read_text_file
from ..errors import ConfigError
from ..schema import OPTIONS
# each reader module registers its formats (`base.register_format`) when imported
from . import axolotl, hf_trainer, llamafactory, megatron, torchtitan, torchtune  # noqa: F401
from .accelerate import is_accelerate, read_accelerate, world_of
from .base import FORMATS, Recipe, formats_for
from .models import hub_hint


SCAN_DEPTH = 100  # nesting a YAML text may show before it is parsed (PyYAML is quadratic in it)


def yaml_depth(text: str) -> int:
    """How deeply a YAML text nests, read in one pass without parsing it: flow brackets outside
    quotes and comments, and block indentation levels. An estimate (a block scalar's
    indentation counts too), to refuse a hostile file before PyYAML spends minutes on it."""
    deepest = 0
    indents: list[int] = []
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        while indents and indents[-1] >= indent:
            indents.pop()
        indents.append(indent)
        depth, quote, prev = len(indents), "", " "
        for ch in stripped:
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"" and prev in " [{,:":
                quote = ch
            elif ch == "#" and prev in " \t":
                break
            elif ch in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif ch in "]}":
                depth -= 1
            prev = ch
        deepest = max(deepest, len(indents))
    return deepest


def _yaml(text: str, path: Path) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - transformers installs it
        raise ConfigError("recipe", f"{path}: reading YAML needs PyYAML (pip install pyyaml)") \
            from None
    if yaml_depth(text) > SCAN_DEPTH:
        raise ConfigError("recipe", f"{path} nests deeper than {MAX_DEPTH} levels")
    try:
        # an alias repeats a node by reference: a few lines of them expand to more keys than
        # memory holds ("billion laughs"); no recipe of these projects uses them
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text)):
            raise ConfigError("recipe", f"{path}: YAML aliases (*name) are not read; write "
                                        f"the values out")
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())
        raise ConfigError("recipe", f"{path} is not valid YAML: "
                                    f"{why if len(why) <= 200 else why[:197] + '...'}") from None
    except ConfigError:
        raise
    except ValueError:  # an integer of more digits than Python converts
        raise ConfigError("recipe", f"{path} holds a number too long to read (over 4,300 "
                                    f"digits)") from None
    except RecursionError:
        raise ConfigError("recipe", f"{path} nests deeper than {MAX_DEPTH} levels") from None
    if nesting_depth(doc) > MAX_DEPTH:
        raise ConfigError("recipe", f"{path} nests deeper than {MAX_DEPTH} levels")
    return doc


def _document(p: Path) -> tuple[Any, str]:
    """A recipe file's parsed document and its suffix (a Megatron-LM file stays text)."""
    text = read_text_file(p, "recipe")
    suffix = p.suffix.lower()
    if suffix in (".toml", ".json"):
        doc = parse_document(text, suffix == ".json", "recipe", p)
        if not isinstance(doc, dict):
            raise ConfigError("recipe", f"{p}: must hold a table (object)")
        return doc, suffix
    if suffix in (".yaml", ".yml"):
        doc = _yaml(text, p)
        if not isinstance(doc, dict):
            raise ConfigError("recipe", f"{p}: must hold a mapping")
        return doc, suffix
    return text, suffix


def read_recipe(path: str | Path, given: dict[str, Any] | None = None) -> Recipe:
    """The recipe at `path` as options. The kind follows the file: its suffix (.toml, .json
    and .yaml/.yml are parsed, any other read as text), then the first registered format of
    that suffix that claims the document (`base.FORMATS`: torchtitan TOML; a DeepSpeed config
    or TrainingArguments JSON; a torchtune `model._component_`, an axolotl `base_model`, an
    accelerate `distributed_type`, a LLaMA-Factory `stage`, a TRL `model_name_or_path`; a
    Megatron-LM argument file as text). `given`: the options typed beside the recipe, for what
    the file leaves to the launcher (the world size)."""
    p = Path(path)
    doc, suffix = _document(p)
    return _read(doc, suffix, p, given or {})


def kinds() -> tuple[str, ...]:
    """The recipe kinds gptcalc reads, as registered."""
    return tuple(FORMATS)


def _read(doc: Any, suffix: str, p: Path, given: dict[str, Any]) -> Recipe:
    candidates = formats_for(suffix)
    for fmt in candidates:
        if fmt.claims(doc):
            return fmt.read(doc, p, given)
    raise ConfigError("recipe", f"{p}: not a recipe gptcalc reads (tried "
                                f"{', '.join(f.kind for f in candidates) or 'none'})")


def read_recipes(paths: Any, given: dict[str, Any] | None = None) -> Recipe:
    """One recipe, or a training recipe with its launcher's config (an accelerate config),
    as one Recipe: the launcher's engine, precision and world size win over the recipe's, and
    its world size completes the recipe's placeholders unless --gpus is typed."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    given = dict(given or {})
    if len(paths) == 1:
        return read_recipe(paths[0], given)
    if len(paths) > 2:
        raise ConfigError("recipe", "give --recipe at most twice: a training recipe and its "
                                    "launcher's config")
    docs = [(Path(p), *_document(Path(p))) for p in paths]
    launchers = [d for d in docs if isinstance(d[1], dict) and d[2] in (".yaml", ".yml")
                 and is_accelerate(d[1])]
    if len(launchers) != 1:
        raise ConfigError("recipe", f"two --recipe files are a training recipe and an "
                                    f"accelerate config; {len(launchers)} of "
                                    f"{', '.join(str(d[0]) for d in docs)} are accelerate "
                                    f"configs")
    launcher = launchers[0]
    train = next(d for d in docs if d is not launcher)
    first = read_accelerate(launcher[1], launcher[0], given)
    world = world_of(launcher[1])
    if not given.get("gpus") and not given.get("dp") and world is not None and \
            launcher[1].get("distributed_type", "NO") != "NO":
        given["gpus"] = world
    second = _read(train[1], train[2], train[0], given)
    return combine(second, first)


def combine(recipe: Recipe, launcher: Recipe) -> Recipe:
    """A training recipe and its launcher's config as one Recipe: the launcher's values win."""
    values = dict(recipe.values)
    if "engine" in launcher.values:  # the launcher's engine (or its ds_config) sets precision
        for option in ("mode", "autocast_dtype"):
            values.pop(option, None)
    for option, value in launcher.values.items():
        values[option] = (*values.get(option, ()), *value) if OPTIONS[option].multiple else value
    refused = {**recipe.refused, **launcher.refused}
    return Recipe(Path(f"{recipe.path} + {launcher.path}"), f"{recipe.kind} + {launcher.kind}",
                  values, recipe.read + launcher.read, recipe.ignored + launcher.ignored,
                  refused, recipe.unread + launcher.unread, parts=(recipe, launcher))


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


def recipe_error(recipe: Recipe, given: dict[str, Any], error: ConfigError) -> ConfigError:
    """An option's error about a value the recipe set (not typed), as the recipe's: one line
    naming the file and the key behind that option; any other error as it is."""
    option = OPTIONS.get(error.field) or next(
        (o for o in OPTIONS.values() if error.field in (o.keyword, o.cli)), None)
    if option is None or option.name not in recipe.values or _typed(given, option.name):
        return error
    reads = [(key, setting) for key, setting in recipe.read
             if setting.split(" ", 1)[0] == option.cli]
    key, setting = reads[-1] if reads else ("(the recipe)", "")
    hint = hub_hint(setting.split(" ", 1)[-1]) if option.name == "hf_config" else ""
    # the hint first: a long reason after it may be cut at the line's 200 characters
    head = f"{hint.removeprefix('; ')}; " if hint else ""
    return ConfigError("recipe", f"{recipe.path}: {key} -> {option.cli}: {head}{error.message}")


def recipe_line(recipe: Recipe, given: dict[str, Any]) -> str:
    """One line a file: the file, its kind, each key read with the option it set (or what
    overrides it: a typed option, the launcher's config), and the keys it does not know."""
    if recipe.parts:
        launcher = recipe.parts[-1]
        return "\n".join(_line(part, given, None if part is launcher else launcher)
                         for part in recipe.parts)
    return _line(recipe, given, None)


def _line(recipe: Recipe, given: dict[str, Any], launcher: Recipe | None) -> str:
    parts = []
    for key, setting in recipe.read:
        cli = setting.split(" ", 1)[0]
        option = next(o for o in OPTIONS.values() if o.cli == cli)
        if _typed(given, option.name) and not option.multiple:
            parts.append(f"{key} -> {setting} (overridden by {cli})")
        elif launcher is not None and option.name in launcher.values:
            parts.append(f"{key} -> {setting} (overridden by {launcher.path.name})")
        else:
            parts.append(f"{key} -> {setting}")
    unread = f"; unread: {', '.join(recipe.unread)}" if recipe.unread else ""
    return f"recipe: {recipe.path} ({recipe.kind}): " + "; ".join(parts) + unread


__all__ = ["FORMATS", "Recipe", "apply_recipe", "combine", "kinds", "read_recipe", "read_recipes",
           "recipe_error", "recipe_line"]
