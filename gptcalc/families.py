"""Families: named bundles of the architecture's switches (`ARCHS`), which one a config has,
and which switches beyond the classic GPT-2 / Llama block it uses."""

from __future__ import annotations

from typing import Any

from .config import GPTConfig

# Families: named bundles of switches. Sizes are not part of them.
ARCHS: dict[str, dict[str, Any]] = {
    # Karpathy's "Let's build GPT" tutorial: per-head k/q/v without bias, projection
    # and MLP with bias, ReLU, LayerNorm with bias, untied lm_head with bias, no embedding dropout.
    "tutorial": dict(
        qkv_layout="per_head", qkv_bias=False, attn_out_bias=True, mlp_bias=True,
        lm_head_bias=True, tie_embeddings=False, pos_embedding="learned", norm="layernorm",
        mlp="relu", final_norm=True, embd_dropout=False,
    ),
    # GPT-2 (nanoGPT model.py): fused c_attn, biases, GELU (tanh), tied head.
    "gpt2": dict(
        qkv_layout="fused", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        lm_head_bias=False, tie_embeddings=True, pos_embedding="learned", norm="layernorm",
        mlp="gelu_tanh", final_norm=True, embd_dropout=True,
    ),
    # A textbook decoder-only transformer: per-head Q/K/V with bias, O with bias, exact GELU,
    # learnable position Parameter(1, K, D), embedding dropout, tied lm_head without bias.
    "notes": dict(
        qkv_layout="per_head", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        lm_head_bias=False, tie_embeddings=True, pos_embedding="learned", norm="layernorm",
        mlp="gelu", final_norm=True, embd_dropout=True,
    ),
    # Llama 2/3 (Touvron et al. 2023; Meta's model cards): no biases, RMSNorm, rotary, SwiGLU,
    # separate q/k/v projections (grouped-query when n_kv_head < n_head), untied head.
    "llama": dict(
        qkv_layout="separate", qkv_bias=False, attn_out_bias=False, mlp_bias=False,
        lm_head_bias=False, tie_embeddings=False, pos_embedding="rotary", norm="rmsnorm",
        mlp="swiglu", final_norm=True, embd_dropout=False, dropout=0.0,
    ),
}
_LLAMA = ARCHS["llama"]
ARCHS.update({
    # Mistral 7B v0.1 (Jiang et al. 2023): Llama's switches; its sliding window is a size.
    "mistral": dict(_LLAMA),
    # Mixtral (Jiang et al. 2024): Llama's attention, every MLP a top-2 mixture of SwiGLU experts.
    "mixtral": dict(_LLAMA, n_expert_active=2, router_norm_topk=True),
    # Qwen3 (Qwen3 technical report 2025): Llama plus RMSNorm on each query and key head.
    "qwen3": dict(_LLAMA, qk_norm="head"),
    "qwen3_moe": dict(_LLAMA, qk_norm="head"),
    # DeepSeek-V3 (DeepSeek-AI 2024): MLA, MoE with shared experts and dense first layers.
    "deepseek": dict(_LLAMA),
    # Families hold switches only: a window and its layer pattern are sizes of a preset.
    # Gemma 2 (Gemma Team 2024): GeGLU, pre- and post-norms, tied head.
    "gemma2": dict(_LLAMA, mlp="geglu", post_norm=True, tie_embeddings=True,
                   attn_softcap=True, logit_softcap=True),
    # Gemma 3 (Gemma Team 2025): Gemma 2 plus q/k RMSNorm over each head.
    "gemma3": dict(_LLAMA, mlp="geglu", post_norm=True, tie_embeddings=True, qk_norm="head"),
    # gpt-oss (OpenAI 2025 model card): biased attention with sinks, MoE with a biased router
    # and biased experts.
    "gpt_oss": dict(_LLAMA, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
                    router_bias=True, expert_bias=True),
    # OLMo 2 (OLMo et al. 2024): RMSNorm after each branch instead of before, q/k RMSNorm over
    # the whole projection.
    "olmo2": dict(_LLAMA, pre_norm=False, post_norm=True, qk_norm="proj"),
    # Phi-3 (Abdin et al. 2024): Llama's switches with fused qkv_proj and gate_up_proj.
    "phi3": dict(_LLAMA, qkv_layout="fused"),
    # BLOOM (BigScience 2022, sec. 3.2.4): GPT-2's fused, biased block with ALiBi instead of a
    # position table and a LayerNorm after the embedding (word_embeddings_layernorm).
    "bloom": dict(ARCHS["gpt2"], pos_embedding="alibi", embd_norm=True, embd_dropout=False,
                  dropout=0.0),
})


def family_of(cfg: GPTConfig) -> str | None:
    """The family in `ARCHS` whose switches `cfg` has (ignoring dropout), or None."""
    for name, switches in ARCHS.items():
        if all(getattr(cfg, k) == v for k, v in switches.items() if k != "dropout"):
            return name
    return None


def modern_switches(cfg: GPTConfig) -> list[str]:
    """The switches beyond the classic GPT-2 / Llama block that `cfg` uses, by name."""
    used = (("mixture of experts", cfg.moe), ("multi-head latent attention", cfg.mla),
            ("q/k norms", cfg.qk_norm != "none"), ("post-norms", cfg.post_norm),
            ("no pre-norms", not cfg.pre_norm), ("a shared parallel norm", cfg.shared_norm),
            ("sliding windows", cfg.sliding_window is not None),
            ("attention sinks", cfg.attn_sinks), ("ALiBi", cfg.pos_embedding == "alibi"),
            ("GeGLU", cfg.mlp == "geglu"), ("an embedding norm", cfg.embd_norm),
            ("OPT's embedding projections", cfg.embd_proj_dim is not None))
    return [name for name, on in used if on]


