"""Which blocks are which: MoE or dense MLP, sliding-window or global attention; and the KV cache.

Blocks of one model can differ: DeepSeek-V3's first 3 blocks keep a dense MLP, Qwen-MoE's
`decoder_sparse_step` and `mlp_only_layers` pick the MoE blocks, Gemma 2/3 and gpt-oss
alternate sliding-window and global attention. These functions count the blocks of each kind
arithmetically from the config's rules (a repeated pattern, a step, a short explicit list), so
every formula built on them stays O(1) in the number of blocks L. Torch-free.
"""

from __future__ import annotations

from .config import GPTConfig
from .errors import ConfigError, one_of

KV_WINDOW_KEEPS = ("window", "window-1")
MLA_CACHES = ("latent", "expanded")


def _multiples_below(step: int, start: int, stop: int) -> int:
    """Indices i in [start, stop) with (i + 1) % step == 0."""
    if stop <= start:
        return 0
    return stop // step - start // step


def moe_layers(cfg: GPTConfig) -> int:
    """Blocks whose MLP is a mixture of experts.

    Block i (0-based) is MoE when i >= moe_first_dense (DeepSeek's first_k_dense_replace),
    (i + 1) % moe_step == 0 (Qwen-MoE's decoder_sparse_step, as transformers' Qwen2MoeDecoderLayer
    tests it) and i is not listed in moe_dense_layers (Qwen-MoE's mlp_only_layers); 0 without
    experts.
    """
    if not cfg.moe:
        return 0
    L, step, first = cfg.n_layer, cfg.moe_step, min(cfg.moe_first_dense, cfg.n_layer)
    sparse = _multiples_below(step, first, L)
    # an explicitly dense block only matters when the rules above made it sparse
    listed = sum(1 for i in cfg.dense_layer_indices if first <= i < L and (i + 1) % step == 0)
    return sparse - listed


def dense_mlp_layers(cfg: GPTConfig) -> int:
    """Blocks with a dense MLP of width d_ff: all blocks but the MoE ones."""
    return cfg.n_layer - moe_layers(cfg)


def attn_pattern(cfg: GPTConfig) -> str:
    """The repeating layer-kind pattern: attn_pattern, or L (every block sliding) when only
    sliding_window is set, or G (every block global)."""
    if cfg.attn_pattern:
        return cfg.attn_pattern.upper()
    return "L" if cfg.sliding_window is not None else "G"


def sliding_layers(cfg: GPTConfig) -> int:
    """Blocks with sliding-window attention: the L letters of the pattern repeated over L blocks
    from block 0 (Gemma 3's LLLLLG: blocks 5, 11, ... are global)."""
    pattern, L = attn_pattern(cfg), cfg.n_layer
    whole, rest = divmod(L, len(pattern))
    return whole * pattern.count("L") + pattern[:rest].count("L")


def global_layers(cfg: GPTConfig) -> int:
    """Blocks with full causal attention: the attention blocks (`attention_layers`) that do
    not slide."""
    return attention_layers(cfg) - sliding_layers(cfg)


def mixer_layers(cfg: GPTConfig, kinds: str) -> int:
    """Blocks whose layer_mixers letter is one of `kinds`, the pattern repeated from block 0
    over L blocks (Qwen3-Next's MMMA over 48 blocks: 36 M, 12 A); an empty pattern is every
    block attention (A)."""
    pattern, L = (cfg.layer_mixers or "A").upper(), cfg.n_layer
    whole, rest = divmod(L, len(pattern))
    return sum(whole * pattern.count(k) + pattern[:rest].count(k) for k in kinds)


def attention_layers(cfg: GPTConfig) -> int:
    """Blocks with an attention layer: A, and P (Falcon-H1's attention beside its Mamba)."""
    return mixer_layers(cfg, "AP")


def mamba_layers(cfg: GPTConfig) -> int:
    """Blocks with a Mamba layer: M, and P (Falcon-H1)."""
    return mixer_layers(cfg, "MP")


def deltanet_layers(cfg: GPTConfig) -> int:
    """Blocks with a Gated DeltaNet layer (D)."""
    return mixer_layers(cfg, "D")


# the commands that read a hybrid model: its parameters, and a serving engine's memory for it
HYBRID_COMMANDS = ("params", "serve")


