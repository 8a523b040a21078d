"""The Hugging Face families `gptcalc.hf` reads: per family, transformers' defaults for fields a
config.json leaves out, and the function that maps its fields onto GPTConfig switches.

Defaults are those of transformers' configuration classes (transformers/models/<family>/
configuration_<family>.py, v5.23) and what the modelling code (modeling_<family>.py) hard-codes.
Sizes (width, depth, heads, vocabulary, MLP width) have no default here: a config.json without
them is truncated, except where the table lists one (the multimodal Gemma 3 configs leave the
text model's vocabulary to Gemma3TextConfig's default).
"""

from __future__ import annotations

from typing import Any, Callable

# --- field spellings -----------------------------------------------------------------------------
HIDDEN = ("hidden_size", "n_embd", "d_model", "n_embed")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads")
POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
# wpe is n_positions long; GPT2Config keeps n_ctx but never reads it (absent: 1024)
GPT2_POSITIONS = ("n_positions", "max_position_embeddings")
VOCAB = ("vocab_size", "n_vocab")
INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
ROTARY_PCT = ("rotary_pct", "partial_rotary_factor")

# transformers' ACT2FN names, onto gptcalc's MLP kinds: plain, and gated (gate_proj, up, down)
GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu",
         "gelu_new": "geglu", "gelu_tanh": "geglu"}

# Fields that mean structure (experts, latent attention, q/k norms, OPT's projections): present
# with a value that is not None / false / 0 / [] in a family that does not read them, they are
# an error, so that e.g. a Mixtral config relabelled "llama" cannot silently lose its experts.
STRUCTURE_FIELDS = (
    "num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
    "n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace",
    "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "qk_layernorm", "use_qk_norm", "word_embed_proj_dim",
    "new_decoder_architecture", "use_sliding_window", "mlp_only_layers",
)

# transformers' attribute_map of each family's configuration class (alias -> attribute): a
# config.json may spell the field either way, and save_pretrained writes the attribute's name
# (Qwen3-MoE's num_local_experts). Read as one field; the two spellings must agree.
ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {
    "gpt2": dict(hidden_size="n_embd", max_position_embeddings="n_positions",
                 num_attention_heads="n_head", num_hidden_layers="n_layer"),
    "gpt_bigcode": dict(hidden_size="n_embd", max_position_embeddings="n_positions",
                        num_attention_heads="n_head", num_hidden_layers="n_layer"),
    "mixtral": dict(num_experts="num_local_experts"),
    "qwen3_moe": dict(num_experts="num_local_experts"),
    "deepseek_v2": dict(num_experts="n_routed_experts"),
    "deepseek_v3": dict(num_local_experts="n_routed_experts",
                        num_mtp_layers="num_nextn_predict_layers"),
    "gpt_oss": dict(num_experts="num_local_experts"),
    "bloom": dict(num_hidden_layers="n_layer", num_attention_heads="n_head"),
}


def spellings(model_type: str, name: str) -> tuple[str, ...]:
    """`name` and its aliases in the family's attribute_map (either direction)."""
    amap = ATTRIBUTE_MAPS.get(model_type, {})
    return (name,) + tuple(dict.fromkeys([a for a, t in amap.items() if t == name]
                                         + [t for a, t in amap.items() if a == name]))


