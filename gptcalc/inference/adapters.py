"""LoRA adapters in a serving engine: the slots vLLM reserves for them on every GPU.

With --enable-lora, vLLM wraps every Linear of the blocks it supports LoRA on (Llama: the
merged qkv_proj and gate_up_proj, o_proj and down_proj; whatever modules an adapter targets)
and gives each `max_loras` slots of rank `max_lora_rank` in the model's dtype
(vllm/lora/layers/base_linear.py, `BaseLinearLayerWithLoRA.create_lora_weights`; the wrappers
in column_parallel_linear.py and row_parallel_linear.py):

    A: max_loras x max_lora_rank x in_features    per output slice
    B: max_loras x out_features x max_lora_rank   per output slice

per GPU: a column-parallel Linear (q, k, v, up, gate) keeps its B split over tp (the key and
value slices one replicated head when tp exceeds the key/value heads), a row-parallel one (o,
down) its A; a fused qkv has an A for each of its three slices. The slots are made while the
model loads, so the weights vLLM logs include them. The profile run activates `max_loras` dummy
adapters (vllm/lora/model_manager.py, `create_dummy_lora`), built on the CPU and copied into
the slots: no GPU memory beyond them.

Scope: dense attention and MLP blocks; MoE experts and MLA projections are refused. Not
counted: the punica kernels' per-token metadata and their float32 intermediate of tokens x
rank per slice (under 2 MiB at 8,192 tokens and rank 16), the lm_head and embeddings (vLLM adapts
them only when asked), fully sharded LoRAs (`--fully-sharded-loras`).
"""

from __future__ import annotations

from ..config import GPTConfig
from ..errors import ConfigError, positive_int
from ..linears import block_linears
from .kv import kv_heads_per_device

DEFAULT_MAX_LORAS = 1  # vLLM's --max-loras (vllm/config/lora.py)
DEFAULT_MAX_LORA_RANK = 16  # vLLM's --max-lora-rank
ROW_PARALLEL = ("o", "down")  # vLLM's RowParallelLinear targets: their input is split over tp


def lora_slot_bytes(cfg: GPTConfig, max_loras: int = DEFAULT_MAX_LORAS,
                    max_lora_rank: int = DEFAULT_MAX_LORA_RANK, tp: int = 1,
                    dtype_bytes: int = 2) -> dict[str, int]:
    """The LoRA slots on one of tp GPUs, by target (`lora/q`, `lora/o`, ...): for each block
    Linear, count x max_loras x max_lora_rank x (A's inputs + B's outputs per GPU) x bytes;
    see the module docstring."""
    positive_int("max_loras", max_loras)
    positive_int("max_lora_rank", max_lora_rank)
    if cfg.moe or cfg.mla:
        kind = "MoE experts" if cfg.moe else "multi-head latent attention"
        raise ConfigError("enable_lora", f"vLLM's LoRA slots for {kind} are not modelled")
    kv_out = kv_heads_per_device(cfg, tp) * cfg.head_size  # one key or value slice per GPU
    out: dict[str, int] = {}
    for lin in block_linears(cfg):
        t = lin.target
        if t in ROW_PARALLEL:
            a_in, b_out = lin.in_features // tp, lin.out_features
        elif t in ("k", "v"):
            a_in, b_out = lin.in_features, kv_out
        elif t == "qkv":  # three output slices, an A for each
            a_in, b_out = 3 * lin.in_features, cfg.q_width // tp + 2 * kv_out
        else:  # q, up, gate: column-parallel
            a_in, b_out = lin.in_features, lin.out_features // tp
        key = f"lora/{t}"
        out[key] = out.get(key, 0) + (lin.count * max_loras * max_lora_rank * (a_in + b_out)
                                      * dtype_bytes)
    return out


__all__ = ["DEFAULT_MAX_LORAS", "DEFAULT_MAX_LORA_RANK", "lora_slot_bytes"]
