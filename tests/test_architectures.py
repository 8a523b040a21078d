"""Modern architectures against transformers, the measured twin: parameter totals at the
published sizes (meta device), forward and training FLOPs (FlopCounterMode, eager attention and
eager experts, real tensors on CPU) and the KV cache after a prefill (DynamicCache) on small
configs of every family; plus golden values of the layer-kind and KV-cache formulas."""

from __future__ import annotations

import pytest

from gptcalc import Workload, config_from_hf, count_flops, count_params, from_name
from gptcalc.errors import ConfigError
from gptcalc.layers import kv_cache_elements, moe_layers, sliding_layers

from .hf_published import PUBLISHED

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def hf_config(raw: dict):
    """transformers' config object for a config.json dict (a multimodal one's text model)."""
    fields = dict(raw)
    model_type = fields.pop("model_type")
    if "text_config" in fields:
        fields = dict(fields["text_config"])
        model_type = fields.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


def hf_model(raw: dict, device: str = "meta"):
    cfg = hf_config(raw)
    with torch.device(device):
        try:
            return transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation="eager", experts_implementation="eager")
        except (TypeError, ValueError):  # families without an experts implementation switch
            return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


# --- (a) parameter totals at the published sizes ---------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", PUBLISHED)
def test_published_totals_match_transformers(name):
    raw = PUBLISHED[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(raw))
    # parameters() yields a tied weight once
    assert count_params(config_from_hf(raw)).total == sum(p.numel() for p in model.parameters())


def test_active_parameters_by_hand():
    # Mixtral 8x7B: every one of the 32 layers holds 8 SwiGLU experts of 3 * 4096 * 14336; a
    # token uses 2, so 6 per layer are inactive (Jiang et al. 2024 announce "12.9B active").
    p = count_params(config_from_hf(PUBLISHED["mixtral-8x7b"]))
    assert p.total == 46_702_792_704  # transformers' count (test above)
    assert p.active == p.total - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248
    # DeepSeek-V3: 58 MoE layers of 256 experts of 3 * 7168 * 2048, top 8 ("37B activated")
    d = count_params(config_from_hf(PUBLISHED["deepseek-v3"]))
    assert d.active == d.total - 58 * 248 * 3 * 7168 * 2048
    # Qwen3-30B-A3B: 48 layers of 128 experts of 3 * 2048 * 768, top 8 ("3.3B activated")
    q = count_params(config_from_hf(PUBLISHED["qwen3-30b-a3b"]))
    assert q.active == q.total - 48 * 120 * 3 * 2048 * 768
    # gpt-oss-20b: 24 layers of 32 experts of 2880 * 2 * 2880 + 2 * 2880 (gate_up and its
    # bias) + 2880 * 2880 + 2880 (down and its bias), top 4
    g = count_params(config_from_hf(PUBLISHED["gpt-oss-20b"]))
    assert g.active == g.total - 24 * 28 * (3 * 2880 * 2880 + 3 * 2880)


def test_deepseek_v2_totals_match_their_model_cards():
    # deepseek-ai/DeepSeek-V2-Lite model card: "15.7B total parameters, 2.4B activated";
    # deepseek-ai/DeepSeek-V2 model card: "236B total parameters, 21B activated". Exact: the
    # count of transformers' DeepseekV2ForCausalLM from the published config.json
    lite = count_params(config_from_hf(PUBLISHED["deepseek-v2-lite"]))
    assert lite.total == 15_706_484_224 and round(lite.total / 1e9, 1) == 15.7
    # 26 MoE layers of 64 experts of 3 * 2048 * 1408, top 6
    assert lite.active == lite.total - 26 * 58 * 3 * 2048 * 1408
    v2 = count_params(config_from_hf(PUBLISHED["deepseek-v2"]))
    assert v2.total == 235_741_434_880 and round(v2.total / 1e9) == 236
    # 59 MoE layers of 160 experts of 3 * 5120 * 1536, top 6
    assert v2.active == v2.total - 59 * 154 * 3 * 5120 * 1536
    assert round(v2.active / 1e9) == 21