# transformers' defaults for the fields each family reads (configuration_<family>.py)
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_positions=1024, activation_function="gelu_new", tie_word_embeddings=True),
    "gpt_neox": dict(max_position_embeddings=2048, hidden_act="gelu", attention_bias=True,
                     rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
    "llama": dict(max_position_embeddings=2048, hidden_act="silu", attention_bias=False,
                  mlp_bias=False, tie_word_embeddings=False),
    "granite": dict(max_position_embeddings=2048, hidden_act="silu", attention_bias=False,
                    mlp_bias=False, tie_word_embeddings=False),
    "mistral": dict(max_position_embeddings=131072, hidden_act="silu", num_key_value_heads=8,
                    sliding_window=4096, tie_word_embeddings=False),
    "mixtral": dict(max_position_embeddings=131072, hidden_act="silu", num_key_value_heads=8,
                    sliding_window=None, tie_word_embeddings=False, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen2": dict(max_position_embeddings=32768, hidden_act="silu", num_key_value_heads=32,
                  use_sliding_window=False, max_window_layers=28, tie_word_embeddings=False),
    "qwen3": dict(max_position_embeddings=32768, hidden_act="silu", num_key_value_heads=32,
                  head_dim=128, attention_bias=False, use_sliding_window=False,
                  max_window_layers=28, tie_word_embeddings=False),
    "qwen3_moe": dict(max_position_embeddings=32768, hidden_act="silu", num_key_value_heads=4,
                      attention_bias=False, use_sliding_window=False, tie_word_embeddings=False,
                      decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                      num_experts=128),
    "qwen2_moe": dict(max_position_embeddings=32768, hidden_act="silu", num_key_value_heads=16,
                      use_sliding_window=False, tie_word_embeddings=False, qkv_bias=True,
                      decoder_sparse_step=1, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, num_experts_per_tok=4,
                      num_experts=60),
    "deepseek_v3": dict(max_position_embeddings=4096, hidden_act="silu", attention_bias=False,
                        tie_word_embeddings=False, moe_intermediate_size=2048,
                        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                        first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        n_group=8, topk_group=4, norm_topk_prob=True),
    "deepseek_v2": dict(max_position_embeddings=2048, hidden_act="silu", attention_bias=False,
                        mlp_bias=False, tie_word_embeddings=False, moe_intermediate_size=1407,
                        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=None,
                        first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        n_group=None, topk_group=None, topk_method="greedy",
                        norm_topk_prob=False, moe_layer_freq=1),
    "gemma": dict(max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh",
                  num_key_value_heads=16, head_dim=256, attention_bias=False,
                  tie_word_embeddings=True),
    "gemma2": dict(max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh",
                   num_key_value_heads=4, head_dim=256, attention_bias=False,
                   sliding_window=4096, tie_word_embeddings=True,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
                        num_key_value_heads=4, head_dim=256, attention_bias=False,
                        sliding_window=4096, sliding_window_pattern=6,
                        tie_word_embeddings=True, vocab_size=262208),
    "phi": dict(max_position_embeddings=2048, hidden_act="gelu_new", partial_rotary_factor=0.5,
                qk_layernorm=False, tie_word_embeddings=False),
    "phi3": dict(max_position_embeddings=4096, hidden_act="silu", partial_rotary_factor=1.0,
                 sliding_window=None, tie_word_embeddings=False),
    "olmo2": dict(max_position_embeddings=2048, hidden_act="silu", attention_bias=False,
                  tie_word_embeddings=False),
    "starcoder2": dict(max_position_embeddings=4096, hidden_act="gelu_pytorch_tanh",
                       num_key_value_heads=2, use_bias=True, sliding_window=None,
                       tie_word_embeddings=True),
    "gpt_bigcode": dict(n_positions=1024, activation_function="gelu_pytorch_tanh",
                        multi_query=True, tie_word_embeddings=True),
    "gpt_oss": dict(max_position_embeddings=131072, hidden_act="silu", num_key_value_heads=8,
                    head_dim=64, sliding_window=128, attention_bias=True,
                    tie_word_embeddings=False, num_local_experts=128, num_experts_per_tok=4),
    "falcon": dict(max_position_embeddings=2048, activation="gelu", bias=False, alibi=False,
                   multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                   tie_word_embeddings=True),
    "opt": dict(max_position_embeddings=2048, activation_function="relu",
                do_layer_norm_before=True, _remove_final_layer_norm=False, enable_bias=True,
                layer_norm_elementwise_affine=True, tie_word_embeddings=True),
    "bloom": dict(tie_word_embeddings=True),
    "stablelm": dict(max_position_embeddings=4096, hidden_act="silu", num_key_value_heads=32,
                     partial_rotary_factor=0.25, use_qkv_bias=False, qk_layernorm=False,
                     use_parallel_residual=False, tie_word_embeddings=False),
    "cohere": dict(max_position_embeddings=8192, hidden_act="silu", attention_bias=False,
                   use_qk_norm=False, tie_word_embeddings=True),
}

# the switches every Llama-shaped family starts from (q_proj/k_proj/v_proj/o_proj,
# gate/up/down, RMSNorm, rotary, untied unless the config says so)
LLAMA_SHAPED = dict(qkv_layout="separate", qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    norm="rmsnorm", pos_embedding="rotary", embd_dropout=False)


def llama_shaped(r, *, mlp_act: str = "hidden_act", head_dim: bool = True) -> dict[str, Any]:
    """The fields of a Llama-shaped config: MLP width, kv heads, head_dim, gated activation."""
    E, H = r.size(HIDDEN), r.size(HEADS)
    hd = r.int(("head_dim",)) if head_dim else None
    return dict(
        LLAMA_SHAPED,
        block_size=r.int(POSITIONS),
        d_ff=r.int(INTERMEDIATE, required=True),
        n_kv_head=r.int(KV_HEADS),  # absent and no default: H (multi-head)
        # transformers: head_dim, or hidden_size // num_attention_heads
        head_dim=None if hd is None or hd * H == E else hd,
        mlp=r.choice(mlp_act, GATED),
        dropout=r.dropout(("attention_dropout",), 0.0),
        tie_embeddings=r.bool("tie_word_embeddings"),
    )


def sliding_all(r) -> dict[str, Any]:
    """Mistral, Mixtral, Phi-3, StarCoder2: sliding_window (null: none) on every block."""
    return dict(sliding_window=r.int(("sliding_window",)), attn_pattern="")


def sliding_from_layer_types(r, default_period: int | None) -> dict[str, Any]:
    """Gemma 2/3, gpt-oss: `layer_types`, or the family's default pattern, where block i is
    sliding unless (i + 1) % period == 0 (Gemma 3: sliding_window_pattern, 6)."""
    window = r.int(("sliding_window",))
    types = r.layer_types()
    if types is not None:
        return dict(sliding_window=window if "L" in types else None, attn_pattern=types)
    if window is None or default_period is None:
        return dict(sliding_window=None, attn_pattern="")
    period = r.int(("sliding_window_pattern",), default=default_period)
    return dict(sliding_window=window, attn_pattern="L" * (period - 1) + "G")


