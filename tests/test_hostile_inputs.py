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


@pytest.mark.parametrize("args, option", [
    (["verify", "--preset", "debug", "--dp", "0"], "--dp"),
    (["verify", "--preset", "debug", "--tp", "0"], "--tp"),
    (["verify", "--preset", "debug", "--pp", "-1"], "--pp"),
    (["verify", "--preset", "debug", "--dp", "0", "--tp", "0", "--pp", "-1"], "--dp"),
    (["verify", "--preset", "debug", "--zero", "-1"], "--zero"),
])
def test_verify_refuses_a_layout_of_no_ranks(args, option):
    refused(args, option)


@pytest.mark.parametrize("args, option", [
    (["infer", "--preset", "gpt2", "--prompt-len", "2000"], "--prompt-len"),
    (["infer", "--preset", "gpt2", "--gen-len", "2000"], "--gen-len"),
    # a request longer than the model's context T: the request's option, not --block-size
    (["serve", "--preset", "gpt2", "--max-model-len", "2048"], "--max-model-len"),
    (["serve", "--preset", "gpt2", "--max-model-len", "2048", "--allow-long-max-model-len",
      "--context", "4096"], "--context"),
    (["serve", "--preset", "gpt2", "--context", "2048"], "--context"),
    (["memory", "--preset", "gpt2", "--seq-len", "2048"], "--seq-len"),
    (["serve", "--preset", "llama3-8b", "--engine", "sglang", "--gpu-memory", "1GiB"],
     "--gpu-memory"),
    (["memory", "--preset", "gpt2", "--attn", "manual", "--impl", "transformers",
      "--set", "norm=rmsnorm"], "--impl"),
])
def test_an_error_names_an_option_the_user_gave(args, option):
    refused(args, option)


def test_every_error_field_is_an_option_a_command_has():
    """Each ConfigError field spelled in gptcalc/ (and each value check's) maps onto an option
    of some command, or onto --set FIELD."""
    import pathlib
    import re

    from gptcalc.schema import cli_spelling

    options = {o for c in cli.commands.values() for p in c.params
               for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    checks = (r"(?:ConfigError|integer|positive_int|nonneg_int|boolean|number|fraction|"
              r"probability|one_of|byte_size)\(\s*\"([a-z_0-9]+)\"")
    root = pathlib.Path(__file__).resolve().parents[1] / "gptcalc"
    # hf_families reads config.json fields (its reader reports --hf-config); layers' two are
    # arguments of the Python API that no command passes through
    internal = {"activation", "activation_function", "hidden_act", "mla_cache", "window_keeps"}
    fields = {m for f in root.rglob("*.py") for m in re.findall(checks, f.read_text())}
    assert len(fields) > 30
    bad = sorted(f for f in fields - internal
                 if not (cli_spelling(f) in options or cli_spelling(f).startswith("--set ")))
    assert not bad, bad


@pytest.mark.parametrize("name", ["starcoder2-15b", "stablelm-2-1.6b"])
def test_memory_runs_by_default_on_published_configs(tmp_path, name):
    from tests.hf_published import PUBLISHED

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED[name]))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["setup"]["impl"] == "reference"  # no transformers profile


@pytest.mark.parametrize("args, key, value", [
    (["memory", "--preset", "gpt2", "--gpu-memory", "24G"], "budget", 24 * 10**9),
    (["memory", "--preset", "gpt2", "--gpu-memory", "24Gi"], "budget", 24 * 2**30),
    (["memory", "--preset", "gpt2", "--gpu-memory", "1.5T"], "budget", 15 * 10**11),
    (["time", "--preset", "gpt2", "--tokens", "1T"], "tokens", 10**12),
    (["time", "--preset", "gpt2", "--tokens", "1.00 T"], "tokens", 10**12),
    (["time", "--preset", "gpt2", "--tokens", "2.49G"], "tokens", 2_490_000_000),
])
def test_si_suffixes_as_the_output_prints_them(args, key, value):
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["fit"] if key == "budget" else out)[key] == value


