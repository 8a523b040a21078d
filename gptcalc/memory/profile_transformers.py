"""What Hugging Face transformers' causal LMs save for backward, and hold around the loss.

The `transformers` implementation profile: the same saved-tensor table as the reference model's
(`embedding/...`, `layer/...` summed over the L layers, `final/...`, `cross_entropy/...`,
`input/...`), for the classes people fine-tune: GPT2LMHeadModel, GPTNeoXForCausalLM,
LlamaForCausalLM, MistralForCausalLM (with its sliding window), Qwen2ForCausalLM,
Qwen3ForCausalLM (q/k norms), Phi3ForCausalLM (fused qkv_proj and gate_up_proj: the same
lines as Llama's, o_proj's input a copy as in NeoX), Gemma2ForCausalLM (eager, its only path: soft-capped scores and
logits) and Gemma3ForCausalLM (gemma3_text: q/k norms, a local and a global rotary embedding,
sliding layers with a mask once S >= window), MixtralForCausalLM and Qwen3MoeForCausalLM (their
experts on transformers' default grouped_mm path, not experts_implementation="eager") and
DeepseekV3ForCausalLM (MLA, dense first layers, group-limited sigmoid routing, shared experts)
and BloomForCausalLM (ALiBi added by baddbmm, word_embeddings_layernorm, fused query_key_value,
dropout_add after each branch; eager attention only: transformers 5.24 gives BLOOM no SDPA path);
other families (Qwen2-MoE's gated shared expert, gpt-oss, Gemma 1, OLMo 2, ...) raise a
ConfigError naming --impl, run as `model(input_ids,
labels=labels)` in train mode with the config's defaults (`use_cache=True`: a DynamicCache holds a
copy of every layer's key and value; `attn_implementation` "sdpa", or "eager" = attn_impl manual).

Measured (saved_tensors_hooks deduplicated by storage; transformers 5.23, torch 2.13, CPU):
fp32 and bf16 weights, sdpa and eager, dropout 0 and > 0, b and H 1 or more, every family
(Gemma 2 and BLOOM: eager only, as transformers runs them; Gemma 3: both; BLOOM also under
bf16 autocast and with recompute full: tests/test_bloom_transformers.py):
exact (tests/test_transformers_twin.py). Documented only (not measurable here): device cuda,
where nn.Dropout saves a 1-byte bool mask (native_dropout), LayerNorm statistics are fp32, and
SDPA always runs a fused kernel (flash for 16-bit: q, k, v, out and an fp32 logsumexp b x H x S;
memory-efficient for fp32: its logsumexp padded to a multiple of 32 queries), dropout included.
Derived from torch.autocast's rules, not measured: mode amp (fp32 weights, bf16 compute): the
residual stream, the norms (input and normalized output) and their statistics stay fp32, and
every Linear casts its own 16-bit copy of its input (separate q/k/v projections three, SwiGLU's
gate and up two); mode mixed is counted as bf16 weights. Not modelled: recompute selective
(transformers has no attention-only checkpointing).

Recomputation (measured on GPT-2, GPT-NeoX, Llama, Qwen2, Gemma 2/3 and Mixtral layers): `full`
is what `gradient_checkpointing_enable()` (now `activation_checkpointing_enable()`) does with
transformers 5.23's defaults: torch.utils.checkpoint(use_reentrant=False) around every decoder
layer's forward, the cache turned off. Kept: each layer's hidden-state input, and what
transformers binds into the recomputed call as keyword arguments, one tensor for all layers:
the rotary cos/sin, the position ids, and the attention masks (eager: one per layer type;
SDPA: a sliding window's, once it cuts keys off). `op` wraps the layers the same way with
torchtitan's op-level policy as the checkpoint's context_fn
(`profile_reference.op_block_lines`: every other mm output, the fused SDPA kernel's output and
logsumexp); not for MoE layers.

One line per saved tensor (N = b*S tokens, a = activation bytes, r = the residual stream's bytes,
E width, Dq = H*hd, Dkv = n_kv_head*hd, Dff = d_ff, V vocabulary, CPU fp32 shapes):

    embedding/positions       S * 8          GPT-2 wpe's position ids (1, S) int64
    embedding/rotary_cos_sin  2 * S * R * r  cos, sin (1, 1, S, R) shared by all layers, R = rotary dims
                              (Gemma 3: one pair per layer type present, sliding and global)
    embedding/dropout_mask    N * E * a      nn.Dropout's float mask (GPT-2, NeoX)
    embedding/ln_emb/...      as ln_1        BLOOM's word_embeddings_layernorm
    layer/ln_1/...            LayerNorm: input N*E*r, mean N*4, rstd N*4;
                              RMSNorm: fp32 input N*E*4, rsqrt N*4, normalized N*E*a;
                              Gemma's RMSNorm, all fp32: input N*E*4, rsqrt N*4,
                              normalized N*E*4, weight E*4 (its 1 + weight.float())
    layer/attn/qkv_input      N * E * a      the q/k/v projections' shared input (the norm's output)
    layer/attn/{q,k}_norm/... Qwen3's RMSNorm of each q (k) head: fp32 input N*Dq*4 (N*Dkv*4),
                              rsqrt N*H*4 (N*n_kv_head*4), normalized N*Dq*a (N*Dkv*a);
                              Gemma 3: Gemma's norm, normalized fp32, weight hd*4
    sdpa (fused kernel, dropout 0 on CPU):
    layer/attn/q              N * Dq * a     rotary output; GPT-2: a view of c_attn's N*3E output
    layer/attn/k, attn/v      N * Dkv * a    the cache's copies (torch.cat in DynamicCache.update)
    layer/attn/logsumexp      b * H * S * 4
    layer/attn/window_mask    b * S^2 * a    Mistral's sliding-window mask once S >= window (then
                              k and v are repeat_kv's N*Dq copies: no enable_gqa with a mask)
    layer/attn/sdpa_out       N * Dq * a     shared with o_proj's input, except NeoX (its rotary cat
                              lays q out as (b, H, S, hd): transpose(1, 2).contiguous() copies)
    eager, or sdpa with dropout on CPU (the math path; 16-bit inputs computed in fp32, m = 4):
    layer/attn/q, k_t, v      N * Dq * m     matmul's contiguous copies (or repeat_kv's outputs);
                              GPT-2 eager with b or H = 1: q is c_attn's N*3E output;
                              BLOOM: q as GPT-2's (also at S = 1), saved by baddbmm with k (the
                              ALiBi bias is its `self`, not saved); k and v the cache's copies
                              eager with one KV head and b = 1: k and v are views of it, N*Dkv
    layer/attn/softcap_tanh   b * H * S^2 * a  Gemma 2's tanh(scores / cap) output (eager only)
    layer/attn/softmax        b * H * S^2 * 4  eager softmax(dtype=float32) (GPT-2: in its input dtype)
    layer/attn/probs          b * H * S^2 * a  eager .to(query.dtype) when 16-bit, without dropout
    layer/attn/dropout_mask   b * H * S^2 * a  float mask (CPU), 1 byte on CUDA
    layer/attn/dropped        b * H * S^2 * a  the dropped probabilities att @ v saves
    layer/attn/out_input      N * Dq * a     o_proj's input (a copy unless shared with sdpa_out)
    layer/attn/resid_dropout_mask N * E * a  GPT-2 resid_dropout, NeoX post_attention_dropout,
                              BLOOM's dropout_add (F.dropout) on dense's output
    layer/ln_post_attn/...    Gemma's post_attention_layernorm on o_proj's output, as its ln_1
    layer/ln_2/...            as ln_1; NeoX's parallel residual reads the block input ln_1 saved
    layer/mlp/fc_input        N * E * a      up (and gate) projection input
    layer/mlp/hidden          k * N * Dff * a  relu 1 (its output), gelu 2 (input, output; BLOOM's
                              GeLUFunction saves its input, dense_4h_to_h the output),
                              gelu_new 5 (x for pow, tanh output, 0.5x, 1 + tanh, output),
                              SwiGLU 4 (gate output, silu output, up output, product),
                              GeGLU (gelu_pytorch_tanh, one fused op) 4 likewise
    layer/mlp/dropout_mask    N * E * a      GPT-2 mlp.dropout, NeoX post_mlp_dropout, BLOOM's
                              dropout_add on dense_4h_to_h's output
    MoE layers (Mixtral, Qwen3-MoE; X experts, top k, Nk = N*k, F expert width), instead of
    mlp/hidden (mlp/fc_input is the router's and the experts' shared input):
    layer/moe/router_probs    N * X * 4      softmax of the fp32 router logits
    layer/moe/topk_indices    Nk * 8         topk's int64 indices
    layer/moe/topk_norm       N*4 + Nk*4     the renormalising sum and top-k values (Mixtral;
                              Qwen with norm_topk_prob)
    layer/moe/gather_index    3 * Nk * 8     int64 index of the sorted token copies, of the
                              sorted weights, and of the inverse permutation
    layer/moe/offsets         X * 4          grouped_mm's int32 offsets
    layer/moe/expert_input    Nk * E * a     the token copies sorted by expert
    layer/moe/hidden          4 * Nk * F * a  gate_up output (2F), silu output, product
    layer/moe/routing_weights Nk * 4         sorted weights (Qwen3-MoE: Nk * a)
    layer/moe/expert_output   Nk * E * a     down_proj's output, weighted
    DeepSeek-V3 (G = n_group, T = topk_group; its router is a sigmoid, weights fp32):
    layer/moe/group_topk      N*G*2*8 + N*T*8 + N*X  the per-group top-2 and chosen-group int64
                              indices, masked_fill's bool mask
    layer/moe/router_fp32_copy N*E * 4      F.linear(x.float(), weight): the input's fp32 copy,
                              16-bit (the router weight itself is kept fp32)
    layer/moe/shared_hidden   4 * N * Fs * a  the shared experts' SwiGLU (Fs = n_shared * F)
    layer/attn/... MLA (ql q_lora_rank, kvl kv_lora_rank, qk = nope + rope, v head widths):
      q_a_norm/..., q_b_input  Llama RMSNorm of N*ql, q_b_proj's input N*ql*a (with q LoRA)
      kv_a_norm/input          N*(kvl + rope)*4 in fp32 (a view of kv_a_proj's output),
                               N*kvl*4 when 16-bit; rsqrt N*4, normalized N*kvl*a
      kv_b_input               N * kvl * a   the cache's copy of the latent
      fused SDPA (qk = v): q, k N*H*qk*a, v N*H*(nope+v)*a (a view of kv_b_proj's output),
      logsumexp, sdpa_out and o_proj's copy N*H*v*a; otherwise the math/eager lines above,
      with v the whole kv_b_proj output where b or H = 1 and nothing casts it
    layer/ln_post_mlp/...     Gemma's post_feedforward_layernorm (its pre_feedforward is ln_2)
    final/ln_f/...            as ln_1
    final/lm_head_input       N * E * a
    final/logit_softcap_tanh  N * V * a      Gemma 2's tanh(logits / cap) output
    cross_entropy/log_probs   N * V * 4      ForCausalLMLoss upcasts logits to fp32: log_softmax's output
    cross_entropy/total_weight 4             nll_loss's fp32 scalar
    recompute full and op, instead of the layer lines above:
    layer/block_input         N * E * r      each layer's input, saved by the checkpoint
    layer/op/...              `op_block_lines` (op only)
    embedding/position_ids    S * 8          bound into every recomputation (not GPT-2)
    embedding/attention_mask  b * S^2 * r    eager's mask per layer type, likewise, in the
                              embeddings' dtype (SDPA: a window's bool S^2 once S >= window)
    embedding/alibi           b * H * S * r  BLOOM's ALiBi bias (b * H, 1, S), likewise (BLOOM
                              has no position ids)
    Liger's kernels (--liger; Llama, Mistral, Qwen2), instead of the lines they replace:
    .../{ln_1,ln_2,ln_f}/     LigerRMSNorm: input N*E*r (the stream itself, no fp32 copy),
                              rstd N*4 (fp32); nothing normalized
    layer/mlp/hidden          LigerSwiGLUMLP: 3 * N * Dff * a (gate and up outputs, the product)
    rope                      no line changes: liger_rotary_pos_emb rotates q and k in place
                              (sdpa's q is q_proj's output) and saves the cos/sin counted above
    input/idx                 N * 8          the embedding's int64 indices
    input/labels              N * 8          the shifted labels (pad + [..., 1:].contiguous());
                              b = 1: (S + 1) * 8, a view of the padded labels
"""

