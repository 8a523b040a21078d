"""Memory of training and inference, per device, in bytes, exact.

Four families of numbers, each a pure function of (config, workload, setup):

- model states: weights, gradients and optimizer states (`state_bytes`), with data parallel
  ZeRO stages 0-3, tensor parallel and pipeline parallel sharding;
- activations: `activations_paper` (Korthikanti et al. 2022, Table 2, as published) beside the
  implementation-exact `saved_activations` (reference_model/memory.py measures what PyTorch saves
  for backward; `gptcalc/activations.py` writes it down one line per tensor);
- logits and cross-entropy temporaries, and the KV cache of an inference run;
- the peak of one training step (`step_peak`), naming the phase that holds it.

Byte sizes of dtypes: fp32 4, bf16 / fp16 2, bool 1. Bytes use binary units when printed.
This module never imports torch.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from dataclasses import dataclass, field

from .config import ConfigError, GPTConfig, Workload, validate_workload
from .params import norm_params

MODES = ("fp32", "amp", "mixed", "bf16")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
AUTOCAST_DTYPES = ("bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
ATTN_IMPLS = ("manual", "sdpa")
DEVICES = ("cpu", "cuda")
ZERO_STAGES = (0, 1, 2, 3)

# Bytes per parameter of (weights, gradients) and of the optimizer's per-parameter state.
# fp32: everything fp32. amp: torch.autocast keeps fp32 weights and gradients and computes in
# 16 bit. mixed: the ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 3.1): fp16 weights
# and gradients (2 + 2) plus an fp32 master copy of the weights (4) and Adam's fp32 momentum and
# variance (4 + 4) = 16 bytes/param, K = 12; the reference model runs it as
# reference_model.memory.MasterWeights (a 16-bit model under autocast, fp32 masters and states
# in the optimizer). bf16: weights, gradients and states all bf16.
_WEIGHT_GRAD_BYTES = {"fp32": (4, 4), "amp": (4, 4), "mixed": (2, 2), "bf16": (2, 2)}
_OPTIMIZER_BYTES = {
    # adamw: exp_avg + exp_avg_sq; sgd-momentum: momentum_buffer; sgd: nothing
    "fp32": {"adamw": 8, "sgd-momentum": 4, "sgd": 0},
    "amp": {"adamw": 8, "sgd-momentum": 4, "sgd": 0},
    # the fp32 master weights (4) belong to the optimizer in the ZeRO paper's K
    "mixed": {"adamw": 12, "sgd-momentum": 8, "sgd": 4},
    "bf16": {"adamw": 4, "sgd-momentum": 2, "sgd": 0},
}
# torch.optim.AdamW keeps state["step"] as a 0-d float32 tensor per parameter tensor
STEP_COUNTER_BYTES = 4


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is trained: precision, optimizer, recomputation, attention, parallelism.

    mode: fp32 | amp (fp32 weights and gradients, autocast compute in `autocast_dtype`) |
    mixed (ZeRO accounting: 16-bit weights and gradients + fp32 master weights and states) |
    bf16 (pure bf16 weights, gradients and states). Parallelism: `dp` data-parallel replicas
    with ZeRO stage `zero`; `tp` tensor-parallel ranks (Megatron-LM); `pp` pipeline stages
    (1F1B schedule); `sp` sequence parallel (Korthikanti et al. 2022) on top of tp.
    `device` matters only for implementation details (CPU and CUDA kernels save different
    dtypes for some ops; DESIGN.md).
    """

    mode: str = "fp32"
    optimizer: str = "adamw"
    autocast_dtype: str = "bf16"
    recompute: str = "none"
    attn_impl: str = "manual"
    device: str = "cpu"
    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        for name, choices in (("mode", MODES), ("optimizer", OPTIMIZERS),
                              ("autocast_dtype", AUTOCAST_DTYPES), ("recompute", RECOMPUTE),
                              ("attn_impl", ATTN_IMPLS), ("device", DEVICES)):
            if getattr(self, name) not in choices:
                raise ConfigError(name, f"{name} must be one of {', '.join(choices)}; "
                                        f"got {getattr(self, name)!r}")
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"{name} must be a positive integer, got {v!r}")
        if self.zero not in ZERO_STAGES:
            raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")

    @property
    def weight_bytes(self) -> int:
        return _WEIGHT_GRAD_BYTES[self.mode][0]

    @property
    def grad_bytes(self) -> int:
        return _WEIGHT_GRAD_BYTES[self.mode][1]

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state per parameter (the ZeRO paper's K in mixed mode)."""
        return _OPTIMIZER_BYTES[self.mode][self.optimizer]

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element: fp32, or the 16-bit compute dtype."""
        return 4 if self.mode == "fp32" else 2

    @property
    def step_counters(self) -> bool:
        return self.optimizer == "adamw"


def validate_setup(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> None:
    """Parallel sizes must divide what they shard (Megatron-LM's and the 1F1B schedule's rules)."""
    validate_workload(cfg, workload)
    t, p, d = setup.tp, setup.pp, setup.dp
    for what, size in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads),
                       ("d_ff", cfg.ffn_dim), ("n_embd", cfg.n_embd)):
        if size % t:
            raise ConfigError("tp", f"tp {t} does not divide {what} {size}")
    if setup.sp and workload.seq_len % t:
        raise ConfigError("sp", f"sequence parallel needs tp {t} to divide seq_len "
                                f"{workload.seq_len}")
    if cfg.n_layer % p:
        raise ConfigError("pp", f"pp {p} does not divide n_layer {cfg.n_layer}")
    if workload.batch_size % d:
        raise ConfigError("dp", f"dp {d} does not divide the global batch {workload.batch_size}")
    if setup.zero and d == 1:
        pass  # ZeRO over one replica shards nothing; allowed, it is the same as stage 0


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------


def zero_bytes_per_param(setup: TrainingSetup, n_params: int) -> dict[str, int]:
    """Weights, gradients and optimizer bytes per device for `n_params` parameters under ZeRO.

    Rajbhandari et al. 2020, sec. 5 / Fig. 1: stage 1 (P_os) shards the optimizer states across
    the dp replicas, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights;
    everything not sharded is replicated on every replica. A shard is ceil(n/dp) elements
    (DeepSpeed pads its flat partitions to equal size).
    """
    d, z = setup.dp, setup.zero
    shard = _ceil(n_params, d)
    return {
        "weights": setup.weight_bytes * (shard if z >= 3 else n_params),
        "gradients": setup.grad_bytes * (shard if z >= 2 else n_params),
        "optimizer": setup.optimizer_bytes * (shard if z >= 1 else n_params),
    }


def _layer_tensors(cfg: GPTConfig) -> int:
    """nn.Parameter objects of one block: per_head q/k/v are one Linear per head and role."""
    qkv_mats = {"fused": 1, "separate": 3, "per_head": 3 * cfg.n_head}[cfg.qkv_layout]
    mlp_mats = 3 if cfg.mlp == "swiglu" else 2
    return (qkv_mats * (2 if cfg.qkv_bias else 1) + (2 if cfg.attn_out_bias else 1)
            + mlp_mats * (2 if cfg.mlp_bias else 1) + 2 * _norm_tensors(cfg))


def _norm_tensors(cfg: GPTConfig) -> int:
    return 2 if cfg.norm == "layernorm" else 1


def _embedding_tensors(cfg: GPTConfig) -> int:
    return 1 + (1 if cfg.pos_embedding == "learned" else 0)


def _head_tensors(cfg: GPTConfig) -> int:
    """Final norm and lm_head tensors (a tied head weight is the embedding's tensor)."""
    return ((_norm_tensors(cfg) if cfg.final_norm else 0) + (0 if cfg.tie_embeddings else 1)
            + (1 if cfg.lm_head_bias else 0))


def param_tensors(cfg: GPTConfig) -> int:
    """Parameter tensors of the reference model (AdamW keeps one step counter per tensor)."""
    return _embedding_tensors(cfg) + cfg.n_layer * _layer_tensors(cfg) + _head_tensors(cfg)


def stage_params(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, dict[str, int]]:
    """Parameters held by one device of the first and of the last pipeline stage, by component.

    Tensor parallel (Shoeybi et al. 2019, Megatron-LM): the q/k/v and MLP up (and gate)
    matrices are column-parallel (weights and biases split by tp); the attention output and MLP
    down matrices are row-parallel (weights split, biases replicated); the token embedding and
    lm_head are vocabulary-parallel, ceil(V/tp) rows each (Megatron pads V); LayerNorm/RMSNorm
    weights and the learned position table are replicated.
    Pipeline parallel: each stage holds L/pp blocks; the first also the embeddings, the last the
    final norm and the lm_head; with tied embeddings and pp > 1 the last stage keeps its own copy
    of the token embedding for the head (Megatron's word-embedding copy on the last stage).
    """
    t, p = setup.tp, setup.pp
    E, V, T = cfg.n_embd, cfg.vocab_size, cfg.block_size
    Dq, Dkv, Dff = cfg.q_width, cfg.kv_width, cfg.ffn_dim
    qkv_out = Dq + 2 * Dkv
    layers = cfg.n_layer // p
    per_layer = {
        "attention/qkv": (E * qkv_out + (qkv_out if cfg.qkv_bias else 0)) // t,
        "attention/out": Dq * E // t + (E if cfg.attn_out_bias else 0),
        "mlp/fc": (E * Dff + (Dff if cfg.mlp_bias else 0)) // t,
        "mlp/gate": (E * Dff + (Dff if cfg.mlp_bias else 0)) // t if cfg.mlp == "swiglu" else 0,
        "mlp/proj": Dff * E // t + (E if cfg.mlp_bias else 0),
        "norm/attention": norm_params(cfg, E),
        "norm/mlp": norm_params(cfg, E),
    }
    blocks = {k: layers * v for k, v in per_layer.items()}
    v_shard = _ceil(V, t)
    token = v_shard * E
    first = {"embedding/token": token,
             "embedding/position": T * E if cfg.pos_embedding == "learned" else 0, **blocks}
    head = {"norm/final": norm_params(cfg, E) if cfg.final_norm else 0,
            "lm_head": (0 if cfg.tie_embeddings else v_shard * E)
            + (v_shard if cfg.lm_head_bias else 0)}
    if p == 1:
        return {"first": {**first, **head}, "last": {**first, **head}}
    tied_copy = token if cfg.tie_embeddings else 0
    last = {"embedding/token": tied_copy, "embedding/position": 0, **blocks, **head}
    first.update({"norm/final": 0, "lm_head": 0})
    return {"first": first, "last": last}


def _stage_tensors(cfg: GPTConfig, setup: TrainingSetup, stage: str) -> int:
    """Parameter tensors on one device of a stage (step counters are replicated, not sharded)."""
    if setup.pp == 1:
        return param_tensors(cfg)
    blocks = cfg.n_layer // setup.pp * _layer_tensors(cfg)
    if stage == "first":
        return blocks + _embedding_tensors(cfg)
    return blocks + _head_tensors(cfg) + (1 if cfg.tie_embeddings else 0)


@dataclass(frozen=True)
class StateBytes:
    """Weights, gradients and optimizer states of one device, with what each line holds."""

    stage: str  # "first" or "last" pipeline stage (the same stage when pp == 1)
    params: int  # parameters held by the device before ZeRO sharding
    weights: int
    gradients: int
    optimizer: int
    breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def state_bytes(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first") -> StateBytes:
    """Weights, gradients and optimizer states on one device of `stage`, exact.

    Sharding as `stage_params` (tp, pp) then `zero_bytes_per_param` (dp, ZeRO). AdamW adds a
    4-byte step counter per parameter tensor (torch keeps `state["step"]` as a float32 scalar
    tensor), not sharded by ZeRO in this accounting.
    """
    n = sum(stage_params(cfg, setup)[stage].values())
    z = zero_bytes_per_param(setup, n)
    steps = STEP_COUNTER_BYTES * _stage_tensors(cfg, setup, stage) if setup.step_counters else 0
    breakdown = {"weights": z["weights"], "gradients": z["gradients"],
                 "optimizer/states": z["optimizer"], "optimizer/step": steps}
    return StateBytes(stage=stage, params=n, weights=z["weights"], gradients=z["gradients"],
                      optimizer=z["optimizer"] + steps, breakdown=breakdown)


# ---------------------------------------------------------------------------------------------
# Activations as published (Korthikanti et al. 2022)
# ---------------------------------------------------------------------------------------------


def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                      recompute: str = "none") -> int:
    """Korthikanti et al. 2022, Table 2: activation bytes of one transformer layer.

    16-bit activations and 1-byte dropout masks, F = 4, s sequence, b micro-batch, h hidden,
    a heads, t tensor-parallel size:
      no recomputation, tp:       sbh(10 + 24/t + 5as/(ht))
      no recomputation, tp + sp:  sbh(34/t + 5as/(ht))
      selective, tp:              sbh(10 + 24/t)
      selective, tp + sp:         sbh(34/t)
      full recomputation:         2sbh  (the layer input; with sp Megatron keeps its 1/t shard)
    With t = 1 the first row is the paper's sbh(34 + 5as/h).
    """
    sbh = s * b * h
    attention_core = 5 * a * s * s * b // t  # sbh * 5as/(ht): softmax 2, its dropout mask 1, output 2
    if recompute == "full":
        return 2 * sbh // (t if sp else 1)
    if sp:
        base = 34 * sbh // t
    else:
        base = 10 * sbh + 24 * sbh // t
    return base + (attention_core if recompute == "none" else 0)


def activations_paper(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> dict[str, int]:
    """Korthikanti et al. 2022's activation memory of the most loaded device, term by term.

    layers: L/pp layers x pp micro-batches in flight on the first stage of a 1F1B pipeline
    (their sec. 4.2.3) = L x `paper_layer_bytes`, with h = E, a = H, s = seq_len and b the
    micro-batch B/dp. embedding/dropout: the 1-byte dropout mask of the input embeddings for
    the pp micro-batches, sbhp/t with sp (sbhp without). The output terms, counted where
    pp = 1 (they live on the last stage): final LayerNorm input 2sbh/t, output-projection input
    2sbh/t (each /t only with sp), and fp32 logits for the cross entropy 4sbv/t, i.e. the
    paper's (4sbh/t)(1 + v/h). As published: 16-bit activations whatever the mode.
    """
    s, b, h, a = workload.seq_len, workload.batch_size // setup.dp, cfg.n_embd, cfg.n_head
    t, p, v = setup.tp, setup.pp, cfg.vocab_size
    ts = t if setup.sp else 1
    out = {
        "layers": cfg.n_layer * paper_layer_bytes(s, b, h, a, t, setup.sp, setup.recompute),
        "embedding/dropout": s * b * h * p // ts,
        "output/final_norm": 2 * s * b * h // ts if p == 1 else 0,
        "output/lm_head_input": 2 * s * b * h // ts if p == 1 else 0,
        "output/cross_entropy": 4 * s * b * v // t if p == 1 else 0,
    }
    return out


# ---------------------------------------------------------------------------------------------
# Logits, KV cache
# ---------------------------------------------------------------------------------------------


def logits_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> dict[str, int]:
    """The logits and the cross entropy's saved log-probabilities of one micro-batch.

    logits: B*S*V in the compute dtype (the model returns them, so they stay alive through
    backward). log_probs: F.cross_entropy's log_softmax output, saved for backward, fp32 under
    autocast (log_softmax autocasts to fp32), else the logits' dtype. Vocab-parallel over tp.
    """
    b, S = workload.batch_size // setup.dp, workload.seq_len
    n = b * S * _ceil(cfg.vocab_size, setup.tp)
    logit_bytes = setup.act_bytes
    lp_bytes = 4 if setup.mode in ("amp", "mixed") else logit_bytes
    return {"logits": n * logit_bytes, "cross_entropy/log_probs": n * lp_bytes}


def kv_cache_bytes(cfg: GPTConfig, batch_size: int, context: int, dtype_bytes: int,
                   tp: int = 1, pp: int = 1) -> int:
    """KV cache of an inference run: 2 (K and V) * L * B * context * n_kv_head * head_dim * bytes.

    Grouped-query aware (only the n_kv_head key/value heads are cached); per device, tp shards
    the KV heads and pp the layers.
    """
    return (2 * (cfg.n_layer // pp) * batch_size * context * (cfg.kv_heads // tp)
            * cfg.head_size * dtype_bytes)


def inference_bytes(cfg: GPTConfig, batch_size: int, context: int, setup: TrainingSetup) -> int:
    """Weights in the activation dtype plus the KV cache (activations of one token ignored)."""
    n = sum(stage_params(cfg, setup)["first"].values())
    return n * setup.act_bytes + kv_cache_bytes(cfg, batch_size, context, setup.act_bytes,
                                                setup.tp, setup.pp)


def max_context(cfg: GPTConfig, batch_size: int, setup: TrainingSetup, budget: int) -> int:
    """Largest context whose inference memory fits `budget` bytes (0 if the weights do not)."""
    fixed = inference_bytes(cfg, batch_size, 0, setup)
    per_token = kv_cache_bytes(cfg, batch_size, 1, setup.act_bytes, setup.tp, setup.pp)
    return max(0, (budget - fixed) // per_token) if per_token else 0


# ---------------------------------------------------------------------------------------------
# Activations as the reference model saves them (implementation-exact)
# ---------------------------------------------------------------------------------------------


def _qkv_storages(cfg: GPTConfig, N: int, a: int, rot: int | None = None) -> int:
    """Bytes of the storages behind the q, k, v handed to the attention core.

    Each is a view of the projection that made it unless something copied it: rotary (a new
    tensor for q and k, `rot` bytes per element: fp32 under amp, where the fp32 cos/sin tables
    promote the 16-bit q and k), grouped-query repeat_interleave (new k and v of H heads).
    Views of the fused c_attn output keep all of it, N(Dq + 2Dkv), alive once.
    """
    Dq, Dkv = cfg.q_width, cfg.kv_width
    rot = a if rot is None else rot
    gqa, rotary = cfg.kv_heads != cfg.n_head, cfg.pos_embedding == "rotary"
    own = {"q": Dq * rot if rotary else 0,
           "k": Dq * (rot if rotary else a) if gqa else (Dkv * rot if rotary else 0),
           "v": Dq * a if gqa else 0}
    total = sum(own.values())
    views = [r for r in own if not own[r]]
    if cfg.qkv_layout == "fused":
        total += (Dq + 2 * Dkv) * a if views else 0
    else:  # separate projections (per_head: concatenated per role) are storages of their own
        total += sum(Dq if r == "q" else Dkv for r in views) * a
    return N * total


def _matmul_operands(cfg: GPTConfig, b: int, N: int, a: int, m: int, math_path: bool
                     ) -> dict[str, int]:
    """Storages behind the q, k^T and v that the attention matmuls save, m bytes per element.

    matmul folds (b, H, S, hd) operands to (b*H, S, hd). When b == 1 or H == 1 that reshape is
    a view, so what is saved is the tensor q, k or v is a view of: the fused c_attn output
    (N(Dq + 2Dkv), kept once however many roles share it), a separate projection's output, the
    rotary or repeat_interleave result (N*Dq). Otherwise matmul saves a contiguous copy, N*Dq
    each. (S == 1 can also fold as a view, but only where the source holds exactly N*Dq.)
    SDPA's math path scales q and k first (fresh tensors either way) and, in 16-bit, upcasts v
    to fp32, so only an fp32 v can be a view of its source.
    """
    Dq, Dkv, H = cfg.q_width, cfg.kv_width, cfg.n_head
    gqa, rotary = cfg.kv_heads != H, cfg.pos_embedding == "rotary"
    views = b == 1 or H == 1

    def source(role: str) -> tuple[str, int]:
        if (role == "q" and rotary) or (role == "k" and rotary and not gqa) or (
                role in "kv" and gqa):
            return role + "/own", N * Dq * a  # rotary / repeat_interleave made a new tensor
        if cfg.qkv_layout == "fused":
            return "c_attn", N * (Dq + 2 * Dkv) * a
        return role + "/proj", N * (Dq if role == "q" else Dkv) * a

    lines, seen = {}, set()
    for role, key in (("q", "attn/q"), ("k", "attn/k_t"), ("v", "attn/v")):
        if not views or (math_path and (role != "v" or a != 4)):
            lines[key] = N * Dq * m  # a fresh contiguous copy
            continue
        name, nbytes = source(role)
        lines[key] = 0 if name in seen else nbytes
        seen.add(name)
    return lines


def _norm_lines(cfg: GPTConfig, N: int, a: int, stats: int) -> dict[str, int]:
    E = cfg.n_embd
    if cfg.norm == "rmsnorm":
        # x * rsqrt(mean(x^2) + eps) * w: pow saves x, rsqrt its result, the last mul x * r
        return {"input": N * E * a, "rsqrt": N * a, "normalized": N * E * a}
    # native_layer_norm saves its input, mean and rstd
    return {"input": N * E * a, "mean": N * stats, "rstd": N * stats}


def saved_activations(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                      ) -> dict[str, int]:
    """Bytes PyTorch saves for backward in one forward of the reference model, one line each.

    Exact (measured with saved_tensors_hooks, deduplicated by storage) on CPU for every mode
    (fp32, bf16, and under torch.autocast amp and mixed, bf16 or fp16), for every size (with b
    or H equal to 1, matmul saves views instead of copies: `_matmul_operands`). Per micro-batch
    b = B/dp on one device; with pp, the first stage holds pp micro-batches of L/pp layers = L
    layers' worth (1F1B). Keys: `embedding/...`, `layer/...` (summed over L layers),
    `final/...`, `cross_entropy/...`, `input/...` (the batch's own index tensors, saved by the
    embedding and the loss), `weight_copy/...` (amp: `autocast_weight_copies`).

    CPU autocast (measured, torch 2.13): Linear and matmul / bmm / SDPA run in the 16-bit dtype;
    layer_norm, softmax, GELU, SiLU, ReLU and the RMSNorm's pow / mean / rsqrt are not autocast
    (they run in their input's dtype; softmax stays 16-bit, unlike CUDA autocast); cross
    entropy runs in fp32. Under amp the weights, embeddings and buffers are fp32, so the
    residual stream, every norm (input, statistics; RMSNorm's rsqrt and x * rsqrt) and rotary's
    q and k (16-bit q, k times fp32 cos / sin) are fp32, while the Linear inputs are 16-bit
    casts, one per Linear (autocast caches casts of parameters only). Under mixed the model is
    16-bit throughout, as in bf16, except the cross entropy's fp32 log-probabilities and total
    weight.

    What each line is (N = bS tokens, a activation bytes, H heads, S sequence):
      norm input, mean and rstd (LayerNorm; 4-byte stats for fp32, `a` bytes for bf16 on CPU,
      fp32 on CUDA); RMSNorm written out saves x, rsqrt (N) and x*rsqrt;
      the q/k/v projections' shared input; manual attention: contiguous copies of q, k^T and v
      made by matmul (N*Dq each), the bool S x S causal mask masked_fill saves, the softmax
      output (bHS^2), with dropout its 1-byte mask and the dropped probabilities; SDPA (CPU flash
      kernel) without dropout: q, k, v storages, the output (shared with c_proj's input) and an
      fp32 logsumexp of bHS; SDPA with dropout (CPU falls back to the math path): copies of q,
      k^T, v, the softmax output, a float dropout mask, the dropped probabilities, all fp32
      (the math path upcasts 16-bit inputs on CPU);
      c_proj's input; the 1-byte masks of the residual dropouts; the MLP up projection's input,
      ReLU's output or GELU's input and output or SwiGLU's gate, SiLU output, up output and
      product; the lm_head input; the log-probabilities of the cross entropy (V per token).
    recompute full: each block's input only (torch.utils.checkpoint); selective: the attention
    core (scores, softmax, dropout) is recomputed and only its q, k, v inputs are kept.
    """
    b, S = workload.batch_size // setup.dp, workload.seq_len
    N, a = b * S, setup.act_bytes
    E, H, V, L = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    Dq, Dff = cfg.q_width, cfg.ffn_dim
    amp = setup.mode == "amp"
    # r: the residual stream's bytes, the weights' dtype: fp32 weights and embeddings keep it
    # fp32 under amp (a 16-bit branch output added to it promotes to fp32)
    r = 4 if setup.mode in ("fp32", "amp") else a
    stats = 4 if (r == 4 or setup.device == "cuda") else a
    # under amp every Linear reading the fp32 stream casts its own 16-bit copy of the input
    # (autocast caches casts of parameters only): separate q/k/v projections make 3 copies,
    # per-head ones 3H, SwiGLU's gate and up projections 2
    qkv_linears = {"fused": 1, "separate": 3, "per_head": 3 * H}[cfg.qkv_layout] if amp else 1
    up_linears = 2 if amp and cfg.mlp == "swiglu" else 1
    drop = cfg.dropout > 0
    att = b * H * S * S  # elements of one score matrix stack
    out: dict[str, int] = {
        "embedding/positions": 8 * S if cfg.pos_embedding == "learned" else 0,  # int64 arange
        "embedding/dropout_mask": N * E if drop and cfg.embd_dropout else 0,
    }
    layer: dict[str, int] = {}
    if setup.recompute == "full":
        layer["block_input"] = N * E * r
    else:
        layer.update({f"ln_1/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
        layer["attn/qkv_input"] = qkv_linears * N * E * a
        sdpa_flash = setup.attn_impl == "sdpa" and not drop
        if setup.recompute == "selective":
            layer["attn/core_inputs"] = _qkv_storages(cfg, N, a, r)
        elif sdpa_flash:
            layer["attn/qkv"] = _qkv_storages(cfg, N, a)
            layer["attn/logsumexp"] = b * H * S * 4
            # the kernel lays its output out like q. Partial rotary (rotary_dims < head_dim)
            # builds q with a cat in (b, H, S, hd) order, so the output is not already in
            # (b, S, H, hd) order and y.transpose(1, 2).contiguous() copies it for c_proj: the
            # output kept for backward is then a storage of its own.
            partial = 0 < cfg.rotary_dims < cfg.head_size
            layer["attn/sdpa_out"] = N * Dq * a if partial and H > 1 and S > 1 else 0
        else:
            # SDPA's CPU math path (taken with dropout) computes 16-bit inputs in fp32
            m = a if setup.attn_impl == "manual" else 4
            layer.update(_matmul_operands(cfg, b, N, a, m, math_path=setup.attn_impl == "sdpa"))
            if setup.attn_impl == "manual":
                layer["attn/causal_mask"] = S * S  # bool tril == 0, one per layer
            layer["attn/softmax"] = att * m
            if drop:
                # native_dropout's bool mask; SDPA's math path multiplies by a float mask
                layer["attn/dropout_mask"] = att * (1 if setup.attn_impl == "manual" else m)
                layer["attn/dropped"] = att * m
        layer["attn/out_input"] = N * Dq * a  # c_proj's input (SDPA flash: its output)
        layer["attn/dropout_mask"] = layer.get("attn/dropout_mask", 0)
        layer["attn/resid_dropout_mask"] = N * E if drop else 0
        ln_2 = _norm_lines(cfg, N, r, stats)
        if cfg.parallel_residual:
            # GPT-NeoX: ln_2 reads the block input, the very tensor ln_1 saved already
            ln_2["input"] = 0
        layer.update({f"ln_2/{k}": v for k, v in ln_2.items()})
        layer["mlp/fc_input"] = up_linears * N * E * a
        hidden = {"relu": 1, "gelu": 2, "gelu_tanh": 2, "swiglu": 4}[cfg.mlp]
        layer["mlp/hidden"] = hidden * N * Dff * a  # incl. c_proj's input
        layer["mlp/dropout_mask"] = N * E if drop else 0
    out.update({f"layer/{k}": L * v for k, v in layer.items()})
    if cfg.final_norm:
        out.update({f"final/ln_f/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
    out["final/lm_head_input"] = N * E * a
    # cross entropy autocasts to fp32: its log-probabilities and total weight are fp32
    autocast = setup.mode in ("amp", "mixed")
    out["cross_entropy/log_probs"] = N * V * (4 if autocast else a)
    out["cross_entropy/total_weight"] = 4 if autocast or setup.mode == "fp32" else a
    out["input/idx"] = 8 * N
    out["input/targets"] = 8 * N
    out.update(autocast_weight_copies(cfg, setup))
    return out


def autocast_weight_copies(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """16-bit copies of fp32 weights that torch.autocast makes and autograd saves (mode amp).

    Under autocast a Linear casts its fp32 weight to the autocast dtype (2 bytes per element;
    autocast caches one copy per parameter per autocast region) and the matmul saves that copy
    for the input's gradient. Biases are cast too but not saved; embeddings and norms are not
    autocast. Every weight matrix is saved once: q/k/v, the attention output, the MLP matrices
    and the lm_head (its tied or own V x E weight). Measured on CPU (reference_model/memory.py
    finds them as `_to_copy` outputs of parameter storages). With full recomputation the blocks'
    copies are made inside the checkpoint and not kept; only the lm_head's is saved. Modes fp32
    and bf16 run no autocast; mixed runs it on 16-bit weights, which are not copied: 0.
    Tensor parallel shards each matrix (lm_head vocabulary-parallel, ceil(V/tp) rows).
    """
    if setup.mode != "amp":
        return {}
    t, E, Dff, Dq = setup.tp, cfg.n_embd, cfg.ffn_dim, cfg.q_width
    w, L = 2, 0 if setup.recompute == "full" else cfg.n_layer
    out = {
        "weight_copy/attention/qkv": w * L * E * (Dq + 2 * cfg.kv_width) // t,
        "weight_copy/attention/out": w * L * Dq * E // t,
        "weight_copy/mlp/fc": w * L * E * Dff // t,
        "weight_copy/mlp/gate": w * L * E * Dff // t if cfg.mlp == "swiglu" else 0,
        "weight_copy/mlp/proj": w * L * Dff * E // t,
        "weight_copy/lm_head": w * _ceil(cfg.vocab_size, t) * E,
    }
    return out


# ---------------------------------------------------------------------------------------------
# Buffers, the step peak, the summary
# ---------------------------------------------------------------------------------------------


def buffer_bytes(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Non-parameter buffers of the reference model: each block's T x T `tril` mask, rotary
    cos/sin tables (T x rotary_dims each, per block), the sinusoidal table (T x E), in the weights'
    dtype (the model is cast as a whole)."""
    T, L = cfg.block_size, cfg.n_layer // setup.pp
    w = 2 if setup.mode in ("mixed", "bf16") else 4
    # GPT-NeoX's partial rotary keeps tables only for the rotated rotary_dims of each head
    per_block = T * T + (2 * T * cfg.rotary_dims if cfg.pos_embedding == "rotary" else 0)
    return w * (L * per_block + (T * cfg.n_embd if cfg.pos_embedding == "sinusoidal" else 0))


def largest_param_tensor(cfg: GPTConfig) -> int:
    """Elements of the reference model's largest parameter tensor (sizes the CPU AdamW temps)."""
    E, V, Dff, hd = cfg.n_embd, cfg.vocab_size, cfg.ffn_dim, cfg.head_size
    qkv = {"fused": E * (cfg.q_width + 2 * cfg.kv_width), "separate": E * cfg.q_width,
           "per_head": E * hd}[cfg.qkv_layout]
    return max(V * E, qkv, cfg.q_width * E, E * Dff,
               cfg.block_size * E if cfg.pos_embedding == "learned" else 0)


def param_sizes(cfg: GPTConfig) -> list[int]:
    """Elements of each parameter tensor of the reference model, in `model.parameters()` order
    (wte, wpe, per block ln_1, attention, ln_2, MLP, then ln_f and lm_head; a tied head weight
    is wte's tensor and is listed once)."""
    E, V, T, hd, Dff = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.head_size, cfg.ffn_dim
    Dq, Dkv = cfg.q_width, cfg.kv_width

    def linear(i: int, o: int, bias: bool) -> list[int]:
        return [i * o] + ([o] if bias else [])

    norm = [E] * _norm_tensors(cfg)
    out = [V * E] + ([T * E] if cfg.pos_embedding == "learned" else [])
    qkv = {"fused": linear(E, Dq + 2 * Dkv, cfg.qkv_bias),
           "separate": linear(E, Dq, cfg.qkv_bias) + 2 * linear(E, Dkv, cfg.qkv_bias),
           "per_head": cfg.n_head * linear(E, hd, cfg.qkv_bias) + cfg.kv_heads * 2
           * linear(E, hd, cfg.qkv_bias)}[cfg.qkv_layout]
    mlp = linear(E, Dff, cfg.mlp_bias) * (2 if cfg.mlp == "swiglu" else 1) + linear(
        Dff, E, cfg.mlp_bias)
    block = norm + qkv + linear(Dq, E, cfg.attn_out_bias) + norm + mlp
    out += cfg.n_layer * block + (norm if cfg.final_norm else [])
    out += ([] if cfg.tie_embeddings else [V * E]) + ([V] if cfg.lm_head_bias else [])
    return out


def adamw_cpu_temps(cfg: GPTConfig) -> int:
    """Elements of the CPU single-tensor AdamW's temporaries at their largest.

    torch.optim.adamw's `_single_tensor_adamw` computes `denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)` per parameter: two tensors of the parameter's size, while
    `denom` of the previous parameter is still bound (Python rebinds it only after the new one
    exists). Peak: max over consecutive parameters of 2 * size_i + size_(i-1).
    """
    sizes = param_sizes(cfg)
    return max(2 * n + (sizes[i - 1] if i else 0) for i, n in enumerate(sizes))


class _Walk:
    """Live bytes through backward, as named lines; remembers the lines at the largest total.

    `alloc` is checked after each allocation (a dispatch-mode tracker measures after every op),
    `free` lowers the total without a check (autograd frees a node's inputs and saved tensors
    after the node returns)."""

    def __init__(self, lines: dict[str, int]) -> None:
        self.lines = dict(lines)
        self.total = sum(lines.values())
        self.peak, self.at, self.peak_lines = self.total, "backward start", dict(lines)
        self.log: list[tuple[str, int]] = [("backward start", self.total)]  # after each alloc
        # every moment's lines, for re-weighting by `parallel_shares`
        self.moments: list[tuple[str, dict[str, int]]] = [("backward start", dict(lines))]

    def alloc(self, where: str, **nbytes: int) -> None:
        for k, v in nbytes.items():
            self.lines[k] = self.lines.get(k, 0) + v
            self.total += v
            if self.total > self.peak:
                self.peak, self.at, self.peak_lines = self.total, where, dict(self.lines)
            self.moments.append((where, dict(self.lines)))
        self.log.append((where, self.total))

    def free(self, **nbytes: int) -> None:
        for k, v in nbytes.items():
            self.lines[k] -= v
            self.total -= v

    def peak_with(self, shares: dict[str, Fraction]) -> tuple[int, str, dict[str, int]]:
        """The largest total once each category is weighted by its per-device share."""
        best = (-1, "", {})
        for where, lines in self.moments:
            scaled = {k: int(v * shares.get(k, 1)) for k, v in lines.items()}
            if sum(scaled.values()) > best[0]:
                best = (sum(scaled.values()), where, scaled)
        return best


def parallel_shares(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                    ) -> dict[str, Fraction]:
    """Shares of the single-device backward walk that one device holds under parallelism.

    The reference model runs on one device, so a parallel step is not measured: this scales the
    walk. Gradients: the device's shard of the parameter gradients (`state_bytes`: tp and pp
    split the matrices and layers, ZeRO 2 and 3 keep 1/dp; gradients reduce-scattered as
    they are produced). Activations, gradients flowing through them and logits: Korthikanti et
    al.'s tp/sp division (the ratio of `activations_paper` with and without tp/sp; pp keeps L
    layers' worth in flight on the first stage either way). dp needs nothing more: the walk
    already runs on the micro-batch B/dp. Empty when nothing is parallel.
    """
    if (setup.tp, setup.pp, setup.dp, setup.zero, setup.sp) == (1, 1, 1, 0, False):
        return {}
    alone = dataclasses.replace(setup, tp=1, pp=1, dp=1, zero=0, sp=False)
    grads = Fraction(state_bytes(cfg, setup, "first").gradients,
                     max(1, state_bytes(cfg, alone, "first").gradients))
    one_device = dataclasses.replace(setup, tp=1, sp=False)
    acts = Fraction(sum(activations_paper(cfg, workload, setup).values()),
                    max(1, sum(activations_paper(cfg, workload, one_device).values())))
    return {"gradients": grads, "saved": acts, "grad_flow": acts, "logits": acts}


# a plain block's saved lines that selective recomputation makes again (the attention core)
_CORE_LINES = ("attn/q", "attn/k_t", "attn/v", "attn/causal_mask", "attn/softmax",
               "attn/dropout_mask", "attn/dropped", "attn/logsumexp")


def _recompute_block(w: _Walk, cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                     where: str, recomputed: int) -> None:
    """A checkpointed block's forward, run again inside backward: `recomputed` bytes of saved
    tensors (a plain block's, less its input) come back. Early stop ends the recomputation at
    the last tensor saved: the MLP's dropout mask (its input and output then still alive) or,
    without dropout, the down projection's input (saved before the matmul runs). A parallel
    block also holds the attention branch's sum with the input there."""
    b, S = workload.batch_size // setup.dp, workload.seq_len
    N, a, E = b * S, setup.act_bytes, cfg.n_embd
    r = 4 if setup.mode in ("fp32", "amp") else a
    extra = (2 * N * E * a if cfg.dropout > 0 else 0) + (N * E * r if cfg.parallel_residual
                                                         else 0)
    w.alloc(f"{where} recompute", saved=recomputed, recompute=extra)
    w.free(recompute=extra)


def sdpa_math_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """Bytes SDPA's CPU math path (taken with dropout) holds beside what it saves, at its last
    saving op (att @ v's operands; checkpoint's early stop ends a recomputation there, before
    the matmul runs). The path upcasts 16-bit q, k, v to fp32, scales q and k (keeping their
    strides), and matmul folds (b, H) into one batch dimension: a view when b, H or S is 1 or
    the operand is contiguous (rotary's q and k, grouped-query's repeated k and v), else a
    contiguous copy, which matmul saves in place of the operand. Alive at the end beside the
    saved tensors: the float causal mask (S^2 fp32); the scaled k when it was copied (fp32,
    N Dq; the scaled q is dropped before); each 16-bit upcast that matmul did not save (q's and
    k's always, v's when copied), and a 16-bit copy of the dropped probabilities (b H S^2);
    under amp with rotary, autocast's 16-bit casts of the fp32 q and k (N Dq each). Measured
    with a per-op MemTracker trace of the math path (torch 2.13 CPU)."""
    b, S = workload.batch_size // setup.dp, workload.seq_len
    N, a, Dq = b * S, setup.act_bytes, cfg.q_width
    folds = b == 1 or cfg.n_head == 1 or S == 1
    rotary, gqa = cfg.pos_embedding == "rotary", cfg.kv_heads != cfg.n_head
    k_view, v_view = folds or (rotary and gqa), folds or gqa
    out = S * S * 4 + (0 if k_view else N * Dq * 4)
    if a != 4:
        out += (2 + (not v_view)) * N * Dq * 4 + b * cfg.n_head * S * S * a
        if setup.mode == "amp" and rotary:
            # rotary's q and k are fp32 (the fp32 tables promote them): autocast casts them to
            # 16 bit for SDPA first, and the math path upcasts those casts again
            out += 2 * N * Dq * a
    return out


def backward_walk(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> _Walk:
    """The live bytes of one backward pass of the reference model on CPU, node by node.

    Start: weights, optimizer states and buffers, every saved activation (less the batch's idx,
    which no op returns), the logits the caller holds, the loss and its seed gradient. Each
    autograd node then allocates its outputs (gradients of its inputs, parameter gradients that
    AccumulateGrad keeps) and, after it returns, frees its incoming gradient and the saved tensors
    no later node needs. Modelled node by node: the cross entropy, lm_head, final norm, the MLP,
    the residual sum, the attention output projection and core (manual; SDPA's CPU math path with
    dropout; SDPA flash's single backward kernel), the embeddings. The q/k/v input path (views,
    rotary, per-head projections) is taken as one step to the block's exact end level (its
    saved tensors freed, its parameter gradients allocated): it allocates less than the core
    before it. Blocks repeat with the live level moving by (parameter gradients - saved
    activations) of one block. Recomputation: full recomputes each block's saved tensors at its
    start (`_recompute_block`), selective the attention core's at the core (SDPA's math path
    with its forward's transients, `sdpa_math_transients`); then the plain block's walk runs.
    The forward's end is `forward_end`, from this walk's start.
    """
    b, S = workload.batch_size // setup.dp, workload.seq_len
    N, a, g = b * S, setup.act_bytes, setup.grad_bytes
    E, V, H, L = cfg.n_embd, cfg.vocab_size, cfg.n_head, cfg.n_layer
    Dq, Dkv, Dff, T = cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.block_size
    drop = cfg.dropout > 0
    acts = saved_activations(cfg, workload, setup)
    first = state_bytes(cfg, setup, "first")
    rec = setup.recompute
    # what a block saves without recomputation: torch.utils.checkpoint's recomputation makes
    # exactly these tensors again inside backward (full: the whole block, whose input the
    # checkpoint already keeps; selective: the attention core)
    plain = dataclasses.replace(setup, recompute="none")
    acts_plain = acts if rec == "none" else saved_activations(cfg, workload, plain)
    plain_layer = {k[len("layer/"):]: v // L for k, v in acts_plain.items()
                   if k.startswith("layer/")}
    layer_saved = sum(v for k, v in acts.items() if k.startswith("layer/")) // L
    if rec == "full":
        layer_saved = sum(plain_layer.values())
    sizes = param_sizes(cfg)
    n_emb = _embedding_tensors(cfg)
    n_layer_t = _layer_tensors(cfg)
    layer_grads = g * sum(sizes[n_emb:n_emb + n_layer_t])
    lp = acts["cross_entropy/log_probs"] // (N * V)
    stats = acts.get("final/ln_f/mean", acts.get("layer/ln_1/mean", 0) // L) // N if (
        cfg.norm != "rmsnorm") else 0
    # amp: fp32 weights under autocast. The residual stream, norms and embeddings are fp32 (r
    # bytes); each Linear gets a 16-bit copy of its weight (saved, freed with the Linear's node)
    # and of its input when that is fp32; its backward makes 16-bit gradients, which the casts'
    # backward (ToCopyBackward) turns into fp32: the input's gradient, then the weight's and
    # the bias's (AccumulateGrad keeps those), each freeing its 16-bit source.
    amp = setup.mode == "amp"
    r = 4 if setup.mode in ("fp32", "amp") else a
    # full recomputation remakes each block's weight copies with the block
    copies = autocast_weight_copies(cfg, plain if rec == "full" else setup)
    layer_saved += sum(v for k, v in copies.items() if not k.endswith("lm_head")) // L
    lossb = lp  # the loss is the cross entropy's dtype (fp32 under autocast)

    def lin_grads(n: int) -> dict[str, int]:
        """A Linear's weight and bias gradients as its backward makes them."""
        return {"grad_flow": a * n} if amp else {"gradients": g * n}

    def lin_casts(where: str, *ns: int) -> None:
        """amp: the 16-bit weight / bias gradients cast to fp32 and accumulated, in turn."""
        if amp:
            for n in ns:
                if n:
                    w.alloc(where, gradients=g * n)
                    w.free(grad_flow=a * n)

    def lin(where: str, in_grad: int, n: int) -> None:
        """A Linear's backward: its input's gradient (bytes), weight and bias gradients (n)."""
        if amp:
            w.alloc(where, grad_flow=in_grad + a * n)
        else:
            w.alloc(where, grad_flow=in_grad, gradients=g * n)

    def cp(name: str) -> int:
        """amp: one block's 16-bit copy of a weight, saved by its Linear."""
        return copies.get(f"weight_copy/{name}", 0) // L

    def input_cast(where: str, n: int) -> None:
        """amp: a Linear's input gradient (n elements) cast back to the fp32 stream's dtype."""
        if r != a:
            w.alloc(where, grad_flow=n * r)
            w.free(grad_flow=n * a)

    w = _Walk({"weights": first.weights, "optimizer": first.optimizer,
               "buffers": buffer_bytes(cfg, setup),
               "saved": sum(v for k, v in acts.items() if k != "input/idx"),
               "logits": N * V * a, "loss": 2 * lossb, "gradients": 0, "grad_flow": 0})
    w.free(loss=lossb)  # the seed gradient, moved into the engine and dropped
    w.alloc("cross entropy", grad_flow=N * V * lp)
    w.alloc("cross entropy", grad_flow=N * V * lp)
    w.free(grad_flow=N * V * lp, saved=N * V * lp)  # total_weight stays with the graph
    if lp != a:  # autocast ran the cross entropy on an fp32 copy of the logits
        w.alloc("cross entropy", grad_flow=N * V * a)
        w.free(grad_flow=N * V * lp)
    head_w, head_b = V * E, (V if cfg.lm_head_bias else 0)
    w.alloc("lm_head", **lin_grads(head_w + head_b))
    w.alloc("lm_head", grad_flow=N * E * a)
    w.free(grad_flow=N * V * a, saved=N * E * a + copies.get("weight_copy/lm_head", 0))
    input_cast("lm_head", N * E)
    lin_casts("lm_head", head_w, head_b)

    par = cfg.parallel_residual

    def norm(where: str, residual: bool, shared: bool = False) -> None:
        """Backward of a norm whose incoming gradient (N*E) is in grad_flow; leaves its input's
        gradient there, summed with the residual stream's gradient when `residual`. `shared`:
        GPT-NeoX's parallel ln_2, whose input is ln_1's (saved once, freed there) and whose
        residual gradient is also the attention branch's incoming one (kept alive for it)."""
        keep = N * E * r if shared else 0
        if cfg.norm == "rmsnorm":
            ne = N * E * r
            # x * rsqrt(mean(x^2) + eps) * w, written out: grad * w and grad * x_hat (summed to
            # the weight's gradient); then grad_x_hat * r, grad_x_hat * x and its row sum
            w.alloc(where, grad_flow=2 * ne)
            w.alloc(where, gradients=g * E)
            w.free(grad_flow=2 * ne, saved=ne)  # grad * x_hat, the incoming gradient; x * r
            w.alloc(where, grad_flow=2 * ne)
            w.alloc(where, grad_flow=N * r)
            w.free(grad_flow=2 * ne)
            if residual:
                w.alloc(where, grad_flow=ne)
                w.free(grad_flow=2 * ne - keep)
            w.alloc(where, grad_flow=3 * N * r)  # rsqrt and mean backward, per row
            w.free(grad_flow=3 * N * r, saved=N * r)  # ... and rsqrt's saved result
            w.alloc(where, grad_flow=ne)  # mean's expand / E
            w.free(grad_flow=N * r)
            w.alloc(where, grad_flow=3 * ne)  # pow's backward: x^1, * 2, * grad
            # the node returns: its two temporaries, its incoming gradient and its saved x go;
            # then its result is summed into x's gradient (out of place) and both summands go
            w.free(grad_flow=3 * ne, saved=ne - keep)
            w.alloc(where, grad_flow=ne)
            w.free(grad_flow=2 * ne)
            return
        w.alloc(where, grad_flow=N * E * r, gradients=g * E * _norm_tensors(cfg))
        w.free(grad_flow=N * E * r, saved=N * E * r - keep + 2 * N * stats)
        if residual:
            w.alloc(where, grad_flow=N * E * r)
            w.free(grad_flow=2 * N * E * r - keep)

    if cfg.final_norm:
        norm("final norm", False)

    def input_sum(where: str) -> None:
        """Two gradients of one tensor summed out of place, then both freed."""
        w.alloc(where, grad_flow=N * E * r)
        w.free(grad_flow=2 * N * E * r)

    head_grads = w.lines["gradients"]

    for layer in range(L):
        where = "last block" if layer == 0 else ("first block" if layer == L - 1 else "block")
        # --- full recomputation: the block's first saving node in backward (the MLP's dropout
        # or down projection) unpacks a checkpointed tensor, and the whole block's forward runs
        # again (non-reentrant checkpoint, early stop: up to the last tensor it saves), leaving
        # every tensor a plain block saves alive beside the input the checkpoint kept
        if rec == "full":
            _recompute_block(w, cfg, workload, setup, where, layer_saved - N * E * r)
        start = w.total
        # --- MLP: g (N*E) is in grad_flow and stays there (the residual branch holds it)
        # amp: the fp32 stream's gradient is cast to the 16-bit branch (ToCopyBackward of the
        # branch output's promotion), which the branch's first node then owns
        cast = r != a
        if cast:
            w.alloc(f"{where} mlp output cast", grad_flow=N * E * a)
        if drop:
            w.alloc(f"{where} mlp dropout", grad_flow=N * E * a)
            w.free(saved=N * E, grad_flow=N * E * a if cast else 0)
        hid = N * Dff * a
        nb_e, nb_f = (E, Dff) if cfg.mlp_bias else (0, 0)
        lin(f"{where} mlp proj", hid, Dff * E + nb_e)
        w.free(grad_flow=N * E * a if (drop or cast) else 0,
               saved=(0 if cfg.mlp == "relu" else hid) + cp("mlp/proj"))
        lin_casts(f"{where} mlp proj", Dff * E, nb_e)
        if cfg.mlp == "swiglu":
            w.alloc(f"{where} mlp swiglu", grad_flow=2 * hid)
            w.free(grad_flow=hid, saved=2 * hid)  # up output, silu output
            lin(f"{where} mlp up", N * E * a, E * Dff + nb_f)
            # amp: up and gate read their own 16-bit copies of ln_2's output
            w.free(grad_flow=hid, saved=(N * E * a if amp else 0) + cp("mlp/fc"))
            input_cast(f"{where} mlp up", N * E)
            lin_casts(f"{where} mlp up", E * Dff, nb_f)
            w.alloc(f"{where} mlp silu", grad_flow=hid)
            w.free(grad_flow=hid, saved=hid)  # the gate's output
            lin(f"{where} mlp gate", N * E * a, E * Dff + nb_f)
            w.free(grad_flow=hid, saved=N * E * a + cp("mlp/gate"))
            input_cast(f"{where} mlp gate", N * E)
            lin_casts(f"{where} mlp gate", E * Dff, nb_f)
            input_sum(f"{where} mlp input sum")
        else:
            w.alloc(f"{where} mlp activation", grad_flow=hid)
            w.free(grad_flow=hid, saved=hid * (2 if cfg.mlp in ("gelu", "gelu_tanh") else 1)
                   - (hid if cfg.mlp != "relu" else 0))
            lin(f"{where} mlp fc", N * E * a, E * Dff + nb_f)
            w.free(grad_flow=hid, saved=N * E * a + cp("mlp/fc"))
            input_cast(f"{where} mlp fc", N * E)
            lin_casts(f"{where} mlp fc", E * Dff, nb_f)
        norm(f"{where} ln_2", True, shared=par)
        # --- attention; in a parallel block the stream's gradient is freed by the branch's
        # first node (the attention branch holds it last)
        if cast:
            w.alloc(f"{where} attn output cast", grad_flow=N * E * a)
            w.free(grad_flow=N * E * r if par else 0)
        owned = cast or par
        if drop:
            w.alloc(f"{where} attn dropout", grad_flow=N * E * a)
            w.free(saved=N * E, grad_flow=N * E * a if owned else 0)
        ob = E if cfg.attn_out_bias else 0
        lin(f"{where} attn proj", N * Dq * a, Dq * E + ob)
        att = b * H * S * S
        flash = setup.attn_impl == "sdpa" and not drop
        # SDPA's fused kernel saves its own output for backward: c_proj's input is that very
        # tensor (unless partial rotary made c_proj's input a copy), freed only after the core;
        # selective recomputation makes the kernel's output anew, c_proj keeps the first
        out_shared = flash and not acts_plain["layer/attn/sdpa_out"] and rec != "selective"
        # the dropout's gradient; in a parallel block also the block output's gradient, which
        # the attention branch was the last to hold
        w.free(grad_flow=N * E * a if (drop or owned) else 0,
               saved=(0 if out_shared else N * Dq * a) + cp("attention/out"))
        lin_casts(f"{where} attn proj", Dq * E, ob)
        core_saved = sum(v for k, v in plain_layer.items() if k in _CORE_LINES)
        if rec == "selective" and setup.attn_impl == "sdpa" and not flash:
            # ... beside the fp32 gradient of the core's output: the math path returns fp32
            # and casts it to 16 bit, whose backward (ToCopyBackward) upcasts the incoming
            # gradient before the recomputation, in place of the 16-bit contiguous copy
            math_core_transients = sdpa_math_transients(cfg, workload, setup) + (
                N * Dq * (4 - a))
        if not flash:
            m = a if setup.attn_impl == "manual" else 4
            w.alloc(f"{where} attn core", grad_flow=N * Dq * a)  # contiguous grad for the view
            w.free(grad_flow=N * Dq * a)
            if rec == "selective":  # att @ v's backward unpacks: the core runs again
                w.alloc(f"{where} attn core recompute", saved=core_saved,
                        recompute=math_core_transients if setup.attn_impl == "sdpa" else 0)
                w.free(recompute=math_core_transients if setup.attn_impl == "sdpa" else 0)
            w.alloc(f"{where} attn core", grad_flow=att * m + N * Dq * m)  # att @ v
            w.free(grad_flow=N * Dq * a, saved=N * Dq * m + (att * m if drop else 0))
            if drop:
                w.alloc(f"{where} attn core", grad_flow=att * m)
                w.free(grad_flow=att * m, saved=att * (1 if setup.attn_impl == "manual" else m))
            w.alloc(f"{where} attn core", grad_flow=att * m)  # softmax
            w.free(grad_flow=att * m, saved=att * m)
            if setup.attn_impl == "manual":
                w.alloc(f"{where} attn core", grad_flow=att * m)  # masked_fill
                w.free(grad_flow=att * m)
                w.alloc(f"{where} attn core", grad_flow=att * m)  # scale
                w.free(grad_flow=att * m, saved=S * S)
            w.alloc(f"{where} attn core", grad_flow=2 * N * Dq * m)  # q @ k^T
        else:
            if rec == "selective":  # the kernel's output and logsumexp, made again
                w.alloc(f"{where} attn core recompute", saved=core_saved + N * Dq * a)
            w.alloc(f"{where} attn core", grad_flow=3 * N * Dq * a)
        # the q/k/v input path (views, rotary, grouped-query sums, the projections' backward and
        # the sum of their input gradients) is taken as one step, to the exact level before
        # ln_1's backward: every block parameter gradient but ln_1's allocated, ln_1's saved
        # tensors alive, its output's gradient and the residual stream's gradient in flight
        ln_1_grads = g * E * _norm_tensors(cfg)
        ln_1_saved = sum(_norm_lines(cfg, N, r, stats).values())
        end = start - layer_saved + layer_grads
        w.lines.update(gradients=head_grads + (layer + 1) * layer_grads - ln_1_grads,
                       grad_flow=2 * N * E * r)
        w.lines["saved"] = (end + ln_1_saved + N * E * r - ln_1_grads
                            - sum(v for k, v in w.lines.items() if k != "saved"))
        w.total = sum(w.lines.values())
        w.log.append((f"{where} q/k/v input path (one step)", w.total))
        w.moments.append((f"{where} q/k/v input path (one step)", dict(w.lines)))
        norm(f"{where} ln_1", True)
        assert w.total == end, (w.total, end)
    # --- embeddings: the stream's gradient goes to wpe's node first (created later), then wte's
    if drop and cfg.embd_dropout:
        w.alloc("embedding dropout", grad_flow=N * E * r)
        w.free(grad_flow=N * E * r, saved=N * E)
    if cfg.pos_embedding == "learned":
        w.alloc("position embedding", grad_flow=S * E * r)  # summed over the batch
        w.alloc("position embedding", gradients=g * T * E)
        w.free(grad_flow=S * E * r, saved=8 * S)
    w.alloc("token embedding", gradients=g * V * E)
    w.free(grad_flow=N * E * r)
    if cfg.tie_embeddings:  # AccumulateGrad adds out of place into lm_head's gradient
        w.alloc("token embedding", gradients=g * V * E)
        w.free(gradients=2 * g * V * E)
    return w


@dataclass(frozen=True)
class StepPeak:
    """The peak of one steady-state training step (after the first, whose states exist)."""

    bytes: int
    phase: str  # "backward" or "optimizer"
    why: str
    phases: dict[str, int]
    lines: dict[str, int] = field(default_factory=dict)  # what is alive at the peak


def step_peak_tolerance(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """Bytes by which `step_peak` may miss MemTracker's CPU peak: what the walk does not model.

    The only step `backward_walk` takes in one piece is each block's q/k/v projection path
    (transposes and their contiguous copies, rotary's backward, grouped-query sums, the
    projections' backward, per-head Linears for `per_head`, and the running sum of their input
    gradients), between levels it knows exactly. What that path can hold above them is in-flight
    gradients: the q, k and v gradients or their copies, N(Dq + 2Dkv), and two N x E input
    gradients of the running sum (a term and the sum being formed), in the activation dtype.
    Where a block's other nodes are larger (any B, S, H of practical size) the walk is exact and
    this bound is never used up; it is at least 1% of the prediction (issue 4's CPU target).
    Under amp the two input gradients are fp32 (the stream's dtype) and one projection's
    16-bit input gradient awaits its cast. With recomputation, the recomputed forward's
    transients that the walk does not place one by one are allowed for: one score stack
    (b H S^2, fp32 on SDPA's math path), one residual-stream tensor and, under amp, the
    recomputation's 16-bit casts of its input, q, k and v.
    Under amp the path also holds the largest q/k/v Linear's 16-bit weight and bias gradients
    beside their fp32 casts. Measured (walk4 sweep, 1,000 draws of tests/_strategies.py x
    fp32/bf16/amp/mixed x manual/SDPA x AdamW/SGD/SGD-momentum x recompute none/selective/full,
    fixed seed): worst |error| / this bound = 0.84, none over it (the amp weight-gradient term
    added for one draw at 1.34 before; dropping the recompute's score stack would leave 0.94).
    """
    b, S = workload.batch_size // setup.dp, workload.seq_len
    r = 4 if setup.mode in ("fp32", "amp") else setup.act_bytes  # the residual stream's bytes
    path = b * S * (setup.act_bytes * (cfg.q_width + 2 * cfg.kv_width) + r * 2 * cfg.n_embd)
    if setup.mode == "amp":
        # a projection's 16-bit input gradient before its cast to fp32, and its 16-bit weight
        # and bias gradients beside their fp32 casts (the largest q/k/v Linear's)
        path += setup.act_bytes * b * S * cfg.n_embd
        width = {"fused": cfg.q_width + 2 * cfg.kv_width, "separate": cfg.q_width,
                 "per_head": cfg.head_size}[cfg.qkv_layout]
        path += setup.act_bytes * width * (cfg.n_embd + cfg.qkv_bias)
    if setup.attn_impl == "sdpa" and cfg.dropout > 0:
        # SDPA's CPU math path (taken with dropout) builds fp32 score stacks in the forward;
        # with one block and a tiny vocabulary the forward can hold the step's peak inside a
        # block, and of the forward only its end is placed: allow one fp32 b x H x S x S stack
        path += 4 * b * cfg.n_head * S * S
    if setup.recompute != "none":
        # the recomputed forward's transients that `_recompute_block` does not place one by
        # one: a score stack before the softmax, a residual-stream sum, and (amp) the
        # recomputation's own 16-bit casts of its inputs, q, k and v
        m = 4 if setup.attn_impl == "sdpa" or setup.mode == "fp32" else setup.act_bytes
        path += m * b * cfg.n_head * S * S + r * b * S * cfg.n_embd
        if setup.mode == "amp":
            path += 2 * b * S * (cfg.n_embd + cfg.q_width + 2 * cfg.kv_width)
    return max(path, _ceil(step_peak(cfg, workload, setup).bytes, 100))


def linear_bias_elements(cfg: GPTConfig) -> int:
    """Elements of every Linear bias of the reference model (q/k/v, attention output, MLP,
    lm_head), the tensors autocast casts to 16 bit without any op saving the copy."""
    E, Dq, Dkv, Dff, H = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.n_head
    qkv = (Dq + 2 * Dkv) if cfg.qkv_bias else 0  # per_head: H Linears of head_dim each role
    mlp = (Dff * (2 if cfg.mlp == "swiglu" else 1) + E) if cfg.mlp_bias else 0
    block = qkv + (E if cfg.attn_out_bias else 0) + mlp
    return cfg.n_layer * block + (cfg.vocab_size if cfg.lm_head_bias else 0)


def forward_end(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, walk: _Walk
                ) -> tuple[int, dict[str, int]]:
    """Live bytes at the forward's last op (the loss made, its seed gradient not yet), from the
    backward walk's start: what the forward still holds that backward does not.

    Autocast (amp, mixed) runs the cross entropy on an fp32 copy of the 16-bit logits (N V 4),
    freed when the forward returns. Under amp torch.autocast also keeps, until the autocast
    region exits, its cached 16-bit casts of the fp32 Linear biases (2 bytes each; no op saves
    them: the addmm's backward needs no bias), and GPT.forward's local `x` (the final norm's or
    last block's fp32 output, N E 4) beside its 16-bit cast that lm_head saved. With full
    recomputation the blocks run inside torch.utils.checkpoint, whose casts are not cached."""
    b, S = workload.batch_size // setup.dp, workload.seq_len
    N, lines = b * S, dict(walk.moments[0][1])
    lines["loss"] -= walk.moments[0][1]["loss"] // 2  # the seed gradient is not made yet
    extra = {}
    if setup.mode in ("amp", "mixed"):
        extra["logits"] = N * cfg.vocab_size * 4
    if setup.mode == "amp":
        biases = linear_bias_elements(cfg)
        if setup.recompute == "full":
            biases = cfg.vocab_size if cfg.lm_head_bias else 0
        extra["autocast_cache"] = 2 * biases
        extra["grad_flow"] = N * cfg.n_embd * 4
    for k, v in extra.items():
        lines[k] = lines.get(k, 0) + v
    return sum(lines.values()), lines


def step_peak(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> StepPeak:
    """Peak bytes of one device over zero_grad(set_to_none) -> forward -> backward -> step.

    Three candidates (measured on CPU with MemTracker, which sums live tensor storages after every
    op):
      forward: its last op (`forward_end`): the backward's start less the loss's seed gradient,
        plus what only the forward holds (autocast's fp32 copy of the logits; amp's cached bias
        casts and GPT.forward's fp32 x). Wins with a small vocabulary under autocast.
      backward: `backward_walk`, node by node; the peak is at the cross entropy's gradients
        (large V), in the last block's MLP or attention core (large activations), or near the
        end of backward where the gradients outweigh the activations freed.
      optimizer: inside optimizer.step() the weights, gradients and states are all alive, with
        the targets the caller holds, plus the update's temporaries: on CPU the single-tensor
        AdamW's `adamw_cpu_temps`; on CUDA the foreach path allocates sqrt(v) for every
        parameter at once. SGD updates in place.
    Exact on CPU against MemTracker for the four families x manual / SDPA x dropout on / off x
    fp32 / bf16 x B, S >= 2 (tests/test_memory_measured.py), AdamW, SGD and SGD-momentum (the
    momentum's 120-byte miss was the per-head q/k/v path, not the step). Over every switch of
    tests/_strategies.py (qkv layouts, GQA, head_dim, biases, tying, positions incl. partial
    rotary, parallel residual, norms, MLPs, B, S, H down to 1) x manual / SDPA x fp32 / bf16 x
    AdamW / SGD / SGD-momentum, 800 drawn configurations: 687 exact to the byte, worst error
    -1,692 bytes (-12.6%, a one-block V=5 model whose peak is in SDPA's math-path forward),
    worst -3.3% (-672 bytes) without SDPA + dropout, -4.8% over peaks above 20 kB; always
    under-predicted and within `step_peak_tolerance` (worst 0.73 of it). What is not modelled:
    each block's q/k/v projection path is one step (its in-flight gradients can exceed the levels
    around it when S, H or b is small), and of the forward only its end is placed (SDPA's math
    path, with dropout, can peak inside a block's forward with one block and a tiny vocabulary);
    CUDA and tp / pp / dp remain estimates.
    Autocast modes (CPU): amp walks each Linear's 16-bit gradients cast back to fp32 (input,
    weight, bias) and its 16-bit weight copy freed with its node, on an fp32 residual stream;
    mixed walks like bf16 with the cross entropy in fp32, and its step adds MasterWeights' fp32
    master gradients (4 bytes/param) and fp32 update temporaries. Measured: the four families x
    amp / mixed x manual / SDPA x dropout on / off, 96 of 96 exact; over the hypothesis strategy
    (300 draws each, AdamW / SGD / SGD-momentum, bf16 / fp16) amp 261 exact, worst -444 bytes
    (-3.8%), 2 draws over `step_peak_tolerance` (worst +448 bytes = 1.23 of it, SwiGLU with
    b = 1: the node order of up / gate's casts is not walked exactly); mixed 296 exact, worst
    -556 bytes (-3.0%, SDPA's math-path forward), within the tolerance (0.24 of it). With a
    small V the autocast forward's end (fp32 logits copy, amp's bias casts and fp32 x) tops the
    backward: the forward phase (gpt2 L=3, B=6, S=11, V=32, dropout 0.1, amp: 868,863 bytes,
    exact; was -1,728).
    Recomputation (torch.utils.checkpoint, non-reentrant, as reference_model.memory's
    apply_recompute): full walks each block's forward run again at the block's first saving
    node in backward (`_recompute_block`: a plain block's saved tensors come back beside the
    input the checkpoint kept, early stop ends it at the last tensor saved), then the plain
    block's backward; selective makes the attention core's saved tensors again at att @ v's
    backward (SDPA flash: its output and logsumexp; SDPA's math path, with dropout, also its
    recomputed forward's transients, `sdpa_math_transients`, and the core output's fp32
    gradient). Measured (walk4 sweep: 1,000 draws of tests/_strategies.py x fp32/bf16/amp/mixed
    x manual/SDPA x AdamW/SGD/SGD-momentum x recompute none/selective/full, fixed seed): 863
    exact (86.3%), worst |error| 864 bytes (+1.6%, amp manual selective, over-predicted), worst
    relative -7.3% (-512 bytes, bf16 SDPA full, b = 1), within `step_peak_tolerance` (0.84 of
    it); before the forward phase and the math path's transients: 836 exact, worst -3,784 bytes
    (-10.3%, SDPA+dropout selective amp), one draw over the tolerance (1.34 of it). By
    recompute: none 293/328, selective 266/309 (was 240), full 304/363 exact. Remaining misses:
    the q/k/v path (b, S or H small), full recomputation's inside (amp with tied embeddings
    +64 bytes), amp's manual core under selective recomputation (+208 to +864 bytes).
    Parallel layouts (tp, pp, dp, ZeRO) are not run by the reference model: their peak is the
    single-device walk with each category weighted by `parallel_shares`, an estimate.
    """
    first = state_bytes(cfg, setup, "first")
    walk = backward_walk(cfg, workload, setup)
    backward, at, walk_lines = walk.peak, walk.at, walk.peak_lines
    shares = parallel_shares(cfg, workload, setup)
    if shares:  # an estimate: the single-device walk re-weighted per device (not measured)
        backward, at, walk_lines = walk.peak_with(shares)
    # the update runs on fp32 tensors in fp32 and amp, and in mixed on MasterWeights' fp32
    # masters, whose `.grad` is an fp32 copy of every 16-bit gradient for the whole step
    wb = 4 if setup.mode in ("fp32", "amp", "mixed") else 2
    master_grads = 0
    if setup.mode == "mixed":
        master_grads = 4 * _ceil(first.params, setup.dp if setup.zero >= 2 else 1)
    if setup.optimizer != "adamw":
        temps = 0
    elif setup.device == "cuda":
        temps = _ceil(first.params, setup.dp if setup.zero else 1) * wb
    else:
        temps = adamw_cpu_temps(cfg) * wb
    targets = 8 * (workload.batch_size // setup.dp) * workload.seq_len
    opt_lines = {"weights": first.weights, "optimizer": first.optimizer,
                 "buffers": buffer_bytes(cfg, setup), "gradients": first.gradients,
                 "targets": targets, "optimizer/temporaries": temps,
                 "optimizer/master_gradients": master_grads}
    optimizer = sum(opt_lines.values())
    fwd, fwd_lines = forward_end(cfg, workload, setup, walk)
    if shares:
        fwd_lines = {k: int(v * shares.get(k, 1)) for k, v in fwd_lines.items()}
        fwd = sum(fwd_lines.values())
    phases = {"backward": backward, "optimizer": optimizer, "forward": fwd}
    phase = max(phases, key=phases.get)
    why = (f"backward at the {at}: saved activations, logits and gradients in flight "
           "outweigh the gradients and update temporaries"
           if phase == "backward" else
           "gradients plus the optimizer's temporaries outweigh the activations (small batch)")
    if shares:
        why += ("; parallel layout: an estimate from the single-device walk, gradients, "
                "activations and logits scaled to this device's share (parallel_shares)")
    if phase == "forward":
        why = ("the forward's end: its fp32 copy of the logits and autocast's cached casts "
               "outweigh the backward's gradients in flight (small vocabulary)")
    lines = {"backward": walk_lines, "optimizer": opt_lines, "forward": fwd_lines}[phase]
    return StepPeak(bytes=phases[phase], phase=phase, why=why, phases=phases, lines=lines)


@dataclass(frozen=True)
class MemoryReport:
    """Everything `gptcalc memory` prints; the byte fields are per device, exact integers."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    weight_copies: int  # autocast's 16-bit copies of fp32 weights saved for backward (amp)
    activations_paper: int
    logits: int
    kv_cache: int
    peak: StepPeak
    breakdown: dict[str, dict[str, int]]


def memory_report(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                  context: int | None = None) -> MemoryReport:
    """weights / gradients / optimizer on the most loaded device, activations both ways, logits,
    the KV cache of an inference run at `context` (default seq_len) and the step peak.
    `activations` excludes the batch's own index tensors (`input/...`) and autocast's weight
    copies, which are `weight_copies` (breakdown["weight_copies"], mode amp only)."""
    validate_setup(cfg, workload, setup)
    stages = [state_bytes(cfg, setup, s) for s in ("first", "last")]
    st = max(stages, key=lambda x: x.total)
    acts = saved_activations(cfg, workload, setup)
    paper = activations_paper(cfg, workload, setup)
    lg = logits_bytes(cfg, workload, setup)
    ctx = context or workload.seq_len
    if ctx <= 0:
        raise ConfigError("context", f"context must be positive, got {ctx}")
    kv = kv_cache_bytes(cfg, workload.batch_size // setup.dp, ctx, setup.act_bytes,
                        setup.tp, setup.pp)
    copies = {k: v for k, v in acts.items() if k.startswith("weight_copy/")}
    acts = {k: v for k, v in acts.items() if k not in copies}
    return MemoryReport(
        weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
        activations=sum(v for k, v in acts.items() if not k.startswith("input/")),
        weight_copies=sum(copies.values()),
        activations_paper=sum(paper.values()), logits=sum(lg.values()), kv_cache=kv,
        peak=step_peak(cfg, workload, setup),
        breakdown={"state": st.breakdown, "activations": acts, "weight_copies": copies,
                   "activations_paper": paper, "logits": lg},
    )


def max_batch(cfg: GPTConfig, seq_len: int, setup: TrainingSetup, budget: int,
              limit: int = 1 << 20) -> int:
    """Largest global batch (a multiple of dp) whose step peak fits `budget` bytes; 0 if none."""
    def fits(b: int) -> bool:
        return step_peak(cfg, Workload(b * setup.dp, seq_len), setup).bytes <= budget
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * setup.dp
