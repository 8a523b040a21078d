"""Every `gptcalc` command and the Python API snippet in README.md run and exit 0."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _commands() -> list[str]:
    """Indented `gptcalc ...` lines (code blocks), without their trailing comments."""
    out = []
    for line in README.splitlines():
        m = re.match(r"^ {4}(?:pip install [^&]*&& )?(gptcalc .*)$", line)
        if m:
            out.append(m.group(1).split("  #")[0].strip())
    return out


COMMANDS = _commands()
SLOW = ("gptcalc report", "gptcalc verify", "gptcalc plot")


def _doc_commands(path: Path) -> list[str]:
    """A doc's `gptcalc ...` command lines in its code blocks (indented or fenced), a line
    ending in a backslash joined with the next, without trailing comments."""
    out, fenced, pending = [], False, None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        code = line[4:] if line.startswith("    ") else (line if fenced else None)
        if pending is not None and code is not None:
            pending += " " + code.strip()
        elif code is not None and code.lstrip("$ ").startswith("gptcalc "):
            pending = code.lstrip("$ ").strip()
        if pending is not None and not pending.endswith("\\"):
            out.append(pending.split("  #")[0].split(" # ")[0].strip())
            pending = None
        elif pending is not None:
            pending = pending[:-1].rstrip()
    return out


DOCS = sorted((ROOT / "docs").glob("*.md"))
# placeholders a reader fills in (a directory of their own), not a command to run as written
PLACEHOLDERS = ("DIR", "FILE", "PATH", "...")
DOC_COMMANDS = [(p.name, c) for p in DOCS for c in _doc_commands(p)
                if not c.startswith(SLOW) and not any(w in PLACEHOLDERS for w in c.split())]


def test_the_docs_have_commands():
    assert len({c for _, c in DOC_COMMANDS}) >= 10 and {n for n, _ in DOC_COMMANDS} >= {
        "serving.md"}, DOC_COMMANDS


@pytest.mark.parametrize("doc, command", DOC_COMMANDS, ids=[f"{n}:{c[8:60]}" for n, c in
                                                             DOC_COMMANDS])
def test_docs_command_runs(doc, command, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs name files by their path in the repository
    # `[--option value]` is optional: the command runs without it and with it
    for variant in {re.sub(r" ?\[[^]]*\]", "", command), re.sub(r"[][]", "", command)}:
        result = CliRunner().invoke(cli, shlex.split(variant)[1:], catch_exceptions=False)
        assert result.exit_code == 0, (doc, variant, result.output)


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 8, COMMANDS


@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.startswith(SLOW)])
def test_readme_command_runs(command, tmp_path):
    args = shlex.split(command)[1:]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, (command, result.output)


# Commands that take minutes as written run here on fewer blocks: the same options, layout and
# engine (the shape-only Llama-3-8B FSDP check over 8 ranks takes about two minutes on 2 cores at
# its 32 blocks, and every rank's check is per block the same).
SHORTENED = {"--preset llama3-8b --device cpu --dp 8": ["--set", "n_layer=4"]}


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith(SLOW)])
def test_readme_slow_command_runs(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --out DIR lands in a temporary directory
    args = shlex.split(command)[1:]
    args += next((extra for key, extra in SHORTENED.items() if key in command), [])
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, (command, result.output)


def test_readme_python_api_snippet_runs():
    code = re.search(r"```python\n(import gptcalc\n.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


# the README's test command, as a user types it
TEST_LINE = "pip install -e '.[all,test]' && python -m pytest -q"


def test_ci_runs_the_readmes_test_line_exactly():
    assert f"\n    {TEST_LINE}\n" in README
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_LINE in ci
    # nothing installed before it that the line itself would not install
    before = ci[:ci.index(TEST_LINE)]
    assert not any("pip install" in line for line in before), before


def test_the_test_extra_pins_the_torch_the_golden_figures_were_measured_on():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    pins = [r for r in extra if r.replace(" ", "").startswith("torch==")]
    assert pins, extra
    version = pins[0].split("==")[1]
    assert f"torch {version}" in README
    marker = (ROOT / "pyproject.toml").read_text()
    assert f"measured on torch {'.'.join(version.split('.')[:2])}" in marker
