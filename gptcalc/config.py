"""The architecture (`GPTConfig`), the workload (`Workload`) and the families of switches.

Letters: B micro-batch, T block size, E embedding width, L blocks, H heads,
F MLP expansion, V vocabulary. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

POSITIONS = ("learned", "sinusoidal", "rotary", "alibi", "none")
NORMS = ("layernorm", "layernorm_nobias", "rmsnorm")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
GATED_MLPS = ("swiglu", "geglu")  # three matrices: up (c_fc), gate, down (c_proj)
QKV_LAYOUTS = ("fused", "separate", "per_head")
QK_NORMS = ("none", "head", "per_head", "proj")
LAYER_KINDS = "GL"  # attn_pattern letters: G global (full causal), L local (sliding window)


class ConfigError(ValueError):
    """An invalid configuration value; `field` names the offending field (or option)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer's architecture. Everything that changes a count lives here.

    The defaults are GPT-2 small (124M) with nanoGPT's module layout.
    """

    block_size: int = 1024  # T: context length; sizes a learned position table
    vocab_size: int = 50257  # V
    n_layer: int = 12  # L
    n_head: int = 12  # H: query heads
    n_embd: int = 768  # E: residual stream width, d_model
    n_kv_head: int | None = None  # key/value heads (grouped-query); None: H
    head_dim: int | None = None  # width of one head; None: E / H
    ffn_mult: int = 4  # F: d_ff = F * E unless d_ff is given
    d_ff: int | None = None  # explicit MLP hidden width (Llama's intermediate_size)
    dropout: float = 0.0  # probability used by every dropout site
    # --- switches; `ARCHS` bundles them into named families ---
    qkv_layout: str = "fused"  # one E x 3E matrix, three matrices, or per-head modules
    qkv_bias: bool = True
    attn_out_bias: bool = True  # bias of the attention output projection
    mlp_bias: bool = True
    lm_head_bias: bool = False
    tie_embeddings: bool = True  # lm_head shares the token embedding's weight
    pos_embedding: str = "learned"  # learned | sinusoidal | rotary | none
    norm: str = "layernorm"  # layernorm | layernorm_nobias | rmsnorm
    mlp: str = "gelu_tanh"  # relu | gelu | gelu_tanh | swiglu
    final_norm: bool = True
    embd_dropout: bool = True  # dropout after the embedding sum (nanoGPT, notes); not the tutorial
    # GPT-NeoX (Pythia): rotary on the first rotary_pct of each head's dims, and attention and
    # MLP reading the same block input in parallel. Neither changes a parameter or matmul count.
    rotary_pct: float = 1.0  # share of head_dim that rotary rotates (HF rotary_pct)
    parallel_residual: bool = False  # x + attn(ln1(x)) + mlp(ln2(x)) (HF use_parallel_residual)
    # --- normalisation placement -----------------------------------------------------------
    # Falcon-7B, Phi-2, Cohere, StableLM's parallel variant, GPT-J: the parallel block's two
    # branches read ONE norm's output, x + attn(ln(x)) + mlp(ln(x)); needs parallel_residual.
    shared_norm: bool = False
    pre_norm: bool = True  # a norm before each branch (ln_1, ln_2); OLMo 2 has none
    # Gemma 2/3 ("sandwich") and OLMo 2: a norm on each branch's output before the residual add,
    # x + norm(attn(.)); Gemma 2/3 keep the pre-norms too, OLMo 2 drops them (pre_norm=false).
    post_norm: bool = False
    # q/k normalisation, a weight without bias (RMSNorm, or LayerNorm without bias for the
    # LayerNorm families): head = one weight of head_dim shared by all heads (Qwen3, Gemma 3);
    # per_head = one weight per head, H x head_dim and n_kv_head x head_dim (StableLM
    # qk_layernorm, Cohere use_qk_norm); proj = over the whole projection, H*head_dim and
    # n_kv_head*head_dim wide (OLMo 2).
    qk_norm: str = "none"
    embd_norm: bool = False  # BLOOM's word_embeddings_layernorm after the token embedding
    # --- embeddings ----------------------------------------------------------------------------
    pos_offset: int = 0  # extra rows of a learned position table: OPT's offset of 2
    # OPT's word_embed_proj_dim: embeddings (and a tied head) of this width, with
    # project_in (Linear(P, E), no bias) and project_out (Linear(E, P), no bias); None: E
    embd_proj_dim: int | None = None
    # --- attention variants ----------------------------------------------------------------
    # gpt-oss: one learned logit per head and layer that joins every softmax (a "sink")
    attn_sinks: bool = False
    # Gemma 2's tanh soft-capping, cap * tanh(x / cap): of the attention scores (HF
    # attn_logit_softcapping) and of the logits (final_logit_softcapping). No parameter or
    # matmul count changes; each tanh saves its output for backward.
    attn_softcap: bool = False
    logit_softcap: bool = False
    # Sliding-window attention (Child et al. 2019; Mistral, Gemma 2/3, gpt-oss, StarCoder2):
    # a query attends itself and the window-1 keys before it (transformers' mask: key position
    # > query position - window). attn_pattern: the layer kinds, G (global, full causal) and
    # L (local, sliding window), repeated from layer 0 (Gemma 2 and gpt-oss "LG", Gemma 3
    # "LLLLLG"); empty: every layer L when sliding_window is set, else every layer G.
    sliding_window: int | None = None
    attn_pattern: str = ""
    # Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, sec. 2.1; DeepSeek-V3). Set
    # kv_lora_rank to use it: kv_a_proj_with_mqa E -> kv_lora_rank + qk_rope_head_dim, its
    # RMSNorm, kv_b_proj kv_lora_rank -> H*(qk_nope_head_dim + v_head_dim), o_proj
    # H*v_head_dim -> E; queries through q_a_proj E -> q_lora_rank, an RMSNorm and q_b_proj
    # q_lora_rank -> H*(qk_nope + qk_rope), or one q_proj when q_lora_rank is None. Head
    # widths left None are DeepSeek's proportions of head_dim: nope = v = head_dim, rope =
    # head_dim / 2. q_a_proj and kv_a_proj take qkv_bias, o_proj attn_out_bias.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # --- mixture of experts (Shazeer et al. 2017; Fedus et al. 2022) ---------------------------
    # An MoE layer replaces the MLP by a router Linear(E, n_expert), n_expert routed experts of
    # moe_ffn_dim (each an MLP of kind `mlp`) of which each token visits n_expert_active (top-k),
    # and shared experts every token visits (DeepSeek's n_shared_experts, fused into one MLP of
    # n_shared_expert * moe_ffn_dim, or Qwen2-MoE's one shared expert of shared_ffn_dim with a
    # sigmoid gate Linear(E, 1)). Which layers: index i is MoE when i >= moe_first_dense
    # (DeepSeek first_k_dense_replace), (i + 1) % moe_step == 0 (Qwen decoder_sparse_step), and
    # i is not in moe_dense_layers (comma-separated, Qwen mlp_only_layers); the others keep the
    # dense MLP of width d_ff.
    n_expert: int = 0  # routed experts; 0: no MoE layers
    n_expert_active: int = 2  # k, experts per token (HF num_experts_per_tok)
    n_shared_expert: int = 0
    moe_ffn_dim: int | None = None  # one routed expert's width (moe_intermediate_size); None: d_ff
    shared_ffn_dim: int | None = None  # the shared MLP's width; None: n_shared_expert * moe width
    shared_expert_gate: bool = False  # Qwen2-MoE's shared_expert_gate
    router_bias: bool = False  # gpt-oss's router has a bias
    # the top-k routing weights renormalised to sum to 1 (Mixtral; Qwen's norm_topk_prob): no
    # count changes, the division saves tensors for backward
    router_norm_topk: bool = False
    # DeepSeek-V3's group-limited routing: experts in router_groups groups (n_group), tokens
    # routed within the best router_topk_groups (topk_group); saved index tensors only
    router_groups: int = 1
    router_topk_groups: int = 1
    expert_bias: bool = False  # gpt-oss's experts have biases
    moe_first_dense: int = 0
    moe_step: int = 1
    moe_dense_layers: str = ""

    def __post_init__(self) -> None:
        validate_config(self)

    # Derived sizes are properties, never stored.
    @property
    def mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank is set)."""
        return self.kv_lora_rank is not None

    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: head_dim, or MLA's qk_nope_head_dim + qk_rope_head_dim."""
        if self.mla:
            return self.nope_dim + self.rope_dim
        return self.head_size

    @property
    def nope_dim(self) -> int:
        """MLA: the query/key dims without rotary (qk_nope_head_dim, default head_dim)."""
        return self.head_size if self.qk_nope_head_dim is None else self.qk_nope_head_dim

    @property
    def rope_dim(self) -> int:
        """MLA: the rotary query/key dims, shared by all heads for k (default head_dim / 2)."""
        return self.head_size // 2 if self.qk_rope_head_dim is None else self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        """Width of one value head: head_dim, or MLA's v_head_dim (default head_dim)."""
        if self.mla and self.v_head_dim is not None:
            return self.v_head_dim
        return self.head_size

    @property
    def attn_out_width(self) -> int:
        """Input width of the attention output projection: H * value head width."""
        return self.n_head * self.v_dim

    @property
    def expert_dim(self) -> int:
        """Width of one routed expert: moe_ffn_dim, or d_ff."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    @property
    def shared_dim(self) -> int:
        """Width of the shared-expert MLP: shared_ffn_dim, or n_shared_expert * expert width."""
        if self.shared_ffn_dim is not None:
            return self.shared_ffn_dim if self.n_shared_expert else 0
        return self.n_shared_expert * self.expert_dim

    @property
    def embd_dim(self) -> int:
        """Width of the token embedding (OPT's word_embed_proj_dim), E unless set."""
        return self.n_embd if self.embd_proj_dim is None else self.embd_proj_dim

    @property
    def dense_layer_indices(self) -> tuple[int, ...]:
        """moe_dense_layers as sorted unique integers."""
        return parse_layer_list(self.moe_dense_layers)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or H for multi-head attention."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_size(self) -> int:
        """Width of one head: head_dim, or E / H."""
        return self.n_embd // self.n_head if self.head_dim is None else self.head_dim

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width d_ff: d_ff, or F * E."""
        return self.ffn_mult * self.n_embd if self.d_ff is None else self.d_ff

    @property
    def rotary_dims(self) -> int:
        """Dims of each query/key head that rotary rotates: int(head_dim * rotary_pct) (HF's
        GPT-NeoX rounding); MLA's qk_rope_head_dim; 0 without rotary positions."""
        if self.pos_embedding != "rotary":
            return 0
        return self.rope_dim if self.mla else int(self.head_size * self.rotary_pct)

    @property
    def q_width(self) -> int:
        """Concatenated query width H * head_dim (= E unless head_dim is set)."""
        return self.n_head * self.head_size

    @property
    def kv_width(self) -> int:
        """Concatenated key (or value) width n_kv_head * head_dim."""
        return self.kv_heads * self.head_size

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Workload:
    """What one device runs: a micro-batch of B sequences of `seq_len` tokens (seq_len <= T)
    per forward/backward, `grad_accum` of them per optimizer step.

    B is DeepSpeed's `train_micro_batch_size_per_gpu`; the global batch of a step is
    B x dp x grad_accum (`global_batch`)."""

    batch_size: int = 1  # B: sequences per device per forward/backward (the micro-batch)
    seq_len: int = 1024  # tokens per sequence; at most the block size T
    grad_accum: int = 1  # micro-batches accumulated per optimizer step

    def __post_init__(self) -> None:
        _positive("batch_size", self.batch_size)
        _positive("seq_len", self.seq_len)
        _positive("grad_accum", self.grad_accum)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch_size * self.seq_len

    def global_batch(self, dp: int = 1) -> int:
        """Sequences per optimizer step over `dp` data-parallel replicas: B x dp x grad_accum."""
        return self.batch_size * dp * self.grad_accum


# The largest size accepted. Products of a handful of sizes (FLOPs of a step, bytes of a
# tensor) then stay far below the 4,300 digits Python will print, and exact.
MAX_SIZE = 10**300


def _positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"{field} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(field, f"{field} must be positive, got {value}")
    if value > MAX_SIZE:
        raise ConfigError(field, f"{field} must be at most 10^300, got a {value.bit_length()}-bit "
                                 "integer")


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, f"{field} must be one of {', '.join(choices)}; got {value!r}")


