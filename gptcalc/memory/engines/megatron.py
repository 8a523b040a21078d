"""Megatron-LM's distributed optimizer, per rank.

Megatron-LM keeps the model's weights in the training dtype, accumulates gradients into a
contiguous fp32 main-gradient buffer (bf16 training; fp16 keeps 16-bit gradients), and steps
fp32 main parameters with fp32 Adam moments. Its distributed optimizer shards the fp32 main
parameters and the Adam moments evenly over the data-parallel ranks (ZeRO-1 over a flat
buffer); without it every rank holds them all. Bytes per parameter, as Megatron-LM's
documentation tabulates them (docs/source/api-guide/dist_optimizer.md, d = dp):

    params / grads      without   distributed optimizer
    bf16 / fp32         18        6 + 12/d
    fp16 / fp16         20        4 + 16/d   (the fp32 main gradients are sharded too)
    fp32 / fp32         16        8 + 8/d

No memory twin of Megatron-LM runs here (it needs CUDA and Transformer Engine); the figures
are its documentation's (its distributed optimizer's collectives are counted on gloo with CUDA
shimmed: reference_model/megatron_optimizer_twin.py). Megatron-LM's fused Adam keeps its step count per parameter group, not a
tensor per parameter.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...schedules import Stage
from ...errors import ConfigError
from ...training_setup import TrainingSetup
from ..ledger import (GRADIENTS, GRADIENTS_ACCUMULATING, Phase, Ledger, Term)
from ..states import stage_tensors
from .base import Engine, Step, register
from .shards import RankStates, coords, first_rank, stage_of

MAIN_GRADIENT_BUFFER = Term("Megatron-LM main-gradient buffer")

# (weight bytes, gradient bytes kept on every rank, bytes sharded by the distributed optimizer)
MEGATRON_BYTES = {
    ("mixed", "bf16"): (2, 4, 12),  # fp32 main grads; fp32 main params + Adam m, v
    ("mixed", "fp16"): (2, 2, 16),  # fp16 grads; fp32 main grads, main params, Adam m, v
    ("fp32", "bf16"): (4, 4, 8),
    ("fp32", "fp16"): (4, 4, 8),
}


def megatron_bytes(setup: TrainingSetup) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter before the distributed optimizer
    shards the last; only Megatron-LM's precisions (bf16/fp16 mixed, fp32) and AdamW."""
    key = (setup.mode, setup.autocast_dtype)
    if key not in MEGATRON_BYTES:
        raise ConfigError("mode", f"Megatron-LM trains in mixed (bf16 or fp16) or fp32, not "
                                  f"{setup.mode}")
    if setup.optimizer != "adamw":
        raise ConfigError("optimizer", f"Megatron-LM's optimizer is its fused Adam (or SGD), "
                                       f"modelled with adamw only, not {setup.optimizer}")
    return MEGATRON_BYTES[key]


def megatron_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """Megatron-LM on `rank`: the stage's tensor-parallel shards whole in the weight and
    gradient dtypes; the optimizer's bytes over ceil(N / dp) elements with the distributed
    optimizer (its buffers are padded to a multiple of dp), over N without it."""
    pp_rank, _, _ = coords(rank, setup)
    n = sum(t.shard(setup.tp) * t.count
            for t in stage_tensors(cfg, setup, stage_of(setup, pp_rank)))
    w, g, k = megatron_bytes(setup)
    owned = -(-n // setup.dp) if setup.distributed_optimizer else n
    return RankStates(w * n, g * n, k * owned, 0,
                      "Megatron-LM: " + ("distributed optimizer" if setup.distributed_optimizer
                                         else "replicated optimizer"))


def megatron_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between steps: weights, the contiguous main-gradient buffer (it
    lives for the whole run) and the optimizer's share."""
    st = megatron_rank_states(cfg, setup, rank)
    return {"weights": st.weights, "main-gradient buffer": st.gradients,
            "optimizer states": st.optimizer}


class Megatron(Engine):
    """Megatron-LM with (by default) its distributed optimizer."""

    name = "megatron"
    help = ("megatron (Megatron-LM's distributed optimizer, from its documentation; no twin "
            "runs here)")
    stages = (0,)
    mixed_by_default = True
    # Megatron-core's context parallel runs TransformerEngine's ring (point-to-point k/v
    # exchange, its own buffers), not torch's
    context_parallel = False
    # Megatron-Core's own layer (memory.profile_megatron); pretrain_gpt.py's forward_step gets
    # the loss from GPTModel.forward, whose logits die with it
    default_impl = "megatron-core"
    loop_keeps_logits = False
    # Megatron-LM runs its own schedules (megatron/core/pipeline_parallel/schedules.py): the
    # micro-batches alive are counted as torch's (`gptcalc.schedules`), its p2p tensors not
    torch_pipelining = False

    def check(self, setup: TrainingSetup) -> None:
        super().check(setup)
        megatron_bytes(setup)

    def label(self, setup: TrainingSetup) -> str:
        return "megatron " + ("(distributed optimizer)" if setup.distributed_optimizer
                              else "(no distributed optimizer)")

    def mixed_precision(self, setup: TrainingSetup) -> str:
        d = setup.autocast_dtype
        grads = "fp32 main gradients" if d == "bf16" else "fp16 gradients"
        return f"mixed ({d} weights, {grads}, fp32 master copy)"

    def replicated(self, setup: TrainingSetup) -> bool:
        return False

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        return megatron_rank_states(cfg, setup, rank)

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return megatron_resident(cfg, setup, rank)

    def optimizer_sharded(self, setup: TrainingSetup) -> bool:
        return setup.distributed_optimizer

    def master_gradient_bytes(self, setup: TrainingSetup, params: int) -> int:
        """The main gradients are the gradients: no separate fp32 copy for the masters."""
        return 0

    def pipeline_accumulation(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                              ) -> dict[Term, int] | None:
        """Every micro-batch's gradient is added into the main-gradient buffer, which `adjust`
        counts at every moment already: nothing more across micro-batches."""
        return {}

    def adjust(self, ledger: Ledger, step: Step) -> None:
        """The main-gradient buffer is allocated once and lives through every moment: before
        the backward it holds the gradients' bytes already (it replaces the accumulating
        gradients of the plain moments); at the end of backward and in the optimizer step it
        is the gradients' line itself."""
        setup = step.setup
        buffer = megatron_rank_states(step.cfg, setup, first_rank(setup, step.stage)).gradients
        for phase in (*ledger.forward_phases(), Phase.BACKWARD_START):
            ledger.add(phase, MAIN_GRADIENT_BUFFER, buffer)
            ledger.replace(phase, GRADIENTS_ACCUMULATING, 0)
        ledger.add(Phase.BACKWARD_LAST_BLOCK, MAIN_GRADIENT_BUFFER, buffer)
        ledger.replace(Phase.BACKWARD_LAST_BLOCK, GRADIENTS, 0)


register(Megatron())

__all__ = ["MAIN_GRADIENT_BUFFER", "MEGATRON_BYTES", "Megatron", "megatron_bytes",
           "megatron_rank_states", "megatron_resident"]
