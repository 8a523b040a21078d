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
from ..schedules import Stage, holds_embedding, holds_head, stage_layers

# Optimizer state bytes per parameter of the optimizers whose states are elementwise. fp32 and
# amp: exp_avg + exp_avg_sq in fp32 (AdamW), momentum_buffer (SGD with momentum), exp_avg (Lion,
# `zeros_like(p)`), nothing (SGD). mixed: the ZeRO paper's K (Rajbhandari et al. 2020, sec.
# 3.1): the fp32 master copy of the weights (4) belongs to the optimizer, with Adam's fp32
# momentum and variance (4 + 4) = 12. bf16: every state in bf16.
OPTIMIZER_BYTES = {
    "fp32": {"adamw": 8, "sgd-momentum": 4, "sgd": 0, "lion": 4},
    "amp": {"adamw": 8, "sgd-momentum": 4, "sgd": 0, "lion": 4},
    "mixed": {"adamw": 12, "sgd-momentum": 8, "sgd": 4, "lion": 8},
    "bf16": {"adamw": 4, "sgd-momentum": 2, "sgd": 0, "lion": 2},
}
# the optimizers whose states depend on each tensor's size or shape (`tensor_optimizer_bytes`)
SHAPED_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit", "adafactor")
BNB_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit")
# bitsandbytes/optim/optimizer.py (0.50), Optimizer2State: `min_8bit_size=4096` (smaller tensors
# keep 32-bit states), `blocksize = 256` in init_state (one fp32 absmax per block of each
# state), and the two quantization maps `name2qmap["dynamic"]` / `["udynamic"]`
# (`F.create_dynamic_map`, 256 fp32 each), made once per optimizer and shared by every tensor
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_BYTES = 2 * 256 * 4
# torch.optim.AdamW keeps state["step"] as a 0-d float32 tensor per parameter tensor;
# transformers' Adafactor keeps state["RMS"], the parameter's RMS as a 0-d fp32 tensor (its
# step is a Python int, as bitsandbytes' is); SGD and Lion keep no scalar
STEP_COUNTER_BYTES = 4
SCALAR_OPTIMIZERS = ("adamw", "adafactor")
STAGES = ("first", "last")


# Muon (Jordan et al. 2024, github.com/KellerJordan/Muon, muon.py; torch.optim.Muon, torch 2.13
# torch/optim/_muon.py): `state["momentum_buffer"] = zeros_like(p.grad)` per 2-D hidden matrix,
# no step counter, so one state in the gradient's dtype (mode mixed: beside the fp32 master
# copy). Every other parameter (embeddings, the output head, norms, biases) goes to AdamW, as
# both tell: "Muon should only be used for hidden weight layers".
MUON_BYTES = {"fp32": 4, "amp": 4, "mixed": 8, "bf16": 2}


def muon_matrix(t: ParamTensor) -> bool:
    """Whether Muon updates `t`: a 2-D weight matrix of a block; AdamW takes the rest."""
    return t.place == "block" and t.role == "matrix" and len(t.shape) == 2


def muon_optimizer_bytes(setup: TrainingSetup, tensors: list[ParamTensor], tp: int = 1
                         ) -> dict[str, int]:
    """Optimizer bytes of Muon with AdamW beside it over `tensors` (tp-sharded): "states",
    Muon's momentum (`MUON_BYTES`) and AdamW's two moments (`OPTIMIZER_BYTES`), and "step",
    AdamW's float32 step per tensor it updates."""
    adamw = replace(setup, optimizer="adamw")
    muon = sum(MUON_BYTES[setup.mode] * t.shard(tp) * t.count for t in tensors if muon_matrix(t))
    rest = [t for t in tensors if not muon_matrix(t)]
    return {"states": muon + sum(OPTIMIZER_BYTES[setup.mode]["adamw"] * t.shard(tp) * t.count
                                 for t in rest),
            "step": step_counter_bytes(adamw) * sum(t.count for t in rest)}


