"""The collectives of one training step on one rank, and their time on a two-level network.

Ranks are placed as Megatron-LM and torchtitan place them: tensor parallel innermost (stride 1),
then context parallel, then data parallel (expert parallel inside it), pipeline outermost; a
group of n ranks at stride s has k = min(n, node / s) ranks on each node (1 when s >= node)
and crosses nodes when n > k.

Time of one collective of `size` bytes (nccl-tests' size: the all-reduced buffer, the gathered
output, the scattered input) over n ranks, as NCCL defines bus bandwidth:

    all-reduce        size x 2(n-1)/n / busbw + latency
    all-gather,       size x (n-1)/n / busbw + latency
    reduce-scatter
    all-to-all        size x (n-1)/n / busbw + latency  (busbw: the NIC's when it crosses nodes)
    send/recv         size / busbw + latency

busbw is the card's intra-node figure within a node; across nodes, the k NICs a node gives the
group: min(intra, k x inter) (a ring leaves each node once per channel, over the node's NICs).
Latency is NCCL's ring/Simple model (src/graph/tuning.cc: baseLat 8.4 us, hwLat 5.7 us per
NVLink or PCI step, 6.6 us per network step): 8.4 us plus 5.7 us per intra-node step and
6.6 us per inter-node step. An all-gather or reduce-scatter is a ring of n - 1 steps, nodes - 1
of them over the network (NCCL runs them as rings only); an all-reduce runs NCCL's tree across
nodes: two passes of (k - 1) intra-node and ceil(log2 nodes) network steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..config import GPTConfig
from ..errors import ConfigError
from ..gpus import GPU
from ..training_setup import TrainingSetup
from .compute import rank_parameters, stage_blocks

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send/recv")
BASE_LATENCY = 8.4e-6  # NCCL tuning.cc baseLat, ring/Simple
INTRA_STEP_LATENCY = 5.7e-6  # hwLat NVLink (and PCI), ring/Simple
INTER_STEP_LATENCY = 6.6e-6  # hwLat network, ring/Simple
# torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25 and a first bucket of 1 MiB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind per step on one rank, each of `size` bytes over a group
    of `group` ranks; `part` names what issues it (tp, cp, ep, pp, dp, fsdp); `phase` the pass
    that issues it, where the model knows it."""

    part: str
    kind: str
    size: float
    group: int
    count: int
    crosses_nodes: bool
    ranks_per_node: int
    phase: str = ""  # "forward" or "backward" where the engine's model tells them apart

    @property
    def bytes_total(self) -> float:
        return self.size * self.count


