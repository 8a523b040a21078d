"""Hypothesis strategies shared by the reference-model tests: tiny configs, every switch."""

from __future__ import annotations

from hypothesis import strategies as st

from gptcalc import GPTConfig, Workload
from gptcalc.config import MLPS, NORMS, POSITIONS, QKV_LAYOUTS

# the classic switches; the newer ones (ALiBi, GeGLU, MoE, MLA, windows, ...) are drawn by
# `modern_configs` in tests/test_memory_modern.py
CLASSIC_POSITIONS = tuple(p for p in POSITIONS if p != "alibi")
CLASSIC_MLPS = tuple(m for m in MLPS if m != "geglu")


@st.composite
def configs(draw, dropout=st.sampled_from([0.0, 0.1])) -> GPTConfig:
    """A tiny GPTConfig with every switch drawn independently (E <= 32, L <= 2, T <= 12)."""
    H = draw(st.integers(1, 4))
    hd = draw(st.sampled_from([2, 4, 6]))  # even: rotary needs it
    layout = draw(st.sampled_from(QKV_LAYOUTS))
    divisors = [d for d in range(1, H + 1) if H % d == 0]
    kv = H if layout == "per_head" else draw(st.sampled_from(divisors))
    explicit_head_dim = draw(st.booleans())
    E = draw(st.sampled_from([8, 12, 16])) if explicit_head_dim else H * hd
    return GPTConfig(
        block_size=draw(st.integers(2, 12)), vocab_size=draw(st.integers(5, 40)),
        n_layer=draw(st.integers(1, 2)), n_head=H, n_embd=E,
        n_kv_head=None if kv == H and draw(st.booleans()) else kv,
        head_dim=hd if explicit_head_dim else None,
        ffn_mult=draw(st.integers(1, 4)), d_ff=draw(st.none() | st.integers(3, 20)),
        dropout=draw(dropout), qkv_layout=layout,
        qkv_bias=draw(st.booleans()), attn_out_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()), lm_head_bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()), pos_embedding=draw(st.sampled_from(CLASSIC_POSITIONS)),
        norm=draw(st.sampled_from(NORMS)), mlp=draw(st.sampled_from(CLASSIC_MLPS)),
        final_norm=draw(st.booleans()), embd_dropout=draw(st.booleans()),
        # GPT-NeoX's switches: rotary on half of each head (even dims need hd == 4), and
        # attention and MLP reading the same block input
        rotary_pct=draw(st.sampled_from([1.0, 0.5])) if hd == 4 else 1.0,
        parallel_residual=draw(st.booleans()),
    )


@st.composite
def configs_and_workloads(draw, dropout=st.sampled_from([0.0, 0.1])):
    cfg = draw(configs(dropout))
    wl = Workload(batch_size=draw(st.integers(1, 2)), seq_len=draw(st.integers(1, cfg.block_size)))
    return cfg, wl


# a one-block model whose attention scores dominate: the phase model once counted the head's and
# the MLP's saved tensors beside the score gradients (+16.6%), which backward has freed by then
TINY_ATTENTION_BOUND = (GPTConfig(
    block_size=6, vocab_size=5, n_layer=1, n_head=2, n_embd=4, n_kv_head=1, d_ff=3,
    qkv_layout="fused", qkv_bias=False, attn_out_bias=False, mlp_bias=True, lm_head_bias=False,
    tie_embeddings=False, pos_embedding="none", norm="layernorm", mlp="relu"), Workload(2, 6))
# the same moment in a parallel block (GPT-NeoX), whose MLP branch is made after the attention's
# and so goes back first: +15.4% while its MLP side was counted beside the score gradients
TINY_PARALLEL_BOUND = (GPTConfig(
    block_size=6, vocab_size=5, n_layer=1, n_head=2, n_embd=4, n_kv_head=1, ffn_mult=1,
    qkv_layout="fused", qkv_bias=False, attn_out_bias=False, mlp_bias=False, lm_head_bias=False,
    tie_embeddings=False, pos_embedding="learned", norm="layernorm", mlp="relu", final_norm=False,
    parallel_residual=True), Workload(2, 6))
