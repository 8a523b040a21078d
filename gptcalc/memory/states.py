"""Model states per device: weights, gradients and optimizer states, exact.

Sharding: tensor parallel and pipeline parallel split the parameter inventory
(`gptcalc.inventory`), then ZeRO splits what one device keeps across the data-parallel replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable

from ..config import GPTConfig
from ..training_setup import TrainingSetup
from ..inventory import ParamTensor, inventory, tied_head_weight
from ..optimizers import Optimizer, optimizer_named
# the optimizers' constants and per-tensor formulas, read here beside the states they make
from ..optimizers.adafactor import adafactor_state_bytes
from ..optimizers.adamw import STEP_COUNTER_BYTES
from ..optimizers.bnb import (BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, BNB_QMAP_BYTES,
                              bnb_8bit_state_bytes)
from ..schedules import Stage, holds_embedding, holds_head, stage_layers

STAGES = ("first", "last")


def optimizer_of(setup: TrainingSetup) -> Optimizer:
    """The set-up's optimizer (`gptcalc.optimizers`)."""
    return optimizer_named(setup.optimizer)


def partnered_optimizer_bytes(setup: TrainingSetup, tensors: list[ParamTensor], tp: int = 1
                              ) -> dict[str, int]:
    """Optimizer bytes over `tensors` (tp-sharded) of an optimizer that steps only some of
    them (`Optimizer.applies_to`: Muon's block matrices) beside its partner, which steps the
    rest (Muon's AdamW): "states", each one's states per element, and "step", the 0-d tensors
    each keeps per tensor it updates."""
    own = optimizer_of(setup)
    partner = optimizer_named(own.partner) if own.partner else own
    states = steps = 0
    for t in tensors:
        opt = own if own.applies_to(t) else partner
        states += opt.per_param_bytes(setup.mode) * t.shard(tp) * t.count
        steps += opt.step_counter_bytes * t.count
    return {"states": states, "step": steps}


def optimizer_bytes_per_param(setup: TrainingSetup, mode: str | None = None) -> int:
    """Optimizer state per parameter (the ZeRO paper's K in mixed mode) of an optimizer whose
    states are elementwise, in `mode` (the set-up's unless given); the shaped ones have none
    (`tensor_optimizer_bytes`)."""
    return optimizer_of(setup).per_param_bytes(mode or setup.mode)


def tensor_optimizer_bytes(setup: TrainingSetup, shape: tuple[int, ...],
                           mode: str | None = None) -> int:
    """Optimizer bytes of one parameter tensor of `shape`, as the optimizer sees it, in
    `mode` (the set-up's unless given): `Optimizer.tensor_state_bytes` (an elementwise
    optimizer's bytes per element x elements, mode mixed's fp32 master copy included;
    bitsandbytes' 8-bit AdamW and Adafactor by the tensor's size and shape). Per-tensor
    scalars (`step_counter_bytes`) and the optimizer's own tensors (`optimizer_fixed_bytes`)
    are apart."""
    return optimizer_of(setup).tensor_state_bytes(shape, mode or setup.mode)


def step_counter_bytes(setup: TrainingSetup) -> int:
    """Bytes of the 0-d tensors the optimizer keeps per parameter tensor it updates: AdamW's
    float32 `step`, Adafactor's fp32 `RMS`; none for the others."""
    return optimizer_of(setup).step_counter_bytes


def optimizer_fixed_bytes(setup: TrainingSetup, sizes: Iterable[int]) -> int:
    """Bytes an optimizer of tensors of `sizes` elements keeps once, whatever their number:
    bitsandbytes' two quantization maps (`BNB_QMAP_BYTES`), made when a first tensor of at
    least min_8bit_size elements gets 8-bit states."""
    return optimizer_of(setup).fixed_bytes(list(sizes))


def unified_optimizer_bytes(setup: TrainingSetup, tensors: Iterable[tuple[tuple[int, ...], int]]
                            ) -> int:
    """Of the optimizer bytes of `tensors` ((shape as the optimizer sees it, count) pairs),
    those in CUDA unified memory: a paged optimizer's state buffers
    (`Optimizer.buffer_bytes`) of tensors of at least `Optimizer.paged_min_elements`
    elements, on CUDA (on CPU paged optimizers fall back to ordinary tensors). torch's
    allocator statistics do not count them: they are not in the device's peak or reserved
    bytes."""
    opt = optimizer_of(setup)
    if opt.paged_min_elements is None or setup.device != "cuda":
        return 0
    return sum(count * opt.buffer_bytes(shape, setup.mode) for shape, count in tensors
               if math.prod(shape) >= opt.paged_min_elements)