def sliding_qwen(r) -> dict[str, Any]:
    """Qwen2/Qwen3: with use_sliding_window, blocks from max_window_layers on slide."""
    types = r.layer_types()
    window = r.int(("sliding_window",)) if r.bool("use_sliding_window") else None
    if types is not None:
        return dict(sliding_window=window if "L" in types else None, attn_pattern=types)
    if window is None:
        return dict(sliding_window=None, attn_pattern="")
    L, first = r.size(LAYERS), r.int(("max_window_layers",), default=28)
    pattern = "G" * min(first, L) + "L" * max(0, L - first)
    return dict(sliding_window=window if "L" in pattern else None, attn_pattern=pattern)


def moe_qwen(r) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE: num_experts, top-k, decoder_sparse_step, mlp_only_layers."""
    return dict(n_expert=r.int(("num_experts",), allow_zero=True),
                n_expert_active=r.int(("num_experts_per_tok",)),
                moe_ffn_dim=r.int(("moe_intermediate_size",)),
                moe_step=r.int(("decoder_sparse_step",)),
                moe_dense_layers=r.layer_list("mlp_only_layers"),
                router_norm_topk=r.bool("norm_topk_prob", default=False))


def _gpt2(r) -> dict[str, Any]:
    if r.bool("add_cross_attention", False):
        raise r.fail("add_cross_attention is true: an encoder-decoder block, not a decoder-only "
                     "GPT")
    return dict(  # GPT2Config: n_inner None = 4 * n_embd; dropouts 0.1
        block_size=r.int(GPT2_POSITIONS), d_ff=r.int(("n_inner",)),
        mlp=r.choice("activation_function", GELU),
        dropout=r.dropout(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.1),
        qkv_layout="fused", qkv_bias=True, attn_out_bias=True, mlp_bias=True, norm="layernorm",
        pos_embedding="learned", embd_dropout=True, tie_embeddings=r.bool("tie_word_embeddings"))


def _gpt_bigcode(r) -> dict[str, Any]:
    # GPTBigCodeAttention: c_attn E -> E + 2 head_dim under multi_query (one k/v head)
    out = _gpt2(r)
    out["n_kv_head"] = 1 if r.bool("multi_query") else None
    return out


def _gpt_neox(r) -> dict[str, Any]:
    bias = r.bool("attention_bias")  # fused query_key_value and dense; the MLP always biased
    return dict(
        block_size=r.int(POSITIONS), d_ff=r.int(INTERMEDIATE, required=True),
        mlp=r.choice("hidden_act", GELU),
        dropout=r.dropout(("hidden_dropout", "attention_dropout"), 0.0),
        rotary_pct=r.float(ROTARY_PCT), parallel_residual=r.bool("use_parallel_residual"),
        qkv_layout="fused", qkv_bias=bias, attn_out_bias=bias, mlp_bias=True, norm="layernorm",
        pos_embedding="rotary", embd_dropout=True, tie_embeddings=r.bool("tie_word_embeddings"))


def _llama(r) -> dict[str, Any]:  # Llama 1-3; Granite's multipliers change no count
    bias = r.bool("attention_bias")  # q, k, v and o_proj
    return llama_shaped(r) | dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=r.bool("mlp_bias"))


def _mistral(r) -> dict[str, Any]:  # bias=False hard-coded everywhere
    return llama_shaped(r) | sliding_all(r)


def _mixtral(r) -> dict[str, Any]:  # every MLP a mixture of SwiGLU experts, router without bias
    return llama_shaped(r) | sliding_all(r) | dict(
        n_expert=r.int(("num_local_experts",)), n_expert_active=r.int(("num_experts_per_tok",)),
        router_norm_topk=True)  # MixtralTopKRouter always renormalises the top-k weights


def _qwen2(r) -> dict[str, Any]:  # q/k/v biased, o_proj not (hard-coded in Qwen2Attention)
    return llama_shaped(r) | sliding_qwen(r) | dict(qkv_bias=True)


def _qwen3(r) -> dict[str, Any]:  # q_norm/k_norm: RMSNorm(head_dim)
    bias = r.bool("attention_bias")
    return llama_shaped(r) | sliding_qwen(r) | dict(qkv_bias=bias, attn_out_bias=bias,
                                                    qk_norm="head")


def _qwen3_moe(r) -> dict[str, Any]:
    return _qwen3(r) | moe_qwen(r)


def _qwen2_moe(r) -> dict[str, Any]:  # plus one shared expert with a sigmoid gate Linear(E, 1)
    shared = r.int(("shared_expert_intermediate_size",), allow_zero=True)
    return llama_shaped(r) | sliding_qwen(r) | moe_qwen(r) | dict(
        qkv_bias=r.bool("qkv_bias"), n_shared_expert=1 if shared else 0,
        shared_ffn_dim=shared or None, shared_expert_gate=bool(shared))


def _deepseek_v3(r) -> dict[str, Any]:
    """MLA and MoE. The router's e_score_correction_bias is a buffer, not a parameter; the
    multi-token-prediction layers (num_nextn_predict_layers) are not built by transformers."""
    E, H = r.size(HIDDEN), r.size(HEADS)
    bias = r.bool("attention_bias")  # q_a_proj, kv_a_proj_with_mqa, o_proj
    v = r.int(("v_head_dim",))
    return llama_shaped(r, head_dim=False) | dict(
        n_kv_head=None, head_dim=None if E % H == 0 else v, qkv_bias=bias, attn_out_bias=bias,
        kv_lora_rank=r.int(("kv_lora_rank",)), q_lora_rank=r.int(("q_lora_rank",)),
        qk_nope_head_dim=r.int(("qk_nope_head_dim",)),
        qk_rope_head_dim=r.int(("qk_rope_head_dim",)), v_head_dim=v,
        n_expert=r.int(("n_routed_experts",), allow_zero=True),
        n_expert_active=r.int(("num_experts_per_tok",)),
        n_shared_expert=r.int(("n_shared_experts",), allow_zero=True),
        moe_ffn_dim=r.int(("moe_intermediate_size",)),
        moe_first_dense=r.int(("first_k_dense_replace",), allow_zero=True),
        router_norm_topk=r.bool("norm_topk_prob"), router_groups=r.int(("n_group",)),
        router_topk_groups=r.int(("topk_group",)))


def _deepseek_v2(r) -> dict[str, Any]:
    """V3's MLA and MoE (q_lora_rank null: one q_proj, DeepSeek-V2-Lite), with a softmax router
    and no e_score_correction_bias; the dense and shared MLPs take mlp_bias. topk_method
    "greedy" routes over all experts, "group_limited_greedy" within the best topk_group of
    n_group groups (transformers' DeepseekV2TopkRouter knows no other). transformers makes
    every block from first_k_dense_replace on MoE, so moe_layer_freq other than 1 (which
    DeepSeek's own code reads) is refused rather than counted two ways."""
    if r.int(("moe_layer_freq",)) not in (None, 1):
        raise r.fail(f"moe_layer_freq {r.raw['moe_layer_freq']!r} is not supported "
                     f"(transformers makes every block from first_k_dense_replace on MoE)")
    method = r.choice("topk_method", {m: m for m in ("greedy", "group_limited_greedy")})
    grouped = method == "group_limited_greedy"
    out = _deepseek_v3(r) | dict(
        mlp_bias=r.bool("mlp_bias"),
        n_expert=r.int(("n_routed_experts",), required=True),
        n_expert_active=r.int(("num_experts_per_tok",), required=True),
        router_groups=r.int(("n_group",), required=grouped) if grouped else 1,
        router_topk_groups=r.int(("topk_group",), required=grouped) if grouped else 1)
    if out["n_expert_active"] is None or None in (out["router_groups"],
                                                  out["router_topk_groups"]):
        raise r.fail("num_experts_per_tok (and, for group_limited_greedy, n_group and "
                     "topk_group) must be set: transformers cannot route without them")
    if out["mlp_bias"] and not out["n_shared_expert"]:  # transformers: Linear(0, E) + bias
        raise r.fail("mlp_bias with n_shared_experts 0 is not supported (transformers builds an "
                     "empty shared MLP whose down_proj keeps its bias)")
    return out


def _gemma(r) -> dict[str, Any]:  # GeGLU, tied; embeddings scaled by sqrt(E) (no count)
    bias = r.bool("attention_bias")
    # Gemma 2/3 name it hidden_activation, Gemma 1 hidden_act (either may be in the file)
    act = next((n for n in ("hidden_activation", "hidden_act") if r.has(n)),
               "hidden_activation" if "hidden_activation" in r.defaults else "hidden_act")
    return llama_shaped(r, mlp_act=act) | dict(qkv_bias=bias, attn_out_bias=bias)


def softcaps(r, attention: bool = True) -> dict[str, Any]:
    """Gemma 2/3's tanh soft-capping (a float, null: none; Gemma 2 defaults to 50 and 30).
    `attention` False: the class never applies attn_logit_softcapping (transformers' Gemma 3)."""
    on = {"attn_softcap": False}
    names = (("attn_logit_softcapping", "attn_softcap"),) if attention else ()
    for name, key in names + (("final_logit_softcapping", "logit_softcap"),):
        r.read.add(name)
        value = r.raw[name] if name in r.raw else r.defaults.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            raise r.fail(f"{name} must be a positive number or null, got {value!r}")
        on[key] = value is not None
    return on


def _gemma2(r) -> dict[str, Any]:  # + post-attention / post-feedforward norms, local/global
    return _gemma(r) | sliding_from_layer_types(r, 2) | dict(post_norm=True) | softcaps(r)


def _gemma3_text(r) -> dict[str, Any]:  # + q/k RMSNorm(head_dim), 5 local : 1 global
    # transformers' Gemma3Attention does not pass attn_logit_softcapping on: never applied
    return (_gemma(r) | sliding_from_layer_types(r, 6) | dict(post_norm=True, qk_norm="head")
            | softcaps(r, attention=False))


def _gpt_oss(r) -> dict[str, Any]:
    """Biased attention with one sink per head; every MLP a mixture of experts with a biased
    router and biased experts (gate_up_proj, down_proj and their biases)."""
    bias = r.bool("attention_bias")
    return llama_shaped(r) | sliding_from_layer_types(r, 2) | dict(
        qkv_bias=bias, attn_out_bias=bias, attn_sinks=True,
        n_expert=r.int(("num_local_experts",)), n_expert_active=r.int(("num_experts_per_tok",)),
        router_bias=True, expert_bias=True)


def _phi(r) -> dict[str, Any]:
    """Phi-1/2: biased q/k/v/dense, fc1/fc2 with bias, one LayerNorm shared by the parallel
    attention and MLP, partial rotary, lm_head with a bias."""
    if r.bool("qk_layernorm"):
        raise r.fail("qk_layernorm true (LayerNorms with bias over each head) is not supported")
    return llama_shaped(r) | dict(
        mlp=r.choice("hidden_act", GELU), qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        norm="layernorm", parallel_residual=True, shared_norm=True, lm_head_bias=True,
        rotary_pct=r.float(ROTARY_PCT),
        dropout=r.dropout(("resid_pdrop", "embd_pdrop", "attention_dropout"), 0.0))


def _phi3(r) -> dict[str, Any]:  # fused qkv_proj and gate_up_proj (same counts as separate)
    return llama_shaped(r) | sliding_all(r) | dict(qkv_layout="fused",
                                                   rotary_pct=r.float(ROTARY_PCT))


def _olmo2(r) -> dict[str, Any]:  # norms after each branch only; q/k RMSNorm over projections
    bias = r.bool("attention_bias")
    return llama_shaped(r) | dict(qkv_bias=bias, attn_out_bias=bias, pre_norm=False,
                                  post_norm=True, qk_norm="proj")


def _starcoder2(r) -> dict[str, Any]:  # biases (use_bias), LayerNorm, c_fc/c_proj GELU
    bias = r.bool("use_bias")
    return llama_shaped(r) | sliding_all(r) | dict(
        qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias, mlp=r.choice("hidden_act", GELU),
        norm="layernorm")


def _stablelm(r) -> dict[str, Any]:
    parallel = r.bool("use_parallel_residual")  # then post_attention_layernorm is None
    return llama_shaped(r) | dict(
        qkv_bias=r.bool("use_qkv_bias"), norm="layernorm", rotary_pct=r.float(ROTARY_PCT),
        qk_norm="per_head" if r.bool("qk_layernorm") else "none",
        parallel_residual=parallel, shared_norm=parallel,
        dropout=r.dropout(("hidden_dropout", "attention_dropout"), 0.0))


def _cohere(r) -> dict[str, Any]:  # one bias-free LayerNorm, parallel block; logit_scale
    bias = r.bool("attention_bias")
    return llama_shaped(r) | dict(
        qkv_bias=bias, attn_out_bias=bias, norm="layernorm_nobias", parallel_residual=True,
        shared_norm=True, qk_norm="per_head" if r.bool("use_qk_norm") else "none")


def _falcon(r) -> dict[str, Any]:
    """Fused query_key_value: new_decoder_architecture (num_kv_heads groups, ln_attn and ln_mlp),
    multi_query (one k/v head) or multi-head; parallel_attn; `bias` on every Linear."""
    new, bias = r.bool("new_decoder_architecture"), r.bool("bias")
    parallel = r.bool("parallel_attn")
    kv = r.int(("num_kv_heads",)) if new else (1 if r.bool("multi_query") else None)
    two_norms = new and r.int(("num_ln_in_parallel_attn",), default=2) == 2
    return dict(
        block_size=r.int(POSITIONS), d_ff=r.int(("ffn_hidden_size",)), n_kv_head=kv,
        mlp=r.choice("activation", GELU), qkv_layout="fused", qkv_bias=bias,
        attn_out_bias=bias, mlp_bias=bias, norm="layernorm",
        pos_embedding="alibi" if r.bool("alibi") else "rotary",
        parallel_residual=parallel or new, shared_norm=(parallel or new) and not two_norms,
        dropout=r.dropout(("hidden_dropout", "attention_dropout"), 0.0), embd_dropout=False,
        tie_embeddings=r.bool("tie_word_embeddings"))


def _opt(r) -> dict[str, Any]:
    """Learned positions with 2 extra rows, optional project_in/out (word_embed_proj_dim),
    q/k/v/out_proj and fc1/fc2 biased by enable_bias; no final LayerNorm when the norms come
    after the blocks (do_layer_norm_before false, OPT-350m: same count per block)."""
    if not r.bool("layer_norm_elementwise_affine"):
        raise r.fail("layer_norm_elementwise_affine false (norms without weights) is not supported")
    bias, pre = r.bool("enable_bias"), r.bool("do_layer_norm_before")
    E, P = r.size(HIDDEN), r.int(("word_embed_proj_dim",))
    return dict(
        block_size=r.int(POSITIONS), d_ff=r.int(("ffn_dim",), required=True), pos_offset=2,
        embd_proj_dim=None if P in (None, E) else P, mlp=r.choice("activation_function", GELU),
        qkv_layout="separate", qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias,
        norm="layernorm", pos_embedding="learned",
        final_norm=pre and not r.bool("_remove_final_layer_norm"),
        dropout=r.dropout(("dropout", "attention_dropout"), 0.1), embd_dropout=True,
        tie_embeddings=r.bool("tie_word_embeddings"))


def _bloom(r) -> dict[str, Any]:  # ALiBi, word_embeddings_layernorm, fused biased qkv, 4E GELU
    return dict(
        block_size=r.int(("seq_length",), default=2048), qkv_layout="fused", qkv_bias=True,
        attn_out_bias=True, mlp_bias=True,
        norm="layernorm", mlp="gelu_tanh", pos_embedding="alibi", embd_norm=True,
        dropout=r.dropout(("hidden_dropout", "attention_dropout"), 0.0), embd_dropout=False,
        tie_embeddings=r.bool("tie_word_embeddings"))


FAMILIES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "gpt2": _gpt2, "gpt_bigcode": _gpt_bigcode, "gpt_neox": _gpt_neox, "llama": _llama,
    "granite": _llama, "mistral": _mistral, "mixtral": _mixtral, "qwen2": _qwen2,
    "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe,
    "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "gemma": _gemma, "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gpt_oss": _gpt_oss, "phi": _phi, "phi3": _phi3, "olmo2": _olmo2, "starcoder2": _starcoder2,
    "stablelm": _stablelm, "cohere": _cohere, "falcon": _falcon, "opt": _opt, "bloom": _bloom,
}
# multimodal configs whose language model is their text_config (of this model_type)
TEXT_CONFIG_TYPES = {"gemma3": "gemma3_text"}

# --- module names, as transformers builds each family and PEFT targets them ----------------------
# gptcalc's block-Linear targets (gptcalc.linears) -> the family's nn.Linear leaf names. Two
# targets of one module under one name are one fused Linear (Phi-3's gate_up_proj); one name in
# two modules is two Linears (GPT-2's c_proj: attention output and MLP down). MoE routers are
# named here though transformers 5 builds them as parameters (ROUTER_LINEAR says which are
# nn.Linear); routed experts are fused 3-D parameters (gate_up_proj, down_proj), never Linears.
_LLAMA_NAMES = dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj", gate="gate_proj",
                    up="up_proj", down="down_proj", router="gate",
                    shared_gate="shared_expert_gate")
