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
# variance (4 + 4) = 16 bytes/param, K = 12. bf16: weights, gradients and states all bf16.
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
                       ("d_ff", cfg.hidden_size), ("n_embd", cfg.n_embd)):
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
    Dq, Dkv, Dff = cfg.q_width, cfg.kv_width, cfg.hidden_size
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


def _qkv_storages(cfg: GPTConfig, N: int, a: int) -> int:
    """Bytes of the storages behind the q, k, v handed to the attention core.

    Each is a view of the projection that made it unless something copied it: rotary (a new
    tensor for q and k), grouped-query repeat_interleave (new k and v of H heads). Views of the
    fused c_attn output keep all of it, N(Dq + 2Dkv), alive once.
    """
    Dq, Dkv = cfg.q_width, cfg.kv_width
    gqa, rotary = cfg.kv_heads != cfg.n_head, cfg.pos_embedding == "rotary"
    own = {"q": Dq if rotary else 0, "k": Dq if gqa else (Dkv if rotary else 0),
           "v": Dq if gqa else 0}
    total = sum(own.values())
    views = [r for r in own if not own[r]]
    if cfg.qkv_layout == "fused":
        total += (Dq + 2 * Dkv) if views else 0
    else:  # separate projections (per_head: concatenated per role) are storages of their own
        total += sum(Dq if r == "q" else Dkv for r in views)
    return N * total * a


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

    Exact (measured with saved_tensors_hooks, deduplicated by storage) on CPU for modes fp32 and
    bf16, B >= 2, seq_len >= 2, H >= 2 (with B, S or H equal to 1 some copies made by matmul
    become views of the projection's output). Per micro-batch b = B/dp on one device; with pp,
    the first stage holds pp micro-batches of L/pp layers = L layers' worth (1F1B). Keys:
    `embedding/...`, `layer/...` (summed over L layers), `final/...`, `cross_entropy/...`,
    `input/...` (the batch's own index tensors, saved by the embedding and the loss).

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
    Dq, Dff = cfg.q_width, cfg.hidden_size
    stats = 4 if (setup.mode == "fp32" or setup.device == "cuda") else a
    drop = cfg.dropout > 0
    att = b * H * S * S  # elements of one score matrix stack
    out: dict[str, int] = {
        "embedding/positions": 8 * S if cfg.pos_embedding == "learned" else 0,  # int64 arange
        "embedding/dropout_mask": N * E if drop and cfg.embd_dropout else 0,
    }
    layer: dict[str, int] = {}
    if setup.recompute == "full":
        layer["block_input"] = N * E * a
    else:
        layer.update({f"ln_1/{k}": v for k, v in _norm_lines(cfg, N, a, stats).items()})
        layer["attn/qkv_input"] = N * E * a
        sdpa_flash = setup.attn_impl == "sdpa" and not drop
        if setup.recompute == "selective":
            layer["attn/core_inputs"] = _qkv_storages(cfg, N, a)
        elif sdpa_flash:
            layer["attn/qkv"] = _qkv_storages(cfg, N, a)
            layer["attn/logsumexp"] = b * H * S * 4
        else:
            # SDPA's CPU math path (taken with dropout) computes 16-bit inputs in fp32
            m = a if setup.attn_impl == "manual" else 4
            layer.update({"attn/q": N * Dq * m, "attn/k_t": N * Dq * m, "attn/v": N * Dq * m})
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
        layer.update({f"ln_2/{k}": v for k, v in _norm_lines(cfg, N, a, stats).items()})
        layer["mlp/fc_input"] = N * E * a
        hidden = {"relu": 1, "gelu": 2, "gelu_tanh": 2, "swiglu": 4}[cfg.mlp]
        layer["mlp/hidden"] = hidden * N * Dff * a  # incl. c_proj's input
        layer["mlp/dropout_mask"] = N * E if drop else 0
    out.update({f"layer/{k}": L * v for k, v in layer.items()})
    if cfg.final_norm:
        out.update({f"final/ln_f/{k}": v for k, v in _norm_lines(cfg, N, a, stats).items()})
    out["final/lm_head_input"] = N * E * a
    out["cross_entropy/log_probs"] = N * V * (4 if setup.mode in ("amp", "mixed") else a)
    out["cross_entropy/total_weight"] = 4 if setup.mode in ("fp32", "amp") else a
    out["input/idx"] = 8 * N
    out["input/targets"] = 8 * N
    return out


# ---------------------------------------------------------------------------------------------
# Buffers, the step peak, the summary
# ---------------------------------------------------------------------------------------------


def buffer_bytes(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Non-parameter buffers of the reference model: each block's T x T `tril` mask, rotary
    cos/sin tables (T x head_dim each, per block), the sinusoidal table (T x E), in the weights'
    dtype (the model is cast as a whole)."""
    T, hd, L = cfg.block_size, cfg.head_size, cfg.n_layer // setup.pp
    w = 2 if setup.mode in ("mixed", "bf16") else 4
    per_block = T * T + (2 * T * hd if cfg.pos_embedding == "rotary" else 0)
    return w * (L * per_block + (T * cfg.n_embd if cfg.pos_embedding == "sinusoidal" else 0))


def largest_param_tensor(cfg: GPTConfig) -> int:
    """Elements of the reference model's largest parameter tensor (sizes the CPU AdamW temps)."""
    E, V, Dff, hd = cfg.n_embd, cfg.vocab_size, cfg.hidden_size, cfg.head_size
    qkv = {"fused": E * (cfg.q_width + 2 * cfg.kv_width), "separate": E * cfg.q_width,
           "per_head": E * hd}[cfg.qkv_layout]
    return max(V * E, qkv, cfg.q_width * E, E * Dff,
               cfg.block_size * E if cfg.pos_embedding == "learned" else 0)


@dataclass(frozen=True)
class StepPeak:
    """The peak of one steady-state training step (after the first, whose states exist)."""

    bytes: int
    phase: str  # "backward" or "optimizer"
    why: str
    phases: dict[str, int]


def step_peak(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> StepPeak:
    """Peak bytes of one device over zero_grad(set_to_none) -> forward -> backward -> step.

    Two candidates (DESIGN.md, measured on CPU):
      backward: at the start of backward the weights, buffers and optimizer states are held with
        every saved activation, the logits the caller holds, and the cross entropy's backward
        temporaries (the gradients of the log-probabilities and of the logits, N*V each);
        gradients do not exist yet (set_to_none).
      optimizer: inside optimizer.step() the weights, gradients and states are all alive, plus
        the update's temporaries: on CPU torch.optim.AdamW takes its single-tensor path whose
        `exp_avg_sq.sqrt() / bias_correction` makes two temporaries of the tensor being updated
        (the largest tensor sets the peak); on CUDA the foreach path allocates sqrt(v) for every
        parameter at once. SGD updates in place.
    An estimate of the backward phase, not exact: backward frees activations while it allocates
    gradients; measured error is reported by `gptcalc verify`.
    """
    first = state_bytes(cfg, setup, "first")
    acts = saved_activations(cfg, workload, setup)
    saved = sum(v for k, v in acts.items() if not k.startswith("input/"))
    lg = logits_bytes(cfg, workload, setup)
    fixed = first.weights + first.optimizer + buffer_bytes(cfg, setup)
    backward = fixed + saved + lg["logits"] + 2 * lg["cross_entropy/log_probs"]
    if setup.optimizer != "adamw":
        temps = 0
    elif setup.device == "cuda":
        temps = _ceil(first.params, setup.dp if setup.zero else 1) * (
            4 if setup.mode != "bf16" else 2)
    else:
        temps = 2 * largest_param_tensor(cfg) * (4 if setup.mode != "bf16" else 2)
    optimizer = fixed + first.gradients + temps
    phases = {"backward": backward, "optimizer": optimizer}
    phase = max(phases, key=phases.get)
    why = ("saved activations and logits outweigh the gradients and update temporaries"
           if phase == "backward" else
           "gradients plus the optimizer's temporaries outweigh the activations (small batch)")
    return StepPeak(bytes=phases[phase], phase=phase, why=why, phases=phases)


@dataclass(frozen=True)
class MemoryReport:
    """Everything `gptcalc memory` prints; the byte fields are per device, exact integers."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    activations_paper: int
    logits: int
    kv_cache: int
    peak: StepPeak
    breakdown: dict[str, dict[str, int]]


def memory_report(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                  context: int | None = None) -> MemoryReport:
    """weights / gradients / optimizer on the most loaded device, activations both ways, logits,
    the KV cache of an inference run at `context` (default seq_len) and the step peak."""
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
    return MemoryReport(
        weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
        activations=sum(v for k, v in acts.items() if not k.startswith("input/")),
        activations_paper=sum(paper.values()), logits=sum(lg.values()), kv_cache=kv,
        peak=step_peak(cfg, workload, setup),
        breakdown={"state": st.breakdown, "activations": acts, "activations_paper": paper,
                   "logits": lg},
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
