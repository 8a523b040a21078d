"""DeepSpeed's ZeRO (deepspeed.runtime.zero), per rank: the ZeRO paper's partitions.

Rajbhandari et al. 2020, sec. 5: stage 1 partitions the fp32 master weights and Adam's
states over the dp ranks, stage 2 also the 16-bit gradients, stage 3 also the 16-bit weights;
a partition is ceil(N / dp) elements. In fp32 DeepSpeed keeps an fp32 partition copy of the
weights beside them, as it keeps the master copy in mixed precision.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..states import OPTIMIZER_BYTES, stage_tensors
from .shards import RankStates, coords, stage_of


def deepspeed_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """Weights, gradients and optimizer states on `rank` in a step: the 16-bit (mixed) or
    fp32 weights and gradients whole or partitioned by stage; the fp32 master partition and
    Adam's moments partitioned from stage 1 on."""
    pp_rank, _, _ = coords(rank, setup)
    n = sum(t.shard(setup.tp) * t.count
            for t in stage_tensors(cfg, setup, stage_of(setup, pp_rank)))
    part = -(-n // setup.dp)
    wb, z = setup.weight_bytes, setup.zero
    k = OPTIMIZER_BYTES[setup.mode][setup.optimizer] + (4 if setup.mode == "fp32" else 0)
    return RankStates(wb * (part if z >= 3 else n), wb * (part if z >= 2 else n),
                      k * (part if z >= 1 else n), 0, f"DeepSpeed ZeRO-{z}: flat partitions")


def deepspeed_buffers(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """DeepSpeed's communication buffers."""
    return {}


def deepspeed_phase_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                          stage: str) -> dict[str, dict[str, int]]:
    """What DeepSpeed holds beyond its states at each phase of the step."""
    return {}


def deepspeed_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between steps: its weights, optimizer partition and buffers (the
    16-bit gradients are freed after the step)."""
    st = deepspeed_rank_states(cfg, setup, rank)
    return {"weights": st.weights, "optimizer states": st.optimizer,
            **deepspeed_buffers(cfg, setup)}


__all__ = ["deepspeed_buffers", "deepspeed_phase_terms", "deepspeed_rank_states",
           "deepspeed_resident"]
