"""What litgpt's own model and full fine-tune loop save for backward, and hold around the loss.

The `litgpt` implementation profile: litgpt's `GPT` (litgpt/model.py, 0.5.13) with the block its
Llama-family configs use (Llama 2/3.x, Mistral without a sliding window, Qwen2.5, Phi-3,
SmolLM2, ...): RMSNorm computed in fp32 (`x.float()`, `x * rsqrt(mean(x^2) + eps)`, times
`weight.float()`, cast back), one fused `qkv` Linear split into q, k and v views, rotary
`apply_rope` on a slice then `torch.cat`, grouped-query heads through `repeat_interleave` of k and
v before `F.scaled_dot_product_attention(is_causal=True)`, LLaMAMLP (fc_1, fc_2, silu, proj).
The loss is litgpt/finetune/full.py's: `logits = model(input_ids)`, then
`chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])` (litgpt/utils.py, chunk_size
128: the shifted logits reshaped to N' = b(S - 1) rows, a copy when b > 1, split into chunks of
128 rows, each chunk's `cross_entropy(reduction="none")` in the logits' own dtype, no upcast),
`fabric.backward(loss / accum)`. Precision "bf16-true" (litgpt's default: weights,
gradients and AdamW states bf16, no autocast) is mode bf16; "32-true" mode fp32. Other blocks
(LayerNorm, GELU MLPs, parallel residual, q/k norms, MoE, MLA, sliding windows, soft-capping,
post-norms), autocast modes and recomputation raise a ConfigError naming --impl.

Measured (saved_tensors_hooks deduplicated by storage; litgpt 0.5.13, torch 2.13, CPU; bf16
and fp32, b 1 or more, S from 1, grouped-query, multi-query and multi-head): exact
(tests/test_litgpt.py). Documented only: device cuda, where SDPA's flash kernel (bf16) saves
the same q, k, v, output and fp32 logsumexp b x H x S (fp32: the memory-efficient kernel, its
logsumexp padded to a multiple of 32 queries).

One line per saved tensor (N = b S tokens, N' = b (S - 1) the loss's rows, a activation bytes,
E width, Dq = H hd, Dkv = G hd with G key/value heads, Dff d_ff, V vocabulary):

    layer/ln_1/input          N * E * 4     x.float(): the fp32 copy (fp32: x itself)
    layer/ln_1/rsqrt          N * 4
    layer/ln_1/normalized     N * E * 4     x * rsqrt, fp32, saved by the product with the weight
    layer/ln_1/weight         E * 4         weight.float(), a copy when the weight is 16-bit
    layer/attn/qkv_input      N * E * a     the norm's output cast back
    layer/attn/q              N * Dq * a    torch.cat of the roped slice and the rest
    layer/attn/k              N * Dq * a    repeat_interleave's copy (G < H); G = H: the cat, N*Dkv*a
    layer/attn/v              N * Dq * a    repeat_interleave's copy (G < H); G = H: a view of the
                                            qkv output, which keeps all of it, N*(Dq + 2 Dkv)*a
    layer/attn/logsumexp      b * H * S * 4
    layer/attn/sdpa_out       N * Dq * a    laid out (b, H, S, hd)
    layer/attn/out_input      N * Dq * a    y.transpose(1, 2).reshape: proj's copy (H, S > 1)
    layer/ln_2/...            as ln_1
    layer/mlp/fc_input        N * E * a     fc_1 and fc_2's shared input
    layer/mlp/hidden          4 * N * Dff * a  fc_1 output (silu's input), silu output, fc_2
                                            output, their product (proj's input)
    final/ln_f/...            as ln_1
    final/lm_head_input       N * E * a
    cross_entropy/log_probs   N' * V * a    every chunk's log_softmax output, the logits' dtype
    cross_entropy/total_weight n * a        each chunk's nll_loss total weight (0-d), n chunks
    cross_entropy/count       8             the int64 count of counted targets the sum divides by
    input/idx                 N * 8         the embedding's int64 indices
    input/labels              N' * 8        targets[..., 1:].reshape(-1), a copy (b > 1, S > 2); else
                                            a view of the batch's (b, S) targets, N * 8
"""

