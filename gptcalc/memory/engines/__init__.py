"""What each training engine holds per rank, the way each does it: one module per engine.

`base` holds the interface every engine answers (`Engine`) and the registry; each other
module defines one engine and registers it, and this package imports them all (so a new module
is a new engine): `deepspeed` (DeepSpeed's ZeRO 1-3, the default for --zero 1-3), `fsdp2`
(PyTorch's `fully_shard`, with MixedPrecisionPolicy in mode mixed), `fsdp1` (PyTorch's
FullyShardedDataParallel: flat parameters per unit, with MixedPrecision in mode mixed), `megatron` (Megatron-LM's
distributed optimizer), `ddp` (DistributedDataParallel, the default for ZeRO 0),
`zero_redundancy` (PyTorch's ZeroRedundancyOptimizer). `pipeline` holds the 1F1B schedule's
own terms, which apply under any engine; `shards` what they share (torch.chunk's splits,
DTensor's tensor-parallel shards, a rank's place in the layout).

The functions here give one device's states (`state_bytes`), the engine's and the schedule's
terms at each moment of the step peak (`adjust`) and what a device keeps between optimizer
steps (`resident`), whatever the engine. Every function is pure and never imports torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from ...config import GPTConfig
from ...optimizers import generation as optimizer_generation
from ...schedules import Stage, micro_batches, stage_layers
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..ledger import Ledger
from ..states import StateBytes, optimizer_of, stage_tensors
from .base import (Engine, Step, default_engine, describe, engine_for, engine_named,
                   generation, names, register, unregister)
from .pipeline import pipeline_adjust
from .shards import RankStates, chunk_rows, coords

# every module of this package that defines an engine registers it when imported
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """The states of `rank` under the set-up's engine (`Engine.rank_states`)."""
    return engine_for(setup).rank_states(cfg, setup, rank)


