"""Input hardening: every bad option is one stderr line naming it with exit code 2; huge models
are exact; JSON output is byte-for-byte deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    # (arguments, the option the message must name)
    (["params", "-E", "0"], "--n-embd"),
    (["params", "-L", "-3"], "--n-layer"),
    (["params", "-H", "5"], "--n-head"),  # does not divide E=384
    (["params", "-V", "abc"], "--vocab-size"),
    (["params", "-T", "1.5"], "--block-size"),
    (["params", "-F", ""], "--ffn-mult"),
    (["params", "--d-ff", "0"], "--d-ff"),
    (["params", "--head-dim", "-1"], "--head-dim"),
    (["params", "--n-kv-head", "4"], "--n-kv-head"),  # does not divide 6 heads
    (["params", "--dropout", "nan"], "--dropout"),
    (["params", "--dropout", "inf"], "--dropout"),
    (["params", "--dropout", "-0.1"], "--dropout"),
    (["params", "--dropout", "1"], "--dropout"),
    (["params", "--dropout", "x"], "--dropout"),
    (["params", "--preset", "gpt5"], "--preset"),
    (["params", "--arch", "bert"], "--arch"),
    (["params", "--set", "qkv_bias=maybe"], "--set"),
    (["params", "--set", "qkv_bias=2"], "--set"),
    (["params", "--set", "no_such=1"], "--set"),
    (["params", "--set", "novalue"], "--set"),
    (["params", "--set", "=1"], "--set"),
    (["params", "--set", "n_embd=1e3"], "--set"),
    (["params", "--set", "norm=batchnorm"], "--set norm"),
    (["params", "--set", "rotary_pct=nan"], "--set rotary_pct"),
    (["params", "--hf-config", "/no/such/config.json"], "--hf-config"),
    (["params", "--config", "/no/such.toml"], "--config"),
    (["params", "--save-config", "out.yaml"], "--save-config"),
    (["flops", "-B", "0"], "--batch-size"),
    (["flops", "--seq-len", "0"], "--seq-len"),
    (["flops", "--seq-len", "257"], "--seq-len"),  # > T=256
    (["flops", "--prompt-len", "0"], "--prompt-len"),
    (["flops", "--prompt-len", "-1"], "--prompt-len"),
    (["flops", "--context", "100000"], "--context"),
    (["flops", "--recompute", "some"], "--recompute"),
    (["flops", "--bogus"], "--bogus"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_option(args, option):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == ""
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    assert option in r.stderr, r.stderr
    assert "Traceback" not in r.output


def test_bad_input_through_a_real_process():
    r = subprocess.run([sys.executable, "-m", "gptcalc", "flops", "--dropout", "nan"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "Error: --dropout: dropout must be in [0, 1), got nan\n"


# --- huge models compute exactly (Python ints, never floats) ------------------------------------

E, L, V, H, T, S = 65536, 1000, 10**6, 512, 1024, 1024
HUGE = ["--preset", "gpt2", "-E", str(E), "-L", str(L), "-V", str(V), "-H", str(H)]


def test_huge_model_params_exact():
    out = json.loads(CliRunner().invoke(cli, ["params", *HUGE, "--json"]).stdout)
    # GPT-2 block by hand: c_attn 3E^2+3E, c_proj E^2+E, c_fc 4E^2+4E, mlp c_proj 4E^2+E,
    # two LayerNorms 4E -> 12E^2+13E; plus wte V*E, wpe T*E, ln_f 2E; lm_head tied.
    expected = V * E + T * E + L * (12 * E * E + 13 * E) + 2 * E
    assert expected == 51_606_062_759_936  # the hand formula evaluated: 5.2e13
    assert out["total"] == expected


def test_huge_model_flops_exact():
    r = CliRunner().invoke(cli, ["flops", *HUGE, "-B", "3", "--json"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    hd = E // H
    # forward of one sequence by hand, 2 FLOPs per multiply-accumulate: per layer
    # qkv 2*S*E*3E, q@k^T and att@v 2 * 2*H*S*S*hd, out 2*S*E*E, fc and proj 2 * 2*S*E*4E;
    # the lm_head 2*S*E*V. Training = forward + 2 x forward.
    fwd = L * (2 * S * E * 3 * E + 2 * 2 * H * S * S * hd + 2 * S * E * E
               + 2 * 2 * S * E * 4 * E) + 2 * S * E * V
    assert out["forward_per_token"] * S == fwd
    assert out["training_per_step"] == 3 * 3 * fwd
    assert isinstance(out["training_per_step"], int)


def test_astronomical_sizes_do_not_crash():
    # far past a float (1e308): the table still renders, in scientific notation
    r = CliRunner().invoke(cli, ["params", "--preset", "gpt2", "-V", str(10**400)])
    assert r.exit_code == 0, r.output
    assert "7.68e402" in r.stdout  # the total, 768 * 10^400 + ...


# --- deterministic JSON -------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["params", "--preset", "llama3-8b", "--json"],
                                  ["flops", "--preset", "gpt2", "-B", "4", "--causal", "--json"]])
def test_json_output_is_byte_identical_across_processes(args):
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-m", "gptcalc", *args], cwd=ROOT, env=env,
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout)
    assert len(outs) == 1
