"""The parameter tensors of a configuration: the one list every count derives from.

Each entry is one kind of tensor (name, shape, role, tensor-parallel split, where it lives) with
how many copies a block holds and how many blocks hold it. Parameter totals, per-component
counts, tensor counts (AdamW keeps a step counter per tensor), tensor- and pipeline-parallel
shards, autocast's 16-bit weight copies and bias counts are grouped sums over this list, so
adding an architecture switch means adding its tensors here once.

Blocks are described once with `layers` = the number of blocks holding the tensor, never
unrolled: every sum costs O(1) in the number of layers L.

Tensor-parallel splits follow Megatron-LM (Shoeybi et al. 2019, sec. 3): q/k/v and the MLP's
up (and gate) matrices are column-parallel (weights and biases split); the attention output and
the MLP's down matrix are row-parallel (weights split, biases replicated); the token embedding
and lm_head are vocabulary-parallel (ceil(V/tp) rows, Megatron pads V); norms and a learned
position table are replicated.

Routed experts are entries with `expert=True` whose `copies` is the number of routed experts of
one MoE block: expert parallelism (ep ranks) divides those copies, n_expert / ep per rank, and
within an expert the column/row split applies as for a dense MLP (Megatron's expert-tensor
parallelism). A token uses `n_expert_active` of the copies (`active_elements`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from .config import GATED_MLPS, GPTConfig
from .layers import attention_layers, deltanet_layers, dense_mlp_layers, mamba_layers, moe_layers

PLACES = ("embedding", "block", "head")  # first pipeline stage, every stage, last stage
# mixer: a Mamba or DeltaNet layer's conv kernel, A_log, D and dt_bias (neither a Linear nor a norm)
ROLES = ("embedding", "matrix", "bias", "norm", "sink", "mixer")
SPLITS = ("column", "row", "vocab", "replicated")


@dataclass(frozen=True)
class ParamTensor:
    """One kind of parameter tensor: `copies` of them in each of `layers` blocks (or one, once,
    outside the blocks when `place` is embedding or head)."""

    name: str  # module path as the reference model names it, e.g. "attn.c_attn.weight"
    component: str  # the params breakdown key it counts under, e.g. "attention/qkv"
    shape: tuple[int, ...]
    role: str  # embedding | matrix (a Linear weight) | bias | norm
    split: str  # tensor-parallel split: column | row | vocab | replicated
    place: str = "block"  # embedding | block | head
    copies: int = 1  # per block: per-head q/k/v modules hold H (or n_kv_head) of them
    layers: int = 1  # blocks holding it (1 outside blocks)
    expert: bool = False  # copies are routed experts: expert parallelism divides them

    def active_elements(self, k: int) -> int:
        """Elements one token uses: all of them, or k of the `copies` routed experts."""
        return self.numel * (min(k, self.copies) if self.expert else self.copies) * self.layers

    @property
    def numel(self) -> int:
        """Elements of one tensor."""
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        """How many such tensors the model holds."""
        return self.copies * self.layers

    @property
    def elements(self) -> int:
        """Elements of every such tensor together."""
        return self.numel * self.count

    def shard(self, tp: int) -> int:
        """Elements of one tensor on one of `tp` tensor-parallel ranks."""
        if self.split == "vocab":  # rows padded to a multiple of tp
            return -(-self.shape[0] // tp) * self.numel // self.shape[0]
        if self.split in ("column", "row"):
            return self.numel // tp
        return self.numel


def _norm(cfg: GPTConfig, name: str, component: str, place: str, layers: int
          ) -> list[ParamTensor]:
    """LayerNorm's weight and bias, or the weight alone (RMSNorm, bias-free LayerNorm)."""
    E = cfg.n_embd
    out = [ParamTensor(f"{name}.weight", component, (E,), "norm", "replicated", place,
                       layers=layers)]
    if cfg.norm == "layernorm":
        out.append(ParamTensor(f"{name}.bias", component, (E,), "norm", "replicated", place,
                               layers=layers))
    return out


