"""The examples in README.md and docs/python-api.md run, and give the numbers they print."""

from __future__ import annotations

import json
import re
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
