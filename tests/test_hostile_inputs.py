"""Inputs at the edges of what a file format or a float holds: each is one line on stderr naming
the option, exit code 2, nothing on stdout; never an internal error, never a figure."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

BIG = 10**150


def refused(args, option):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "", r.stdout  # no results above the error
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {option}:"), lines
    return lines[0]


@pytest.mark.parametrize("text", [
    '{"zero_optimization": {"stage": NaN}}',
    '{"train_micro_batch_size_per_gpu": Infinity}',
    '{"train_micro_batch_size_per_gpu": -Infinity}',
    '{"train_micro_batch_size_per_gpu": 1e400}',
    '{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}",
    '{"train_micro_batch_size_per_gpu": ' + "9" * 400 + "}",
    '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e400}}',
    '{"bf16": {"enabled": 1}}',  # not true: it ran as fp16
    '{"fp16": {"enabled": 0}}',
    '{"zero_optimization": {"stage": 1.0}}',
])
def test_a_ds_config_holding_what_no_setting_can_is_refused(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text)
    refused(["memory", "--preset", "gpt2", "--deepspeed-config", str(path)],
            "--deepspeed-config")


@pytest.mark.parametrize("name, text", [
    ("c.toml", '[model]\npreset = "gpt2"\nn_layer = nan\n'),
    ("c.toml", '[model]\npreset = "gpt2"\nn_layer = inf\n'),
    ("c.toml", '[model]\npreset = "gpt2"\nn_layer = ' + "9" * 5000 + "\n"),
    ("c.toml", '[training]\noverhead = 1e400\n'),
    ("c.json", '{"model": {"preset": "gpt2", "n_layer": NaN}}'),
    ("c.json", '{"model": {"preset": "gpt2", "dropout": Infinity}}'),
    ("c.json", '{"model": {"preset": "gpt2", "n_layer": 1e400}}'),
    ("c.json", '{"model": {"preset": "gpt2", "n_layer": ' + "9" * 5000 + "}}"),
])
def test_a_config_file_holding_what_no_setting_can_is_refused(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    refused(["memory", "--config", str(path)], "--config")


def test_the_ds_config_s_bf16_true_still_runs_bf16(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 1}}')
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--deepspeed-config", str(path),
                                 "--json"])
    assert r.exit_code == 0
    out = json.loads(r.stdout)
    assert out["setup"]["autocast_dtype"] == "bf16" and out["setup"]["zero"] == 1
    assert type(out["setup"]["zero"]) is int


@pytest.mark.parametrize("ref", ["a/b..c", "org/-name", "org/name-", "a--b/c",
                                 "org/" + "x" * 300, "x" * 300 + "/config.json",
                                 "dir/" + "y" * 300])
def test_hub_ids_huggingface_hub_refuses_and_overlong_names(ref, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    refused(["params", "--hf-config", ref], "--hf-config")


@pytest.mark.parametrize("args", [
    ["--preset", "llama3-8b", "--set", "qkv_layout=fused", "--lora-rank", "8"],
    ["--preset", "llama3-8b", "--set", "qkv_layout=fused", "--lora-rank", "8",
     "--lora-targets", "all"],
    ["--preset", "gpt2", "--set", "mlp=swiglu", "--lora-rank", "8"],
    ["--preset", "gpt2", "--set", "mlp=swiglu", "--lora-rank", "8", "--lora-targets", "all"],
])
def test_lora_on_a_layout_set_over_the_family_s(args):
    r = CliRunner().invoke(cli, ["memory", *args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["setup"]["lora_targets"] and out["peak"] > 0
    if "qkv_layout=fused" in args and "all" not in args:
        assert out["setup"]["lora_targets"] == ["qkv"]  # the fused module, as PEFT would
    if "all" in args and "mlp=swiglu" in args:
        assert "gate" in out["setup"]["lora_targets"]


@pytest.mark.parametrize("args, option", [
    (["time", "--preset", "gpt2", "-L", str(BIG)], "--n-layer"),
    (["time", "--preset", "gpt2", "-L", str(BIG), "--json"], "--n-layer"),
    (["time", "--preset", "gpt2", "--mfu", "5e-324", "--json"], "--mfu"),
    (["infer", "--preset", "gpt2", "-L", str(BIG), "-E", str(10**100), "--head-dim", "64",
      "-H", str(10**98)], "--n-layer"),
    (["infer", "--preset", "gpt2", "-L", str(BIG), "-B", str(BIG)], "--n-layer"),
])
def test_sizes_past_a_float_s_range_are_refused(args, option):
    refused(args, option)


def test_results_are_not_printed_above_an_error(tmp_path):
    refused(["memory", "--preset", "gpt2", "--save-config", str(tmp_path / "no" / "x.json")],
            "--save-config")