def hybrid_layer_words(cfg: GPTConfig) -> str:
    """The hybrid's non-attention layers in words: "36 Gated DeltaNet layers" (blocks with
    Falcon-H1's parallel Mamba2 counted among the Mamba ones)."""
    kind = "Mamba2" if cfg.mamba_version == 2 else "Mamba"
    parts = [f"{n} {name} layers" for n, name in ((mamba_layers(cfg), kind),
                                                    (deltanet_layers(cfg), "Gated DeltaNet"))
             if n]
    return " and ".join(parts)


def hybrid_refusal(cfg: GPTConfig, command: str) -> str:
    """Why `command` refuses a hybrid model: what it would need and does not model."""
    commands = " and ".join(f"`gptcalc {c}`" for c in HYBRID_COMMANDS)
    return (f"the model's {hybrid_layer_words(cfg)} (beside {attention_layers(cfg)} attention "
            f"layers) are not modelled by `{command}`: their training memory, FLOPs and step "
            f"time are not counted; {commands} read this model")


def window_pairs(seq_len: int, window: int) -> int:
    """Query-key pairs a causal sliding window of `window` keeps over S queries: query i sees
    min(i + 1, window) keys (itself and window - 1 before it)."""
    S, W = seq_len, window
    if S <= W:
        return S * (S + 1) // 2
    return W * (W + 1) // 2 + (S - W) * W


def kv_tokens_per_layer(cfg: GPTConfig, context: int, window_keeps: str = "window"
                        ) -> tuple[int, int]:
    """(tokens a global block caches, tokens a sliding block caches) at `context` tokens.

    A global block caches every token. A sliding block caches at most its window: `window`
    (the default: serving engines such as vLLM keep the whole window, the newest token's key
    included) or `window-1` (transformers' DynamicSlidingWindowLayer keeps the window - 1 past
    tokens the next query needs; that query's own key joins them when it is computed)."""
    one_of("window_keeps", window_keeps, KV_WINDOW_KEEPS)
    if context < 0:
        raise ConfigError("context", f"context must not be negative, got {context}")
    if cfg.sliding_window is None:
        return context, context
    W = cfg.sliding_window - (1 if window_keeps == "window-1" else 0)
    return context, min(context, W)


def kv_elements_per_token(cfg: GPTConfig, mla_cache: str = "latent") -> int:
    """Cached elements per token and block.

    Standard attention: K and V, 2 * n_kv_head * head_dim (grouped-query aware).
    MLA, `latent` (DeepSeek-V2, sec. 2.1.2; what transformers 5's DeepseekV3Attention, DeepSeek's
    inference code and vLLM cache): the normalised kv latent and the shared rotary key,
    kv_lora_rank + qk_rope_head_dim.
    MLA, `expanded` (a cache of the decompressed heads, as the reference model keeps it): keys
    of H * (qk_nope + qk_rope) and values of H * v_head_dim.
    """
    one_of("mla_cache", mla_cache, MLA_CACHES)
    if cfg.mla:
        if mla_cache == "latent":
            return cfg.kv_lora_rank + cfg.rope_dim  # c_kv and k_rope
        return cfg.n_head * (cfg.qk_head_dim + cfg.v_dim)  # k and v of every head
    return 2 * cfg.kv_heads * cfg.head_size  # K and V of the n_kv_head heads


def kv_cache_elements(cfg: GPTConfig, context: int, window_keeps: str = "window",
                      mla_cache: str = "latent") -> int:
    """K+V cache elements of ONE sequence at `context` tokens, summed over the blocks.

        global blocks  * per_token * context
      + sliding blocks * per_token * min(context, window)      (window - 1 with window_keeps)

    per_token from `kv_elements_per_token` (2 * n_kv_head * head_dim, or MLA's latent).
    Multiply by the batch and the bytes per element for bytes; tensor and pipeline parallelism
    shard it (heads and blocks; `gptcalc.inference.kv` counts one device's share). O(1) in L:
    block kinds are counted, never enumerated.
    """
    per_token = kv_elements_per_token(cfg, mla_cache)
    full, windowed = kv_tokens_per_layer(cfg, context, window_keeps)
    return per_token * (global_layers(cfg) * full + sliding_layers(cfg) * windowed)


__all__ = ["HYBRID_COMMANDS", "KV_WINDOW_KEEPS", "MLA_CACHES", "attention_layers",
           "attn_pattern", "deltanet_layers", "dense_mlp_layers", "global_layers",
           "hybrid_layer_words", "hybrid_refusal", "kv_cache_elements", "kv_elements_per_token",
           "kv_tokens_per_layer", "mamba_layers", "mixer_layers", "moe_layers", "sliding_layers",
           "window_pairs"]
