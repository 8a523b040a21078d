"""The architecture (`GPTConfig`), the workload (`Workload`) and the families of switches.

Letters: B micro-batch, T block size, E embedding width, L blocks, H heads,
F MLP expansion, V vocabulary. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

POSITIONS = ("learned", "sinusoidal", "rotary", "none")
NORMS = ("layernorm", "layernorm_nobias", "rmsnorm")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu")
QKV_LAYOUTS = ("fused", "separate", "per_head")


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

    def __post_init__(self) -> None:
        validate_config(self)

    # Derived sizes are properties, never stored.
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
        GPT-NeoX rounding); 0 without rotary positions."""
        return int(self.head_size * self.rotary_pct) if self.pos_embedding == "rotary" else 0

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
    if cfg.pos_embedding == "rotary" and cfg.rotary_pct == 1.0 and cfg.head_size % 2:
        raise ConfigError("head_dim",
                          f"rotary positions need an even head_dim, got {cfg.head_size}")
    if cfg.pos_embedding == "rotary" and (cfg.rotary_dims % 2 or cfg.rotary_dims == 0):
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


# --- how a model is trained ----------------------------------------------------------------------

MODES = ("fp32", "amp", "mixed", "bf16")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
AUTOCAST_DTYPES = ("bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
ATTN_IMPLS = ("manual", "sdpa")
DEVICES = ("cpu", "cuda")
IMPLS = ("reference", "transformers", "paper")
ZERO_STAGES = (0, 1, 2, 3)


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
    (Korthikanti et al. 2022); `pp` pipeline stages (1F1B). `overhead`: bytes added to every
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
    overhead: int = 0

    def __post_init__(self) -> None:
        for name, choices in (("mode", MODES), ("optimizer", OPTIMIZERS),
                              ("autocast_dtype", AUTOCAST_DTYPES), ("recompute", RECOMPUTE),
                              ("attn_impl", ATTN_IMPLS), ("device", DEVICES), ("impl", IMPLS)):
            if getattr(self, name) not in choices:
                raise ConfigError(name, f"{name} must be one of {', '.join(choices)}; "
                                        f"got {getattr(self, name)!r}")
        for name in ("dp", "tp", "pp"):
            _positive(name, getattr(self, name))
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.sp, bool):
            raise ConfigError("sp", f"sp must be true or false, got {self.sp!r}")
        if isinstance(self.overhead, bool) or not isinstance(self.overhead, int) or (
                self.overhead < 0):
            raise ConfigError("overhead", f"overhead must be a byte count >= 0, got "
                                          f"{self.overhead!r}")

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

    def describe(self) -> str:
        """One line naming every assumption of the set-up."""
        prec = {"fp32": "fp32", "amp": f"amp ({self.autocast_dtype} autocast, fp32 weights)",
                "mixed": f"mixed ({self.autocast_dtype} weights, fp32 master copy)",
                "bf16": "pure bf16"}[self.mode]
        layout = f"dp={self.dp} zero={self.zero} tp={self.tp} sp={'on' if self.sp else 'off'}" \
                 f" pp={self.pp}"
        return (f"{prec}, {self.optimizer}, attention {self.attn_impl}, {self.device.upper()} "
                f"kernels, {self.impl} implementation, recompute {self.recompute}, {layout}")


# The families the seeds train in fp32 with a written-out attention on a CPU; everything else
# (GPT-2, Llama and every Hugging Face model) is trained the way people train today: bf16
# autocast over fp32 weights, SDPA (flash attention), CUDA kernels.
SEED_FAMILIES = ("tutorial", "notes")


def family_of(cfg: GPTConfig) -> str | None:
    """The family in `ARCHS` whose switches `cfg` has (ignoring dropout), or None."""
    for name, switches in ARCHS.items():
        if all(getattr(cfg, k) == v for k, v in switches.items() if k != "dropout"):
            return name
    return None


def training_defaults(cfg: GPTConfig, hf: bool = False) -> dict[str, str]:
    """The set-up a model of this family is usually trained with: `mode`, `attn`, `device`,
    `impl`. Seed families: fp32, manual attention, CPU (the reference model, as the seeds run
    it). Others: amp (bf16), SDPA, CUDA; a Hugging Face config (`hf`) is counted as
    transformers' modules save it."""
    if not hf and family_of(cfg) in SEED_FAMILIES:
        return {"mode": "fp32", "attn": "manual", "device": "cpu", "impl": "reference"}
    return {"mode": "amp", "attn": "sdpa", "device": "cuda",
            "impl": "transformers" if hf else "reference"}


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