def test_presets_match_their_published_configs():
    for preset, name in [("mixtral-8x7b", "mixtral-8x7b"), ("deepseek-v3", "deepseek-v3"),
                         ("deepseek-v2-lite", "deepseek-v2-lite"), ("deepseek-v2", "deepseek-v2"),
                         ("qwen3-8b", "qwen3-8b"), ("qwen3-30b-a3b", "qwen3-30b-a3b"),
                         ("gemma-2-9b", "gemma-2-9b"), ("gemma-3-27b", "gemma-3-27b"),
                         ("gpt-oss-20b", "gpt-oss-20b"), ("llama3.1-405b", "llama3.1-405b"),
                         ("llama3.1-8b", "llama3.1-8b"), ("llama3.1-70b", "llama3.1-70b"),
                         ("mistral-7b-v0.1", "mistral-7b-v0.1"), ("olmo2-7b", "olmo2-7b"),
                         ("phi-3-mini", "phi-3-mini")]:
        ours, hf = from_name(preset), config_from_hf(PUBLISHED[name])
        assert count_params(ours) == count_params(hf), preset
        assert (sliding_layers(ours), moe_layers(ours)) == (sliding_layers(hf), moe_layers(hf))


# --- small configs of every family --------------------------------------------------------------

_SMALL = dict(  # applied where the published config has the field
    hidden_size=64, n_embd=64, num_hidden_layers=2, n_layer=2, num_attention_heads=4, n_head=4,
    num_key_value_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=96, n_inner=96,
    ffn_dim=96, vocab_size=128, max_position_embeddings=64, n_positions=64,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, shared_expert_intermediate_size=48, kv_lora_rank=16,
    q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
    topk_group=1, word_embed_proj_dim=32, first_k_dense_replace=1,
)
WINDOW = 6  # smaller than the sequences below, so windows and their caches are exercised


def small(name: str) -> dict:
    raw = dict(PUBLISHED[name])
    if "text_config" in raw:
        raw = dict(raw["text_config"])
    out = {k: (_SMALL[k] if k in _SMALL else v) for k, v in raw.items()}
    if name.startswith("deepseek"):
        out["num_hidden_layers"] = 3  # one dense layer, two MoE layers
        out["num_key_value_heads"] = 4  # MLA: k and v have every head
    if name == "deepseek-v2-lite":
        out["q_lora_rank"] = None  # one q_proj
    if name == "deepseek-v2":
        out["n_group"], out["topk_group"] = 2, 1  # group-limited: 2 of the 4 experts
    if name == "phi-3-mini":
        out["pad_token_id"] = 0  # Phi3Config's default 32000 is outside the small vocabulary
    if out.get("sliding_window"):
        out["sliding_window"] = WINDOW
    if "layer_types" in out:
        out["layer_types"] = out["layer_types"][: out["num_hidden_layers"]]
    if name == "opt-125m":
        out["word_embed_proj_dim"] = 64
    return out


# one published config per family (the KV twin and the FLOP twin need one each)
FAMILY_CASES = ["mixtral-8x7b", "deepseek-v3", "deepseek-v2-lite", "deepseek-v2", "qwen3-8b",
                "qwen3-30b-a3b", "qwen1.5-moe-a2.7b",
                "gemma-7b", "gemma-2-9b", "gemma-3-1b", "gpt-oss-20b", "phi-2", "phi-3-mini",
                "olmo2-7b", "starcoder2-15b", "starcoderbase", "falcon-7b", "falcon-40b",
                "opt-125m", "opt-350m", "bloom-560m", "stablelm-2-1.6b", "stablelm-2-12b",
                "granite-3.0-8b", "command-r", "llama3.1-405b", "mistral-7b-v0.1"]


def _counter():
    from reference_model.measure import CPU_SDPA_FLOPS  # CPU SDPA kernels registered
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)


def _fused(fc) -> bool:
    return any("scaled_dot_product" in str(op) for op in fc.get_flop_counts()["Global"])


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_small_family_flops_and_kv_cache_match_transformers(name):
    raw = small(name)
    ours = config_from_hf(raw)
    B, S = 2, 10
    torch.manual_seed(0)
    model = hf_model(raw, "cpu").float()
    idx = torch.randint(0, raw["vocab_size"], (B, S))
    # (b) forward FLOPs, eval, no cache
    model.eval()
    with torch.no_grad(), _counter() as fc:
        model(idx, use_cache=False)
    assert fc.get_total_flops() == B * count_flops(ours, Workload(B, S)).forward_total
    # (b) training FLOPs: forward with the loss, backward
    model.train()
    with _counter() as fc:
        model(idx, labels=idx, use_cache=False).loss.backward()
    want = count_flops(ours, Workload(B, S), flash_backward=_fused(fc)).hardware_total
    assert fc.get_total_flops() == B * want
    # (c) KV cache after a prefill: transformers keeps window - 1 past tokens in a sliding
    # block and caches MLA's compressed latent and rotary key
    model.eval()
    with torch.no_grad():
        cache = model(idx, use_cache=True).past_key_values
    got = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    if raw.get("new_decoder_architecture"):
        # FalconAttention broadcasts k and v to every query head before caching them
        ours = ours.replace(n_kv_head=None)
    assert got == B * kv_cache_elements(ours, S, window_keeps="window-1", mla_cache="latent")


