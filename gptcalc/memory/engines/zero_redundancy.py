"""ZeroRedundancyOptimizer (`torch.distributed.optim`, ZeRO-1 as PyTorch runs it), per rank.

It assigns whole parameter tensors to ranks greedily by size (`zero1_partition`): a rank's
optimizer states are those of its tensors; weights and gradients are replicated. Ranks are
uneven, unlike DeepSpeed's flat 1/dp partitions.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

import functools
import heapq

from ...config import GPTConfig
from ...schedules import Stage
from ...training_setup import TrainingSetup
from ..states import optimizer_bytes_per_param, optimizer_of, stage_tensors
from .base import Engine, register
from .shards import (RankStates, coords, first_rank, optimizer_over, stage_of, step_counters,
                     tensor_sizes, tp_local_shape)


@functools.lru_cache(maxsize=64)
def zero1_owned(sizes: tuple[int, ...], world: int) -> dict[int, tuple[int, ...]]:
    """ZeroRedundancyOptimizer's assignment of whole tensors to ranks (torch.distributed.optim,
    `_partition_parameters`): tensors sorted by size, largest first (a stable sort), each to the
    rank with the fewest elements so far (the lowest such rank on a tie). Returns the indices
    into `sizes` of each rank that owns any; the others own nothing. Greedy, not 1/N: ranks
    are uneven. The least loaded rank comes from a heap of the ranks given a tensor so far and
    the lowest rank not given one yet (its load is 0), so the cost does not grow with world."""
    heap: list[tuple[int, int]] = []  # (load, rank) of the ranks given a tensor
    fresh = 0  # the lowest rank not given a tensor yet
    owned: dict[int, list[int]] = {}
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        if fresh < world and (not heap or (0, fresh) < heap[0]):
            load, r = 0, fresh
            fresh += 1
        else:
            load, r = heapq.heappop(heap)
        owned.setdefault(r, []).append(i)
        heapq.heappush(heap, (load + sizes[i], r))
    return {r: tuple(o) for r, o in owned.items()}


def zero1_partition(sizes: tuple[int, ...], world: int) -> tuple[tuple[int, ...], ...]:
    """`zero1_owned` for every rank of `world`, in rank order."""
    owned = zero1_owned(sizes, world)
    return tuple(owned.get(r, ()) for r in range(world))


@functools.lru_cache(maxsize=64)
def _zero1_shapes(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                  ) -> tuple[tuple[int, ...], ...]:
    """The shape of every parameter tensor of `stage` (its tensor-parallel shard), in
    inventory order."""
    shapes: list[tuple[int, ...]] = []
    for t in stage_tensors(cfg, setup, stage):
        shapes += [tp_local_shape(t, setup.tp, 0)] * t.count
    return tuple(shapes)


@functools.lru_cache(maxsize=64)
def _zero1_sizes(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                 ) -> tuple[int, ...]:
    return tuple(tensor_sizes(stage_tensors(cfg, setup, stage), setup.tp))


def zero1_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """ZeroRedundancyOptimizer on `rank`: every weight and gradient (replicated), the optimizer
    states (and the optimizer's 0-d tensors) of the tensors `zero1_partition` gives it, each
    whole to the local optimizer (`states.tensor_optimizer_bytes` of its shape)."""
    pp_rank, dp_rank, _ = coords(rank, setup)
    stage = stage_of(setup, pp_rank)
    sizes = _zero1_sizes(cfg, setup, stage)
    mine = zero1_owned(sizes, setup.dp).get(dp_rank, ())
    n, wb = sum(sizes), setup.weight_bytes
    steps = step_counters(setup, len(mine))
    if optimizer_of(setup).shaped:
        shapes = _zero1_shapes(cfg, setup, stage)
        opt = optimizer_over(setup, [(shapes[i], 1) for i in mine]) + steps
    else:
        opt = optimizer_bytes_per_param(setup) * sum(sizes[i] for i in mine) + steps
    return RankStates(wb * n, wb * n, opt, steps,
                      "ZeroRedundancyOptimizer: whole tensors assigned greedily by size")


def zero1_most_loaded(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first") -> int:
    """The data-parallel rank holding the most optimizer elements under `zero1_partition`."""
    sizes = _zero1_sizes(cfg, setup, stage)
    loads = {r: sum(sizes[i] for i in o) for r, o in zero1_owned(sizes, setup.dp).items()}
    return max(sorted(loads), key=loads.__getitem__, default=0)


def zero1_peak_rank(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first") -> int:
    """The global rank of `stage` whose states are the largest (the most loaded dp rank)."""
    return first_rank(setup, stage) + zero1_most_loaded(cfg, setup, stage) * setup.tp


def zero1_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between steps: every weight and its optimizer states
    (`zero_grad(set_to_none=True)` frees the gradients)."""
    st = zero1_rank_states(cfg, setup, rank)
    return {"weights": st.weights, "optimizer states": st.optimizer}


def zero1_lora_states(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """LoRA under ZeroRedundancyOptimizer over the adapters (the parameters that train): the
    frozen base and the adapters replicated, as on one device (`finetune.
    finetune_state_bytes` at ZeRO 0), and the optimizer states of the adapter tensors
    `zero1_owned` gives the most loaded rank, each tensor whole, with its 0-d tensors."""
    from dataclasses import replace

    from ..finetune import finetune_state_bytes
    from ...lora import selected

    lines = finetune_state_bytes(cfg, replace(setup, zero=0))
    shapes: list[tuple[int, ...]] = []
    for a in selected(cfg, setup.lora_targets):
        r = setup.lora_rank * a.rank_mult
        shapes += [(r, a.in_features), (a.out_features, r)] * a.count
    sizes = tuple(shapes[i][0] * shapes[i][1] for i in range(len(shapes)))
    owned = zero1_owned(sizes, setup.dp)
    rank = max(sorted(owned), key=lambda r: sum(sizes[i] for i in owned[r]), default=0)
    mine = owned.get(rank, ())
    opt = optimizer_over(setup, [(shapes[i], 1) for i in mine]) + step_counters(setup,
                                                                               len(mine))
    return {**lines, "adapter/optimizer": opt}


def zero1_step_pairs(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                     ) -> set[tuple[int, int]]:
    """The consecutive tensors the most loaded rank's local optimizer steps: its own tensors
    in `zero1_owned`'s order, largest first (`_partition_parameters` hands each rank its
    parameters in the sorted order, and the local optimizer keeps it); with LoRA, the
    adapters' lora_A and lora_B tensors."""
    from ..states import consecutive_pairs

    if setup.lora_rank:
        from ...lora import selected

        sizes_list: list[int] = []
        for a in selected(cfg, setup.lora_targets):
            r = setup.lora_rank * a.rank_mult
            sizes_list += [r * a.in_features, r * a.out_features] * a.count
        sizes = tuple(sizes_list)
    else:
        sizes = _zero1_sizes(cfg, setup, stage)
    owned = zero1_owned(sizes, setup.dp)
    rank = max(sorted(owned), key=lambda r: sum(sizes[i] for i in owned[r]), default=0)
    return consecutive_pairs(sizes[i] for i in owned.get(rank, ()))


class ZeroRedundancy(Engine):
    """PyTorch's ZeroRedundancyOptimizer: ZeRO-1 over whole tensors."""

    name = "zero-redundancy"
    help = "zero-redundancy (PyTorch's ZeroRedundancyOptimizer, --zero 1)"
    stages = (1,)

    def replicated(self, setup: TrainingSetup) -> bool:
        return False

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        return zero1_rank_states(cfg, setup, rank)

    def peak_rank(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage) -> int:
        return zero1_peak_rank(cfg, setup, stage)

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return zero1_resident(cfg, setup, rank)

    def finetune_states(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        return zero1_lora_states(cfg, setup)

    def optimizer_step_pairs(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                             ) -> set[tuple[int, int]]:
        return zero1_step_pairs(cfg, setup, stage)


register(ZeroRedundancy())

__all__ = ["ZeroRedundancy", "zero1_lora_states", "zero1_most_loaded", "zero1_owned", "zero1_partition", "zero1_peak_rank", "zero1_rank_states",
           "zero1_resident", "zero1_step_pairs"]