def _linear(name: str, component: str, n_in: int, n_out: int, bias: bool, split: str,
            layers: int, copies: int = 1, place: str = "block") -> list[ParamTensor]:
    """nn.Linear(n_in, n_out): weight (n_out, n_in) and an optional bias (n_out); a row-parallel
    layer's bias is replicated (added after the all-reduce)."""
    out = [ParamTensor(f"{name}.weight", component, (n_out, n_in), "matrix", split, place,
                       copies, layers)]
    if bias:
        out.append(ParamTensor(f"{name}.bias", component, (n_out,), "bias",
                               "column" if split == "column" else "replicated", place,
                               copies, layers))
    return out


def _weight(name: str, component: str, shape: tuple[int, ...], layers: int, role: str = "norm"
            ) -> list[ParamTensor]:
    """A weight-only vector (a q/k or latent norm's weight, attention sinks), replicated."""
    return [ParamTensor(f"{name}.weight" if role == "norm" else name, component, shape, role,
                        "replicated", "block", layers=layers)]


def _attention(cfg: GPTConfig, L: int) -> list[ParamTensor]:
    """q/k/v (or MLA's projections), q/k norms, sinks and the output projection."""
    E, H, Hkv, hd = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size
    Dq, Dkv, b = cfg.q_width, cfg.kv_width, cfg.qkv_bias
    qkv, norm = "attention/qkv", "attention/norm"
    if cfg.mla:  # DeepSeek-V2/V3 multi-head latent attention (transformers' DeepseekV3Attention)
        Dqk, r_kv, rope = H * cfg.qk_head_dim, cfg.kv_lora_rank, cfg.rope_dim
        if cfg.q_lora_rank is None:  # DeepSeek-V2-Lite: one q_proj, no bias
            out = _linear("attn.q_proj", qkv, E, Dqk, False, "column", L)
        else:
            out = _linear("attn.q_a_proj", qkv, E, cfg.q_lora_rank, b, "replicated", L)
            out += _weight("attn.q_a_norm", norm, (cfg.q_lora_rank,), L)
            out += _linear("attn.q_b_proj", qkv, cfg.q_lora_rank, Dqk, False, "column", L)
        out += _linear("attn.kv_a_proj", qkv, E, r_kv + rope, b, "replicated", L)
        out += _weight("attn.kv_a_norm", norm, (r_kv,), L)
        out += _linear("attn.kv_b_proj", qkv, r_kv, H * (cfg.nope_dim + cfg.v_dim), False,
                       "column", L)
    elif cfg.qkv_layout == "fused":  # one E x (Dq + 2 Dkv) matrix (GPT-2's c_attn)
        out = _linear("attn.c_attn", qkv, E, Dq + 2 * Dkv, b, "column", L)
    elif cfg.qkv_layout == "separate":  # three matrices (Llama's q_proj, k_proj, v_proj)
        gate = 2 if cfg.attn_output_gate else 1  # Qwen3-Next: the query and its gate
        out = _linear("attn.q_proj", qkv, E, gate * Dq, b, "column", L)
        out += _linear("attn.k_proj", qkv, E, Dkv, b, "column", L)
        out += _linear("attn.v_proj", qkv, E, Dkv, b, "column", L)
    else:  # per_head: one Linear(E, head_dim) per head and role (the tutorial's Head modules)
        out = []
        for role, heads in (("query", H), ("key", Hkv), ("value", Hkv)):
            out += _linear(f"attn.heads.{role}", qkv, E, hd, b, "column", L, copies=heads)
    if cfg.qk_norm == "head":  # Qwen3, Gemma 3: RMSNorm(head_dim), shared by the heads
        out += _weight("attn.q_norm", norm, (hd,), L) + _weight("attn.k_norm", norm, (hd,), L)
    elif cfg.qk_norm in ("per_head", "proj"):  # StableLM/Cohere per head, OLMo 2 per projection
        shape_q, shape_k = ((H, hd), (Hkv, hd)) if cfg.qk_norm == "per_head" else ((Dq,), (Dkv,))
        out += _weight("attn.q_norm", norm, shape_q, L) + _weight("attn.k_norm", norm, shape_k, L)
    if cfg.attn_sinks:  # gpt-oss: one learned logit per head
        out += _weight("attn.sinks", "attention/sinks", (H,), L, role="sink")
    out += _linear("attn.c_proj", "attention/out", cfg.attn_out_width, E, cfg.attn_out_bias,
                   "row", L)
    return out


