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
# config.json of Qwen/Qwen3-Next-80B-A3B-Instruct as the Hugging Face Hub publishes it,
# transcribed (its model card: 80B parameters, 3B activated; 48 layers, 3 Gated DeltaNet to 1
# gated attention, 512 experts of which 10 routed and 1 shared)
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


# --- the cache of each layer kind, as vLLM pages it ------------------------------------------


from gptcalc.inference.kv import (hybrid_block_size, hybrid_groups,  # noqa: E402
                                  kv_bytes_per_token_layer, state_bytes_per_layer,
                                  state_elements_per_layer)
from gptcalc.inference.pool import kv_pool  # noqa: E402
from tests.test_serve import run, serve_json  # noqa: E402

GiB = 2**30




def test_qwen3_next_state_per_layer_as_vllm_shapes_it():
    """vLLM's `gated_delta_net_state_shape` (vllm/model_executor/layers/mamba/mamba_utils.py,
    vllm-project/vllm@02d71083) for Qwen3-Next-80B (16 key heads of 128, 32 value heads of 128,
    conv 4), by hand: conv (4 - 1) x (2 x 16 x 128 + 32 x 128) / tp, recurrent
    32 / tp x 128 x 128."""
    cfg = config_from_hf(QWEN3_NEXT_80B)
    assert state_elements_per_layer(cfg, 1) == {"conv": 3 * 8192, "ssm": 32 * 128 * 128}
    assert state_elements_per_layer(cfg, 4) == {"conv": 3 * 2048, "ssm": 8 * 128 * 128}
    assert state_bytes_per_layer(cfg, 4, 2) == (6144 + 131072) * 2


def test_mamba2_groups_are_replicated_up_to_tp():
    """vLLM's `extra_groups_for_head_shards`: one group of B and C at tp 4 is held as 4, so the
    conv state covers d_inner + 2 x 4 x N channels, a quarter on each GPU."""
    raw = dict(model_type="granitemoehybrid", hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=96, vocab_size=128, mamba_n_heads=8,
               mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
               layer_types=["mamba", "attention"])
    cfg = config_from_hf(raw)  # d_inner = 2 x 64 = 128, head_dim 16
    assert state_elements_per_layer(cfg, 1) == {"conv": 3 * (128 + 2 * 16), "ssm": 8 * 16 * 16}
    assert state_elements_per_layer(cfg, 4) == {"conv": 3 * (128 + 2 * 4 * 16) // 4,
                                                "ssm": 2 * 16 * 16}


def test_jamba_state_is_mamba1s():
    """vLLM's `mamba1_state_shape`: conv (K - 1) x d_inner, ssm d_inner x N."""
    cfg = config_from_hf(dict(model_type="jamba", hidden_size=64, num_hidden_layers=8,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, vocab_size=128))
    assert state_elements_per_layer(cfg, 2) == {"conv": 3 * 64, "ssm": 64 * 16}


def _qwen3_next_small(**change) -> dict:
    return dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, vocab_size=128, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, num_experts=0, max_position_embeddings=4096) | change


def test_the_attention_block_is_raised_to_hold_one_state_page_on_both_sides():
    """vLLM's rule (vllm/model_executor/models/config.py, `HybridAttentionMambaModelConfig`,
    vllm-project/vllm@0144dd5b): needed = 16 x ceil(state page / (16 x KV bytes per
    token-layer)); a --block-size below it is raised, one at or above it is kept."""
    cfg = config_from_hf(_qwen3_next_small())
    token = kv_bytes_per_token_layer(cfg, 1, "bf16")  # 2 x 2 heads x 16 x 2 bytes = 128
    state = state_bytes_per_layer(cfg, 1, 2)  # conv 3 x 64, ssm 4 x 8 x 8: 448 values, 896 bytes
    assert (token, state) == (128, 896)
    needed = 16  # 896 bytes fit in one page of 16 tokens x 128 bytes (2,048)
    assert hybrid_block_size(cfg, None, 1, "bf16", 2) == needed
    assert hybrid_block_size(cfg, needed - 1, 1, "bf16", 2) == needed
    assert hybrid_block_size(cfg, needed, 1, "bf16", 2) == needed
    assert hybrid_block_size(cfg, needed + 1, 1, "bf16", 2) == needed + 1