_GPT2_NAMES = dict(qkv="c_attn", o="c_proj", up="c_fc", down="c_proj")
_NEOX_NAMES = dict(qkv="query_key_value", o="dense", up="dense_h_to_4h", down="dense_4h_to_h")
LINEAR_NAMES: dict[str, dict[str, str]] = {
    **dict.fromkeys(("llama", "granite", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                     "qwen2_moe", "gemma", "gemma2", "gemma3_text", "olmo2", "stablelm",
                     "cohere"), _LLAMA_NAMES),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3"), _LLAMA_NAMES | dict(
        q_a="q_a_proj", q_b="q_b_proj", kv_a="kv_a_proj_with_mqa", kv_b="kv_b_proj")),
    "gpt_oss": _LLAMA_NAMES | dict(router="router"),
    "gpt2": _GPT2_NAMES, "gpt_bigcode": _GPT2_NAMES,
    "gpt_neox": _NEOX_NAMES, "falcon": _NEOX_NAMES, "bloom": _NEOX_NAMES,
    "phi": dict(q="q_proj", k="k_proj", v="v_proj", o="dense", up="fc1", down="fc2"),
    "phi3": dict(qkv="qkv_proj", o="o_proj", gate="gate_up_proj", up="gate_up_proj",
                 down="down_proj"),
    "starcoder2": dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj", up="c_fc", down="c_proj"),
    "opt": dict(q="q_proj", k="k_proj", v="v_proj", o="out_proj", up="fc1", down="fc2"),
}
# PEFT's default target_modules per model_type (peft.utils.constants.
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, PEFT 0.21); absent: PEFT asks for targets
PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2",
                     "gemma3_text", "stablelm", "opt"), ("q_proj", "v_proj")),
    "gpt2": ("c_attn",), "gpt_bigcode": ("c_attn",), "gpt_neox": ("query_key_value",),
    "falcon": ("query_key_value",), "bloom": ("query_key_value",),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
}
# MoE families whose checkpoints transformers 5 converts from v4's Linear experts (its
# conversion_mapping): for them PEFT 0.21's all-linear also adapts the router's weight and the
# fused experts, as v4's Linears were ("mixtral": w1/w3 -> gate_up_proj; "qwen2_moe":
# gate_proj/up_proj -> gate_up_proj, which also takes those names off the dense and shared MLPs)
PEFT_MOE_CONVERSION = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "deepseek_v2": "qwen2_moe",
                       "deepseek_v3": "qwen2_moe"}


