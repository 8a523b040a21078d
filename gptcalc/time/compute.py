"""Compute time of one micro-batch on one rank, op by op.

Each op is timed on a roofline of the card (`gptcalc.gpus`): the larger of its FLOPs at a
fraction of the dense peak and its bytes at the HBM bandwidth.

    matmul (a block Linear, the lm_head)  max(2 M K N / (peak x MATMUL_EFFICIENCY),
                                              bytes(M K + K N + M N) / HBM)
    attention core (flash-type kernel)    causal FLOPs / (peak x ATTENTION_EFFICIENCY)
    norms, residual adds, activation,     bytes read and written / HBM, op by op
    rotary, cross-entropy, optimizer

so a small or skinny GEMM (few tokens, a narrow tensor-parallel shard, one expert's tokens)
falls below the peak as its operands' traffic dominates. Backward is twice the forward's
matmuls (the input and the weight gradient, each a GEMM of the same shape), a flash-type
attention backward 2.5 times its forward FLOPs (it recomputes q k^T; Dao et al. 2022), and
twice the forward's memory traffic. Recomputation runs the forward's share again
(`gptcalc.flops.recompute_flops` says which matmuls); torch.compile fuses the elementwise chains
(fewer bytes); float8 runs the blocks' Linears at the fp8 peak and adds the casts' traffic.

Scope: one rank of the layout's heaviest pipeline stage (the most blocks, and the lm_head and
loss on the last); the sequence is split over cp ranks, the widths over tp; kernel launch
latency, data loading and host overhead are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..config import GPTConfig
from ..flops import forward_flops, recompute_flops
from ..gpus import GPU, require_bandwidth, require_peak
from ..linears import block_linears
from ..params import count_params
from ..training_setup import TrainingSetup

# The share of the dense peak that large 16-bit GEMMs reach, and that a flash-type attention
# kernel reaches on the causal work, for a card whose catalogue entry has no fitted figure
# (`GPU.matmul_efficiency`, `GPU.attention_efficiency`): the H100 SXM's, FITTED on MPT's
# published H100 runs (gptcalc.gpus cites them; docs/time.md gives the held-out error).
MATMUL_EFFICIENCY = 0.50
ATTENTION_EFFICIENCY = 0.18
# A flash-type attention backward does 2.5x its forward's FLOPs: it recomputes q @ k^T (Dao et
# al. 2022; torch's FlopCounterMode counts SDPA's backward so)
FLASH_BACKWARD = 2.5
# Backward moves about twice the forward's elementwise bytes: it reads the saved input and the
# output gradient and writes the input gradient of each op (ASSUMED, not measured).
BACKWARD_TRAFFIC = 2.0
# AdamW's fused step per parameter: reads the fp32 parameter, gradient, exp_avg and exp_avg_sq
# and writes the three states back (torch.optim.AdamW(fused=True)); 4 bytes each, plus one more
# read of the gradient for its norm (gradient clipping).
ADAMW_BYTES_PER_PARAM = 4 * (4 + 3) + 4
# bytes per element of float8 casts: an amax read of the 16-bit tensor, then a read and an
# 8-bit write (torchao's tensorwise scaling, eager); compiled, the amax and the cast fuse
FLOAT8_CAST_BYTES = {False: 2 + 2 + 1, True: 2 + 1}


@dataclass(frozen=True)
class MicroBatchCompute:
    """Seconds of one micro-batch's compute on one rank, by op kind; `forward` and `backward`
    sum their parts; `recompute` is the forward work backward does again."""

    matmul_forward: float
    attention_forward: float
    memory_forward: float  # elementwise and loss traffic
    matmul_backward: float
    attention_backward: float
    memory_backward: float
    recompute: float
    attention_forward_per_block: float  # the core kernel of one block (context parallel's ring)

    @property
    def forward(self) -> float:
        return self.matmul_forward + self.attention_forward + self.memory_forward

    @property
    def backward(self) -> float:
        return (self.matmul_backward + self.attention_backward + self.memory_backward
                + self.recompute)


def matmul_seconds(m: float, k: float, n: float, peak: float, hbm: float, elem: float = 2,
                   efficiency: float = MATMUL_EFFICIENCY) -> float:
    """One (m, k) x (k, n) GEMM on the roofline: max(2mkn / (peak x efficiency), bytes / HBM),
    bytes = elem x (mk + kn + mn): each operand read once and the output written once."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    return max(2 * m * k * n / (peak * efficiency), elem * (m * k + k * n + m * n) / hbm)


def stage_blocks(cfg: GPTConfig, pp: int) -> int:
    """Blocks of the heaviest pipeline stage: ceil(L / pp)."""
    return math.ceil(cfg.n_layer / pp)


@lru_cache(maxsize=256)
def _linears(cfg: GPTConfig) -> tuple:
    return tuple(block_linears(cfg))


