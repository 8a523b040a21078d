"""The config.json files the installed transformers writes (`save_pretrained`), and their
attribute_map spellings, read by gptcalc: parameter totals equal transformers' own on the meta
device, for a small config of every family."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc import ConfigError, config_from_hf, count_params
from gptcalc.hf import SUPPORTED_MODEL_TYPES
from gptcalc.hf_families import ATTRIBUTE_MAPS, FAMILIES

from .hf_published import PUBLISHED
from .test_architectures import FAMILY_CASES, small

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

# the families FAMILY_CASES has no published config of: small configs by hand
EXTRA = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=64,
                 vocab_size=128),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=96, vocab_size=128,
                     max_position_embeddings=64),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, vocab_size=128,
                  max_position_embeddings=64),
}
# the hybrid families (Mamba / Gated DeltaNet blocks beside attention): tests/test_hybrid.py
# draws their sizes; one small config each here
EXTRA |= {
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=96, vocab_size=128, max_position_embeddings=64,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=24, shared_expert_intermediate_size=20),
    "jamba": dict(model_type="jamba", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, vocab_size=128, num_experts=4,
                  mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1),
    "falcon_h1": dict(model_type="falcon_h1", hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=128, mamba_d_ssm=48, mamba_n_heads=6,
                      mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16),
    "granitemoehybrid": dict(model_type="granitemoehybrid", hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=96, vocab_size=128, num_local_experts=4,
                             shared_intermediate_size=40, mamba_n_heads=8, mamba_d_head=16,
                             mamba_n_groups=2, mamba_d_state=16,
                             layer_types=["mamba", "attention"]),
}
CASES = {name: small(name) for name in FAMILY_CASES} | EXTRA


def test_every_family_has_a_case():
    assert {raw["model_type"] for raw in CASES.values()} | {"gemma3"} == set(SUPPORTED_MODEL_TYPES)


def transformers_total(cfg) -> int:
    """transformers' count on the meta device (a tied weight once); a multimodal config's
    language model only."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg.get_text_config())
    return sum(p.numel() for p in model.parameters())


def saved(cfg, tmp_path) -> dict:
    cfg.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("model_type", sorted(FAMILIES) + ["gemma3"])
def test_attribute_maps_cover_transformers(model_type):
    ours = ATTRIBUTE_MAPS.get(model_type, {})
    theirs = type(transformers.AutoConfig.for_model(model_type)).attribute_map
    # the multimodal Gemma 3 config's aliases are token ids, none of them read
    if model_type != "gemma3":
        assert theirs.items() <= ours.items()


@pytest.mark.parametrize("name", CASES)
def test_save_pretrained_config_matches_transformers(name, tmp_path):
    fields = dict(CASES[name])
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    saved(cfg, tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert count_params(config_from_hf(tmp_path)).total == transformers_total(loaded)


def test_gemma3_multimodal_save_pretrained(tmp_path):
    text = dict(small("gemma-3-27b"), model_type="gemma3_text", vocab_size=128)
    cfg = transformers.AutoConfig.for_model("gemma3", text_config=text)
    raw = saved(cfg, tmp_path)
    assert raw["model_type"] == "gemma3" and "text_config" in raw
    assert count_params(config_from_hf(tmp_path)).total == transformers_total(cfg)


# the hybrid families' layer patterns are properties or checked lists in transformers (no
# slicing by depth here): tests/test_hybrid.py draws their depths and spellings
HYBRID = ("qwen3_next", "jamba", "falcon_h1", "granitemoehybrid")
ALIASED = [name for name, raw in CASES.items()
           if raw["model_type"] in ATTRIBUTE_MAPS and name not in HYBRID]


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(ALIASED), layers=st.integers(1, 3), vocab=st.integers(16, 300),
       spell=st.lists(st.booleans(), min_size=4, max_size=4), data=st.data())
