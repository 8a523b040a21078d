"""LoRA adapters and QLoRA's frozen 4-bit base: parameters and bytes, as pure functions.

LoRA (Hu et al. 2021) as PEFT implements it (`peft.tuners.lora.LoraLayer`): a target
Linear(in, out) gains lora_A = Linear(in, r) and lora_B = Linear(r, out), both without bias, so
r x (in + out) trainable parameters; the base weight is frozen. PEFT's default targets for Llama
are q_proj and v_proj ("q,v"); for GPT-2's fused c_attn, the whole "qkv" module.

QLoRA (Dettmers et al. 2023) keeps the frozen base's block Linears in 4-bit NormalFloat (NF4) as
bitsandbytes stores them: 4 bits per weight, one absmax per block of 64 weights, and with double
quantisation the absmax values themselves in 8 bits with one fp32 scale per 256 of them: 8/64 +
32/(64 x 256) = 0.127 bits of constants per parameter, against 32/64 = 0.5 without (QLoRA paper,
sec. 3, "Double Quantization"). Embeddings, the lm_head, norms and biases stay 16-bit (bitsandbytes
replaces only the block Linears; transformers skips the lm_head).
"""

from __future__ import annotations

import math

from .config import GPTConfig
from .errors import ConfigError
from .linears import block_linears, targets as linear_targets
from .params import count_params

LORA_TARGETS = ("q", "k", "v", "qkv", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b",
                "router")
NF4_BLOCK = 64  # weights per absmax (bitsandbytes blocksize for 4-bit)
ABSMAX_BLOCK = 256  # double quantisation: absmax values per fp32 second-level scale


def default_targets(cfg: GPTConfig) -> tuple[str, ...]:
    """PEFT's defaults: q and v, or the fused qkv module (GPT-2's c_attn)."""
    return ("qkv",) if cfg.qkv_layout == "fused" else ("q", "v")


def parse_targets(text: str | None, cfg: GPTConfig) -> tuple[str, ...]:
    """'q,k,v,o' -> ('q', 'k', 'v', 'o'); 'all' -> every block Linear; None -> the defaults.
    Each target must exist in this architecture (ConfigError("lora_targets") otherwise)."""
    if text is None:
        return default_targets(cfg)
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return tuple(t for t in linear_targets(cfg) if t != "router")
    if not names:
        raise ConfigError("lora_targets", "give at least one target, e.g. q,v")
    linears = linear_targets(cfg)
    for t in names:
        if t not in LORA_TARGETS:
            raise ConfigError("lora_targets", f"unknown target {t!r}; targets: "
                                              f"{', '.join(LORA_TARGETS)} or all")
        if t not in linears:
            why = {"gate": "only a gated MLP (mlp=swiglu) has a gate projection",
                   "qkv": "this model has separate q, k and v projections",
                   }.get(t, "this model fuses q, k and v into one qkv module")
            raise ConfigError("lora_targets", f"{t}: {why}; this model's targets: "
                                              f"{', '.join(linears)}")
    return tuple(dict.fromkeys(names))


def lora_params(cfg: GPTConfig, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """Trainable LoRA parameters by target, summed over every block Linear of that target (all
    layers; each routed expert's own): r x (in + out) per adapted Linear (PEFT's lora_A and
    lora_B, no bias). The values sum to the trainable total."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError("lora_rank", f"must be a positive integer, got {rank!r}")
    out = dict.fromkeys(targets, 0)
    for m in block_linears(cfg):
        if m.target in out:
            out[m.target] += m.count * rank * (m.in_features + m.out_features)
    return out


def qlora_weight_bytes(n_params: int, double_quant: bool = True) -> dict[str, int]:
    """Bytes of `n_params` weights in NF4 as bitsandbytes stores them, by part:

    nf4: 4 bits per weight; absmax: one per block of 64 weights, 8 bits with double quantisation
    (fp32 without); absmax_scales: with double quantisation one fp32 per 256 absmax values.
    The weights are taken as one run of blocks (per-tensor rounding and the per-tensor fp32
    offset and 256-entry code table, a few hundred bytes per tensor, are left out)."""
    blocks = math.ceil(n_params / NF4_BLOCK)
    return {
        "nf4": math.ceil(n_params / 2),
        "absmax": blocks if double_quant else 4 * blocks,
        "absmax_scales": 4 * math.ceil(blocks / ABSMAX_BLOCK) if double_quant else 0,
    }


def lora_state_bytes(cfg: GPTConfig, rank: int, targets: tuple[str, ...], base: str = "nf4",
                     double_quant: bool = True) -> dict[str, int]:
    """Bytes of (Q)LoRA fine-tuning's model states, by category; the values sum to the total.

    base/weights: the frozen block Linears, NF4 (base="nf4", QLoRA) or 16-bit (base="bf16");
    base/quant_constants: NF4's absmax values and their scales (qlora_weight_bytes);
    base/other: embeddings, lm_head, norms and biases, 16-bit and frozen;
    adapter/weights, adapter/gradients: fp32, 4 bytes per LoRA parameter each;
    adapter/optimizer: AdamW's two fp32 moments, 8 bytes per LoRA parameter.
    Not included: activations, the cross-entropy logits, framework workspace."""
    if base not in ("nf4", "bf16"):
        raise ConfigError("base", f"base must be nf4 or bf16, got {base!r}")
    n_lora = sum(lora_params(cfg, rank, targets).values())
    n_matrix = sum(m.weights for m in block_linears(cfg))
    q = qlora_weight_bytes(n_matrix, double_quant)
    return {
        "base/weights": q["nf4"] if base == "nf4" else 2 * n_matrix,
        "base/quant_constants": q["absmax"] + q["absmax_scales"] if base == "nf4" else 0,
        "base/other": 2 * (count_params(cfg).total - n_matrix),
        "adapter/weights": 4 * n_lora,
        "adapter/gradients": 4 * n_lora,
        "adapter/optimizer": 8 * n_lora,
    }
