"""Training time and achieved MFU: nanoGPT's sizing notebook, Megatron-LM's GPT-3 figure,
properties of the formula, and bad input through the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.gpus import gpu
from gptcalc.time import achieved_mfu, parse_count, training_time

GPT2, WL = from_name("gpt2"), Workload(1, 1024)
A100 = gpu("a100-sxm-80gb")


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def run_json(*args: str) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_nanogpt_sizing_notebook():
    out = run_json("time", "--preset", "gpt2", "--tokens", "300e9", "--gpu", "a100-sxm-80gb",
                   "--gpus", "8", "--mfu", "0.3")
    # karpathy/nanoGPT transformer_sizing.ipynb: 6ND on 8 A100s (312 TFLOP/s) at 30% MFU,
    # "time needed to train the model: 3.46 days"; its N is 124,337,664 (no biases), ours the
    # released checkpoint's 124,439,808, so 6 * 124,439,808 * 300e9 / (8 * 312e12 * 0.3) s
    assert round(out["conventions"]["6N"]["days"], 2) == 3.46
    assert out["conventions"]["6N"]["seconds"] == pytest.approx(
        6 * 124_439_808 * 300e9 / (8 * 312e12 * 0.3), rel=1e-12)
    # the notebook's own flops(): "total 874944921600" per 1,024-token sequence
    assert out["flops_per_token"] * 1024 == 874_944_921_600
    assert round(out["days"], 2) == 3.96  # = 874944921600 / 1024 * 300e9 / (8*312e12*0.3) / 86400
    assert out["peak_flops"] == 312e12 and out["mfu"] == 0.3 and out["gpu"] == "a100-sxm-80gb"
    assert out["gpu_hours"] == pytest.approx(out["seconds"] * 8 / 3600)
    assert set(out["conventions"]) == {"6N", "kaplan", "palm"}


def test_megatron_gpt3_at_140_tflops_per_gpu():
    # Narayanan et al. 2021, sec. 5.1: GPT-3 175B on 300B tokens with 1,024 A100s at 140
    # TFLOP/s per GPU (counting recomputation, their 8TP/nX) takes 34 days
    t = training_time(from_name("gpt3-175b"), Workload(1, 2048), 300 * 10**9, A100, 1024,
                      mfu=0.3, recompute="full")
    hardware_seconds = t.hardware_flops_per_token * t.tokens / (1024 * 140e12)
    assert hardware_seconds / 86400 == pytest.approx(34, abs=1)


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 4096), k=st.integers(2, 16), mfu=st.floats(0.01, 0.5))
def test_time_is_inversely_proportional_to_gpus_and_mfu(gpus, k, mfu):
    t1 = training_time(GPT2, WL, 10**9, A100, gpus, mfu)
    assert training_time(GPT2, WL, 10**9, A100, gpus * k, mfu).seconds * k == pytest.approx(
        t1.seconds, rel=1e-12)
    assert training_time(GPT2, WL, 10**9, A100, gpus, mfu * 2).seconds * 2 == pytest.approx(
        t1.seconds, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 512), mfu=st.floats(0.01, 1.0), tokens=st.integers(10**6, 10**13))
def test_mfu_round_trip(gpus, mfu, tokens):
    t = training_time(GPT2, WL, tokens, A100, gpus, mfu)
    rate = t.tokens / t.seconds  # what a run at that MFU would measure
    assert achieved_mfu(t.flops_per_token, rate, t.peak_flops, gpus) == pytest.approx(mfu)


def test_achieved_mfu_from_a_step_time_through_the_cli():
    # nanoGPT notebook: batch 20 x 5 accumulation of 1,024 tokens in 0.755 s on one A100 ->
    # "fraction of A100 used: 37.14%"
    out = run_json("time", "--preset", "gpt2", "--gpu", "a100-sxm-80gb", "--seconds-per-step",
                   "0.755", "--tokens-per-step", "102400")
    assert round(100 * out["achieved_mfu"], 2) == 37.14


def test_recomputation_raises_hfu_not_time():
    base = training_time(GPT2, WL, 10**9, A100, 1, 0.4)
    full = training_time(GPT2, WL, 10**9, A100, 1, 0.4, recompute="full")
    assert full.seconds == base.seconds and full.hfu > base.hfu == 0.4
    with pytest.raises(ConfigError) as e:
        training_time(GPT2, WL, 10**9, A100, 1, 0.9, recompute="full")
    assert e.value.field == "mfu"


@pytest.mark.parametrize("text", ["300e9", "3e11", "300000000000", "300_000_000_000", "3.0e11"])
def test_token_spellings(text):
    assert parse_count(text, "tokens") == 300_000_000_000


def test_default_budget_is_chinchilla():
    out = run_json("time", "--preset", "gpt2")
    assert out["tokens"] == 20 * 124_439_808 and out["gpu"] == "h100-sxm"
    assert out["mfu_source"] == "predicted" and 0 < out["mfu"] < 1


BAD = [
    (["--tokens", "0"], "--tokens"), (["--tokens", "-1"], "--tokens"),
    (["--tokens", "abc"], "--tokens"), (["--tokens", "inf"], "--tokens"),
    (["--tokens", "nan"], "--tokens"), (["--tokens", "1.5"], "--tokens"),
    (["--gpu", "tpu-v9"], "--gpu"), (["--gpu", "cpu"], "--gpu"),
    (["--mfu", "0"], "--mfu"), (["--mfu", "1.5"], "--mfu"), (["--mfu", "nan"], "--mfu"),
    (["--mfu", "-0.1"], "--mfu"), (["--gpus", "0"], "--gpus"),
    (["--gpu", "a100-sxm-80gb", "--precision", "fp8"], "--precision"),
    (["--precision", "fp4"], "--precision"),
    (["--tokens-per-second", "1e12"], "--tokens-per-second"),  # MFU far above 1
    (["--seconds-per-step", "1e-9"], "--seconds-per-step"),
    (["--seconds-per-step", "0"], "--seconds-per-step"),
    (["--tokens-per-step", "1000"], "--tokens-per-step"),  # without --seconds-per-step
]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_option(args, option):
    r = run("time", "--preset", "gpt2", *args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and option in r.stderr, r.stderr