@pytest.mark.parametrize("args, option", [
    (["time", "--preset", "gpt2", "--tokens", "1.5"], "--tokens"),
    (["time", "--preset", "gpt2", "--tokens", "T"], "--tokens"),
    (["memory", "--preset", "gpt2", "--gpu-memory", "24"], "--gpu-memory"),
    (["memory", "--preset", "gpt2", "--gpu-memory", "24X"], "--gpu-memory"),
])
def test_si_suffixes_still_need_a_whole_amount(args, option):
    refused(args, option)


def _greedy(sizes, world):  # ZeroRedundancyOptimizer's loop over every rank, as torch writes it
    loads, owned = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        r = loads.index(min(loads))
        owned[r].append(i)
        loads[r] += sizes[i]
    return owned


def test_zero1_partition_is_torch_s_greedy_loop_without_the_loop():
    import random

    from gptcalc.memory.engines.zero_redundancy import zero1_partition

    rng = random.Random(0)
    for _ in range(300):
        sizes = tuple(rng.choice([1, 2, 3, 5, 8, 64]) for _ in range(rng.randint(1, 30)))
        world = rng.randint(1, 40)
        want = _greedy(sizes, world)
        got = zero1_partition(sizes, world)
        assert [list(o) for o in got] == want[:len(got)] and not any(want[len(got):])


@pytest.mark.parametrize("dp", [10**6, 10**19])
def test_zero_redundancy_over_a_huge_world_is_quick_and_exact(dp):
    import time

    start = time.perf_counter()
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--engine", "zero-redundancy",
                                 "--zero", "1", "--dp", str(dp), "--json"])
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - start < 5
    out = json.loads(r.stdout)
    # the most loaded rank holds the largest tensor alone (wte: 50,257 x 768): AdamW's two fp32
    # moments of it
    assert out["breakdown"]["state"]["optimizer/states"] == 8 * 50257 * 768


@pytest.mark.parametrize("engine", [["--zero", "1"],
                                    ["--engine", "zero-redundancy", "--zero", "1"]])
def test_a_partition_of_more_tensors_than_any_model_is_refused(engine):
    refused(["memory", "--preset", "gpt2", "-L", str(10**12), *engine], "--n-layer")


def test_gpu_hours_past_a_float_s_range_are_refused():
    refused(["time", "--preset", "gpt3-175b", "--mfu", "1e-300", "--gpus", "1024"], "--mfu")


# --- an error names what was typed --------------------------------------------------------------

@pytest.mark.parametrize("args, said, note", [
    # the check fails on a value the user did not type: the typed option it concerns is named,
    # and the value's source (its default) is said
    (["serve", "--preset", "debug"], "--preset debug", "(--gen-len 128 is the default)"),
    (["memory", "--engine", "fsdp2"], "--engine fsdp2", "(--zero 0 is the default)"),
    # the typed option itself is at fault: the line names the engine it meets
    (["memory", "--engine", "ddp", "--offload-param", "cpu"], "--offload-param",
     "(give --engine deepspeed)"),
    (["time", "--gpu", "t4"], "--gpu t4", "(--precision bf16 is the default)"),
    (["memory", "--preset", "gpt2", "--impl", "megatron-core"], "--impl megatron-core",
     "(--mode amp is the default)"),
])
def test_an_error_about_a_default_names_the_typed_option_and_the_default(args, said, note):
    line = refused(args, said)
    assert line.endswith(note), line


def test_an_error_about_a_typed_option_names_it_alone():
    line = refused(["memory", "--preset", "gpt2", "--zero", "5"], "--zero")
    assert "default" not in line


def test_a_config_file_value_is_blamed_on_the_file_and_its_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "gpt2"\n[parallel]\nengine = "fsdp2"\n')
    line = refused(["memory", "--config", str(path)], "--config")
    assert str(path) in line and "[parallel]" in line


