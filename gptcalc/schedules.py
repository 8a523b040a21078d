"""Pipeline stages: which blocks each pipeline rank holds, and what each schedule keeps alive.

A pipeline of pp ranks with v virtual stages per rank cuts the L blocks into pp x v chunks;
rank r runs chunks r, r + pp, ... (torch.distributed.pipelining's "loop" placement,
torchtitan's `stage_ids_this_rank`). Chunk 0 also embeds, the last chunk also applies the final
norm and the head. Each schedule runs m micro-batches per step in its own order of forwards
and backwards; the saved tensors of a (chunk, micro-batch) stay alive from its forward to its
backward (zero bubble: to its weight-gradient backward). This module replays each rank's
order and finds the moment it holds the most. Torch-free, pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .config import GPTConfig
from .errors import ConfigError
from .training_setup import TrainingSetup
from .workload import Workload

Stage = str | int  # "first" (pipeline rank 0), "last" (rank pp - 1) or a pipeline rank

# the layers torchtitan counts the embedding and the final norm + head as when it balances an
# uneven split (`generate_llm_fqn_per_model_part`'s input_weight and output_weight defaults)
INPUT_WEIGHT = OUTPUT_WEIGHT = 1


def chunk_layers(n_layer: int, chunks: int) -> tuple[int, ...]:
    """Blocks of each of `chunks` consecutive model chunks (virtual stages).

    L / chunks each when chunks divides L. Otherwise torchtitan's split
    (torchtitan/distributed/pipeline_parallel.py, `generate_llm_fqn_per_model_part`): the
    embedding and the final norm + head count as one layer each, the L + 2 effective layers are
    dealt out evenly (the first (L + 2) % chunks chunks one more), and the first and last
    chunks give up one block each for the embedding and the head. Refused (ConfigError naming
    --pp) where torchtitan refuses: a chunk with fewer effective layers than those weights."""
    if chunks == 1:
        return (n_layer,)
    if n_layer % chunks == 0:
        return (n_layer // chunks,) * chunks
    effective = n_layer + INPUT_WEIGHT + OUTPUT_WEIGHT
    per, extra = divmod(effective, chunks)
    if per < max(1, INPUT_WEIGHT, OUTPUT_WEIGHT):
        raise ConfigError("pp", f"{chunks} pipeline chunks over {n_layer} layers plus the "
                                "embedding and the head leave a chunk without a block")
    out = [per + (i < extra) for i in range(chunks)]
    out[0] -= INPUT_WEIGHT
    out[-1] -= OUTPUT_WEIGHT
    return tuple(out)


def pp_rank(setup: TrainingSetup, stage: Stage) -> int:
    """The pipeline rank of `stage`: "first" 0, "last" pp - 1, else the rank itself."""
    if stage == "first":
        return 0
    if stage == "last":
        return setup.pp - 1
    return int(stage)


def holds_embedding(setup: TrainingSetup, stage: Stage) -> bool:
    """Whether the rank runs chunk 0, the embeddings."""
    return pp_rank(setup, stage) == 0


def holds_head(setup: TrainingSetup, stage: Stage) -> bool:
    """Whether the rank runs the last chunk: the final norm, the head and the loss."""
    return pp_rank(setup, stage) == setup.pp - 1


def rank_chunks(setup: TrainingSetup, stage: Stage) -> tuple[int, ...]:
    """The chunks (global virtual-stage indices) a rank runs, in local order: r, r + pp, ..."""
    r = pp_rank(setup, stage)
    return tuple(r + k * setup.pp for k in range(setup.pp_virtual))


def stage_layers(cfg: GPTConfig, setup: TrainingSetup, stage: Stage) -> int:
    """Blocks one rank of pipeline stage `stage` holds over all its chunks."""
    split = chunk_layers(cfg.n_layer, setup.pp * setup.pp_virtual)
    return sum(split[c] for c in rank_chunks(setup, stage))


def micro_batches(workload: Workload, setup: TrainingSetup) -> int:
    """Micro-batches per pipeline step: --grad-accum when above 1 (each of B sequences), else
    pp (one per stage, the fewest Schedule1F1B accepts)."""
    return workload.grad_accum if workload.grad_accum > 1 else setup.pp


def _interleaved_actions(pp: int, v: int, m: int, rank: int, zero_bubble: bool
                         ) -> list[tuple[str, int, int]]:
    """The compute order of ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble on
    `rank` (torch/distributed/pipelining/schedules.py, torch 2.13: `_get_warmup_ops`,
    `_get_1f1b_rank_ops`): micro-batches go in rounds of m // max(1, m // pp), each round
    through one local chunk; (v - 1) rounds plus 2 (zero bubble: 1) per hop from the last rank
    run as warm-up forwards, capped at m v; then each step a forward and a backward (zero
    bubble: its input-gradient half; from the rank's (rank + 1)-th such step on also the
    oldest pending weight-gradient half), then the remaining backwards. Megatron-LM's
    interleaved schedule warms up the same count when pp divides m
    (megatron/core/pipeline_parallel/schedules.py,
    `forward_backward_pipelining_with_interleaving`: (pp - rank - 1) x 2 + (v - 1) x pp)."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v
    fwd_done: dict[int, int] = {}
    bwd_done: dict[int, int] = {}
    out: list[tuple[str, int, int]] = []
    backwards: list[tuple[int, int]] = []
    weights = 0

    def forward(op: int) -> None:
        c = (op // per_round) % v
        out.append(("F", c, fwd_done.get(c, 0)))
        fwd_done[c] = fwd_done.get(c, 0) + 1

    def backward(op: int) -> None:
        nonlocal weights
        c = v - 1 - ((op - warmup) // per_round) % v
        out.append(("I" if zero_bubble else "B", c, bwd_done.get(c, 0)))
        backwards.append((c, bwd_done.get(c, 0)))
        bwd_done[c] = bwd_done.get(c, 0) + 1
        if zero_bubble and op - warmup >= rank:
            out.append(("W", *backwards[weights]))
            weights += 1

    for op in range(warmup):
        forward(op)
    for op in range(warmup, total):
        forward(op)
        backward(op)
    for op in range(total, total + warmup):
        backward(op)
    if zero_bubble:  # the weight-gradient halves still pending
        out += [("W", *b) for b in backwards[weights:]]
    return out


def rank_actions(setup: TrainingSetup, m: int, stage: Stage) -> list[tuple[str, int, int]]:
    """The compute order of one pipeline rank over a step of `m` micro-batches, as
    (kind, local chunk, micro-batch): F forward, B backward, I and W the input- and
    weight-gradient halves of a split backward.

    gpipe (ScheduleGPipe): every forward, then every backward. 1f1b (Schedule1F1B): min(m, pp -
    rank) warm-up forwards, then a backward and a forward in turn, then the remaining
    backwards (torch/distributed/pipelining/schedules.py, torch 2.13,
    `Schedule1F1B._step_microbatches`). interleaved-1f1b and zero-bubble:
    `_interleaved_actions`."""
    r, pp = pp_rank(setup, stage), setup.pp
    schedule = setup.pp_schedule
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, pp - r)
        out = [("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            out += [("B", 0, i), ("F", 0, warmup + i)]
        return out + [("B", 0, i) for i in range(m - warmup, m)]
    return _interleaved_actions(pp, setup.pp_virtual, m, r, schedule == "zero-bubble")


@dataclass(frozen=True)
class StageHold:
    """What one pipeline rank holds at the moment of its schedule with the most saved
    tensors: `held_layers` block-micro-batches (the blocks of each alive (chunk, micro-batch)
    summed), `held_embedding` and `held_head` alive micro-batches of the chunk that embeds and
    of the chunk that ends in the head (0 on ranks without them); `backward_done`: a backward
    has already run on the rank, so the stage's gradients exist then."""

    rank: int
    layers: int  # blocks the rank holds
    micro_batches: int
    held_layers: int
    held_embedding: int
    held_head: int
    backward_done: bool
    alive: tuple[int, ...] = ()  # micro-batches alive then, per local chunk
    backwards: tuple[int, ...] = ()  # backwards (B or I) run by then, per local chunk


def stage_hold(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
               ) -> StageHold:
    """Replay `rank_actions` and keep the moment after a forward with the most blocks alive
    (ties: the later one, when gradients exist). A (chunk, micro-batch)'s saved tensors are
    freed by its backward (B), under zero bubble by its weight-gradient half (W): torch's
    `stage_backward_input` computes the input gradients with retain_graph=True, so the graph
    and what it saved stay until `stage_backward_weight` (torch/distributed/pipelining/
    _backward.py, torch 2.13). Without pipelining: one micro-batch of every block."""
    if setup.pp == 1:
        return StageHold(0, cfg.n_layer, 1, cfg.n_layer, 1, 1, workload.grad_accum > 1, (1,),
                         (0,))
    return _replayed_hold(cfg, workload, setup, stage)


@dataclass(frozen=True)
class _Schedule:
    """What a replay reads of a set-up: the stages, the schedule and its chunks per stage."""

    pp: int
    pp_schedule: str
    pp_virtual: int


def _replayed_hold(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
                   ) -> StageHold:
    """`stage_hold` under pipelining, replayed once per (blocks, schedule, micro-batches,
    rank): nothing else of the model, the workload or the set-up changes it."""
    return _hold(cfg.n_layer, _Schedule(setup.pp, setup.pp_schedule, setup.pp_virtual),
                 micro_batches(workload, setup), pp_rank(setup, stage))


@lru_cache(maxsize=8192)  # every term of a stage's peak asks; the replay is O(m v) actions
def _hold(n_layer: int, setup: _Schedule, m: int, r: int) -> StageHold:
    """`_replayed_hold`: the blocks alive kept as a running sum over the replayed actions."""
    chunks = rank_chunks(setup, r)
    split = chunk_layers(n_layer, setup.pp * setup.pp_virtual)
    last = setup.pp * setup.pp_virtual - 1
    alive: set[tuple[int, int]] = set()
    per = [0] * len(chunks)  # micro-batches alive, per local chunk
    backwards = [0] * len(chunks)
    held, done, best, best_key = 0, False, None, None
    for kind, c, mb in rank_actions(setup, m, r):
        if kind == "F":
            if (c, mb) not in alive:
                alive.add((c, mb))
                held += split[chunks[c]]
                per[c] += 1
            key = (held, done)
            if best_key is None or key >= best_key:
                emb = per[0] if chunks[0] == 0 else 0
                head = per[-1] if chunks[-1] == last else 0
                best, best_key = (held, emb, head, done, tuple(per), tuple(backwards)), key
        else:
            if kind in ("B", "I"):
                backwards[c] += 1
            if kind in ("B", "W") and (c, mb) in alive:
                alive.discard((c, mb))
                held -= split[chunks[c]]
                per[c] -= 1
            done = True
    assert best is not None
    held, emb, head, done, per_chunk, bwd = best
    return StageHold(r, sum(split[c] for c in chunks), m, held, emb, head, done, per_chunk,
                     bwd)


# Each rank's order of forwards and backwards is replayed (`rank_actions`), for every rank:
# the cost grows as ranks x micro-batches. Published runs use at most tens of stages and a few
# thousand micro-batches; these bounds keep a command within seconds.
MAX_CHUNKS = 512
MAX_MICRO_BATCHES = 16_384


def check_pipeline(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> None:
    """The set-ups the schedules run: the interleaved schedules need m a multiple of their
    rounds, max(1, m // pp); every chunk needs a block (`chunk_layers`). 1F1B with fewer
    micro-batches than stages is counted as Megatron-LM runs it (each stage warms up with
    min(m, pp - rank) forwards); torch's Schedule1F1B refuses it."""
    if setup.pp == 1:
        if setup.pp_virtual > 1:
            raise ConfigError("pp_virtual", "virtual stages need pipeline stages: give --pp")
        return
    if setup.pp * setup.pp_virtual > MAX_CHUNKS:
        raise ConfigError("pp", f"at most {MAX_CHUNKS:,} pipeline stages (pp x virtual "
                                f"stages) are modelled: the schedules are replayed per rank")
    m = micro_batches(workload, setup)
    if m > MAX_MICRO_BATCHES:
        raise ConfigError("grad_accum", f"at most {MAX_MICRO_BATCHES:,} micro-batches per "
                                        f"pipeline step are modelled: each is replayed")
    rounds = max(1, m // setup.pp)
    if setup.pp_schedule in ("interleaved-1f1b", "zero-bubble") and m % rounds:
        raise ConfigError("grad_accum", f"the interleaved schedules need the micro-batches "
                                        f"({m}) to be a multiple of their rounds ({rounds})")
    chunk_layers(cfg.n_layer, setup.pp * setup.pp_virtual)


__all__ = ["INPUT_WEIGHT", "MAX_CHUNKS", "MAX_MICRO_BATCHES", "OUTPUT_WEIGHT", "Stage",
           "StageHold", "check_pipeline",
           "chunk_layers", "holds_embedding", "holds_head", "micro_batches", "pp_rank",
           "rank_actions", "rank_chunks", "stage_hold", "stage_layers"]
