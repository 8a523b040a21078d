"""DistributedDataParallel (ZeRO 0 with dp > 1), per rank: every state replicated, and the
reducer's gradient buckets.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...training_setup import TrainingSetup
from .shards import coords, first_rank, stage_of, tp_rank_states

PHASES = ("forward end", "backward start", "backward, last block", "backward end",
          "optimizer step")


def ddp_gradient_buckets(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first") -> int:
    """Bytes of DistributedDataParallel's gradient buckets on one rank: the reducer allocates
    flat bucket buffers for every parameter that requires a gradient at construction
    (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb 25, the first bucket 1 MB) and,
    with PyTorch's default gradient_as_bucket_view=False, `.grad` stays a tensor of its own:
    the buffers are a second copy of the gradients, alive for the whole step. Each bucket
    packs its parameters' elements without padding (measured on CPU/gloo, torch 2.13), so the
    buffers total the rank's gradient bytes. Zero unless the engine is DDP with dp > 1."""
    if setup.dp == 1 or setup.engine_name != "ddp":
        return 0
    return tp_rank_states(cfg, setup, first_rank(setup, stage)).gradients


def ddp_phase_terms(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first"
                    ) -> dict[str, dict[str, int]]:
    """DDP's gradient buckets (`ddp_gradient_buckets`) in every phase of the step. Empty unless
    the engine is DDP with dp > 1."""
    buckets = ddp_gradient_buckets(cfg, setup, stage)
    if not buckets:
        return {}
    name = "DDP gradient buckets (a second copy of the gradients)"
    return {phase: {name: buckets} for phase in PHASES}


def ddp_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between steps under DDP (or on one device, or tensor and pipeline
    parallel alone): weights, optimizer states and the reducer's gradient buckets
    (`zero_grad(set_to_none=True)` frees `.grad`, not the buckets)."""
    st = tp_rank_states(cfg, setup, rank)
    out = {"weights": st.weights, "optimizer states": st.optimizer}
    buckets = ddp_gradient_buckets(cfg, setup, stage_of(setup, coords(rank, setup)[0]))
    if buckets:
        out["DDP gradient buckets"] = buckets
    return out


__all__ = ["ddp_gradient_buckets", "ddp_phase_terms", "ddp_resident"]