def test_alias_spellings_match_transformers(name, layers, vocab, spell, data, tmp_path_factory):
    """A config.json spelling each field by its attribute_map alias or by the attribute itself
    (as transformers reads either), at drawn depths and vocabularies."""
    fields = dict(CASES[name])
    model_type = fields.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    cfg.num_hidden_layers, cfg.vocab_size = layers, vocab
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = (cfg.layer_types * 3)[:layers]
    if getattr(cfg, "first_k_dense_replace", None):
        cfg.first_k_dense_replace = data.draw(st.integers(0, layers))
    d = tmp_path_factory.mktemp("cfg")
    raw = saved(cfg, d)
    for (alias, attr), use_alias in zip(ATTRIBUTE_MAPS[model_type].items(), spell * 2):
        if use_alias and attr in raw:
            raw[alias] = raw.pop(attr)
    (d / "config.json").write_text(json.dumps(raw))
    loaded = transformers.AutoConfig.from_pretrained(d)
    assert count_params(config_from_hf(d)).total == transformers_total(loaded)


def test_disagreeing_spellings_are_refused():
    from gptcalc import ConfigError

    raw = dict(PUBLISHED["qwen3-30b-a3b"], num_local_experts=64)  # num_experts is 128
    with pytest.raises(ConfigError, match="num_experts .* name the same field"):
        config_from_hf(raw)


@settings(max_examples=12, deadline=None)
@given(q_lora=st.sampled_from([None, 8, 24]), dense=st.integers(0, 2), shared=st.integers(0, 2),
       experts=st.sampled_from([(4, 2, 1), (4, 2, 2), (6, 3, 2), (8, 4, 1)]),
       method=st.sampled_from(["greedy", "group_limited_greedy"]), heads=st.sampled_from([2, 4]),
       # transformers' complex rotary needs the rope part at an even offset: nope even
       dims=st.tuples(st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 8]), st.integers(2, 9)),
       mlp_bias=st.booleans(), attention_bias=st.booleans(), topk=st.integers(1, 2))
def test_deepseek_v2_params_and_flops_match_transformers(q_lora, dense, shared, experts, method,
                                                         heads, dims, mlp_bias, attention_bias,
                                                         topk):
    """DeepseekV2ForCausalLM from a config object: V2-Lite's plain q_proj and V2's q_lora_rank,
    the first_k_dense_replace dense blocks, fused shared experts, both routings (no router
    parameter but its weight), the own nope/rope/v split; biases where the config puts them."""
    from .test_architectures import _counter, hf_model

    from gptcalc import Workload, count_flops

    n_routed, n_group, topk_group = experts
    nope, rope, v = dims
    raw = dict(model_type="deepseek_v2", hidden_size=8 * heads, num_hidden_layers=3,
               num_attention_heads=heads, intermediate_size=40, moe_intermediate_size=12,
               n_routed_experts=n_routed, num_experts_per_tok=topk, n_shared_experts=shared,
               first_k_dense_replace=dense, kv_lora_rank=10, q_lora_rank=q_lora,
               qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, topk_method=method,
               n_group=n_group, topk_group=topk_group, mlp_bias=mlp_bias,
               attention_bias=attention_bias, vocab_size=64, max_position_embeddings=32)
    if mlp_bias and not shared:
        with pytest.raises(ConfigError, match="mlp_bias"):
            config_from_hf(raw)
        raw["mlp_bias"] = False
    ours = config_from_hf(raw)
    model = hf_model(raw, "meta")
    assert count_params(ours).total == sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    model = hf_model(raw, "cpu").float().eval()
    B, S = 2, 5
    with torch.no_grad(), _counter() as fc:
        model(torch.randint(0, 64, (B, S)), use_cache=False)
    assert fc.get_total_flops() == B * count_flops(ours, Workload(B, S)).forward_total


@pytest.mark.parametrize("change, field", [
    (dict(topk_method="noaux_tc"), "topk_method"), (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(num_experts_per_tok=None), "num_experts_per_tok"),
    (dict(topk_method="group_limited_greedy", n_group=None), "n_group")])
def test_deepseek_v2_refuses_what_transformers_cannot_build(change, field):
    raw = dict(small("deepseek-v2-lite"))
    with pytest.raises(ConfigError, match=field):
        config_from_hf({k: v for k, v in (raw | change).items()})
