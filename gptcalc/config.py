"""The architecture (`GPTConfig`): its fields, derived sizes and the rules a valid one obeys.

Letters: B micro-batch, T block size, E embedding width, L blocks, H heads,
F MLP expansion, V vocabulary. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, boolean, fraction, nonneg_int, one_of, positive_int, probability

POSITIONS = ("learned", "sinusoidal", "rotary", "alibi", "none")
NORMS = ("layernorm", "layernorm_nobias", "rmsnorm")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
GATED_MLPS = ("swiglu", "geglu")  # three matrices: up (c_fc), gate, down (c_proj)
QKV_LAYOUTS = ("fused", "separate", "per_head")
QK_NORMS = ("none", "head", "per_head", "proj")
LAYER_KINDS = "GL"  # attn_pattern letters: G global (full causal), L local (sliding window)

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
    # the transformers model_type whose module names and PEFT rules LoRA follows ("": gptcalc's)
    hf_model_type: str = ""

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


def _validate_modern(cfg: GPTConfig) -> None:
    """The switches of MoE, MLA, sliding windows, q/k norms and the embedding variants."""
    for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "moe_ffn_dim", "shared_ffn_dim", "embd_proj_dim",
                 "sliding_window"):
        if getattr(cfg, name) is not None:
            positive_int(name, getattr(cfg, name))
    for name in ("n_expert", "n_shared_expert", "moe_first_dense", "pos_offset"):
        nonneg_int(name, getattr(cfg, name))
    positive_int("n_expert_active", cfg.n_expert_active)
    positive_int("moe_step", cfg.moe_step)
    if cfg.moe and cfg.n_expert_active > cfg.n_expert:
        raise ConfigError("n_expert_active", f"n_expert_active {cfg.n_expert_active} exceeds "
                                             f"n_expert {cfg.n_expert}")
    if not isinstance(cfg.moe_dense_layers, str):
        raise ConfigError("moe_dense_layers", "moe_dense_layers must be text like '0,1'")
    parse_layer_list(cfg.moe_dense_layers)
    one_of("qk_norm", cfg.qk_norm, QK_NORMS)
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
        boolean(name, getattr(cfg, name))
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
        positive_int(name, getattr(cfg, name))
    for name in ("n_kv_head", "head_dim", "d_ff"):
        if getattr(cfg, name) is not None:
            positive_int(name, getattr(cfg, name))
    if cfg.head_dim is None and cfg.n_embd % cfg.n_head:
        raise ConfigError(
            "n_head", f"n_head {cfg.n_head} does not divide n_embd {cfg.n_embd} (set head_dim)"
        )
    if cfg.n_head % cfg.kv_heads:
        raise ConfigError(
            "n_kv_head", f"n_kv_head {cfg.kv_heads} does not divide n_head {cfg.n_head}"
        )
    fraction("rotary_pct", cfg.rotary_pct)
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
    probability("dropout", cfg.dropout)
    one_of("qkv_layout", cfg.qkv_layout, QKV_LAYOUTS)
    if cfg.hf_model_type:
        from .hf_families import LINEAR_NAMES
        one_of("hf_model_type", cfg.hf_model_type, tuple(LINEAR_NAMES))
    one_of("pos_embedding", cfg.pos_embedding, POSITIONS)
    one_of("norm", cfg.norm, NORMS)
    one_of("mlp", cfg.mlp, MLPS)
    for name in ("qkv_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "tie_embeddings",
                 "final_norm", "embd_dropout", "parallel_residual"):
        boolean(name, getattr(cfg, name))