def flat_optimizer_bytes(setup: TrainingSetup, partitions: Iterable[int],
                         mode: str | None = None) -> int:
    """Optimizer bytes over flat 1-D partitions of `partitions` elements (DeepSpeed's and
    ZeRO's flat groups): each partition is one tensor to the optimizer, so Adafactor keeps a
    full (unfactored) second moment and 8-bit AdamW quantizes the partition block-wise."""
    parts = list(partitions)
    return (sum(tensor_optimizer_bytes(setup, (n,), mode) for n in parts)
            + optimizer_fixed_bytes(setup, parts))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def zero_bytes_per_param(setup: TrainingSetup, n_params: int) -> dict[str, int]:
    """Weights, gradients and optimizer bytes per device for `n_params` parameters under ZeRO.

    Rajbhandari et al. 2020, sec. 5 / Fig. 1: stage 1 (P_os) shards the optimizer states across
    the dp replicas, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights;
    everything not sharded is replicated on every replica. A shard is ceil(n/dp) elements
    (DeepSpeed pads its flat partitions to equal size); the optimizer sees it as one flat
    tensor (`flat_optimizer_bytes`).
    """
    d, z = setup.dp, setup.zero
    shard = _ceil(n_params, d)
    return {
        "weights": setup.weight_bytes * (shard if z >= 3 else n_params),
        "gradients": setup.weight_bytes * (shard if z >= 2 else n_params),
        "optimizer": flat_optimizer_bytes(setup, [shard if z >= 1 else n_params]),
    }


def stage_tensors(cfg: GPTConfig, setup: TrainingSetup, stage: Stage) -> list[ParamTensor]:
    """The parameter tensors one device of pipeline stage `stage` ("first", "last" or a
    pipeline rank) holds.

    Expert parallelism keeps n_expert / ep of each MoE block's routed experts. Each rank holds
    its chunks' blocks (`schedules.stage_layers`: L/pp, or torchtitan's split where pp x
    virtual stages do not divide L); a block kind on only some blocks (MoE, sliding) is counted
    pro rata, t.layers x blocks / L. The first rank also holds the embeddings, the last the
    final norm and the lm_head. With tied embeddings and pp > 1 the last stage keeps its own
    copy of the token embedding for the head (Megatron-LM's word-embedding copy on the last
    stage). With pp = 1 both names are the one device.
    """
    key = (cfg, setup.pp, setup.pp_virtual, setup.ep, stage)
    kept = _STAGE_TENSORS.get(key)
    if kept is None:
        if len(_STAGE_TENSORS) >= 512:
            _STAGE_TENSORS.clear()
        kept = _STAGE_TENSORS[key] = tuple(_stage_tensors(cfg, setup, stage))
    return list(kept)


# `time` and `plan` ask for one stage's list many times (each collective, each micro-batch
# tried): kept per configuration and what the list reads of the set-up (pp, its virtual
# stages, ep); the callers get their own list
_STAGE_TENSORS: dict[tuple, tuple[ParamTensor, ...]] = {}


