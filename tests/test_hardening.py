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
    (["flops", "--context", "0"], "--context"),
    (["flops", "--context", "-5"], "--context"),
    (["params", "--preset", ""], "--preset"),
    (["params", "--preset", "  "], "--preset"),
    (["params", "--hf-config", "/dev/zero"], "--hf-config"),
    (["params", "--config", "/dev/null"], "--config"),
    (["params", "-V", "1" + "0" * 301], "--vocab-size"),  # over 10^300
    (["memory", "--gpu-memory", "0.5"], "--gpu-memory"),
    (["memory", "--gpu-memory", "24"], "--gpu-memory"),
    (["memory", "--gpu-memory", "inf"], "--gpu-memory"),
    (["memory", "--gpu-memory", "1e999GiB"], "--gpu-memory"),
    (["memory", "--gpu-memory", "-1GiB"], "--gpu-memory"),
    (["memory", "--gpu-memory", "0GiB"], "--gpu-memory"),
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
    # the largest vocabulary accepted, 10^300: 768 * 10^300 parameters, and bytes past what a
    # float holds (~1.8e308) in the memory table, print exactly
    r = CliRunner().invoke(cli, ["params", "--preset", "gpt2", "-V", str(10**300)])
    assert r.exit_code == 0, r.output
    assert "7.68e302" in r.stdout
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "-B", "1", "-V", str(10**300)])
    assert r.exit_code == 0, r.output
    assert "e30" in r.stdout and " B" in r.stdout
    r = CliRunner().invoke(cli, ["flops", "--preset", "gpt2", "-E", str(10**300), "-H", "100",
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["forward_per_token"] > 10**600  # exact ints of 600+ digits


# --- input files and config sections ------------------------------------------------------------


def _one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.mark.parametrize("text", ['sp = "false"', 'sp = 0', 'dp = "2"', 'dp = true',
                                  'dp = 2.0'])
def test_parallel_values_in_a_file_must_have_their_type(tmp_path, text):
    # `sp = "false"` used to turn sequence parallelism on: a non-empty string is truthy
    f = tmp_path / "run.toml"
    f.write_text(f"[parallel]\n{text}\n")
    err = _one_line_error(["memory", "--config", str(f)])
    assert "--config" in err and "[parallel]" in err and text.split()[0] in err


def test_training_values_in_a_file_must_have_their_type(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"training": {"mode": 32}}))
    err = _one_line_error(["memory", "--config", str(f)])
    assert "[training] mode must be a name" in err and "run.json" in err


def test_a_true_bool_in_the_file_still_works(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[parallel]\nsp = true\ntp = 2\n")
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--config", str(f), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["setup"]["sp"] is True


@pytest.mark.parametrize("option", ["--config", "--hf-config"])
def test_a_fifo_is_refused_before_it_is_opened(tmp_path, option):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # opening it would block until a writer came
    err = _one_line_error(["params", option, str(fifo)])
    assert option in err and "not a regular file" in err


@pytest.mark.parametrize("option", ["--config", "--hf-config"])
def test_a_file_over_16_mib_is_refused(tmp_path, option):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(16 * 2**20 + 1)  # sparse: no 16 MiB written to disk
    assert "16 MiB" in _one_line_error(["params", option, str(big)])


@pytest.mark.parametrize("name,text", [
    ("deep.json", "[" * 100_000),
    ("deep.toml", "a = " + "[" * 100_000),
    ("nested.json", '{"model": {"n_layer": 2}, "training": ' + '{"a": ' * 40 + "1" + "}" * 41),
])
def test_deeply_nested_files_are_refused(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    assert "nests deeper than 16 levels" in _one_line_error(["params", "--config",
                                                             str(tmp_path / name)])


def test_hidden_act_must_be_a_name(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 32,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "intermediate_size": 64, "vocab_size": 100,
                             "hidden_act": ["gelu"]}))
    assert "hidden_act must be a name" in _one_line_error(["params", "--hf-config", str(f)])


