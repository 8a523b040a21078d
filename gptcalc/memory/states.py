"""Model states per device: weights, gradients and optimizer states, exact.

Sharding: tensor parallel and pipeline parallel split the parameter inventory
(`gptcalc.inventory`), then ZeRO splits what one device keeps across the data-parallel replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import GPTConfig
from ..training_setup import TrainingSetup
from ..inventory import ParamTensor, inventory, tied_head_weight

# Optimizer state bytes per parameter. fp32 and amp: exp_avg + exp_avg_sq in fp32 (AdamW),
# momentum_buffer (SGD with momentum), nothing (SGD). mixed: the ZeRO paper's K (Rajbhandari et
# al. 2020, sec. 3.1): the fp32 master copy of the weights (4) belongs to the optimizer, with
# Adam's fp32 momentum and variance (4 + 4) = 12. bf16: every state in bf16.
OPTIMIZER_BYTES = {
    "fp32": {"adamw": 8, "sgd-momentum": 4, "sgd": 0},
    "amp": {"adamw": 8, "sgd-momentum": 4, "sgd": 0},
    "mixed": {"adamw": 12, "sgd-momentum": 8, "sgd": 4},
    "bf16": {"adamw": 4, "sgd-momentum": 2, "sgd": 0},
}
# torch.optim.AdamW keeps state["step"] as a 0-d float32 tensor per parameter tensor
STEP_COUNTER_BYTES = 4
STAGES = ("first", "last")


def optimizer_bytes_per_param(setup: TrainingSetup) -> int:
    """Optimizer state per parameter (the ZeRO paper's K in mixed mode)."""
    return OPTIMIZER_BYTES[setup.mode][setup.optimizer]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def zero_bytes_per_param(setup: TrainingSetup, n_params: int) -> dict[str, int]:
    """Weights, gradients and optimizer bytes per device for `n_params` parameters under ZeRO.

    Rajbhandari et al. 2020, sec. 5 / Fig. 1: stage 1 (P_os) shards the optimizer states across
    the dp replicas, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights;
    everything not sharded is replicated on every replica. A shard is ceil(n/dp) elements
    (DeepSpeed pads its flat partitions to equal size).
    """
    d, z = setup.dp, setup.zero
    shard = _ceil(n_params, d)
    return {
        "weights": setup.weight_bytes * (shard if z >= 3 else n_params),
        "gradients": setup.weight_bytes * (shard if z >= 2 else n_params),
        "optimizer": optimizer_bytes_per_param(setup) * (shard if z >= 1 else n_params),
    }


def stage_tensors(cfg: GPTConfig, setup: TrainingSetup, stage: str) -> list[ParamTensor]:
    """The parameter tensors one device of pipeline stage `stage` ("first" or "last") holds.

    Expert parallelism keeps n_expert / ep of each MoE block's routed experts. Each stage holds
    L/pp blocks; the first also the embeddings, the last the final norm and the
    lm_head. With tied embeddings and pp > 1 the last stage keeps its own copy of the token
    embedding for the head (Megatron-LM's word-embedding copy on the last stage). With pp = 1
    both names are the one device.
    """
    p, out = setup.pp, []
    for t in inventory(cfg):
        if t.expert and setup.ep > 1:  # expert parallelism: n_expert / ep experts per rank
            t = replace(t, copies=t.copies // setup.ep)
        if t.place == "block":
            out.append(replace(t, layers=t.layers // p))
        elif p == 1 or (t.place == "embedding") == (stage == "first"):
            out.append(t)
    tied = tied_head_weight(cfg)
    if p > 1 and stage == "last" and tied is not None:
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

    stage: str  # "first" or "last" pipeline stage (the same device when pp == 1)
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
