"""The serving roofline: gpt-fast's Llama-2-7B on an A100-80GB, quantised weight bytes,
properties of the two roofline terms, and bad input through the CLI."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import from_name
from gptcalc.cli import cli
from gptcalc.gpus import gpu
from gptcalc.inference import crossing_batch, serving, weight_bytes

LLAMA2 = from_name("llama2-7b")
A100 = gpu("a100-sxm-80gb")
# transformers' LlamaForCausalLM(meta-llama/Llama-2-7b-hf config): 6,738,415,616 parameters
LLAMA2_PARAMS = 6_738_415_616
# its KV cache per token: 2 (K, V) x 32 layers x 32 heads x 128 dims x 2 bytes (bf16)
LLAMA2_KV_PER_TOKEN = 2 * 32 * 32 * 128 * 2


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_gpt_fast_llama2_7b_on_an_a100():
    r = run("infer", "--preset", "llama2-7b", "--gpu", "a100-sxm-80gb", "-B", "1",
            "--prompt-len", "128", "--gen-len", "128", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["weights_bytes"] == 2 * LLAMA2_PARAMS  # 13.48 GB per decoded token, bf16
    assert out["kv_cache_bytes"] == 256 * LLAMA2_KV_PER_TOKEN
    # roofline: 2,039 GB/s (A100 datasheet) over the weights and the KV cache at the mean
    # context of the 128 generated tokens, 128 + 129/2 = 192.5
    step_bytes = 2 * LLAMA2_PARAMS + 192.5 * LLAMA2_KV_PER_TOKEN
    assert out["decode_tokens_per_second"] == pytest.approx(2039e9 / step_bytes, rel=1e-12)
    assert out["decode_bound"] == "memory" and out["fits"] is True
    # gpt-fast README: 104.9 tokens/s at 1,397.31 GB/s; the default bandwidth efficiency is that
    # ratio (1397.31 / 2039 = 0.685), so this checks consistency, not a prediction
    assert out["expected_decode_tokens_per_second"] == pytest.approx(104.9, rel=0.05)
    assert out["bandwidth_efficiency"] == pytest.approx(1397.31 / 2039, abs=1e-3)
    # per sequence the KV cache (192.5 x 0.5 MiB) takes longer to read than its 2N FLOPs take
    # at 312 TFLOP/s: no batch turns decode compute-bound; with the weights alone (2 bytes and
    # 2 FLOPs per parameter per token) at about the A100's ridge, 312e12 / 2039e9 = 153
    assert out["compute_bound_batch"] is None
    assert 140 < out["compute_bound_batch_weights_only"] < 170


def test_int4_weights_with_group_scales():
    # block Linear weights of Llama-2-7B: 32 x (4 x 4096^2 + 3 x 4096 x 11008) = 6,476,005,376;
    # int4: half a byte each, one fp16 scale per 128; the rest (embeddings, head, norms) 16-bit
    matrix = 32 * (4 * 4096**2 + 3 * 4096 * 11008)
    w = weight_bytes(LLAMA2, "int4")
    assert w == {"quantised": matrix // 2, "scales": matrix // 128 * 2,
                 "other": 2 * (LLAMA2_PARAMS - matrix)}
    assert sum(weight_bytes(LLAMA2, "bf16").values()) == 2 * LLAMA2_PARAMS


def test_tensor_parallel_splits_weights_and_kv_heads():
    one, four = serving(LLAMA2, A100, tp=1), serving(LLAMA2, A100, tp=4)
    assert four.kv_cache_bytes * 4 == one.kv_cache_bytes
    assert four.weights_bytes == pytest.approx(one.weights_bytes / 4, rel=1e-3)  # norms replicated


@settings(max_examples=30, deadline=None)
@given(prompt=st.integers(1, 1000), gen=st.integers(1, 1000), extra=st.integers(1, 1000),
       batch=st.integers(1, 64))
def test_decode_time_per_token_grows_with_context(prompt, gen, extra, batch):
    short = serving(LLAMA2, A100, batch, prompt, gen)
    longer = serving(LLAMA2, A100, batch, prompt + extra, gen)
    assert longer.decode.memory_seconds > short.decode.memory_seconds
    assert longer.decode.compute_seconds > short.decode.compute_seconds
    assert longer.decode_seconds_per_token >= short.decode_seconds_per_token


@settings(max_examples=60, deadline=None)
@given(preset=st.sampled_from(["gpt2", "llama3-8b", "llama2-7b", "gpt3-6.7b"]),
       name=st.sampled_from(["a100-sxm-80gb", "h100-sxm", "l40s", "mi300x"]),
       prompt=st.integers(1, 256), gen=st.integers(1, 256))
def test_compute_bound_batch_is_where_the_terms_cross(preset, name, prompt, gen):
    cfg, g = from_name(preset), gpu(name)
    s = serving(cfg, g, 1, prompt, gen)
    b = s.compute_bound_batch
    at = lambda n: serving(cfg, g, n, prompt, gen).decode  # noqa: E731
    if b is None:  # every extra sequence adds more memory time than compute time
        assert s.kv_per_sequence / Fraction(g.hbm_bytes_per_second) >= \
            s.decode_flops_per_sequence / Fraction(g.bf16_flops)
        return
    assert at(b).compute_seconds >= at(b).memory_seconds
    if b > 1:
        assert at(b - 1).compute_seconds < at(b - 1).memory_seconds


def test_crossing_batch_by_hand():
    # 1 GB of weights, 1 GFLOP and no KV per sequence, 100 TFLOP/s, 1 TB/s: B = 1e-3 / 1e-5 = 100
    assert crossing_batch(Fraction(10**9), Fraction(0), 10**9, 100e12, 1e12) == 100


def test_prefill_of_a_long_prompt_is_compute_bound():
    s = serving(LLAMA2, A100, 8, 2048, 128)
    assert s.prefill.bound == "compute" and s.expected_prefill_seconds > s.prefill.seconds


BAD = [
    (["--gpu", "nonesuch"], "--gpu"), (["--gpu", "cpu"], "--gpu"),
    (["--tp", "3"], "--tp"), (["--gpus", "0"], "--tp"),
    (["--weights-dtype", "int2"], "--weights-dtype"), (["--kv-dtype", "int4"], "--kv-dtype"),
    (["--flops-efficiency", "0"], "--flops-efficiency"),
    (["--bandwidth-efficiency", "1.2"], "--bandwidth-efficiency"),
    (["--prompt-len", "4000", "--gen-len", "200"], "--gen-len"),
    (["--prompt-len", "0"], "--prompt-len"), (["--gen-len", "-1"], "--gen-len"),
    (["--gpu", "t4"], "--weights-dtype"),  # Turing: fp16 tensor cores, no bf16
]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_option(args, option):
    r = run("infer", "--preset", "llama2-7b", *args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and option in r.stderr, r.stderr