@pytest.mark.parametrize("kernel, state, needed", [(13, 2048, 16), (14, 2176, 32)])
def test_a_state_page_just_over_one_attention_page_takes_16_tokens_more(kernel, state, needed):
    """The ceiling's boundary: with 128 bytes of KV a token, a state page of exactly 16 tokens'
    KV (2,048 bytes) needs a block of 16; 128 bytes more need 32. The state, by hand: conv
    (K - 1) x (2 x 2 x 8 + 4 x 8) values and 4 x 8 x 8 recurrent, 2 bytes each."""
    cfg = config_from_hf(_qwen3_next_small(linear_conv_kernel_dim=kernel))
    assert kv_bytes_per_token_layer(cfg, 1, "bf16") == 128
    assert state_bytes_per_layer(cfg, 1, 2) == 2 * ((kernel - 1) * 64 + 256) == state
    assert hybrid_block_size(cfg, None, 1, "bf16", 2) == needed


@pytest.mark.parametrize("attention, state, expected", [
    (12, 36, (12, 1, 3)),   # Qwen3-Next: 1 : 3, the fewer as the group size
    (12, 17, (17, 1, 1)),   # 17 < 1.5 x 12: the more, the attention group padded
    (12, 18, (12, 1, 2)),   # 18 is not below 1.5 x 12: the fewer again
    (4, 28, (4, 1, 7)),     # Jamba: 1 attention block in 8
    (32, 32, (32, 1, 1)),   # Falcon-H1: attention and Mamba in every block
])
def test_kv_cache_groups_on_both_sides_of_the_one_and_a_half_rule(attention, state, expected):
    """vLLM's `_get_kv_cache_groups_uniform_page_size` (vllm/v1/core/kv_cache_utils.py,
    vllm-project/vllm@001cabc1): `if max_num_layers < min_num_layers * 1.5`."""
    assert hybrid_groups(attention, state) == expected


def test_the_pool_blocks_and_concurrency_of_qwen3_next_at_tp_4():
    """The pool in blocks of 12 layers' pages (272 tokens x 1,024 bytes each: one KV head a GPU
    at tp 4, 2 x 256 x 2 bytes), and a request of C tokens takes ceil(C / 272) blocks in the
    attention group and one in each of the 3 state groups."""
    out = serve_json("--hf-config", str(QWEN3_NEXT_80B), "--tp", "4", "--max-model-len",
                     "32768")
    page = 272 * 1024
    assert (out["block_size"], out["group_size"], out["attention_groups"],
            out["state_groups"]) == (272, 12, 1, 3)
    assert out["state_page"] == (6144 + 131072) * 2 <= page
    assert out["kv_blocks"] == out["kv_cache"] // (12 * page)
    assert out["max_concurrency"]["32768"] == pytest.approx(out["kv_blocks"] / (121 + 3))


def test_concurrency_is_bounded_by_the_state_slots():
    """Short requests: each still takes one whole block in every state group, so the pool holds
    at most blocks / (attention groups + state groups) of them however short."""
    cfg = config_from_hf(_qwen3_next_small())
    pool = kv_pool(cfg, 80 * GiB, max_model_len=4096)
    assert pool.max_concurrency(cfg, 1) == pool.kv_blocks / (pool.attention_groups
                                                             + pool.state_groups)


def test_hybrid_pools_start_at_vllm_0_10():
    ok = run("serve", "--hf-config", str(QWEN3_NEXT_80B), "--tp", "4", "--engine-version",
             "0.10.0")
    assert ok.exit_code == 0, ok.output
    old = run("serve", "--hf-config", str(QWEN3_NEXT_80B), "--tp", "4", "--engine-version",
              "0.9.2")
    assert old.exit_code == 2 and "--engine-version" in old.output and "V0" in old.output
    sglang = run("serve", "--hf-config", str(QWEN3_NEXT_80B), "--engine", "sglang")
    assert sglang.exit_code == 2 and "--engine" in sglang.output
    lora = run("serve", "--hf-config", str(QWEN3_NEXT_80B), "--tp", "4", "--enable-lora")
    assert lora.exit_code == 2 and "--enable-lora" in lora.output