def optimizer_bytes_per_param(setup: TrainingSetup) -> int:
    """Optimizer state per parameter (the ZeRO paper's K in mixed mode) of an optimizer whose
    states are elementwise; the shaped ones have none (`tensor_optimizer_bytes`)."""
    if setup.optimizer in SHAPED_OPTIMIZERS:
        raise ValueError(f"{setup.optimizer}'s states depend on each tensor's shape")
    return OPTIMIZER_BYTES[setup.mode][setup.optimizer]


def bnb_8bit_state_bytes(n: int) -> int:
    """Bytes of bitsandbytes' AdamW8bit states for one tensor of `n` elements.

    bitsandbytes/optim/optimizer.py (0.50), `Optimizer2State.init_state`: a tensor with fewer
    than min_8bit_size (4096) elements keeps fp32 state1 and state2, 8 n, whatever its dtype;
    a larger one keeps uint8 state1 and state2 (2 n) and an fp32 `absmax1` and `absmax2` of
    ceil(n / 256) blocks each. The quantization maps are the optimizer's, not the tensor's
    (`optimizer_fixed_bytes`); `step` is a Python int. PagedAdamW8bit holds the same bytes:
    on CUDA its states of 10^5 elements or more are unified memory (`F.get_paged`), outside
    PyTorch's caching allocator, paged to the host only under memory pressure.
    """
    if n < BNB_MIN_8BIT_SIZE:
        return 8 * n
    return 2 * n + 2 * 4 * _ceil(n, BNB_BLOCKSIZE)


def adafactor_state_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of transformers' Adafactor states for one tensor of `shape` (its defaults:
    beta1=None, so no `exp_avg`).

    transformers/optimization.py, `Adafactor.step`: a tensor of 2 or more dims keeps a factored
    second moment, `exp_avg_sq_row` of shape[:-1] and `exp_avg_sq_col` of shape[:-2] +
    shape[-1:]; a 1-D one the full `exp_avg_sq`. The states are fp32 (made `.to(grad)` after
    16-bit gradients are upcast). Its scalars: `STEP_COUNTER_BYTES` (RMS).
    """
    if len(shape) >= 2:
        rows = math.prod(shape[:-1])
        cols = math.prod(shape[:-2]) * shape[-1]
        return 4 * (rows + cols)
    return 4 * math.prod(shape)


def tensor_optimizer_bytes(setup: TrainingSetup, shape: tuple[int, ...],
                           mode: str | None = None) -> int:
    """Optimizer bytes of one parameter tensor of `shape`, as the optimizer sees it, in
    `mode` (the set-up's unless given): the elementwise optimizers' `OPTIMIZER_BYTES` x
    elements (mode mixed's fp32 master copy included); bitsandbytes' 8-bit AdamW
    (`bnb_8bit_state_bytes`) and Adafactor (`adafactor_state_bytes`) beside mode mixed's 4-byte
    master copy per element. Per-tensor scalars (`step_counter_bytes`) and the optimizer's own
    tensors (`optimizer_fixed_bytes`) are apart."""
    mode = mode or setup.mode
    n = math.prod(shape)
    if setup.optimizer not in SHAPED_OPTIMIZERS:
        return OPTIMIZER_BYTES[mode][setup.optimizer] * n
    master = 4 * n if mode == "mixed" else 0
    if setup.optimizer in BNB_OPTIMIZERS:
        return master + bnb_8bit_state_bytes(n)
    return master + adafactor_state_bytes(shape)


def step_counter_bytes(setup: TrainingSetup) -> int:
    """Bytes of the 0-d tensors the optimizer keeps per parameter tensor it updates: AdamW's
    float32 `step`, Adafactor's fp32 `RMS`; none for the others."""
    return STEP_COUNTER_BYTES if setup.optimizer in SCALAR_OPTIMIZERS else 0


def optimizer_fixed_bytes(setup: TrainingSetup, sizes: Iterable[int]) -> int:
    """Bytes an optimizer of tensors of `sizes` elements keeps once, whatever their number:
    bitsandbytes' two quantization maps (`BNB_QMAP_BYTES`), made when a first tensor of at
    least min_8bit_size elements gets 8-bit states."""
    if setup.optimizer in BNB_OPTIMIZERS and any(n >= BNB_MIN_8BIT_SIZE for n in sizes):
        return BNB_QMAP_BYTES
    return 0


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