@pytest.mark.parametrize("args, option, meant", [
    (["params", "--preset", "llama3-8"], "--preset", "llama3-8b"),
    (["memory", "--gpu", "a6000x"], "--gpu", "a6000"),  # ("rtx-a6000" is an alias)
    (["params", "--set", "n_embdd=3"], "--set", "n_embd"),
])
def test_a_misspelt_name_gets_did_you_mean_not_the_whole_list(args, option, meant):
    line = refused(args, option)
    assert "did you mean" in line and meant in line and len(line) <= 200
    assert "choose from" not in line


@pytest.mark.parametrize("args, option", [
    (["params", "--hf-config", "/" + "a" * 10_000], "--hf-config"),
    (["params", "--preset", "x" * 10_000], "--preset"),
    (["params", "-V", "9" * 5_000], "--vocab-size"),
    (["params", "--config", "/tmp/" + "d" * 300 + ".toml"], "--config"),
])
def test_a_long_value_is_elided_and_the_line_is_at_most_200_characters(args, option):
    r = CliRunner().invoke(cli, args)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and r.stdout == "" and len(lines) == 1, r.output
    assert option in lines[0] and len(lines[0]) <= 200, lines[0]


@pytest.mark.parametrize("args, option", [
    (["plan", "--mfu", "5e-324", "--json"], "--mfu 5e-324"),
    (["plan", "--mfu", "5e-324"], "--mfu 5e-324"),
    (["infer", "--flops-efficiency", "5e-324"], "--flops-efficiency 5e-324"),
    (["time", "--tokens-per-second", "1e-300"], "--tokens-per-second 1e-300"),
])
def test_a_result_past_a_float_s_range_is_refused_never_printed_as_inf(args, option):
    refused(args, option)


@pytest.mark.parametrize("command", ["plot", "report"])
@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_output_folder_is_refused(command, out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused([command, "--out", out], "--out")
    assert list(tmp_path.iterdir()) == []


def test_the_reserved_replay_of_a_405b_step_at_65536_sequences():
    # a segment past 2^48 bytes: the simulated allocator's addresses stay apart
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3.1-405b", "-B", "65536",
                                 "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["reserved"] >= out["peak"] > 2**48


def test_an_error_about_an_option_the_command_lacks_names_the_model_and_says_so():
    from gptcalc.cli.blame import blame
    from gptcalc.errors import ConfigError

    ctx = cli.commands["plan"].make_context("plan", ["--preset", "llama3-8b"])
    line = blame(ConfigError("recompute", "recompute op keeps every second matmul"), ctx)
    assert line.startswith("--preset llama3-8b: ")
    assert line.endswith("(`gptcalc plan` chose recompute itself; it has no --recompute)")


def test_a_size_typed_through_set_is_blamed_on_that_set():
    line = refused(["params", "--set", "n_head=5"], "--set n_head=5")
    assert "does not divide" in line


# found by benchmarks/fuzz_cli.py (50,000 calls, seed 38)
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
             "num_experts_per_tok": 8, "decoder_sparse_step": 1, "vocab_size": 151936,
             "max_position_embeddings": 40960, "tie_word_embeddings": False}


@pytest.mark.parametrize("extra", [["--recompute", "full"], ["--gpu-memory", "80GiB"]])
def test_lora_on_moe_experts_under_full_checkpointing(tmp_path, extra):
    # full checkpointing saves no expert hidden state for the adapters to leave out; the fit
    # advice tries full checkpointing too
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(path), "--zero", "3",
                                 "--lora-rank", "64", *extra, "--json"])
    assert r.exit_code == 0, r.output


def test_fit_advice_skips_layouts_the_rules_refuse():
    # muon runs on one device or DDP: the advice's ZeRO-3 layouts are refused, not counted
    r = CliRunner().invoke(cli, ["memory", "--preset", "olmo2-7b", "--gpu", "a100-sxm-80gb",
                                 "--device", "cpu", "--optimizer", "muon", "--json"])
    assert r.exit_code == 0, r.output
    advice = json.loads(r.stdout)["fit"]["advice"]
    assert not any(a["options"].startswith("--zero 3") for a in advice)