from __future__ import annotations

import math
from typing import Any

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..layers import moe_layers, sliding_layers
from ..training_setup import liger_kernels
from .profile_reference import op_block_lines

# transformers' gptcalc-shaped families; gelu_tanh is read as GPT-2's `gelu_new` (Python, saves
# three more N x Dff tensors than a fused GELU)
FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2",
            "gemma3_text", "mixtral", "qwen3_moe", "deepseek_v3", "bloom")
_SDPA_GQA_MAX_HEAD_DIM = 256  # transformers' use_gqa_in_sdpa: enable_gqa only up to this head dim


def _gemma(cfg: GPTConfig) -> bool:
    """Gemma 2/3's block: RMSNorm (1 + weight) before and after each branch, GeGLU, rotary."""
    return (cfg.norm == "rmsnorm" and cfg.mlp == "geglu" and cfg.pre_norm and cfg.post_norm
            and cfg.qkv_layout == "separate" and cfg.pos_embedding == "rotary"
            and not cfg.parallel_residual)


def _bloom(cfg: GPTConfig) -> bool:
    """BLOOM's block (BloomForCausalLM): ALiBi, an embedding LayerNorm, fused biased
    query_key_value, LayerNorms, a 4E tanh-GELU MLP with biases, multi-head attention of
    E / H wide heads (BloomAttention and BloomMLP fix those widths)."""
    return (cfg.pos_embedding == "alibi" and cfg.embd_norm and cfg.qkv_layout == "fused"
            and cfg.norm == "layernorm" and cfg.mlp == "gelu_tanh" and cfg.pre_norm
            and not (cfg.post_norm or cfg.parallel_residual or cfg.moe or cfg.mla
                     or cfg.embd_dropout or cfg.sliding_window is not None)
            and cfg.qk_norm == "none" and cfg.kv_heads == cfg.n_head
            and cfg.head_size * cfg.n_head == cfg.n_embd and cfg.ffn_dim == 4 * cfg.n_embd
            and cfg.qkv_bias and cfg.attn_out_bias and cfg.mlp_bias)


