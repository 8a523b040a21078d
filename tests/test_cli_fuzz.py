"""Hypothesis fuzz of the command line: valid and invalid option names and values for `params`
and `flops`, through `GptcalcGroup.main` (CliRunner). Every run ends in exit code 0 or 2, never a
traceback; exit 2 is exactly one line on stderr.

Run with `--hypothesis-show-statistics` to see how many examples ran."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gptcalc.cli import cli
from gptcalc.coerce import field_kinds
from gptcalc.presets import PRESETS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Config files the fuzzer may point at: good, malformed, unsupported, missing."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "llama.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "vocab_size": 100, "max_position_embeddings": 16}))
    (d / "gpt2.json").write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 8,
        "vocab_size": 50}))
    (d / "t5.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    (d / "broken.json").write_text("{\"model_type\": ")
    (d / "good.toml").write_text("[model]\npreset = \"debug\"\nn_layer = 1\n"
                                 "[workload]\nbatch_size = 2\n[training]\ndtype = \"bf16\"\n")
    (d / "bad.toml").write_text("[model]\nn_layer = 'two'\n")
    (d / "broken.toml").write_text("[model\n")
    (d / "empty.toml").write_text("")
    return [str(d / n) for n in ("llama.json", "gpt2.json", "t5.json", "broken.json",
                                 "good.toml", "bad.toml", "broken.toml", "empty.toml",
                                 "missing.toml")] + [str(d)]


SIZE_OPTIONS = ["-B", "--batch-size", "-T", "--block-size", "--seq-len", "-E", "--n-embd", "-L",
                "--n-layer", "-H", "--n-head", "-F", "--ffn-mult", "--d-ff", "--n-kv-head",
                "--head-dim", "-V", "--vocab-size"]
FIELDS = list(field_kinds())

# integers mostly small (models stay tiny), sometimes zero, negative or astronomically large
ints = st.one_of(st.integers(1, 64), st.integers(-3, 0), st.just(10**30),
                 st.sampled_from(["1.5", "", "abc", "0x10", " 7", "1e3", "--", "nan"]))
text_values = st.one_of(
    ints.map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "yes", "off", "maybe", "none", "auto", "rmsnorm",
                     "swiglu", "fused", "per_head", "rotary", "0.25", "1", "2", "-1", ""]),
    st.text(max_size=6),
)


def option(files):
    return st.one_of(
        st.tuples(st.sampled_from(SIZE_OPTIONS), ints.map(str)),
        st.tuples(st.just("--dropout"), st.one_of(
            st.floats(allow_nan=True, allow_infinity=True).map(repr),
            st.sampled_from(["0", "0.1", "0.99", "1", "x"]))),
        st.tuples(st.just("--preset"), st.sampled_from([*PRESETS, "gpt5", ""])),
        st.tuples(st.just("--arch"), st.sampled_from(["tutorial", "gpt2", "notes", "llama",
                                                      "bert"])),
        st.tuples(st.just("--set"), st.builds(
            lambda k, v, sep: f"{k}{sep}{v}",
            st.sampled_from([*FIELDS, "nope", "n-embd", ""]), text_values,
            st.sampled_from(["=", "=", ":"]))),
        st.tuples(st.sampled_from(["--hf-config", "--config"]), st.sampled_from(files)),
        st.tuples(st.sampled_from(["--bogus", "--n_embd", "-Z"]), ints.map(str)),
    )


FLOPS_ONLY = st.one_of(
    st.just(("--causal",)),
    st.tuples(st.just("--recompute"), st.sampled_from(["none", "selective", "full", "half"])),
    st.tuples(st.sampled_from(["--prompt-len", "--context"]), ints.map(str)),
)


# 200 by default keeps the suite fast; GPTCALC_FUZZ_EXAMPLES=5000 for a longer hunt
@settings(max_examples=int(os.environ.get("GPTCALC_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_fuzz_never_tracebacks(files, data):
    command = data.draw(st.sampled_from(["params", "flops"]), label="command")
    opts = data.draw(st.lists(option(files), max_size=5), label="options")
    if command == "flops":
        opts += data.draw(st.lists(FLOPS_ONLY, max_size=2), label="flops options")
    args = [command] + [a for pair in opts for a in pair]
    if data.draw(st.booleans(), label="json"):
        args.append("--json")
    result = CliRunner().invoke(cli, args)
    event(f"{command} exit {result.exit_code}")
    assert result.exit_code in (0, 2), (args, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output, args
    # the only exception CliRunner may see is the SystemExit of GptcalcGroup.main
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, repr(result.exception))
    if result.exit_code == 2:
        assert result.stdout == "", args
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, (
            args, result.stderr)
    elif "--json" in args:
        json.loads(result.stdout)  # valid JSON whenever it succeeds


def _fuzz_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz_cli.py"
    spec = importlib.util.spec_from_file_location("fuzz_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# benchmarks/fuzz_cli.py's calls (every command, engines, LoRA, Hub ids, mutated config.json of
# every family), a few per run with a fresh seed; the script runs 20,000 and more
@settings(max_examples=int(os.environ.get("GPTCALC_FUZZ_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_every_command_and_mutated_config_is_refused_in_one_line(tmp_path_factory, seed):
    import random

    fz = _fuzz_module()
    rng = random.Random(seed)
    d = tmp_path_factory.mktemp("hf")
    cfg, kind, invalid = fz.mutate(rng, rng.choice(fz.seeds()))
    (d / "config.json").write_text(json.dumps(cfg))
    files = {str(d / "config.json"): (str(d / "config.json"), kind, invalid),
             **fz.write_ds_configs(d)}
    args, refuse, label = fz.draw_call(rng, files)
    # Hub ids offline: a machine without a network would wait out huggingface_hub's retries
    result = CliRunner(env={"HF_HUB_OFFLINE": "1"}).invoke(cli, args)
    assert fz.classify(result, refuse, args) is None, (args, label, cfg, result.output)


@pytest.mark.parametrize("args", [
    ["memory", "--preset", "debug", "--lora-targets", ""],
    ["memory", "--preset", "debug", "--lora-rank", "8", "--lora-targets", ""],
    ["memory", "--preset", "debug", "--lora-rank", "8", "--lora-targets", " , "],
])
def test_blank_lora_targets_are_refused_not_taken_as_the_default(args):
    # a blank list once fell back to the default targets (exit 0)
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and r.stderr == (
        "Error: --lora-targets: give at least one target, e.g. q,v\n"), r.output


@pytest.mark.parametrize("option, value", [("--max-num-seqs", "-7"),
                                           ("--max-num-batched-tokens", "0")])
def test_serve_scheduler_options_are_checked_under_every_engine(option, value):
    # sglang does not read vLLM's scheduler options; a bad value was once accepted with exit 0
    r = CliRunner().invoke(cli, ["serve", "--preset", "llama3-8b", "--engine", "sglang",
                                 option, value])
    assert r.exit_code == 2 and r.stderr.startswith(f"Error: {option}: "), r.output
    assert r.stderr.count("\n") == 1


# the benchmark's whole loop on a small budget (the quick lane): boundary values, many options
# at once, hostile config and ds_config files and special files among the calls; every defect
# class (internal error, non-finite figure, over 10 s, exit other than 0 and 2, a refusal not
# one line of at most 200 characters, an invalid value accepted) stays empty
QUICK_CALLS = int(os.environ.get("GPTCALC_FUZZ_QUICK_CALLS", "80"))


def test_the_fuzz_benchmark_on_a_small_budget_finds_no_defect():
    import random

    fz = _fuzz_module()
    seed = random.SystemRandom().randrange(2**32)
    per_command, classes, _seconds = fz.fuzz(QUICK_CALLS, seed=seed, configs=30)
    assert sum(c["calls"] for c in per_command.values()) == QUICK_CALLS
    assert not classes, (seed, {k: v[1] for k, v in classes.items()})