def _stage_tensors(cfg: GPTConfig, setup: TrainingSetup, stage: Stage) -> list[ParamTensor]:
    p, out = setup.pp, []
    blocks, L = stage_layers(cfg, setup, stage), cfg.n_layer
    for t in inventory(cfg):
        if t.expert and setup.ep > 1:  # expert parallelism: n_expert / ep experts per rank
            t = replace(t, copies=t.copies // setup.ep)
        if t.place == "block":
            out.append(replace(t, layers=t.layers * blocks // L))
        elif p == 1 or (holds_embedding(setup, stage) if t.place == "embedding"
                        else holds_head(setup, stage)):
            out.append(t)
    tied = tied_head_weight(cfg)
    if p > 1 and holds_head(setup, stage) and tied is not None:
        out.append(tied)
    return out


def stage_params(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, dict[str, int]]:
    """Parameters one device of the first and of the last pipeline stage holds, by component,
    after tensor-parallel sharding (`ParamTensor.shard`)."""
    out: dict[str, dict[str, int]] = {}
    for stage in STAGES:
        comps: dict[str, int] = {}
        for t in stage_tensors(cfg, setup, stage):
            comps[t.component] = comps.get(t.component, 0) + t.shard(setup.tp) * t.count
        out[stage] = comps
    return out


@dataclass(frozen=True)
class StateBytes:
    """Weights, gradients and optimizer states of one device, with what each line holds."""

    stage: Stage  # "first", "last" or a pipeline rank (the same device when pp == 1)
    params: int  # parameters held by the device before ZeRO sharding
    weights: int
    gradients: int
    optimizer: int
    breakdown: dict[str, int] = field(default_factory=dict)
    # a paged optimizer's states in CUDA unified memory, outside `optimizer` and the device's
    # peak (`unified_optimizer_bytes`)
    unified: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def largest_tensor(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Elements of the largest trained parameter tensor one device holds (tp-sharded; with
    LoRA the largest adapter matrix)."""
    if setup.lora_rank:
        from ..lora import selected
        return max(setup.lora_rank * a.rank_mult * max(a.in_features, a.out_features)
                   for a in selected(cfg, setup.lora_targets))
    largest = max(t.shard(setup.tp) for s in STAGES for t in stage_tensors(cfg, setup, s))
    if setup.impl == "transformers" and cfg.moe:
        # transformers 5 stores the experts fused: one (X, 2 F, E) gate_up_proj per layer
        largest = max(largest, -(-cfg.n_expert * 2 * cfg.expert_dim * cfg.n_embd // setup.tp))
    return largest


def consecutive_pairs(sizes: Iterable[int]) -> set[tuple[int, int]]:
    """The (previous, this) element counts of consecutive tensors of `sizes`, in order; the
    first tensor's previous is 0."""
    out: set[tuple[int, int]] = set()
    prev = 0
    for n in sizes:
        out.add((prev, n))
        prev = n
    return out


def _unrolled(tensors: list[ParamTensor], size) -> list[int]:
    """The sizes of `tensors` (one block's, or the embeddings' or the head's) in the order a
    module registers them: the entries of one module (a weight and its bias) that a block holds
    `copies` of (per-head modules, routed experts) come module by module, weight, bias, weight,
    bias; two copies give every pair more would."""
    out: list[int] = []
    i = 0
    while i < len(tensors):
        module, copies = tensors[i].name.rsplit(".", 1)[0], tensors[i].copies
        j = i
        while (j < len(tensors) and tensors[j].copies == copies
               and tensors[j].name.rsplit(".", 1)[0] == module):
            j += 1
        out += [size(t) for t in tensors[i:j]] * min(copies, 2)
        i = j
    return out


def step_order_pairs(cfg: GPTConfig, setup: TrainingSetup, stage: Stage,
                     size=None) -> set[tuple[int, int]]:
    """The (previous, this) element counts of the consecutive tensors an optimizer steps one
    at a time over `stage`'s trainable parameters, in the order the model registers them
    (`model.parameters()`, which `torch.optim` keeps): the embeddings, each block's tensors
    in the inventory's order (a module a block holds several copies of, module by module),
    the final norm and the head; with LoRA each adapted Linear's lora_A then lora_B (PEFT's
    order; DoRA's magnitude after them), block by block. Two or more blocks give the pairs across a block boundary (the
    last tensor of one block, the first of the next); the pairs do not grow with L. `size(t)`
    gives a tensor's elements on the device (default: its tensor-parallel shard). Blocks whose
    kinds differ (MoE on some blocks, hybrid mixers) are taken as if each held every kind."""
    if setup.lora_rank:
        from ..lora import selected

        sizes: list[int] = []
        adapters = selected(cfg, setup.lora_targets)
        for a in adapters:
            r = setup.lora_rank * a.rank_mult
            sizes += [r * a.in_features, r * a.out_features] + [a.out_features] * setup.dora
        return consecutive_pairs(sizes * (2 if any(a.count > 1 for a in adapters) else 1))
    size = size or (lambda t: t.shard(setup.tp))
    tensors = stage_tensors(cfg, setup, stage)
    blocks = [t for t in tensors if t.place == "block"]
    twice = any(t.layers > 1 for t in blocks)
    return consecutive_pairs(_unrolled([t for t in tensors if t.place == "embedding"], size)
                             + _unrolled(blocks, size) * (2 if twice else 1)
                             + _unrolled([t for t in tensors if t.place == "head"], size))


def autocast_weight_copies(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """16-bit copies of fp32 weights that torch.autocast makes and autograd saves (mode amp).

    Under autocast a Linear casts its fp32 weight to the autocast dtype (2 bytes per element;
    autocast caches one copy per parameter per autocast region) and the matmul saves that copy
    for the input's gradient. Biases are cast too but not saved; embeddings and norms are not
    autocast. Every weight matrix is saved once: the inventory's matrices and the lm_head (its
    own or the tied V x E weight). With full or op recomputation the blocks' copies are made
    inside the checkpoint and not kept; only the lm_head's is saved. Modes fp32 and bf16 run no
    autocast; mixed runs it on 16-bit weights, which are not copied. Per device: tensor-parallel
    shards; a pipeline stage's own blocks (L/pp), the lm_head on the last stage. Keys
    `weight_copy/<component>`.
    """
    if setup.mode != "amp":
        return {}
    out: dict[str, int] = {}
    tied = tied_head_weight(cfg)
    matrices = [t for t in inventory(cfg) if t.role == "matrix"] + ([tied] if tied else [])
    for t in matrices:
        if t.place == "block" and setup.recompute in ("full", "op"):
            continue
        key = f"weight_copy/{t.component}"
        out[key] = out.get(key, 0) + 2 * t.shard(setup.tp) * t.count
    return out


__all__ = ["BNB_BLOCKSIZE", "BNB_MIN_8BIT_SIZE", "BNB_QMAP_BYTES", "STAGES", "STEP_COUNTER_BYTES",
           "StateBytes", "adafactor_state_bytes", "autocast_weight_copies",
           "bnb_8bit_state_bytes", "consecutive_pairs", "flat_optimizer_bytes", "largest_tensor",
           "optimizer_bytes_per_param", "optimizer_fixed_bytes", "optimizer_of",
           "partnered_optimizer_bytes", "stage_params", "stage_tensors", "step_order_pairs", "step_counter_bytes",
           "tensor_optimizer_bytes", "unified_optimizer_bytes", "zero_bytes_per_param"]
