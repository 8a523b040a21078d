"""What torch.compile saves for backward (`TrainingSetup.compile`): the reference profile's lines
as AOTAutograd's min-cut partitioner changes them.

torch.compile traces a compiled region's forward and backward into one joint graph;
`min_cut_rematerialization_partition` (torch/_functorch/partitioners.py, torch 2.13, the
partitioner Inductor trains with) then saves the cheapest set of tensors from which the
backward can run, recomputing in backward what its rules allow:

- only ops of its allowlist are recomputed (pointwise ops, views, casts, cheap reductions:
  `get_default_op_list`); matmuls, attention kernels and random ops (dropout) never are;
- a tensor the backward reads as a matmul's operand (a Linear's input, for its weight
  gradient) is "materialized in backward" and is saved, not recomputed
  (`ban_recompute_materialized_backward`);
- a reduction whose output is 4x smaller than its input (RMSNorm's rsqrt over the mean of
  squares) is saved (`ban_recompute_reductions`).

So inside a block the partitioner keeps every matmul's input and the outputs that a
non-pointwise backward needs, and drops what an eager block keeps only for pointwise backward
formulas: RMSNorm's `x * rsqrt` (recomputed from the saved input and rsqrt) and a gated MLP's
activation output (silu(gate), recomputed from the saved gate). LayerNorm (native_layer_norm
saves input, mean and rstd) and the ungated MLPs save the same as in eager. Under torchtitan's
op-level checkpointing the recompute tags decide instead: the kept outputs that the backward
reads stay (the block's last Linear's does not: only the residual sum reads it).

`model` compiles the loss too (torchtitan's compile component `loss`): the cross entropy, a
log_softmax and an nll_loss decomposed into pointwise ops and reductions, saves the logits it
was given, each row's maximum and log-sum-exp (fp32, N x 4 each) and the targets, and
recomputes the log-probabilities in backward; torchtune's chunked loss compiles
`compute_cross_entropy`, once per chunk.

Scope (measured against the reference model's blocks compiled with the min-cut partitioner,
tests/test_compile.py): the reference implementation; dense pre-norm blocks without dropout,
q/k norms, post-norms or a parallel residual; SDPA; modes fp32, mixed and bf16 (amp's autocast
weight copies are not modelled under compile); recompute none, op or full.

Under `--impl transformers`, `model` is the Hugging Face Trainer's `torch_compile` (accelerate's
`prepare_model` wraps the whole model in torch.compile; TRL, LLaMA-Factory and axolotl set it):
the same rules on transformers' Llama / Mistral / Qwen2 blocks, ForCausalLMLoss inside the
compiled forward (`compiled_transformers_lines`), and the compiled backward handed zeros for
the outputs the Trainer drops (`compiled_transformers_loss_transients`), in fp32, bf16, mixed
and amp (the fp32 model under bf16 autocast), with PEFT's LoRA added before the compile
(`compiled_transformers_lora_lines`); measured on transformers' own models (tests/test_compile_transformers.py), refused elsewhere
(`check_compile_transformers`).

LoRA (torchtune's LoRA recipes with compile on: the adapters added, then each block compiled):
the partitioner's rules meet the frozen base's, and the eager LoRA lines
(`finetune.finetune_saved`) applied to the compiled ones are what the compiled blocks save,
measured on the reference model with PEFT-shaped adapters (tests/test_compile.py): RMSNorm
blocks, a 16-bit base, recompute none or full. A first block whose first adapter is gate or
up keeps what the compiled MLP keeps for it: gate's output (silu's recomputed), and up's
output where gate is adapted. Outside that scope the compiled block's saved set differs (a
frozen LayerNorm saves its normalized output and one statistic where the partitioner finds
that cheaper) and the combination is refused.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..recompute import block_linears
from ..training_setup import TrainingSetup
from ..workload import Workload


def check_compile(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """ConfigError("compile") for a set-up whose compiled blocks are not modelled."""
    if setup.compile == "none":
        return
    if setup.impl == "transformers":
        check_compile_transformers(cfg, setup)
        return
    why = None
    if setup.impl != "reference":
        why = "--impl reference or transformers (the compiled model is the reference model or " \
              "a transformers causal LM)"
    elif setup.mode == "amp":
        why = "--mode fp32, mixed or bf16 (autocast's weight copies are not modelled compiled)"
    elif setup.recompute == "selective":
        why = "--recompute none, op or full (torchtitan's compiled blocks)"
    elif setup.attn_impl != "sdpa":
        why = "--attn sdpa"
    elif cfg.dropout or cfg.n_expert or cfg.mla or cfg.post_norm or cfg.parallel_residual \
            or cfg.qk_norm != "none" or not cfg.pre_norm:
        why = ("dense pre-norm blocks without dropout, q/k norms, post-norms or a parallel "
               "residual")
    elif setup.loss == "fused":
        why = "--loss standard or chunked (Liger's fused loss is a Triton kernel)"
    if why:
        raise ConfigError("compile", f"--compile {setup.compile} is modelled for {why}")
    if not setup.lora_rank:
        return
    if setup.base_dtype == "nf4":
        why = "LoRA on a 16-bit base, not with --weights-dtype nf4 (QLoRA's NF4 matmuls)"
    elif cfg.norm != "rmsnorm":
        why = ("LoRA on RMSNorm blocks: a frozen LayerNorm's saved tensors follow the "
               "partitioner's tie-breaks, not modelled")
    elif setup.recompute == "op":
        why = "LoRA under --recompute none or full"
    elif setup.recompute == "full" and set(setup.lora_targets) == {"lm_head"}:
        why = "LoRA with a block Linear among the targets under --recompute full"

    if why:
        raise ConfigError("lora_rank", f"--compile {setup.compile} with --lora-rank is "
                                       f"modelled for {why}")


# the transformers classes whose whole-model compile is measured (tests/
# test_compile_transformers.py): LlamaForCausalLM, MistralForCausalLM (Llama's network) and
# Qwen2ForCausalLM, as `profile_transformers.transformers_family` names them
COMPILED_TRANSFORMERS = ("llama", "qwen2")


def check_compile_transformers(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """ConfigError for `--compile` under `--impl transformers` outside what is measured: the
    Hugging Face Trainer's `torch_compile` (accelerate wraps the whole model in torch.compile,
    the loss inside its forward) on Llama / Mistral / Qwen2 blocks without dropout, SDPA,
    modes fp32, bf16, mixed or amp, recompute none or full, the standard loss, LoRA without
    dropout, DoRA or a quantized base (`compiled_transformers_lora_lines`), no float8. One
    line naming both options."""
    from .profile_transformers import transformers_family

    why = None
    if setup.compile != "model":
        why = ("--compile model (the Trainer's torch_compile compiles the whole model; "
               "per-block compile is torchtitan's, --impl reference)")
    elif transformers_family(cfg) not in COMPILED_TRANSFORMERS or cfg.dropout:
        why = "Llama, Mistral and Qwen2 blocks without dropout"
    elif setup.recompute not in ("none", "full"):
        why = "--recompute none or full (gradient_checkpointing_enable)"
    elif setup.recompute == "full" and cfg.n_layer < 2:
        # one checkpointed layer: the partitioner keeps the causal mask's bool form or the
        # position ids by its tie-breaks, not modelled
        why = "--recompute full with 2 or more layers"
    elif setup.attn_impl != "sdpa":
        why = "--attn sdpa"
    elif setup.loss != "standard":
        why = "--loss standard (transformers' ForCausalLMLoss)"
    elif setup.lora_rank and setup.lora_dropout:
        why = "--lora-rank without --lora-dropout (compiled dropout masks are not measured)"
    elif setup.lora_rank and (setup.base_dtype != "same" or setup.kbit_prepare or setup.dora):
        why = ("PEFT's LoRA on the model's own weights, not QLoRA, k-bit preparation or DoRA "
               "(not measured compiled)")
    elif setup.float8 != "none":
        why = "--float8 none"
    elif setup.offload_activations:
        why = "activations kept on the device, not with --offload-activations"
    if why:
        raise ConfigError("compile", f"--compile {setup.compile} with --impl transformers is "
                                     f"modelled for {why}")


def compiled_transformers_lines(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                                lines: dict[str, int]) -> dict[str, int]:
    """The transformers profile's saved lines (`profile_transformers.transformers_saved`,
    Llama / Mistral / Qwen2) with the whole model compiled as the Hugging Face Trainer's
    `torch_compile` compiles it (accelerate's `torch.compile(model)`; the labels passed, so
    ForCausalLMLoss, logits.float() and the cross entropy, runs inside the compiled forward).

    recompute none, what the min-cut partitioner changes (the rules of the module docstring):
      embedding/rotary_cos_sin  0         recomputed in backward from the position ids
      */ln_*/input              N E a     LlamaRMSNorm's x.float() is recomputed from the
                                          16-bit residual it reads (eager: its fp32 copy)
      */ln_*/normalized         gone      x * rsqrt, recomputed from the input and rsqrt
      layer/mlp/hidden          3 N Dff a of the eager 4 (silu(gate) recomputed)
    recompute full (gradient_checkpointing_enable, the cache off): each layer's input but the
    first's (the embedding's output, recomputed from the token ids), (L - 1) N E a, and per
    layer the generator state the compiled checkpoint saves (`RNG_STATE_BYTES`); beside them
    the causal mask the traced model builds, b S^2 in the model's dtype (torch 2.13 Dynamo:
    transformers does not skip it while compiling), bound into every layer's recomputation
    (L >= 2: one layer is refused, its mask kept by the partitioner's tie-breaks);
    the rotary cos/sin and position ids are recomputed, not kept; ln_f as above.
    amp (fp32 weights, the forward under bf16 autocast; the residual stream fp32, r = 4):
    every 16-bit weight copy autocast makes stays saved (the eager `weight_copy/` lines: the
    partitioner recomputes no cast of a weight; recompute full, lm_head's alone); recompute
    none, the fp32 residual at every layer's ln_1 (the first: the embedding's output) and ln_2
    but the first layer's, which is recomputed from that layer's input and its o_proj output
    (N E a, kept), 2 L N E r with ln_f's; one 16-bit copy of ln_1's (ln_2's) output feeds
    q, k and v (gate and up), L N E a each, not a cast per Linear; recompute full, the block
    inputs and ln_f's input at r.
    Both: the loss as `compiled_loss_lines` (logits N V a, row max and log-sum-exp, fp32 N
    each, instead of log_probs) plus nll_loss's decomposed `target != -100` mask (bool, N) and
    its (N, 1) int64 target index, 8 N (eager: a view of the padded labels, 8 (S + 1) for b 1);
    the mean's divisor, the fp32 count (4), or for N < 4 tokens the bool it sums (N).

    Measured (tests/test_compile_transformers.py: transformers 5.24, torch 2.13, CPU, the
    graphs partitioned as Inductor partitions them; amp with the compiled model called under
    torch.autocast(bf16)): exact. CUDA is the same graph: its
    attention lines are the eager profile's (SDPA runs causal without a mask under recompute
    none)."""
    N, E, L, S, b = workload.tokens, cfg.n_embd, cfg.n_layer, workload.seq_len, \
        workload.batch_size
    a = setup.act_bytes
    if cfg.sliding_window is not None and S >= cfg.sliding_window:
        raise ConfigError("compile", "--compile model with --impl transformers is modelled for "
                                     "sequences shorter than the sliding window (a window's "
                                     "mask under compile is not measured)")
    out = dict(lines)
    amp = setup.mode == "amp"
    r = 4 if amp else a  # the residual stream's dtype is the weights' (fp32 under amp)
    out["embedding/rotary_cos_sin"] = 0  # recomputed in backward from the position ids
    norms = [("final/ln_f", 1)]
    if setup.recompute == "full":
        # the first layer's input is the embedding's output, recomputed from the token ids
        out["layer/block_input"] = (L - 1) * N * E * r
        out["layer/rng_state"] = L * RNG_STATE_BYTES[setup.device]
        out["embedding/position_ids"] = 0  # an arange, recomputed
        # the mask in the model's dtype, which every layer's recomputation reads
        out["embedding/attention_mask"] = b * S * S * a
    elif amp:
        # autocast: one 16-bit copy of a norm's fp32 output feeds q, k and v (gate and up),
        # not a cast per Linear; the fp32 residual kept at every layer's ln_1 (the first: the
        # embedding's output) and at ln_2 but the first layer's, which is recomputed from the
        # first layer's input and its o_proj output (16-bit, kept)
        norms += [("layer/ln_1", L), ("layer/ln_2", L - 1)]
        out["layer/attn/qkv_input"] = L * N * E * a
        out["layer/mlp/fc_input"] = L * N * E * a
        out["layer/attn/o_proj_output"] = N * E * a  # the first layer's only
        out["layer/mlp/hidden"] = out["layer/mlp/hidden"] * COMPILED_HIDDEN[cfg.mlp] // 4
    else:
        norms += [("layer/ln_1", L), ("layer/ln_2", L)]
        out["layer/mlp/hidden"] = out["layer/mlp/hidden"] * COMPILED_HIDDEN[cfg.mlp] // 4
    for name, n in norms:
        out[f"{name}/input"] = n * N * E * r
        out.pop(f"{name}/normalized", None)
    out = compiled_loss_lines(cfg, workload, setup, out)
    out["cross_entropy/ignore_mask"] = N  # bool: target != ignore_index (-100)
    # the mean's divisor: the fp32 count, or below 4 tokens the (N,) bool it is summed from
    # (the partitioner saves the smaller and recomputes the other)
    out["cross_entropy/total_weight"] = min(4, N)
    out["input/labels"] = 8 * N
    return out


# the generator state a compiled checkpointed block saves: CPU, torch.get_rng_state() (the
# mt19937 state, 5,056 bytes, measured); CUDA, torch.cuda.get_rng_state(), the Philox seed and
# offset (8 + 8 bytes: CUDAGeneratorImpl::get_state, aten/src/ATen/cuda/CUDAGeneratorImpl.cpp)
RNG_STATE_BYTES = {"cpu": 5056, "cuda": 16}

# a compiled MLP's saved (tokens x d_ff) tensors by kind: the up projection's output (and the
# gate's), the down projection's input; gated: gate, up, act(gate) * up (act(gate) recomputed)
COMPILED_HIDDEN = {"relu": 1, "gelu": 2, "gelu_tanh": 2, "swiglu": 3, "geglu": 3}


def compiled_block_lines(cfg: GPTConfig, setup: TrainingSetup, lines: dict[str, int]
                         ) -> dict[str, int]:
    """The layer lines of compiled blocks from the eager profile's (`lines`, all L layers).

    recompute none: RMSNorm's `normalized` lines (x * rsqrt) are gone; a gated MLP keeps 3
    (tokens x d_ff) tensors of the eager 4 (silu(gate) or gelu(gate) recomputed from gate).
    op: the kept output of the block's last Linear is gone (only the residual sum reads it).
    full: the block's input, as in eager, and the random generator's state, which the
    compiled checkpoint saves per block (`RNG_STATE_BYTES`).
    """
    out = dict(lines)
    if setup.recompute == "op":
        last = block_linears(cfg)[-1].name
        out.pop(f"layer/op/{last}", None)
        return out
    if setup.recompute == "full":
        out["layer/rng_state"] = cfg.n_layer * RNG_STATE_BYTES[setup.device]
        return out
    if cfg.norm == "rmsnorm":
        out.pop("layer/ln_1/normalized", None)
        out.pop("layer/ln_2/normalized", None)
    if cfg.mlp in GATED_MLPS and "layer/mlp/hidden" in out:
        out["layer/mlp/hidden"] = out["layer/mlp/hidden"] * COMPILED_HIDDEN[cfg.mlp] // 4
    return out


def compiled_loss_lines(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                        lines: dict[str, int]) -> dict[str, int]:
    """The cross entropy's lines when the loss is compiled (`model`): the logits it reads,
    N V in the compute dtype (the standard loss's whole logits, or the chunked loss's chunks),
    each row's maximum and log-sum-exp (N x 4 each) instead of the fp32 log-probabilities.
    The loss's scalars stay: the standard loss's total weight, one per chunk of the chunked
    loss (`reduction="sum"` keeps none: 0) and the count it divides by."""
    N, V, a = workload.tokens, cfg.vocab_size, setup.act_bytes
    out = {k: v for k, v in lines.items() if k != "cross_entropy/log_probs"}
    out["cross_entropy/logits"] = N * V * a
    out["cross_entropy/row_max"] = 4 * N
    out["cross_entropy/logsumexp"] = 4 * N
    if setup.loss == "chunked":  # reduction "sum": the compiled nll keeps no total weight
        out["cross_entropy/total_weight"] = 0
    return out


def compiled_lines(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                   lines: dict[str, int]) -> dict[str, int]:
    """The profile's saved lines (one micro-batch, unsharded) under `setup.compile`."""
    if setup.compile == "none":
        return lines
    check_compile(cfg, setup)
    if setup.impl == "transformers":
        return compiled_transformers_lines(cfg, workload, setup, lines)
    out = compiled_block_lines(cfg, setup, lines)
    if setup.compile == "model":
        out = compiled_loss_lines(cfg, workload, setup, out)
    return out


def compiled_loss_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                             ) -> dict[str, int]:
    """A compiled loss beside its saved tensors, per device (vocabulary shard V'), as Inductor
    runs it: the forward's upcast, maximum, exponentials' sum and gather fuse into reductions
    that write N numbers each, so no N x V' tensor is made (forward 0); the backward's fused
    kernel writes the logits' gradient in their dtype from the saved logits and statistics,
    N V' a (chunked: a chunk's rows_j V' a while the chunks done hold gradients where their
    logits were freed, so the largest chunk; then the head's weight-gradient sum over the
    chunks, as `losses.chunked_loss_transients` counts it, against the freed logits). The
    buffers are those of Inductor's generated code for the loss (torch 2.13, CPU): forward,
    two N x 1 fp32 and the scalars; backward, an N x 1 fp32 and the N x V' gradient
    (tests/test_compile.py reads them); the chunked loss's moments are modelled, not measured."""
    if setup.impl == "transformers":
        return compiled_transformers_loss_transients(cfg, workload, setup)
    V, a = -(-cfg.vocab_size // setup.tp), setup.act_bytes
    if setup.loss != "chunked":
        return {"forward": 0, "backward": workload.tokens * V * a}
    from .losses import chunk_row

    n = setup.loss_chunks
    largest = chunk_row(workload, n, 0) * V * a  # the first chunk is the widest
    if n > 1 and not setup.lora_rank:
        head = 3 * V * cfg.embd_dim * a - (chunk_row(workload, n, -1)
                                           + chunk_row(workload, n, -2)) * V * a
        largest = max(largest, head)
    return {"forward": 0, "backward": largest}


def compiled_transformers_loss_transients(cfg: GPTConfig, workload: Workload,
                                          setup: TrainingSetup) -> dict[str, int]:
    """The whole compiled transformers model's loss beside its saved tensors, per device
    (vocabulary shard V'): forward 0 (as `compiled_loss_transients`); backward, at the compiled
    backward's start: autograd hands it a zero-filled gradient for every output the loop did
    not differentiate, the logits (N V' a) and, with the cache on (recompute none), every
    layer's DynamicCache key and value (2 L N Dkv a), then its first fused kernel writes the
    logits' gradient (N V' a) and a row buffer (N x 1 fp32) while the saved logits and those
    zeros are alive:

        backward = 2 N V' a + 4 N + 2 L N Dkv a  (recompute none)

    Read off Inductor's generated backward (torch 2.13, CPU: `tangents_*` inputs, buf0 and
    buf1 of the loss kernel) and measured with the allocator's running total
    (tests/test_compile_transformers.py)."""
    N, a, L = workload.tokens, setup.act_bytes, cfg.n_layer
    V = -(-cfg.vocab_size // setup.tp)
    cache = 2 * L * N * cfg.kv_width * a if setup.recompute == "none" else 0
    return {"forward": 0, "backward": 2 * N * V * a + 4 * N + cache}


# the adapters of one layer that read the same tensor: ln_1's output (q, k, v), ln_2's (gate,
# up), by gptcalc's names or transformers' (q_proj, ...)
SHARED_INPUT_ADAPTERS = (("q", "k", "v"), ("gate", "up"))


def compiled_transformers_lora_lines(setup: TrainingSetup, lines: dict[str, int]
                                     ) -> dict[str, int]:
    """The LoRA lines (`finetune.finetune_saved`) of the compiled transformers model: under
    autocast (mode amp, fp32 adapters) eager PEFT casts each adapter's input to fp32 and
    autocast casts it back, a 16-bit copy per adapter (`finetune.adapter_copies`); compiled,
    the adapters reading the same tensor share one copy (the graph's casts of one tensor are
    one), so of q, k, v (gate, up) only the first adapted keeps `lora_A_input`. Elsewhere
    (fp32, bf16, mixed; recompute full) the eager lines on the compiled ones are what the
    compiled model saves. Measured on transformers' Llama wrapped by PEFT and compiled
    (tests/test_compile_transformers.py): exact."""
    if setup.impl != "transformers" or setup.compile != "model":
        return lines
    out = dict(lines)
    for group in SHARED_INPUT_ADAPTERS:
        keys = [key for n in group for name in (n, f"{n}_proj")
                if (key := f"lora/{name}/lora_A_input") in out]
        for key in keys[1:]:
            out[key] = 0
    return out


def loss_saves_logits(setup: TrainingSetup) -> bool:
    """Whether the loss saves the logits for its backward (a compiled loss): then they are a
    saved line, alive until the loss's backward whatever the training loop does."""
    return setup.compile == "model" and setup.loss != "fused"


__all__ = ["COMPILED_HIDDEN", "COMPILED_TRANSFORMERS", "RNG_STATE_BYTES", "check_compile",
           "check_compile_transformers", "compiled_block_lines", "compiled_lines",
           "compiled_transformers_lines", "compiled_transformers_loss_transients",
           "compiled_transformers_lora_lines", "SHARED_INPUT_ADAPTERS",
           "compiled_loss_lines", "compiled_loss_transients",
           "loss_saves_logits"]