def _mlp(cfg: GPTConfig, prefix: str, keys: tuple[str, str, str], width: int, bias: bool,
         layers: int, copies: int = 1, expert: bool = False) -> list[ParamTensor]:
    """An MLP of hidden `width`: up (c_fc), a gate for SwiGLU/GeGLU, down (c_proj); `keys` are
    the components of the three matrices."""
    E = cfg.n_embd
    parts = [("c_fc", keys[0], E, width, "column")]
    if cfg.mlp in GATED_MLPS:  # SwiGLU / GeGLU (Shazeer 2020): a gate the size of the up matrix
        parts.append(("c_gate", keys[1], E, width, "column"))
    parts.append(("c_proj", keys[2], width, E, "row"))
    return [dataclasses.replace(t, expert=expert)
            for name, key, n_in, n_out, split in parts
            for t in _linear(f"{prefix}.{name}", key, n_in, n_out, bias, split, layers, copies)]


# the params breakdown keys of the Mamba and Gated DeltaNet layers (present for hybrid models)
MIXER_KEYS = ("mamba/in_proj", "mamba/conv", "mamba/x_proj", "mamba/dt_proj", "mamba/ssm",
              "mamba/norm", "norm/mamba", "mamba/out_proj", "deltanet/in_proj", "deltanet/conv",
              "deltanet/ssm", "norm/deltanet", "deltanet/out_proj")


def _mixer(name: str, component: str, shape: tuple[int, ...], layers: int,
           role: str = "mixer", split: str = "column") -> list[ParamTensor]:
    """A Mamba / DeltaNet parameter that is not a Linear, split by channels or heads across
    tensor-parallel ranks as vLLM shards them (column), or replicated."""
    return [ParamTensor(name, component, shape, role, split, "block", layers=layers)]


def mamba_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """A Mamba layer's tensors in each Mamba block (`mamba_layers`), as transformers builds them.

    Mamba2 (Falcon-H1's and GraniteMoeHybrid's mixer): in_proj E -> 2 d_inner + 2 G N + h (the
    gate z, x, B and C of G groups of d_state N, dt of h heads), a depthwise conv1d over
    d_inner + 2 G N channels of width d_conv (+ bias), dt_bias, A_log and D of h, the gated
    RMSNorm over d_inner (mamba_norm), out_proj d_inner -> E.
    Mamba-1 (Jamba's mixer): in_proj E -> 2 d_inner, conv1d over d_inner, x_proj d_inner ->
    R + 2N (dt rank R), dt_proj R -> d_inner with bias, A_log (d_inner, N), D (d_inner),
    out_proj, and Jamba's RMSNorms over dt (R), B and C (N).
    Biases: conv1d's by mamba_conv_bias; in_proj's and out_proj's by mamba_proj_bias."""
    n = mamba_layers(cfg)
    if not n:
        return []
    E, D, N, K = cfg.n_embd, cfg.mamba_inner, cfg.mamba_d_state, cfg.mamba_d_conv
    pb, key = cfg.mamba_proj_bias, "mamba/"
    if cfg.mamba_version == 1:
        R = cfg.mamba_dt_width
        out = _linear("mamba.in_proj", key + "in_proj", E, 2 * D, pb, "column", n)
        out += _mixer("mamba.conv1d.weight", key + "conv", (D, 1, K), n)
        if cfg.mamba_conv_bias:
            out += _mixer("mamba.conv1d.bias", key + "conv", (D,), n, role="bias")
        out += _linear("mamba.x_proj", key + "x_proj", D, R + 2 * N, False, "row", n)
        out += _linear("mamba.dt_proj", key + "dt_proj", R, D, True, "column", n)
        out += _mixer("mamba.A_log", key + "ssm", (D, N), n)
        out += _mixer("mamba.D", key + "ssm", (D,), n)
        for norm, width in (("dt", R), ("b", N), ("c", N)):  # Jamba's, replicated in vLLM
            out += _weight(f"mamba.{norm}_layernorm", "norm/mamba", (width,), n)
    else:
        G, h = cfg.mamba_n_groups, cfg.mamba_n_heads
        conv = D + 2 * G * N
        out = _linear("mamba.in_proj", key + "in_proj", E, D + conv + h, pb, "column", n)
        out += _mixer("mamba.conv1d.weight", key + "conv", (conv, 1, K), n)
        if cfg.mamba_conv_bias:
            out += _mixer("mamba.conv1d.bias", key + "conv", (conv,), n, role="bias")
        for name in ("dt_bias", "A_log", "D"):
            out += _mixer(f"mamba.{name}", key + "ssm", (h,), n)
        if cfg.mamba_norm:  # split by channels in vLLM's Mixer2RMSNormGated
            out += _mixer("mamba.norm.weight", key + "norm", (D,), n, role="norm")
    out += _linear("mamba.out_proj", key + "out_proj", D, E, pb, "row", n)
    return out


