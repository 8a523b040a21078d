"""One optimizer step's time: compute, the communication compute does not hide, the bubble.

    slot    = forward + backward of one micro-batch on the heaviest stage (`compute`), plus
              the exposed tensor-, context- and expert-parallel communication and the
              pipeline's send/recv of that micro-batch
    step    = m x slot + bubble + exposed data-parallel communication + optimizer step

What each engine overlaps with compute (`comm` lists the collectives):
- tensor parallel and expert parallel collectives sit between the ops that need them: exposed
  (Megatron-LM's and torchtitan's defaults; their async/overlapped TP is opt-in).
- context parallel's ring sends the next chunk while the current one is attended: exposed only
  what exceeds the attention kernels' time.
- FSDP2 and ZeRO-3 prefetch the next block's all-gather during the current block's compute
  and reduce-scatter during the next block's backward: exposed, the first block's gather each
  micro-batch, the last block's reduce-scatter of the step and what each pass's collectives
  take beyond that pass's compute (the forward's gathers behind the forward, the backward's
  gathers and the reduce-scatters behind the backward). Under pipelining FSDP2 reduces once a
  step and, at --zero 2, gathers once a step (`comm.fsdp2_gather_rounds`).
- FSDP1 gathers each unit in its own pre-forward (no forward prefetch, limit_all_gathers) and
  the next unit's before the current one's backward (BACKWARD_PRE): exposed, the root's and
  the first block's gathers of each forward that gathers, the first block's and the root's
  reduce-scatters of each synced backward, and what each pass's other collectives take beyond
  it (`_exposed_fsdp1`).
- compute that a collective overlaps runs slower by `OVERLAP_SLOWDOWN` of the collective's
  time (FSDP2, FSDP1, ZeRO-3 and the overlapped data-parallel reductions).
- DDP's buckets all-reduce during the last micro-batch's backward (gradients are synchronised
  once per step, `no_sync` before): exposed, the last bucket or what exceeds that backward.
  Megatron's distributed optimizer overlaps its reduce-scatter the same way and its parameter
  all-gather with the next forward (--overlap-grad-reduce, --overlap-param-gather, as its
  training recipes run). DeepSpeed ZeRO 1-2 (overlap_comm off below stage 3, its default) and
  ZeroRedundancyOptimizer's broadcast after the step are exposed.
- pipeline send/recv is on the critical path of each slot.

Bubble per schedule (p stages, m micro-batches, v chunks per stage; Narayanan et al. 2021 sec.
2.2): GPipe and 1F1B (p - 1) slots, interleaved 1F1B (p - 1) / v slots, zero bubble (Qi et al.
2023, ZB-H1) (p - 1) x (slot - weight-gradient time) / v: the weight gradients (half the
backward's matmuls) fill the gaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..config import GPTConfig
from ..errors import positive_int
from ..flops import count_flops
from ..gpus import GPU, require_peak
from ..training_setup import TrainingSetup
from ..workload import Workload
from .comm import (Collective, collective_seconds, collectives, fsdp1_rounds,
                   fsdp2_gather_rounds)
from .compute import micro_batch_compute, optimizer_seconds

# Compute that a collective overlaps runs slower, by this share, for the collective's time:
# NCCL's kernels take SMs (one thread block per channel) and HBM bandwidth from the matmuls
# they overlap. Agrawal et al. 2025, "Characterizing Compute-Communication Overlap in
# GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114), abstract: an average
# computational slowdown of 18.9% (at most 40%) of overlapped compute, GPT and Llama models on
# A100, H100, MI250 and MI210
OVERLAP_SLOWDOWN = 0.189

PARTS = ("compute", "recompute", "comm/tp", "comm/cp", "comm/ep", "comm/pp", "comm/fsdp",
         "comm/dp", "bubble", "optimizer")


@dataclass(frozen=True)
class TimedCollective:
    collective: Collective
    seconds: float  # all `count` of them, as if nothing overlapped


@dataclass(frozen=True)
class StepTime:
    """A step's seconds and its parts (`PARTS`, which sum to it)."""

    step_seconds: float
    tokens_per_step: int
    gpus: int
    model_flops: float  # of the step: forward + backward, full S x S attention (gptcalc.flops)
    peak_flops: float  # the dense bf16 peak the MFU is measured against
    parts: dict[str, float]
    collectives: list[TimedCollective] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over gpus x dense bf16 peak (PaLM's definition)."""
        return self.model_flops / (self.step_seconds * self.gpus * self.peak_flops)


def _bubble(setup: TrainingSetup, slot: float, weight_grad: float) -> float:
    p, v = setup.pp, setup.pp_virtual
    if p == 1:
        return 0.0
    if setup.pp_schedule == "zero-bubble":
        return (p - 1) * (slot - weight_grad) / v
    return (p - 1) * slot / (v if setup.pp_schedule == "interleaved-1f1b" else 1)


def step_time(cfg: GPTConfig, setup: TrainingSetup, batch: int, seq_len: int,
              micro_batches: int, g: GPU, precision: str = "bf16", node: int | None = None,
              intra: float | None = None, inter: float | None = None) -> StepTime:
    """The step time of `micro_batches` micro-batches of `batch` sequences of `seq_len` tokens
    on every data-parallel replica of `setup`'s layout on `g` (module docstring); `node` GPUs
    per node (default the card's), `intra`/`inter` bus bandwidths overriding the card's."""
    positive_int("grad_accum", micro_batches)
    node = node or g.gpus_per_node
    m = micro_batches
    c = micro_batch_compute(cfg, setup, batch, seq_len, g, precision)
    timed = [TimedCollective(x, x.count * collective_seconds(
        x.kind, x.size, x.group, x.ranks_per_node, x.crosses_nodes, g, intra, inter))
        for x in collectives(cfg, setup, batch, seq_len, m, node)]
    by = {p: sum(t.seconds for t in timed if t.collective.part == p)
          for p in ("tp", "cp", "ep", "pp", "fsdp", "dp")}
    attention = c.attention_forward * (2 if setup.recompute in ("selective", "full") else 1) \
        + c.attention_backward
    cp = max(0.0, by["cp"] - m * attention)
    compute = c.forward + c.backward - c.recompute
    slot = c.forward + c.backward + (by["tp"] + cp + by["ep"] + by["pp"]) / m
    bubble = _bubble(setup, slot, c.matmul_backward / 2)
    fsdp = 0.0
    if by["fsdp"] and setup.engine == "fsdp1":
        fsdp = _exposed_fsdp1([t for t in timed if t.collective.part == "fsdp"],
                              fsdp1_rounds(setup, m), cfg.n_layer, c.forward, c.backward)
    elif by["fsdp"]:
        fsdp = _exposed_fsdp([t for t in timed if t.collective.part == "fsdp"], m,
                             c.forward, c.backward, setup.zero == 3,
                             fsdp2_gather_rounds(setup, m) if setup.engine == "fsdp2" else m)
    dp_timed = [t for t in timed if t.collective.part == "dp"]
    dp = _exposed_dp(setup, dp_timed, c.backward, c.forward)
    # what overlaps compute slows it: NCCL's kernels take SMs from the matmuls they overlap
    fsdp += OVERLAP_SLOWDOWN * (by["fsdp"] - fsdp)
    dp += OVERLAP_SLOWDOWN * max(0.0, by["dp"] - dp)
    parts = {"compute": m * compute, "recompute": m * c.recompute, "comm/tp": by["tp"],
             "comm/cp": cp, "comm/ep": by["ep"], "comm/pp": by["pp"], "comm/fsdp": fsdp,
             "comm/dp": dp, "bubble": bubble, "optimizer": optimizer_seconds(cfg, setup, g)}
    flops = _model_flops(cfg, seq_len)
    global_batch = batch * m * setup.dp
    return StepTime(sum(parts.values()), global_batch * seq_len, setup.gpus,
                    flops * global_batch, require_peak(g, "bf16"), parts, timed)


@lru_cache(maxsize=256)
def _model_flops(cfg: GPTConfig, seq_len: int) -> int:
    return count_flops(cfg, Workload(1, seq_len)).training_total


def _exposed_fsdp(timed: list[TimedCollective], m: int, forward: float, backward: float,
                  reshard: bool, rounds: int) -> float:
    """FSDP2's and ZeRO-3's exposed seconds: the first all-gather of each of the `rounds`
    forwards that gather (every micro-batch's, once a step for FSDP2 under pipelining at
    --zero 2: nothing to overlap it before the first block), the step's last reduce-scatter
    (the first block's gradients, after the last backward, before the optimizer step), and
    what each pass's collectives take beyond that pass's compute of the m micro-batches: the
    forward's all-gathers behind the forward; the backward's all-gathers (`reshard`: ZeRO-3 gathers
    again) and every reduce-scatter behind the backward. Where the collectives name their
    pass (DeepSpeed ZeRO-3's prefetching replay), the forward's gathers are those named so."""
    gathers = [t for t in timed if t.collective.kind == "all-gather"]
    scatters = [t for t in timed if t.collective.kind == "reduce-scatter"]
    gathered = sum(t.seconds for t in gathers)
    first = gathers[0].seconds / gathers[0].collective.count * min(m, rounds)
    last = scatters[0].seconds / scatters[0].collective.count if scatters else 0.0
    if any(t.collective.phase for t in gathers):  # the engine's model names each pass's
        ahead = sum(t.seconds for t in gathers if t.collective.phase == "forward")
    else:  # FSDP2: half the gathers run before the forward
        ahead = gathered / 2 if reshard else gathered
    behind = gathered - ahead + sum(t.seconds for t in scatters)
    return first + last + max(0.0, ahead - first - m * forward) \
        + max(0.0, behind - last - m * backward)


def _exposed_fsdp1(timed: list[TimedCollective], rounds: list[tuple[int, bool, bool, bool]],
                   blocks: int, forward: float, backward: float) -> float:
    """FSDP1's exposed seconds, summed over the kinds of micro-batch `comm.fsdp1_rounds` gives
    (how many, whether the forward gathers, the backward gathers, the backward reduces), from
    one call's seconds of each unit's collective (G_root, G_block, R_root, R_block) and one
    micro-batch's compute (F, B) over L blocks:

        forward   G_root + G_block + max(0, (L - 1) G_block - F)
        backward  [reduces] (R_block + R_root)
                  + max(0, [gathers] L G_block + [reduces] (L - 1) R_block - B)

    As FSDP1 issues them (torch 2.13, torch/distributed/fsdp/_runtime_utils.py):
    forward_prefetch is off by default, so each unit's all-gather is issued in its own
    pre-forward (`_pre_forward_unshard`), while the GPU still runs the previous block (the CPU
    runs ahead), and limit_all_gathers keeps at most two units' gathers in flight (`_unshard`
    waits on the free event of the unit two back: `_FreeEventQueue`, 2 in flight,
    _limiter_utils.py): block i + 1's gather
    hides behind block i's compute, the root's and the first block's only behind the
    embedding lookup. In backward, BACKWARD_PRE (`_pre_backward_hook`, `_prefetch_handle`)
    issues the next unit's all-gather before the current unit's backward computes, the last
    block's from the root's pre-backward hook, before the head's backward: every backward
    gather hides behind backward compute. Each unit's reduce-scatter is issued on the
    post-backward stream in its post-backward hook (`_post_backward_hook`) and runs during the
    next unit's backward; the first block's and then the root's (the embedding's gradient,
    made last) have nothing left to hide behind, and a synced backward ends by waiting for
    them (`_post_backward_final_callback`)."""
    def per_call(kind: str, phase: str) -> list[float]:  # the root's, then a block's
        return [t.seconds / t.collective.count for t in timed
                if t.collective.kind == kind and t.collective.phase == phase]

    g_root, g_block = per_call("all-gather", "forward")
    r_root, r_block = per_call("reduce-scatter", "backward")
    out = 0.0
    for n, gathers_forward, gathers_backward, reduces in rounds:
        if gathers_forward:
            out += n * (g_root + g_block + max(0.0, (blocks - 1) * g_block - forward))
        behind = gathers_backward * blocks * g_block + reduces * (blocks - 1) * r_block
        out += n * (reduces * (r_block + r_root) + max(0.0, behind - backward))
    return out


def _exposed_dp(setup: TrainingSetup, timed: list[TimedCollective], backward: float,
                forward: float) -> float:
    """The data-parallel collectives' exposed seconds (module docstring)."""
    out = 0.0
    for t in timed:
        x, s = t.collective, t.seconds
        one = s / x.count
        if x.kind == "all-reduce":  # DDP's buckets during the last backward
            out += max(one, s - backward)
        elif x.kind == "reduce-scatter" and setup.engine == "megatron":
            out += max(one, s - backward)
        elif x.kind == "all-gather" and setup.engine == "megatron":
            out += max(0.0, s - forward)
        else:  # DeepSpeed ZeRO 1-2 without overlap_comm, ZeroRedundancy's broadcast
            out += s
    return out


__all__ = ["PARTS", "StepTime", "TimedCollective", "step_time"]
