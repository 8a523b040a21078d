"""What `torch.cuda.max_memory_reserved()` reads for a training step: the step's tensors as a
sequence of allocations and frees, replayed on the caching-allocator simulator
(`gptcalc.memory.allocator`), and what nvidia-smi shows beside it.

The sequence is built from the step's account (`peak.step_account`: its ledger, engine terms
included, and its saved-tensor lines), in the order a step makes them:

- before the first step: each parameter tensor's weights (an engine's kept gradient buffers
  too); where QLoRA's base is quantised as the model loads (`load.load_events`), the load's
  allocations and frees instead, the steps continuing from the segments it reserved
  (`after_load`);
- forward: the batch and the embeddings' saved tensors (an engine's root all-gather), then
  block by block (an engine's all-gather of it) each saved line's share of one block (a line
  of the profile is one tensor per block: `layer/attn/q`, ...), the head's lines, the logits
  and the loss's fp32 copy;
- backward: the loss's gradient (two N x V tensors), the head's gradients, then block by block
  from the last: the recomputed block and the block's gradients in flight beside its saved
  tensors, which are then freed, and the block's parameter gradients; what the end of backward
  adds (the embeddings' gradients, an engine's reduced root gradients);
- activation offloading (`memory.offload`): an offloaded line is made in the forward and
  freed at once (copied to the host); the forward stash (the ledger's term, the last offloaded
  tensors) is made after the blocks and alive at the forward's end and again at backward's
  start; each block's backward holds the ledger's brought-back block beside it; the
  embeddings' offloaded inputs come back at the end of backward. The copy stream's own pool
  (torchtune brings tensors back on a second stream) is not replayed, as below;
- the optimizer step: in the first step each tensor's states (created lazily, as
  torch.optim does), in every step the update's temporaries (one per tensor, as the foreach
  path makes them), then `zero_grad(set_to_none=True)` frees the gradients.

The gradients alive at each moment are the ledger's at that moment, and so is every other
term: at each moment of a steady step the replay holds the ledger's total (`mark` events say
where; tests/test_reserved.py checks them). Gradient accumulation is two micro-batches per
step, the second running beside the first's gradients.

Two steps are replayed: the first creates the optimizer states amid the gradients, the second
reuses the cache, and the reserved bytes only grow, so their last value is the peak.

Granularity: each state total of the ledger (weights, gradients, optimizer states, the
optimizer's temporaries) is split over the parameter tensors in proportion to their elements,
one tensor per kind per block (a kind's copies, such as routed experts, as one), as per-tensor
storages (torch.optim, FSDP2's per-parameter shards); a flat buffer (DeepSpeed's partitions,
DDP's buckets) is thereby many tensors instead of one. The engine's own terms (FSDP2's
all-gathered blocks, DDP's buckets, ...) are one tensor each: a term held in every moment is
allocated before the first step, another at the moment it belongs to and freed after it (a
block's backward moment again for each block). Saved lines that stand for several tensors of
one kind in a block are one tensor. Streams: an engine whose gradients are made on a stream of
its own (`Engine.gradient_stream`: FSDP2's reduce-scatter output, of which the sharded
gradients past the head's are views) has them replayed there, in a pool the compute stream's
requests cannot reuse (`allocator.DeviceAllocator`); so are its all-gathers' buffers
(`Engine.gather_stream`, `Engine.gather_buffers`: FSDP2's copy-in stream, where each
all-gather makes the copy-in's cast of the shards and the output, the cast freed once copied):
the ledger's all-gather outputs (`Engine.gather_terms`) are made there, each after its cast
(freed before the output is made: `_Replay.gather`), and so is the root's forward all-gather, kept until the first block's output is made (the
ledger's kept output then stands for it). Each block's forward is the ledger's last-block
all-gather moment again, its unsharded parameters alive while the block saves its tensors.
Not replayed: each op's own outputs before autograd frees them, and NCCL's buffers (outside
the allocator: `nccl_buffer_bytes`).

Every block is simulated: the reserved bytes are not linear in L (a large tensor that finds a
hole at L blocks may need a new segment at L + 1), so no extrapolation from fewer blocks is
exact; the cost is linear in L.

What nvidia-smi shows beside it (`nvidia_smi_lines`): the reserved bytes, the CUDA context and,
when the set-up communicates, NCCL's buffers, which NCCL allocates outside PyTorch's allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GPTConfig
from ..training_setup import TrainingSetup
from ..workload import Workload
from .allocator import simulate
from .load import kept_bytes, load_events
from .ledger import (BLOCK_GRADIENTS, EMBEDDING_INPUTS, GRADIENTS, GRADIENTS_ACCUMULATING,
                     LOGITS, LOSS_GRADIENT, LOSS_LOGITS_COPY, OFFLOAD_STASH, OPTIMIZER_STATES,
                     OPTIMIZER_TEMPORARIES, OVERHEAD, RECOMPUTED_BLOCK, SAVED,
                     SAVED_TO_ATTENTION_CORE, ATTENTION_CORE_TRANSIENTS, STEADY_PHASES, TARGETS,
                     TIED_EMBEDDING_GRADIENT, WEIGHTS, Ledger, Phase)
from .peak import step_account
from .states import optimizer_of, stage_tensors
from .engines import engine_for
from .engines.shards import stage_of
from ..schedules import stage_layers

# the step's own terms; any other term of the ledger is the engine's
OWN_TERMS = frozenset({WEIGHTS, OPTIMIZER_STATES, OVERHEAD, SAVED, LOGITS, LOSS_LOGITS_COPY,
                       LOSS_GRADIENT, GRADIENTS, GRADIENTS_ACCUMULATING, RECOMPUTED_BLOCK,
                       BLOCK_GRADIENTS, TIED_EMBEDDING_GRADIENT, EMBEDDING_INPUTS,
                       OPTIMIZER_TEMPORARIES, TARGETS, SAVED_TO_ATTENTION_CORE,
                       ATTENTION_CORE_TRANSIENTS})
# steps replayed: the first creates the optimizer states amid the gradients, the second reuses
# the cache (tests/test_reserved.py: further steps reserve nothing more)
STEPS = 2
# The CUDA context of a PyTorch training process, outside the caching allocator: an estimate, not
# measured here. With CUDA's lazy module loading (CUDA >= 11.7; the default on Linux since 12.2,
# CUDA C++ Programming Guide, "Lazy Loading") PyTorch's maintainers put the bare context at about
# 300 MB; a training step then loads the cuBLAS, attention and NCCL kernels it uses.
CUDA_CONTEXT_BYTES = 500 << 20
# NCCL's buffers, allocated by NCCL itself (not through PyTorch's allocator): the Simple
# protocol's buffer per channel and peer, DEFAULT_BUFFSIZE = 1 << 22 (4 MiB, NCCL_BUFFSIZE) in
# NVIDIA/nccl src/init.cc; up to MAXCHANNELS = 32 channels (src/include/device.h), as NVLink rings
# on an 8-GPU H100 node open; two peers per channel in a ring (the previous and the next rank).
# The LL and LL128 protocols' smaller buffers are not counted. One communicator per parallel
# group of more than one rank (dp, tp, pp, ep).
NCCL_BUFFSIZE = 4 << 20
NCCL_CHANNELS = 32
NCCL_RING_PEERS = 2


@dataclass(frozen=True)
class _Tensors:
    """The parameter tensors of one stage by place, as element counts (`total` over all)."""

    head: tuple[int, ...]  # final norm, lm_head
    embedding: tuple[int, ...]  # token and position embeddings
    block: tuple[int, ...]  # one block's tensors, in inventory order
    blocks: int  # blocks on the stage
    total: int

    def part(self, nbytes: int, n: int) -> int:
        """A tensor of `n` elements' share of `nbytes` spread over all the stage's elements."""
        return nbytes * n // self.total


def _place(key: str) -> str:
    """Where a saved line is made and freed: its first word (`layer`, `final`, ...), LoRA's
    block adapters in each block (`lora`), the head's adapter with the head (`lora_head`)."""
    return "lora_head" if key.startswith("lora/lm_head/") else key.split("/", 1)[0]


