"""Options several commands take are declared once (`cli.options`): --gpu (`gpu_option`) and
--json (`json_option`); a command module declaring its own copy fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CLI = Path(__file__).resolve().parent.parent / "gptcalc" / "cli"
SHARED = ("--gpu", "--json")
# plan's module still declares its own (it is edited apart); it may move onto the shared ones
NOT_YET = {"plan.py"}


def declared(source: str) -> set[str]:
    """The SHARED options a module declares with `click.option(...)` itself."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "option" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in SHARED):
            out.add(node.args[0].value)
    return out


def test_shared_options_are_declared_once():
    owners = {path.name: found for path in sorted(CLI.glob("*.py"))
              if (found := declared(path.read_text()))}
    assert set(owners) - NOT_YET == {"options.py"}
    assert owners["options.py"] == set(SHARED)


@pytest.mark.parametrize("source, found", [
    ('@click.option("--gpu", "gpu_name", default="h100-sxm")\ndef f(): pass', {"--gpu"}),
    ('@click.option("--json", "as_json", is_flag=True)\ndef f(): pass', {"--json"}),
    ('@gpu_option()\n@json_option()\ndef f(): pass', set()),
])
def test_the_check_sees_a_declaration(source, found):
    assert declared(source) == found


def test_commands_take_the_shared_options():
    from gptcalc.cli import cli
    from gptcalc.gpus import DEFAULT_GPU

    for name in ("infer", "serve", "time", "report"):
        gpu = next(p for p in cli.commands[name].params if p.name == "gpu_name")
        assert gpu.opts == ["--gpu"] and gpu.default == DEFAULT_GPU
    for name in ("flops", "gpus", "infer", "memory", "params", "presets", "serve", "time",
                 "verify"):
        flag = next(p for p in cli.commands[name].params if p.name == "as_json")
        assert flag.opts == ["--json"] and flag.is_flag