def _not_modelled(cfg: GPTConfig) -> list[str]:
    """Switches of `cfg` whose transformers modules this profile has not measured."""
    gemma = _gemma(cfg)
    bloom = _bloom(cfg)
    deepseek = (cfg.mla and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.pre_norm
                and not cfg.post_norm and cfg.qk_norm == "none" and cfg.sliding_window is None)
    moe = cfg.moe and not (cfg.shared_expert_gate or cfg.router_bias or cfg.expert_bias
                           or cfg.mlp != "swiglu")
    moe = moe and (deepseek or not (cfg.n_shared_expert or cfg.moe_first_dense))
    used = (("a mixture of experts beyond Mixtral's, Qwen3-MoE's and DeepSeek-V3's",
             cfg.moe and not moe),
            ("multi-head latent attention outside DeepSeek-V3", cfg.mla and not deepseek),
            # DeepseekV2TopkRouter: softmax and its own group-limited top-k, not measured
            ("DeepSeek-V2's router", cfg.moe and cfg.hf_model_type == "deepseek_v2"),
            ("post-norms", (cfg.post_norm or not cfg.pre_norm) and not gemma),
            ("a shared parallel norm", cfg.shared_norm),
            (f"q/k norm {cfg.qk_norm!r}", cfg.qk_norm not in ("none", "head")),
            ("a pattern of global and sliding layers",
             "G" in cfg.attn_pattern.upper() and not gemma),
            ("attention sinks", cfg.attn_sinks),
            ("ALiBi outside BLOOM", cfg.pos_embedding == "alibi" and not bloom),
            ("GeGLU without Gemma's post-norms", cfg.mlp == "geglu" and not gemma),
            ("soft-capping outside Gemma", (cfg.attn_softcap or cfg.logit_softcap) and not gemma),
            ("an embedding norm outside BLOOM", cfg.embd_norm and not bloom),
            ("OPT's embedding projections", cfg.embd_proj_dim is not None or cfg.pos_offset))
    return [name for name, on in used if on]


