"""Hugging Face config.json import: released models' totals, generated configs of every family
against an independent module-by-module count, spellings, defaults, and errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import ConfigError, config_from_hf, count_flops, count_params, Workload
from gptcalc.flops import NONMATMUL_COST, nonmatmul_flops
from gptcalc.cli import cli
from gptcalc.hf import SUPPORTED_MODEL_TYPES


# --- released configs, as their config.json files hold them (huggingface.co/<repo>/config.json;
# the fields that do not change a count, e.g. bos_token_id, torch_dtype, are left out) ----------

GPT2 = {  # openai-community/gpt2
    "model_type": "gpt2", "activation_function": "gelu_new", "n_ctx": 1024, "n_embd": 768,
    "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
    "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-05,
}
PYTHIA_160M = {  # EleutherAI/pythia-160m
    "model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 768,
    "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "num_attention_heads": 12, "num_hidden_layers": 12, "rotary_emb_base": 10000,
    "rotary_pct": 0.25, "tie_word_embeddings": False, "use_parallel_residual": True,
    "vocab_size": 50304,
}
LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "vocab_size": 32000,
}
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256,
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN2_05B = {  # Qwen/Qwen2-0.5B
    "model_type": "qwen2", "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "max_position_embeddings": 131072, "max_window_layers": 24,
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}

RELEASED = [
    # The count transformers' num_parameters() gives for gpt2 (HF model card: "124M"; the
    # figure nanoGPT prints for from_pretrained('gpt2') with the tied lm_head counted once).
    # By hand: 50257*768 + 1024*768 + 12*(12*768^2 + 13*768) + 2*768.
    ("gpt2", GPT2, 124_439_808),
    # Pythia model card table (EleutherAI/pythia-160m): 85,056,000 non-embedding parameters; plus
    # embed_in and the untied embed_out, 2 * 50304 * 768 = 77,266,944: 162,322,944.
    ("pythia-160m", PYTHIA_160M, 162_322_944),
    # Hand count (no page quoting the exact figure was found offline; it is the count the
    # released safetensors hold): 2*32000*4096 + 32*(4*4096^2 + 3*4096*11008 + 2*4096) + 4096.
    ("llama-2-7b", LLAMA2_7B, 6_738_415_616),
    # Hand count: 2*128256*4096 + 32*(2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 4096.
    ("llama-3-8b", LLAMA3_8B, 8_030_261_248),
    # Hand count: 2*32000*4096 + 32*(2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 4096.
    ("mistral-7b-v0.1", MISTRAL_7B, 7_241_732_096),
    # Hand count, tied head: 151936*896 + 24*((896*896 + 896) + 2*(896*128 + 128) + 896*896
    #                                          + 3*896*4864 + 2*896) + 896.
    ("qwen2-0.5b", QWEN2_05B, 494_032_768),
]


@pytest.mark.parametrize("name,raw,total", RELEASED, ids=[r[0] for r in RELEASED])
def test_released_model_totals(name, raw, total, tmp_path):
    assert count_params(config_from_hf(raw)).total == total
    # the same through a file and through the directory that holds it
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert count_params(config_from_hf(tmp_path / "config.json")).total == total
    assert count_params(config_from_hf(tmp_path)).total == total


def test_pythia_non_embedding_matches_model_card():
    # Pythia's table excludes both embed_in and embed_out; gptcalc's Kaplan figure keeps the
    # untied head, so subtract it to compare with the card's 85,056,000.
    p = count_params(config_from_hf(PYTHIA_160M))
    assert p.non_embedding - p.components["lm_head"] == 85_056_000


def test_released_switches():
    gpt2 = config_from_hf(GPT2)
    assert (gpt2.tie_embeddings, gpt2.pos_embedding, gpt2.mlp, gpt2.block_size) == \
        (True, "learned", "gelu_tanh", 1024)
    neox = config_from_hf(PYTHIA_160M)
    assert (neox.qkv_layout, neox.qkv_bias, neox.attn_out_bias, neox.mlp_bias, neox.norm) == \
        ("fused", True, True, True, "layernorm")
    assert (neox.rotary_pct, neox.rotary_dims, neox.parallel_residual, neox.tie_embeddings) == \
        (0.25, 16, True, False)
    qwen = config_from_hf(QWEN2_05B)
    assert (qwen.qkv_bias, qwen.attn_out_bias, qwen.mlp_bias, qwen.kv_heads) == \
        (True, False, False, 2)
    llama3 = config_from_hf(LLAMA3_8B)
    assert (llama3.kv_heads, llama3.ffn_dim, llama3.block_size) == (8, 14336, 8192)


# --- an independent count, module by module, the way each family's transformers modelling code
# builds its nn.Linear / nn.Embedding / norm modules (never calls gptcalc.params) ---------------


def _linear(n_in, n_out, bias):
    return n_in * n_out + (n_out if bias else 0)


def reference_count(raw: dict) -> int:
    mt = raw["model_type"]
    if mt == "gpt2":
        E, L, V = raw["n_embd"], raw["n_layer"], raw["vocab_size"]
        P = raw.get("n_positions", 1024)
        inner = raw.get("n_inner") or 4 * E
        block = (2 * E + _linear(E, 3 * E, True) + _linear(E, E, True) + 2 * E
                 + _linear(E, inner, True) + _linear(inner, E, True))
        head = 0 if raw.get("tie_word_embeddings", True) else V * E
        return V * E + P * E + L * block + 2 * E + head
    if mt == "gpt_neox":
        E, L, V, I = (raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"],
                      raw["intermediate_size"])
        b = raw.get("attention_bias", True)
        block = (2 * E + 2 * E + _linear(E, 3 * E, b) + _linear(E, E, b)
                 + _linear(E, I, True) + _linear(I, E, True))
        head = 0 if raw.get("tie_word_embeddings", False) else V * E  # embed_out, no bias
        return V * E + L * block + 2 * E + head
    E, L, V, I = (raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"],
                  raw["intermediate_size"])
    H = raw["num_attention_heads"]
    KV = raw.get("num_key_value_heads") or H
    hd = raw.get("head_dim") or E // H
    qkv_b = {"llama": raw.get("attention_bias", False), "mistral": False, "qwen2": True}[mt]
    o_b = {"llama": raw.get("attention_bias", False), "mistral": False, "qwen2": False}[mt]
    mlp_b = raw.get("mlp_bias", False) if mt == "llama" else False
    block = (_linear(E, H * hd, qkv_b) + 2 * _linear(E, KV * hd, qkv_b) + _linear(H * hd, E, o_b)
             + 2 * _linear(E, I, mlp_b) + _linear(I, E, mlp_b) + E + E)
    head = 0 if raw.get("tie_word_embeddings", False) else V * E
    return V * E + L * block + E + head


@st.composite
def small_hf_config(draw, model_type):
    """A small config.json of one family, with the optional fields sometimes present."""
    H = draw(st.integers(1, 4))
    hd = draw(st.sampled_from([2, 4, 8]))
    E, L, V = H * hd, draw(st.integers(1, 3)), draw(st.integers(2, 128))
    maybe = lambda: draw(st.booleans())  # noqa: E731
    raw: dict = {"model_type": model_type, "vocab_size": V}
    if model_type == "gpt2":
        raw.update(n_embd=E, n_layer=L, n_head=H, n_positions=draw(st.integers(1, 16)))
        if maybe():
            raw["n_inner"] = draw(st.none() | st.integers(1, 64))
        if maybe():
            raw["tie_word_embeddings"] = maybe()
        return raw
    raw.update(hidden_size=E, num_hidden_layers=L, num_attention_heads=H,
               intermediate_size=draw(st.integers(1, 64)),
               max_position_embeddings=draw(st.integers(1, 16)))
    if maybe():
        raw["tie_word_embeddings"] = maybe()
    if model_type == "gpt_neox":
        if maybe():
            raw["attention_bias"] = maybe()
        raw["rotary_pct"] = 1.0 if hd == 2 else draw(st.sampled_from([0.5, 1.0]))
        return raw
    # MistralConfig and Qwen2Config default num_key_value_heads to 8 and 32, not to H
    if maybe() or model_type in ("mistral", "qwen2"):
        divisors = [k for k in range(1, H + 1) if H % k == 0]
        raw["num_key_value_heads"] = draw(st.sampled_from(divisors))
    if maybe():
        raw["head_dim"] = draw(st.sampled_from([2, 4, 6]))
    if model_type == "llama":
        if maybe():
            raw["attention_bias"] = maybe()
        if maybe():
            raw["mlp_bias"] = maybe()
    return raw


@pytest.mark.parametrize("model_type", ("gpt2", "gpt_neox", "llama", "mistral", "qwen2"))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_generated_configs_match_module_count(model_type, data, tmp_path_factory):
    raw = data.draw(small_hf_config(model_type))
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(raw))
    assert count_params(config_from_hf(path)).total == reference_count(raw)


# --- spellings and defaults ---------------------------------------------------------------------


def test_gpt2_newer_spellings_and_n_ctx():
    newer = {"model_type": "gpt2", "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "max_position_embeddings": 1024, "vocab_size": 50257}
    assert config_from_hf(newer) == config_from_hf(GPT2)
    # n_ctx never sizes the position table: GPT2Config keeps it but builds wpe from
    # n_positions, 1024 when absent
    only_ctx = {k: v for k, v in GPT2.items() if k != "n_positions"} | {"n_ctx": 512}
    assert config_from_hf(only_ctx).block_size == 1024
    assert config_from_hf(GPT2 | {"n_positions": 2048, "n_ctx": 512}).block_size == 2048


def test_gpt2_n_inner_none_is_4e_and_explicit_n_inner_counts():
    assert config_from_hf(GPT2 | {"n_inner": None}).ffn_dim == 4 * 768
    cfg = config_from_hf(GPT2 | {"n_inner": 1000})
    assert cfg.ffn_dim == 1000
    assert count_params(cfg).total == reference_count(GPT2 | {"n_inner": 1000})


def test_tie_defaults_per_family():
    assert config_from_hf(GPT2).tie_embeddings is True
    assert config_from_hf(GPT2 | {"tie_word_embeddings": False}).tie_embeddings is False
    for raw in (PYTHIA_160M, LLAMA2_7B, MISTRAL_7B, QWEN2_05B):
        drop = {k: v for k, v in raw.items() if k != "tie_word_embeddings"}
        assert config_from_hf(drop).tie_embeddings is False, raw["model_type"]


def test_llama1_config_without_kv_heads():
    # huggyllama/llama-7b style: no num_key_value_heads (= H), max_sequence_length spelling
    raw = {k: v for k, v in LLAMA2_7B.items()
           if k not in ("num_key_value_heads", "max_position_embeddings")}
    raw["max_sequence_length"] = 2048
    cfg = config_from_hf(raw)
    assert cfg.kv_heads == 32 and cfg.block_size == 2048
    assert count_params(cfg).total == 6_738_415_616  # same weights as Llama 2 7B


def test_llama_bias_fields():
    base = count_params(config_from_hf(LLAMA2_7B)).total
    E, L = 4096, 32
    with_attn = count_params(config_from_hf(LLAMA2_7B | {"attention_bias": True})).total
    assert with_attn - base == L * (3 * E + E)  # q, k, v and o_proj biases
    with_mlp = count_params(config_from_hf(LLAMA2_7B | {"mlp_bias": True})).total
    assert with_mlp - base == L * (2 * 11008 + E)  # gate, up, down biases


def test_neox_attention_bias_false_and_partial_rotary_spelling():
    base = count_params(config_from_hf(PYTHIA_160M)).total
    nobias = count_params(config_from_hf(PYTHIA_160M | {"attention_bias": False})).total
    assert base - nobias == 12 * (3 * 768 + 768)
    newer = {k: v for k, v in PYTHIA_160M.items() if k != "rotary_pct"}
    assert config_from_hf(newer | {"partial_rotary_factor": 0.5}).rotary_dims == 32


def test_head_dim_field_counts():
    # a Mistral-Nemo-like config: head_dim 128 with E=5120, H=32 (H * head_dim != E)
    raw = MISTRAL_7B | {"hidden_size": 5120, "head_dim": 128, "num_hidden_layers": 2}
    cfg = config_from_hf(raw)
    assert (cfg.q_width, cfg.kv_width) == (4096, 1024)
    assert count_params(cfg).total == reference_count(raw)


def test_partial_rotary_nonmatmul_flops():
    cfg = config_from_hf(PYTHIA_160M)
    S = 128
    rot = nonmatmul_flops(cfg, S)["attention/rotary"]
    # rotary on 16 of 64 dims of each of the 12 query and 12 key heads, in 12 layers
    assert rot == NONMATMUL_COST["rotary"] * 12 * S * (12 + 12) * 16
    full = nonmatmul_flops(cfg.replace(rotary_pct=1.0), S)["attention/rotary"]
    assert full == 4 * rot
    # matmul FLOPs do not depend on rotary_pct or parallel_residual
    wl = Workload(1, S)
    assert count_flops(cfg, wl).forward == count_flops(
        cfg.replace(rotary_pct=1.0, parallel_residual=False), wl).forward


# --- errors -------------------------------------------------------------------------------------


def test_unknown_model_type_lists_supported():
    with pytest.raises(ConfigError) as e:
        config_from_hf({"model_type": "bert", "hidden_size": 8})
    assert e.value.field == "hf_config"
    for name in SUPPORTED_MODEL_TYPES:
        assert name in e.value.message
    with pytest.raises(ConfigError, match="missing"):
        config_from_hf({"hidden_size": 8})


@pytest.mark.parametrize("raw,needle", [
    ({k: v for k, v in LLAMA2_7B.items() if k != "intermediate_size"}, "intermediate_size"),
    (LLAMA2_7B | {"hidden_size": "4096"}, "hidden_size must be an integer"),
    (LLAMA2_7B | {"hidden_size": 4096.0}, "hidden_size must be an integer"),
    (LLAMA2_7B | {"num_hidden_layers": 0}, "must be positive"),
    (LLAMA2_7B | {"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    (LLAMA2_7B | {"hidden_act": "tanh"}, "hidden_act 'tanh' is not supported"),
    (LLAMA2_7B | {"num_key_value_heads": 3}, "does not divide"),
    (LLAMA2_7B | {"num_attention_heads": 30}, "does not divide"),
    (GPT2 | {"add_cross_attention": True}, "add_cross_attention"),
    (GPT2 | {"resid_pdrop": 1.5}, "dropout"),
    (PYTHIA_160M | {"rotary_pct": 0.01}, "rotary"),
])
def test_bad_fields(raw, needle):
    with pytest.raises(ConfigError) as e:
        config_from_hf(raw)
    assert e.value.field == "hf_config"
    assert needle in e.value.message


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        config_from_hf(tmp_path)  # a directory without config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        config_from_hf(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_hf(bad)
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config_from_hf(bad)


def run_cli(*args: str):
    r = CliRunner().invoke(cli, list(args))
    r.returncode = r.exit_code
    return r


def test_cli_hf_config_params_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_05B))
    r = run_cli("params", "--hf-config", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total"] == 494_032_768
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    r = run_cli("flops", "--hf-config", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: --hf-config:")
    # the line keeps to 200 characters: it starts the list the API's message holds whole
    # (test_unknown_model_type_lists_supported)
    assert "'t5' is not supported; supported: " + SUPPORTED_MODEL_TYPES[0] in r.stderr
    assert len(r.stderr.rstrip("\n")) <= 200


def test_cli_explicit_options_override_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    r = run_cli("params", "--hf-config", str(tmp_path / "config.json"), "-L", "1", "--json")
    assert r.returncode == 0, r.stderr
    one_layer = dict(GPT2, n_layer=1)
    assert json.loads(r.stdout)["total"] == reference_count(one_layer)