# --- hybrid families: Mamba / Gated DeltaNet blocks beside attention -----------------------------
# transformers' defaults (configuration_<family>.py, v5.24)
DEFAULTS.update({
    "qwen3_next": dict(max_position_embeddings=32768, hidden_act="silu", num_key_value_heads=2,
                       head_dim=256, attention_bias=False, tie_word_embeddings=False,
                       partial_rotary_factor=0.25, decoder_sparse_step=1,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                       linear_conv_kernel_dim=4, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32, full_attention_interval=4),
    "jamba": dict(max_position_embeddings=262144, hidden_act="silu", num_key_value_heads=8,
                  tie_word_embeddings=False, num_experts=16, num_experts_per_tok=2,
                  expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8,
                  attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                  mamba_conv_bias=True, mamba_proj_bias=False),
    "falcon_h1": dict(max_position_embeddings=8192, hidden_act="silu", num_key_value_heads=8,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      mamba_d_ssm=1024, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256,
                      mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
                      mamba_proj_bias=False, mamba_rms_norm=False, projectors_bias=False),
    "granitemoehybrid": dict(max_position_embeddings=2048, hidden_act="silu",
                             tie_word_embeddings=False, attention_bias=False,
                             num_local_experts=8, num_experts_per_tok=2,
                             shared_intermediate_size=1024, mamba_n_heads=128,
                             mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
                             mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False),
})
ATTRIBUTE_MAPS["granitemoehybrid"] = dict(layers_block_type="layer_types")
ATTRIBUTE_MAPS["falcon_h1"] = dict(layer_types="layers_block_type")  # every block "hybrid"
ATTRIBUTE_MAPS["jamba"] = dict(num_local_experts="num_experts")