def transformers_family(cfg: GPTConfig) -> str:
    """The transformers model_type implementing `cfg`: gpt2 (learned positions, fused q/k/v,
    LayerNorm), gpt_neox (rotary, fused q/k/v, LayerNorm), qwen2 (RMSNorm, SwiGLU, separate
    q/k/v with q/k/v bias and no output bias), qwen3 (RMSNorm over each q and k head) or llama
    (the same without that bias pattern; mistral is the same network, with or without its
    sliding window), phi3 (Llama's block with fused qkv_proj and gate_up_proj), bloom (ALiBi
    and an embedding LayerNorm around GPT-2's fused, biased block). Raises ConfigError(field="impl") for switches the profile has not measured
    (MoE, MLA, Gemma's norms and GeGLU, ...) and for a set of switches no class has."""
    missing = _not_modelled(cfg)
    if missing:
        raise ConfigError("impl", f"the transformers profile does not model {', '.join(missing)} "
                                  "(its saved tensors are not measured); use --impl reference")
    if _gemma(cfg):
        return "gemma3_text" if cfg.qk_norm == "head" else "gemma2"
    if _bloom(cfg):
        return "bloom"
    if cfg.mla:
        return "deepseek_v3"
    if cfg.qkv_layout == "fused" and cfg.norm == "layernorm" and cfg.qk_norm == "none":
        if cfg.pos_embedding == "learned":
            return "gpt2"
        if cfg.pos_embedding == "rotary":
            return "gpt_neox"
    if (cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.qkv_layout == "fused"
            and cfg.pos_embedding == "rotary" and not cfg.moe and cfg.qk_norm == "none"):
        return "phi3"
    if cfg.norm == "rmsnorm" and cfg.mlp in GATED_MLPS and cfg.qkv_layout == "separate":
        if cfg.moe:
            return "qwen3_moe" if cfg.qk_norm == "head" else "mixtral"
        if cfg.qk_norm == "head":
            return "qwen3"
        return "qwen2" if cfg.qkv_bias and not cfg.attn_out_bias else "llama"
    raise ConfigError("impl", "no transformers class implements this GPTConfig (use --impl "
                              "reference): gpt2 needs "
                                "learned positions, fused q/k/v and LayerNorm; gpt_neox rotary, "
                                "fused q/k/v and LayerNorm; llama / mistral / qwen2 / qwen3 "
                                "RMSNorm, SwiGLU and separate q/k/v; phi3 RMSNorm, SwiGLU, "
                                "fused q/k/v and rotary")


def _window_mask(cfg: GPTConfig, S: int) -> bool:
    """transformers builds an explicit sliding-window mask only when the window cuts keys off
    (S >= window, as transformers 5.23 decides); otherwise SDPA runs causal without one."""
    return cfg.sliding_window is not None and S >= cfg.sliding_window


def _layer_kinds(cfg: GPTConfig, S: int) -> list[tuple[int, bool]]:
    """(number of layers, whether their attention gets an explicit window mask): the sliding
    layers (L in the pattern) and the global ones."""
    n_slide = sliding_layers(cfg)
    masked = _window_mask(cfg, S)
    return [(n, m) for n, m in ((n_slide, masked), (cfg.n_layer - n_slide, False)) if n]


# the classes with an eager attention only: Gemma 2 (its soft-capping) and BLOOM (ALiBi added
# by baddbmm; BloomPreTrainedModel declares no SDPA or flash support in transformers 5.24)
EAGER_ONLY = ("gemma2", "bloom")


def default_attention(cfg: GPTConfig) -> str:
    """transformers' default attention for `cfg`'s class: Gemma 2 and BLOOM have no SDPA path
    (`EAGER_ONLY`), eager = "manual"; every other family here defaults to "sdpa"."""
    try:
        return "manual" if transformers_family(cfg) in EAGER_ONLY else "sdpa"
    except ConfigError:
        return "sdpa"


def _check(setup: Any, cfg: GPTConfig | None = None) -> None:
    if setup.recompute not in ("none", "op", "full"):
        raise ConfigError("recompute", "transformers checkpoints whole decoder layers only "
                                       "(gradient_checkpointing_enable): recompute none, op "
                                       "or full")
    if setup.recompute == "op" and cfg is not None and _bloom(cfg):
        raise ConfigError("recompute", "recompute op is not measured on BLOOM's blocks (ALiBi "
                                       "through baddbmm): use --recompute none or full")
    if setup.recompute == "op" and cfg is not None and cfg.moe:
        raise ConfigError("recompute", "recompute op keeps every second matmul of a layer, "
                                       "which in an MoE layer depends on the routing; use "
                                       "--recompute none or full")


# the families whose Liger patch (apply_liger_kernel_to_llama / _mistral / _qwen2) this profile
# counts; Mistral's network is Llama's here
LIGER_FAMILIES = ("llama", "qwen2")


def _liger(cfg: GPTConfig, fam: str, setup: Any) -> tuple[str, ...]:
    """The Liger kernels of `setup` (TrainingSetup.liger; none for setups without the field),
    ConfigError(field="liger") where this profile has not measured them."""
    kernels = liger_kernels(getattr(setup, "liger", "none"))
    if kernels and fam not in LIGER_FAMILIES:
        raise ConfigError("liger", f"Liger's kernels are measured on transformers' Llama, "
                                   f"Mistral and Qwen2, not {fam}: --liger none, or --impl "
                                   f"transformers with one of those")
    if kernels and setup.recompute == "op":
        raise ConfigError("liger", "Liger's kernels under --recompute op are not measured: "
                                   "--recompute none or full, or --liger none")
    return kernels


def _check_attention(cfg: GPTConfig, fam: str, setup: Any) -> None:
    if fam == "gemma2" and setup.attn_impl == "sdpa":
        raise ConfigError("attn_impl", "transformers' Gemma2 has no SDPA path (soft-capping): "
                                       "its default is eager attention (attn_impl manual)")
    if fam == "bloom" and setup.attn_impl == "sdpa":
        raise ConfigError("attn_impl", "transformers' BLOOM has no SDPA path (ALiBi through "
                                       "baddbmm): its only attention is eager (attn_impl "
                                       "manual)")


def _norm(cfg: GPTConfig, N: int, a: int, r: int, stats: int, liger: bool = False
          ) -> dict[str, int]:
    E = cfg.n_embd
    if liger:
        # LigerRMSNormFunction (liger_kernel/ops/rms_norm.py, 0.8.5): save_for_backward(X, W,
        # RSTD): the input as it came (the residual stream, r), the weight (a parameter) and
        # one fp32 rstd per row (casting mode "llama"); Y is the next Linear's saved input
        return {"input": N * E * r, "rstd": N * 4}
    if _gemma(cfg):
        # Gemma's RMSNorm computes in fp32 throughout: x.float() (pow and mul save it), the
        # rsqrt, x * rsqrt and (1 + weight.float()) (the product saves both), then type_as(x)
        return {"input": N * E * 4, "rsqrt": N * 4, "normalized": N * E * 4, "weight": E * 4}
    if cfg.norm == "rmsnorm":
        # LlamaRMSNorm: x.to(fp32) (pow and mul save it), rsqrt(mean(x^2) + eps) (N x 1), and
        # the weight multiply saves (x * rsqrt).to(input dtype)
        return {"input": N * E * 4, "rsqrt": N * 4, "normalized": N * E * a}
    return {"input": N * E * r, "mean": N * stats, "rstd": N * stats}  # native_layer_norm