@lru_cache(maxsize=256)
def _params(cfg: GPTConfig):
    return count_params(cfg)


@lru_cache(maxsize=256)
def _forward(cfg: GPTConfig, seq_len: int) -> dict[str, int]:
    """forward_flops with causal attention (never mutated by its readers)."""
    return forward_flops(cfg, seq_len, causal=True)


def _block_matmuls(cfg: GPTConfig, setup: TrainingSetup, tokens: float, peak: float,
                   hbm: float, fp8_peak: float | None, eff: float) -> tuple[float, float]:
    """(seconds, float8 cast bytes) of one block's Linears forward on one rank, averaged over
    the blocks (a MoE model's dense and MoE blocks in proportion)."""
    L, tp = cfg.n_layer, setup.tp
    seconds = cast = 0.0
    p = fp8_peak or peak
    for lin in _linears(cfg):
        if lin.target == "router":
            n_mod, m = lin.count / L, tokens
        elif ".experts." in f".{lin.name}":  # routed: each expert sees k / n of the tokens
            n_mod = lin.count / L / setup.ep
            m = tokens * cfg.n_expert_active * setup.ep / cfg.n_expert
        else:
            n_mod, m = lin.count / L, tokens
        k, n = lin.in_features, lin.out_features / tp
        seconds += n_mod * matmul_seconds(m, k, n, p, hbm, 1 if fp8_peak else 2, eff)
        if fp8_peak:  # the input and the weight cast to float8 (their grads in backward)
            cast += n_mod * FLOAT8_CAST_BYTES[setup.compile != "none"] * (m * k + k * n)
    return seconds, cast


def _elementwise_bytes(cfg: GPTConfig, setup: TrainingSetup, tokens: float) -> float:
    """Bytes one block's elementwise ops read and write in forward on one rank: two norms,
    two residual adds, the MLP activation, rotary on q and k. Eager: each op reads its inputs
    and writes its output (a norm upcasts, reduces and scales: read and write twice); compiled
    (torch.compile), a norm fuses with the residual add before it and the gated activation is
    one kernel."""
    a, tp = setup.act_bytes, setup.tp
    E = cfg.n_embd
    stream = tokens / tp if setup.sp else tokens  # sequence parallel splits the stream ops
    F = (cfg.ffn_dim if not cfg.moe else cfg.n_expert_active * cfg.expert_dim + cfg.shared_dim)
    gated = cfg.mlp == "swiglu" or cfg.mlp.endswith("glu")
    rot = (cfg.n_head + cfg.kv_heads) * cfg.head_size / tp if cfg.rotary_dims else 0
    if setup.compile != "none":
        norms = 2 * 4 * E  # read x and the residual branch, write the sum and the normed x
        residual = 0
        act = (3 if gated else 2) * F / tp
        rotary = 2 * rot
    else:
        norms = 2 * 4 * E  # per norm: read, write the fp32 upcast's result, read, write
        residual = 2 * 3 * E  # per add: read two, write one
        act = (5 if gated else 2) * F / tp  # silu(gate) then gate * up: 2F + 3F
        rotary = 6 * rot  # rotate_half's temporaries: read, write, twice, and the sum
    return a * (stream * (norms + residual) + tokens * (act + rotary))


def _loss_bytes(cfg: GPTConfig, setup: TrainingSetup, tokens: float) -> float:
    """Forward and backward bytes of the cross-entropy over the logits (V / tp per rank):
    eager, the 16-bit logits are upcast to fp32, log-softmaxed and their gradient written back
    (read 2 + write 4, read 4 + write 4, then backward read 4 + write 4 and the downcast read 4
    + write 2 bytes per logit); compiled or chunked, one read and one gradient write."""
    per_logit = 4 if (setup.compile != "none" or setup.loss != "standard") else 28
    return tokens * cfg.vocab_size / setup.tp * per_logit


def micro_batch_compute(cfg: GPTConfig, setup: TrainingSetup, batch: int, seq_len: int,
                        g: GPU, precision: str = "bf16", last_stage: bool = True
                        ) -> MicroBatchCompute:
    """Compute seconds of one micro-batch of `batch` sequences on one rank of the heaviest
    pipeline stage (module docstring); computed once per set-up fields it reads (the layout
    but dp, the precision, compile, float8, the loss, attention, recomputation): the engine,
    its ZeRO stage and the replicas do not change a rank's compute."""
    key = (setup.tp, setup.ep, setup.cp, setup.pp, setup.sp, setup.mode, setup.compile,
           setup.float8, setup.loss, setup.attn_impl, setup.recompute)
    return _compute(cfg, key, setup, batch, seq_len, g, precision, last_stage)


@lru_cache(maxsize=4096)
def _compute_cached(cfg: GPTConfig, key: tuple, batch: int, seq_len: int, g: GPU,
                    precision: str, last_stage: bool) -> MicroBatchCompute:
    return _uncached_compute(cfg, _SETUPS[key], batch, seq_len, g, precision, last_stage)


