"""Hostile and malformed recipes: wrong types, lists for scalars, huge numbers, deep nesting,
long paths, NUL bytes and any value a reader's keys may hold: one line naming the file (and the
key where one is at fault), exit 2, never an internal error; deep nesting refused at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.recipes import read_recipes
from gptcalc.recipes import torchtitan as titan_reader

BIG = "9" * 5000  # past the 4,300 digits Python converts
TUNE = "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\n"
TRL = "model_name_or_path: Qwen/Qwen2.5-0.5B\n"
AXO = "base_model: meta-llama/Llama-3.2-1B\n"
LF = "stage: sft\nmodel_name_or_path: Qwen/Qwen2.5-0.5B\n"
ACC = "distributed_type: DEEPSPEED\n"


def fails(*args: str) -> str:
    r = CliRunner().invoke(cli, ["memory", *args])
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stderr.startswith("Error: --recipe: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.mark.parametrize("name, text, needle", [
    ("huge.yaml", AXO + f"micro_batch_size: {BIG}\n", "a number too long to read"),
    ("huge.toml", f"[training]\nlocal_batch_size = {BIG}\n", "a number too long to read"),
    ("huge.json", '{"per_device_train_batch_size": ' + BIG + "}", "a number too long to read"),
    ("huge_acc.yaml", ACC + f"num_processes: {BIG}\n", "a number too long to read"),
    ("list.yaml", AXO + "micro_batch_size: [1, 2]\n", "micro_batch_size must be a whole number"),
    ("dict.yaml", TRL + "per_device_train_batch_size: {a: 1}\n",
     "per_device_train_batch_size must be a whole number"),
    ("bool.yaml", TUNE + "batch_size: true\n", "batch_size must be a whole number"),
    ("type.toml", '[model]\nname = 3\n', "model.name must be a non-empty string"),
    ("auto.toml", '[parallelism]\ndata_parallel_shard_degree = "auto"\n',
     "parallelism.data_parallel_shard_degree must be a whole number"),
    ("nul.yaml", 'model_name_or_path: "Qwen/Qwen2.5-0.5B\\0"\n',
     "model_name_or_path must be a non-empty string"),
    ("long.yaml", TRL + "deepspeed: " + "a/" * 3000 + "x.json\n", "deepspeed: a path of"),
    ("long2.yaml", TRL + "deepspeed: " + "a" * 3000 + ".json\n", "deepspeed: "),
    ("section.yaml", ACC + "deepspeed_config: [1]\n", "deepspeed_config must be a mapping"),
    ("fsdp.yaml", TRL + "fsdp: 3\n", "fsdp must be a string or a list of strings"),
    ("comp.yaml", "model:\n  _component_: [1]\n", "model._component_ must be a non-empty"),
    ("targets.yaml", TRL + "use_peft: true\nlora_dropout: 0\nlora_target_modules: 5\n",
     "lora_target_modules must be a list of module names"),
    ("world.yaml", TUNE + "fsdp_reshard_after_forward: true\n", "give --gpus N"),
    ("lf.yaml", LF + "finetuning_type: freeze\n", "finetuning_type = 'freeze'"),
])
def test_a_hostile_value_is_one_line_naming_the_key_and_the_file(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    err = fails("--recipe", str(path))
    # the file as typed, or, where the line would pass 200 characters, its folders elided
    assert needle in err and len(err) <= 200 and (
        str(path) in err or f"/{path.name}:" in err and "…" in err)


@pytest.mark.parametrize("name, text", [
    ("deep.yaml", "k: " + "[" * 5000 + "]" * 5000 + "\n"),
    ("deep_block.yaml", "".join(f"{' ' * i}k{i}:\n" for i in range(2000)) + " " * 2000 + "x: 1\n"),
    ("deep.json", "[" * 5000 + "]" * 5000),
    ("deep.toml", "k = " + "[" * 5000 + "]" * 5000 + "\n"),
])
def test_deep_nesting_is_refused_at_once(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    start = time.perf_counter()
    err = fails("--recipe", str(path))
    assert time.perf_counter() - start < 5  # PyYAML alone spends minutes on 5,000 levels
    assert str(path) in err


def test_the_depth_scan_reads_the_shipped_recipes():
    from gptcalc.recipes import SCAN_DEPTH, yaml_depth

    shipped = Path(__file__).resolve().parent / "recipes" / "shipped"
    depths = [yaml_depth(p.read_text()) for p in shipped.rglob("*.y*ml")]
    assert depths and max(depths) < SCAN_DEPTH
    assert yaml_depth("a: [[[[1]]]]\n") == 5 and yaml_depth("a: '[[[['\n") == 1
    assert yaml_depth("a:\n  b:\n    c: 1\n") == 3


# a reader's keys with any value: each document is a valid recipe of its kind with one key
# set to a value drawn from every YAML type (and nested), and must answer or be refused
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**30),
                     st.floats(allow_nan=False), st.text(max_size=20),
                     st.sampled_from(["auto", "-1", "bf16", "all", "lora", "FSDP", "full"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_BASES = {
    "tune.yaml": (TUNE, ["batch_size", "dtype", "compile", "loss", "model.lora_rank",
                         "enable_activation_checkpointing", "optimizer", "tokenizer",
                         "fsdp_reshard_after_forward", "model.apply_lora_to_mlp"]),
    "axo.yml": (AXO, ["micro_batch_size", "adapter", "lora_r", "load_in_4bit", "bf16",
                      "optimizer", "fsdp", "fsdp_config", "plugins", "sequence_len", "fp8",
                      "lora_target_modules", "deepspeed"]),
    "trl.yaml": (TRL, ["per_device_train_batch_size", "bf16", "torch_dtype", "use_peft",
                       "load_in_4bit", "optim", "fsdp", "deepspeed", "max_length",
                       "attn_implementation", "gradient_checkpointing"]),
    "lf.yaml": (LF, ["finetuning_type", "lora_rank", "lora_target", "quantization_bit",
                     "cutoff_len", "flash_attn", "pure_bf16", "deepspeed"]),
    "acc.yaml": (ACC, ["num_processes", "mixed_precision", "deepspeed_config",
                       "distributed_type", "fsdp_config"]),
}


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(_BASES)), data=st.data(), value=_values)
def test_any_value_of_a_read_key_is_an_answer_or_one_line(tmp_path, kind, data, value):
    import yaml

    base, keys = _BASES[kind]
    doc = yaml.safe_load(base)
    key = data.draw(st.sampled_from(keys))
    head, _, tail = key.partition(".")
    if tail:
        doc.setdefault(head, {})[tail] = value
    else:
        doc[key] = value
    path = tmp_path / kind
    path.write_text(yaml.safe_dump(doc))
    try:
        read_recipes([str(path)], {"gpus": 8})
    except ConfigError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(path), "--gpus", "8"])
    assert r.exit_code in (0, 2), r.output
    if r.exit_code == 2:
        assert r.stderr.count("\n") == 1, r.stderr


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), value=_values)
def test_any_value_of_a_torchtitan_key_is_an_answer_or_one_line(tmp_path, data, value):
    key = data.draw(st.sampled_from(sorted(k for k, e in titan_reader.KEYS.items()
                                           if not k.endswith("*"))))
    section, name = key.rsplit(".", 1)
    path = tmp_path / "job.json"  # a torchtitan document written as TOML needs a TOML writer
    doc = {section: {name: value}}
    toml = tmp_path / "job.toml"
    toml.write_text(f"[{section}]\n{name} = {_toml(value)}\n" if _toml(value) else "")
    path.write_text(json.dumps(doc))
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(toml), "--gpus", "8"])
    assert r.exit_code in (0, 2), r.output
    if r.exit_code == 2:
        assert r.stderr.count("\n") == 1, r.stderr


def _toml(value) -> str:
    """A TOML literal of a drawn value (None and mixed tables left out: TOML has neither)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        items = [_toml(v) for v in value]
        return "[" + ", ".join(items) + "]" if all(items) else ""
    return ""