def placement(n: int, stride: int, node: int) -> tuple[int, bool]:
    """(ranks of the group per node, whether the group crosses nodes) for a group of n ranks
    at `stride` on nodes of `node` GPUs."""
    k = max(1, min(n, node // stride)) if stride < node else 1
    return k, n > k


def collective_seconds(kind: str, size: float, n: int, k: int, crosses: bool, g: GPU,
                       intra: float | None = None, inter: float | None = None) -> float:
    """Seconds of one collective (module docstring); `intra`/`inter` override the card's."""
    if n <= 1 or size <= 0:
        return 0.0
    intra = intra or g.intra_node_busbw
    inter = inter or g.inter_node_busbw
    if intra is None or (crosses and inter is None):
        raise ConfigError("gpu", f"{g.name} has no network figures; pick an accelerator (see "
                                 "`gptcalc gpus`)")
    if kind == "all-to-all":
        bw = inter if crosses else intra
    elif kind == "send/recv":
        return size / (inter if crosses else intra) + BASE_LATENCY + (
            INTER_STEP_LATENCY if crosses else INTRA_STEP_LATENCY)
    else:
        bw = min(intra, k * inter) if crosses else intra
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    nodes = math.ceil(n / k)
    if kind == "all-reduce":  # NCCL's tree across nodes, a ring within: two passes
        latency = BASE_LATENCY + 2 * ((k - 1) * INTRA_STEP_LATENCY
                                      + math.ceil(math.log2(nodes)) * INTER_STEP_LATENCY)
    else:  # all-gather, reduce-scatter, all-to-all: a ring of n - 1 steps, nodes - 1 of them
        # over the network (NCCL tuning.cc's nInterSteps)
        latency = BASE_LATENCY + (n - nodes) * INTRA_STEP_LATENCY \
            + (nodes - 1) * INTER_STEP_LATENCY
    return size * factor / bw + latency


def ddp_buckets(gradient_bytes: float, cap: int = DDP_BUCKET_BYTES) -> int:
    """All-reduces DDP issues for `gradient_bytes` of gradients with buckets of `cap` bytes: at
    the default cap a first bucket of DDP_FIRST_BUCKET_BYTES, then buckets of the cap (with
    bucket_cap_mb given, torch 2.13's DDP makes the first bucket the cap too); the gradients
    taken as whole tensors that fill buckets exactly (DDP never splits a tensor)."""
    first = DDP_FIRST_BUCKET_BYTES if cap == DDP_BUCKET_BYTES else cap
    rest = max(0.0, gradient_bytes - first)
    return 1 + math.ceil(rest / cap)


def gradient_bytes(setup: TrainingSetup) -> int:
    """Bytes of one gradient element as reduced: fp32 under fp32 and amp (fp32 weights), 16
    bits under mixed and bf16."""
    return setup.weight_bytes


def collectives(cfg: GPTConfig, setup: TrainingSetup, batch: int, seq_len: int,
                micro_batches: int, node: int) -> list[Collective]:
    """Every collective one rank of the heaviest stage issues in one optimizer step of
    `micro_batches` micro-batches of `batch` sequences (module docstring for placement)."""
    tp, cp, dp, pp, ep = setup.tp, setup.cp, setup.dp, setup.pp, setup.ep
    m, a, E = micro_batches, setup.act_bytes, cfg.n_embd
    blocks = stage_blocks(cfg, pp)
    tokens = batch * seq_len / cp
    out: list[Collective] = []

    def add(part, kind, size, n, stride, count):
        if n > 1 and count > 0 and size > 0:
            k, crosses = placement(n, stride, node)
            out.append(Collective(part, kind, size, n, count, crosses, k))

    fwd_runs = 2 if setup.recompute == "full" else 1
    act = tokens * E * a
    out += _tensor_parallel(cfg, setup, m, blocks, tokens, act, fwd_runs, node)
    # context parallel: Megatron-core's ring passes each rank's keys and values cp - 1 times
    # in forward; backward passes them and their gradients
    if setup.engine == "megatron":
        kv = tokens * 2 * cfg.kv_heads * cfg.head_size / tp * a
        add("cp", "send/recv", kv, cp, tp, m * blocks * (cp - 1) * (fwd_runs + 2))
    elif cp > 1:
        kv = tokens * 2 * cfg.q_width / tp  # k and v with every query head (repeat_kv)
        add("cp", "all-gather", kv * a * cp, cp, tp, m * blocks * (fwd_runs + 1))
        add("cp", "all-to-all", kv * CP_GRAD_BYTES, cp, tp, m * blocks * cp)
    # expert parallel: per MoE block, the token counts, dispatch and combine (`ep_all_to_alls`)
    if cfg.moe and ep > 1:
        moe_blocks = max(1, round(blocks * _moe_share(cfg)))
        for size, count in ep_all_to_alls(cfg, tokens, a, fwd_runs):
            add("ep", "all-to-all", size, ep, tp * cp, m * moe_blocks * count)
    # pipeline: each chunk sends its activation forward and its input's gradient backward
    if pp > 1:
        size = act / tp if setup.sp else act
        # the stages are node-strided: some boundary crosses nodes once the layout does
        out.append(Collective("pp", "send/recv", size, 2,
                              m * pipeline_sends(pp, setup.pp_virtual),
                              tp * cp * dp * pp > node, 1))
    out += _data_parallel(cfg, setup, m, node, blocks)
    return out


# the token counts torchtitan's dispatcher exchanges: one int64 per routed expert
# (`num_local_tokens_per_expert_E`, a sum over a bool routing map)
EP_COUNT_BYTES = 8


def ep_all_to_alls(cfg: GPTConfig, tokens: float, act_bytes: int,
                   fwd_runs: int) -> list[tuple[float, int]]:
    """(bytes, calls) of the all-to-alls one MoE block issues per micro-batch on one
    expert-parallel rank of `tokens` tokens, as torchtitan 0.3.0's `AllToAllTokenDispatcher`
    issues them (torchtitan/models/common/token_dispatcher.py):

        token counts   n_expert x 8 B                      each forward run (under no_grad)
        dispatch       T x k x E x act_bytes               each forward run, and backward
        combine        T x k x E x act_bytes (balanced)    each forward run, and backward

    `fwd_runs` is 2 under full recomputation (the checkpointed block's forward runs again in
    backward, its exchanges too). The dispatch sends this rank's T x k routed rows; the
    combine sends back the rows it received, T x k under balanced routing and on average over
    the ranks under any routing (the rows the ranks send are the rows they receive); backward
    sends the gradients of both, the same sizes. Sizes as nccl-tests': each call's input."""
    routed = tokens * cfg.n_expert_active * cfg.n_embd * act_bytes
    return [(cfg.n_expert * EP_COUNT_BYTES, fwd_runs), (routed, 2 * (fwd_runs + 1))]


# torch's ring attention backward passes dk and dv around the ring in fp32 (torch 2.13,
# _context_parallel/_attention.py, `_templated_ring_attention_backward`: its accumulators are
# fp32, rotated by `_AllToAllRotater`, one permute_tensor per step, cp steps); its forward and
# backward each all-gather k and v once (`_AllGatherRotater`, the default rotate method)
CP_GRAD_BYTES = 4

# The vocabulary-parallel cross-entropy's all-reduces per micro-batch, each of one fp32 per
# token: the logits' maximum, the sum of their exponentials and the target's logit
# (torch.distributed.tensor.parallel.loss_parallel, `_log_softmax` and `_nll_loss_forward`
# in torch/distributed/tensor/parallel/loss.py; Megatron-LM's
# `_VocabParallelCrossEntropy` alike)
LOSS_PARALLEL_ALL_REDUCES = 3
LOSS_STAT_BYTES = 4
# torch.optim.AdamW reads a gradient three times (exp_avg.lerp_(grad),
# exp_avg_sq.addcmul_(grad, grad)): a gradient left Partial by sequence parallel (a DTensor
# of a replicated parameter whose tokens were sharded) is all-reduced at each read
ADAMW_GRADIENT_READS = 3


def _tensor_parallel(cfg: GPTConfig, setup: TrainingSetup, m: int, blocks: int,
                     tokens: float, act: float, fwd_runs: int, node: int) -> list[Collective]:
    """Tensor (and sequence) parallel's collectives (Shoeybi et al. 2019; Korthikanti et al.
    2022, sec. 4.2), each of `act` bytes (tokens x E) unless said, per micro-batch:

    - each block: two all-reduces in forward (after the attention's and the MLP's row-parallel
      Linear) and two in backward (the gradients of their column-parallel inputs); under
      sequence parallel each is an all-gather before and a reduce-scatter after (forward;
      backward the reverse); full recomputation runs the forward's again;
    - the vocabulary-parallel embedding (first stage): an all-reduce of its output in forward;
      under sequence parallel a reduce-scatter (with learned positions an all-reduce, the
      positions added, then a split: Megatron-LM's `reduce_scatter_embeddings` is off there)
      and an all-gather in backward;
    - the column-parallel head (last stage): an all-reduce of its input's gradient in backward,
      under sequence parallel an all-gather of its input in forward and a reduce-scatter
      backward; the vocabulary-parallel loss's LOSS_PARALLEL_ALL_REDUCES of tokens x 4 B;

    and once per step under sequence parallel, the gradients of the replicated parameters
    that see sequence-sharded tokens: Megatron-LM all-reduces its norms' and row-parallel
    biases' (marked `sequence_parallel`) in one call (finalize_model_grads.py,
    `_allreduce_layernorm_grads`); PyTorch's parallelize_module leaves the norms' Partial
    (its row-parallel bias is added before the reduce-scatter) and AdamW all-reduces each at
    every read (ADAMW_GRADIENT_READS). With pp > 1 the stage is the last (head and loss, not the
    embedding). Not counted: FSDP2 over tensor-parallel ranks' handling of those gradients."""
    tp = setup.tp
    if tp <= 1:
        return []
    k, crosses = placement(tp, 1, node)
    out: list[Collective] = []

    def tp_add(kind, size, count):
        if count > 0 and size > 0:
            out.append(Collective("tp", kind, size, tp, count, crosses, k))

    first = setup.pp == 1  # the first stage, holding the embedding
    per_pass = m * blocks * 2 * (fwd_runs + 1)
    if setup.sp:
        # with learned positions the embedding's output is all-reduced, positions added, and
        # split to the sequence shards (no collective; its backward all-gathers)
        learned = first and cfg.pos_embedding == "learned"
        tp_add("all-gather", act, per_pass + m * (1 + first))
        tp_add("reduce-scatter", act, per_pass + m * (1 + first - learned))
        tp_add("all-reduce", act, m * learned)
    else:
        tp_add("all-reduce", act, per_pass + m * (1 + first))
    tp_add("all-reduce", tokens * LOSS_STAT_BYTES, m * LOSS_PARALLEL_ALL_REDUCES)
    if setup.sp:
        from ..memory.states import stage_tensors

        stage = "first" if setup.pp == 1 else "last"
        replicated = [t for t in stage_tensors(cfg, setup, stage)
                      if t.split == "replicated" and t.place != "embedding"]
        g = gradient_bytes(setup)
        if setup.engine == "megatron":  # norms and row-parallel biases (`sequence_parallel`)
            tp_add("all-reduce", sum(t.numel * t.count for t in replicated) * g, 1)
        else:  # the norms: a row-parallel bias is added before the reduce-scatter
            for t in replicated:
                if t.role == "norm":
                    tp_add("all-reduce", t.numel * g, ADAMW_GRADIENT_READS * t.count)
    return out


def pipeline_sends(pp: int, v: int) -> int:
    """Sends per micro-batch of the busiest pipeline rank: rank r runs chunks r, r + pp, ...
    (v of them, pp x v in all); every chunk but the last sends its output forward, every
    chunk but the first its input's gradient backward (torch.distributed.pipelining's
    SEND_F and SEND_B, Megatron-LM's p2p_communication alike), whatever the schedule. A
    middle rank sends 2v; with pp = 2 each rank holds an end chunk: 2v - 1."""
    last = pp * v - 1
    return max(sum((c != last) + (c != 0) for c in range(r, pp * v, pp)) for r in range(pp))


def _moe_share(cfg: GPTConfig) -> float:
    from ..layers import moe_layers

    return moe_layers(cfg) / cfg.n_layer


def _data_parallel(cfg: GPTConfig, setup: TrainingSetup, m: int, node: int,
                   blocks: int) -> list[Collective]:
    """The gradient reduction and parameter gathers over the dp x cp ranks that hold the same
    parameters: DDP's bucketed all-reduce; ZeRO 1-2 and Megatron's distributed optimizer a
    reduce-scatter of the gradients and an all-gather of the updated parameters; ZeRO-3
    (FSDP2 reshard_after_forward, DeepSpeed stage 3) per block an all-gather in forward and in
    backward and a reduce-scatter of its gradients, every micro-batch (FSDP2 at --zero 2 keeps
    the forward's gather for backward; under pipelining FSDP2 reduces once a step,
    `fsdp2_reduce_rounds`); FSDP1 per unit, its flat parameter (`_fsdp1`)."""
    n = setup.dp * setup.cp
    if n <= 1:
        return []
    k, crosses = placement(n, setup.tp, node)
    params = rank_parameters(cfg, setup)
    g = gradient_bytes(setup)
    if setup.engine == "fsdp2" and setup.mode != "bf16":
        g = 4  # MixedPrecisionPolicy's fp32 reduction (torchtitan's default), fp32 shards
    w = setup.act_bytes if setup.mode != "fp32" else 4  # parameters gathered in 16 bits

    def c(kind, size, count, part="dp", phase=""):
        return Collective(part, kind, size, n, count, crosses, k, phase)

    if setup.engine == "fsdp2" and setup.zero in (2, 3):
        return _fsdp2(cfg, setup, m, blocks, g, w, c)
    if setup.engine == "fsdp1":
        return _fsdp1(cfg, setup, m, c)
    if setup.engine == "deepspeed" and setup.zero in (1, 2):
        return _deepspeed_zero12(cfg, setup, m, g, w, c)
    if setup.engine == "deepspeed" and setup.zero == 3:
        return _deepspeed_zero3(cfg, setup, m, blocks, g, w, c)
    if setup.zero == 3:
        block = params / blocks  # per block (embeddings and head folded in)
        gathers = 2 if setup.zero == 3 else 1
        return [c("all-gather", block * w, m * blocks * gathers, "fsdp"),
                c("reduce-scatter", block * g, m * blocks, "fsdp")]
    total = params * g
    buckets = ddp_buckets(total)
    ddp = c("all-reduce", total / buckets, buckets)
    if setup.engine == "zero-redundancy":  # DDP's all-reduce, then each shard broadcast back
        return [ddp, c("all-gather", params * w, 1)]
    if setup.engine == "megatron" and setup.distributed_optimizer:
        return _megatron_distributed_optimizer(cfg, setup, g, w, c)
    if setup.zero in (1, 2):
        return [c("reduce-scatter", total, 1), c("all-gather", params * w, 1)]
    return [ddp]


# Megatron-core's distributed optimizer buffer (megatron/core/distributed/
# param_and_grad_buffer.py, 0.16.1): each parameter starts at a multiple of 64 elements
# (`_pad_start_of_param_if_needed`), each bucket ends at a multiple of lcm(dp, 128)
# (`_pad_end_of_bucket_if_needed`)
MEGATRON_PARAM_ALIGN = 64
MEGATRON_BUCKET_ALIGN = 128
# the gradient norm Megatron's optimizer all-reduces before clipping (one fp32,
# `get_grad_norm_fp32`; clip_grad 1.0 is Megatron-LM's default)
MEGATRON_GRAD_NORM_BYTES = 4
# `engine_settings` keys of the megatron engine: ("overlap_grad_reduce", 0) runs without
# --overlap-grad-reduce (one bucket per buffer, Megatron-LM's flag default); ("bucket_size", n)
# is --ddp-bucket-size. Overlap is the default: Megatron-LM's example scripts pass
# --overlap-grad-reduce, and `step` overlaps the buckets with backward
MEGATRON_OVERLAP = "overlap_grad_reduce"
MEGATRON_BUCKET = "bucket_size"
# distributed_data_parallel.py: with overlap and no --ddp-bucket-size, buckets of
# max(40,000,000, 1,000,000 x dp) elements
MEGATRON_MIN_BUCKET = 40_000_000
MEGATRON_BUCKET_PER_RANK = 1_000_000


def megatron_settings(setup: TrainingSetup) -> tuple[int, int]:
    """(whether --overlap-grad-reduce, the --ddp-bucket-size given or 0) of a megatron
    set-up's `engine_settings`."""
    d = dict(setup.engine_settings)
    return int(d.get(MEGATRON_OVERLAP, 1)), int(d.get(MEGATRON_BUCKET, 0))


def megatron_bucket_size(setup: TrainingSetup) -> int | None:
    """Elements at which Megatron-core closes a gradient bucket: None (one bucket) without
    --overlap-grad-reduce, else the given size or max(MEGATRON_MIN_BUCKET,
    MEGATRON_BUCKET_PER_RANK x dp)."""
    overlap, given = megatron_settings(setup)
    if not overlap:
        return None
    return given or max(MEGATRON_MIN_BUCKET, MEGATRON_BUCKET_PER_RANK * setup.dp)


def megatron_buckets(sizes: list[int], n: int, bucket_size: int | None) -> list[int]:
    """Elements of each bucket of Megatron-core's distributed-optimizer buffer over `n`
    data-parallel ranks for parameters of `sizes` elements in module order
    (`_ParamAndGradBuffer.__init__`): taken in reverse (backward's order), each starting at a
    multiple of MEGATRON_PARAM_ALIGN; a bucket closes once its parameters span at least
    `bucket_size` elements (`>=`), the rest form the last; each bucket padded to a multiple of
    lcm(n, MEGATRON_BUCKET_ALIGN)."""
    a, d = MEGATRON_PARAM_ALIGN, math.lcm(n, MEGATRON_BUCKET_ALIGN)
    out, span, open_ = [], 0, False
    for k in reversed(sizes):
        span = -(-span // a) * a + k  # a bucket starts aligned to d, a multiple of a
        open_ = True
        if bucket_size is not None and span >= bucket_size:
            out.append(-(-span // d) * d)
            span, open_ = 0, False
    return out + ([-(-span // d) * d] if open_ else [])


def module_order_sizes(tensors, tp: int) -> list[int]:
    """Elements of each parameter tensor (its tensor-parallel shard) in a GPT module's
    `parameters()` order: the embeddings, then block by block each block's tensors in
    inventory order (a kind that fewer blocks hold: in the first of them), then the head's."""
    blocks = [t for t in tensors if t.place == "block"]
    out = [t.shard(tp) for t in tensors if t.place == "embedding" for _ in range(t.count)]
    for i in range(max((t.layers for t in blocks), default=0)):
        out += [t.shard(tp) for t in blocks if i < t.layers for _ in range(t.copies)]
    return out + [t.shard(tp) for t in tensors if t.place == "head" for _ in range(t.count)]


def _megatron_distributed_optimizer(cfg: GPTConfig, setup: TrainingSetup, g: int, w: int,
                                    c) -> list[Collective]:
    """Megatron-core 0.16.1's DistributedDataParallel with its distributed optimizer, per step:
    each bucket of the main-gradient buffer reduce-scattered once (`start_grad_sync`; during
    the last micro-batch's backward under --overlap-grad-reduce, after it without), in the
    gradients' dtype (`MEGATRON_BYTES`: fp32 under bf16, Megatron-LM accumulating and reducing
    bf16 training's gradients in fp32); the gradient norm all-reduced
    (MEGATRON_GRAD_NORM_BYTES); each bucket of the parameter buffer all-gathered after the
    step (`start_param_sync`) in the weights' dtype. The buckets are `megatron_buckets` of the
    stage's parameters (`module_order_sizes`; with pp > 1 the last stage's, its embedding
    copy's own bucket not split off) at `megatron_bucket_size`. Not counted: expert
    parameters' own buffer under ep, fp16's found-inf all-reduce. Outside Megatron-LM's
    precisions (which its engine refuses) the weights' and gradients' bytes are `w` and `g`,
    as given."""
    from ..memory.engines.megatron import MEGATRON_BYTES
    from ..memory.engines.shards import MAX_TENSORS
    from ..memory.states import stage_tensors

    w, g, _ = MEGATRON_BYTES.get((setup.mode, setup.autocast_dtype), (w, g, 0))
    tensors = stage_tensors(cfg, setup, "first" if setup.pp == 1 else "last")
    if sum(t.count for t in tensors) > MAX_TENSORS:
        raise ConfigError("n_layer", f"more than {MAX_TENSORS:,} parameter tensors: Megatron's "
                                     "buckets are counted per tensor")
    sizes = module_order_sizes(tensors, setup.tp)
    buckets = megatron_buckets(sizes, setup.dp * setup.cp, megatron_bucket_size(setup))
    order = dict.fromkeys(buckets)
    return [*(c("reduce-scatter", n * g, buckets.count(n)) for n in order),
            c("all-reduce", MEGATRON_GRAD_NORM_BYTES, 1),
            *(c("all-gather", n * w, buckets.count(n)) for n in order)]


def _fsdp2(cfg: GPTConfig, setup: TrainingSetup, m: int, blocks: int, g: int, w: int,
           c) -> list[Collective]:
    """FSDP2 with `fully_shard` on every block and at the root (torchtitan's wrapping): per
    micro-batch each group is all-gathered before its forward and, resharded after forward
    (--zero 3; torch 2.13 reshards the root too), again before its backward, and its
    gradients reduce-scattered after its backward. A group's bytes are its parameters, each
    padded on dim 0 to a multiple of dp (`fsdp2_unsharded_elements`), in the gather's dtype
    and the reduction's. The root's collectives come first: its gather opens the forward, its
    reduce-scatter (the embeddings' gradients) closes the backward."""
    from ..memory.engines.fsdp2 import fsdp2_gradient_elements, fsdp2_unsharded_elements

    gathered, reduced = fsdp2_unsharded_elements(cfg, setup), fsdp2_gradient_elements(cfg, setup)
    gathers = fsdp2_gather_rounds(setup, m)
    reductions = fsdp2_reduce_rounds(setup, m)
    out = []
    for group, n in (("root", 1), ("block", blocks)):
        if gathered[group]:
            out.append(c("all-gather", gathered[group] * w, gathers * n, "fsdp"))
    for group, n in (("root", 1), ("block", blocks)):
        if reduced[group]:
            out.append(c("reduce-scatter", reduced[group] * g, reductions * n, "fsdp"))
    return out


def fsdp1_no_sync(setup: TrainingSetup) -> bool:
    """Whether FSDP1 accumulates under `no_sync()` (reduce-scatters after the last
    micro-batch only) rather than reducing every micro-batch: `fsdp1_sync` no-sync, the
    default (`gptcalc.memory.engines.fsdp1` says why)."""
    return setup.fsdp1_sync == "no-sync"


def accumulation_assumption(setup: TrainingSetup, m: int) -> str:
    """What the first line says of how the engine accumulates `m` micro-batches' gradients
    where the time model assumes it ("; ..."), else "" (`fsdp1.fsdp1_accumulation`)."""
    from ..memory.engines.fsdp1 import fsdp1_accumulation

    return fsdp1_accumulation(setup, m)


def fsdp1_rounds(setup: TrainingSetup, m: int) -> list[tuple[int, bool, bool, bool]]:
    """The kinds of micro-batch of one FSDP1 step of `m`, as (how many, whether its forward
    all-gathers, whether its backward all-gathers, whether it reduce-scatters), per unit
    (torch 2.13, torch/distributed/fsdp/_runtime_utils.py):

    - a unit is all-gathered in its pre-forward unless still unsharded (`FlatParamHandle.
      needs_unshard`); FULL_SHARD frees a block's in its post-forward (`_post_forward_reshard`:
      not the root's, which backward uses at once) and gathers it again before its backward;
    - a synced backward reduce-scatters each unit's flat gradient in its post-backward hook and
      frees the unit (`_should_free_in_backward`: `_sync_gradients` or FULL_SHARD); under
      `no_sync()` it reduces nothing and SHARD_GRAD_OP keeps every unit unsharded, so its
      next forward gathers nothing.

    Every micro-batch syncs, unless `fsdp1_no_sync`: then the first m - 1 run under no_sync
    and the last syncs."""
    z3 = setup.zero == 3
    if m == 1 or not fsdp1_no_sync(setup):
        return [(m, True, z3, True)]
    if z3:
        return [(m - 1, True, True, False), (1, True, True, True)]
    middle = [(m - 2, False, False, False)] if m > 2 else []
    return [(1, True, False, False), *middle, (1, False, False, True)]


def _fsdp1(cfg: GPTConfig, setup: TrainingSetup, m: int, c) -> list[Collective]:
    """FSDP1 (FullyShardedDataParallel, a unit per block and the root, gptcalc.memory.engines.
    fsdp1), per step: each unit's padded flat parameter all-gathered (`FlatParamHandle.
    _all_gather_flat_param`: the padded unsharded size, in MixedPrecision's param_dtype,
    `compute_bytes`) in the forwards and backwards `fsdp1_rounds` says, and its padded flat
    gradient reduce-scattered (`_reduce_grad`, in reduce_dtype, `reduce_bytes`) in each
    synced backward. The root is gathered once a forward and never in backward (its
    pre-backward hook finds it unsharded). In this order, which `step._exposed_fsdp1` reads:
    the root's forward gather, the blocks' forward gathers, the blocks' backward gathers
    (FULL_SHARD), the root's reduce-scatter (the step's last: the embedding's gradient
    closes the backward), the blocks' reduce-scatters."""
    from ..memory.engines.fsdp1 import compute_bytes, fsdp1_units, reduce_bytes

    units = fsdp1_units(cfg, setup)
    root, block = units["root"].padded, units["block"].padded
    w, g, L = compute_bytes(setup), reduce_bytes(setup), cfg.n_layer
    rounds = fsdp1_rounds(setup, m)
    forwards = sum(n for n, fwd, _, _ in rounds if fwd)
    backwards = sum(n for n, _, bwd, _ in rounds if bwd)
    synced = sum(n for n, _, _, sync in rounds if sync)
    out = [c("all-gather", root * w, forwards, "fsdp", "forward"),
           c("all-gather", block * w, forwards * L, "fsdp", "forward"),
           c("all-gather", block * w, backwards * L, "fsdp", "backward"),
           c("reduce-scatter", root * g, synced, "fsdp", "backward"),
           c("reduce-scatter", block * g, synced * L, "fsdp", "backward")]
    return [x for x in out if x.count]


def fsdp2_reduce_rounds(setup: TrainingSetup, m: int) -> int:
    """How many times per step FSDP2 reduce-scatters each group's gradients: every micro-batch
    (gradient accumulation without `no_sync`, as torchtitan and MPT run it), but once under
    torch.distributed.pipelining (pp > 1): its stage runs every backward with
    `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`, then one
    `post_backward` of every parameter group after the last micro-batch
    (torch/distributed/pipelining/stage.py, `backward_maybe_with_nosync` and
    `perform_reduce_grad`, torch 2.13.0 at cf30153c4c131c8164ee7798e5022d810682e2cb)."""
    return 1 if setup.pp > 1 else m


def fsdp2_gather_rounds(setup: TrainingSetup, m: int) -> int:
    """How many times per step FSDP2 all-gathers each group: before every micro-batch's forward
    and, resharded after forward (--zero 3), again before its backward. Under pipelining
    (`fsdp2_reduce_rounds`) a stage that keeps its forward's parameters (--zero 2,
    reshard_after_forward False: torchtitan's default with pp, "we do not reshard after
    forward" in the Llama 3 paper, sec. 3.3.2) is never resharded after backward before the
    step's end either: gathered once per step."""
    if setup.pp > 1 and setup.zero == 2:
        return 1
    return m * (2 if setup.zero == 3 else 1)


def deepspeed_reduce_buckets(sizes: list[int], bucket: int, dp: int = 1) -> list[int]:
    """Elements of each gradient all-reduce of DeepSpeed ZeRO 1-2 over gradients of `sizes`
    elements in the order backward produces them: a gradient that would take the bucket past
    `bucket` (reduce_bucket_size) elements first sends the bucket (`if bucket.elements +
    param.numel() > self.reduce_bucket_size`, stage_1_and_2.py,
    `reduce_independent_p_g_buckets_and_remove_grads`); one larger than the bucket goes alone;
    what is left goes at the end of backward. Each bucket is one all-reduce
    (`use_multi_rank_bucket_allreduce`, the default, all-reduces it instead of reducing each
    rank's slice to its owner). Stage 3 fills its buckets by the same rule
    (stage3.py, `reduce_independent_p_g_buckets_and_remove_grads`) and reduce-scatters each
    with every gradient padded to a multiple of `dp` (`reduce_scatter_coalesced`): with `dp`
    given, the elements returned are the padded ones (the rule reads the unpadded)."""
    out, acc, padded = [], 0, 0
    for n in sizes:
        if n == 0:
            continue
        if acc + n > bucket and acc:
            out.append(padded)
            acc = padded = 0
        if n > bucket:
            out.append(-(-n // dp) * dp)
        else:
            acc, padded = acc + n, padded + -(-n // dp) * dp
    return out + ([padded] if acc else [])


# DeepSpeed ZeRO 1-2's step (deepspeed 0.19 stage_1_and_2.py): the gradient norm all-reduced
# (one fp32, `get_grad_norm_direct`) and, under bf16 or fp16 (`check_grad_overflow`,
# runtime/engine.py), the overflow flag (a 1-byte tensor, `has_overflow`)
DEEPSPEED_GRAD_NORM_BYTES = 4
DEEPSPEED_OVERFLOW_FLAG_BYTES = 1


def _deepspeed_zero12(cfg: GPTConfig, setup: TrainingSetup, m: int, g: int, w: int,
                      c) -> list[Collective]:
    """DeepSpeed ZeRO 1-2: the gradients all-reduced in reduce_bucket_size buckets
    (`deepspeed_reduce_buckets`, the tensors in backward's order: the inventory's reversed) at
    every micro-batch under stage 2 (the gradient hooks reduce as they fire), once per step
    under stage 1; after the step, the updated 16-bit flat buffer all-gathered in one call
    (`all_gather_into_tensor_dp_groups`: allgather_bucket_size is unused when the backend has
    all_gather_into_tensor), padded to a multiple of 2 x dp (`flat_group_elements`); and the
    step's scalars: the gradient norm, and the overflow flag in mode mixed."""
    from ..memory.engines.deepspeed import _sizes, flat_group_elements, zero_settings

    sizes = _sizes(cfg, setup, 0)
    times = m if setup.zero == 2 else 1
    buckets = deepspeed_reduce_buckets(sizes[::-1], zero_settings(setup)["reduce_bucket_size"])
    out = [c("all-reduce", n * g, times * buckets.count(n)) for n in dict.fromkeys(buckets)]
    out.append(c("all-gather", flat_group_elements(sum(sizes), setup.dp) * w, 1))
    scalars = [DEEPSPEED_GRAD_NORM_BYTES] + (
        [DEEPSPEED_OVERFLOW_FLAG_BYTES] if setup.mode == "mixed" else [])
    return out + [c("all-reduce", b, 1) for b in scalars]


# DeepSpeed ZeRO-3's step: the gradient norm all-reduced as one fp64 (stage3.py,
# `get_grad_norm_direct`, in zero/utils.py's `get_norm_dtype`: fp64 where the device has it);
# no overflow flag under bf16 (`check_overflow` runs under fp16 only)
DEEPSPEED_STAGE3_GRAD_NORM_BYTES = 8


def deepspeed_stage3_gathers(cfg: GPTConfig, setup: TrainingSetup, blocks: int
                             ) -> tuple[dict[int, int], dict[int, int]]:
    """The all-gathers of one micro-batch of DeepSpeed ZeRO-3 at its steady state, forward's
    and backward's: {elements of one call: calls}, in the order of each size's first call.
    Each call is one fetch's own parameters
    not yet gathered, or one prefetch (`stage3_gathered`'s replay of the parameter
    coordinator over `stage3_trace`), every parameter padded to a multiple of dp
    (`_all_gather_coalesced`: the partitions, ceil(n / dp) each, gathered from dp ranks).

    The replay runs on at most 2w + 1 blocks and one more (w: `stage3_blocks`, the blocks
    the reuse distance, prefetch bucket and live limit span): beyond that a block's calls
    repeat, and the stage's `blocks` add the difference of the two once each."""
    fwd, bwd = _stage3_gathers(cfg, setup, blocks)
    return dict(fwd), dict(bwd)


def _items(sides: tuple[dict[int, int], dict[int, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple(side.items()) for side in sides)


# `plan` asks for the same set-up's gathers at every micro-batch size it tries, and each replay
# walks a coordinator trace: kept, as tuples, per (cfg, set-up, blocks)
@functools.lru_cache(maxsize=512)
def _stage3_gathers(cfg: GPTConfig, setup: TrainingSetup, blocks: int
                    ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """`deepspeed_stage3_gathers`' replay, its two sides as (elements, calls) pairs."""
    from ..memory.engines.deepspeed import stage3_blocks, stage3_gathered, stage3_trace

    dp = setup.dp

    def replay(n: int) -> tuple[dict[int, int], dict[int, int]]:
        trace, calls = stage3_trace(cfg, setup, 0, n), []
        stage3_gathered(trace, setup, calls)
        fwd: dict[int, int] = {}
        bwd: dict[int, int] = {}
        for at, params in calls:
            size = sum(-(-trace.sizes[p] // dp) * dp for p in params)
            side = fwd if at < trace.marks["forward_end"] else bwd
            side[size] = side.get(size, 0) + 1
        return fwd, bwd

    k = min(blocks, 2 * stage3_blocks(cfg, setup, 0) + 1)
    if k == blocks:
        return _items(replay(blocks))
    out = []
    for a, b in zip(replay(k), replay(k + 1)):
        per_block = {n: b.get(n, 0) - a.get(n, 0) for n in dict.fromkeys([*a, *b])}
        if min(per_block.values(), default=0) < 0:  # not periodic yet: the whole stage
            return _items(replay(blocks))
        out.append({n: a.get(n, 0) + (blocks - k) * d for n, d in per_block.items()
                    if a.get(n, 0) + (blocks - k) * d})
    return _items((out[0], out[1]))


def _deepspeed_zero3(cfg: GPTConfig, setup: TrainingSetup, m: int, blocks: int, g: int,
                     w: int, c) -> list[Collective]:
    """DeepSpeed ZeRO-3 (deepspeed 0.19 stage3.py, partitioned_param_coordinator.py), per
    micro-batch: the all-gathers of `deepspeed_stage3_gathers` (the parameters above
    stage3_param_persistence_threshold, fetched per module and prefetched as the trace
    allows), and the gradients reduce-scattered in reduce_bucket_size buckets
    (`deepspeed_reduce_buckets` with dp's padding, backward's order: the inventory's
    reversed), persistent parameters' gradients too; once per step, after it, each
    persistent parameter all-gathered on its own (`_post_step`: `all_gather` of the
    persistent list, one call per parameter, padded to a multiple of dp) and the gradient
    norm all-reduced (DEEPSPEED_STAGE3_GRAD_NORM_BYTES). The step's last reduce-scatter (the
    embedding's bucket) is listed first."""
    from ..memory.engines.deepspeed import _persistent, _sizes, zero_settings

    dp, sizes = setup.dp, _sizes(cfg, setup, 0)
    fwd, bwd = deepspeed_stage3_gathers(cfg, setup, blocks)
    out = [c("all-gather", n * w, m * k, "fsdp", phase)
           for phase, calls in (("forward", fwd), ("backward", bwd)) for n, k in calls.items()]
    buckets = deepspeed_reduce_buckets(sizes[::-1], zero_settings(setup)["reduce_bucket_size"],
                                       dp)
    order = dict.fromkeys([buckets[-1], *buckets]) if buckets else {}
    out += [c("reduce-scatter", n * g, m * buckets.count(n), "fsdp", "backward") for n in order]
    kept = [-(-n // dp) * dp for n, keep in zip(sizes, _persistent(sizes, setup)) if keep]
    out += [c("all-gather", n * w, kept.count(n)) for n in dict.fromkeys(kept)]
    return out + [c("all-reduce", DEEPSPEED_STAGE3_GRAD_NORM_BYTES, 1)]


__all__ = ["CP_GRAD_BYTES", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES",
           "DEEPSPEED_GRAD_NORM_BYTES",
           "DEEPSPEED_OVERFLOW_FLAG_BYTES", "DEEPSPEED_STAGE3_GRAD_NORM_BYTES", "EP_COUNT_BYTES",
           "KINDS",
           "Collective", "collective_seconds",
           "collectives", "ddp_buckets", "deepspeed_reduce_buckets", "deepspeed_stage3_gathers",
           "ep_all_to_alls", "megatron_bucket_size", "megatron_buckets", "megatron_settings",
           "module_order_sizes",
           "MEGATRON_BUCKET", "MEGATRON_BUCKET_ALIGN", "MEGATRON_BUCKET_PER_RANK",
           "MEGATRON_GRAD_NORM_BYTES", "MEGATRON_MIN_BUCKET", "MEGATRON_OVERLAP",
           "MEGATRON_PARAM_ALIGN",
           "accumulation_assumption", "fsdp1_no_sync", "fsdp1_rounds",
           "pipeline_sends", "placement"]
