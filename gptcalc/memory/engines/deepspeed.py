"""DeepSpeed's ZeRO (deepspeed.runtime.zero, DeepSpeed 0.19), per rank, as DeepSpeed lays it out.

Stages 1-2 (`stage_1_and_2.py`, DeepSpeedZeroOptimizer): the 16-bit weights of a parameter
group are flattened into one buffer padded to a multiple of 2 x dp elements
(`nccl_start_alignment_factor = 2`, "4-byte alignment/sizeof(fp16)", times the dp world size)
and the parameters become views of it; each rank owns one 1/dp slice, whose fp32 copy
(`single_partition_of_fp32_groups`) is the master partition the client optimizer updates.
Stage 3 (`stage3.py`, `partition_parameters.py`): every parameter is partitioned on its own,
padded to a multiple of dp (`_padding_size`), ceil(n / dp) elements per rank, and the
partitions of all parameters live in one flat 16-bit buffer (`lp_param_buffer`); parameters of
at most `stage3_param_persistence_threshold` elements also stay whole on every rank
(`ds_persist`). In mode mixed the weights are bf16 (the `bf16` section; `fp16` alike) beside
an fp32 master partition and AdamW's two fp32 moments (12 bytes per partition element); in
mode fp32 the weights stay fp32 and DeepSpeed still keeps an fp32 partition copy beside them
(4 + 8 bytes per partition element). torch.optim.AdamW, the client optimizer, keeps one 4-byte
step counter per parameter it updates: one flat partition per parameter group (stage 3: per
sub-group of `sub_group_size` elements). Any other client optimizer sees the same flat 1-D
partitions: Adafactor keeps an unfactored second moment over them, bitsandbytes' 8-bit AdamW
quantizes them in blocks of 256.

The buffers and their sizes follow DeepSpeed's defaults (`runtime/zero/config.py`,
DeepSpeedZeroConfig) unless a ds_config changes them (`engine_settings` of the set-up,
`read_ds_config`). Scope: one parameter group (the client optimizer's `model.parameters()`),
no tensor parallel.

ZeRO-Offload and ZeRO-Infinity (`offload_optimizer`, `offload_param`; `deepspeed_host`): what
moves to the host leaves the device's states, and `deepspeed_host` counts what the host holds
per rank.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from ...config import GPTConfig
from ...dsconfig import OFFLOAD_DEFAULTS, ZERO_DEFAULTS
from ...errors import ConfigError
from ...training_setup import TrainingSetup
from ..ledger import GRADIENTS, OPTIMIZER_TEMPORARIES, STEADY_PHASES, Ledger, Phase, Term
from ..states import flat_optimizer_bytes, stage_tensors
from .base import Engine, Step, register
from .shards import RankStates, coords, first_rank, stage_of, step_counters, tensor_sizes

# stage_1_and_2.py: "4-byte alignment/sizeof(fp16) = 2"; the flat group is padded to this
# times the dp world size
NCCL_START_ALIGNMENT = 2
# stage3.py: `inf_or_nan_tracker = torch.zeros(1, dtype=torch.bool)`, kept for the run
INF_OR_NAN_TRACKER_BYTES = 1


# swap_tensor/utils.py: AIO_ALIGNED_BYTES; an NVMe swap buffer is padded to a multiple of
# AIO_ALIGNED_BYTES x intra_op_parallelism (default 1) bytes (`_io_aligned_numel`)
AIO_ALIGNED_BYTES = 1024


def zero_settings(setup: TrainingSetup) -> dict:
    """DeepSpeed's zero_optimization sizes and offload settings for the set-up: the defaults,
    overridden by the set-up's `engine_settings` pairs (a ds_config's, and --offload-*)."""
    return {**ZERO_DEFAULTS, **OFFLOAD_DEFAULTS, **dict(setup.engine_settings)}


def offload_devices(setup: TrainingSetup) -> tuple[str, str]:
    """(offload_optimizer, offload_param) devices: none, cpu or nvme; none at ZeRO 0."""
    s = zero_settings(setup)
    if setup.zero == 0:
        return "none", "none"
    return s["offload_optimizer"], s["offload_param"]


def _sizes(cfg: GPTConfig, setup: TrainingSetup, rank: int) -> list[int]:
    """Elements of every parameter tensor of `rank`'s pipeline stage, in inventory order."""
    pp_rank, _, _ = coords(rank, setup)
    return tensor_sizes(stage_tensors(cfg, setup, stage_of(setup, pp_rank)), setup.tp)


def _trained_sizes(cfg: GPTConfig, setup: TrainingSetup, rank: int) -> list[int]:
    """Elements of every tensor the optimizer steps on `rank`: every parameter's
    (`_sizes`), or under LoRA the adapters' only, lora_A (m r x in) and lora_B (out x m r) of
    each selected adapter (the client optimizer holds only them, so DeepSpeed's bit16 groups
    are theirs)."""
    if not setup.lora_rank:
        return _sizes(cfg, setup, rank)
    from ...lora import selected

    return [n for a in selected(cfg, setup.lora_targets)
            for n in [setup.lora_rank * a.rank_mult * a.in_features,
                      setup.lora_rank * a.rank_mult * a.out_features] * a.count]


