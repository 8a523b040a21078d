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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import GPTConfig

PLACES = ("embedding", "block", "head")  # first pipeline stage, every stage, last stage
ROLES = ("embedding", "matrix", "bias", "norm")
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


def block_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """The tensors of the transformer blocks, each kind once with its `layers` count."""
    E, L, H = cfg.n_embd, cfg.n_layer, cfg.n_head
    Dq, Dkv, Dff, hd = cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.head_size
    out = _norm(cfg, "ln_1", "norm/attention", "block", L)
    qkv, b = "attention/qkv", cfg.qkv_bias
    if cfg.qkv_layout == "fused":  # one E x (Dq + 2 Dkv) matrix (GPT-2's c_attn)
        out += _linear("attn.c_attn", qkv, E, Dq + 2 * Dkv, b, "column", L)
    elif cfg.qkv_layout == "separate":  # three matrices (Llama's q_proj, k_proj, v_proj)
        out += _linear("attn.q_proj", qkv, E, Dq, b, "column", L)
        out += _linear("attn.k_proj", qkv, E, Dkv, b, "column", L)
        out += _linear("attn.v_proj", qkv, E, Dkv, b, "column", L)
    else:  # per_head: one Linear(E, head_dim) per head and role (the tutorial's Head modules)
        for role, heads in (("query", H), ("key", cfg.kv_heads), ("value", cfg.kv_heads)):
            out += _linear(f"attn.heads.{role}", qkv, E, hd, b, "column", L, copies=heads)
    out += _linear("attn.c_proj", "attention/out", Dq, E, cfg.attn_out_bias, "row", L)
    out += _norm(cfg, "ln_2", "norm/mlp", "block", L)
    out += _linear("mlp.c_fc", "mlp/fc", E, Dff, cfg.mlp_bias, "column", L)
    if cfg.mlp == "swiglu":  # SwiGLU (Shazeer 2020): a gate matrix the size of the up one
        out += _linear("mlp.gate", "mlp/gate", E, Dff, cfg.mlp_bias, "column", L)
    out += _linear("mlp.c_proj", "mlp/proj", Dff, E, cfg.mlp_bias, "row", L)
    return out


def embedding_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """Token embedding (vocabulary-parallel) and a learned position table (replicated)."""
    out = [ParamTensor("wte.weight", "embedding/token", (cfg.vocab_size, cfg.n_embd),
                       "embedding", "vocab", "embedding")]
    if cfg.pos_embedding == "learned":  # the one place the block size T enters the count
        out.append(ParamTensor("wpe.weight", "embedding/position", (cfg.block_size, cfg.n_embd),
                               "embedding", "replicated", "embedding"))
    return out


def head_tensors(cfg: GPTConfig) -> list[ParamTensor]:
    """Final norm and lm_head; a tied head's weight is the token embedding's tensor."""
    out = _norm(cfg, "ln_f", "norm/final", "head", 1) if cfg.final_norm else []
    V, E = cfg.vocab_size, cfg.n_embd
    if not cfg.tie_embeddings:
        out.append(ParamTensor("lm_head.weight", "lm_head", (V, E), "matrix", "vocab", "head"))
    if cfg.lm_head_bias:
        out.append(ParamTensor("lm_head.bias", "lm_head", (V,), "bias", "vocab", "head"))
    return out


def inventory(cfg: GPTConfig) -> list[ParamTensor]:
    """Every parameter tensor kind of `cfg`, a tied weight once (under the embedding)."""
    return embedding_tensors(cfg) + block_tensors(cfg) + head_tensors(cfg)


def tied_head_weight(cfg: GPTConfig) -> ParamTensor | None:
    """The lm_head's matrix when it is the token embedding's tensor (it is used as a matrix by
    the head: autocast copies it, and a last pipeline stage holds its own copy of it)."""
    if not cfg.tie_embeddings:
        return None
    return ParamTensor("wte.weight", "lm_head", (cfg.vocab_size, cfg.n_embd), "matrix", "vocab",
                       "head")