def deltanet_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """A Gated DeltaNet layer's tensors in each DeltaNet block (`deltanet_layers`), as
    transformers' Qwen3NextGatedDeltaNet builds them: in_proj_qkvz E -> 2 Hk dk + 2 Hv dv (q, k;
    v and the output gate z), in_proj_ba E -> 2 Hv (the write strength beta and the decay's
    input), a depthwise conv1d over 2 Hk dk + Hv dv channels of width K without bias, dt_bias
    and A_log of Hv, a gated RMSNorm of dv shared by the heads, out_proj Hv dv -> E."""
    n = deltanet_layers(cfg)
    if not n:
        return []
    E, Hk, Hv = cfg.n_embd, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    key = "deltanet/"
    out = _linear("deltanet.in_proj_qkvz", key + "in_proj", E, 2 * Hk * dk + 2 * Hv * dv,
                  False, "column", n)
    out += _linear("deltanet.in_proj_ba", key + "in_proj", E, 2 * Hv, False, "column", n)
    out += _mixer("deltanet.conv1d.weight", key + "conv", (2 * Hk * dk + Hv * dv, 1, K), n)
    out += _mixer("deltanet.dt_bias", key + "ssm", (Hv,), n)
    out += _mixer("deltanet.A_log", key + "ssm", (Hv,), n)
    out += _weight("deltanet.norm", "norm/deltanet", (dv,), n)
    out += _linear("deltanet.out_proj", key + "out_proj", Hv * dv, E, False, "row", n)
    return out


def mixer_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """The hybrid blocks' Mamba and Gated DeltaNet layers (none without layer_mixers)."""
    return mamba_tensors(cfg) + deltanet_tensors(cfg)