def test_an_internal_error_is_one_line_with_a_hint(monkeypatch):
    import gptcalc.cli.params as params_cli

    def broken(cfg):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(params_cli, "count_params", broken)
    r = CliRunner().invoke(cli, ["params"])
    assert r.exit_code == 1
    assert r.stderr.count("\n") == 1 and "GPTCALC_DEBUG=1" in r.stderr
    assert "RuntimeError: boom second line" in r.stderr and "Traceback" not in r.stderr
    monkeypatch.setenv("GPTCALC_DEBUG", "1")
    r = CliRunner().invoke(cli, ["params"])
    assert r.exit_code == 1 and "Traceback" in r.stderr


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    r = CliRunner().invoke(cli, ["verify", "--preset", "debug"])
    assert r.exit_code == 2
    assert r.stderr == ("Error: gptcalc verify needs PyTorch: pip install 'gptcalc[verify]'\n")


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


# --- the Python API checks its arguments' types -------------------------------------------------


@pytest.mark.parametrize("call,field", [
    (lambda g, c, w: g.summarize(c, w, prompt_len=5.5), "prompt_len"),
    (lambda g, c, w: g.summarize(c, w, context="8"), "context"),
    (lambda g, c, w: g.summarize(c, w, causal="no"), "causal"),
    (lambda g, c, w: g.count_flops(c, w, causal=1), "causal"),
    (lambda g, c, w: g.inference_flops(c, 5.5, 8), "prompt_len"),
    (lambda g, c, w: g.inference_flops(c, 4, True), "context"),
    (lambda g, c, w: g.load(preset=""), "preset"),
])
def test_api_arguments_of_the_wrong_type_are_config_errors(call, field):
    import gptcalc

    cfg, wl = gptcalc.load(preset="debug")
    with pytest.raises(gptcalc.ConfigError) as e:
        call(gptcalc, cfg, wl)
    assert e.value.field == field


def test_gpt2_n_ctx_does_not_size_the_position_table():
    # transformers' GPT2Config stores n_ctx but sizes wpe by n_positions (default 1024)
    from transformers import GPT2Config

    from gptcalc import config_from_hf

    raw = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_ctx": 64,
           "vocab_size": 50}
    assert GPT2Config(**raw).n_positions == 1024
    assert config_from_hf(raw).block_size == 1024


# --- bounded work: a count the input sizes costs O(1) ---------------------------------------------

def _chunked_backward_by_walking(cfg, workload, setup):
    """torchtune's chunked loss's backward moments, walked chunk by chunk from the last
    (`losses.chunked_loss_transients`'s docstring), for few chunks."""
    from gptcalc.memory.losses import chunk_rows

    V, a, n = -(-cfg.vocab_size // setup.tp), setup.act_bytes, setup.loss_chunks
    rows = chunk_rows(workload, n)
    N = sum(rows)
    done, largest = 0, 0
    for r in reversed(rows):
        largest = max(largest, done + 2 * r * V * 4)
        done += r * V * (a - 4)
    if n > 1 and not setup.lora_rank:
        largest = max(largest, 3 * V * cfg.embd_dim * a + (N - rows[-1] - rows[-2]) * V * a
                      - N * V * 4)
    return largest + (8 * N if workload.batch_size > 1 and n > 1 else 0)


@pytest.mark.parametrize("mode", ["fp32", "amp", "bf16"])
@pytest.mark.parametrize("b, S, n", [(1, 8, 1), (1, 8, 3), (2, 8, 8), (2, 8, 9), (1, 7, 20),
                                     (3, 4096, 8), (1, 4097, 8), (2, 5, 2), (1, 1, 1)])
def test_the_chunked_loss_closed_form_is_the_walk_over_its_chunks(mode, b, S, n):
    from gptcalc import TrainingSetup, Workload, from_name
    from gptcalc.memory.losses import chunked_loss_transients

    cfg = from_name("llama3-8b", n_layer=1)
    wl = Workload(b, S)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", loss="chunked", loss_chunks=n)
    assert chunked_loss_transients(cfg, wl, setup)["backward"] == \
        _chunked_backward_by_walking(cfg, wl, setup)


def test_a_trillion_loss_chunks_take_no_time():
    import time

    start = time.perf_counter()
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", "--loss", "chunked",
                                 "--loss-chunks", "1000000000000", "--json"])
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - start < 10
    out = json.loads(r.stdout)
    # each chunk's nll_loss saves its fp32 total weight: 4 bytes per chunk
    assert out["breakdown"]["activations"]["cross_entropy/total_weight"] == 4 * 10**12