def peak_rank(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first") -> int:
    """The global rank of pipeline stage `stage` holding the most state bytes
    (`Engine.peak_rank`)."""
    return engine_for(setup).peak_rank(cfg, setup, stage)


def state_bytes(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first") -> StateBytes:
    """Weights, gradients and optimizer states on the most loaded device of `stage`, exact.

    Tensor and pipeline parallelism split the inventory (`states.stage_params`); the engine
    splits the rest over dp (`Engine.rank_states` of `peak_rank`): DeepSpeed's flat
    partitions, FSDP2's padded dim-0 shards, ZeroRedundancyOptimizer's whole tensors (its most
    loaded rank), Megatron-LM's distributed optimizer. Replicated states (one device, DDP) are
    the inventory's tp shards in the mode's dtypes (`states.zero_bytes_per_param`), each tensor's
    optimizer states by its shape (`states.tensor_optimizer_bytes`). AdamW adds a 4-byte step
    counter per parameter tensor (torch keeps `state["step"]` as a float32 scalar tensor),
    Adafactor its 4-byte RMS, not sharded. LoRA: a frozen base and trainable adapters, as the
    engine lays them out (`Engine.finetune_states`). Made once per configuration, set-up, stage
    and state of the engine and optimizer registries (a step's account, plan's micro-batches
    and pipeline ranks all ask)."""
    return _state_bytes(cfg, setup, stage, (generation(), optimizer_generation()))


@lru_cache(maxsize=4096)
def _state_bytes(cfg: GPTConfig, setup: TrainingSetup, stage: Stage,
                 _generation: tuple[int, int]) -> StateBytes:
    if setup.lora_rank:
        lines = engine_for(setup).finetune_states(cfg, setup)
        grads, opt = lines["adapter/gradients"], lines["adapter/optimizer"]
        weights = lines["base/weights"] + lines["adapter/weights"]
        return StateBytes(stage=stage, params=lines["adapter/weights"] // setup.weight_bytes,
                          weights=weights, gradients=grads, optimizer=opt, breakdown=lines)
    from ..states import (partnered_optimizer_bytes, unified_optimizer_bytes,
                          zero_bytes_per_param)
    from .shards import optimizer_over, step_counters, tp_local_shape

    engine = engine_for(setup)
    tensors = stage_tensors(cfg, setup, stage)
    n = sum(t.shard(setup.tp) * t.count for t in tensors)
    optimizer, unified = optimizer_of(setup), 0
    if engine.replicated(setup) and optimizer.partner:  # by each tensor's role
        z = zero_bytes_per_param(setup, n)
        split = partnered_optimizer_bytes(setup, tensors, setup.tp)
        weights, grads, opt, steps = z["weights"], z["gradients"], split["states"], split["step"]
    elif engine.replicated(setup):
        z = zero_bytes_per_param(setup, n)
        steps = step_counters(setup, sum(t.count for t in tensors))
        weights, grads, opt = z["weights"], z["gradients"], z["optimizer"]
        if setup.zero == 0:  # each tensor whole to the optimizer
            shapes = [(tp_local_shape(t, setup.tp, 0), t.count) for t in tensors]
            if optimizer.shaped:  # by each tensor's shape
                opt = optimizer_over(setup, shapes)
            # a paged optimizer's states in unified memory, not the device's
            unified = unified_optimizer_bytes(setup, shapes)
            opt -= unified
    else:
        r = engine.rank_states(cfg, setup, engine.peak_rank(cfg, setup, stage))
        weights, grads, opt, steps = r.weights, r.gradients, r.optimizer - r.steps, r.steps
    breakdown = {"weights": weights, "gradients": grads, "optimizer/states": opt,
                 "optimizer/step": steps}
    return StateBytes(stage=stage, params=n, weights=weights, gradients=grads,
                      optimizer=opt + steps, breakdown=breakdown, unified=unified)


def adjust(ledger: Ledger, step: Step) -> None:
    """The engine's terms at each moment of the step peak (`Engine.adjust`), then the
    pipeline schedule's (`pipeline.pipeline_adjust`)."""
    engine_for(step.setup).adjust(ledger, step)
    pipeline_adjust(ledger, step)


def host(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first") -> dict[str, int]:
    """Bytes the host holds for the most loaded rank of `stage`, by line (`Engine.host`:
    DeepSpeed's offloaded states); {} when nothing is offloaded."""
    engine = engine_for(setup)
    return engine.host(cfg, setup, engine.peak_rank(cfg, setup, stage))


def resident(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first",
             rank: int | None = None) -> dict[str, int]:
    """Bytes one device keeps between optimizer steps, by line: weights, optimizer states, the
    gradients the engine keeps (DDP's buckets, Megatron-LM's main-gradient buffer) and its
    buffers (`Engine.resident`). On `rank`, else the most loaded rank of `stage`
    (`peak_rank`). LoRA: the frozen base, the adapters and their optimizer states, and the
    engine's buffers (`Engine.finetune_resident`)."""
    engine = engine_for(setup)
    if setup.lora_rank:
        return engine.finetune_resident(cfg, setup)
    rank = engine.peak_rank(cfg, setup, stage) if rank is None else rank
    return engine.resident(cfg, setup, rank)


def rank_training_flops(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                        rank: int = 0, flash_backward: bool = False) -> int:
    """Matmul FLOPs rank `rank` executes in one training step (forward + backward), as
    FlopCounterMode counts them on its local shards.

    Blocks: `count_flops`' per-sequence total less the lm_head, times the micro-batch, divided
    by tp (heads and d_ff are split evenly), times the share of the L blocks the rank's
    pipeline stage holds (`schedules.stage_layers`), times the micro-batches a pipeline step
    runs (`schedules.micro_batches`; 1 without pipelining). lm_head: on the last stage, its
    share of the vocabulary rows as torch.chunk splits them (V/tp need not be whole)."""
    from ...flops import count_flops

    fc = count_flops(cfg, workload, recompute=setup.recompute, flash_backward=flash_backward)
    head = sum(part.get("lm_head", 0) for part in (fc.forward, fc.backward, fc.recompute))
    blocks = fc.hardware_total - head
    pp_rank, _, tp_rank = coords(rank, setup)
    micro = micro_batches(workload, setup) if setup.pp > 1 else 1
    b = workload.batch_size * micro
    total = b * blocks * stage_layers(cfg, setup, pp_rank) // (setup.tp * cfg.n_layer)
    if pp_rank == setup.pp - 1:
        V = cfg.vocab_size
        total += b * head * chunk_rows(V, setup.tp, tp_rank) // V
    return total


__all__ = ["Engine", "RankStates", "Step", "adjust", "chunk_rows", "default_engine", "describe",
           "engine_for", "engine_named", "generation", "host", "names", "peak_rank", "rank_states",
           "rank_training_flops", "register", "resident", "state_bytes", "unregister"]
