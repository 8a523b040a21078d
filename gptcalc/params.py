"""Exact parameter counts, by component.

Every trainable tensor of the architecture is counted once (a tied lm_head adds only its bias).
Buffers (causal masks, sinusoidal or rotary tables) are not parameters. The keys of
`param_components` are stable and sum to the total.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPTConfig

EMBEDDING_KEYS = ("embedding/token", "embedding/position")


@dataclass(frozen=True)
class ParamCount:
    total: int
    non_embedding: int  # Kaplan et al. 2020: excludes token and position embeddings
    components: dict[str, int]


def norm_params(cfg: GPTConfig, width: int) -> int:
    """Weight (and bias) of one normalisation layer over `width` features."""
    return 2 * width if cfg.norm == "layernorm" else width  # LayerNorm γ,β; RMSNorm / no-bias γ


def layer_components(cfg: GPTConfig) -> dict[str, int]:
    """Parameters of one transformer block, by component."""
    E, Dq, Dkv, Dff = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.ffn_dim
    qkv_out = Dq + 2 * Dkv  # query, key and value widths side by side
    return {
        "attention/qkv": E * qkv_out + (qkv_out if cfg.qkv_bias else 0),
        "attention/out": Dq * E + (E if cfg.attn_out_bias else 0),
        "mlp/fc": E * Dff + (Dff if cfg.mlp_bias else 0),
        # SwiGLU (Shazeer 2020) adds a gate matrix the size of the up projection
        "mlp/gate": (E * Dff + (Dff if cfg.mlp_bias else 0)) if cfg.mlp == "swiglu" else 0,
        "mlp/proj": Dff * E + (E if cfg.mlp_bias else 0),
        "norm/attention": norm_params(cfg, E),
        "norm/mlp": norm_params(cfg, E),
    }


def param_components(cfg: GPTConfig) -> dict[str, int]:
    """All parameters by component; the values sum to `count_params(cfg).total`."""
    T, E, L, V = cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.vocab_size
    comps = {
        "embedding/token": V * E,
        # only a learned table is a parameter; it is the one place T enters the count
        "embedding/position": T * E if cfg.pos_embedding == "learned" else 0,
    }
    comps.update({key: L * n for key, n in layer_components(cfg).items()})
    comps["norm/final"] = norm_params(cfg, E) if cfg.final_norm else 0
    # a tied head reuses the token embedding: count its weight once, under the embedding
    comps["lm_head"] = (0 if cfg.tie_embeddings else E * V) + (V if cfg.lm_head_bias else 0)
    return comps


def count_params(cfg: GPTConfig) -> ParamCount:
    comps = param_components(cfg)
    total = sum(comps.values())
    return ParamCount(
        total=total,
        non_embedding=total - sum(comps[k] for k in EMBEDDING_KEYS),
        components=comps,
    )
