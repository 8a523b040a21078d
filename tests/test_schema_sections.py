"""The training set-up in sections: every TrainingSetup field in exactly one section, each
default written once (TrainingSetup declares it; the option tables, the help and the CLI read
it there), config files written and read by section, and the flat [training] table of earlier
releases still read."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc import from_name
from gptcalc.cli import cli
from gptcalc.cli.options import OTHER_MEANINGS
from gptcalc.schema import OPTIONS, SETUP_TABLES, TABLES, table_keys
from gptcalc.training import PARALLEL_DEFAULTS, resolve_training, setup_table_defaults
from gptcalc.training_setup import SECTIONS, TrainingSetup, field_defaults, section_of

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [f.name for f in dataclasses.fields(TrainingSetup)]
# fields no option of their own sets: the ds_config's engine settings (--deepspeed-config,
# --offload-*), and the NF4 constants' double quantisation (--weights-dtype nf4 / nf4-dq)
DERIVED = {"engine_settings", "double_quant"}


def test_every_field_is_in_exactly_one_section():
    placed = [f for fields in SECTIONS.values() for f in fields]
    assert sorted(placed) == sorted(FIELDS), "a field in no section, in two, or not a field"
    assert list(SECTIONS) == ["precision", "optimizer", "parallel", "stack", "finetune"]
    setup = TrainingSetup(dp=2, lora_rank=4, lora_targets=("q",))
    assert setup.section("parallel")["dp"] == 2 and setup.section("finetune")["lora_rank"] == 4
    assert {k for s in SECTIONS for k in setup.section(s)} == set(FIELDS)


def test_every_set_up_option_sits_in_its_field_s_section():
    setup_options = [o for o in OPTIONS.values() if o.field]
    # an option declared in table "training" that sets no field would sit in no table
    assert [o.name for o in OPTIONS.values() if o.table == "training"] == []
    assert {o.field for o in setup_options} | DERIVED == set(FIELDS)
    for opt in setup_options:
        assert opt.table == section_of(opt.field), opt.name
    for table in SETUP_TABLES:
        assert set(table_keys(table)) == {o.name for o in setup_options if o.table == table}
    assert set(SETUP_TABLES) < set(TABLES) and "training" in TABLES  # still read


def test_table_defaults_are_the_declared_defaults():
    """The tables' defaults come from TrainingSetup, but for the family's usual set-up
    (gpt2: amp, sdpa, CUDA) and the options whose value says "not set"."""
    declared = field_defaults()
    tables = setup_table_defaults(from_name("gpt2"))
    assert tables["parallel"] == PARALLEL_DEFAULTS
    family = {"mode": "amp", "attn": "sdpa", "device": "cuda", "keep_logits": False}
    not_set = {"engine", "lora_targets", "weights_dtype"}
    for table, values in tables.items():
        for key, value in values.items():
            want = family.get(key, "" if key in not_set else declared[OPTIONS[key].field])
            assert value == want, (table, key)


# --- each default written once --------------------------------------------------------------

# the modules that build the set-up's options, tables and defaults (the Python API's and the
# count functions' keyword defaults are their own signatures, outside this check)
DECLARING = ["gptcalc/training.py", "gptcalc/schema.py", "gptcalc/configfile.py",
             *sorted(p.relative_to(ROOT).as_posix()
                                       for p in (ROOT / "gptcalc" / "cli").glob("*.py"))]
# the family's usual set-up (`training.training_defaults`) is its own default, per family
FAMILY = {"mode", "attn", "attn_impl", "device", "impl", "keep_logits"}


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def repeated_defaults(source: str, where: str = "<planted>") -> list[str]:
    """Places in `source` that write a set-up option's declared default again: a dict entry or
    a keyword (`default=` of a click option, a function's parameter) holding the default of
    the option it names, and an Option's help saying "default X" for its own default X
    instead of "{default}"."""
    declared = field_defaults()
    by_name = {o.name: o for o in OPTIONS.values() if o.field and o.name not in FAMILY}
    by_name.update({f: None for f in declared if f not in FAMILY})
    # a serving command's --tp is its own option (OTHER_MEANINGS), not the set-up's
    by_flag = {o.cli: o for o in OPTIONS.values()
               if o.field and o.name not in FAMILY and o.cli not in OTHER_MEANINGS}

    def default_of(name: str):
        opt = by_name[name]
        return declared[opt.field if opt is not None else name]

    def same(node, name) -> bool:
        return (isinstance(node, ast.Constant) and name in by_name and node.value is not None
                and type(node.value) is type(default_of(name))
                and node.value == default_of(name))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and same(v, k.value):
                    found.append(f"{where}:{node.lineno}: {k.value!r}: {v.value!r}")
        elif isinstance(node, ast.Call):
            flags = [a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            opt = next((by_flag[f] for f in flags if f in by_flag), None)
            for kw in node.keywords:
                if kw.arg == "default" and opt is not None and same(kw.value, opt.name):
                    found.append(f"{where}:{node.lineno}: {opt.cli} default={kw.value.value!r}")
            name = getattr(node.func, "id", None)
            if name == "Option" and flags and flags[0] in by_name and len(node.args) > 3:
                text = "".join(c.value for c in ast.walk(node.args[3])
                               if isinstance(c, ast.Constant) and isinstance(c.value, str))
                shown = re.escape(_shown(default_of(flags[0])))
                if re.search(rf"\bdefault:? {shown}\b", text):
                    found.append(f"{where}:{node.lineno}: {flags[0]} help says its default")
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            args = node.args.args[len(node.args.args) - len(node.args.defaults):]
            for arg, value in zip(args + node.args.kwonlyargs,
                                  node.args.defaults + node.args.kw_defaults):
                if value is not None and same(value, arg.arg):
                    found.append(f"{where}:{node.lineno}: {arg.arg}={value.value!r}")
    return found


def test_no_default_is_written_twice():
    found = [hit for rel in DECLARING
             for hit in repeated_defaults((ROOT / rel).read_text(), rel)]
    assert not found, "defaults TrainingSetup declares, written again: " + "; ".join(found)


@pytest.mark.parametrize("planted", [
    'PARALLEL_DEFAULTS = {"zero": 0, "dp": 1}',
    'def table(cfg):\n    return {"recompute": "none", "loss_chunks": 8}',
    'Option("dp", "--dp", "int", "Data-parallel replicas (default 1).", "parallel")',
    'Option("sp", "--sp", "flag", "Sequence parallel (default: off).", "parallel")',
    '@click.option("--recompute", default="none")\ndef command(recompute): pass',
    'def resolve(cfg, bnb_version="0.50.0"): pass',
])
def test_a_planted_second_default_is_found(planted):
    assert repeated_defaults(planted)


def test_a_different_value_is_not_a_second_default():
    assert not repeated_defaults('changes = {"dp": 2, "recompute": "full"}\n'
                                 'Option("dp", "--dp", "int", "Replicas (default {default}).")')


def test_help_shows_the_declared_default():
    assert "(default 1)" in OPTIONS["dp"].help and "{default}" not in OPTIONS["dp"].help
    assert f"(default {field_defaults()['bnb_version']})" in OPTIONS["bnb_version"].help
    assert "(default on)" in OPTIONS["distributed_optimizer"].help
    assert not any("{default}" in o.help for o in OPTIONS.values())
    # a choice named as the default in prose ("1f1b (default)") is the declared one
    named = 0
    for opt in OPTIONS.values():
        # weights_dtype's "bf16 (default)" is the mode's dtype when the option is not set
        if opt.field and opt.name not in FAMILY and opt.name != "weights_dtype":
            for m in re.finditer(r"(\S+) \(default[),:]", opt.help):
                assert m.group(1) == _shown(field_defaults()[opt.field]), opt.name
                named += 1
    assert named >= 4  # pp_schedule, compile, float8, loss


# --- config files by section, and the flat [training] of earlier releases ------------------

def _memory(*args: str) -> str:
    r = CliRunner().invoke(cli, ["memory", *args])
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_save_config_writes_one_table_per_section_and_reads_it_back(fmt, tmp_path):
    path = tmp_path / f"run.{fmt}"
    args = ["--preset", "gpt2", "--mode", "bf16", "--optimizer", "sgd-momentum", "--zero", "1",
            "--dp", "4", "--recompute", "full", "--loss", "chunked", "--json"]
    first = _memory(*args, "--save-config", str(path))
    text = path.read_text()
    doc = json.loads(text) if fmt == "json" else tomllib.loads(text)
    assert list(doc) == ["model", "workload", *SECTIONS]
    assert doc["precision"]["mode"] == "bf16" and doc["optimizer"]["optimizer"] == "sgd-momentum"
    assert doc["parallel"]["dp"] == 4 and doc["stack"]["loss"] == "chunked"
    assert doc["finetune"]["lora_rank"] == 0
    assert _memory("--config", str(path), "--json") == first


def test_a_file_with_the_flat_training_table_still_loads(tmp_path):
    """A file as the previous release's --save-config wrote it: [training] and [parallel]."""
    old = tmp_path / "old.toml"
    old.write_text('[model]\npreset = "gpt2"\n[training]\nmode = "bf16"\noptimizer = "adamw"\n'
                   'recompute = "full"\nloss_chunks = 8\nlora_rank = 0\nlora_targets = ""\n'
                   'weights_dtype = ""\n[parallel]\nzero = 1\ndp = 2\n')
    typed = _memory("--preset", "gpt2", "--mode", "bf16", "--recompute", "full", "--zero", "1",
                    "--dp", "2", "--json")
    assert _memory("--config", str(old), "--json") == typed
    again = tmp_path / "again.toml"
    _memory("--config", str(old), "--save-config", str(again))
    doc = tomllib.loads(again.read_text())
    assert "training" not in doc and doc["precision"]["mode"] == "bf16"
    assert _memory("--config", str(again), "--json") == typed


@pytest.mark.parametrize("tables,word", [
    ({"precision": {"recompute": "full"}}, "[precision] has unknown keys recompute"),
    ({"training": {"mode": "bf16"}, "precision": {"mode": "fp32"}},
     "[precision] mode is set in [training] too"),
    ({"stack": {"loss_chunks": "8"}}, "[stack] loss_chunks must be an integer"),
    ({"finetune": {"lora_rank": -1}}, "[finetune] lora_rank must not be negative"),
])
def test_a_bad_section_table_names_it(tables, word):
    from gptcalc.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        resolve_training(from_name("gpt2"), tables, where="run.toml: ")
    assert e.value.field == "config" and word in e.value.message