from __future__ import annotations

from ..config import GPTConfig
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload
from .ledger import LOGITS, OPTIMIZER_TEMPORARIES, Ledger, Phase, Term

# litgpt's GPT keeps its rotary cos and sin as buffers beside the weights, all through the step
ROPE_CACHE = Term("rope cache (litgpt's cos and sin buffers)")

CHUNK_SIZE = 128  # chunked_cross_entropy's default chunk_size (litgpt/utils.py), rows per chunk


def _not_modelled(cfg: GPTConfig) -> list[str]:
    """Switches of `cfg` outside the Llama-family block this profile measured."""
    used = (("a norm other than RMSNorm", cfg.norm != "rmsnorm"),
            ("an MLP other than SwiGLU", cfg.mlp != "swiglu"),
            ("positions other than rotary", cfg.pos_embedding != "rotary"),
            ("partial rotary", cfg.rotary_pct != 1.0),
            ("a parallel residual", cfg.parallel_residual or cfg.shared_norm),
            ("post-norms", cfg.post_norm or not cfg.pre_norm),
            (f"q/k norm {cfg.qk_norm!r}", cfg.qk_norm != "none"),
            ("a mixture of experts", cfg.moe), ("multi-head latent attention", cfg.mla),
            ("a sliding window", cfg.sliding_window is not None),
            ("soft-capping", cfg.attn_softcap or cfg.logit_softcap),
            ("dropout", cfg.dropout > 0),
            # litgpt's `bias` is proj's and the MLP's, its qkv's too (`bias or attn_bias`)
            ("biases litgpt's bias and attn_bias cannot express",
             cfg.attn_out_bias != cfg.mlp_bias or (cfg.mlp_bias and not cfg.qkv_bias)),
            ("an embedding norm or projection", cfg.embd_norm or cfg.embd_proj_dim is not None),
            ("attention sinks or an output gate", cfg.attn_sinks or cfg.attn_output_gate),
            ("a hybrid mixer", bool(cfg.layer_mixers)),
            ("no final norm", not cfg.final_norm))
    return [name for name, on in used if on]


def check_litgpt_config(cfg: GPTConfig) -> None:
    """ConfigError(field="impl") for a `cfg` litgpt's Llama-family block does not build, or a
    tied head (litgpt keeps lm_head apart from the embedding: its checkpoint converter copies a
    tied embedding into lm_head)."""
    missing = _not_modelled(cfg)
    if missing:
        raise ConfigError("impl", f"the litgpt profile models litgpt's Llama-family block only, "
                                  f"not {', '.join(missing)}: use --impl reference")
    if cfg.tie_embeddings:
        raise ConfigError("impl", "litgpt unties the head (its converter copies the embedding "
                                  "into lm_head): add --set tie_embeddings=false for --impl litgpt")


