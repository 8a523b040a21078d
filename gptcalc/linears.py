"""The Linear modules of one transformer block, by the names LoRA and quantisation use.

q, k, v, o: attention's query, key, value and output projections (a fused layout has one `qkv`
module instead of q, k, v; the per-head layout has H modules of each); up, gate, down: the MLP's
input (c_fc), SwiGLU gate (c_gate, gated MLPs only) and output (c_proj) projections. Embeddings,
the lm_head and norms are not block Linears.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPTConfig


@dataclass(frozen=True)
class Linear:
    """`count` modules Linear(in_features, out_features) in each block."""

    in_features: int
    out_features: int
    count: int = 1
    bias: bool = False

    @property
    def weights(self) -> int:
        """Weight elements of one block's `count` modules (biases apart)."""
        return self.count * self.in_features * self.out_features


def block_linears(cfg: GPTConfig) -> dict[str, Linear]:
    """The Linear modules of one block, by name; their weights plus biases are the block's
    parameters less its norms (a test checks this against gptcalc.params)."""
    E, Dq, Dkv, Dff, H, hd = (cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.n_head,
                              cfg.head_size)
    out: dict[str, Linear] = {}
    if cfg.qkv_layout == "fused":  # nanoGPT's c_attn: one E x (Dq + 2 Dkv) matrix
        out["qkv"] = Linear(E, Dq + 2 * Dkv, 1, cfg.qkv_bias)
    elif cfg.qkv_layout == "separate":  # Llama's q_proj, k_proj, v_proj
        out.update(q=Linear(E, Dq, 1, cfg.qkv_bias), k=Linear(E, Dkv, 1, cfg.qkv_bias),
                   v=Linear(E, Dkv, 1, cfg.qkv_bias))
    else:  # per_head: H modules Linear(E, head_dim) each for query, key and value
        out.update(q=Linear(E, hd, H, cfg.qkv_bias), k=Linear(E, hd, H, cfg.qkv_bias),
                   v=Linear(E, hd, H, cfg.qkv_bias))
    out["o"] = Linear(Dq, E, 1, cfg.attn_out_bias)
    out["up"] = Linear(E, Dff, 1, cfg.mlp_bias)
    if cfg.mlp == "swiglu":
        out["gate"] = Linear(E, Dff, 1, cfg.mlp_bias)
    out["down"] = Linear(Dff, E, 1, cfg.mlp_bias)
    return out