def _moe(cfg: GPTConfig, fam: str, N: int, a: int) -> dict[str, int]:
    """Per MoE layer: the router and the experts of transformers' default grouped_mm path
    (tokens sorted by expert, one torch._grouped_mm per projection). Routing-independent: the
    experts see N * k rows in all, however the router splits them."""
    X, k, F, E = cfg.n_expert, cfg.n_expert_active, cfg.expert_dim, cfg.n_embd
    Nk = N * k
    ds = fam == "deepseek_v3"
    return {
        # DeepSeek-V3: F.linear(x.float(), weight.float()) saves the input's fp32 copy when
        # 16-bit; the weight is no copy: transformers keeps the router's weight in fp32 in every
        # dtype (`_keep_in_fp32_modules_strict`, "gate.weight")
        "router_fp32_copy": N * E * 4 if ds and a != 4 else 0,
        # DeepSeek-V3's group-limited top-k: the per-group top-2 indices (N x groups x 2), the
        # chosen groups (N x topk_group) and the bool mask masked_fill saves (N x X)
        "group_topk": (N * cfg.router_groups * 2 * 8 + N * cfg.router_topk_groups * 8 + N * X
                       if ds else 0),
        # the shared experts: SwiGLU's 4 hidden tensors on every token
        "shared_hidden": 4 * N * cfg.shared_dim * a if ds and cfg.n_shared_expert else 0,
        "router_probs": N * X * 4,  # softmax (DeepSeek: sigmoid) of the fp32 router logits
        "topk_indices": Nk * 8,  # topk's int64 indices
        # top_k /= top_k.sum(-1, keepdim): the sum (N x 1) and the fp32 top-k values
        "topk_norm": N * 4 + Nk * 4 if cfg.router_norm_topk else 0,
        # int64 gathers: hidden[perm // k], weights[perm], out[inv_perm]
        "gather_index": 3 * Nk * 8,
        "offsets": X * 4,  # grouped_mm's int32 cumulative tokens per expert
        "expert_input": Nk * E * a,  # the sorted token copies
        "hidden": 4 * Nk * F * a,  # gate_up output (2F), silu output, the product
        # the sorted routing weights: fp32 in Mixtral, cast to the logits' dtype in Qwen3-MoE
        "routing_weights": Nk * (4 if fam in ("mixtral", "deepseek_v3") else a),
        "expert_output": Nk * E * a,  # down_proj's output, multiplied by the weights
    }