def mixer_pattern(r, kinds: dict[str, str], default: str) -> str:
    """`layer_types` as layer_mixers letters (`kinds` maps each name), or `default` (letters
    repeated from block 0, as layer_mixers reads them) when the file has none; shortened to
    its period (MMMA)."""
    r.read.add("layer_types")
    types = r.raw.get("layer_types")
    L = r.size(LAYERS)
    if types is None:
        text = default
    else:
        if not isinstance(types, list) or any(t not in kinds for t in types):
            raise r.fail(f"layer_types must list {' / '.join(kinds)}, got {types!r}")
        if len(types) != L:
            raise r.fail(f"layer_types lists {len(types)} blocks, num_hidden_layers is {L}")
        text = "".join(kinds[t] for t in types)
    for period in range(1, len(text) + 1):  # reading a file's list, not a formula
        if (text[:period] * (len(text) // period + 1))[:len(text)] == text:
            return text[:period]
    return text


def mamba2_fields(r, inner: int) -> dict[str, Any]:
    """Mamba2's sizes (Falcon-H1, GraniteMoeHybrid): heads, groups, state, conv, biases;
    mamba_d_head ("auto": d_inner / heads) must agree with them, as transformers checks."""
    heads = r.int(("mamba_n_heads",))
    d_head = r.raw.get("mamba_d_head")
    if d_head not in (None, "auto") and (isinstance(d_head, bool) or not isinstance(d_head, int)
                                         or d_head * heads != inner):
        raise r.fail(f"mamba_d_head {d_head!r} x mamba_n_heads {heads} is not Mamba's inner "
                     f"width {inner}")
    r.read.add("mamba_d_head")
    return dict(mamba_version=2, mamba_d_inner=inner, mamba_n_heads=heads,
                mamba_n_groups=r.int(("mamba_n_groups",)), mamba_d_state=r.int(("mamba_d_state",)),
                mamba_d_conv=r.int(("mamba_d_conv",)), mamba_conv_bias=r.bool("mamba_conv_bias"),
                mamba_proj_bias=r.bool("mamba_proj_bias"))


def _qwen3_next(r) -> dict[str, Any]:
    """Qwen3-Next: Gated DeltaNet blocks (layer_types linear_attention) and gated attention
    blocks (full_attention; default every full_attention_interval-th), q/k RMSNorm(head_dim),
    partial rotary (0.25); Qwen-MoE experts with a gated shared expert."""
    L, every = r.size(LAYERS), r.int(("full_attention_interval",))
    default = "".join("D" if (i + 1) % every else "A" for i in range(L))
    shared = r.int(("shared_expert_intermediate_size",), allow_zero=True)
    if not shared and r.int(("num_experts",), allow_zero=True):
        # transformers builds an empty shared expert whose gate Linear(E, 1) remains
        raise r.fail("shared_expert_intermediate_size 0 is not supported (transformers keeps "
                     "the shared expert's gate)")
    bias = r.bool("attention_bias")
    return llama_shaped(r) | moe_qwen(r) | dict(
        qkv_bias=bias, attn_out_bias=bias, qk_norm="head", attn_output_gate=True,
        rotary_pct=r.float(ROTARY_PCT), n_shared_expert=1 if shared else 0,
        shared_ffn_dim=shared or None, shared_expert_gate=bool(shared),
        layer_mixers=mixer_pattern(r, {"linear_attention": "D", "full_attention": "A"},
                                   default),
        linear_num_key_heads=r.int(("linear_num_key_heads",)),
        linear_num_value_heads=r.int(("linear_num_value_heads",)),
        linear_key_head_dim=r.int(("linear_key_head_dim",)),
        linear_value_head_dim=r.int(("linear_value_head_dim",)),
        linear_conv_kernel_dim=r.int(("linear_conv_kernel_dim",)))


def _jamba(r) -> dict[str, Any]:
    """Jamba: Mamba-1 blocks and attention blocks (i % attn_layer_period ==
    attn_layer_offset), no positional encoding; experts (num_experts > 1) in blocks i %
    expert_layer_period == expert_layer_offset, which must be the period's last block (gptcalc's
    MoE step), else the dense MLP."""
    period, offset = r.int(("attn_layer_period",)), r.int(("attn_layer_offset",), allow_zero=True)
    if offset >= period:
        raise r.fail(f"attn_layer_offset {offset} must be below attn_layer_period {period}")
    n_exp = r.int(("num_experts",))
    e_period = r.int(("expert_layer_period",))
    e_offset = r.int(("expert_layer_offset",), allow_zero=True)
    if n_exp > 1 and e_offset != e_period - 1:
        raise r.fail(f"expert_layer_offset {e_offset} with expert_layer_period {e_period} is "
                     "not supported (experts in the last block of each period only)")
    rank = r.raw.get("mamba_dt_rank", "auto")
    r.read.add("mamba_dt_rank")
    if rank != "auto" and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
        raise r.fail(f"mamba_dt_rank must be \"auto\" or a positive integer, got {rank!r}")
    moe = n_exp > 1
    return llama_shaped(r) | dict(
        pos_embedding="none", layer_mixers="".join("A" if i == offset else "M"
                                                   for i in range(period)),
        n_expert=n_exp if moe else 0, n_expert_active=r.int(("num_experts_per_tok",)),
        moe_step=e_period if moe else 1, mamba_version=1,
        mamba_d_inner=r.int(("mamba_expand",)) * r.size(HIDDEN),
        mamba_d_state=r.int(("mamba_d_state",)), mamba_d_conv=r.int(("mamba_d_conv",)),
        mamba_dt_rank=None if rank == "auto" else rank,
        mamba_conv_bias=r.bool("mamba_conv_bias"), mamba_proj_bias=r.bool("mamba_proj_bias"))


def _falcon_h1(r) -> dict[str, Any]:
    """Falcon-H1: every block holds attention and a Mamba2 layer side by side (P), then the
    MLP; Mamba's width mamba_d_ssm (null: mamba_expand x E), its gated norm only with
    mamba_rms_norm. in_proj's bias is mamba_proj_bias and out_proj's projectors_bias: they
    must agree (gptcalc has one switch for both)."""
    if "mamba_d_ssm" in r.raw and r.raw["mamba_d_ssm"] is None:
        inner = r.int(("mamba_expand",)) * r.size(HIDDEN)
    else:
        inner = r.int(("mamba_d_ssm",))
    out = llama_shaped(r) | mamba2_fields(r, inner)
    if r.bool("projectors_bias") != out["mamba_proj_bias"]:
        raise r.fail("projectors_bias and mamba_proj_bias differ (out_proj's and in_proj's "
                     "biases): not supported")
    bias = r.bool("attention_bias")
    return out | dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=r.bool("mlp_bias"),
                      layer_mixers="P", mamba_norm=r.bool("mamba_rms_norm"))


def _granitemoehybrid(r) -> dict[str, Any]:
    """Granite 4.0 (GraniteMoeHybrid): Mamba2 blocks (layer_types mamba) and attention blocks
    (attention); every block's shared_mlp (a gated MLP of shared_intermediate_size, fused
    input_linear), beside num_local_experts experts of intermediate_size when there are any;
    rotary only with position_embedding_type "rope"."""
    E, n_exp = r.size(HIDDEN), r.int(("num_local_experts",), allow_zero=True)
    shared = r.int(("shared_intermediate_size",))
    r.read.add("position_embedding_type")
    rope = r.raw.get("position_embedding_type") == "rope"
    bias = r.bool("attention_bias")
    out = llama_shaped(r) | mamba2_fields(r, r.int(("mamba_expand",)) * E) | dict(
        qkv_bias=bias, attn_out_bias=bias, pos_embedding="rotary" if rope else "none",
        layer_mixers=mixer_pattern(r, {"mamba": "M", "linear_attention": "M", "attention": "A",
                                       "full_attention": "A"}, "M"),
        mamba_norm=True)
    if n_exp:
        return out | dict(n_expert=n_exp, n_expert_active=r.int(("num_experts_per_tok",)),
                          moe_ffn_dim=out["d_ff"], n_shared_expert=1, shared_ffn_dim=shared)
    r.int(("num_experts_per_tok",))  # read, and unused without experts (as transformers)
    return out | dict(d_ff=shared)


FAMILIES.update({"qwen3_next": _qwen3_next, "jamba": _jamba, "falcon_h1": _falcon_h1,
                 "granitemoehybrid": _granitemoehybrid})
LINEAR_NAMES.update({
    "qwen3_next": _LLAMA_NAMES, "falcon_h1": _LLAMA_NAMES,
    "jamba": _LLAMA_NAMES | dict(router="router"),
    "granitemoehybrid": dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj", router="router",
                             gate="input_linear", up="input_linear", down="output_linear"),
})
