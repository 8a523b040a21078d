"""The CLI: JSON keys and numbers equal the library's, tables carry units, errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc import count_params, from_name, inference_flops
from gptcalc.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_params_json_is_the_library_count():
    out = run_json("params", "--preset", "gpt2")
    p = count_params(from_name("gpt2"))
    assert out["total"] == p.total == 124_439_808  # released GPT-2 small, see test_params
    assert out["non_embedding"] == p.non_embedding
    assert out["components"] == p.components


def test_default_model_is_the_seeds_tutorial():
    assert run_json("params")["total"] == 10_788_929  # "10.788929 M parameters" (seed 000)


def test_explicit_options_override_the_preset():
    out = run_json("params", "--preset", "gpt2", "-L", "2", "-V", "100", "--set", "qkv_bias=false")
    assert out["config"]["n_layer"] == 2 and out["config"]["vocab_size"] == 100
    assert out["total"] == count_params(from_name("gpt2", n_layer=2, vocab_size=100,
                                                  qkv_bias=False)).total


def test_arch_swaps_the_family_but_keeps_sizes():
    out = run_json("params", "--preset", "gpt2", "--arch", "llama")
    assert out["config"]["norm"] == "rmsnorm" and out["config"]["n_embd"] == 768


def test_flops_json_keys_and_values():
    out = run_json("flops", "--preset", "gpt2", "-B", "4", "--prompt-len", "100",
                   "--context", "300")
    cfg = from_name("gpt2")
    # nanoGPT transformer_sizing.ipynb, GPT-2 124M, one sequence of 1024 tokens:
    # forward_total 291,648,307,200, backward_total 583,296,614,400, total 874,944,921,600
    assert out["forward_per_token"] * 1024 == 291_648_307_200
    assert out["backward_per_token"] * 1024 == 583_296_614_400
    assert out["training_per_token"] * 1024 == 874_944_921_600
    assert out["training_per_step"] == 4 * 874_944_921_600
    assert set(out["conventions"]) == {"6N", "kaplan", "palm"}
    inf = inference_flops(cfg, 100, 300)
    assert out["inference"] == {"prompt_len": 100, "context": 300, "prefill": inf.prefill,
                                "decode_per_token": inf.decode_per_token,
                                "decode_per_token_no_cache": inf.decode_per_token_no_cache}
    for value in (out["forward_per_token"], out["training_per_step"], *out["conventions"].values()):
        assert isinstance(value, int)


def test_preset_batch_size_is_the_default_workload():
    assert run_json("flops")["workload"] == {"batch_size": 64, "seq_len": 256, "grad_accum": 1}


def test_human_tables_carry_units():
    result = run("params", "--preset", "gpt2")
    assert result.exit_code == 0
    assert "124,439,808" in result.output and "124.44 M" in result.output
    result = run("flops", "--preset", "gpt2")
    assert "palm" in result.output and "KV cache" in result.output and " G" in result.output


def test_presets_lists_every_preset():
    out = run_json("presets")
    assert out["schema"] == "gptcalc/2"
    rows = {r["name"]: r for r in out["presets"]}
    assert set(rows) >= {"shakespeare-char", "gpt2-xl", "gpt3-175b", "llama3-8b"}
    # Brown et al. 2020, Table 2.1: GPT-3 175B has 96 layers of width 12288, 96 heads
    assert rows["gpt3-175b"]["config"]["n_layer"] == rows["gpt3-175b"]["n_layer"] == 96
    assert rows["gpt3-175b"]["n_embd"] == 12288 and rows["gpt3-175b"]["n_head"] == 96


@pytest.mark.parametrize("args,training", [
    (["params", "--preset", "gpt2"], None),
    (["flops", "--preset", "gpt2", "--recompute", "full"], {"recompute": "full"}),
    (["memory", "--preset", "gpt2", "-B", "2"], None),  # memory adds its own training set-up
])
def test_every_json_output_has_the_envelope(args, training):
    out = run_json(*args)
    assert out["schema"] == "gptcalc/2"
    assert out["config"]["n_embd"] == 768 and out["config"]["n_layer"] == 12
    assert set(out["workload"]) == {"batch_size", "seq_len", "grad_accum"}
    if training is not None:
        assert out["training"] == training


@pytest.mark.parametrize("args,option", [
    (["params", "-H", "7"], "--n-head"),
    (["params", "--n-kv-head", "4"], "--n-kv-head"),  # 6 heads, 4 kv heads
    (["params", "-E", "0"], "--n-embd"),
    (["params", "-L", "-2"], "--n-layer"),
    (["flops", "--seq-len", "257"], "--seq-len"),
    (["params", "--preset", "gpt5"], "--preset"),
    (["params", "--arch", "mamba"], "--arch"),
    (["params", "-E", "abc"], "--n-embd"),
    (["params", "--set", "norm=batchnorm"], "norm"),
    (["params", "--set", "colour=blue"], "--set"),
    (["flops", "--context", "1000"], "--context"),
    (["flops", "-B", "0"], "--batch-size"),
])
def test_bad_input_is_one_line_exit_2(args, option):
    r = run(*args)
    assert r.exit_code == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert option in lines[0]


def test_import_gptcalc_loads_no_heavy_library():
    code = ("import sys, gptcalc, gptcalc.cli; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'fvcore', 'matplotlib', 'reports', 'reference_model')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_analytic_commands_load_no_heavy_library():
    code = ("import sys; from gptcalc.cli import cli; "
            "cli.main(['flops', '--json'], standalone_mode=False); "
            "cli.main(['params'], standalone_mode=False); "
            "print('LOADED', ' '.join(m for m in ('torch', 'fvcore', 'matplotlib') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].strip() == "LOADED"
