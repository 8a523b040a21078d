"""What PyTorch's own distributed engines hold per rank, the way each does it.

The ZeRO stages of `states.zero_bytes_per_param` are the paper's accounting. PyTorch's engines
shard differently, and per rank:

- FSDP2 (`torch.distributed.fsdp.fully_shard`, ZeRO-3; ZeRO-2 with
  `reshard_after_forward=False`) shards every parameter tensor on dim 0 across the dp ranks, as
  `torch.chunk` does: each rank owns ceil(rows / dp) rows (the last ranks fewer, possibly none).
  Its sharded parameter and gradient storages are padded to ceil(rows / dp) rows on every rank;
  AdamW's states are made by `zeros_like` of the rank's own (unpadded) rows.
- DTensor tensor parallel (`distribute_tensor` with Shard(0) / Shard(1)): the same chunking of
  the split dim over the tp ranks; the scattered parameter keeps the padded receive buffer as its
  storage, its gradient and AdamW's states hold the rank's own rows.
- `DistributedDataParallel` (ZeRO 0, dp > 1) replicates every state and, with its default
  gradient_as_bucket_view=False, holds its flat gradient buckets beside `.grad`.
- `ZeroRedundancyOptimizer` (ZeRO-1) assigns whole parameter tensors to ranks greedily by size
  (`zero1_partition`): optimizer states of a rank are those of its tensors; weights and gradients
  are replicated.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..config import GPTConfig, TrainingSetup, Workload
from ..inventory import ParamTensor
from .states import STEP_COUNTER_BYTES, optimizer_bytes_per_param, stage_tensors


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


def _rows_times_rest(shape: tuple[int, ...], rows: int) -> int:
    return rows * math.prod(shape[1:])


@dataclass(frozen=True)
class RankStates:
    """Weights, gradients and optimizer states one rank holds after a step, in bytes, with the
    rule that gave them."""

    weights: int
    gradients: int
    optimizer: int  # AdamW's step counters included
    steps: int  # of which AdamW's 4-byte step counters
    rule: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def _tp_coords(rank: int, setup: TrainingSetup) -> tuple[int, int, int]:
    """(pp, dp, tp) coordinates of `rank`, tp fastest."""
    return rank // (setup.dp * setup.tp), rank // setup.tp % setup.dp, rank % setup.tp


def _stage(setup: TrainingSetup, pp_rank: int) -> str:
    return "last" if setup.pp > 1 and pp_rank == setup.pp - 1 else "first"


def _stage_list(cfg: GPTConfig, setup: TrainingSetup, pp_rank: int) -> list[ParamTensor]:
    """The tensors of pipeline rank `pp_rank` (middle stages: blocks only)."""
    tensors = stage_tensors(cfg, setup, _stage(setup, pp_rank))
    if 0 < pp_rank < setup.pp - 1:
        tensors = [t for t in tensors if t.place == "block"]
    return tensors


def fsdp2_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """FSDP2's states on `rank`: every tensor (tensor-parallel shard first) split on dim 0 over
    dp; weights and gradients in padded ceil(rows / dp) storages, optimizer states over the
    rank's own rows, plus AdamW's 4-byte step per tensor. ZeRO-2 as FSDP2 runs it holds the same
    at rest (its parameters are resharded after backward)."""
    pp_rank, dp_rank, tp_rank = _tp_coords(rank, setup)
    wb, k = setup.weight_bytes, optimizer_bytes_per_param(setup)
    padded = own = tensors = 0
    for t in _stage_list(cfg, setup, pp_rank):
        shape = tp_local_shape(t, setup.tp, tp_rank)
        padded += t.count * _rows_times_rest(shape, padded_rows(shape[0], setup.dp))
        own += t.count * _rows_times_rest(shape, chunk_rows(shape[0], setup.dp, dp_rank))
        tensors += t.count
    steps = STEP_COUNTER_BYTES * tensors if setup.optimizer == "adamw" else 0
    return RankStates(wb * padded, wb * padded, k * own + steps, steps,
                      "FSDP2: dim-0 shards padded to ceil(rows/dp); optimizer over own rows")


def tp_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """DTensor tensor parallel (and pipeline stages) without data parallel sharding: weights in
    the padded receive buffers, gradients and optimizer states over the rank's own rows."""
    pp_rank, _, tp_rank = _tp_coords(rank, setup)
    wb, k = setup.weight_bytes, optimizer_bytes_per_param(setup)
    padded = own = tensors = 0
    for t in _stage_list(cfg, setup, pp_rank):
        padded += t.count * math.prod(tp_local_shape(t, setup.tp, tp_rank, padded=True))
        own += t.count * math.prod(tp_local_shape(t, setup.tp, tp_rank))
        tensors += t.count
    steps = STEP_COUNTER_BYTES * tensors if setup.optimizer == "adamw" else 0
    return RankStates(wb * padded, wb * own, k * own + steps, steps,
                      "DTensor: scattered shards keep ceil(n/tp) storage; gradients and "
                      "optimizer over own rows")


