"""What Megatron-Core's GPT model keeps for backward (`--impl megatron-core`).

Read from Megatron-LM at commit d98e8a64ddf3 (2026-08-22) and Transformer Engine at commit
d0067d0da6cb (2026-08-22). The layer is `megatron/core/transformer/transformer_layer.py` built
by `megatron/core/models/gpt/gpt_layer_specs.py`: with Transformer Engine
(`get_gpt_layer_with_transformer_engine_spec`) the input norm is fused into linear_qkv and the
pre-MLP norm into linear_fc1 (TELayerNormColumnParallelLinear), the core attention is TE's
DotProductAttention, the output projections TERowParallelLinear, the rotary TE's fused one;
without it (`get_gpt_layer_local_spec`) Apex's FusedLayerNorm, Megatron's Column/
RowParallelLinear, its own unfused DotProductAttention and rotary. The local modules are
measured: `benchmarks/megatron_twin.py` runs megatron-core 0.16.1's GPTModel on CPU (tp = 1)
and every line below equals what autograd keeps, for GeLU, ReLU and SwiGLU, MHA and GQA,
learned and rotary positions, dropout or none, each recomputation, bf16 and fp32. The
Transformer Engine layer needs CUDA and is read, not measured. One micro-batch, before tensor
and sequence parallel sharding (`gptcalc.memory.activations` shards the lines: the norms, the
projections' normalized inputs and the residual dropout masks by sequence parallelism only,
the rest by tp); a dropout mask is 1 byte an element on CUDA, the compute dtype's on CPU:

  ln_1, ln_2 / input   N E a   TE `_LayerNormLinear.forward` saves `inputmat` (the residual
                               stream), `mu`, `rsigma` (fp32 on CUDA, one per token; RMSNorm:
                               rsigma only) and `ln_out`; Apex's FusedLayerNorm input, mean,
                               invvar
  attn/qkv_input       N E a   `ln_out`, the GEMM input; with sequence parallelism the local
                               shard, re-gathered in backward (`ctx.ln_out_needs_gather`; the
                               local spec's LinearWithGradAccumulationAndAsyncCommunication
                               saves `input`, not the all-gathered `total_input`)
  attn/qkv, q_copy, q_rotary, k_rotary, kv_repeated, rotary_tables   `_attention_inputs`:
                               linear_qkv's output, N (Dq + 2 Dkv) a, which q, k and v are
                               views of, or the copies the core keeps instead
  attn/qk_norm, q_normed, k_normed   with qk_layernorm: each head's statistics (N (H + g)),
                               and the normed q and k the core keeps without rotary
  attn/rotary_freqs    S rd 4   fp32 frequencies of one forward (TE's fused rotary; the full
                               checkpoints), one per micro-batch and stage
  attn/softmax_stats   b H S 4  TE's fused attention (`FusedAttnFunc`): q, k, v, its output
                               and the fp32 softmax statistics; attention dropout is
                               regenerated from the saved RNG state, no mask
  attn/softmax, dropout_mask, dropped   b H S^2 (a, 1, a)   the local spec's unfused core
                               (the fused masked softmax's 16-bit output, as Megatron-LM's
                               arguments run it; with attention dropout its mask and the
                               dropped probabilities bmm saves): Korthikanti et al.'s 5as^2b
  attn/out_input       N Dq a  the core's output, which linear_proj saves (TE's kernel saves
                               the same storage)
  attn/resid_dropout_mask, mlp/dropout_mask   N E   bias-dropout-add's mask (dropout > 0)
  mlp/fc_input         N E a   linear_fc1's `ln_out`, as attn/qkv_input
  mlp/act_input        N k d_ff a   the activation's input: `bias_gelu_impl` saves fc1's
                               output, `bias_swiglu_impl` / `bias_geglu_impl` their 2 d_ff
                               input (k = 2); ReLU saves its output, the next line, instead
  mlp/hidden           N d_ff a   the activation's output, linear_fc2's input

recompute selective (Megatron's `recompute_modules=["core_attn"]`,
`_checkpointed_attention_forward`): the checkpoint keeps q, k, v and the mask type as an int32
tensor (4 bytes), the core's own tensors are recomputed. full (`recompute_granularity="full"`,
uniform, one layer per chunk): each layer keeps its input hidden states only (the local shard
with sequence parallelism). Embedding and head: the token ids (8 N; with tp > 1
VocabParallelEmbedding's masked copy, and its bool mask), the learned positions' ids (8 N),
the embedding dropout's mask; the final norm (TENorm: input, mu, rsigma), the output layer's
input (ColumnParallelLinear, local shard with sequence parallelism), and the vocab-parallel
cross entropy (`megatron/core/tensor_parallel/cross_entropy.py`): its fp32 softmax of the
local vocabulary shard (`.float()` of the logits, made the softmax in place), its bool target
mask and int64 masked targets (whole on every rank), and pretrain_gpt.py's `loss_func`
multiplication by the fp32 loss mask (4 N).

Not modelled: MoE, MLA, q/k norms other than qk_layernorm's (a norm of head_dim, gptcalc's
`qk_norm="head"`, `_normed_attention_inputs`), sliding windows, post-norms, parallel residuals,
sinusoidal or ALiBi positions, fp8, TE's fused activation modules, the dataloader's
attention mask, the fused attention's RNG state (16 bytes a layer).
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload

MEGATRON_LM_COMMIT = "d98e8a64ddf3"
TRANSFORMER_ENGINE_COMMIT = "d0067d0da6cb"


def unmodelled(cfg: GPTConfig) -> list[str]:
    """The switches of `cfg` the profile does not model, in words ([] when it models them)."""
    return [name for name, on in (
        ("MoE", cfg.moe), ("MLA", cfg.mla),
        (f"q/k norms over {'heads' if cfg.qk_norm == 'per_head' else 'the projection'}",
         cfg.qk_norm in ("per_head", "proj")),
        ("post-norms", cfg.post_norm), ("parallel residuals", cfg.parallel_residual),
        ("sliding windows", cfg.sliding_window is not None),
        ("attention sinks", cfg.attn_sinks), ("an embedding norm", cfg.embd_norm),
        ("embedding projections", cfg.embd_dim != cfg.n_embd),
        (f"{cfg.pos_embedding} positions", cfg.pos_embedding in ("sinusoidal", "alibi")),
        ("blocks without pre-norms", not cfg.pre_norm)) if on]


def check_megatron_core(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """ConfigError naming --impl (or the option) for what the profile does not model."""
    missing = unmodelled(cfg)
    if missing:
        raise ConfigError("impl", f"the megatron-core profile does not model "
                                  f"{', '.join(missing)}; use --impl reference")
    if setup.mode == "amp":
        raise ConfigError("mode", "Megatron-Core trains in mixed (bf16/fp16), bf16 or fp32, "
                                  "not amp (autocast over fp32 weights)")
    if setup.lora_rank:
        raise ConfigError("impl", "the megatron-core profile counts full training; LoRA: use "
                                  "--impl reference or transformers")
    if setup.recompute == "op":
        raise ConfigError("recompute", "Megatron-Core recomputes selective (the core "
                                       "attention) or full layers, not op")
    if setup.loss != "standard":
        raise ConfigError("loss", "Megatron-Core's loss is its vocab-parallel cross entropy: "
                                  "--loss standard")
    for heads, what in ((cfg.n_head, "attention heads"), (cfg.kv_heads, "query groups")):
        if heads % setup.tp:
            raise ConfigError("tp", f"Megatron-Core divides the {heads} {what} over tp; "
                                    f"{setup.tp} does not divide them")


def _norm(cfg: GPTConfig, N: int, setup: TrainingSetup) -> dict[str, int]:
    """One norm's saved tensors: its input and the statistics, fp32 on CUDA (TE's mu and
    rsigma, Apex's mean and invvar), in the input's dtype on CPU (torch's layer_norm there,
    the local spec's fallback without Apex); RMSNorm keeps no mean."""
    a = setup.act_bytes
    stats = 4 if setup.device == "cuda" else a
    out = {"input": N * cfg.n_embd * a, "rstd": stats * N}
    if cfg.norm != "rmsnorm":
        out["mean"] = stats * N
    return out


def dropout_mask_bytes(setup: TrainingSetup) -> int:
    """Bytes of one dropout mask element: bool on CUDA (torch's fused native_dropout), the
    input's dtype on CPU (its mask is the scaled noise tensor)."""
    return 1 if setup.device == "cuda" else setup.act_bytes


def _attention_inputs(cfg: GPTConfig, N: int, S: int, setup: TrainingSetup
                      ) -> dict[str, int]:
    """What the core attention (or the selective checkpoint) keeps of q, k, v, one layer.

    q, k and v are views of linear_qkv's output [s, b, g, (H/g + 2) hd] (g query groups per
    rank), and a saved view keeps that storage whole. q is a copy where
    `get_query_key_value_tensors` reshapes it across groups (1 < g < H per rank), or where
    Megatron's unfused core folds (b, H) of a single group's q (g = 1); rotary makes new q and
    k. Megatron's unfused core repeats grouped-query k and v to H heads (`repeat_interleave`,
    N Dq each) and saves those instead. The selective checkpoint keeps what the core receives.
    The unfused rotary (without Transformer Engine, no rope fusion) saves cos and sin in the
    compute dtype for q and for k, 4 S rd a; TE's fused rotary saves its fp32 frequencies
    (`rotary_freqs`: `megatron_saved`)."""
    a, Dq, Dkv = setup.act_bytes, cfg.q_width, cfg.kv_width
    g, H = cfg.kv_heads // setup.tp, cfg.n_head // setup.tp
    rope = cfg.pos_embedding == "rotary"
    unfused_core = not setup.megatron_te and setup.recompute == "none"
    repeats = unfused_core and g != H
    if cfg.qk_norm != "none":
        return _normed_attention_inputs(cfg, N, S, setup, repeats)
    q_copy = not rope and (1 < g < H or (g == 1 < H and unfused_core))
    q_view, v_view = not rope and not q_copy, not repeats  # k's view implies v's
    return {"attn/qkv": N * (Dq + 2 * Dkv) * a if q_view or v_view else 0,
            "attn/q_copy": N * Dq * a if q_copy else 0,
            "attn/q_rotary": N * Dq * a if rope else 0,
            "attn/k_rotary": N * Dkv * a if rope and not repeats else 0,
            "attn/kv_repeated": 2 * N * Dq * a if repeats else 0,
            "attn/rotary_tables": 4 * S * cfg.rotary_dims * a if not setup.megatron_te else 0}


def _normed_attention_inputs(cfg: GPTConfig, N: int, S: int, setup: TrainingSetup,
                             repeats: bool) -> dict[str, int]:
    """`_attention_inputs` with Megatron's qk_layernorm (`q_layernorm` / `k_layernorm` of
    head_dim, `get_query_key_value_tensors`): each norm saves its input and statistics per
    token and head. k's input is a view of linear_qkv's output, which stays whole; q's is that
    view too, or the copy `get_query_key_value_tensors` makes across groups (1 < g < H per
    rank). The normed q and k are new tensors: rotary reads them without saving them (it
    saves cos and sin) and the core keeps its rotated copies as without norms; without
    rotary the core (or the selective checkpoint, or TE's fused attention) keeps normed q (or
    the unfused core's folded copy of it, as large) and normed k unless the unfused core
    repeats k and v to H heads (`attn/kv_repeated`)."""
    a, Dq, Dkv = setup.act_bytes, cfg.q_width, cfg.kv_width
    g, H = cfg.kv_heads // setup.tp, cfg.n_head // setup.tp
    rope = cfg.pos_embedding == "rotary"
    stats = 4 if setup.device == "cuda" else a
    per_head = N * (cfg.n_head + cfg.kv_heads) * stats  # one statistic per token and head
    return {"attn/qkv": N * (Dq + 2 * Dkv) * a,
            "attn/q_copy": N * Dq * a if 1 < g < H else 0,
            "attn/qk_norm/rstd": per_head,
            "attn/qk_norm/mean": per_head if cfg.norm != "rmsnorm" else 0,
            "attn/q_normed": N * Dq * a if not rope else 0,
            "attn/k_normed": N * Dkv * a if not rope and not repeats else 0,
            "attn/q_rotary": N * Dq * a if rope else 0,
            "attn/k_rotary": N * Dkv * a if rope and not repeats else 0,
            "attn/kv_repeated": 2 * N * Dq * a if repeats else 0,
            "attn/rotary_tables": 4 * S * cfg.rotary_dims * a if not setup.megatron_te else 0}


def megatron_layer_lines(cfg: GPTConfig, b: int, S: int, setup: TrainingSetup
                         ) -> dict[str, int]:
    """One TransformerLayer's saved bytes before sharding (the module docstring's table)."""
    N, a, E, H = b * S, setup.act_bytes, cfg.n_embd, cfg.n_head
    if setup.recompute == "full":
        return {"block_input": N * E * a}
    F, m = cfg.ffn_dim, dropout_mask_bytes(setup) if cfg.dropout > 0 else 0
    out = {f"ln_1/{k}": v for k, v in _norm(cfg, N, setup).items()}
    out["attn/qkv_input"] = N * E * a
    out.update(_attention_inputs(cfg, N, S, setup))
    if setup.recompute == "selective":  # the attention mask type, an int32 checkpoint input
        out["attn/checkpoint_mask_type"] = 4
    elif setup.megatron_te:
        out["attn/softmax_stats"] = b * H * S * 4
    else:
        out["attn/softmax"] = b * H * S * S * a
        out["attn/dropout_mask"] = b * H * S * S * m
        out["attn/dropped"] = b * H * S * S * a if m else 0
    out["attn/out_input"] = N * cfg.q_width * a
    out["attn/resid_dropout_mask"] = N * E * m
    out.update({f"ln_2/{k}": v for k, v in _norm(cfg, N, setup).items()})
    out["mlp/fc_input"] = N * E * a
    if cfg.mlp != "relu":  # ReLU saves its output, which is linear_fc2's input
        out["mlp/act_input"] = N * F * a * (2 if cfg.mlp in GATED_MLPS else 1)
    out["mlp/hidden"] = N * F * a
    out["mlp/dropout_mask"] = N * E * m
    return out


def megatron_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                   ) -> dict[str, int]:
    """Bytes Megatron-Core's GPTModel saves for backward in one micro-batch, one line per saved
    tensor kind, all L layers, before tensor/sequence-parallel sharding (`input/...` and the
    cross entropy's index lines are per rank already). Keys as the other profiles':
    `input/...`, `embedding/...`, `layer/...`, `final/...`, `cross_entropy/...`."""
    check_megatron_core(cfg, setup)
    b, S = workload.batch_size, workload.seq_len
    N, a, E, t = b * S, setup.act_bytes, cfg.n_embd, setup.tp
    out = {"input/idx": 8 * N,
           "input/idx_vocab_mask": N if t > 1 else 0,  # VocabParallelEmbedding's input_mask
           "input/idx_positions": 8 * N if cfg.pos_embedding == "learned" else 0,
           "embedding/dropout_mask": (N * E * dropout_mask_bytes(setup)
                                      if cfg.dropout > 0 and cfg.embd_dropout else 0)}
    out.update({f"layer/{k}": cfg.n_layer * v
                for k, v in megatron_layer_lines(cfg, b, S, setup).items()})
    if cfg.pos_embedding == "rotary" and (setup.megatron_te or setup.recompute == "full"):
        # the fp32 frequencies [S, 1, 1, rd] of one forward, which TE's fused rotary or the
        # layers' checkpoints save: one tensor per micro-batch on each pipeline stage
        out["layer/attn/rotary_freqs"] = S * cfg.rotary_dims * 4 * setup.pp
    if cfg.final_norm:
        out.update({f"final/ln_f/{k}": v for k, v in _norm(cfg, N, setup).items()})
    out["final/lm_head_input"] = N * E * a
    v_shard = -(-cfg.vocab_size // t)  # Megatron pads the vocabulary to a multiple of tp
    out["cross_entropy/softmax"] = N * v_shard * t * 4
    out["cross_entropy/target_mask"] = N
    out["cross_entropy/masked_target"] = 8 * N
    out["cross_entropy/loss_mask"] = 4 * N
    return out


__all__ = ["MEGATRON_LM_COMMIT", "TRANSFORMER_ENGINE_COMMIT", "check_megatron_core",
           "dropout_mask_bytes", "megatron_layer_lines", "megatron_saved", "unmodelled"]
