"""Hybrid models (Mamba / Mamba2 / Gated DeltaNet blocks beside attention blocks): their
config.json read into GPTConfig, checked against transformers' own configuration classes; their
parameter counts against transformers' models built on the meta device, over drawn sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc import ConfigError, config_from_hf, count_params
from gptcalc.layers import attention_layers, deltanet_layers, mamba_layers

HERE = Path(__file__).parent
# config.json of Qwen/Qwen3-Next-80B-A3B-Instruct as published on the Hugging Face Hub
QWEN3_NEXT_80B = HERE / "hybrid" / "qwen3-next-80b-a3b-instruct.json"


def _transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    return torch, transformers


def hf_objects(raw: dict):
    """transformers' config object from the same fields, and its model's parameter count on the
    meta device (a tied weight once)."""
    torch, transformers = _transformers()
    fields = dict(raw)
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return cfg, sum(p.numel() for p in model.parameters())


def kinds(cfg) -> list[str]:
    """transformers' per-block kinds: attention or the state mixer, per layer."""
    names = getattr(cfg, "layers_block_type", None) or cfg.layer_types
    return ["A" if t in ("attention", "full_attention") else "P" if t == "hybrid" else "S"
            for t in names]


def ours_kinds(c) -> list[str]:
    pattern = c.layer_mixers or "A"
    return ["S" if k in "MD" else k for k in (pattern * c.n_layer)[:c.n_layer]]


heads = st.sampled_from([(4, 2), (4, 4), (6, 2), (8, 1)])


@st.composite
def qwen3_next(draw):
    H, kv = draw(heads)
    hk = draw(st.sampled_from([1, 2, 4]))
    L = draw(st.integers(1, 9))
    raw = dict(model_type="qwen3_next", hidden_size=16 * draw(st.integers(2, 5)),
               num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=kv,
               head_dim=draw(st.sampled_from([8, 16])), intermediate_size=draw(st.integers(8, 90)),
               vocab_size=draw(st.integers(16, 300)), linear_num_key_heads=hk,
               linear_num_value_heads=hk * draw(st.integers(1, 3)),
               linear_key_head_dim=draw(st.integers(2, 12)),
               linear_value_head_dim=draw(st.integers(2, 12)),
               linear_conv_kernel_dim=draw(st.integers(2, 5)),
               num_experts=draw(st.sampled_from([0, 3, 4])), num_experts_per_tok=2,
               moe_intermediate_size=draw(st.integers(4, 40)),
               shared_expert_intermediate_size=draw(st.sampled_from([8, 12])),
               decoder_sparse_step=draw(st.integers(1, 2)),
               mlp_only_layers=draw(st.lists(st.integers(0, L - 1), max_size=2, unique=True)))
    if draw(st.booleans()):  # an explicit pattern rather than full_attention_interval
        raw["layer_types"] = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]),
                                           min_size=L, max_size=L))
    else:
        raw["full_attention_interval"] = draw(st.integers(1, 4))
    return raw


@st.composite
def jamba(draw):
    H, kv = draw(heads)
    period = draw(st.integers(1, 4))
    e_period = draw(st.integers(1, 3))
    return dict(model_type="jamba", hidden_size=4 * H * draw(st.integers(1, 4)),
                num_hidden_layers=draw(st.integers(1, 9)), num_attention_heads=H,
                num_key_value_heads=kv, intermediate_size=draw(st.integers(8, 90)),
                vocab_size=draw(st.integers(16, 300)), num_experts=draw(st.sampled_from([1, 3, 4])),
                num_experts_per_tok=1, expert_layer_period=e_period,
                expert_layer_offset=e_period - 1, attn_layer_period=period,
                attn_layer_offset=draw(st.integers(0, period - 1)),
                mamba_d_state=draw(st.integers(2, 16)), mamba_d_conv=draw(st.integers(2, 5)),
                mamba_expand=draw(st.integers(1, 3)),
                mamba_dt_rank=draw(st.sampled_from(["auto", 3, 8])),
                mamba_conv_bias=draw(st.booleans()), mamba_proj_bias=draw(st.booleans()))


@st.composite
def falcon_h1(draw):
    H, kv = draw(heads)
    n_heads, groups = draw(st.sampled_from([(6, 2), (4, 1), (8, 4), (2, 2)]))
    d_head = draw(st.integers(2, 10))
    bias = draw(st.booleans())
    return dict(model_type="falcon_h1", hidden_size=8 * draw(st.integers(2, 8)),
                num_hidden_layers=draw(st.integers(1, 5)), num_attention_heads=H,
                num_key_value_heads=kv, head_dim=draw(st.sampled_from([8, 16])),
                intermediate_size=draw(st.integers(8, 90)), vocab_size=draw(st.integers(16, 300)),
                mamba_d_ssm=n_heads * d_head, mamba_n_heads=n_heads, mamba_d_head=d_head,
                mamba_n_groups=groups, mamba_d_state=draw(st.integers(2, 16)),
                mamba_d_conv=draw(st.integers(2, 5)), mamba_conv_bias=draw(st.booleans()),
                mamba_proj_bias=bias, projectors_bias=bias,
                mamba_rms_norm=draw(st.booleans()), attention_bias=draw(st.booleans()),
                mlp_bias=draw(st.booleans()), tie_word_embeddings=draw(st.booleans()))


