"""FLOP counts: golden values from nanoGPT's sizing notebook, and scaling properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import Workload, count_flops, count_params, from_name, inference_flops
from gptcalc.flops import forward_flops, nonmatmul_flops, published_estimates

from .test_params import configs


def test_gpt2_forward_matches_nanogpt_sizing_notebook():
    # nanoGPT transformer_sizing.ipynb, flops() for GPT-2 124M at T=1024 (one sequence):
    # attention/kqv 3623878656, attention/scores 1610612736, attention/reduce 1610612736,
    # attention/proj 1207959552, mlp/ffw1 = mlp/ffw2 = 4831838208 (per layer), dense 79047426048,
    # forward_total 291648307200, backward_total 583296614400, total 874944921600.
    cfg = from_name("gpt2")
    f = count_flops(cfg, Workload(batch_size=1, seq_len=1024))
    L = 12
    assert f.forward["attention/qkv"] == L * 3_623_878_656
    assert f.forward["attention/scores"] == L * 1_610_612_736
    assert f.forward["attention/values"] == L * 1_610_612_736
    assert f.forward["attention/out"] == L * 1_207_959_552
    assert f.forward["mlp/fc"] == f.forward["mlp/proj"] == L * 4_831_838_208
    assert f.forward["lm_head"] == 79_047_426_048
    assert f.forward_total == 291_648_307_200
    assert f.backward_total == 583_296_614_400
    assert f.training_total == 874_944_921_600


def test_palm_estimate_matches_nanogpt_estimate_mfu():
    # nanoGPT model.py, GPT.estimate_mfu for GPT-2 124M at T=1024: N = get_num_params(), whose
    # non_embedding=True subtracts transformer.wpe only (124,439,808 - 1024 x 768 = 123,653,376);
    # flops_per_token = 6N + 12 L H Q T = 741,920,256 + 113,246,208.
    assert published_estimates(from_name("gpt2"), 1024)["palm"] == 855_166_464


def test_kaplan_and_6n_by_their_definitions():
    # Kaplan et al. 2020 eq. 2.2: C_forward = 2N + 2 n_layer n_ctx d_attn; training ~ 3x.
    cfg = from_name("gpt2")
    p = count_params(cfg)
    est = published_estimates(cfg, 1024)
    assert est["kaplan"] == 3 * (2 * p.non_embedding + 2 * 12 * 1024 * 768)
    assert est["6N"] == 6 * 124_439_808


@settings(max_examples=200)
@given(configs(), st.integers(1, 32))
def test_attention_is_quadratic_in_length_and_the_rest_linear(cfg, s):
    cfg = cfg.replace(block_size=max(cfg.block_size, 2 * s))
    one, two = forward_flops(cfg, s), forward_flops(cfg, 2 * s)
    for key in one:
        factor = 4 if key in ("attention/scores", "attention/values") else 2
        assert two[key] == factor * one[key], key


@settings(max_examples=200)
@given(configs(), st.integers(1, 64))
def test_recomputation_adds_forward_work_only(cfg, s):
    wl = Workload(1, min(s, cfg.block_size))
    base = count_flops(cfg, wl)
    sel = count_flops(cfg, wl, recompute="selective")
    full = count_flops(cfg, wl, recompute="full")
    core = base.forward["attention/scores"] + base.forward["attention/values"]
    assert sel.training_total == full.training_total == base.training_total  # model FLOPs
    assert sel.hardware_total - base.training_total == core
    assert full.hardware_total - base.training_total == base.forward_total - base.forward["lm_head"]
    flash = count_flops(cfg, wl, flash_backward=True)
    # FlopCounterMode's rule for SDPA: backward = 2.5 x forward of the attention core
    assert 2 * (flash.hardware_total - flash.forward_total) - 2 * (
        base.backward_total - base.backward["attention/scores"] - base.backward["attention/values"]
    ) == 5 * core


@settings(max_examples=200)
@given(configs(), st.integers(1, 64))
def test_causal_counts_the_unmasked_pairs(cfg, s):
    s = min(s, cfg.block_size)
    full, causal = forward_flops(cfg, s), forward_flops(cfg, s, causal=True)
    assert causal["attention/scores"] * s == full["attention/scores"] * (s + 1) // 2
    assert {k: v for k, v in causal.items() if "scores" not in k and "values" not in k} == \
        {k: v for k, v in full.items() if "scores" not in k and "values" not in k}


@settings(max_examples=200)
@given(configs(), st.integers(2, 64), st.integers(1, 64))
def test_decode_with_cache_is_the_last_row_of_a_causal_forward(cfg, c, prompt):
    cfg = cfg.replace(block_size=max(cfg.block_size, c, prompt))
    inf = inference_flops(cfg, prompt, c)
    # a cached step does exactly the work a causal forward over c tokens adds over c-1 tokens
    assert inf.decode_per_token == (sum(forward_flops(cfg, c, causal=True).values())
                                    - sum(forward_flops(cfg, c - 1, causal=True).values()))
    assert inf.decode_per_token_no_cache == sum(forward_flops(cfg, c).values())
    assert inf.prefill == sum(forward_flops(cfg, prompt).values())


@settings(max_examples=100)
@given(configs(), st.integers(1, 64))
def test_per_token_matmul_counts_are_exact_integers(cfg, s):
    f = count_flops(cfg, Workload(3, min(s, cfg.block_size)), causal=True)
    for v in f.forward.values():
        assert isinstance(f.per_token(v), int)


@settings(max_examples=100)
@given(configs(), st.integers(1, 32))
def test_nonmatmul_attention_is_quadratic_rest_linear(cfg, s):
    cfg = cfg.replace(block_size=max(cfg.block_size, 2 * s))
    one, two = nonmatmul_flops(cfg, s), nonmatmul_flops(cfg, 2 * s)
    for key in one:
        factor = 4 if key in ("attention/scale", "attention/softmax", "attention/alibi") else 2
        assert two[key] == factor * one[key], key


def test_inference_rejects_context_beyond_block_size():
    from gptcalc import ConfigError

    with pytest.raises(ConfigError) as info:
        inference_flops(from_name("debug"), 4, 17)
    assert info.value.field == "context"
