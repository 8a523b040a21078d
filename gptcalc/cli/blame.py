"""An error names what was typed: the option or the file and key the user gave.

A check deep in gptcalc raises `ConfigError(field, message)` about the value it checks, which
is not always a value the user typed: `--engine fsdp2` alone fails on `zero`, whose 0 is the
default. Here, where the command line is known (click's `ParameterSource`), the error is told
again against what was given:

- the option was typed on the command line: that option;
- its value came from `--recipe` or `--config`: that file and key;
- otherwise it is a default or derived: the typed option the message is about (one of the
  field's own kind, `--offload-param` for `offload_optimizer`; one the message spells; one
  whose value it quotes; the model's source), with "(--zero 0 is the default)".

Then the line is made short: a list of every choice becomes "did you mean", a long value is
elided, and the line is at most `MAX_LINE` characters.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import click
from click.core import ParameterSource

from ..errors import ConfigError
from ..schema import OPTIONS, cli_spelling

# the longest error line printed (characters, "Error: " included)
MAX_LINE = 200
# a word longer than this is elided in its middle (its start and its end kept: a path's file
# name stays): a path or a number pasted whole
MAX_WORD = 100
# the model's sources, the last resort to blame for a value no option of its own gave
_SOURCES = ("preset", "hf_config", "config", "recipe")
# for an unknown name: the command that lists them all
_LISTS = {"preset": "gptcalc presets", "GPU": "gptcalc gpus"}


def typed(ctx: click.Context) -> dict[str, Any]:
    """The command's options typed on the command line (or its environment): keyword -> value."""
    return {p.name: ctx.params.get(p.name) for p in ctx.command.params
            if p.name and ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE,
                                                               ParameterSource.ENVIRONMENT)}


@dataclass(frozen=True)
class _Opt:
    """What an error needs of an option: its name, spelling, keyword, config-file table."""

    name: str
    cli: str
    keyword: str
    table: str | None = None
    source: bool = False


def _option(field: str, ctx: click.Context) -> _Opt | None:
    """The option a field stands for: a declared one (attn_impl -> attn), else one of the
    command's own (`serve --gen-len`); None for neither."""
    from ..schema import _FIELD_OPTIONS

    o = OPTIONS.get(_FIELD_OPTIONS.get(field, field))
    if o is not None:
        return _Opt(o.name, o.cli, o.keyword, o.table, o.source)
    for p in ctx.command.params:
        if p.name == field and isinstance(p, click.Option):
            return _Opt(field, max(p.opts, key=len), field)
    return None