def check_litgpt(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """ConfigError for a set-up the litgpt profile does not model: `check_litgpt_config`, then
    precision (bf16-true = mode bf16, 32-true = fp32), recomputation and the loss (litgpt's
    loop runs its own chunked cross entropy)."""
    check_litgpt_config(cfg)
    if setup.mode not in ("bf16", "fp32"):
        raise ConfigError("mode", "--impl litgpt: litgpt's precisions bf16-true (--mode bf16, "
                                  "its default) and 32-true (--mode fp32)")
    if setup.recompute != "none":
        raise ConfigError("recompute", "--impl litgpt: its full fine-tune does not recompute")
    if setup.loss != "standard" or setup.compile != "none" or setup.float8 != "none":
        raise ConfigError("impl", "--impl litgpt runs litgpt's own chunked cross entropy in "
                                  "eager mode: not with --loss, --compile or --float8")
    if not setup.keep_logits:
        raise ConfigError("keep_logits", "--impl litgpt: litgpt's loop holds the logits "
                                         "through backward, to the next step")
    if setup.attn_impl != "sdpa":
        raise ConfigError("attn", "--impl litgpt: litgpt's attention is SDPA (--attn sdpa)")
    if setup.lora_rank:
        raise ConfigError("lora_rank", "--impl litgpt models litgpt's full fine-tune, not LoRA")
    for name, on in (("optimizer_in_backward", setup.optimizer_in_backward),
                     ("offload_activations", setup.offload_activations)):
        if on:
            raise ConfigError(name, f"--impl litgpt: litgpt's full fine-tune has no "
                                    f"--{name.replace('_', '-')}")
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(setup, name) > 1:
            raise ConfigError(name, f"--impl litgpt: litgpt's full fine-tune shards data only "
                                    f"(one device, or FSDP over --dp): not --{name}")


def _shift_copies(workload: Workload) -> bool:
    """Whether `x[..., 1:]` (or `[..., :-1, :]`) then `reshape` copies: b > 1 rows of S - 1 > 1
    positions are not one stride apart; with b = 1, or one position left per row (S = 2), the
    reshape is a view of the batch's (or the logits') storage."""
    return workload.batch_size > 1 and workload.seq_len > 2


def loss_chunks(workload: Workload) -> int:
    """Chunks of `chunked_cross_entropy`: ceil(N' / 128) over N' = b (S - 1) rows, at least one
    (`split` of an empty tensor returns it whole)."""
    rows = workload.batch_size * (workload.seq_len - 1)
    return max(1, -(-rows // CHUNK_SIZE))


def _norm(N: int, E: int, a: int, prefix: str) -> dict[str, int]:
    return {f"{prefix}/input": N * E * 4, f"{prefix}/rsqrt": N * 4,
            f"{prefix}/normalized": N * E * 4, f"{prefix}/weight": E * 4 if a != 4 else 0}


def litgpt_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> dict[str, int]:
    """Bytes litgpt's GPT and full.py's loss save for backward in one micro-batch of b x S.

    Keys and lines: the module docstring. Exact on CPU in bf16 and fp32."""
    check_litgpt(cfg, setup)
    b, S = workload.batch_size, workload.seq_len
    N, rows, a = b * S, b * (S - 1), setup.act_bytes
    E, V, L, H = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.n_head
    Dq, Dkv, Dff = cfg.q_width, cfg.kv_width, cfg.ffn_dim
    grouped = cfg.kv_heads != H
    cuda_fp32 = setup.device == "cuda" and a == 4  # memory-efficient kernel: lse padded to 32
    s_lse = 32 * -(-S // 32) if cuda_fp32 else S
    layer = {**_norm(N, E, a, "ln_1"),
             "attn/qkv_input": N * E * a,
             "attn/q": N * Dq * a,
             "attn/k": N * (Dq if grouped else Dkv) * a,
             "attn/v": N * (Dq if grouped else Dq + 2 * Dkv) * a,
             "attn/logsumexp": b * H * s_lse * 4,
             "attn/sdpa_out": N * Dq * a,
             "attn/out_input": N * Dq * a if H > 1 and S > 1 else 0,
             **_norm(N, E, a, "ln_2"),
             "mlp/fc_input": N * E * a,
             "mlp/hidden": 4 * N * Dff * a}
    out = {f"layer/{k}": L * v for k, v in layer.items()}
    out.update({f"final/{k}": v for k, v in _norm(N, E, a, "ln_f").items()})
    out["final/lm_head_input"] = N * E * a
    out["cross_entropy/log_probs"] = rows * V * a
    out["cross_entropy/total_weight"] = loss_chunks(workload) * a
    out["cross_entropy/count"] = 8
    out["input/idx"] = 8 * N
    out["input/labels"] = 8 * (rows if _shift_copies(workload) else N)
    return out


def litgpt_loss_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                           ) -> dict[str, int]:
    """What full.py's loss holds beyond the saved tensors and the logits, at the forward's end
    and at the backward's start (n = b S V a the logits, n' = N' V a the shifted rows, c the
    largest chunk, min(128, N') rows).

    forward: the larger of the loss's own moment, the shifted logits' reshape copy (n' when
    b > 1 and S > 2; a view otherwise) beside the chunks' per-row losses and their cat
    (2 N' a), and the model's last op, where the loop's `logits` still holds the previous
    step's logits beside the new ones and no log-probability is made yet (n - n').
    backward: autograd runs the chunks' losses from the last: each chunk's nll_loss gradient
    and log_softmax's gradient are alive beside its saved output (2 c V a), the chunks done
    before having traded their log-probabilities for gradients; then the split's backward
    concatenates those gradients (n', the log-probabilities all freed), and the slice's
    backward writes them into a zero b x S x V gradient of the logits (n beside the n'
    freed and the n' concatenated): the larger of 2 c V a and n."""
    b, S, V, a = workload.batch_size, workload.seq_len, cfg.vocab_size, setup.act_bytes
    rows = b * (S - 1)
    logits, shifted = b * S * V * a, rows * V * a
    copy = shifted if _shift_copies(workload) else 0
    forward = max(copy + 2 * rows * a, logits - shifted)
    return {"forward": forward, "backward": max(2 * min(CHUNK_SIZE, rows) * V * a, logits)}


def rope_cache_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """litgpt's cos and sin buffers, 2 x rows x rotary dims: full.py sets the model's
    max_seq_length to the longest sequence (S), which rebuilds them in fp32
    (build_rope_cache); at S = block_size they stay as the model was cast (the weights'
    dtype)."""
    S = workload.seq_len
    return 2 * S * cfg.rotary_dims * (4 if S != cfg.block_size else setup.weight_bytes)


def litgpt_loop(ledger: Ledger, cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                ) -> None:
    """full.py's loop in `ledger`: the rope cache at every moment, and the logits at the
    optimizer step (the loop's `logits` name holds them until the next forward returns).
    On one CPU device AdamW steps one tensor at a time (`_single_tensor_adamw`) in the
    model's parameter order, the previous tensor's denom alive beside this one's two
    temporaries: litgpt's order (`parameter_order`), not the inventory's."""
    for phase in ledger.phases:
        ledger.add(phase, ROPE_CACHE, rope_cache_bytes(cfg, workload, setup))
    ledger.add(Phase.OPTIMIZER_STEP, LOGITS,
               workload.batch_size * workload.seq_len * cfg.vocab_size * setup.act_bytes)
    if (setup.device == "cpu" and setup.optimizer == "adamw" and setup.dp == 1
            and setup.zero == 0):
        sizes = parameter_order(cfg)
        pairs = max(p + 2 * n for p, n in zip([0] + sizes, sizes))
        ledger.replace(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES,
                       pairs * setup.weight_bytes)


def parameter_order(cfg: GPTConfig) -> list[int]:
    """Elements of litgpt's GPT parameters in `parameters()` order, with at most two blocks
    (every block repeats the first's order): lm_head (weight, bias), then transformer.wte, each
    block's norm_1, attn.qkv (weight, bias), attn.proj, norm_2, mlp.fc_1, fc_2, proj (weight,
    bias each where `bias`), and transformer.ln_f."""
    E, V, Dff = cfg.n_embd, cfg.vocab_size, cfg.ffn_dim
    qkv = cfg.q_width + 2 * cfg.kv_width
    bias = cfg.mlp_bias  # litgpt's `bias`: proj's and the MLP's
    block = [E, E * qkv] + ([qkv] if cfg.qkv_bias else []) + [cfg.q_width * E] + (
        [E] if bias else []) + [E]
    for fan_in, fan_out in ((E, Dff), (E, Dff), (Dff, E)):
        block += [fan_in * fan_out] + ([fan_out] if bias else [])
    head = [V * E] + ([V] if cfg.lm_head_bias else [])
    return head + [V * E] + block * min(cfg.n_layer, 2) + [E]


__all__ = ["CHUNK_SIZE", "ROPE_CACHE", "check_litgpt", "check_litgpt_config",
           "litgpt_loop", "litgpt_loss_transients", "litgpt_saved", "loss_chunks",
           "parameter_order", "rope_cache_bytes"]