def parse_layer_list(text: str) -> tuple[int, ...]:
    """'0, 3,5' -> (0, 3, 5); raises ConfigError(moe_dense_layers) for anything else."""
    out = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit():
            raise ConfigError("moe_dense_layers", "moe_dense_layers must be comma-separated "
                                                  f"layer indices, got {text!r}")
        out.add(int(part))
    return tuple(sorted(out))


def _nonneg(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"{field} must be an integer, got {value!r}")
    if value < 0:
        raise ConfigError(field, f"{field} must not be negative, got {value}")


def _validate_modern(cfg: GPTConfig) -> None:
    """The switches of MoE, MLA, sliding windows, q/k norms and the embedding variants."""
    for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "moe_ffn_dim", "shared_ffn_dim", "embd_proj_dim",
                 "sliding_window"):
        if getattr(cfg, name) is not None:
            _positive(name, getattr(cfg, name))
    for name in ("n_expert", "n_shared_expert", "moe_first_dense", "pos_offset"):
        _nonneg(name, getattr(cfg, name))
    _positive("n_expert_active", cfg.n_expert_active)
    _positive("moe_step", cfg.moe_step)
    if cfg.moe and cfg.n_expert_active > cfg.n_expert:
        raise ConfigError("n_expert_active", f"n_expert_active {cfg.n_expert_active} exceeds "
                                             f"n_expert {cfg.n_expert}")
    if not isinstance(cfg.moe_dense_layers, str):
        raise ConfigError("moe_dense_layers", "moe_dense_layers must be text like '0,1'")
    parse_layer_list(cfg.moe_dense_layers)
    _choice("qk_norm", cfg.qk_norm, QK_NORMS)
    if not isinstance(cfg.attn_pattern, str) or set(cfg.attn_pattern.upper()) - set(LAYER_KINDS):
        raise ConfigError("attn_pattern", "attn_pattern must be letters G (global) and L "
                                          f"(sliding window), e.g. LLLLLG; got "
                                          f"{cfg.attn_pattern!r}")
    if "L" in cfg.attn_pattern.upper() and cfg.sliding_window is None:
        raise ConfigError("sliding_window", f"attn_pattern {cfg.attn_pattern!r} has sliding "
                                            "layers (L): set sliding_window")
    for name in ("shared_norm", "pre_norm", "post_norm", "embd_norm", "attn_sinks",
                 "attn_softcap", "logit_softcap", "shared_expert_gate", "router_bias",
                 "expert_bias", "router_norm_topk"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(name, f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.shared_norm and not cfg.parallel_residual:
        raise ConfigError("shared_norm", "shared_norm (one norm for both branches) needs "
                                         "parallel_residual=true")
    if not cfg.pre_norm and cfg.shared_norm:
        raise ConfigError("shared_norm", "shared_norm is a pre-norm; it needs pre_norm=true")
    if cfg.mla:
        if cfg.qkv_layout == "per_head":
            raise ConfigError("kv_lora_rank", "multi-head latent attention has its own "
                                              "projections; use qkv_layout separate or fused")
        if cfg.pos_embedding == "rotary" and cfg.rope_dim % 2:
            raise ConfigError("qk_rope_head_dim", f"rotary needs an even qk_rope_head_dim, "
                                                  f"got {cfg.rope_dim}")
        if cfg.qk_norm != "none":
            raise ConfigError("qk_norm", "q/k norms of multi-head latent attention are not "
                                         "modelled (its latents have their own norms)")
        for name in ("nope_dim", "rope_dim"):
            if getattr(cfg, name) <= 0:
                raise ConfigError("qk_rope_head_dim", "MLA head widths must be positive")


def validate_config(cfg: GPTConfig) -> None:
    """Raise ConfigError naming the first invalid field of `cfg`."""
    for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "ffn_mult"):
        _positive(name, getattr(cfg, name))
    for name in ("n_kv_head", "head_dim", "d_ff"):
        if getattr(cfg, name) is not None:
            _positive(name, getattr(cfg, name))
    if cfg.head_dim is None and cfg.n_embd % cfg.n_head:
        raise ConfigError(
            "n_head", f"n_head {cfg.n_head} does not divide n_embd {cfg.n_embd} (set head_dim)"
        )
    if cfg.n_head % cfg.kv_heads:
        raise ConfigError(
            "n_kv_head", f"n_kv_head {cfg.kv_heads} does not divide n_head {cfg.n_head}"
        )
    if (isinstance(cfg.rotary_pct, bool) or not isinstance(cfg.rotary_pct, (int, float))
            or not 0.0 < cfg.rotary_pct <= 1.0):  # NaN fails the comparison too
        raise ConfigError("rotary_pct", f"rotary_pct must be in (0, 1], got {cfg.rotary_pct!r}")
    _validate_modern(cfg)
    rotary = cfg.pos_embedding == "rotary" and not cfg.mla
    if rotary and cfg.rotary_pct == 1.0 and cfg.head_size % 2:
        raise ConfigError("head_dim",
                          f"rotary positions need an even head_dim, got {cfg.head_size}")
    if rotary and (cfg.rotary_dims % 2 or cfg.rotary_dims == 0):
        raise ConfigError("rotary_pct", f"rotary_pct {cfg.rotary_pct} of head_dim {cfg.head_size}"
                          f" gives {cfg.rotary_dims} rotary dims; it must be even and positive")
    if cfg.qkv_layout == "per_head" and cfg.kv_heads != cfg.n_head:
        raise ConfigError("n_kv_head", "per_head q/k/v modules need n_kv_head equal to n_head")
    if (isinstance(cfg.dropout, bool) or not isinstance(cfg.dropout, (int, float))
            or not math.isfinite(cfg.dropout) or not 0.0 <= cfg.dropout < 1.0):
        raise ConfigError("dropout", f"dropout must be in [0, 1), got {cfg.dropout!r}")
    _choice("qkv_layout", cfg.qkv_layout, QKV_LAYOUTS)
    _choice("pos_embedding", cfg.pos_embedding, POSITIONS)
    _choice("norm", cfg.norm, NORMS)
    _choice("mlp", cfg.mlp, MLPS)
    for name in ("qkv_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "tie_embeddings",
                 "final_norm", "embd_dropout", "parallel_residual"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(name, f"{name} must be true or false, got {getattr(cfg, name)!r}")


def validate_workload(cfg: GPTConfig, workload: Workload) -> None:
    """A sequence cannot be longer than the context the model was built for."""
    if workload.seq_len > cfg.block_size:
        raise ConfigError(
            "seq_len", f"seq_len {workload.seq_len} exceeds block_size {cfg.block_size}"
        )


# Families: named bundles of switches. Sizes are not part of them.
ARCHS: dict[str, dict[str, Any]] = {
    # Karpathy's "Let's build GPT" tutorial: per-head k/q/v without bias, projection
    # and MLP with bias, ReLU, LayerNorm with bias, untied lm_head with bias, no embedding dropout.
    "tutorial": dict(
        qkv_layout="per_head", qkv_bias=False, attn_out_bias=True, mlp_bias=True,
        lm_head_bias=True, tie_embeddings=False, pos_embedding="learned", norm="layernorm",
        mlp="relu", final_norm=True, embd_dropout=False,
    ),
    # GPT-2 (nanoGPT model.py): fused c_attn, biases, GELU (tanh), tied head.
    "gpt2": dict(
        qkv_layout="fused", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        lm_head_bias=False, tie_embeddings=True, pos_embedding="learned", norm="layernorm",
        mlp="gelu_tanh", final_norm=True, embd_dropout=True,
    ),
    # A textbook decoder-only transformer: per-head Q/K/V with bias, O with bias, exact GELU,
    # learnable position Parameter(1, K, D), embedding dropout, tied lm_head without bias.
    "notes": dict(
        qkv_layout="per_head", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        lm_head_bias=False, tie_embeddings=True, pos_embedding="learned", norm="layernorm",
        mlp="gelu", final_norm=True, embd_dropout=True,
    ),
    # Llama 2/3 (Touvron et al. 2023; Meta's model cards): no biases, RMSNorm, rotary, SwiGLU,
    # separate q/k/v projections (grouped-query when n_kv_head < n_head), untied head.
    "llama": dict(
        qkv_layout="separate", qkv_bias=False, attn_out_bias=False, mlp_bias=False,
        lm_head_bias=False, tie_embeddings=False, pos_embedding="rotary", norm="rmsnorm",
        mlp="swiglu", final_norm=True, embd_dropout=False, dropout=0.0,
    ),
}
_LLAMA = ARCHS["llama"]
ARCHS.update({
    # Mistral 7B v0.1 (Jiang et al. 2023): Llama's switches; its sliding window is a size.
    "mistral": dict(_LLAMA),
    # Mixtral (Jiang et al. 2024): Llama's attention, every MLP a top-2 mixture of SwiGLU experts.
    "mixtral": dict(_LLAMA, n_expert_active=2, router_norm_topk=True),
    # Qwen3 (Qwen3 technical report 2025): Llama plus RMSNorm on each query and key head.
    "qwen3": dict(_LLAMA, qk_norm="head"),
    "qwen3_moe": dict(_LLAMA, qk_norm="head"),
    # DeepSeek-V3 (DeepSeek-AI 2024): MLA, MoE with shared experts and dense first layers.
    "deepseek": dict(_LLAMA),
    # Families hold switches only: a window and its layer pattern are sizes of a preset.
    # Gemma 2 (Gemma Team 2024): GeGLU, pre- and post-norms, tied head.
    "gemma2": dict(_LLAMA, mlp="geglu", post_norm=True, tie_embeddings=True,
                   attn_softcap=True, logit_softcap=True),
    # Gemma 3 (Gemma Team 2025): Gemma 2 plus q/k RMSNorm over each head.
    "gemma3": dict(_LLAMA, mlp="geglu", post_norm=True, tie_embeddings=True, qk_norm="head"),
    # gpt-oss (OpenAI 2025 model card): biased attention with sinks, MoE with a biased router
    # and biased experts.
    "gpt_oss": dict(_LLAMA, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
                    router_bias=True, expert_bias=True),
    # OLMo 2 (OLMo et al. 2024): RMSNorm after each branch instead of before, q/k RMSNorm over
    # the whole projection.
    "olmo2": dict(_LLAMA, pre_norm=False, post_norm=True, qk_norm="proj"),
    # Phi-3 (Abdin et al. 2024): Llama's switches with fused qkv_proj and gate_up_proj.
    "phi3": dict(_LLAMA, qkv_layout="fused"),
})


# --- how a model is trained ----------------------------------------------------------------------

MODES = ("fp32", "amp", "mixed", "bf16")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
AUTOCAST_DTYPES = ("bf16", "fp16")
# recompute: none; selective, the attention core (Korthikanti et al. 2022, sec. 5); op,
# torchtitan's op-level selective checkpointing (matmul and attention-kernel outputs kept but
# every second matmul); full, every block (only its input kept)
RECOMPUTE = ("none", "selective", "op", "full")
ATTN_IMPLS = ("manual", "sdpa")
DEVICES = ("cpu", "cuda")
IMPLS = ("reference", "transformers", "paper")
ZERO_STAGES = (0, 1, 2, 3)
# the training engines whose per-rank memory gptcalc models (gptcalc.memory.engines)
ENGINES = ("deepspeed", "fsdp2", "megatron", "ddp", "zero-redundancy")
# the ZeRO stages each engine runs: FSDP2's reshard_after_forward False/True is ZeRO-2/3;
# Megatron-LM shards with its distributed optimizer, not a ZeRO stage
ENGINE_STAGES = {"deepspeed": (0, 1, 2, 3), "fsdp2": (2, 3), "megatron": (0,), "ddp": (0,),
                 "zero-redundancy": (1,)}
# engines whose mixed precision (16-bit compute, fp32 master weights) is their default
MIXED_ENGINES = ("deepspeed", "fsdp2", "megatron")


def default_engine(zero: int) -> str:
    """The engine most users run a layout with: DeepSpeed for ZeRO stages 1-3 (ZeRO is its
    vocabulary and the ZeRO paper's accounting), DistributedDataParallel otherwise."""
    return "deepspeed" if zero >= 1 else "ddp"


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is trained: precision, optimizer, recomputation, kernels, parallel layout.

    mode: fp32 | amp (fp32 weights and gradients, autocast compute in `autocast_dtype`) |
    mixed (ZeRO's accounting: 16-bit weights and gradients + fp32 master weights and states) |
    bf16 (pure bf16 weights, gradients and states). attn_impl: manual (softmax(q k^T) v written
    out, its S x S scores saved) | sdpa (F.scaled_dot_product_attention; a flash-type kernel
    on CUDA). device: whose kernel semantics decide what is saved (CPU and CUDA save different
    dtypes for some ops). impl: the implementation whose saved tensors are counted: the
    project's `reference` model, Hugging Face `transformers`' modules, or Korthikanti et al.
    2022's `paper` formula. Parallel layout: `dp` data-parallel replicas with ZeRO stage
    `zero`; `tp` tensor-parallel ranks (Megatron-LM) with sequence parallelism `sp`
    (Korthikanti et al. 2022); `pp` pipeline stages (1F1B); `ep` expert-parallel ranks, each
    holding n_expert / ep of every MoE block's routed experts (Lepikhin et al. 2020, GShard).
    `lora_rank` > 0: LoRA fine-tuning of `lora_targets` (gptcalc.lora's names) on a frozen
    base, stored in the mode's dtype or (`base_dtype` nf4) as QLoRA's NF4. `overhead`: bytes
    added to every
    phase of the peak for what the model does not cover (framework context, allocator
    fragmentation, communication buckets); 0 unless given, always printed.

    The dataclass defaults are the bare fp32 CPU set-up the reference model is measured in;
    `training_defaults` gives the set-up a family is usually trained with.
    """

    mode: str = "fp32"
    optimizer: str = "adamw"
    autocast_dtype: str = "bf16"
    recompute: str = "none"
    attn_impl: str = "manual"
    device: str = "cpu"
    impl: str = "reference"
    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    sp: bool = False
    ep: int = 1
    engine: str | None = None
    distributed_optimizer: bool = True
    overhead: int = 0
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    base_dtype: str = "same"
    # DeepSpeed's zero_optimization settings that differ from its defaults, as (key, value)
    # pairs (gptcalc.memory.engines.deepspeed reads them; a ds_config file gives them)
    deepspeed_zero: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name, choices in (("mode", MODES), ("optimizer", OPTIMIZERS),
                              ("autocast_dtype", AUTOCAST_DTYPES), ("recompute", RECOMPUTE),
                              ("attn_impl", ATTN_IMPLS), ("device", DEVICES), ("impl", IMPLS)):
            if getattr(self, name) not in choices:
                raise ConfigError(name, f"{name} must be one of {', '.join(choices)}; "
                                        f"got {getattr(self, name)!r}")
        for name in ("dp", "tp", "pp", "ep"):
            _positive(name, getattr(self, name))
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.sp, bool):
            raise ConfigError("sp", f"sp must be true or false, got {self.sp!r}")
        if self.engine is not None and self.engine not in ENGINES:
            raise ConfigError("engine", f"engine must be one of {', '.join(ENGINES)}; got "
                                        f"{self.engine!r}")
        if self.zero not in ENGINE_STAGES[self.engine_name]:
            stages = " or ".join(map(str, ENGINE_STAGES[self.engine_name]))
            raise ConfigError("zero", f"the {self.engine_name} engine runs ZeRO stage {stages}, "
                                      f"not {self.zero}")
        if not isinstance(self.distributed_optimizer, bool):
            raise ConfigError("distributed_optimizer", "must be true or false")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or (
                self.lora_rank < 0):
            raise ConfigError("lora_rank", f"must be a rank >= 0, got {self.lora_rank!r}")
        if self.lora_rank and not self.lora_targets:
            raise ConfigError("lora_targets", "a LoRA rank needs targets, e.g. q,v")
        if self.base_dtype not in ("same", "nf4"):
            raise ConfigError("base_dtype", f"base_dtype must be same or nf4, got "
                                            f"{self.base_dtype!r}")
        if self.base_dtype == "nf4" and not self.lora_rank:
            raise ConfigError("weights_dtype", "a 4-bit (NF4) base is frozen: QLoRA needs "
                                               "--lora-rank")
        if isinstance(self.overhead, bool) or not isinstance(self.overhead, int) or (
                self.overhead < 0):
            raise ConfigError("overhead", f"overhead must be a byte count >= 0, got "
                                          f"{self.overhead!r}")

    @property
    def engine_name(self) -> str:
        """The engine: `engine` when given, else `default_engine` of the ZeRO stage."""
        return self.engine or default_engine(self.zero)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight (and of one gradient): fp32, or 16 bit in mixed and bf16."""
        return 4 if self.mode in ("fp32", "amp") else 2

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element: fp32, or the 16-bit compute dtype."""
        return 4 if self.mode == "fp32" else 2

    @property
    def stream_bytes(self) -> int:
        """Bytes of one residual-stream element: the weights' dtype (fp32 weights keep the
        stream fp32 under amp: a 16-bit branch output added to it promotes to fp32)."""
        return self.weight_bytes

    def _mixed(self) -> str:
        """What mode mixed means under the engine."""
        d = self.autocast_dtype
        if self.engine_name == "fsdp2":
            return f"mixed (MixedPrecisionPolicy: {d} parameters, fp32 shards and reduction)"
        if self.engine_name == "megatron":
            grads = "fp32 main gradients" if d == "bf16" else "fp16 gradients"
            return f"mixed ({d} weights, {grads}, fp32 master copy)"
        return f"mixed ({d} weights and gradients, fp32 master copy)"

    def describe(self) -> str:
        """One line naming every assumption of the set-up."""
        amp_weights = "16-bit frozen base, fp32 adapters" if self.lora_rank else "fp32 weights"
        prec = {"fp32": "fp32", "amp": f"amp ({self.autocast_dtype} autocast, {amp_weights})",
                "mixed": self._mixed(),
                "bf16": "pure bf16"}[self.mode]
        layout = f"dp={self.dp} zero={self.zero} tp={self.tp} sp={'on' if self.sp else 'off'}" \
                 f" pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")
        engine = self.engine_name
        if engine == "megatron":
            engine += " (distributed optimizer)" if self.distributed_optimizer else \
                " (no distributed optimizer)"
        tune = ""
        if self.lora_rank:
            base = "an NF4 (QLoRA)" if self.base_dtype == "nf4" else "a frozen"
            tune = (f", LoRA r={self.lora_rank} on {','.join(self.lora_targets)} over "
                    f"{base} base")
        return (f"engine {engine}, {prec}, {self.optimizer}, attention {self.attn_impl}, "
                f"{self.device.upper()} kernels, {self.impl} implementation, recompute "
                f"{self.recompute}{tune}, "
                f"{layout}")


# The families whose notebooks train in fp32 with a written-out attention on a CPU (Karpathy's
# "Let's build GPT" and the decoder-only notes); everything else
# (GPT-2, Llama and every Hugging Face model) is trained the way people train today: bf16
# autocast over fp32 weights, SDPA (flash attention), CUDA kernels.
NOTEBOOK_FAMILIES = ("tutorial", "notes")


def family_of(cfg: GPTConfig) -> str | None:
    """The family in `ARCHS` whose switches `cfg` has (ignoring dropout), or None."""
    for name, switches in ARCHS.items():
        if all(getattr(cfg, k) == v for k, v in switches.items() if k != "dropout"):
            return name
    return None


def training_defaults(cfg: GPTConfig, hf: bool = False) -> dict[str, str]:
    """The set-up a model of this family is usually trained with: `mode`, `attn`, `device`,
    `impl`. The tutorial and notes families: fp32, manual attention, CPU (the reference model,
    as their notebooks run it). Others: amp (bf16), SDPA, CUDA; a Hugging Face config (`hf`) is
    counted as transformers' modules save it where that profile models its switches (with the
    class's default attention: eager for Gemma 2), else as the reference model saves it."""
    if not hf and family_of(cfg) in NOTEBOOK_FAMILIES:
        return {"mode": "fp32", "attn": "manual", "device": "cpu", "impl": "reference"}
    impl = "transformers" if hf and _transformers_modelled(cfg) else "reference"
    attn = "sdpa"
    if impl == "transformers":  # the class's own default (Gemma 2: eager, no SDPA path)
        from .memory.profile_transformers import default_attention  # torch-free

        attn = default_attention(cfg)
    return {"mode": "amp", "attn": attn, "device": "cuda", "impl": impl}


def _transformers_modelled(cfg: GPTConfig) -> bool:
    """False when the transformers profile has not measured a switch of `cfg` (MoE, MLA,
    Gemma's norms, ...): such a Hugging Face config is then counted as the reference model
    saves it, and the assumptions line says so."""
    from .memory.profile_transformers import transformers_family  # torch-free

    try:
        transformers_family(cfg)
    except ConfigError as e:
        return e.field != "impl"
    return True


def modern_switches(cfg: GPTConfig) -> list[str]:
    """The switches beyond the classic GPT-2 / Llama block that `cfg` uses, by name."""
    used = (("mixture of experts", cfg.moe), ("multi-head latent attention", cfg.mla),
            ("q/k norms", cfg.qk_norm != "none"), ("post-norms", cfg.post_norm),
            ("no pre-norms", not cfg.pre_norm), ("a shared parallel norm", cfg.shared_norm),
            ("sliding windows", cfg.sliding_window is not None),
            ("attention sinks", cfg.attn_sinks), ("ALiBi", cfg.pos_embedding == "alibi"),
            ("GeGLU", cfg.mlp == "geglu"), ("an embedding norm", cfg.embd_norm),
            ("OPT's embedding projections", cfg.embd_proj_dim is not None))
    return [name for name, on in used if on]


def default_setup(cfg: GPTConfig, hf: bool = False, **changes: Any) -> TrainingSetup:
    """`TrainingSetup` with the family's `training_defaults`, then `changes`."""
    d = training_defaults(cfg, hf)
    fields = {"mode": d["mode"], "attn_impl": d["attn"], "device": d["device"],
              "impl": d["impl"], **changes}
    return TrainingSetup(**fields)


# --- typed field values from text (--set) and from TOML/JSON files -------------------------------

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_UNSET = ("none", "null", "auto")  # an optional size left to its rule (n_kv_head = H, ...)


def field_kinds() -> dict[str, str]:
    """Each GPTConfig field's kind: int, optional_int, float, bool or str."""
    kinds = {}
    for f in dataclasses.fields(GPTConfig):
        t = str(f.type).replace(" ", "")
        kinds[f.name] = {"int": "int", "int|None": "optional_int", "float": "float",
                         "bool": "bool", "str": "str"}[t]
    return kinds


def coerce_field(name: str, value: Any) -> Any:
    """`value` (text or a TOML/JSON scalar) as the type of GPTConfig field `name`.

    Raises ConfigError(name) for a value of the wrong kind; ranges are left to validate_config.
    """
    kinds = field_kinds()
    if name not in kinds:
        raise ConfigError(name, f"unknown field {name!r}; fields: {', '.join(kinds)}")
    kind = kinds[name]
    text = value.strip().lower() if isinstance(value, str) else None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(name, f"{name} must be true or false, got {value!r}")
    if kind == "str":
        if isinstance(value, str):
            return value.strip()
        raise ConfigError(name, f"{name} must be a name, got {value!r}")
    if kind == "optional_int" and (value is None or text in _UNSET):
        return None
    if kind in ("int", "optional_int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text is not None:
            try:
                return int(text)
            except ValueError:
                pass
        raise ConfigError(name, f"{name} must be an integer, got {value!r}")
    # float
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if text is not None:
        try:
            return float(text)
        except ValueError:
            pass
    raise ConfigError(name, f"{name} must be a number, got {value!r}")