def block_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """The tensors of the transformer blocks, each kind once with its `layers` count."""
    E, L = cfg.n_embd, cfg.n_layer
    out: list[ParamTensor] = []
    if cfg.pre_norm:  # ln_1 before attention; ln_2 before the MLP unless both share ln_1
        out += _norm(cfg, "ln_1", "norm/attention", "block", L)
    out += _attention(cfg, attention_layers(cfg)) + mixer_tensors(cfg)
    if cfg.post_norm:  # Gemma 2/3 post_attention_layernorm, OLMo 2 post_attention_layernorm
        out += _norm(cfg, "ln_attn_out", "norm/attention", "block", L)
    if cfg.pre_norm and not cfg.shared_norm:
        out += _norm(cfg, "ln_2", "norm/mlp", "block", L)
    dense, sparse = dense_mlp_layers(cfg), moe_layers(cfg)
    out += _mlp(cfg, "mlp", ("mlp/fc", "mlp/gate", "mlp/proj"), cfg.ffn_dim, cfg.mlp_bias, dense)
    if sparse:
        n = cfg.n_expert
        out += _linear("moe.router", "moe/router", E, n, cfg.router_bias, "replicated", sparse)
        out += _mlp(cfg, "moe.experts", ("moe/experts",) * 3, cfg.expert_dim, cfg.expert_bias,
                    sparse, copies=n, expert=True)
        if cfg.shared_dim:
            out += _mlp(cfg, "moe.shared", ("moe/shared",) * 3, cfg.shared_dim, cfg.mlp_bias,
                        sparse)
        if cfg.shared_dim and cfg.shared_expert_gate:  # Qwen2-MoE: sigmoid(Linear(E, 1))
            out += _linear("moe.shared_gate", "moe/shared", E, 1, False, "replicated", sparse)
    if cfg.post_norm:  # Gemma 2/3, OLMo 2 post_feedforward_layernorm
        out += _norm(cfg, "ln_mlp_out", "norm/mlp", "block", L)
    return [t for t in out if t.layers]


def embedding_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """Token embedding (vocabulary-parallel) and a learned position table (replicated)."""
    out = [ParamTensor("wte.weight", "embedding/token", (cfg.vocab_size, cfg.embd_dim),
                       "embedding", "vocab", "embedding")]
    if cfg.pos_embedding == "learned":  # the one place the block size T enters the count
        # OPT's table has pos_offset (2) more rows than max_position_embeddings
        rows = cfg.block_size + cfg.pos_offset
        out.append(ParamTensor("wpe.weight", "embedding/position", (rows, cfg.n_embd),
                               "embedding", "replicated", "embedding"))
    if cfg.embd_dim != cfg.n_embd:  # OPT's project_in: Linear(word_embed_proj_dim, E)
        out += _linear("proj_in", "embedding/proj", cfg.embd_dim, cfg.n_embd, False,
                       "replicated", 1, place="embedding")
    if cfg.embd_norm:  # BLOOM's word_embeddings_layernorm
        out += _norm(cfg, "ln_emb", "norm/embedding", "embedding", 1)
    return out


def head_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """Final norm and lm_head; a tied head's weight is the token embedding's tensor."""
    out = _norm(cfg, "ln_f", "norm/final", "head", 1) if cfg.final_norm else []
    V, E = cfg.vocab_size, cfg.embd_dim
    if cfg.embd_dim != cfg.n_embd:  # OPT's project_out: Linear(E, word_embed_proj_dim)
        out += _linear("proj_out", "embedding/proj", cfg.n_embd, E, False, "replicated", 1,
                       place="head")
    if not cfg.tie_embeddings:
        out.append(ParamTensor("lm_head.weight", "lm_head", (V, E), "matrix", "vocab", "head"))
    if cfg.lm_head_bias:
        out.append(ParamTensor("lm_head.bias", "lm_head", (V,), "bias", "vocab", "head"))
    return out


def inventory(cfg: GPTConfig) -> list[ParamTensor]:
    """Every parameter tensor kind of `cfg`, a tied weight once (under the embedding)."""
    return list(_inventory(cfg))


# every count of a command asks for the same configuration's list (a configuration is frozen,
# so its list is made once); the callers get their own list to filter or extend
@lru_cache(maxsize=256)
def _inventory(cfg: GPTConfig) -> tuple[ParamTensor, ...]:
    return tuple(embedding_tensors(cfg) + block_tensors(cfg) + head_tensors(cfg))


def tied_head_weight(cfg: GPTConfig) -> ParamTensor | None:
    """The lm_head's matrix when it is the token embedding's tensor (it is used as a matrix by
    the head: autocast copies it, and a last pipeline stage holds its own copy of it)."""
    if not cfg.tie_embeddings:
        return None
    return ParamTensor("wte.weight", "lm_head", (cfg.vocab_size, cfg.embd_dim), "matrix",
                       "vocab", "head")