def zero1_partition(sizes: tuple[int, ...], world: int) -> tuple[tuple[int, ...], ...]:
    """ZeroRedundancyOptimizer's assignment of whole tensors to ranks (torch.distributed.optim,
    `_partition_parameters`): tensors sorted by size, largest first (a stable sort), each to the
    rank with the fewest elements so far (the lowest such rank on a tie). Returns the indices
    into `sizes` each rank owns. Greedy, not 1/N: ranks are uneven."""
    loads = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        r = loads.index(min(loads))
        owned[r].append(i)
        loads[r] += sizes[i]
    return tuple(tuple(o) for o in owned)


@functools.lru_cache(maxsize=64)
def _zero1_sizes(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first"
                 ) -> tuple[int, ...]:
    sizes: list[int] = []
    for t in stage_tensors(cfg, setup, stage):
        sizes += [t.shard(setup.tp)] * t.count
    return tuple(sizes)


def zero1_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """ZeroRedundancyOptimizer on `rank`: every weight and gradient (replicated), the optimizer
    states (and AdamW's step counters) of the tensors `zero1_partition` gives it."""
    pp_rank, dp_rank, _ = _tp_coords(rank, setup)
    sizes = _zero1_sizes(cfg, setup, _stage(setup, pp_rank))
    mine = zero1_partition(sizes, setup.dp)[dp_rank]
    n, wb = sum(sizes), setup.weight_bytes
    steps = STEP_COUNTER_BYTES * len(mine) if setup.optimizer == "adamw" else 0
    opt = optimizer_bytes_per_param(setup) * sum(sizes[i] for i in mine) + steps
    return RankStates(wb * n, wb * n, opt, steps,
                      "ZeroRedundancyOptimizer: whole tensors assigned greedily by size")