def _mla(cfg: GPTConfig, b: int, S: int, setup: Any) -> dict[str, int]:
    """Per-layer saved bytes of DeepSeek-V3's latent attention, from the q/kv down-projections'
    shared input to o_proj's input. SDPA runs its fused kernel only when query/key and value
    heads are equally wide (and no dropout on CPU); otherwise the decomposed math path."""
    N, a, H = b * S, setup.act_bytes, cfg.n_head
    qk, v, kvl, ql = cfg.qk_head_dim, cfg.v_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    att = b * H * S * S
    lines: dict[str, int] = {}
    if ql is not None:  # q_a_proj -> q_a_layernorm (Llama's RMSNorm) -> q_b_proj
        lines.update({"q_a_norm/input": N * ql * 4, "q_a_norm/rsqrt": N * 4,
                      "q_a_norm/normalized": N * ql * a, "q_b_input": N * ql * a})
    # kv_a_layernorm reads a split of kv_a_proj's output: in fp32, x.float() is that view and
    # keeps the whole kv_lora_rank + rope storage; 16-bit: an fp32 copy of the split
    lines["kv_a_norm/input"] = N * (kvl + cfg.rope_dim if a == 4 else kvl) * 4
    lines["kv_a_norm/rsqrt"] = N * 4
    lines["kv_a_norm/normalized"] = N * kvl * a
    lines["kv_b_input"] = N * kvl * a  # the cache's torch.cat copy of the latent
    cuda = setup.device == "cuda"
    # q/k heads wider than v heads: the flash kernels refuse, CUDA's memory-efficient kernel
    # runs (profile_reference._mem_efficient), the CPU takes the math path
    mem_efficient = setup.attn_impl == "sdpa" and qk != v and cuda
    fused = setup.attn_impl == "sdpa" and qk == v and (cuda or cfg.dropout == 0)
    if fused or mem_efficient:
        lines["q"] = N * H * qk * a  # torch.cat((q_pass, q_rot))
        lines["k"] = N * H * qk * a  # expand_kv's new key tensor
        lines["v"] = N * H * (cfg.nope_dim + v) * a  # a split view of kv_b_proj's output
        lines["logsumexp"] = b * H * (-(-S // 32) * 32 if mem_efficient else S) * 4
        lines["sdpa_out"] = N * H * v * a
        # q comes from a cat in (b, H, S, hd) order, and the flash kernel lays its output out
        # like q: transpose(1, 2).contiguous() copies it for o_proj (as in NeoX); the
        # memory-efficient kernel's output is (b, S, H, v) already, o_proj's input
        lines["out_input"] = N * H * v * a if H > 1 and S > 1 and not mem_efficient else 0
        return lines
    math_path = setup.attn_impl == "sdpa"
    m = 4 if math_path else a
    drop = cfg.dropout > 0
    lines["q"] = N * H * qk * m
    lines["k_t"] = N * H * qk * m
    # v is a split view of kv_b_proj's (b, S, H, nope + v) output: where matmul folds (b, H)
    # as a view too (b or H = 1) and nothing casts it (m = a), it saves that whole storage
    v_view = (b == 1 or H == 1) and m == a
    lines["v"] = N * H * (cfg.nope_dim + v if v_view else v) * m
    lines["softmax"] = att * m if math_path else att * 4
    lines["probs"] = att * a if not math_path and a != 4 and not drop else 0
    if drop:
        lines["dropout_mask"] = att * (1 if setup.device == "cuda" else m)
        lines["dropped"] = att * m
    lines["out_input"] = N * H * v * a
    return lines


def _attention(cfg: GPTConfig, fam: str, b: int, S: int, setup: Any, masked: bool
               ) -> dict[str, int]:
    """Per-layer saved bytes of the attention core (q/k/v storages to o_proj's input);
    `masked`: the layer's attention gets an explicit sliding-window mask."""
    N, a, H = b * S, setup.act_bytes, cfg.n_head
    Dq, Dkv, hd = cfg.q_width, cfg.kv_width, cfg.head_size
    att = b * H * S * S
    drop = cfg.dropout > 0
    cuda = setup.device == "cuda"
    gqa = cfg.kv_heads != H
    fused = setup.attn_impl == "sdpa" and (cuda or not drop)
    lines: dict[str, int] = {}
    if fused:
        # q: rotary's output (a view of c_attn's output in GPT-2, which keeps all of it);
        # k, v: DynamicCache's torch.cat copies, or repeat_kv's H-head copies beyond head dim 256
        lines["attn/q"] = N * (3 * cfg.n_embd if fam == "gpt2" else Dq) * a
        # with an explicit mask (a sliding window that cuts keys off) transformers does not
        # pass enable_gqa: repeat_kv's H-head copies are saved, and the mask in q's dtype
        kv = Dq if gqa and (hd > _SDPA_GQA_MAX_HEAD_DIM or masked) else Dkv
        lines["attn/window_mask"] = b * S * S * a if masked else 0
        lines["attn/k"] = N * kv * a
        lines["attn/v"] = N * kv * a
        # fp32 logsumexp b x H x S; CUDA's memory-efficient kernel (fp32) pads S to 32
        s_lse = 32 * math.ceil(S / 32) if cuda and a == 4 else S
        lines["attn/logsumexp"] = b * H * s_lse * 4
        lines["attn/sdpa_out"] = N * Dq * a
        # the kernel lays its output out like q; NeoX and Phi-3 build q with a cat in
        # (b, H, S, hd) order (their rotary splits off the pass-through dims, even when there
        # are none), so transpose(1, 2).contiguous() copies it for the output projection
        copy = fam in ("gpt_neox", "phi3") and H > 1 and S > 1
        lines["attn/out_input"] = N * Dq * a if copy else 0
        return lines
    math_path = setup.attn_impl == "sdpa"  # CPU, dropout > 0: SDPA's decomposed math path
    m = 4 if math_path else a  # the math path computes 16-bit inputs in fp32 on CPU
    # matmul folds (b, H, S, hd) to (b*H, S, hd): a contiguous copy of q, k^T and v (for a
    # contiguous k or v, such as the cache's copies or repeat_kv's output, a view of it: the
    # same N*Dq bytes, since the cache holds H heads without grouping)
    # GPT-2's q is a view of c_attn's output: where the fold is a view too (b or H = 1) eager
    # matmul saves that whole N*3E storage (the math path scales q into a fresh tensor first);
    # BLOOM's likewise, of query_key_value's output, by baddbmm (its k and v: the cache's
    # copies), and also at S = 1, where (b, H) strides 3E and 3hd merge into a view
    q_view = fam in ("gpt2", "bloom") and not math_path and (
        b == 1 or H == 1 or (fam == "bloom" and S == 1))
    lines["attn/q"] = N * (3 * cfg.n_embd if q_view else Dq) * m
    # one KV head (multi-query): repeat_kv's expand-reshape is a view of the cache's one head
    # (stride 0 over the repeats), and with b = 1 matmul folds it as a view too: that one head
    mqa_view = cfg.kv_heads == 1 and H > 1 and b == 1 and not math_path
    lines["attn/k_t"] = N * (Dkv if mqa_view else Dq) * m
    lines["attn/v"] = N * (Dkv if mqa_view else Dq) * m
    # Gemma's eager soft-capping, cap * tanh(scores / cap): tanh saves its output
    lines["attn/softcap_tanh"] = att * m if cfg.attn_softcap and not math_path else 0
    if math_path or fam == "gpt2":
        lines["attn/softmax"] = att * m  # GPT-2: softmax in its input dtype
        lines["attn/probs"] = 0
    else:
        lines["attn/softmax"] = att * 4  # softmax(..., dtype=torch.float32)
        # .to(query.dtype), saved by att @ v when 16-bit and not dropped (dropout saves its mask)
        lines["attn/probs"] = att * a if a != 4 and not drop else 0
    if drop:
        # CPU F.dropout multiplies by a float mask of the input's dtype; CUDA: native_dropout's bool
        lines["attn/dropout_mask"] = att * (1 if cuda else m)
        lines["attn/dropped"] = att * m
    lines["attn/out_input"] = N * Dq * a  # transpose(1, 2).contiguous(): o_proj's own copy
    return lines


def transformers_saved(cfg: GPTConfig, b: int, S: int, setup: Any) -> dict[str, int]:
    """Bytes transformers saves for backward in one training forward of b sequences x S tokens.

    `setup` is read by attribute: mode (fp32 | bf16), attn_impl (manual = "eager" | sdpa),
    device (cpu | cuda), recompute (none | op | full = gradient_checkpointing_enable),
    act_bytes.
    Keys and lines: the module docstring. Exact on CPU (fp32, bf16) for every b and H.
    """
    _check(setup, cfg)
    fam = transformers_family(cfg)
    _check_attention(cfg, fam, setup)
    liger = _liger(cfg, fam, setup)
    ln = "rms_norm" in liger  # LigerRMSNorm for every RMSNorm of the block and ln_f
    N, a = b * S, setup.act_bytes
    E, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    Dff = cfg.ffn_dim
    cuda = setup.device == "cuda"
    amp = setup.mode == "amp"
    r = 4 if amp else a  # the residual stream's dtype is the weights'
    stats = 4 if (r == 4 or cuda) else a  # CPU LayerNorm keeps bf16 statistics in bf16
    n_out = r if amp else a  # amp: a norm's output is fp32 (the fp32 weight promotes it)
    qkv_casts = 3 if amp and cfg.qkv_layout != "fused" else 1  # autocast: a cast per Linear
    up_casts = 2 if amp and cfg.mlp in GATED_MLPS else 1
    drop = cfg.dropout > 0
    mask = 1 if cuda else a  # nn.Dropout: float mask on CPU, bool on CUDA
    # Llama-shaped models drop attention only; BLOOM's dropout_add drops each branch's output
    resid_drop = drop and fam in ("gpt2", "gpt_neox", "bloom")
    rot = cfg.rotary_dims
    gemma = fam in ("gemma2", "gemma3_text")
    kinds = _layer_kinds(cfg, S)
    # Gemma 3: one rotary embedding per layer type (local and global bases), each its cos, sin
    n_rotary = len(kinds) if fam == "gemma3_text" else 1
    out: dict[str, int] = {
        "embedding/positions": 8 * S if fam == "gpt2" else 0,  # wpe(position_ids): (1, S) int64
        "embedding/rotary_cos_sin": n_rotary * 2 * S * rot * r,
        "embedding/dropout_mask": N * E * mask if resid_drop and fam != "bloom" else 0,
    }
    if fam == "bloom":  # word_embeddings_layernorm on the embedding's output
        out.update({f"embedding/ln_emb/{k}": v for k, v in _norm(cfg, N, n_out, r, stats, ln).items()})
    layer: dict[str, int] = {}
    checkpointed = setup.recompute in ("full", "op")
    if checkpointed:
        layer["block_input"] = N * E * r  # torch.utils.checkpoint keeps each layer's input
        # the keyword arguments bound into every layer's recomputation (one tensor for all
        # layers): position ids (GPT-2's are wpe's, counted above; BLOOM has none) and the
        # attention masks, one per layer type: eager's b x S x S in the embeddings' dtype (fp32
        # under amp); SDPA's only for a window that cuts keys off, a bool S x S broadcast over
        # the batch; BLOOM's ALiBi bias, (b * H, 1, S) in the residual stream's dtype
        out["embedding/position_ids"] = 8 * S if fam not in ("gpt2", "bloom") else 0
        out["embedding/alibi"] = b * cfg.n_head * S * r if fam == "bloom" else 0
        if setup.attn_impl == "manual":
            out["embedding/attention_mask"] = len(kinds) * b * S * S * r
        else:
            out["embedding/attention_mask"] = sum(S * S for _, m in kinds if m)
        if setup.recompute == "op":
            fused = setup.attn_impl == "sdpa" and (cuda or not drop)
            layer.update(op_block_lines(cfg, b, S, setup, fused))
    else:
        layer.update({f"ln_1/{k}": v for k, v in _norm(cfg, N, n_out, r, stats, ln).items()})
        layer["attn/qkv_input"] = qkv_casts * N * E * a
        if fam in ("qwen3", "qwen3_moe", "gemma3_text"):  # RMSNorm on each q and k head, as the block's norms
            for role, heads in (("q", cfg.n_head), ("k", cfg.kv_heads)):
                W = heads * cfg.head_size
                layer[f"attn/{role}_norm/input"] = N * W * 4
                layer[f"attn/{role}_norm/rsqrt"] = N * heads * 4
                layer[f"attn/{role}_norm/normalized"] = N * W * (4 if gemma else n_out)
                if gemma:  # (1 + weight) in fp32
                    layer[f"attn/{role}_norm/weight"] = cfg.head_size * 4
        layer["attn/resid_dropout_mask"] = N * E * mask if resid_drop else 0
        if gemma:  # post_attention_layernorm on the attention's output
            layer.update({f"ln_post_attn/{k}": v for k, v in _norm(cfg, N, n_out, r, stats, ln).items()})
        ln_2 = _norm(cfg, N, n_out, r, stats, ln)
        if cfg.parallel_residual:
            ln_2["input"] = 0  # post_attention_layernorm(hidden_states): ln_1's saved input
        layer.update({f"ln_2/{k}": v for k, v in ln_2.items()})
        layer["mlp/fc_input"] = up_casts * N * E * a
        gelu_new = fam == "gpt2" and cfg.mlp == "gelu_tanh"
        hidden = 5 if gelu_new else {"relu": 1, "gelu": 2, "gelu_tanh": 2, "swiglu": 4, "geglu": 4}[cfg.mlp]
        if "swiglu" in liger:
            # LigerSiLUMulFunction saves the gate and up outputs (a, b), not silu(gate); the
            # down projection saves the product
            hidden = 3
        dense_hidden = hidden * N * Dff * a  # incl. the down projection's input
        layer["mlp/dropout_mask"] = N * E * mask if resid_drop else 0
        if gemma:  # post_feedforward_layernorm on the MLP's output
            layer.update({f"ln_post_mlp/{k}": v for k, v in _norm(cfg, N, n_out, r, stats, ln).items()})
    out.update({f"layer/{k}": L * v for k, v in layer.items()})
    if not checkpointed:  # dense MLP layers only; the others: moe/...
        out["layer/mlp/hidden"] = (L - moe_layers(cfg)) * dense_hidden
    if not checkpointed and cfg.moe:
        out.update({f"layer/moe/{k}": moe_layers(cfg) * v
                    for k, v in _moe(cfg, fam, N, a).items()})
    if not checkpointed and fam == "deepseek_v3":
        out.update({f"layer/attn/{k}": L * v for k, v in _mla(cfg, b, S, setup).items()})
    elif not checkpointed:  # the attention core, by layer kind (sliding or global)
        for n, masked in kinds:
            for k, v in _attention(cfg, fam, b, S, setup, masked).items():
                out[f"layer/{k}"] = out.get(f"layer/{k}", 0) + n * v
    out.update({f"final/ln_f/{k}": v for k, v in _norm(cfg, N, n_out, r, stats, ln).items()})
    out["final/lm_head_input"] = N * E * a
    # Gemma 2: cap * tanh(logits / cap), tanh saving its output in the logits' dtype
    out["final/logit_softcap_tanh"] = N * V * a if cfg.logit_softcap else 0
    out["cross_entropy/log_probs"] = N * V * 4  # logits.float() in ForCausalLMLoss
    out["cross_entropy/total_weight"] = 4
    out["input/idx"] = 8 * N
    # ForCausalLMLoss: pad(labels, (0, 1))[..., 1:].contiguous(); for b = 1 the slice is
    # already contiguous, and nll_loss saves a view of the padded (1, S + 1) tensor
    out["input/labels"] = 8 * (N + 1 if b == 1 else N)
    return out


def transformers_loss_transients(cfg: GPTConfig, b: int, S: int, setup: Any
                                 ) -> dict[str, int]:
    """What the model output and transformers' loss path hold beside the saved tensors, at the
    moments a phase model needs (CPU, MemTracker; transformers 5.23, torch 2.13):

    forward_end/...      model(...) has returned; the caller holds the output through backward:
      logits              N * V * a    the output's logits (the fp32 upcast inside the loss is
                                       freed when the loss function returns)
      kv_cache            the cache's key/value copies that no autograd node saved (eager with
                          grouped-query heads, and the math path, save copies of their own)
      loss                4
    loss_backward/...    inside log_softmax's backward, the step's largest loss-path moment:
      logits, kv_cache    as above
      scalars             8            the loss and its gradient
      grad_log_probs      N * V * 4    nll_loss's gradient
      grad_logits_fp32    N * V * 4    log_softmax's gradient (the saved log_probs still alive)
      freed/labels        -N * 8 - 4   nll_loss's saved labels and total weight, released
    backward_start/...   the logits' gradient made, before lm_head's backward:
      logits, kv_cache, scalars, freed/labels   as above
      grad_logits         N * V * a    (16-bit: the ToCopyBackward cast of the fp32 gradient)
      freed/log_probs     -N * V * 4   log_softmax's saved output, released

    The forward's own largest moment is at the loss: logits + the fp32 upcast (N*V*4 when the
    logits are 16-bit) + log_probs. Lines are bytes to add to weights + optimizer states + the
    saved activations of `transformers_saved`.
    """
    _check(setup)
    fam = transformers_family(cfg)
    N, a, V = b * S, setup.act_bytes, cfg.vocab_size
    logits = N * V * a
    kv = sum(n * _kv_cache_unsaved(cfg, fam, b, S, setup, masked)
             for n, masked in _layer_kinds(cfg, S))
    # nll_loss's backward releases its saved labels and total weight before log_softmax's runs
    labels = 8 * (N + 1 if b == 1 else N) + 4
    held = {"logits": logits, "kv_cache": kv}
    out = {f"forward_end/{k}": v for k, v in held.items()}
    out["forward_end/loss"] = 4
    out.update({f"loss_backward/{k}": v for k, v in held.items()})
    out["loss_backward/scalars"] = 8  # the loss and its gradient
    out["loss_backward/grad_log_probs"] = N * V * 4
    out["loss_backward/grad_logits_fp32"] = N * V * 4
    out["loss_backward/freed/labels"] = -labels
    out.update({f"backward_start/{k}": v for k, v in held.items()})
    out["backward_start/scalars"] = 8
    out["backward_start/grad_logits"] = N * V * a
    out["backward_start/freed/log_probs"] = -N * V * 4
    out["backward_start/freed/labels"] = -labels
    return out


def first_layer_kv_cache(cfg: GPTConfig, b: int, S: int, setup: Any) -> tuple[int, int]:
    """The first layer's DynamicCache key and value copies, 2 N Dkv a (0 when checkpointing
    turns the cache off), and the part of them that full training leaves unsaved
    (`_kv_cache_unsaved`); the first layer is a sliding one where the model has any."""
    if setup.recompute in ("full", "op"):
        return 0, 0
    fam = transformers_family(cfg)
    masked = _window_mask(cfg, S) and sliding_layers(cfg) > 0 and (
        not cfg.attn_pattern or cfg.attn_pattern.upper()[0] == "L")
    return 2 * b * S * cfg.kv_width * setup.act_bytes, _kv_cache_unsaved(cfg, fam, b, S, setup,
                                                                          masked)


def _kv_cache_unsaved(cfg: GPTConfig, fam: str, b: int, S: int, setup: Any, masked: bool
                      ) -> int:
    """Per-layer bytes of DynamicCache's key/value copies (N * Dkv * a each) not saved for
    backward: the fused SDPA kernel saves them (unless repeat_kv copies them beyond head dim
    256); eager's matmul saves views of them, except with grouped-query heads (repeat_kv's
    copies are saved instead); the math path saves its scaled copy of k, and with grouped-query
    heads repeat_interleave'd copies of both."""
    if setup.recompute in ("full", "op"):
        return 0  # gradient checkpointing turns the cache off
    N, a, H = b * S, setup.act_bytes, cfg.n_head
    gqa = cfg.kv_heads != H
    one = N * cfg.kv_width * a
    fused = setup.attn_impl == "sdpa" and (setup.device == "cuda" or cfg.dropout == 0)
    if fused:
        repeated = cfg.head_size > _SDPA_GQA_MAX_HEAD_DIM or masked
        return 2 * one if gqa and repeated else 0
    if setup.attn_impl == "manual":
        return 2 * one if gqa else 0
    return 2 * one if gqa else one


__all__ = ["FAMILIES", "LIGER_FAMILIES", "default_attention", "first_layer_kv_cache", "transformers_family", "transformers_loss_transients",
           "transformers_saved"]
