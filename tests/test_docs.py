"""The examples in README.md and docs/python-api.md run, and give the numbers they print."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

from .test_hf import LLAMA3_8B

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "python-api.md"]


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A directory holding what the examples name: Meta-Llama-3-8B/config.json, run.toml."""
    (tmp_path / "Meta-Llama-3-8B").mkdir()
    (tmp_path / "Meta-Llama-3-8B" / "config.json").write_text(json.dumps(LLAMA3_8B))
    (toml,) = blocks(ROOT / "docs" / "python-api.md", "toml")
    (tmp_path / "run.toml").write_text(toml)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_toml_example_is_accepted_by_memory(workdir):
    r = CliRunner().invoke(cli, ["memory", "--config", "run.toml", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["n_layer"] == 16  # the file's override of the config.json's 32
    assert out["workload"] == {"batch_size": 4, "seq_len": 4096, "grad_accum": 1}
    assert (out["setup"]["mode"], out["setup"]["zero"], out["setup"]["dp"]) == ("mixed", 1, 2)


# a line `expression   # 123456` states the value of the expression
_STATED = re.compile(r"^(?P<expr>[^#=\n]+?)[ ]+#[ ]+(?P<value>\d{4,})\b", re.M)


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_python_examples_run_and_print_what_they_say(doc, workdir):
    # the model the examples' comments describe (a sketch that builds it may be skipped)
    ns: dict = {}
    exec("import gptcalc\ncfg, wl = gptcalc.load(hf_config='Meta-Llama-3-8B/config.json', "
         "batch_size=4, seq_len=4096)", ns)
    checked = 0
    for code in blocks(doc, "python"):
        if any("..." in line.split("#")[0] for line in code.splitlines()):  # elided arguments
            continue
        exec(compile(code, str(doc), "exec"), ns)  # noqa: S102 - the docs' own examples
        for m in _STATED.finditer(code):
            assert eval(m.group("expr"), ns) == int(m.group("value")), m.group(0)  # noqa: S307
            checked += 1
    assert checked >= 2


# a README paragraph "`gptcalc CMD --json`: an object, `schema` and `KEY`, a list of objects with
# `a`, `b`, ... and `z`." states the JSON's shape
_SHAPE = re.compile(r"`gptcalc (?P<cmd>\w+) --json`: an object, `schema` and `(?P<key>\w+)`, a "
                    r"list of objects with (?P<fields>.*?)\.\n\n", re.S)


def test_the_json_shapes_the_readme_states_are_what_the_commands_print():
    text = (ROOT / "README.md").read_text()
    stated = list(_SHAPE.finditer(text))
    assert {m.group("cmd") for m in stated} >= {"gpus", "presets"}
    for m in stated:
        r = CliRunner().invoke(cli, [m.group("cmd"), "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert isinstance(out, dict) and set(out) == {"schema", m.group("key")}, list(out)
        items = out[m.group("key")]
        assert isinstance(items, list) and items
        fields = re.findall(r"`(\w+)`", m.group("fields"))
        for item in items:
            assert set(item) == set(fields), (m.group("cmd"), set(item) ^ set(fields))


def test_the_memory_fit_keys_docs_json_states_are_printed():
    text = (ROOT / "docs" / "json.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `fit.verdict` |"))
    stated = set(re.findall(r"`(\w+)`", row.split("|")[3]))
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--gpu", "a6000", "--json"])
    verdict = json.loads(r.stdout)["fit"]["verdict"]
    assert set(verdict) <= stated and set(verdict) >= {"fits", "must_hold", "margin",
                                                       "allocated_peak", "reserved"}


def test_the_python_api_lists_every_supported_model_type():
    import gptcalc

    text = (ROOT / "docs" / "python-api.md").read_text()
    para = text[text.index("Supported `model_type`s"):]
    para = para[:para.index("\n\n")]
    assert set(re.findall(r"`(\w+)`", para)) >= set(gptcalc.SUPPORTED_MODEL_TYPES)


# --- docs/json.md: the keys each section states are the keys the command prints ----------------

# one command per section of docs/json.md, with the options that make its optional keys appear
JSON_COMMANDS = {
    "params": "params --preset mixtral-8x7b --lora-rank 8",
    "flops": "flops --preset llama3-8b",
    "time": "time --preset llama3-8b --tokens-per-second 5000",
    "memory": "memory --preset llama3-8b --gpu h100-sxm --pp 2",
    "plan": "plan --preset gpt2 --gpu h100-sxm --max-gpus 8",
    "infer": "infer --preset llama3-8b",
    "serve": "serve --preset llama3-8b",
}
# keys a section states that only some options print: the key and why it is absent above
OPTIONAL = {"memory": {"recipe", "fit"}}  # only with --recipe FILE; with --gpu or --gpu-memory
ENVELOPE = {"schema", "config", "workload", "training"}


def _json_sections() -> dict[str, str]:
    text = (ROOT / "docs" / "json.md").read_text()
    out = {}
    for section in re.split(r"^## ", text, flags=re.M):
        m = re.match(r"`gptcalc (\w+) --json`", section)
        if m:
            out[m.group(1)] = section
    return out


def _table_keys(section: str) -> set[str]:
    """The keys in the first column of the section's first table (a plan's own table after
    it is the objects inside `plans`)."""
    keys: set[str] = set()
    rows = section.split("\n\n| key")[1].split("\n\n")[0] if "\n\n| key" in section else ""
    for line in rows.splitlines():
        if line.startswith("| `"):
            keys |= set(re.findall(r"`(\w+)`", line.split("|")[1]))
    return keys


def test_every_json_section_has_a_command_here():
    assert set(_json_sections()) - {"verify", "presets", "gpus"} == set(JSON_COMMANDS)


def _documented_json_commands() -> list[str]:
    """The README's and docs' own `gptcalc CMD ... --json` examples, CMD a section above."""
    from .test_readme import COMMANDS, DOC_COMMANDS

    sections = _json_sections()
    return [c for c in COMMANDS + [c for _, c in DOC_COMMANDS]
            if c.split()[1] in sections and "--json" in c.split()]


@pytest.mark.parametrize("command", [
    *(f"gptcalc {c} --json" for c in JSON_COMMANDS.values()), *_documented_json_commands()])
def test_the_keys_docs_json_states_are_the_keys_printed(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs name files by their path in the repository
    sections = _json_sections()
    args = shlex.split(command)[1:]
    cmd = args[0]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    printed = set(json.loads(r.stdout))
    section = sections[cmd]
    table = _table_keys(section)
    assert table, cmd
    assert not table - OPTIONAL.get(cmd, set()) - printed, sorted(table - printed)
    stated = table | set(re.findall(r"`(\w+)`", section.split("\n\n| key")[0])) | ENVELOPE
    if cmd == "serve":  # "infer's keys follow"
        stated |= _table_keys(sections["infer"])
    assert not printed - stated, sorted(printed - stated)


def _readme_json_paragraphs() -> dict[str, str]:
    """README's paragraphs naming a command's --json keys: "`gptcalc CMD --json` ..." (both
    of params' are one), and memory's "`--json` (bytes per device ..." under its section."""
    text = (ROOT / "README.md").read_text()
    out: dict[str, str] = {}
    for para in text.split("\n\n"):
        m = re.match(r"`gptcalc (\w+) --json`", para)
        if m:
            out[m.group(1)] = out.get(m.group(1), "") + para
        elif para.startswith("`--json` (bytes per device, exact integers)"):
            out["memory"] = para
    return out


@pytest.mark.parametrize("cmd", ["params", "flops", "time", "infer", "serve", "memory"])
def test_the_readme_names_every_key_a_command_prints(cmd):
    paragraphs = _readme_json_paragraphs()
    r = CliRunner().invoke(cli, JSON_COMMANDS[cmd].split() + ["--json"])
    assert r.exit_code == 0, r.output
    stated = set(re.findall(r"`(\w+)`", paragraphs[cmd])) | ENVELOPE
    if cmd == "serve":  # "plus infer's keys"
        stated |= set(re.findall(r"`(\w+)`", paragraphs["infer"]))
    printed = set(json.loads(r.stdout))
    assert not printed - stated, sorted(printed - stated)
