"""Exact parameter counts, by component.

Every trainable tensor of the architecture is counted once (a tied lm_head adds only its bias).
Buffers (causal masks, sinusoidal or rotary tables, DeepSeek-V3's e_score_correction_bias) are
not parameters. The keys of `param_components` are stable and sum to the total.

Active parameters (mixture of experts): the parameters one token uses in a forward pass: every
parameter that is not a routed expert, plus n_expert_active of the n_expert routed experts of
each MoE block (shared experts and routers are used by every token). Embeddings count as in the
total (the whole token table, a tied head once), which is the convention of the Mixtral and
DeepSeek-V3 announcements ("12.9B active" of 46.7B; "37B activated" of 671B).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPTConfig
from .inventory import MIXER_KEYS, ParamTensor, inventory

EMBEDDING_KEYS = ("embedding/token", "embedding/position")


@dataclass(frozen=True)
class ParamCount:
    total: int
    non_embedding: int  # Kaplan et al. 2020: excludes token and position embeddings
    components: dict[str, int]
    active: int  # parameters one token uses: all but the routed experts it does not visit


def _by_component(tensors: list[ParamTensor]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tensors:
        out[t.component] = out.get(t.component, 0) + t.elements
    return out


BLOCK_KEYS = ("attention/qkv", "attention/norm", "attention/sinks", "attention/out", "mlp/fc",
              "mlp/gate", "mlp/proj", "moe/router", "moe/experts", "moe/shared",
              "norm/attention", "norm/mlp")


def param_components(cfg: GPTConfig) -> dict[str, int]:
    """All parameters by component; the values sum to `count_params(cfg).total`.

    A grouped sum over `inventory(cfg)`: a tied head reuses the token embedding, so its weight is
    counted once, under the embedding; only a learned position table depends on T. Hybrid
    models add the Mamba / Gated DeltaNet keys (`inventory.MIXER_KEYS`)."""
    got = _by_component(inventory(cfg))
    keys = ("embedding/token", "embedding/position", "embedding/proj", "norm/embedding",
            *BLOCK_KEYS, *(MIXER_KEYS if cfg.hybrid else ()), "norm/final", "lm_head")
    return {k: got.get(k, 0) for k in keys}


def active_params(cfg: GPTConfig) -> int:
    """Parameters one token uses: every tensor, routed experts only n_expert_active of n_expert
    per MoE block (equal to the total without experts)."""
    return sum(t.active_elements(cfg.n_expert_active) for t in inventory(cfg))


def count_params(cfg: GPTConfig) -> ParamCount:
    comps = param_components(cfg)
    total = sum(comps.values())
    return ParamCount(
        total=total,
        non_embedding=total - sum(comps[k] for k in EMBEDDING_KEYS),
        components=comps,
        active=active_params(cfg),
    )