# --- golden values of the analytic side (hand counts) ------------------------------------------

def test_mistral_kv_cache_is_one_window_per_layer():
    # Mistral 7B v0.1 at 32768 tokens, bf16, B=1: each of the 32 layers caches one 4096-token
    # window of 8 kv heads x 128 for K and V: 32 x 2 x 8 x 128 x 4096 x 2 bytes = 512 MiB.
    cfg = from_name("mistral-7b-v0.1")
    assert kv_cache_elements(cfg, 32768) * 2 == 32 * 2 * 8 * 128 * 4096 * 2 == 512 * 2**20
    # transformers' sliding cache keeps window - 1 past tokens
    assert kv_cache_elements(cfg, 32768, window_keeps="window-1") == 32 * 2 * 8 * 128 * 4095
    # below the window, the window changes nothing
    assert kv_cache_elements(cfg, 1000) == 32 * 2 * 8 * 128 * 1000


def test_gemma3_five_local_to_one_global():
    # Gemma 3 27B: 62 layers in the pattern LLLLLG: 10 whole periods (50 L, 10 G) and LL:
    # 52 sliding (window 1024), 10 global. K+V per token and layer: 2 x 16 x 128 = 4096.
    cfg = from_name("gemma-3-27b")
    assert (sliding_layers(cfg), cfg.n_layer - sliding_layers(cfg)) == (52, 10)
    assert kv_cache_elements(cfg, 32768) == 4096 * (10 * 32768 + 52 * 1024)
    assert kv_cache_elements(cfg, 32768) * 2 == 3_120_562_176  # bytes in bf16: 2.91 GiB
    # gpt-oss-20b: LG over 24 layers, window 128
    assert sliding_layers(from_name("gpt-oss-20b")) == 12


def test_mla_latent_cache():
    # DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer, 61 layers
    cfg = from_name("deepseek-v3")
    assert kv_cache_elements(cfg, 1) == 61 * (512 + 64)
    assert kv_cache_elements(cfg, 1, mla_cache="expanded") == 61 * 128 * (192 + 128)


def test_moe_layer_rules():
    base = from_name("debug", arch="mixtral", n_layer=10, n_expert=4)
    assert moe_layers(base) == 10
    assert moe_layers(base.replace(moe_first_dense=3)) == 7  # DeepSeek's first_k_dense_replace
    assert moe_layers(base.replace(moe_step=2)) == 5  # blocks 1, 3, 5, 7, 9
    assert moe_layers(base.replace(moe_step=2, moe_dense_layers="0,1,3")) == 3  # 5, 7, 9
    assert moe_layers(base.replace(moe_step=3, moe_first_dense=4)) == 2  # blocks 5, 8