def _spelling(keyword: str, ctx: click.Context) -> str:
    o = next((x for x in OPTIONS.values() if x.keyword == keyword), None)
    if o is not None:
        return o.cli
    p = next((p for p in ctx.command.params if p.name == keyword), None)
    return max(p.opts, key=len) if isinstance(p, click.Option) else "--" + keyword.replace(
        "_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return ""
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return "" if value is None else str(value)


def blame(e: ConfigError, ctx: click.Context) -> str:
    """The error's line (without "Error: "), against what the user gave."""
    field, message = e.field, e.message
    opt = _option(field, ctx)
    spelled = opt.cli if opt else cli_spelling(field)
    given = typed(ctx)
    keyword = opt.keyword if opt else field
    if opt is None or opt.source or keyword in given or opt.name in ("set", "deepspeed_config"):
        return f"{spelled}: {message}"
    typed_set = next((item for item in given.get("sets") or () if isinstance(item, str)
                      and item.split("=", 1)[0].strip().replace("-", "_") == opt.name), None)
    if typed_set is not None:  # a size typed as --set FIELD=VALUE
        return f"--set {typed_set}: {message}"
    from_file = _from_file(ctx, opt)
    if from_file:
        return f"{from_file}: {message}"
    value = _default_of(ctx, opt) if keyword in ctx.params else None
    note = (f"`gptcalc {ctx.command.name}` chose {opt.name} itself; it has no {opt.cli}"
            if keyword not in ctx.params else f"{opt.cli} {value} is the default"
            if value is not None else f"{opt.cli} is not given")
    culprit = _culprit(opt, message, given, ctx)
    if culprit is None and keyword not in ctx.params and "preset" in ctx.params:
        # an option this command does not have, nothing typed: the model it runs on
        from ..presets import DEFAULT_PRESET

        return f"--preset {ctx.params.get('preset') or DEFAULT_PRESET}: {message} ({note})"
    if culprit is None:
        return f"{spelled}: {message} ({note})"
    if culprit in ("config", "recipe"):
        key = _file_key(ctx, message)
        if key:
            return f"{key}: {message} ({note})"
    name = _spelling(culprit, ctx)
    shown = _shown(given[culprit])
    return f"{name}{' ' + shown if shown else ''}: {message} ({note})"


def _culprit(opt, message: str, given: dict[str, Any], ctx: click.Context) -> str | None:
    """The typed option (keyword) an error about the untyped `opt` is about, or None."""
    plain = {k: v for k, v in given.items() if v not in (None, ()) and k not in
             ("as_json", "detail")}
    if not plain:
        return None
    stem = opt.name.split("_")[0]
    words = {w.lower() for w in re.findall(r"[\w.\-/]+", message)}
    for k in plain:  # one of the field's own kind
        if k.split("_")[0] == stem:
            return k
    for k in plain:  # one the message spells
        if re.search(re.escape(_spelling(k, ctx)) + r"(?![\w-])", message):
            return k
    for k, v in plain.items():  # one whose value the message quotes
        if _shown(v) and _shown(v).lower() in words:
            return k
    for k in _SOURCES:
        if k in plain:
            return k
    return next(iter(plain))


def _from_file(ctx: click.Context, opt) -> str | None:
    """"FILE: key (--option value)" where --recipe or --config gave `opt`'s value."""
    from .options import current_recipe, current_setup

    recipe = current_recipe(ctx)
    if recipe is not None:
        for key, setting in recipe[0].read:
            if setting.split(" ", 1)[0] == opt.cli:
                return f"--recipe: {recipe[0].path}: {key} ({setting})"
    path = ctx.params.get("config")
    setup = current_setup(ctx)
    if path and setup is not None and opt.table:
        from ..schema import LEGACY_TRAINING

        for name in (opt.table, LEGACY_TRAINING):  # a set-up key may sit in the flat [training]
            table = dict(setup.sections).get(name, {})
            if opt.name in table:
                return f"--config: {path}: [{name}] {opt.name} = {table[opt.name]!r}"
    return None


def _file_key(ctx: click.Context, message: str) -> str | None:
    """"FILE: key (--option value)" of the --recipe or --config value the message quotes."""
    from .options import current_recipe, current_setup

    words = {w.lower() for w in re.findall(r"[\w.\-/]+", message)}
    recipe = current_recipe(ctx)
    if recipe is not None:
        for key, setting in recipe[0].read:
            if setting.split(" ", 1)[-1].lower() in words:
                return f"--recipe: {recipe[0].path}: {key} ({setting})"
    path, setup = ctx.params.get("config"), current_setup(ctx)
    if path and setup is not None:
        for table, values in dict(setup.sections).items():
            for key, value in dict(values).items():
                if _shown(value) and _shown(value).lower() in words:
                    return f"--config: {path}: [{table}] {key} = {value!r}"
    return None


def _default_of(ctx: click.Context, opt) -> Any:
    """The value `opt` took without being given: what the command recorded, else the defaults
    of its table; None when not known."""
    from ..schema import SETUP_TABLES
    from ..training import PARALLEL_DEFAULTS, training_table_defaults
    from .options import current_setup, recorded_sections

    recorded = recorded_sections(ctx).get(opt.table or "", {})
    if opt.name in recorded and opt.table in SETUP_TABLES:
        return recorded[opt.name]
    if opt.table == "parallel":
        return PARALLEL_DEFAULTS.get(opt.name) if PARALLEL_DEFAULTS.get(opt.name) != "" else None
    if opt.table in SETUP_TABLES:
        setup = current_setup(ctx)
        if setup is not None:
            value = training_table_defaults(setup.config, setup.from_hf).get(opt.name)
            return value if value not in ("", None) else None
    if ctx.params.get(opt.keyword) is not None:
        return ctx.params[opt.keyword]
    for p in ctx.command.params:
        if p.name == opt.keyword and p.default is not None:
            return p.default
    return None


def shorten(message: str) -> str:
    """One line of at most MAX_LINE characters with "Error: ": every choice listed becomes
    "did you mean", a long word is elided."""
    message = " ".join(message.split())
    message = _did_you_mean(message)
    message = " ".join(w if len(w) <= MAX_WORD else
                       f"{w[:MAX_WORD // 2]}…{w[-MAX_WORD // 4:]} ({len(w):,} characters)"
                       for w in message.split(" "))
    room = MAX_LINE - len("Error: ")
    words = message.split(" ")
    for i in sorted(range(len(words)), key=lambda i: -len(words[i])):  # longest paths first
        over = len(" ".join(words)) - room
        if over <= 0:
            break
        words[i] = _elide_path(words[i], over)
    message = " ".join(words)
    return message if len(message) <= room else message[:room - 1] + "…"


def _elide_path(word: str, over: int) -> str:
    """A path shortened by up to `over` characters from its folders, its file name kept
    (".../train_configs/debug_model.toml"); a word that is not a path, unchanged."""
    head, sep, name = word.rpartition("/")
    if not sep or len(head) <= 4:
        return word
    keep = max(len(head) - over - 2, 0)  # "…/" replaces what is dropped
    return "…" + head[len(head) - keep:] + "/" + name if keep else "…/" + name


_LIST = re.compile(r"(?P<head>unknown (?P<noun>[\w ]+?) '(?P<value>[^']*)')(?P<mid>[^;]*);"
                   r" (?:choose from|fields:) (?P<names>.+)$")


def _did_you_mean(message: str) -> str:
    m = _LIST.search(message)
    if not m:
        return message
    names = [n.strip() for n in m.group("names").split(",") if n.strip()]
    close = difflib.get_close_matches(m.group("value").lower(), names, n=3, cutoff=0.5)
    where = _LISTS.get(m.group("noun"))
    tail = f"did you mean {' or '.join(close)}?" if close else f"{len(names)} to choose from"
    if where:
        tail += f" (`{where}` lists them)"
    elif not close:
        tail = f"choose from {', '.join(names)}" if len(", ".join(names)) < 100 else tail
    return message[:m.start()] + f"{m.group('head')}{m.group('mid')}; {tail}"


__all__ = ["MAX_LINE", "blame", "shorten", "typed"]
