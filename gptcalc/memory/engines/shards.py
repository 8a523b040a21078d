"""What every engine shares: how a tensor splits over ranks, a rank's place in the layout, and
the states of one rank.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...config import GPTConfig
from ...errors import ConfigError
from ...training_setup import TrainingSetup
from ...inventory import ParamTensor
from ...schedules import Stage
from ...schedules import pp_rank as schedule_rank
from ..states import (optimizer_fixed_bytes, optimizer_of, partnered_optimizer_bytes,
                      stage_tensors, step_counter_bytes, tensor_optimizer_bytes,
                      unified_optimizer_bytes)


def chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows rank `rank` of `world` owns when `rows` are split as torch.chunk splits them
    (FSDP2's dim-0 shards, DTensor's Shard(d)): ceil(rows / world) each, the remainder on the
    last owner, nothing after it."""
    step = -(-rows // world)
    return max(0, min(step, rows - rank * step))


def padded_rows(rows: int, world: int) -> int:
    """Rows of a padded shard: ceil(rows / world) (FSDP2 pads dim 0 to a multiple of world)."""
    return -(-rows // world)


def tp_local_shape(t: ParamTensor, tp: int, rank: int, padded: bool = False
                   ) -> tuple[int, ...]:
    """The shape of one tensor of `t` on tensor-parallel rank `rank` (Megatron's splits as
    DTensor makes them): column and vocab split dim 0, a row-parallel matrix dim 1 (its bias is
    replicated), replicated tensors whole. `padded`: the ceil(n / tp) receive buffer a scattered
    shard keeps as its storage."""
    if tp == 1 or t.split == "replicated" or (t.split == "row" and len(t.shape) == 1):
        return t.shape
    dim = 1 if t.split == "row" else 0
    n = t.shape[dim]
    part = padded_rows(n, tp) if padded else chunk_rows(n, tp, rank)
    return t.shape[:dim] + (part,) + t.shape[dim + 1:]


def rows_times_rest(shape: tuple[int, ...], rows: int) -> int:
    """Elements of `shape` with dim 0 replaced by `rows`."""
    return rows * math.prod(shape[1:])


@dataclass(frozen=True)
class RankStates:
    """Weights, gradients and optimizer states one rank holds in a step, in bytes, with the
    rule that gave them."""

    weights: int
    gradients: int
    optimizer: int  # AdamW's step counters included
    steps: int  # of which AdamW's 4-byte step counters
    rule: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def coords(rank: int, setup: TrainingSetup) -> tuple[int, int, int]:
    """(pp, dp, tp) coordinates of `rank`, tp fastest."""
    return rank // (setup.dp * setup.tp), rank // setup.tp % setup.dp, rank % setup.tp


def stage_of(setup: TrainingSetup, pp_rank: int) -> Stage:
    """The pipeline stage of `pp_rank`: "first" (rank 0), "last" (pp - 1) or the rank."""
    if setup.pp > 1 and pp_rank == setup.pp - 1:
        return "last"
    return "first" if pp_rank == 0 else pp_rank


def first_rank(setup: TrainingSetup, stage: Stage) -> int:
    """The lowest global rank of pipeline stage `stage`."""
    return schedule_rank(setup, stage) * setup.dp * setup.tp


def stage_list(cfg: GPTConfig, setup: TrainingSetup, pp_rank: int) -> list[ParamTensor]:
    """The tensors of pipeline rank `pp_rank` (middle stages: blocks only)."""
    return stage_tensors(cfg, setup, stage_of(setup, pp_rank))


def step_counters(setup: TrainingSetup, tensors: int) -> int:
    """Bytes of the optimizer's 0-d tensors over `tensors` parameter tensors it updates
    (`states.step_counter_bytes`: torch.optim.AdamW's float32 `step`, Adafactor's `RMS`)."""
    return step_counter_bytes(setup) * tensors


def optimizer_over(setup: TrainingSetup, tensors: list[tuple[tuple[int, ...], int]],
                   mode: str | None = None) -> int:
    """Optimizer bytes (scalars apart) of `tensors`, (shape as the optimizer sees it, count)
    pairs: each tensor's states (`states.tensor_optimizer_bytes`) and the optimizer's own
    (`states.optimizer_fixed_bytes`)."""
    sizes = [math.prod(shape) for shape, count in tensors if count]
    return (sum(count * tensor_optimizer_bytes(setup, shape, mode) for shape, count in tensors)
            + optimizer_fixed_bytes(setup, sizes))


def tp_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """DTensor tensor parallel (and pipeline stages) without data parallel sharding: weights in
    the padded receive buffers, gradients and optimizer states over the rank's own rows."""
    pp_rank, _, tp_rank = coords(rank, setup)
    wb = setup.weight_bytes
    padded = own = tensors = 0
    shapes = []
    for t in stage_list(cfg, setup, pp_rank):
        padded += t.count * math.prod(tp_local_shape(t, setup.tp, tp_rank, padded=True))
        shapes.append((tp_local_shape(t, setup.tp, tp_rank), t.count))
        own += t.count * math.prod(shapes[-1][0])
        tensors += t.count
    steps = step_counters(setup, tensors)
    if optimizer_of(setup).partner:  # by each tensor's role (tp 1: whole tensors)
        split = partnered_optimizer_bytes(setup, stage_list(cfg, setup, pp_rank), setup.tp)
        opt, steps = split["states"], split["step"]
    else:  # a paged optimizer's states in unified memory are not the device's
        opt = optimizer_over(setup, shapes) - unified_optimizer_bytes(setup, shapes)
    return RankStates(wb * padded, wb * own, opt + steps, steps,
                      "DTensor: scattered shards keep ceil(n/tp) storage; gradients and "
                      "optimizer over own rows")


__all__ = ["RankStates", "chunk_rows", "coords", "first_rank", "optimizer_over", "padded_rows",
           "rows_times_rest", "stage_list", "stage_of", "step_counters", "tp_local_shape",
           "tp_rank_states"]


# The most parameter tensors a partition that places each tensor counts (DeepSpeed's
# buckets, ZeroRedundancyOptimizer's greedy assignment): far past any real model's thousands.
MAX_TENSORS = 10**7


def tensor_sizes(tensors, tp: int) -> list[int]:
    """Elements of every parameter tensor (each of `count` copies), in inventory order; more
    than MAX_TENSORS is ConfigError naming --n-layer (a list that long is no model's)."""
    total = sum(t.count for t in tensors)
    if total > MAX_TENSORS:
        raise ConfigError("n_layer", f"{total:,} parameter tensors: more than the {MAX_TENSORS:,} "
                                     "this engine's per-tensor partition is counted for")
    out: list[int] = []
    for t in tensors:
        out += [t.shard(tp)] * t.count
    return out
