"""Which matmuls torchtitan's op-level selective activation checkpointing keeps in a block.

torchtitan (torchtitan/distributed/activation_checkpoint.py, `_apply_op_sac`) runs each block
under torch.utils.checkpoint with a policy that keeps the outputs of the ops in its save list
(`aten.mm`, the SDPA kernels, reduce_scatter, max; torchtitan/models/llama3/infra/
parallelize.py) except every second `aten.mm` of the block, counted in forward order, and
recomputes the rest. A Linear without a bias dispatches `aten.mm`; with a bias `aten.addmm`,
which the list does not hold: it is recomputed and does not count. Memory
(`gptcalc.memory.profile_reference.op_block_lines`) and FLOPs (`gptcalc.flops.recompute_flops`)
both read `op_kept_linears`. Scope: dense blocks; in an MoE block the experts' matmuls that
run, and so which of them are kept, depend on the routing. Torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import GATED_MLPS, GPTConfig


class BlockLinear(NamedTuple):
    name: str  # the reference model's module, e.g. "q_proj"
    component: str  # the FLOPs breakdown key it counts under, e.g. "attention/qkv"
    n_in: int
    n_out: int
    bias: bool


def block_linears(cfg: GPTConfig) -> list[BlockLinear]:
    """The Linear layers one dense block runs, in forward order (the reference model's, which
    transformers' Llama, Qwen2, GPT-NeoX and GPT-2 layers share): q/k/v (per_head: every query
    head, then every key head, then every value head; MLA: the query path, then kv_a and
    kv_b), the output projection, then the MLP (gated: gate before up), down."""
    E, H, hd, b = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.qkv_bias
    qkv = "attention/qkv"
    if cfg.mla:
        Dqk = H * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            attn = [BlockLinear("q_proj", qkv, E, Dqk, False)]
        else:
            attn = [BlockLinear("q_a_proj", qkv, E, cfg.q_lora_rank, b),
                    BlockLinear("q_b_proj", qkv, cfg.q_lora_rank, Dqk, False)]
        attn += [BlockLinear("kv_a_proj", qkv, E, cfg.kv_lora_rank + cfg.rope_dim, b),
                 BlockLinear("kv_b_proj", qkv, cfg.kv_lora_rank,
                             H * (cfg.nope_dim + cfg.v_dim), False)]
    elif cfg.qkv_layout == "fused":
        attn = [BlockLinear("c_attn", qkv, E, cfg.q_width + 2 * cfg.kv_width, b)]
    elif cfg.qkv_layout == "separate":
        attn = [BlockLinear("q_proj", qkv, E, cfg.q_width, b),
                BlockLinear("k_proj", qkv, E, cfg.kv_width, b),
                BlockLinear("v_proj", qkv, E, cfg.kv_width, b)]
    else:
        attn = [BlockLinear(f"{role}_heads", qkv, E, hd, b)
                for role in ("query", "key", "value") for _ in range(H)]
    attn.append(BlockLinear("c_proj", "attention/out", cfg.attn_out_width, E,
                            cfg.attn_out_bias))
    W, mb = cfg.ffn_dim, cfg.mlp_bias
    gate = [BlockLinear("mlp_gate", "mlp/gate", E, W, mb)] if cfg.mlp in GATED_MLPS else []
    return attn + gate + [BlockLinear("mlp_fc", "mlp/fc", E, W, mb),
                          BlockLinear("mlp_proj", "mlp/proj", W, E, mb)]


def _kept(lins: list[BlockLinear]) -> list[bool]:
    """Whether each Linear's output is kept: the 1st, 3rd, 5th, ... bias-free one."""
    out, mm = [], 0
    for lin in lins:
        mm += not lin.bias
        out.append(not lin.bias and mm % 2 == 1)
    return out


def op_kept_linears(cfg: GPTConfig) -> list[BlockLinear]:
    """The Linear layers whose outputs op-level checkpointing keeps: the 1st, 3rd, 5th, ...
    `aten.mm` (bias-free Linear) of the block."""
    lins = block_linears(cfg)
    return [lin for lin, kept in zip(lins, _kept(lins)) if kept]


def op_recomputed_linears(cfg: GPTConfig) -> list[BlockLinear]:
    """The Linear layers op-level checkpointing runs again in backward: those not kept, but the
    block's last one when nothing after it saves a tensor (no dropout mask, no post-norm):
    torch.utils.checkpoint (non-reentrant, early stop) ends a recomputation once the last
    saved tensor is made again, and an op's inputs are saved before it runs."""
    lins = block_linears(cfg)
    flags = _kept(lins)
    if cfg.dropout == 0 and not cfg.post_norm:
        flags[-1] = True  # the trailing Linear: kept, or not needed
    return [lin for lin, skip in zip(lins, flags) if not skip]


__all__ = ["BlockLinear", "block_linears", "op_kept_linears", "op_recomputed_linears"]
