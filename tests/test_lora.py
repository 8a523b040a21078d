"""LoRA adapter counts (PEFT's), QLoRA's NF4 constants (Dettmers et al. 2023), target checks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import count_params, from_name
from gptcalc.cli import cli
from gptcalc.linears import block_linears
from gptcalc.lora import lora_params, parse_targets, qlora_weight_bytes
from gptcalc.memory.finetune import finetune_state_bytes
from gptcalc.presets import PRESETS
from gptcalc.memory import TrainingSetup, state_bytes

from ._strategies import configs


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_peft_llama_7b_q_v_rank_8():
    r = run("params", "--preset", "llama2-7b", "--lora-rank", "8", "--lora-targets", "q,v",
            "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # PEFT's LoRA on LLaMA-7B, r=8, q_proj and v_proj: "trainable params: 4,194,304"
    assert out["trainable"] == 4_194_304
    # the preset is the released checkpoint: its adapters carry its module names
    assert out["lora"]["components"] == {"q_proj": 2_097_152, "v_proj": 2_097_152}
    assert out["total"] == 6_738_415_616  # the frozen base is unchanged


def test_default_targets_are_peft_s():
    # the presets are released checkpoints: PEFT's defaults under their module names
    assert parse_targets(None, from_name("llama2-7b")) == ("q_proj", "v_proj")
    assert parse_targets(None, from_name("gpt2")) == ("c_attn",)  # GPT-2's fused qkv
    assert parse_targets(None, from_name("gpt3-13b")) == ("qkv",)  # no release: gptcalc's
    out = json.loads(run("params", "--preset", "gpt2", "--json").stdout)
    assert out["trainable"] == out["total"] and out["lora"] is None


def test_llama3_8b_all_linear_rank_16():
    cfg = from_name("llama3-8b")
    # by hand from meta-llama/Meta-Llama-3-8B config.json (E 4096, 8 KV heads of 128, d_ff
    # 14336): per block r x (q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096,
    # gate/up 4096+14336 twice, down 14336+4096) = 16 x 81,920; x 32 blocks
    assert sum(lora_params(cfg, 16, parse_targets("all", cfg)).values()) == 32 * 16 * 81_920


def test_qlora_constants_per_parameter():
    n = 64 * 256 * 1000  # whole blocks and whole second-level blocks
    dq = qlora_weight_bytes(n)
    # Dettmers et al. 2023, sec. 3: 8/64 + 32/(64*256) = 0.127 bits per parameter with double
    # quantisation, 32/64 = 0.5 without; NF4 itself 4 bits
    assert 8 * (dq["absmax"] + dq["absmax_scales"]) / n == pytest.approx(0.127, abs=5e-4)
    assert 8 * dq["nf4"] / n == 4
    plain = qlora_weight_bytes(n, double_quant=False)
    assert 8 * (plain["absmax"] + plain["absmax_scales"]) / n == 0.5


def test_lora_state_bytes_categories():
    cfg = from_name("llama3-8b")
    targets = parse_targets("all", cfg)
    qlora = TrainingSetup(mode="amp", lora_rank=16, lora_targets=targets, base_dtype="nf4")
    s = finetune_state_bytes(cfg, qlora)
    n_lora = 32 * 16 * 81_920
    assert s["adapter/weights"] == s["adapter/gradients"] == 4 * n_lora
    # AdamW's two fp32 moments, and torch's 4-byte step counter for each of the 448 adapter
    # tensors (A and B of 7 targets in 32 blocks)
    assert s["adapter/optimizer"] == 8 * n_lora + 4 * 448
    # the 4-bit block Linears with their constants, and the embedding, untied head 2 x 128256
    # x 4096 and norms 65 x 4096 in 16 bit. Every Llama-3-8B matrix is whole 64 x 256 blocks,
    # so the constants are the paper's rates plus bitsandbytes' tables per tensor (its
    # quant_state: 16 fp32 NF4 code, 256 fp32 dynamic map, fp32 offset) x 7 x 32 tensors
    q = qlora_weight_bytes(sum(m.weights for m in block_linears(cfg)))
    other = 2 * (2 * 128_256 * 4096 + 65 * 4096)
    assert s["base/weights"] == q["nf4"] + q["absmax"] + q["absmax_scales"] + other + (
        224 * (64 + 1024 + 4))
    plain = finetune_state_bytes(cfg, dataclasses.replace(qlora, double_quant=False))
    n = sum(m.weights for m in block_linears(cfg))
    assert plain["base/weights"] == n // 2 + 4 * n // 64 + other + 224 * 64
    bf16 = finetune_state_bytes(cfg, dataclasses.replace(qlora, base_dtype="same"))
    assert bf16["base/weights"] == 2 * sum(m.weights for m in block_linears(cfg)) + other


@pytest.mark.parametrize("name", list(PRESETS))
def test_block_linears_are_the_block_parameters(name):
    cfg = from_name(name)
    lin = block_linears(cfg)
    linears = sum(m.weights + (m.count * m.out_features if m.bias else 0) for m in lin)
    p = count_params(cfg).components
    outside = ("embedding/", "lm_head", "norm/")
    # every block parameter that is not a norm (q/k norms, sinks and the like are apart)
    small = sum(v for k, v in p.items() if k.startswith("attention/") and k not in (
        "attention/qkv", "attention/out"))
    assert linears == sum(v for k, v in p.items() if not k.startswith(outside)) - small


@settings(max_examples=50, deadline=None)
@given(cfg=configs(), rank=st.integers(1, 64))
def test_lora_is_linear_in_rank(cfg, rank):
    targets = tuple(dict.fromkeys(m.target for m in block_linears(cfg)))
    one = sum(lora_params(cfg, 1, targets).values())
    assert sum(lora_params(cfg, rank, targets).values()) == rank * one


BAD = [
    (["--preset", "llama2-7b", "--lora-rank", "8", "--lora-targets", "q,bogus"], "--lora-targets"),
    (["--preset", "gpt2", "--lora-rank", "8", "--lora-targets", "gate"], "--lora-targets"),
    (["--preset", "gpt2", "--lora-rank", "8", "--lora-targets", "q"], "--lora-targets"),
    (["--preset", "llama2-7b", "--lora-rank", "8", "--lora-targets", "qkv"], "--lora-targets"),
    (["--preset", "llama2-7b", "--lora-rank", "0"], "--lora-rank"),
    (["--preset", "llama2-7b", "--lora-targets", "q"], "--lora-targets"),
]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_option(args, option):
    r = run("params", *args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and option in r.stderr, r.stderr


def test_a_hand_written_set_up_may_name_targets_either_way():
    from gptcalc import ConfigError

    # TrainingSetup(lora_targets=...) written by hand for a released checkpoint: gptcalc's names
    # select the same adapters as the module names; a name the model lacks is refused, never
    # counted as zero adapters
    cfg = from_name("phi-3-mini")
    assert lora_params(cfg, 16, ("qkv", "o")) == lora_params(cfg, 16, ("qkv_proj", "o_proj"))
    with pytest.raises(ConfigError, match="qkv_proj"):
        lora_params(cfg, 8, ("q",))  # phi3's q is part of one fused qkv_proj
    with pytest.raises(ConfigError, match="bogus"):
        lora_params(cfg, 8, ("bogus",))
    setup = TrainingSetup(mode="amp", lora_rank=8, lora_targets=("q", "v"))
    assert state_bytes(from_name("llama2-7b"), setup).gradients == 4 * 4_194_304