def _tensors(cfg: GPTConfig, setup: TrainingSetup, stage: str) -> _Tensors:
    head: list[int] = []
    emb: list[int] = []
    block: list[int] = []
    blocks = max(1, stage_layers(cfg, setup, stage))
    for t in stage_tensors(cfg, setup, stage):
        # a kind's copies in one block (heads' modules, routed experts) as one tensor
        if t.place == "block":
            block.append(t.numel * (t.count // blocks))
        else:
            (emb if t.place == "embedding" else head).append(t.numel * t.count)
    total = max(1, sum(head) + sum(emb) + blocks * sum(block))
    return _Tensors(tuple(head), tuple(emb), tuple(block), blocks, total)


def _engine_terms(ledger: Ledger) -> tuple[dict, dict]:
    """The engine's terms: those held with one value in every steady moment (allocated before
    the first step), and each moment's others."""
    steady = [p for p in STEADY_PHASES if ledger.has(p)]
    extra = {p: {t: v for t, v in ledger.terms(p).items() if t not in OWN_TERMS and v}
             for p in ledger.phases}
    held = {t: v for t, v in extra[steady[0]].items()
            if all(extra[p].get(t) == v for p in steady)}
    moments = {p: {t: v for t, v in terms.items() if t not in held}
               for p, terms in extra.items()}
    return held, moments


class _Replay:
    """The events of one device's steps, built moment by moment (`step_events`)."""

    def __init__(self, cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: str,
                 blocks: int | None) -> None:
        # the step's account: a context-parallel rank saves the activations of its T/cp tokens
        # and holds states sharded over dp x cp
        account = step_account(cfg, workload, setup, stage)
        self.ledger = ledger = account.ledger
        self.acts = account.activations
        # what activation offloading moves to the host: made in the forward and copied out,
        # not kept (`forward`); the ledger's stash and brought-back terms hold them on the device
        self.offloaded = account.offloaded
        self.ts = _tensors(cfg, account.setup, stage)
        self.n = self.ts.blocks if blocks is None else blocks
        self.held, self.moments = _engine_terms(ledger)
        # activation offloading's forward stash: the last offloaded tensors, alive once the
        # blocks have run (made after them, not with the forward end's other terms)
        self.stash = self.moments.get(Phase.FORWARD_END, {}).pop(OFFLOAD_STASH, 0)
        self.open: dict = {}  # the engine's terms alive, by term: their bytes
        opt = ledger.get(Phase.OPTIMIZER_STEP, OPTIMIZER_STATES)
        # the optimizer's state tensors per parameter tensor (`Optimizer.state_tensors`)
        self.k = optimizer_of(setup).state_tensors if opt else 0
        self.sizes = {"weights": ledger.get(Phase.OPTIMIZER_STEP, WEIGHTS),
                      "gradients": ledger.get(Phase.OPTIMIZER_STEP, GRADIENTS),
                      "temporaries": ledger.get(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES)}
        self.sizes.update({f"state{i}": opt // self.k for i in range(self.k)})
        forward = ledger.terms(Phase.FORWARD_END)
        # gradients alive through the forward: an engine's kept gradient buffers (held from
        # the start), or those accumulating over micro-batches (made in the first backward)
        self.grads_held = forward.get(GRADIENTS, 0) > 0
        # the gradients as each moment holds them: the head's (made before any block's), the
        # blocks' (one by one), the rest after backward (an engine's reduced root gradients)
        last = ledger.get(Phase.BACKWARD_LAST_BLOCK, GRADIENTS)
        end = ledger.get(Phase.BACKWARD_END, GRADIENTS)
        self.head_kept = end >= last  # else the engine reduces the head's before the end
        ts = self.ts
        later = end - (last if self.head_kept else 0)
        blocks = min(later, end * ts.blocks * sum(ts.block) // ts.total)
        self.grads = {"head": last, "blocks": blocks, "embedding": later - blocks,
                      "rest": max(0, self.sizes["gradients"] - end),
                      "accumulating": forward.get(GRADIENTS_ACCUMULATING, 0)}
        # an engine that moves the gradients into its own buffers before the step (DeepSpeed's
        # fp32 partition) holds fewer at the step than at the end of backward
        self.grads_moved = self.sizes["gradients"] < end
        self.micro_batches = 2 if forward.get(GRADIENTS_ACCUMULATING, 0) else 1
        # the stream the blocks' and the rest's gradients are allocated on (FSDP2's
        # reduce-scatter stream), or None: the compute stream's; the head's, made before any
        # block's, stay on the compute stream (FSDP2 reduces the root's at the end of backward)
        engine = engine_for(account.setup)
        self.grad_stream = engine.gradient_stream
        # the engine's all-gather outputs (FSDP2's: `gather_terms`) are allocated on its
        # all-gather stream, each after its copy-in's cast (freed once copied): by output bytes
        self.gather_stream, self.gather_terms = engine.gather_stream, engine.gather_terms
        buffers = engine.gather_buffers(cfg, account.setup, stage)
        self.casts = {out: cast for cast, out in buffers.values()}
        # the root's forward all-gather, whose output is kept until the first block's is
        # copied out (the ledger's kept output, `moment`, stands for it from there); a pipeline
        # stage's (`schedules`) is not replayed
        self.root_gather = buffers.get("root", (0, 0)) if account.setup.pp == 1 else (0, 0)
        self.events: list[tuple] = []

    def alloc(self, key, nbytes: int, stream: str | None = None) -> None:
        self.events.append(("alloc", key, nbytes) if stream is None
                           else ("alloc", key, nbytes, stream))

    def free(self, *keys) -> None:
        self.events.extend(("free", key) for key in keys)

    def mark(self, phase: Phase) -> None:
        """Where the ledger's moment `phase` is (the allocator passes over it)."""
        if self.ledger.has(phase):
            self.events.append(("mark", phase))

    def each_tensor(self, kind: str, free: bool = False,
                    places=("head", "embedding", "block")) -> None:
        """Alloc (or free) `kind`'s share of every parameter tensor of `places`."""
        ts, total = self.ts, self.sizes[kind]
        for place in places:
            blocks = range(self.n) if place == "block" else (None,)
            shares = ts.block if place == "block" else getattr(ts, place)
            for b in blocks:
                for i, n in enumerate(shares):
                    key = (kind, place, b, i)
                    self.free(key) if free else self.alloc(key, ts.part(total, n))

    def block_gradients(self, b: int) -> None:
        """Block `b`'s share of the blocks' gradients, per parameter tensor."""
        per_block = max(1, sum(self.ts.block) * self.ts.blocks)
        for i, n in enumerate(self.ts.block):
            self.alloc(("gradients", "block", b, i), self.grads["blocks"] * n // per_block,
                       self.grad_stream)

    def free_gradients(self) -> None:
        head = ("head gradient",) if self.head_kept else ()
        self.free(*head, "embedding gradients", "rest of the gradients", *(
            ("gradients", "block", b, i) for b in range(self.n) for i in range(len(self.ts.block))))

    def lines(self, place: str, b=None, offloaded: bool | None = False) -> list[tuple]:
        """The saved lines of `place` (a block's share of a `layer` line) as (key, bytes): those
        the device keeps, those activation offloading moves to the host (`offloaded`), or
        (None) all, in the profile's order."""
        per = self.ts.blocks if place in ("layer", "weight_copy", "lora") else 1
        return [(("saved", k, b), v // per) for k, v in self.acts.items()
                if _place(k) == place and v and offloaded in (None, k in self.offloaded)]

    def made(self, lines: list[tuple]) -> None:
        """Saved lines as the forward makes them: kept, or (offloaded) copied to the host and
        freed at once (the forward stash, the ledger's term, stands for those still alive)."""
        for key, v in lines:
            self.alloc(key, v)
            if key[1] in self.offloaded:
                self.free(key)

    def places(self, *places: str, b=None) -> list[tuple]:
        """All `lines` of `places`, kept and offloaded."""
        return [line for place in places for line in self.lines(place, b, None)]

    def gather(self, key, cast: int, output: int) -> None:
        """An all-gather's buffers on the engine's all-gather stream: the copy-in's cast of the
        shards, then the output. The cast is freed before the output is made, where the
        all-gather frees it once copied into the output: beside the output it would make a
        moment the ledger does not count (up to 1/dp of a group above it); in the stream's
        pool the freed cast is too small to serve the output, which takes the same block as
        beside it unless a free neighbour of the cast's block fits it."""
        self.alloc(("all-gather cast", key), cast, self.gather_stream)
        self.free(("all-gather cast", key))
        self.alloc(key, output, self.gather_stream)

    def moment(self, phase: Phase, start: bool, gathered: bool | None = None) -> None:
        """Open (or close) the engine's terms of `phase` (or, opening, only its all-gather
        outputs: `gathered` True, or only its other terms: False): inside another open moment
        only what a term holds beyond its value there; an all-gather output on the all-gather
        stream, after its cast (`gather`)."""
        for t, v in self.moments.get(phase, {}).items():
            key = (t, phase)
            if start and gathered is not None and gathered != (t in self.gather_terms):
                continue
            if start:
                extra = v - self.open.get(t, 0)
                if t in self.gather_terms and extra > 0:
                    self.gather(key, self.casts.get(extra, 0), extra)
                else:
                    self.alloc(key, extra)
                self.open[key] = extra
                self.open[t] = self.open.get(t, 0) + extra
            else:
                self.free(key)
                self.open[t] -= self.open.pop(key)

    def get(self, phase: Phase, term) -> int:
        return self.ledger.get(phase, term)

    def setup_tensors(self) -> None:
        self.each_tensor("weights", places=("embedding", "block", "head"))
        for t, v in self.held.items():
            self.alloc(t, v)
        self.alloc("overhead", self.get(Phase.OPTIMIZER_STEP, OVERHEAD))
        if self.grads_held:
            self.each_tensor("gradients")

    def forward(self) -> None:
        self.made(self.places("input", "embedding"))
        # the root's all-gather output is alive when the next all-gather's is made (the
        # ledger's kept output), and freed before the root's unsharded parameters (as many
        # bytes) are: the moment they are alive together is not the ledger's
        cast, root = self.root_gather
        if root:
            self.gather("root all-gather output", cast, root)
        self.moment(Phase.FORWARD_END, True, gathered=True)
        if root:
            self.free("root all-gather output")
        self.moment(Phase.FORWARD_END, True, gathered=False)
        for b in range(self.n):
            # FSDP2's all-gather of each block, its unsharded parameters alive while it
            # computes; the ledger's moment is the last block's
            self.moment(Phase.FORWARD_GATHER, True)
            if b == self.n - 1:
                self.mark(Phase.FORWARD_GATHER)
            self.made(self.places("layer", "weight_copy", "lora", b=b))
            self.moment(Phase.FORWARD_GATHER, False)
        self.alloc("forward stash", self.stash)
        self.made(self.places("final", "lora_head", "cross_entropy"))
        self.alloc("logits", self.get(Phase.FORWARD_END, LOGITS))
        self.alloc("loss copy", self.get(Phase.FORWARD_END, LOSS_LOGITS_COPY))
        self.mark(Phase.FORWARD_END)
        self.free("loss copy", "forward stash")
        self.moment(Phase.FORWARD_END, False)
        if not self.get(Phase.BACKWARD_START, LOGITS):
            self.free("logits")

    def backward(self, first: bool) -> None:
        """The loss's and the head's backward, the blocks' from the last, the embeddings'; the
        gradients are made in the first micro-batch's (unless held)."""
        make = first and not self.grads_held
        self.moment(Phase.ROOT_REGATHER, True)
        self.mark(Phase.ROOT_REGATHER)
        self.moment(Phase.ROOT_REGATHER, False)
        self.moment(Phase.BACKWARD_START, True)
        grad = self.get(Phase.BACKWARD_START, LOSS_GRADIENT)
        self.alloc("loss gradient 1", grad // 2)
        self.alloc("loss gradient 2", grad - grad // 2)
        self.mark(Phase.BACKWARD_START)
        self.free("loss gradient 1")
        head = self.lines("final") + self.lines("lora_head") + self.lines("cross_entropy")
        self.free("loss gradient 2", *(key for key, _v in head))
        self.moment(Phase.BACKWARD_START, False)
        if make:
            self.alloc("head gradient", self.grads["head"])
        for b in reversed(range(self.n)):  # each block's backward is that moment again
            self.moment(Phase.BACKWARD_LAST_BLOCK, True)
            self.alloc(("recomputed", b), self.get(Phase.BACKWARD_LAST_BLOCK, RECOMPUTED_BLOCK))
            self.alloc(("in flight", b), self.get(Phase.BACKWARD_LAST_BLOCK, BLOCK_GRADIENTS))
            if b == self.n - 1:
                self.mark(Phase.BACKWARD_LAST_BLOCK)
            saved = self.lines("layer", b) + self.lines("weight_copy", b) + self.lines("lora", b)
            self.free(("in flight", b), ("recomputed", b), *(key for key, _v in saved))
            self.moment(Phase.BACKWARD_LAST_BLOCK, False)
            if b == self.n - 1:  # the last block's gradients handed to the reduction
                self.moment(Phase.REDUCE_SCATTER, True)
                self.mark(Phase.REDUCE_SCATTER)
                self.moment(Phase.REDUCE_SCATTER, False)
            if make:  # the block's parameter gradients, as its backward ends
                self.block_gradients(b)
        if make and not self.head_kept:
            self.free("head gradient")
        if make:
            self.alloc("embedding gradients", self.grads["embedding"], self.grad_stream)
        self.moment(Phase.BACKWARD_END, True)
        self.alloc("tied gradient", self.get(Phase.BACKWARD_END, TIED_EMBEDDING_GRADIENT))
        # the embeddings' offloaded inputs, brought back for their backward
        for key, v in self.lines("input", offloaded=True) + self.lines("embedding",
                                                                       offloaded=True):
            self.alloc(key, v)
        self.mark(Phase.BACKWARD_END)
        early = self.places("input", "embedding")
        self.free("tied gradient", *(key for key, _v in early))
        if self.get(Phase.BACKWARD_START, LOGITS):
            self.free("logits")
        self.moment(Phase.BACKWARD_END, False)
        if make:
            self.alloc("rest of the gradients", self.grads["rest"], self.grad_stream)
        if first and self.grads_held:  # accumulating beside an engine's kept buffers
            self.alloc("accumulating gradients", self.grads["accumulating"])

    def optimizer_step(self, first: bool) -> None:
        """The states made lazily in the first step, the update's temporaries, and
        zero_grad(set_to_none=True) (kept gradient buffers stay)."""
        if first:
            for i in range(self.k):
                self.each_tensor(f"state{i}")
        if self.grads_moved and not self.grads_held:
            self.free_gradients()
            self.alloc("moved gradients", self.sizes["gradients"])
        self.moment(Phase.OPTIMIZER_STEP, True)
        self.alloc("targets", self.get(Phase.OPTIMIZER_STEP, TARGETS))
        self.each_tensor("temporaries")
        self.mark(Phase.OPTIMIZER_STEP)
        self.each_tensor("temporaries", free=True)
        self.free("targets")
        self.moment(Phase.OPTIMIZER_STEP, False)
        if self.grads_moved and not self.grads_held:
            self.free("moved gradients")
        elif not self.grads_held:
            self.free_gradients()
        if self.grads_held:
            self.free("accumulating gradients")


def step_events(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: str = "first",
                blocks: int | None = None, steps: int = STEPS) -> list[tuple]:
    """The allocations and frees of `steps` training steps on one device of `stage`, with the
    stage's blocks (or `blocks` of them: the same per-block tensors, repeated that often).
    Gradient accumulation is replayed as two micro-batches per step (the second's forward
    runs beside the gradients, as every later one's does). Events are
    `("alloc", key, nbytes)` (on the compute stream), `("alloc", key, nbytes, stream)` and
    `("free", key)`."""
    replay = _Replay(cfg, workload, setup, stage, blocks)
    replay.setup_tensors()
    for step in range(steps):
        for micro in range(replay.micro_batches):
            replay.forward()
            replay.backward(first=micro == 0)
        replay.optimizer_step(first=step == 0)
    return replay.events


def after_load(load: list[tuple], step: list[tuple]) -> list[tuple]:
    """`step`'s events continued from the allocator state `load` leaves (`load.load_events`):
    the step's weights are the tensors the load made, so its own weight allocations are left
    out, and what they hold beyond the load's (the adapters, made after loading) is one tensor."""
    def own(e: tuple) -> bool:  # a parameter tensor's weights, as `each_tensor` keys them
        return isinstance(e[1], tuple) and len(e[1]) == 4 and e[1][0] == "weights"
    weights = sum(e[2] for e in step if e[0] == "alloc" and own(e))
    rest = [e for e in step if not own(e)]
    extra = max(0, weights - kept_bytes(load))
    return load + [("alloc", "weights beyond the load", extra)] + rest


def stage_reserved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                   stage: str = "first", blocks: int | None = None) -> int:
    """The reserved bytes after `step_events` on one device of `stage` (`blocks` blocks, default
    the stage's), under the set-up's allocator (`TrainingSetup.allocator`); where the model is
    quantised as it loads (`load.load_events`), the steps continue from the load's segments
    (with the stage's own blocks only: a load of `blocks` blocks is not a model's)."""
    events = step_events(cfg, workload, setup, stage, blocks)
    load = load_events(cfg, setup) if blocks is None else None
    if load is not None:
        events = after_load(load, events)
    return simulate(events, setup.allocator == "expandable").reserved


# The replay allocates every block's tensors, so its cost grows with the blocks on a stage; the
# largest published models hold 126 (Llama 3.1 405B on one stage). Beyond this many the reserved
# bytes are not simulated (reserved is not linear in the blocks: no extrapolation is exact).
MAX_SIMULATED_BLOCKS = 256


def rank_reserved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                  ) -> list[int] | None:
    """`stage_reserved` of every pipeline rank, rank 0 first (one entry without pipelining);
    None when a rank holds more than `MAX_SIMULATED_BLOCKS` blocks."""
    ranks = [stage_of(setup, r) for r in range(setup.pp)] if setup.pp > 1 else ["first"]
    if max(stage_layers(cfg, setup, s) for s in ranks) > MAX_SIMULATED_BLOCKS:
        return None
    return [stage_reserved(cfg, workload, setup, s) for s in ranks]


def reserved_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int | None:
    """What `torch.cuda.max_memory_reserved()` reads on the most loaded device: the largest
    `rank_reserved`; None when a rank holds more than `MAX_SIMULATED_BLOCKS` blocks."""
    per_rank = rank_reserved(cfg, workload, setup)
    return None if per_rank is None else max(per_rank)


def nccl_buffer_bytes(setup: TrainingSetup) -> int:
    """NCCL's own buffers on one rank: NCCL_BUFFSIZE x channels x ring peers per communicator,
    one communicator per parallel group of more than one rank; none on one device."""
    groups = sum(1 for n in (setup.dp, setup.tp, setup.pp, setup.ep) if n > 1)
    return groups * NCCL_CHANNELS * NCCL_RING_PEERS * NCCL_BUFFSIZE


# the line of `nvidia_smi_lines` that is the allocator's reserved bytes
RESERVED_LINE = "reserved (caching allocator)"


def nvidia_smi_lines(reserved: int, setup: TrainingSetup) -> dict[str, int]:
    """What nvidia-smi shows for the process, by line: the allocator's reserved bytes, the CUDA
    context (`CUDA_CONTEXT_BYTES`) and NCCL's buffers (`nccl_buffer_bytes`)."""
    return {RESERVED_LINE: reserved, "CUDA context": CUDA_CONTEXT_BYTES,
            "NCCL buffers": nccl_buffer_bytes(setup)}


__all__ = ["CUDA_CONTEXT_BYTES", "after_load", "MAX_SIMULATED_BLOCKS", "NCCL_BUFFSIZE", "NCCL_CHANNELS", "NCCL_RING_PEERS",
           "RESERVED_LINE", "STEPS", "nccl_buffer_bytes", "nvidia_smi_lines",
           "rank_reserved", "reserved_bytes", "stage_reserved", "step_events"]
