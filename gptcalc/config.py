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
# layer_mixers letters: A attention, M Mamba (Mamba-1 or Mamba2, `mamba_version`), D Gated
# DeltaNet (linear attention), P attention and Mamba side by side in one block (Falcon-H1)
MIXERS = "AMDP"

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
    # --- hybrid models: state-space / linear-attention mixers beside attention ------------------
    # layer_mixers: each block's token mixer, letters of `MIXERS` repeated from block 0 as
    # attn_pattern is ("MMMA": Qwen3-Next's three Gated DeltaNet blocks to one attention block);
    # empty: every block attention. A Mamba or DeltaNet block keeps its MLP (or MoE) and norms.
    layer_mixers: str = ""
    # Mamba (Gu & Dao 2023; Mamba2: Dao & Gu 2024), as transformers' Jamba (1) and Falcon-H1 /
    # GraniteMoeHybrid (2) mixers build it: d_inner = mamba_d_inner (None: 2E) channels,
    # d_state, a causal depthwise conv of width d_conv; Mamba2 in mamba_n_heads heads of
    # d_inner / heads with mamba_n_groups groups of B and C; Mamba-1's dt of rank
    # mamba_dt_rank (None: ceil(E / 16)).
    mamba_version: int = 2
    mamba_d_inner: int | None = None
    mamba_d_state: int = 128
    mamba_d_conv: int = 4
    mamba_n_heads: int = 1
    mamba_n_groups: int = 1
    mamba_dt_rank: int | None = None
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # in_proj and out_proj
    mamba_norm: bool = True  # Mamba2's gated RMSNorm over d_inner (Falcon-H1: mamba_rms_norm)
    # Gated DeltaNet (Yang et al. 2024; Qwen3-Next's linear_attn): q and k of
    # linear_num_key_heads x linear_key_head_dim, v and the output gate z of
    # linear_num_value_heads x linear_value_head_dim, a causal conv of linear_conv_kernel_dim
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # Qwen3-Next's gated attention: q_proj also yields a sigmoid gate per query channel (2 x the
    # query width); no other count changes
    attn_output_gate: bool = False

    def __post_init__(self) -> None:
        validate_config(self)

    # Derived sizes are properties, never stored.
    @property
    def hybrid(self) -> bool:
        """Some blocks mix tokens with a Mamba or Gated DeltaNet layer (layer_mixers)."""
        return bool(set(self.layer_mixers.upper()) - {"A"})

    @property
    def mamba_inner(self) -> int:
        """Mamba's inner width d_inner: mamba_d_inner, or 2E (transformers' mamba_expand 2)."""
        return 2 * self.n_embd if self.mamba_d_inner is None else self.mamba_d_inner

    @property
    def mamba_head_dim(self) -> int:
        """Mamba2's head width, d_inner / mamba_n_heads."""
        return self.mamba_inner // self.mamba_n_heads

    @property
    def mamba_dt_width(self) -> int:
        """Mamba-1's dt rank: mamba_dt_rank, or ceil(E / 16) (transformers' "auto")."""
        return -(-self.n_embd // 16) if self.mamba_dt_rank is None else self.mamba_dt_rank

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


def _validate_hybrid(cfg: GPTConfig) -> None:
    """The mixer pattern and the Mamba / Gated DeltaNet sizes."""
    if not isinstance(cfg.layer_mixers, str) or set(cfg.layer_mixers.upper()) - set(MIXERS):
        raise ConfigError("layer_mixers", "layer_mixers must be letters A (attention), M "
                                          "(Mamba), D (Gated DeltaNet), P (attention and Mamba "
                                          f"in parallel), e.g. MMMA; got {cfg.layer_mixers!r}")
    for name in ("mamba_d_state", "mamba_d_conv", "mamba_n_heads", "mamba_n_groups",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"):
        positive_int(name, getattr(cfg, name))
    for name in ("mamba_d_inner", "mamba_dt_rank"):
        if getattr(cfg, name) is not None:
            positive_int(name, getattr(cfg, name))
    for name in ("mamba_conv_bias", "mamba_proj_bias", "mamba_norm", "attn_output_gate"):
        boolean(name, getattr(cfg, name))
    one_of("mamba_version", cfg.mamba_version, (1, 2))
    if cfg.mamba_version == 2 and cfg.mamba_inner % cfg.mamba_n_heads:
        raise ConfigError("mamba_n_heads", f"mamba_n_heads {cfg.mamba_n_heads} does not divide "
                                           f"Mamba's inner width {cfg.mamba_inner}")
    if cfg.mamba_version == 2 and cfg.mamba_n_heads % cfg.mamba_n_groups:
        raise ConfigError("mamba_n_groups", f"mamba_n_groups {cfg.mamba_n_groups} does not "
                                            f"divide mamba_n_heads {cfg.mamba_n_heads}")
    if cfg.attn_output_gate and cfg.qkv_layout != "separate":
        raise ConfigError("attn_output_gate", "the gated attention's q_proj needs "
                                              "qkv_layout separate")
    if cfg.hybrid and (cfg.sliding_window is not None or cfg.mla):
        raise ConfigError("layer_mixers", "sliding-window or latent attention beside Mamba / "
                                          "DeltaNet layers is not modelled")


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
    _validate_hybrid(cfg)
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