@pytest.mark.parametrize("command", ["memory", "flops", "time", "plan", "infer", "report",
                                     "verify"])
def test_other_commands_refuse_hybrid_models_in_one_line(command):
    r = run(command, "--hf-config", str(QWEN3_NEXT_80B))
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--hf-config" in lines[0] and "Gated DeltaNet" in lines[0]
    assert f"`{command}`" in lines[0]


def test_refusal_names_mamba_layers_and_the_set_option():
    r = run("flops", "--preset", "llama3-8b", "--set", "layer_mixers=MMMA")
    assert r.exit_code == 2 and "--set" in r.output and "Mamba2 layers" in r.output


def test_params_and_serve_read_hybrid_models():
    assert run("params", "--hf-config", str(QWEN3_NEXT_80B)).exit_code == 0
    assert run("serve", "--hf-config", str(QWEN3_NEXT_80B), "--tp", "4").exit_code == 0


def test_block_size_matches_a_published_vllm_log_of_a_gated_deltanet_model():
    """A vLLM log of Qwen3.8-27B-FP8 at tp 2 with an fp8 KV cache runs blocks of 1,568 tokens
    (mitchross/talos-argocd-proxmox pull 1995: "ceil(262144/1568) = 168 blocks"). Its sizes, as
    that deployment states them: 64 blocks, every fourth attention with 4 KV heads of 256;
    Gated DeltaNet with 16 key and 48 value heads of 128, conv 4; mamba_ssm_dtype float32. The
    DeltaNet and attention layers are Qwen3-Next's, so its config is read as one. At tp 2:
    conv 3 x 5,120 bf16 values, recurrent 24 x 128 x 128 fp32 values = 1,603,584 bytes; KV
    1,024 bytes a token: 16 x ceil(1,603,584 / 16,384) = 1,568."""
    cfg = config_from_hf(dict(
        model_type="qwen3_next", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=248320,
        num_experts=0, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4))
    assert state_bytes_per_layer(cfg, 2, 2, 4) == 1_603_584
    assert hybrid_block_size(cfg, None, 2, "fp8", 2, 4) == 1568
    out = serve_json("--hf-config", str(QWEN3_NEXT_80B), "--tp", "4",
                     "--mamba-ssm-cache-dtype", "float32")
    assert out["state_page"] == 6144 * 2 + 131072 * 4


@pytest.mark.parametrize("pp, groups", [(1, (12, 1, 3)), (2, (6, 1, 3)), (3, (4, 1, 3))])
def test_pipeline_stages_split_the_hybrid_weights_and_groups(pp, groups):
    """vLLM's even split of 48 blocks (`weights.pp_partition`): each stage's weights sum to the
    whole model's a GPU, and each stage groups its own 1 : 3 attention and DeltaNet layers."""
    from gptcalc.inference.pool import kv_pool

    cfg = config_from_hf(QWEN3_NEXT_80B)
    whole = kv_pool(cfg, 80 * GiB, tp=4, max_model_len=8192).weights
    pool = kv_pool(cfg, 80 * GiB, tp=4, pp=pp, max_model_len=8192)
    assert sum(s["weights"] for s in pool.stages or [{"weights": pool.weights}]) == whole
    assert (pool.group_size, pool.attention_groups, pool.state_groups) == groups


def test_a_granite_hybrid_with_a_trillion_layers_is_read_in_constant_memory(tmp_path):
    """Without layer_types every GraniteMoeHybrid block is Mamba2: the pattern is its period,
    never a letter per block (a fuzzed file with 10^12 layers raised MemoryError)."""
    from click.testing import CliRunner

    from gptcalc.cli import cli

    raw = {"model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 10**12,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
           "vocab_size": 1000, "max_position_embeddings": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert config_from_hf(raw).layer_mixers == "M"
    r = CliRunner().invoke(cli, ["flops", "--hf-config", str(path), "--causal", "--json"])
    assert r.exit_code == 2 and "--hf-config" in r.output and "Traceback" not in r.output
