"""What each training engine holds per rank, the way each does it: one module per engine.

- `deepspeed`: DeepSpeed's ZeRO stages 1-3 (the default for `--zero` 1-3);
- `fsdp2`: PyTorch's `fully_shard` (ZeRO-2 and ZeRO-3), with MixedPrecisionPolicy in mode
  mixed;
- `megatron`: Megatron-LM's distributed optimizer;
- `ddp`: DistributedDataParallel (ZeRO 0, the default for dp > 1 without ZeRO);
- `zero_redundancy`: PyTorch's ZeroRedundancyOptimizer (ZeRO-1, whole tensors per rank);
- `pipeline`: the 1F1B schedule's own terms; `shards`: what they share (torch.chunk's splits,
  DTensor's tensor-parallel shards, a rank's place in the layout).

The functions here choose the engine of a set-up (`TrainingSetup.engine_name`) and give one
device's states (`state_bytes`), its extra terms at each phase of the step peak
(`phase_terms`) and what it keeps between optimizer steps (`resident`). Every function is pure
and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..states import StateBytes, stage_tensors
from .ddp import ddp_gradient_buckets, ddp_phase_terms, ddp_resident
from .deepspeed import deepspeed_phase_terms, deepspeed_rank_states, deepspeed_resident
from .fsdp2 import (REDUCE_SCATTER, ROOT_REGATHER, fsdp2_phase_terms, fsdp2_rank_states, fsdp2_resident,
                    fsdp2_unsharded)
from .megatron import megatron_phase_terms, megatron_rank_states, megatron_resident
from .pipeline import pipeline_phase_terms
from .shards import (RankStates, chunk_rows, coords, first_rank, padded_rows, tp_local_shape,
                     tp_rank_states)
from .zero_redundancy import (zero1_most_loaded, zero1_partition, zero1_peak_rank,
                              zero1_rank_states, zero1_resident)


def _sharded_by(setup: TrainingSetup) -> str | None:
    """The engine whose own partitioning decides a rank's states, or None when every state is
    replicated (one device or DDP, and DeepSpeed at ZeRO 0). An engine keeps its own layout
    at dp = 1 too (DeepSpeed's fp32 partition copy, FSDP2's fp32 shards under
    MixedPrecisionPolicy)."""
    engine = setup.engine_name
    if engine == "ddp" or (engine == "deepspeed" and setup.zero == 0):
        return None
    return engine


def rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """The states of `rank` under the set-up's engine (`TrainingSetup.engine_name`); DTensor's
    tensor-parallel shards when nothing is sharded over dp."""
    engine = _sharded_by(setup)
    if engine is None:
        return tp_rank_states(cfg, setup, rank)
    return {"fsdp2": fsdp2_rank_states, "zero-redundancy": zero1_rank_states,
            "deepspeed": deepspeed_rank_states,
            "megatron": megatron_rank_states}[engine](cfg, setup, rank)


def peak_rank(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first") -> int:
    """The global rank of pipeline stage `stage` holding the most state bytes: the first
    (the first dp rank owns the most rows of every split), or ZeroRedundancyOptimizer's most
    loaded rank."""
    if _sharded_by(setup) == "zero-redundancy":
        return zero1_peak_rank(cfg, setup, stage)
    return first_rank(setup, stage)


def state_bytes(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first") -> StateBytes:
    """Weights, gradients and optimizer states on the most loaded device of `stage`, exact.

    Tensor and pipeline parallelism split the inventory (`states.stage_params`); the engine
    splits the rest over dp (`rank_states`): DeepSpeed's flat partitions, FSDP2's padded dim-0
    shards, ZeroRedundancyOptimizer's whole tensors (its most loaded rank), Megatron-LM's
    distributed optimizer. Replicated states (one device, DDP) are the inventory's tp shards
    in the mode's dtypes (`states.zero_bytes_per_param`). AdamW adds a 4-byte step counter per
    parameter tensor (torch keeps `state["step"]` as a float32 scalar tensor), not sharded.
    LoRA: a frozen base and trainable adapters (`finetune.finetune_state_bytes`)."""
    if setup.lora_rank:
        from ..finetune import finetune_state_bytes

        lines = finetune_state_bytes(cfg, setup)
        grads, opt = lines["adapter/gradients"], lines["adapter/optimizer"]
        weights = lines["base/weights"] + lines["adapter/weights"]
        return StateBytes(stage=stage, params=lines["adapter/weights"] // setup.weight_bytes,
                          weights=weights, gradients=grads, optimizer=opt, breakdown=lines)
    from ..states import zero_bytes_per_param
    from .shards import step_counters

    tensors = stage_tensors(cfg, setup, stage)
    n = sum(t.shard(setup.tp) * t.count for t in tensors)
    if _sharded_by(setup) is None:
        z = zero_bytes_per_param(setup, n)
        steps = step_counters(setup, sum(t.count for t in tensors))
        weights, grads, opt = z["weights"], z["gradients"], z["optimizer"]
    else:
        r = rank_states(cfg, setup, peak_rank(cfg, setup, stage))
        weights, grads, opt, steps = r.weights, r.gradients, r.optimizer - r.steps, r.steps
    breakdown = {"weights": weights, "gradients": grads, "optimizer/states": opt,
                 "optimizer/step": steps}
    return StateBytes(stage=stage, params=n, weights=weights, gradients=grads,
                      optimizer=opt + steps, breakdown=breakdown)


def phase_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: str,
                logits: int, gradients: int) -> dict[str, dict[str, int]]:
    """Every engine term of every phase of the step peak on a device of `stage`, merged: the
    data-parallel engine's (FSDP2's unsharded groups, DDP's buckets, Megatron-LM's
    main-gradient buffer, DeepSpeed's buffers) and
    the pipeline schedule's. A phase no plain step has (FSDP2's root re-gather) appears on
    its own."""
    out: dict[str, dict[str, int]] = {}
    parts = (fsdp2_phase_terms(cfg, workload, setup, stage), ddp_phase_terms(cfg, setup, stage),
             megatron_phase_terms(cfg, setup, stage),
             deepspeed_phase_terms(cfg, workload, setup, stage)
             if setup.engine_name == "deepspeed" else {},
             pipeline_phase_terms(cfg, workload, setup, stage, logits, gradients))
    for part in parts:
        for phase, terms in part.items():
            out.setdefault(phase, {}).update(terms)
    return out


def resident(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first",
             rank: int | None = None) -> dict[str, int]:
    """Bytes one device keeps between optimizer steps, by line: weights, optimizer states, the
    gradients the engine keeps (DDP's buckets, Megatron-LM's main-gradient buffer) and its
    buffers. Gradients freed by `zero_grad(set_to_none=True)` (PyTorch's engines) or by the
    engine after its step (DeepSpeed) are not resident. On `rank`, else the most loaded rank
    of `stage` (`peak_rank`). LoRA: the frozen base, the adapters and their optimizer
    states."""
    if setup.lora_rank:
        st = state_bytes(cfg, setup, stage)
        return {"weights": st.weights, "optimizer states": st.optimizer}
    rank = peak_rank(cfg, setup, stage) if rank is None else rank
    engine = _sharded_by(setup)
    if engine is None:
        return ddp_resident(cfg, setup, rank)
    return {"fsdp2": fsdp2_resident, "zero-redundancy": zero1_resident,
            "deepspeed": deepspeed_resident,
            "megatron": megatron_resident}[engine](cfg, setup, rank)


def rank_training_flops(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                        rank: int = 0, flash_backward: bool = False) -> int:
    """Matmul FLOPs rank `rank` executes in one training step (forward + backward), as
    FlopCounterMode counts them on its local shards.

    Blocks: `count_flops`' per-sequence total less the lm_head, times the micro-batch, divided
    by tp (heads and d_ff are split evenly) and by pp (L/pp blocks per stage), times the
    micro-batches a stage runs (pp under 1F1B, 1 otherwise). lm_head: on the last stage, its
    share of the vocabulary rows as torch.chunk splits them (V/tp need not be whole)."""
    from ...flops import count_flops

    fc = count_flops(cfg, workload, recompute=setup.recompute, flash_backward=flash_backward)
    head = sum(part.get("lm_head", 0) for part in (fc.forward, fc.backward, fc.recompute))
    blocks = fc.hardware_total - head
    pp_rank, _, tp_rank = coords(rank, setup)
    micro = setup.pp if setup.pp > 1 else 1
    b = workload.batch_size * micro
    total = b * blocks // (setup.tp * setup.pp)
    if pp_rank == setup.pp - 1:
        V = cfg.vocab_size
        total += b * head * chunk_rows(V, setup.tp, tp_rank) // V
    return total


__all__ = ["REDUCE_SCATTER", "ROOT_REGATHER", "RankStates", "chunk_rows", "ddp_gradient_buckets",
           "ddp_phase_terms", "fsdp2_phase_terms", "fsdp2_rank_states", "fsdp2_unsharded",
           "padded_rows", "peak_rank", "phase_terms", "pipeline_phase_terms", "rank_states",
           "rank_training_flops", "resident", "state_bytes", "tp_local_shape",
           "tp_rank_states", "zero1_most_loaded", "zero1_partition", "zero1_rank_states"]