@st.composite
def granite(draw):
    H, kv = draw(heads)
    E = 4 * H * draw(st.integers(1, 4))
    n_heads, groups = draw(st.sampled_from([(8, 2), (4, 1), (16, 4), (2, 2)]))
    L = draw(st.integers(1, 6))
    return dict(model_type="granitemoehybrid", hidden_size=E, num_hidden_layers=L,
                num_attention_heads=H, num_key_value_heads=kv,
                intermediate_size=draw(st.integers(8, 90)), vocab_size=draw(st.integers(16, 300)),
                num_local_experts=draw(st.sampled_from([0, 3, 4])), num_experts_per_tok=2,
                shared_intermediate_size=draw(st.integers(8, 60)), mamba_n_heads=n_heads,
                mamba_d_head=2 * E // n_heads, mamba_n_groups=groups,
                mamba_d_state=draw(st.integers(2, 16)), mamba_d_conv=draw(st.integers(2, 5)),
                mamba_conv_bias=draw(st.booleans()), mamba_proj_bias=draw(st.booleans()),
                attention_bias=draw(st.booleans()),
                position_embedding_type=draw(st.sampled_from([None, "rope"])),
                layer_types=draw(st.lists(st.sampled_from(["mamba", "attention"]), min_size=L,
                                          max_size=L)))


FAMILIES = {"qwen3_next": qwen3_next(), "jamba": jamba(), "falcon_h1": falcon_h1(),
            "granitemoehybrid": granite()}


def _sizes_agree(raw: dict) -> None:
    """The parsed config against transformers' own config object built from the same fields:
    depth, width, heads, the layer kinds block by block, and each mixer's sizes."""
    theirs, _ = hf_objects(raw)
    ours = config_from_hf(raw)
    assert (ours.n_layer, ours.n_embd, ours.n_head, ours.kv_heads, ours.vocab_size) == (
        theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads,
        theirs.num_key_value_heads, theirs.vocab_size)
    assert ours_kinds(ours) == kinds(theirs)
    mt = raw["model_type"]
    if mt == "qwen3_next":
        assert (ours.linear_num_key_heads, ours.linear_num_value_heads, ours.linear_key_head_dim,
                ours.linear_value_head_dim, ours.linear_conv_kernel_dim, ours.head_size) == (
            theirs.linear_num_key_heads, theirs.linear_num_value_heads,
            theirs.linear_key_head_dim, theirs.linear_value_head_dim,
            theirs.linear_conv_kernel_dim, theirs.head_dim)
    else:
        assert (ours.mamba_d_state, ours.mamba_d_conv) == (theirs.mamba_d_state,
                                                           theirs.mamba_d_conv)
    if mt == "jamba":
        assert ours.mamba_dt_width == theirs.mamba_dt_rank
        assert ours.mamba_inner == theirs.mamba_expand * theirs.hidden_size
    if mt in ("falcon_h1", "granitemoehybrid"):
        assert (ours.mamba_n_heads, ours.mamba_head_dim, ours.mamba_n_groups) == (
            theirs.mamba_n_heads, theirs.mamba_d_head, theirs.mamba_n_groups)


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_configs_read_as_transformers_reads_them(family):
    @settings(max_examples=15, deadline=None)
    @given(raw=FAMILIES[family])
    def check(raw):
        _sizes_agree(raw)
    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_params_equal_transformers_meta_models(family):
    """Every parameter of every block kind: the total equals transformers' model built from
    the same config on the meta device, over drawn sizes, depths and switches."""
    @settings(max_examples=15, deadline=None)
    @given(raw=FAMILIES[family])
    def check(raw):
        _, total = hf_objects(raw)
        assert count_params(config_from_hf(raw)).total == total
    check()


def test_qwen3_next_80b_published_config():
    """The published Qwen3-Next-80B-A3B: 36 Gated DeltaNet blocks, 12 gated-attention blocks
    (every fourth), and the total transformers builds from the file."""
    raw = json.loads(QWEN3_NEXT_80B.read_text())
    cfg = config_from_hf(QWEN3_NEXT_80B)
    assert cfg.layer_mixers == "DDDA"
    assert (deltanet_layers(cfg), attention_layers(cfg), mamba_layers(cfg)) == (36, 12, 0)
    _, total = hf_objects({k: v for k, v in raw.items()
                           if k not in ("architectures", "torch_dtype", "transformers_version")})
    assert count_params(cfg).total == total


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["full_attention", "mamba"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(full_attention_interval=0), "full_attention_interval"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
])
def test_qwen3_next_bad_patterns_are_refused(change, field):
    raw = dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=96, vocab_size=128) | change
    with pytest.raises(ConfigError, match=field):
        config_from_hf(raw)


def test_jamba_experts_off_the_period_end_are_refused():
    raw = dict(model_type="jamba", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               intermediate_size=96, vocab_size=128, expert_layer_period=2,
               expert_layer_offset=0)
    with pytest.raises(ConfigError, match="expert_layer_offset"):
        config_from_hf(raw)


def test_mamba_heads_that_do_not_fit_the_width_are_refused():
    raw = dict(model_type="granitemoehybrid", hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=96, vocab_size=128, mamba_n_heads=8,
               mamba_d_head=8)  # 8 x 8 is not mamba_expand 2 x 64
    with pytest.raises(ConfigError, match="mamba_d_head"):
        config_from_hf(raw)