_SETUPS: dict[tuple, TrainingSetup] = {}  # a set-up with each key's fields, the first seen


def _compute(cfg: GPTConfig, key: tuple, setup: TrainingSetup, batch: int, seq_len: int,
             g: GPU, precision: str, last_stage: bool) -> MicroBatchCompute:
    _SETUPS.setdefault(key, setup)
    return _compute_cached(cfg, key, batch, seq_len, g, precision, last_stage)


def _uncached_compute(cfg: GPTConfig, setup: TrainingSetup, batch: int, seq_len: int,
                      g: GPU, precision: str = "bf16", last_stage: bool = True
                      ) -> MicroBatchCompute:
    """`micro_batch_compute` computed."""
    peak = require_peak(g, "bf16" if precision == "fp8" else precision)
    hbm = require_bandwidth(g)
    fp8 = precision == "fp8" or setup.float8 != "none"
    fp8_peak = require_peak(g, "fp8") if fp8 else None
    tokens = batch * seq_len / setup.cp  # context parallel splits the sequence
    blocks = stage_blocks(cfg, setup.pp)
    eff = g.matmul_efficiency or MATMUL_EFFICIENCY
    attn_eff = g.attention_efficiency or ATTENTION_EFFICIENCY
    mm_block, cast = _block_matmuls(cfg, setup, tokens, peak, hbm, fp8_peak, eff)
    mm = blocks * (mm_block + cast / hbm)
    fwd = _forward(cfg, seq_len)
    core = (fwd["attention/scores"] + fwd["attention/values"]) * batch / setup.cp / setup.tp
    attn = blocks / cfg.n_layer * core / (peak * attn_eff)
    if setup.attn_impl == "manual":  # the S x S scores written out: fp32 softmax traffic
        scores = batch * cfg.n_head / setup.tp * tokens * seq_len
        attn = max(attn, blocks * 4 * 4 * scores / hbm)
    elem = blocks * _elementwise_bytes(cfg, setup, tokens) / hbm
    head = loss = 0.0
    if last_stage:
        head = matmul_seconds(tokens, cfg.n_embd, cfg.vocab_size / setup.tp, peak, hbm, 2, eff)
        loss = _loss_bytes(cfg, setup, tokens) / hbm
    # recomputation: the share of the forward's matmuls and core `recompute_flops` names,
    # and the elementwise ops of any block run again (full, op)
    extra = recompute_flops(cfg, fwd, setup.recompute, True, seq_len)
    block_mm = {k: v for k, v in fwd.items() if k not in (
        "attention/scores", "attention/values", "lm_head", "embedding/proj")}
    mm_share = sum(extra[k] for k in block_mm) / max(1, sum(block_mm.values()))
    recompute = mm_share * mm + (mm_share * elem if setup.recompute in ("full", "op") else 0)
    if setup.recompute in ("selective", "full") or (setup.recompute == "op"
                                                    and setup.attn_impl == "manual"):
        recompute += attn
    return MicroBatchCompute(
        matmul_forward=mm + head, attention_forward=attn, memory_forward=elem + loss / 3,
        matmul_backward=2 * (mm + head), attention_backward=FLASH_BACKWARD * attn,
        memory_backward=BACKWARD_TRAFFIC * elem + 2 * loss / 3, recompute=recompute,
        attention_forward_per_block=attn / blocks)


def rank_parameters(cfg: GPTConfig, setup: TrainingSetup) -> float:
    """Parameters one rank holds before data-parallel sharding: the model's over tp, its
    heaviest pipeline stage's share of the blocks (embeddings and head beside them)."""
    p = _params(cfg)
    outside = p.total - p.non_embedding
    blocks = p.non_embedding * stage_blocks(cfg, setup.pp) / cfg.n_layer
    experts = (p.components.get("moe/experts", 0) * stage_blocks(cfg, setup.pp) / cfg.n_layer)
    return (blocks - experts + experts / setup.ep) / setup.tp + outside / setup.tp / max(
        1, min(setup.pp, 2))


def optimizer_seconds(cfg: GPTConfig, setup: TrainingSetup, g: GPU) -> float:
    """The optimizer step on one rank: AdamW's traffic over the parameters it updates (its
    shard of dp x cp under ZeRO 1-3 or Megatron's distributed optimizer)."""
    params = rank_parameters(cfg, setup)
    if setup.zero or (setup.engine == "megatron" and setup.distributed_optimizer):
        params /= setup.dp * setup.cp
    return params * ADAMW_BYTES_PER_PARAM / require_bandwidth(g)


__all__ = ["ATTENTION_EFFICIENCY", "MATMUL_EFFICIENCY", "MicroBatchCompute", "matmul_seconds",
           "micro_batch_compute", "optimizer_seconds", "rank_parameters", "stage_blocks"]
