"""Exact parameter counts, by component.

Every trainable tensor of the architecture is counted once (a tied lm_head adds only its bias).
Buffers (causal masks, sinusoidal or rotary tables) are not parameters. The keys of
`param_components` are stable and sum to the total.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPTConfig
from .inventory import ParamTensor, block_tensors, inventory

EMBEDDING_KEYS = ("embedding/token", "embedding/position")


@dataclass(frozen=True)
class ParamCount:
    total: int
    non_embedding: int  # Kaplan et al. 2020: excludes token and position embeddings
    components: dict[str, int]


def norm_params(cfg: GPTConfig, width: int) -> int:
    """Weight (and bias) of one normalisation layer over `width` features."""
    return 2 * width if cfg.norm == "layernorm" else width  # LayerNorm γ,β; RMSNorm / no-bias γ


def _by_component(tensors: list[ParamTensor], per_block: bool = False) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tensors:
        n = t.numel * t.copies if per_block else t.elements
        out[t.component] = out.get(t.component, 0) + n
    return out


def layer_components(cfg: GPTConfig) -> dict[str, int]:
    """Parameters of one transformer block, by component (the inventory's block tensors)."""
    keys = ("attention/qkv", "attention/out", "mlp/fc", "mlp/gate", "mlp/proj",
            "norm/attention", "norm/mlp")
    got = _by_component(block_tensors(cfg), per_block=True)
    return {k: got.get(k, 0) for k in keys}


def param_components(cfg: GPTConfig) -> dict[str, int]:
    """All parameters by component; the values sum to `count_params(cfg).total`.

    A grouped sum over `inventory(cfg)`: a tied head reuses the token embedding, so its weight is
    counted once, under the embedding; only a learned position table depends on T."""
    got = _by_component(inventory(cfg))
    keys = ("embedding/token", "embedding/position", *layer_components(cfg), "norm/final",
            "lm_head")
    return {k: got.get(k, 0) for k in keys}


def count_params(cfg: GPTConfig) -> ParamCount:
    comps = param_components(cfg)
    total = sum(comps.values())
    return ParamCount(
        total=total,
        non_embedding=total - sum(comps[k] for k in EMBEDDING_KEYS),
        components=comps,
    )
