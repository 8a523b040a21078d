"""DistributedDataParallel (ZeRO 0 with dp > 1), per rank: every state replicated, and the
reducer's gradient buckets.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...schedules import Stage
from ...training_setup import TrainingSetup
from ..ledger import STEADY_PHASES, Ledger, Term
from .base import Engine, Step, engine_for, register
from .shards import coords, first_rank, stage_of, tp_rank_states

BUCKETS = Term("DDP gradient buckets (a second copy of the gradients)")


def ddp_gradient_buckets(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first") -> int:
    """Bytes of DistributedDataParallel's gradient buckets on one rank: the reducer allocates
    flat bucket buffers for every parameter that requires a gradient at construction
    (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb 25, the first bucket 1 MB) and,
    with PyTorch's default gradient_as_bucket_view=False, `.grad` stays a tensor of its own:
    the buffers are a second copy of the gradients, alive for the whole step. Each bucket
    packs its parameters' elements without padding (measured on CPU/gloo, torch 2.13), so the
    buffers total the rank's gradient bytes; under LoRA the adapters' only (the reducer
    buckets the parameters that require a gradient). Zero unless the engine is DDP with
    dp > 1."""
    if setup.dp == 1 or not isinstance(engine_for(setup), DDP):
        return 0
    if setup.lora_rank:
        return engine_for(setup).finetune_states(cfg, setup)["adapter/gradients"]
    return tp_rank_states(cfg, setup, first_rank(setup, stage)).gradients


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


class DDP(Engine):
    """DistributedDataParallel: every state replicated, the reducer's gradient buckets in
    every moment of the step."""

    name = "ddp"
    help = "ddp (DistributedDataParallel; the default for --zero 0)"
    stages = (0,)
    default_for = (0,)

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return ddp_resident(cfg, setup, rank)

    def finetune_resident(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        """The frozen base, the adapters, their optimizer states and the adapters' buckets."""
        out = super().finetune_resident(cfg, setup)
        buckets = ddp_gradient_buckets(cfg, setup)
        if buckets:
            out["DDP gradient buckets"] = buckets
        return out

    def adjust(self, ledger: Ledger, step: Step) -> None:
        buckets = ddp_gradient_buckets(step.cfg, step.setup, step.stage)
        if buckets:
            phases = dict.fromkeys((*STEADY_PHASES, *ledger.forward_phases()))
            ledger.add_each(phases, BUCKETS, buckets)


register(DDP())

__all__ = ["BUCKETS", "DDP", "ddp_gradient_buckets", "ddp_resident"]