def test_causal_flops_count_the_window():
    cfg = from_name("mistral-7b-v0.1")
    S, W, L, H, hd = 8192, 4096, 32, 32, 128
    f = count_flops(cfg, Workload(1, S), causal=True).forward
    # query i sees min(i + 1, W) keys: W(W+1)/2 + (S - W) W pairs per head and layer
    assert f["attention/scores"] == 2 * L * H * hd * (W * (W + 1) // 2 + (S - W) * W)
    full = count_flops(cfg, Workload(1, S)).forward
    assert full["attention/scores"] == 2 * L * H * hd * S * S  # the default: full S x S


@pytest.mark.parametrize("setting", [
    "n_expert=8", "n_expert_active=1", "n_shared_expert=1", "moe_ffn_dim=64",
    "shared_ffn_dim=96", "shared_expert_gate=true", "router_bias=true", "expert_bias=true",
    "moe_first_dense=1", "moe_step=2", "moe_dense_layers=0", "kv_lora_rank=16",
    "q_lora_rank=8", "qk_nope_head_dim=8", "qk_rope_head_dim=4", "v_head_dim=8",
    "qk_norm=head", "qk_norm=per_head", "qk_norm=proj", "post_norm=true", "pre_norm=false",
    "embd_norm=true", "pos_offset=2", "embd_proj_dim=16", "attn_sinks=true",
    "sliding_window=4", "attn_pattern=G", "pos_embedding=alibi", "mlp=geglu",
])
def test_each_switch_is_settable_alone(setting):
    from click.testing import CliRunner

    from gptcalc.cli import cli

    extra = ["--set", "n_expert=4"] if setting.split("=")[0] in (
        "n_expert_active", "n_shared_expert", "moe_ffn_dim", "shared_ffn_dim",
        "shared_expert_gate", "router_bias", "expert_bias", "moe_first_dense", "moe_step",
        "moe_dense_layers") else []
    if setting.split("=")[0] in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim"):
        extra = ["--set", "kv_lora_rank=16"]
    r = CliRunner().invoke(cli, ["params", "--preset", "debug", "--arch", "llama", "--json",
                                  "--set", setting, *extra])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("fields,needle", [
    (dict(attn_pattern="LLX"), "attn_pattern"),
    (dict(attn_pattern="LG"), "sliding_window"),
    (dict(n_expert=2, n_expert_active=3), "n_expert_active"),
    (dict(shared_norm=True), "parallel_residual"),
    (dict(qk_norm="both"), "qk_norm"),
    (dict(moe_dense_layers="1;2"), "moe_dense_layers"),
    (dict(kv_lora_rank=8, qkv_layout="per_head"), "kv_lora_rank"),
])
def test_bad_switches(fields, needle):
    with pytest.raises(ConfigError) as e:
        from_name("debug", **fields)
    assert needle in e.value.field or needle in e.value.message


@pytest.mark.parametrize("raw,needle", [
    # a Mixtral config relabelled llama would silently lose its experts
    (PUBLISHED["mixtral-8x7b"] | {"model_type": "llama"}, "num_local_experts"),
    (PUBLISHED["deepseek-v3"] | {"model_type": "mistral"}, "n_routed_experts"),
    (PUBLISHED["opt-125m"] | {"layer_norm_elementwise_affine": False}, "elementwise"),
    (PUBLISHED["phi-2"] | {"qk_layernorm": True}, "qk_layernorm"),
    (PUBLISHED["gemma-2-9b"] | {"layer_types": ["sliding_attention", "local"]}, "layer_types"),
    ({"model_type": "t5", "hidden_size": 8}, "not supported"),
])
def test_hf_structure_errors(raw, needle):
    with pytest.raises(ConfigError) as e:
        config_from_hf(raw)
    assert e.value.field == "hf_config" and needle in e.value.message


@pytest.mark.slow
def test_reference_model_checks_modern_switches_exactly():
    # the reference model against the formulas (parameters by component, fvcore and
    # FlopCounterMode forward, training and decode) on a handful of small modern configs
    from reference_model.verify import run_checks

    cases = [
        from_name("debug-moe"),
        from_name("debug-moe", q_lora_rank=None),
        from_name("debug", arch="gemma3", sliding_window=5, attn_pattern="LLG", n_kv_head=1),
        from_name("debug", arch="olmo2"),
        from_name("debug", arch="gpt_oss", n_expert=4, sliding_window=4, attn_pattern="LG"),
        from_name("debug", pos_embedding="alibi", embd_norm=True),
        from_name("debug", mlp="relu", pos_offset=2, embd_proj_dim=16),
        from_name("debug", qk_norm="per_head", parallel_residual=True, shared_norm=True),
        from_name("debug", arch="qwen3_moe", n_expert=4, moe_ffn_dim=8, n_shared_expert=1,
                  shared_ffn_dim=24, shared_expert_gate=True, moe_step=2, moe_dense_layers="1"),
    ]
    for cfg in cases:
        for attn in ("manual",) if cfg.attn_sinks else ("manual", "sdpa"):
            checks = run_checks(cfg, Workload(2, 12), "cpu", attn, "real")
            bad = [(c.name, c.analytic, c.measured) for c in checks if not c.ok]
            assert not bad, (cfg, attn, bad)
