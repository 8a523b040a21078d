"""Each command-line flag is declared once: in `gptcalc.schema.OPTIONS` or by one click option
in `gptcalc/cli/` (a factory such as `gpu_option`, `context_option` or `detail_option` that
every command taking the flag calls with its own phrase). A flag that means another thing on
a serving or measuring command is declared once per meaning (`OTHER_MEANINGS`)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import click

from gptcalc.cli import cli
from gptcalc.cli.options import OTHER_MEANINGS
from gptcalc.schema import OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def _flags(text: str) -> list[str]:
    return [f for f in text.split("/") if f.startswith("--") and not f.startswith("--no-")]


def declarations(sources: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Flag -> where it is declared: each Option of the schema, and each call in the CLI's
    modules that names a flag in a literal ("--x", or "--x/--no-x")."""
    out: dict[str, list[str]] = defaultdict(list)
    if sources is None:
        for opt in OPTIONS.values():
            out[opt.cli].append(f"gptcalc/schema.py:{opt.name}")
        sources = {p.relative_to(ROOT).as_posix(): p.read_text()
                   for p in sorted((ROOT / "gptcalc" / "cli").glob("*.py"))}
    for rel, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            if not func.endswith("option"):  # click.option and the factories, not append
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    for flag in _flags(arg.value):
                        out[flag].append(f"{rel}:{node.lineno}")
    return dict(out)


def twice(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The flags declared more often than their meanings allow."""
    return {flag: where for flag, where in found.items()
            if len(where) > (2 if flag in OTHER_MEANINGS else 1)}


def test_every_flag_is_declared_once():
    found = declarations()
    assert not twice(found), f"declared in more than one place: {twice(found)}"
    # the shared ones the commands used to declare each on their own
    for flag in ("--tp", "--context", "--detail", "--kv-dtype", "--mfu", "--precision",
                 "--prompt-len", "--gen-len", "--out", "--json", "--gpu", "--gpu-memory",
                 "--recompute", "--tokens", "--tokens-per-step"):
        assert flag in found


def test_other_meanings_are_real():
    found = declarations()
    for flag in OTHER_MEANINGS:
        assert len(found.get(flag, ())) == 2, flag


def test_a_planted_second_declaration_fails():
    planted = {"a.py": '@click.option("--detail", is_flag=True, help="All.")\ndef a(): pass',
               "b.py": '@click.option("--detail", is_flag=True, help="Every.")\ndef b(): pass',
               "c.py": 'x = click.option("--sp/--no-sp", default=False)'}
    found = declarations(planted)
    assert twice(found) == {"--detail": ["a.py:1", "b.py:1"]} and found["--sp"] == ["c.py:1"]


def _params_by_flag() -> dict[str, dict[str, click.Parameter]]:
    out: dict[str, dict[str, click.Parameter]] = defaultdict(dict)
    for name, command in cli.commands.items():
        for param in command.params:
            for flag in getattr(param, "opts", []):
                if flag.startswith("--"):
                    out[flag][name] = param
    return out


def test_a_shared_flag_reads_the_same_on_every_command():
    """Where several commands take a flag, they take the same kind of value under the same
    keyword (the phrase that says what the command reads of it may differ)."""
    for flag, params in _params_by_flag().items():
        if flag in OTHER_MEANINGS or len(params) < 2:
            continue
        kinds = {(p.name, p.type.name, getattr(p, "is_flag", False)) for p in params.values()}
        assert len(kinds) == 1, (flag, kinds)


def test_the_declaration_table(capsys):
    """The table of flags taken by more than one command (printed with -s)."""
    params = _params_by_flag()
    found = declarations()
    shared = {f: sorted(c) for f, c in params.items() if len(c) > 1}
    for flag, commands in sorted(shared.items()):
        assert len(found[flag]) <= (2 if flag in OTHER_MEANINGS else 1)
        print(f"{flag}: {len(found[flag])} declaration(s), {len(commands)} commands")
    assert len(shared) > 20


def test_commands_take_the_shared_options():
    from gptcalc.gpus import DEFAULT_GPU

    for name in ("infer", "serve", "time", "report", "plan"):
        gpu = next(p for p in cli.commands[name].params if p.name == "gpu_name")
        assert gpu.opts == ["--gpu"] and gpu.default == DEFAULT_GPU
    for name in ("flops", "gpus", "infer", "memory", "params", "plan", "presets", "serve",
                 "time", "verify"):
        flag = next(p for p in cli.commands[name].params if p.name == "as_json")
        assert flag.opts == ["--json"] and flag.is_flag
    for name in ("flops", "memory", "serve"):
        context = next(p for p in cli.commands[name].params if p.name == "context")
        assert context.opts == ["--context"] and context.default is None


def test_no_command_reads_the_running_context_implicitly():
    """Commands take their context with click.pass_context and hand it, or the values read
    from it, to the helpers; nothing in gptcalc asks click for the running one."""
    import inspect

    from gptcalc.cli import options

    users = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "gptcalc").rglob("*.py"))
             if "get_current_context" in p.read_text()]
    assert users == []
    for helper in (options.current_recipe, options.current_setup, options.recorded_sections,
                   options.config_section, options.record_section, options.training_setup,
                   options.setup_source):
        ctx = inspect.signature(helper).parameters["ctx"]
        assert ctx.default is inspect.Parameter.empty, helper.__name__