def zero1_most_loaded(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first") -> int:
    """The data-parallel rank holding the most optimizer elements under `zero1_partition`."""
    sizes = _zero1_sizes(cfg, setup, stage)
    loads = [sum(sizes[i] for i in o) for o in zero1_partition(sizes, setup.dp)]
    return loads.index(max(loads))


def rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """The states of `rank` under the engine PyTorch runs the layout with: FSDP2 for ZeRO-2/3,
    ZeroRedundancyOptimizer for ZeRO-1 (dp > 1), DTensor otherwise (DistributedDataParallel
    replicates every state: its gradient buckets are a peak term, `ddp_gradient_buckets`)."""
    if setup.dp > 1 and setup.zero >= 2:
        return fsdp2_rank_states(cfg, setup, rank)
    if setup.dp > 1 and setup.zero == 1:
        return zero1_rank_states(cfg, setup, rank)
    return tp_rank_states(cfg, setup, rank)


__all__ = ["RankStates", "chunk_rows", "ddp_gradient_buckets", "ddp_phase_terms",
           "fsdp2_rank_states", "padded_rows", "rank_states",
           "fsdp2_phase_terms", "fsdp2_unsharded", "pipeline_phase_terms", "rank_training_flops",
           "tp_local_shape", "tp_rank_states", "zero1_most_loaded", "zero1_partition",
           "zero1_rank_states"]


def rank_training_flops(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                        rank: int = 0, flash_backward: bool = False) -> int:
    """Matmul FLOPs rank `rank` executes in one training step (forward + backward), as
    FlopCounterMode counts them on its local shards.

    Blocks: `count_flops`' per-sequence total less the lm_head, times the micro-batch, divided
    by tp (heads and d_ff are split evenly) and by pp (L/pp blocks per stage), times the
    micro-batches a stage runs (pp under 1F1B, 1 otherwise). lm_head: on the last stage, its
    share of the vocabulary rows as torch.chunk splits them (V/tp need not be whole)."""
    from ..flops import count_flops

    fc = count_flops(cfg, workload, recompute=setup.recompute, flash_backward=flash_backward)
    head = sum(part.get("lm_head", 0) for part in (fc.forward, fc.backward, fc.recompute))
    blocks = fc.hardware_total - head
    pp_rank, _, tp_rank = _tp_coords(rank, setup)
    micro = setup.pp if setup.pp > 1 else 1
    b = workload.batch_size * micro
    total = b * blocks // (setup.tp * setup.pp)
    if pp_rank == setup.pp - 1:
        V = cfg.vocab_size
        total += b * head * chunk_rows(V, setup.tp, tp_rank) // V
    return total


def _padded_elements(t: ParamTensor, setup: TrainingSetup) -> int:
    """Elements of one tensor of `t` unsharded by FSDP2: the tp shard (rank 0's), dim 0 padded
    to a multiple of dp (the all-gather output is padded)."""
    shape = tp_local_shape(t, setup.tp, 0)
    return _rows_times_rest(shape, padded_rows(shape[0], setup.dp) * setup.dp)


def fsdp2_unsharded(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first"
                    ) -> dict[str, int]:
    """Bytes of the parameters FSDP2 all-gathers, per group: `root` (everything outside the
    blocks: embeddings, final norm, head; `fully_shard` at the root groups them) and `block`
    (one transformer block, each wrapped on its own), unsharded and padded."""
    wb = setup.weight_bytes
    root = block = 0
    for t in stage_tensors(cfg, setup, stage):
        n = _padded_elements(t, setup) * t.copies
        if t.place == "block":
            block += n * t.layers // max(1, cfg.n_layer // setup.pp)
        else:
            root += n
    return {"root": wb * root, "block": wb * block}


ROOT_REGATHER = "backward start, root all-gather"  # a phase of FSDP2 ZeRO-3 only


def fsdp2_phase_terms(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first"
                      ) -> dict[str, dict[str, int]]:
    """What FSDP2 holds beyond the sharded states at each phase of the step peak
    (torch.distributed.fsdp.fully_shard on every block and at the root; measured with
    FSDPMemTracker on CPU/gloo, torch 2.13):

    - the root's parameters are all-gathered before the forward and stay unsharded through
      it (ZeRO-2: until the end of backward);
    - ZeRO-3 (reshard_after_forward=True): a block is unsharded while it computes and freed
      after its forward; in backward the block being computed is unsharded and the next one's
      all-gather output (backward prefetch) is alive beside it;
    - ZeRO-2 (reshard_after_forward=False): every block stays unsharded from its forward to its
      backward;
    - FSDP2 keeps each forward all-gather's output until the next all-gather is issued: the
      last block's is still alive when the loss is computed inside the root's forward, and
      freed by the root's post-forward (measured: FSDPMemTracker's root BEF_POST_FW);
    - ZeRO-3: the root's pre-backward hook prefetches the last block: its all-gather output is
      alive while the loss's backward makes the logits' gradient;
    - ZeRO-3: the root is resharded after its forward too (FSDP2 reshards it when the root is
      given reshard_after_forward=True), so its pre-backward hook all-gathers it again before
      the loss's backward runs: the all-gather output and the unsharded parameters copied out
      of it are alive together beside every saved activation and the logits (phase "backward
      start, root all-gather"; measured: the whole 2 V E of an untied Llama-3-8B's embedding
      and head, 4.2 GB at dp 8, with no loss gradient yet);
    - at the end of backward, as the root's post-backward hook starts: its unsharded parameters
      and gradients, the blocks' sharded gradients (the root's shards are its reduce-scatter's
      output, not made yet) and the first block's reduce-scatter input, which FSDP2 keeps
      until the next reduce-scatter is issued (measured: FSDPMemTracker's root BEF_POST_BW).
    Empty unless dp > 1 and ZeRO >= 2."""
    if setup.dp == 1 or setup.zero < 2:
        return {}
    u = fsdp2_unsharded(cfg, setup, stage)
    root, block = u["root"], u["block"]
    blocks = cfg.n_layer // setup.pp
    held = blocks * block if setup.zero == 2 else 0
    last = {"FSDP2 unsharded root parameters": root,
            "FSDP2 unsharded block (computing)": block if setup.zero == 3 else 0,
            "FSDP2 all-gather of the next block (prefetch)": block if setup.zero == 3 else 0,
            "FSDP2 unsharded blocks (ZeRO-2 keeps them)": held}
    fwd = {"FSDP2 unsharded root parameters": root,
           "FSDP2 unsharded blocks (ZeRO-2 keeps them)": held}
    kept = {"FSDP2 all-gather output of the last block (kept to the root's post-forward)": block}
    # the blocks' sharded gradients: the root's shards are its reduce-scatter's output
    rank = 0 if stage == "first" else (setup.pp - 1) * setup.dp * setup.tp
    blocks_grads = fsdp2_rank_states(cfg, setup, rank).gradients - root // setup.dp
    prefetch = {"FSDP2 all-gather of the last block (the root's pre-backward prefetch)":
                block if setup.zero == 3 else 0}
    terms = {"forward end": {**fwd, **kept}, "backward start": {**fwd, **prefetch},
             "backward, last block": last,
             "backward end": {"FSDP2 unsharded root parameters": root,
                              "FSDP2 unsharded root gradients (before its reduce-scatter)": root,
                              "gradients": blocks_grads,
                              "FSDP2 reduce-scatter input of the first block (kept until the "
                              "next reduce-scatter)": block},
             "optimizer step": {}}
    if setup.zero == 3:
        terms[ROOT_REGATHER] = {"FSDP2 unsharded root parameters": root,
                                "FSDP2 root all-gather output (re-gathered for backward)": root}
    return terms


def ddp_gradient_buckets(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Bytes of DistributedDataParallel's gradient buckets on one rank: the reducer allocates
    flat bucket buffers for every parameter that requires a gradient at construction
    (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb 25, the first bucket 1 MB) and,
    with PyTorch's default gradient_as_bucket_view=False, `.grad` stays a tensor of its own:
    the buffers are a second copy of the gradients, alive for the whole step. Each bucket
    packs its parameters' elements without padding (measured on CPU/gloo, torch 2.13), so the
    buffers total the rank's gradient bytes. Zero unless dp > 1 and ZeRO 0."""
    if setup.dp == 1 or setup.zero != 0:
        return 0
    return tp_rank_states(cfg, setup).gradients


def ddp_phase_terms(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, dict[str, int]]:
    """DDP's gradient buckets (`ddp_gradient_buckets`) in every phase of the step. Empty unless
    dp > 1 and ZeRO 0."""
    buckets = ddp_gradient_buckets(cfg, setup)
    if not buckets:
        return {}
    name = "DDP gradient buckets (a second copy of the gradients)"
    return {phase: {name: buckets} for phase in ("forward end", "backward start",
                                                "backward, last block", "backward end",
                                                "optimizer step")}


def pipeline_phase_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                         stage: str, logits: int, gradients: int) -> dict[str, dict[str, int]]:
    """What torch.distributed.pipelining's Schedule1F1B (pp micro-batches) holds on the last
    stage beyond one micro-batch's tensors (measured with MemTracker on CPU/gloo, torch 2.13):

    - the schedule keeps every micro-batch's output (the logits) to return them merged at the
      end of the step: pp - 1 earlier micro-batches' logits beside the current one;
    - the last stage runs each micro-batch's backward right after its forward, so from the
      second micro-batch on the stage's gradients of the earlier ones are alive (the first
      stage runs all pp forwards before its first backward: it holds none at its peak).
    Empty unless pp > 1."""
    if setup.pp == 1 or stage != "last":
        return {}
    kept = {"pipeline: earlier micro-batches' logits (kept for the merged output)":
            (setup.pp - 1) * logits}
    grads = {"gradients (accumulating over micro-batches)": gradients}
    return {"forward end": {**kept, **grads}, "backward start": {**kept, **grads},
            "backward, last block": {**kept, "gradients": gradients},
            "backward end": kept, "optimizer step": {}}