def flat_group_elements(n: int, dp: int) -> int:
    """Elements of stages 1-2's flat 16-bit buffer of a group of `n` elements: padded to a
    multiple of NCCL_START_ALIGNMENT x dp (stage_1_and_2.py, `aligned_numel`)."""
    align = NCCL_START_ALIGNMENT * dp
    return -(-n // align) * align


def stage3_partition_elements(sizes: list[int], dp: int) -> int:
    """Elements of one rank's stage-3 partitions: each parameter padded to a multiple of dp
    and split evenly (partition_parameters.py, `_aligned_size // world`), summed."""
    return sum(-(-n // dp) for n in sizes)


def stage3_persistent_elements(sizes: list[int], setup: TrainingSetup) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank: those of at most
    stage3_param_persistence_threshold elements, in registration order while their running
    total stays within stage3_model_persistence_threshold (partition_parameters.py,
    `ds_persist`)."""
    s = zero_settings(setup)
    kept = 0
    for n in sizes:
        if n <= s["stage3_param_persistence_threshold"] and (
                kept + n <= s["stage3_model_persistence_threshold"]):
            kept += n
    return kept


def stage3_sub_group_elements(sizes: list[int], setup: TrainingSetup) -> list[int]:
    """Elements of each optimizer sub-group of stage 3: partitions are grouped until a group
    reaches sub_group_size elements (stage3.py, `_create_fp16_sub_groups`)."""
    limit, parts = zero_settings(setup)["sub_group_size"], [-(-n // setup.dp) for n in sizes]
    if limit >= sum(parts):
        return [sum(parts)]
    groups, acc = [], 0
    for i, p in enumerate(parts):
        acc += p
        if acc >= limit or i == len(parts) - 1:
            groups.append(acc)  # in place: a copy per group was quadratic in the tensors
            acc = 0
    return groups


def stage3_sub_groups(sizes: list[int], setup: TrainingSetup) -> int:
    """Optimizer sub-groups of stage 3 (`stage3_sub_group_elements`)."""
    return len(stage3_sub_group_elements(sizes, setup))


def _optimizer_bytes(setup: TrainingSetup, partitions: list[int]) -> int:
    """Bytes of the fp32 master partitions and the optimizer's states over flat partitions of
    `partitions` elements (`states.flat_optimizer_bytes`: each is one 1-D tensor to the client
    optimizer, so Adafactor keeps a full second moment there and 8-bit AdamW quantizes it
    block-wise): mode mixed's K (master included), or fp32's states plus DeepSpeed's fp32
    partition copy (4 per element)."""
    copy = 4 * sum(partitions) if setup.mode == "fp32" else 0
    return flat_optimizer_bytes(setup, partitions) + copy


def deepspeed_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """Weights, gradients and optimizer states on `rank` in a step.

    Stages 1-2: weights wb x flat (the padded flat buffer, `flat_group_elements`); gradients
    whole (stage 1, wb x n) or one partition (stage 2, wb x flat / dp); optimizer
    `_optimizer_bytes` over the flat / dp partition. Stage 3: weights wb x (partitions +
    persistent parameters); gradients wb x partitions (`grad_partitions_flat_buffer`, in the
    16-bit gradient-accumulation dtype); optimizer `_optimizer_bytes` over each sub-group's
    partition. Plus the optimizer's 0-d tensors (AdamW's step, Adafactor's RMS) per flat
    partition (stage 3: per sub-group).

    Device bytes only: with offload_optimizer the optimizer's bytes are the host's (0 here),
    and so are stage 3's gradient partitions (stage3.py: `grad_partitions_flat_buffer` lives
    on `self.device`, the CPU when the optimizer is offloaded); with offload_param (stage 3)
    the 16-bit partitions are the host's and the device keeps the persistent parameters
    (`deepspeed_host` counts what moved)."""
    sizes, wb, z, dp = _sizes(cfg, setup, rank), setup.weight_bytes, setup.zero, setup.dp
    opt_dev, param_dev = offload_devices(setup)
    on_device = opt_dev == "none"  # with offload_optimizer the states live on the host
    if z >= 3:
        part = stage3_partition_elements(sizes, dp)
        groups = stage3_sub_group_elements(sizes, setup)
        steps = step_counters(setup, len(groups)) if on_device else 0
        kept = stage3_persistent_elements(sizes, setup)
        return RankStates(wb * (kept + (part if param_dev == "none" else 0)),
                          wb * part if on_device else 0,
                          _optimizer_bytes(setup, groups) + steps if on_device else 0, steps,
                          "DeepSpeed ZeRO-3: each parameter padded to a multiple of dp, "
                          "persistent small parameters whole" + _offloaded(setup))
    n = sum(sizes)
    flat = flat_group_elements(n, dp)
    steps = step_counters(setup, 1) if on_device else 0
    return RankStates(wb * flat, wb * (flat // dp if z >= 2 else n),
                      _optimizer_bytes(setup, [flat // dp]) + steps if on_device else 0,
                      steps, f"DeepSpeed ZeRO-{z}: one flat group padded to a multiple of "
                             f"{NCCL_START_ALIGNMENT} x dp" + _offloaded(setup))


def deepspeed_lora_states(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """LoRA under ZeRO 1-2, by `finetune.finetune_state_bytes`' lines: the frozen base stays
    the module's own tensors, replicated (the client optimizer holds only the adapters, so
    DeepSpeed flattens only them); the adapters are one flat 16-bit group padded as
    `flat_group_elements` pads it, their gradients whole (stage 1) or one partition (stage 2),
    and the optimizer the fp32 master partition with its states over flat / dp elements
    (`_optimizer_bytes`) and one step counter. Stage 3: `deepspeed_stage3_lora_states`."""
    from ..finetune import finetune_state_bytes
    from ...lora import lora_params

    lines = finetune_state_bytes(cfg, setup)
    if setup.zero >= 3:
        return deepspeed_stage3_lora_states(cfg, setup, lines)
    n = sum(lora_params(cfg, setup.lora_rank, setup.lora_targets).values())
    wb, dp = setup.weight_bytes, setup.dp
    flat = flat_group_elements(n, dp)
    # with offload_optimizer the adapters' fp32 master and states are the host's
    # (`deepspeed_host`)
    on_device = offload_devices(setup)[0] == "none"
    return {**lines, "adapter/weights": wb * flat,
            "adapter/gradients": wb * (flat // dp if setup.zero >= 2 else n),
            "adapter/optimizer": _optimizer_bytes(setup, [flat // dp]) + step_counters(setup, 1)
            if on_device else 0}


def deepspeed_stage3_lora_states(cfg: GPTConfig, setup: TrainingSetup,
                                 lines: dict[str, int]) -> dict[str, int]:
    """LoRA under ZeRO-3, by `finetune.finetune_state_bytes`' lines (`lines`): ZeRO-3
    partitions every parameter of the module, the frozen base too, and keeps whole those of at
    most stage3_param_persistence_threshold elements (`_persistent`, over the base's tensors
    then the adapters'); the client optimizer holds the adapters only, so the flat 16-bit
    partition buffer (`lp_param_buffer`), the gradient partitions, the fp32 master partitions
    with their states and the step counters (one per sub-group) are the adapters'. base: the
    persistent tensors whole and each other one's padded 1/dp partition; adapters: the
    persistent ones whole beside every adapter's partition in the flat buffer
    (`stage3_partition_elements`), gradients wb x those partitions, optimizer
    `_optimizer_bytes` over their sub-groups (DeepSpeed's fp32 copy in mode fp32). A persistent
    base tensor keeps its partition beside its whole copy, as every parameter does
    (partition_parameters.py, `_partition_param`: `ds_tensor` on the local device). Measured
    on the CPU accelerator (DeepSpeed 0.19, 2 gloo ranks, the default and small thresholds).
    An NF4 base keeps `lines`' own base line.

    Offload (device bytes only; `deepspeed_host` counts what moved): offload_optimizer takes
    the adapters' gradient partitions, fp32 master and states to the host; offload_param the
    adapters' flat partition (`param_groups_fp16_flat_cpu_memory`) and the frozen base's
    non-persistent partitions (`_partition_param` places them on `remote_device`); persistent
    tensors stay whole with their partitions."""
    from ...lora import selected

    base = _sizes(cfg, setup, 0)
    adapters = [n for a in selected(cfg, setup.lora_targets)
                for n in [setup.lora_rank * a.rank_mult * a.in_features,
                          setup.lora_rank * a.rank_mult * a.out_features] * a.count]
    whole = _persistent(base + adapters, setup)
    dp, wb = setup.dp, setup.weight_bytes
    opt_dev, param_dev = offload_devices(setup)
    on_device, moved = opt_dev == "none", param_dev != "none"
    part = stage3_partition_elements(adapters, dp)
    groups = stage3_sub_group_elements(adapters, setup)
    kept = sum(n for n, k in zip(adapters, whole[len(base):]) if k)
    out = {**lines, "adapter/weights": wb * (kept + (0 if moved else part)),
           "adapter/gradients": wb * part if on_device else 0,
           "adapter/optimizer": _optimizer_bytes(setup, groups)
           + step_counters(setup, len(groups)) if on_device else 0}
    if setup.base_dtype != "nf4":
        wbase = 2 if setup.mode == "amp" else wb
        out["base/weights"] = wbase * sum(n + -(-n // dp) if k else 0 if moved else -(-n // dp)
                                          for n, k in zip(base, whole))
    return out


def stage3_frozen_partitions(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Elements of the frozen base's non-persistent partitions on one rank under LoRA at stage
    3: each tensor padded to a multiple of dp and split (`_persistent` over the base's
    tensors then the adapters')."""
    base = _sizes(cfg, setup, 0)
    whole = _persistent(base + _trained_sizes(cfg, setup, 0), setup)
    return sum(-(-n // setup.dp) for n, k in zip(base, whole) if not k)


def _offloaded(setup: TrainingSetup) -> str:
    """The offload of the set-up, for a rule's words."""
    opt_dev, param_dev = offload_devices(setup)
    return "".join(f"; {what} offloaded to {dev}" for what, dev in (
        ("optimizer", opt_dev), ("16-bit parameter partitions", param_dev)) if dev != "none")


def deepspeed_buffers(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """The buffers DeepSpeed keeps for the whole run, on one rank.

    Stage 3 (stage3.py, `_setup_for_real_optimizer`): with contiguous_gradients (default on)
    one reduce bucket of reduce_bucket_size elements in the communication dtype (the 16-bit
    dtype in mode mixed, fp32 in fp32), allocated at initialisation whatever the model's size;
    the one-byte `inf_or_nan_tracker`. The gradient partitions' flat buffer is the gradients
    of `deepspeed_rank_states`, kept too (`deepspeed_resident`). Stages 1-2 keep no buffer
    between steps: their reduce buckets are made in backward and released after the step
    (`_release_ipg_buffers`)."""
    if setup.zero < 3:
        return {}
    return {REDUCE_BUCKET.label: reduce_bucket_bytes(setup),
            INF_NAN_TRACKER.label: INF_OR_NAN_TRACKER_BYTES}


def reduce_bucket_bytes(setup: TrainingSetup) -> int:
    """Bytes of one reduce bucket: reduce_bucket_size elements in the gradients' dtype (the
    16-bit dtype in mode mixed, fp32 in fp32), 0 without contiguous_gradients."""
    s = zero_settings(setup)
    return setup.weight_bytes * s["reduce_bucket_size"] if s["contiguous_gradients"] else 0


# ---------------------------------------------------------------- stage 3's gathered parameters


@dataclass(frozen=True)
class TraceModule:
    """One entry of stage 3's module trace: a module's fetch (`fetch_sub_module`), with its
    own parameters (indices into the trace's sizes); a container has none, and its fetch
    still runs the prefetcher."""

    key: str
    params: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """The modules of one forward and backward in the order the coordinator records them
    (`record_module`), the elements and persistence of each parameter, and the trace indices
    of the step's moments."""

    order: tuple[TraceModule, ...]
    sizes: tuple[int, ...]
    persistent: tuple[bool, ...]
    marks: dict[str, int]


def _modules(tensors, first: int, tag: str) -> list[tuple[str, list[int]]]:
    """The (module path, parameter indices) of `tensors`, in their order, numbered from
    `first`: a tensor's module is its name less the last part; `copies` parameters each."""
    out: dict[str, list[int]] = {}
    for t in tensors:
        for _ in range(t.copies):
            out.setdefault(f"{tag}{t.name.rsplit('.', 1)[0]}", []).append(first)
            first += 1
    return list(out.items())


def _block_calls(mods: list[tuple[str, list[int]]], tag: str, backward: bool
                 ) -> list[TraceModule]:
    """One block's submodule calls: a module under a container (`attn.q_proj` under `attn`)
    is preceded by the container's own call, once per run of its children; backward runs the
    groups in reverse, each container before its children in reverse."""
    groups: list[tuple[str | None, list[TraceModule]]] = []
    for path, params in mods:
        parts = path[len(tag):].split(".")
        parent = tag + parts[0] if len(parts) > 1 else None
        if not groups or groups[-1][0] != parent or parent is None:
            groups.append((parent, []))
        groups[-1][1].append(TraceModule(path, tuple(params)))
    out: list[TraceModule] = []
    for parent, children in (reversed(groups) if backward else groups):
        out += [TraceModule(parent)] if parent else []
        out += list(reversed(children)) if backward else children
    return out


def stage3_trace(cfg: GPTConfig, setup: TrainingSetup, rank: int, blocks: int) -> Trace:
    """Stage 3's module trace of one step over `blocks` blocks, as the coordinator records it
    for the reference model and Hugging Face decoders (partitioned_param_coordinator.py,
    `record_module`; parameter_offload.py's hooks): forward: the root, the embeddings, each
    block (the block, then its submodules: a norm, the attention container and its
    projections, a norm, the MLP container and its Linears), the final norm and the head;
    backward (the pre-backward hooks): the root, the head, the final norm, the blocks in
    reverse, each block before its submodules in reverse, the embeddings. With activation
    checkpointing that re-runs a block's forward (`full`, `op`), the block's submodules are
    fetched again in forward order right after the block's backward hook. Parameters are
    the inventory's tensors of `rank`'s stage (tensor-parallel shards), a tied lm_head the
    token embedding's; the gate and up Linears of a gated MLP run in inventory order."""
    pp_rank, _, _ = coords(rank, setup)
    tensors = stage_tensors(cfg, setup, stage_of(setup, pp_rank))
    sizes: list[int] = []
    emb = _modules(tensors_of(tensors, "embedding"), 0, "")
    first = sum(len(p) for _, p in emb)
    per_block = tensors_of(tensors, "block")
    block_mods = []
    for b in range(blocks):
        mods = _modules(per_block, first, f"h.{b}.")
        first += sum(len(p) for _, p in mods)
        block_mods.append(mods)
    head = _modules(tensors_of(tensors, "head"), first, "")
    if cfg.tie_embeddings and not any(k == "lm_head" for k, _ in head) and emb:
        head.append(("lm_head", emb[0][1]))
    for group in (tensors_of(tensors, "embedding"), *[per_block] * blocks,
                  tensors_of(tensors, "head")):
        sizes += [t.shard(setup.tp) for t in group for _ in range(t.copies)]
    rerun = setup.recompute in ("full", "op")
    fwd = [TraceModule("root"), *(TraceModule(k, tuple(p)) for k, p in emb)]
    for b, mods in enumerate(block_mods):
        fwd += [TraceModule(f"h.{b}"), *_block_calls(mods, f"h.{b}.", backward=False)]
    fwd += [TraceModule(k, tuple(p)) for k, p in head]
    bwd = [TraceModule("root"), *(TraceModule(k, tuple(p)) for k, p in reversed(head))]
    marks = {"attention": next((i for i, m in enumerate(fwd) if m.key.endswith(".attn.c_proj")
                                and m.key.startswith(f"h.{blocks - 1}.")), len(fwd) - 1),
             "forward_end": len(fwd)}
    for b in reversed(range(blocks)):
        if b == blocks - 1:
            marks["last_block"] = len(fwd) + len(bwd)
        bwd.append(TraceModule(f"h.{b}"))
        if rerun:
            bwd += _block_calls(block_mods[b], f"h.{b}.", backward=False)
        bwd += _block_calls(block_mods[b], f"h.{b}.", backward=True)
        if b == blocks - 1:
            marks["last_block_end"] = len(fwd) + len(bwd)
    marks["embedding"] = len(fwd) + len(bwd)
    bwd += [TraceModule(k, tuple(p)) for k, p in reversed(emb)]
    persistent = _persistent(sizes, setup)
    return Trace(tuple(fwd + bwd), tuple(sizes), tuple(persistent), marks)


def stage3_gathered(trace: Trace, setup: TrainingSetup, calls: list | None = None
                    ) -> tuple[list[int], list[int]]:
    """Elements gathered whole (non-persistent parameters all-gathered or in flight) before
    and after each fetch of a steady-state step (its trace recorded by an earlier one), a
    replay of partitioned_param_coordinator.py's `PartitionedParameterCoordinator`:

    - `fetch_sub_module`: gather the module's parameters; pop its own entries off the
      parameter queue (the trace's parameters in order, each with the step of its use), then
      prefetch: pop entries while the elements newly gathered stay below
      min(stage3_max_live_parameters - available, stage3_prefetch_bucket_size) (none when
      the bucket is 0), gathering those not available and marking every popped parameter as
      fetched for its step (`__most_recent_step_id_param_fetched_for`);
    - `release_sub_module` (`__params_to_release`), after a module's forward or backward:
      release its non-persistent parameters unless marked fetched for a later step, or used
      again by a module reached before the traversed elements of the modules after it reach
      stage3_max_reuse_distance (`params_traversed >= __max_reuse_dist_in_numel`).

    A container's release frees nothing (no parameters of its own), so only leaves release,
    right after their fetch. Scope: the steady-state step; the first step has no trace and
    releases every parameter after its module (nothing is gathered beyond the module
    running); `memory_efficient_linear` and the all-gather's transient flat buffer are not
    modelled. `calls`, when given, receives one (trace index, parameter indices) per
    all-gather the replay issues: a fetch's own parameters not yet gathered, then its
    prefetch (`__all_gather_params`: one coalesced call each)."""
    s = zero_settings(setup)
    bucket, live_max = s["stage3_prefetch_bucket_size"], s["stage3_max_live_parameters"]
    reuse, order, size = s["stage3_max_reuse_distance"], trace.order, trace.sizes
    queue = [(p, i) for i, m in enumerate(order) for p in sorted(set(m.params))]
    uses: dict[int, list[int]] = {}
    cum = [0]  # elements of the modules before each trace index
    for i, m in enumerate(order):
        for p in m.params:
            uses.setdefault(p, []).append(i)
        cum.append(cum[-1] + sum(size[p] for p in m.params))
    avail = list(trace.persistent)
    fetched: dict[int, int] = {}
    q = n_avail = live = 0
    before, after = [], []

    def gather(params, at: int) -> None:
        nonlocal n_avail, live
        new = []
        for p in params:
            if not avail[p]:
                avail[p], n_avail, live = True, n_avail + size[p], live + size[p]
                new.append(p)
        if calls is not None and new:
            calls.append((at, new))

    for i, m in enumerate(order):
        before.append(live)
        gather(m.params, i)
        pending = {p for p in m.params if fetched.get(p, -1) < i}
        popped: set[int] = set()
        while q < len(queue) and len(popped) < len(pending):
            p, at = queue[q]
            q, fetched[p] = q + 1, at
            popped.add(p)
        if bucket > 0:
            limit, numel, chosen = min(live_max - n_avail, bucket), 0, []
            while q < len(queue) and numel < limit:
                p, at = queue[q]
                q, fetched[p] = q + 1, max(fetched.get(p, -1), at)
                if not avail[p] and p not in chosen:
                    chosen.append(p)
                    numel += size[p]
            gather(chosen, i)
        after.append(live)
        # the modules scanned for reuse: those before the traversed elements reach `reuse`
        end = bisect_left(cum, cum[i + 1] + reuse, lo=i + 1)
        for p in set(m.params):
            # a parameter not used again in the step is released however far the scan
            # reaches (it scans this step's trace only, `__submodule_order[step_id:]`)
            again = uses[p][-1] > i and uses[p][bisect_left(uses[p], i + 1)] < end
            keep = trace.persistent[p] or fetched.get(p, -1) > i + 1 or again
            if avail[p] and not keep:
                avail[p], n_avail, live = False, n_avail - size[p], live - size[p]
    return before, after


def tensors_of(tensors, place: str) -> list:
    """The tensors of one place (embedding, block, head), in inventory order."""
    return [t for t in tensors if t.place == place]


def _persistent(sizes: list[int], setup: TrainingSetup) -> list[bool]:
    """Whether each parameter stays whole (`stage3_persistent_elements`' rule)."""
    s = zero_settings(setup)
    kept, out = 0, []
    for n in sizes:
        keep = n <= s["stage3_param_persistence_threshold"] and (
            kept + n <= s["stage3_model_persistence_threshold"])
        kept += n if keep else 0
        out.append(keep)
    return out


def _aio_aligned(n: int, element_bytes: int) -> int:
    """`n` elements padded to a multiple of AIO_ALIGNED_BYTES / element size (swap_tensor's
    `_io_aligned_numel`, intra_op_parallelism 1)."""
    align = AIO_ALIGNED_BYTES // element_bytes
    return -(-n // align) * align


def deepspeed_host(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """Bytes the host holds for `rank` under ZeRO-Offload / ZeRO-Infinity, by line; {} with
    no offload. P = the rank's partition elements, wb the 16-bit (fp32 in mode fp32) size.

    Stages 1-2, offload_optimizer of any device (stage_1_and_2.py treats every device but
    none as `cpu_offload`; `self.device = 'cpu'`): the fp32 master partition and the
    optimizer's states over it (`single_partition_of_fp32_groups`, as on the device without
    offload), its fp32 gradient, 4 P (`initialize_optimizer_states`: `single_grad_partition`
    on the CPU), the 16-bit copy-back buffer, wb P (`param_buffer_of_bit16_for_cpu_offload_
    groups`), and the gradient staging buffer of the largest parameter, wb x max numel
    (`temp_grad_buffer_for_cpu_offload`).

    Stage 3 (stage3.py): offload_optimizer: the 16-bit gradient partitions, wb P
    (`grad_partitions_flat_buffer` on `self.device`, the CPU); cpu: each sub-group's fp32
    partition and states (`_create_fp32_partitions`, `subgroup_to_device` 'cpu') and its fp32
    gradient, 4 P (`subgroup_gradient_buffer`); nvme: the states on NVMe behind buffer_count
    pinned fp32 buffers of the largest sub-group, AIO-aligned (optimizer_utils.py,
    `SwapBufferManager(num_elems=largest_numel, count=buffer_count)`). offload_param: cpu:
    the 16-bit partitions, wb P (`_create_param_groups_fp16_flat_cpu_memory`); nvme: at most
    max_in_cpu of them (1 element when none) and the swapper's buffer_count buffers of
    buffer_size elements, AIO-aligned (partitioned_param_swapper.py, `self.buffers`). Under
    LoRA the partitions are the adapters' (the client optimizer's), and with offload_param cpu
    the frozen base's non-persistent partitions too (`stage3_frozen_partitions`).

    Scope: ratio 1 (every sub-group offloaded); NVMe optimizer's gradient buffer, the
    parameter swapper's per-parameter bookkeeping and stages 1-2's gradient-accumulation
    copies (`accumulated_grads_in_cpu`, with grad_accum > 1) are not counted."""
    opt_dev, param_dev = offload_devices(setup)
    if opt_dev == param_dev == "none":
        return {}
    s, sizes, wb = zero_settings(setup), _trained_sizes(cfg, setup, rank), setup.weight_bytes
    out: dict[str, int] = {}
    if setup.zero <= 2:
        part = flat_group_elements(sum(sizes), setup.dp) // setup.dp
        out[HOST_STATES] = _optimizer_bytes(setup, [part]) + step_counters(setup, 1)
        out[HOST_FP32_GRADS] = 4 * part
        out[HOST_COPY_BACK] = wb * part
        out[HOST_STAGING] = wb * max(sizes)
        return out
    part = stage3_partition_elements(sizes, setup.dp)
    groups = stage3_sub_group_elements(sizes, setup)
    if opt_dev != "none":
        out[HOST_GRAD16] = wb * part
    if opt_dev == "cpu":
        out[HOST_STATES] = _optimizer_bytes(setup, groups) + step_counters(setup, len(groups))
        out[HOST_FP32_GRADS] = 4 * sum(groups)
    elif opt_dev == "nvme":
        out[HOST_OPT_SWAP] = (
            s["offload_optimizer_buffer_count"] * 4 * _aio_aligned(max(groups), 4))
    if param_dev == "cpu":
        out[HOST_PARAMS] = wb * part
        if setup.lora_rank:
            wbase = 2 if setup.mode == "amp" else wb
            out[HOST_FROZEN_PARAMS] = wbase * stage3_frozen_partitions(cfg, setup)
    elif param_dev == "nvme":
        out[HOST_PARAMS] = wb * max(1, min(part, s["offload_param_max_in_cpu"]))
        out[HOST_PARAM_SWAP] = (
            s["offload_param_buffer_count"] * wb * _aio_aligned(
                s["offload_param_buffer_size"], wb))
    return out


HOST_STATES = "fp32 master partition and optimizer states"
HOST_FP32_GRADS = "fp32 gradient partition"
HOST_PARAMS = "16-bit parameter partitions (param_groups_fp16_flat_cpu_memory)"
HOST_FROZEN_PARAMS = "frozen 16-bit parameter partitions (LoRA's base, offload_param)"
HOST_PARAM_SWAP = "NVMe parameter swap buffers (buffer_count x buffer_size)"
HOST_OPT_SWAP = "NVMe optimizer swap buffers (buffer_count x largest sub-group, fp32)"
HOST_GRAD16 = "16-bit gradient partitions (grad_partitions_flat_buffer)"
HOST_STAGING = "gradient staging buffer (temp_grad_buffer_for_cpu_offload)"
HOST_COPY_BACK = "16-bit copy-back buffer (param_buffer_of_bit16_for_cpu_offload_groups)"
REDUCE_BUCKET = Term("DeepSpeed reduce bucket (reduce_bucket_size)")
OFFLOAD_STAGING = Term("DeepSpeed offload gradient staging buffer (temp_grad_buffer_for_gpu_"
                       "offload)")
INF_NAN_TRACKER = Term("DeepSpeed inf/nan tracker")
GATHERED = Term("DeepSpeed gathered parameters (all-gathered and prefetched)")


def deepspeed_adjust(ledger: Ledger, step: Step) -> None:
    """What DeepSpeed holds beyond its states at each phase of the step.

    Stages 1-2 (stage_1_and_2.py): the first gradient hook of backward (`process_gradients` ->
    `setup_buckets`) allocates the reduce bucket, reduce_bucket_size elements (one; two with
    overlap_comm, whose default is off below stage 3); it lives until the gradients are
    reduced at the end of backward (`_release_ipg_buffers`). In the optimizer step the 16-bit
    gradients are gone (the fp32 gradient partition is an optimizer temporary); under LoRA the
    same bucket, over the adapters' gradients. Nothing at ZeRO 0; DeepSpeed keeps its layout
    and buffers at dp = 1 too.

    Stage 3 (stage3.py): its buffers (`deepspeed_buffers`) and the gradient partitions'
    flat buffer are alive in every phase; beside them the parameters the coordinator holds
    gathered at each moment (`stage3_moments`), none in the optimizer step.

    With offload_optimizer the optimizer step's temporaries are the host's (0 here); stages
    1-2 keep a device buffer of the largest parameter's 16-bit gradient for the copies to the
    host (`staging_bytes`)."""
    cfg, setup = step.cfg, step.setup
    if setup.zero == 0:
        return
    offloaded = offload_devices(setup)[0] != "none"
    if offloaded:  # the update runs on the host (DeepSpeedCPUAdam over the host partition)
        ledger.replace(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES, 0)
    if setup.zero <= 2 and offloaded:
        ledger.add_each(ledger.phases, OFFLOAD_STAGING, staging_bytes(cfg, setup, step.stage))
    if setup.zero <= 2:
        bucket = reduce_bucket_bytes(setup)
        ledger.add(Phase.BACKWARD_LAST_BLOCK, REDUCE_BUCKET, bucket)
        ledger.add(Phase.BACKWARD_END, REDUCE_BUCKET, bucket)
        # step(): the 16-bit gradients are flattened into the fp32 gradient partition and
        # freed (`averaged_gradients[i] = None`) before the client optimizer runs
        ledger.replace(Phase.OPTIMIZER_STEP, GRADIENTS, 0)
        return
    rank = first_rank(setup, step.stage)
    # LoRA: the gradient partitions cover the adapters (the client optimizer's parameters);
    # every parameter, frozen or not, is partitioned and gathered alike
    grads = step.gradients if setup.lora_rank else deepspeed_rank_states(cfg, setup,
                                                                         rank).gradients
    gathered = stage3_moments(cfg, setup, rank)
    forward = (*ledger.forward_phases(), Phase.BACKWARD_START)
    for phase in dict.fromkeys((*STEADY_PHASES, *forward)):
        ledger.add(phase, REDUCE_BUCKET, reduce_bucket_bytes(setup))
        ledger.add(phase, INF_NAN_TRACKER, INF_OR_NAN_TRACKER_BYTES)
        (ledger.add if phase in forward else ledger.replace)(phase, GRADIENTS, grads)
        if phase in gathered:
            ledger.add(phase, GATHERED, setup.weight_bytes * gathered[phase])


def stage3_blocks(cfg: GPTConfig, setup: TrainingSetup, rank: int) -> int:
    """Blocks of the trace `stage3_moments` replays: the stage's, or when fewer suffice, two
    more than the largest of the reuse distance, the prefetch bucket and the live limit
    spans in blocks (a parameter farther than that from the forward's end is released after
    its forward and not prefetched before the backward's last block), so that the replay
    costs the same at any depth."""
    s = zero_settings(setup)
    window = max(s["stage3_max_reuse_distance"], s["stage3_prefetch_bucket_size"],
                 s["stage3_max_live_parameters"])
    pp_rank, _, _ = coords(rank, setup)
    tensors = stage_tensors(cfg, setup, stage_of(setup, pp_rank))
    per_block = sum(t.shard(setup.tp) * t.copies for t in tensors_of(tensors, "block"))
    layers = max((t.layers for t in tensors_of(tensors, "block")), default=0)
    return min(layers, 2 + -(-window // max(1, per_block)))


def stage3_moments(cfg: GPTConfig, setup: TrainingSetup, rank: int,
                   blocks: int | None = None) -> dict[Phase, int]:
    """Elements stage 3 holds gathered at each moment of a steady-state step on `rank`
    (`stage3_gathered` over `stage3_trace`): inside the last block's attention core (before
    its output projection's fetch), at the forward's end (after the head's release), at the
    backward's start (after the root's backward fetch and its prefetch), the largest during
    the last block's backward (after each fetch of its section, the re-run forward under
    checkpointing included), and while the embedding's backward runs."""
    blocks = stage3_blocks(cfg, setup, rank) if blocks is None else blocks
    trace = stage3_trace(cfg, setup, rank, blocks)
    before, after = stage3_gathered(trace, setup)
    mk = trace.marks
    out = {Phase.ATTENTION_CORE: before[mk["attention"]],
           Phase.FORWARD_END: before[mk["forward_end"]],
           Phase.BACKWARD_START: after[mk["forward_end"]],
           Phase.BACKWARD_END: after[min(mk["embedding"], len(after) - 1)]}
    if blocks:
        out[Phase.BACKWARD_LAST_BLOCK] = max(after[mk["last_block"]:mk["last_block_end"]])
    return out


def staging_bytes(cfg: GPTConfig, setup: TrainingSetup, stage: str = "first") -> int:
    """Stages 1-2 under offload_optimizer: the device buffer of the largest parameter's
    16-bit gradient, allocated at initialisation (stage_1_and_2.py,
    `temp_grad_buffer_for_gpu_offload`, largest_param_numel elements of `self.dtype`)."""
    if setup.zero == 0 or setup.zero >= 3 or offload_devices(setup)[0] == "none":
        return 0
    return setup.weight_bytes * max(_trained_sizes(cfg, setup, first_rank(setup, stage)))


def deepspeed_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between steps: its weights (stages 1-2 the whole flat buffer, stage
    3 its partitions and the persistent parameters), the fp32 master partition and AdamW's
    states, stage 3's gradient partitions (`grad_partitions_flat_buffer` lives for the run)
    and `deepspeed_buffers`. Stages 1-2 free their 16-bit gradients after the step. With
    offload the states that moved are the host's (`deepspeed_host`)."""
    st = deepspeed_rank_states(cfg, setup, rank)
    out = {"weights": st.weights, "optimizer states": st.optimizer}
    if setup.zero >= 3:
        out["DeepSpeed gradient partitions (grad_partitions_flat_buffer)"] = st.gradients
    staging = staging_bytes(cfg, setup, "last" if coords(rank, setup)[0] else "first")
    if staging:
        out[OFFLOAD_STAGING.label] = staging
    return {**out, **deepspeed_buffers(cfg, setup)}


class DeepSpeed(Engine):
    """DeepSpeed's ZeRO stages 1-3; at ZeRO 0 it replicates every state as DDP does."""

    name = "deepspeed"
    help = "deepspeed (DeepSpeed's ZeRO; the default for --zero 1-3)"
    stages = (0, 1, 2, 3)
    default_for = (1, 2, 3)
    mixed_by_default = True
    # DeepSpeed's sequence parallelism is Ulysses (heads exchanged all-to-all), not a ring
    context_parallel = False

    def assumptions(self, setup: TrainingSetup) -> str:
        placed = [words for key, words in (
            ("partition_activations", "split over tp (partition_activations)"),
            ("cpu_checkpointing", "in host memory (cpu_checkpointing)"))
            if dict(setup.engine_settings).get(key)]
        checkpoints = f"; activation checkpoints {' and '.join(placed)}" + (
            "" if setup.recompute == "full" else ", unused without --recompute full") \
            if placed else ""
        buffers = f"; DeepSpeed {describe_buffers(setup)}" if setup.zero >= 1 else ""
        return buffers + checkpoints

    def check(self, setup: TrainingSetup) -> None:
        super().check(setup)
        opt_dev, param_dev = zero_settings(setup)["offload_optimizer"], zero_settings(setup)[
            "offload_param"]
        if (opt_dev, param_dev) == ("none", "none"):
            return
        field = "offload_optimizer" if opt_dev != "none" else "offload_param"
        if setup.zero == 0:
            raise ConfigError(field, "DeepSpeed offloads ZeRO's partitions: give --zero 1-3")
        if param_dev != "none" and setup.zero != 3:
            raise ConfigError("offload_param", "parameter offload is ZeRO-3's: give --zero 3")
        if zero_settings(setup)["offload_optimizer_ratio"] != 1.0:
            raise ConfigError("deepspeed_config", "a partial optimizer offload (ratio < 1) is "
                                                  "not modelled")
        flag = f"--{field.replace('_', '-')}"
        # LoRA: the adapters' states offloaded at stages 1-3 and the base's partitions at
        # stage 3 to the CPU (twinned); stage 3's NVMe swappers do not run here (stages 1-2
        # offload to the CPU whatever the device)
        if setup.lora_rank and setup.zero == 3 and "nvme" in (opt_dev, param_dev):
            field = "offload_optimizer" if opt_dev == "nvme" else "offload_param"
            raise ConfigError(field, f"--{field.replace('_', '-')} nvme with --lora-rank is "
                                     "not modelled: LoRA's offload is modelled to the CPU")
        for other, given in (("--tp", setup.tp > 1),
                             ("--pp", setup.pp > 1),
                             ("optimizer_in_backward", setup.optimizer_in_backward)):
            if given:
                raise ConfigError(field, f"{flag} with {other} is not modelled: DeepSpeed "
                                         "offload is modelled with data parallelism alone "
                                         "and a step after backward")

    def host(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return deepspeed_host(cfg, setup, rank)

    def replicated(self, setup: TrainingSetup) -> bool:
        return setup.zero == 0

    def finetune_states(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        return deepspeed_lora_states(cfg, setup) if setup.zero else super().finetune_states(
            cfg, setup)

    def finetune_resident(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        """LoRA's resident lines: stages 1-2 with, under offload_optimizer, the device's
        staging buffer of the largest adapter's 16-bit gradient (`staging_bytes`); stage 3
        with the adapters' gradient partitions and its buffers, as in full training
        (`deepspeed_resident`)."""
        out = super().finetune_resident(cfg, setup)
        staging = staging_bytes(cfg, setup)
        if setup.zero >= 3:  # the gradient partitions (on the host when offloaded), buffers
            grads = self.finetune_states(cfg, setup)["adapter/gradients"]
            if grads:
                out["DeepSpeed gradient partitions (grad_partitions_flat_buffer)"] = grads
            return {**out, **deepspeed_buffers(cfg, setup)}
        return {**out, OFFLOAD_STAGING.label: staging} if staging else out

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        return super().rank_states(cfg, setup, rank) if setup.zero == 0 else (
            deepspeed_rank_states(cfg, setup, rank))

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return super().resident(cfg, setup, rank) if setup.zero == 0 else (
            deepspeed_resident(cfg, setup, rank))

    def master_gradient_bytes(self, setup: TrainingSetup, params: int) -> int:
        """The fp32 gradient partition: from ZeRO-1 on each rank flattens only its own
        partition (stage_1_and_2.py, `single_partition_of_fp32_groups`' gradients)."""
        if setup.mode != "mixed" or offload_devices(setup)[0] != "none":
            return 0  # offloaded: the host's (`deepspeed_host`)
        return 4 * (-(-params // setup.dp) if setup.zero >= 1 else params)

    def largest_optimizer_tensor(self, cfg: GPTConfig, setup: TrainingSetup,
                                 params: int) -> int:
        """ZeRO 1-2: the rank's flat partition; ZeRO-3: its largest sub-group's partition
        (each is one tensor to the client optimizer)."""
        if setup.zero == 0 or setup.lora_rank:
            return super().largest_optimizer_tensor(cfg, setup, params)
        if setup.zero >= 3:
            return max(stage3_sub_group_elements(_sizes(cfg, setup, 0), setup))
        return flat_group_elements(params, setup.dp) // setup.dp

    def adjust(self, ledger: Ledger, step: Step) -> None:
        deepspeed_adjust(ledger, step)


register(DeepSpeed())


def describe_buffers(setup: TrainingSetup) -> str:
    """The DeepSpeed buffer sizes of the set-up, for the first line of a command."""
    s = zero_settings(setup)
    given = {k: v for k, v in setup.engine_settings if k in ZERO_DEFAULTS}
    keys = ["reduce_bucket_size", "allgather_bucket_size"] if setup.zero < 3 else [
        "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance"]
    parts = [f"{k} {s[k]:,}" for k in keys]
    if not s["contiguous_gradients"]:
        parts.append("contiguous_gradients off")
    src = "ds_config" if given else "DeepSpeed's defaults"
    opt_dev, param_dev = offload_devices(setup)
    moved = "".join(f"; offload_{what} {dev}" for what, dev in (
        ("optimizer", opt_dev), ("param", param_dev)) if dev != "none")
    return f"buckets ({src}): " + ", ".join(parts) + moved


__all__ = ["DeepSpeed", "ZERO_DEFAULTS", "deepspeed_adjust", "deepspeed_buffers",
           "deepspeed_host", "deepspeed_lora_states", "stage3_frozen_partitions", "deepspeed_stage3_lora_states", "deepspeed_rank_states", "deepspeed_resident", "offload_devices", "describe_buffers",
           "flat_group_elements", "stage3_partition_elements", "stage3_persistent_elements",
           "zero_settings"]
