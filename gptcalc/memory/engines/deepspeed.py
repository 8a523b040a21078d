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
sub-group of `sub_group_size` elements).

The buffers and their sizes follow DeepSpeed's defaults (`runtime/zero/config.py`,
DeepSpeedZeroConfig) unless a ds_config changes them (`engine_settings` of the set-up,
`read_ds_config`). Scope: one parameter group (the client optimizer's `model.parameters()`),
no offload, no tensor parallel.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

import sys
from typing import Any

from ...config import GPTConfig
from ...errors import ConfigError
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..ledger import GRADIENTS, STEADY_PHASES, Ledger, Phase, Term
from ..states import OPTIMIZER_BYTES, STEP_COUNTER_BYTES, stage_tensors
from .base import Engine, Step, register
from .shards import RankStates, coords, first_rank, stage_of

# DeepSpeedZeroConfig's defaults (deepspeed/runtime/zero/config.py), in ds_config's spelling
ZERO_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,  # elements, in the communication dtype
    "allgather_bucket_size": 500_000_000,  # elements (stages 1-2)
    "stage3_prefetch_bucket_size": 50_000_000,  # elements
    "stage3_param_persistence_threshold": 100_000,  # elements of one parameter
    "stage3_model_persistence_threshold": sys.maxsize,  # elements of all persistent ones
    "stage3_max_live_parameters": 1_000_000_000,  # elements
    "sub_group_size": 1_000_000_000,  # elements of one optimizer sub-group (stage 3)
    "contiguous_gradients": True,
}
# stage_1_and_2.py: "4-byte alignment/sizeof(fp16) = 2"; the flat group is padded to this
# times the dp world size
NCCL_START_ALIGNMENT = 2
# stage3.py: `inf_or_nan_tracker = torch.zeros(1, dtype=torch.bool)`, kept for the run
INF_OR_NAN_TRACKER_BYTES = 1


def zero_settings(setup: TrainingSetup) -> dict[str, int]:
    """DeepSpeed's zero_optimization sizes for the set-up: the defaults, overridden by the
    set-up's `engine_settings` pairs (a ds_config's)."""
    return {**ZERO_DEFAULTS, **dict(setup.engine_settings)}


def _sizes(cfg: GPTConfig, setup: TrainingSetup, rank: int) -> list[int]:
    """Elements of every parameter tensor of `rank`'s pipeline stage, in inventory order."""
    pp_rank, _, _ = coords(rank, setup)
    out: list[int] = []
    for t in stage_tensors(cfg, setup, stage_of(setup, pp_rank)):
        out += [t.shard(setup.tp)] * t.count
    return out


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


def stage3_sub_groups(sizes: list[int], setup: TrainingSetup) -> int:
    """Optimizer sub-groups of stage 3: partitions are grouped until a group reaches
    sub_group_size elements (stage3.py, `_create_fp16_sub_groups`)."""
    limit, parts = zero_settings(setup)["sub_group_size"], [-(-n // setup.dp) for n in sizes]
    if limit >= sum(parts):
        return 1
    groups, acc = 0, 0
    for i, p in enumerate(parts):
        acc += p
        if acc >= limit or i == len(parts) - 1:
            groups, acc = groups + 1, 0
    return groups


def _optimizer_bytes(setup: TrainingSetup) -> int:
    """Bytes per partition element of the fp32 master partition and the optimizer's states:
    mode mixed's K (master included), or fp32's states plus DeepSpeed's fp32 partition copy."""
    return OPTIMIZER_BYTES[setup.mode][setup.optimizer] + (4 if setup.mode == "fp32" else 0)


def deepspeed_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """Weights, gradients and optimizer states on `rank` in a step.

    Stages 1-2: weights wb x flat (the padded flat buffer, `flat_group_elements`); gradients
    whole (stage 1, wb x n) or one partition (stage 2, wb x flat / dp); optimizer
    `_optimizer_bytes` x flat / dp. Stage 3: weights wb x (partitions + persistent
    parameters); gradients wb x partitions (`grad_partitions_flat_buffer`, in the 16-bit
    gradient-accumulation dtype); optimizer `_optimizer_bytes` x partitions. Plus AdamW's
    step counter per flat partition (stage 3: per sub-group)."""
    sizes, wb, z, dp = _sizes(cfg, setup, rank), setup.weight_bytes, setup.zero, setup.dp
    k = _optimizer_bytes(setup)
    steps_of = lambda groups: STEP_COUNTER_BYTES * groups if setup.optimizer == "adamw" else 0
    if z >= 3:
        part = stage3_partition_elements(sizes, dp)
        steps = steps_of(stage3_sub_groups(sizes, setup))
        return RankStates(wb * (part + stage3_persistent_elements(sizes, setup)), wb * part,
                          k * part + steps, steps,
                          "DeepSpeed ZeRO-3: each parameter padded to a multiple of dp, "
                          "persistent small parameters whole")
    n = sum(sizes)
    flat = flat_group_elements(n, dp)
    steps = steps_of(1)
    return RankStates(wb * flat, wb * (flat // dp if z >= 2 else n), k * flat // dp + steps,
                      steps, f"DeepSpeed ZeRO-{z}: one flat group padded to a multiple of "
                             f"{NCCL_START_ALIGNMENT} x dp")


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


REDUCE_BUCKET = Term("DeepSpeed reduce bucket (reduce_bucket_size)")
INF_NAN_TRACKER = Term("DeepSpeed inf/nan tracker")
GATHERED = Term("DeepSpeed gathered parameters (held for backward)")


def deepspeed_adjust(ledger: Ledger, step: Step) -> None:
    """What DeepSpeed holds beyond its states at each phase of the step.

    Stages 1-2 (stage_1_and_2.py): the first gradient hook of backward (`process_gradients` ->
    `setup_buckets`) allocates the reduce bucket, reduce_bucket_size elements (one; two with
    overlap_comm, whose default is off below stage 3); it lives until the gradients are
    reduced at the end of backward (`_release_ipg_buffers`). In the optimizer step the 16-bit
    gradients are gone (the fp32 gradient partition is an optimizer temporary). Nothing at ZeRO 0 or
    under LoRA; DeepSpeed keeps its layout and buffers at dp = 1 too.

    Stage 3 (stage3.py): its buffers (`deepspeed_buffers`) and the gradient partitions'
    flat buffer are alive in every phase; the parameters it all-gathers in forward stay
    whole until their backward, held by autograd (the whole 16-bit parameters less the
    persistent ones, which are whole anyway)."""
    cfg, setup = step.cfg, step.setup
    if setup.zero == 0 or setup.lora_rank:
        return
    if setup.zero <= 2:
        bucket = reduce_bucket_bytes(setup)
        ledger.add(Phase.BACKWARD_LAST_BLOCK, REDUCE_BUCKET, bucket)
        ledger.add(Phase.BACKWARD_END, REDUCE_BUCKET, bucket)
        # step(): the 16-bit gradients are flattened into the fp32 gradient partition and
        # freed (`averaged_gradients[i] = None`) before the client optimizer runs
        ledger.replace(Phase.OPTIMIZER_STEP, GRADIENTS, 0)
        return
    rank = first_rank(setup, step.stage)
    st = deepspeed_rank_states(cfg, setup, rank)
    sizes = _sizes(cfg, setup, rank)
    gathered = setup.weight_bytes * (sum(sizes) - stage3_persistent_elements(sizes, setup))
    forward = (*ledger.forward_phases(), Phase.BACKWARD_START)
    for phase in dict.fromkeys((*STEADY_PHASES, *forward)):
        ledger.add(phase, REDUCE_BUCKET, reduce_bucket_bytes(setup))
        ledger.add(phase, INF_NAN_TRACKER, INF_OR_NAN_TRACKER_BYTES)
        (ledger.add if phase in forward else ledger.replace)(phase, GRADIENTS, st.gradients)
        if phase in forward or phase is Phase.BACKWARD_LAST_BLOCK:
            ledger.add(phase, GATHERED, gathered)


def deepspeed_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between steps: its weights (stages 1-2 the whole flat buffer, stage
    3 its partitions and the persistent parameters), the fp32 master partition and AdamW's
    states, stage 3's gradient partitions (`grad_partitions_flat_buffer` lives for the run)
    and `deepspeed_buffers`. Stages 1-2 free their 16-bit gradients after the step."""
    st = deepspeed_rank_states(cfg, setup, rank)
    out = {"weights": st.weights, "optimizer states": st.optimizer}
    if setup.zero >= 3:
        out["DeepSpeed gradient partitions (grad_partitions_flat_buffer)"] = st.gradients
    return {**out, **deepspeed_buffers(cfg, setup)}


class DeepSpeed(Engine):
    """DeepSpeed's ZeRO stages 1-3; at ZeRO 0 it replicates every state as DDP does."""

    name = "deepspeed"
    help = "deepspeed (DeepSpeed's ZeRO; the default for --zero 1-3)"
    stages = (0, 1, 2, 3)
    default_for = (1, 2, 3)
    mixed_by_default = True

    def assumptions(self, setup: TrainingSetup) -> str:
        return f"; DeepSpeed {describe_buffers(setup)}" if setup.zero >= 1 else ""

    def replicated(self, setup: TrainingSetup) -> bool:
        return setup.zero == 0

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        return super().rank_states(cfg, setup, rank) if setup.zero == 0 else (
            deepspeed_rank_states(cfg, setup, rank))

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return super().resident(cfg, setup, rank) if setup.zero == 0 else (
            deepspeed_resident(cfg, setup, rank))

    def master_gradient_bytes(self, setup: TrainingSetup, params: int) -> int:
        """The fp32 gradient partition: from ZeRO-1 on each rank flattens only its own
        partition (stage_1_and_2.py, `single_partition_of_fp32_groups`' gradients)."""
        if setup.mode != "mixed":
            return 0
        return 4 * (-(-params // setup.dp) if setup.zero >= 1 else params)

    def adjust(self, ledger: Ledger, step: Step) -> None:
        deepspeed_adjust(ledger, step)


register(DeepSpeed())


# --------------------------------------------------------------------------- ds_config.json

# the zero_optimization keys gptcalc reads from a ds_config; any other key is reported
ZERO_KEYS = ("stage", *ZERO_DEFAULTS, "overlap_comm", "reduce_scatter", "allgather_partitions",
             "round_robin_gradients", "stage3_max_reuse_distance",
             "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear")
# keys a ds_config may hold that do not change what a rank holds in memory (read and ignored)
IGNORED_KEYS = ("train_batch_size", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
                "optimizer", "scheduler", "zero_allow_untested_optimizer", "prescale_gradients",
                "gradient_predivide_factor", "communication_data_type", "flops_profiler",
                "activation_checkpointing", "tensorboard", "wandb", "csv_monitor",
                "comms_logger", "checkpoint", "data_types", "amp")
KNOWN_KEYS = ("zero_optimization", "bf16", "fp16", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", *IGNORED_KEYS)


def read_ds_config(path: str, cfg: GPTConfig) -> dict[str, Any]:
    """A user's ds_config.json as gptcalc settings: {"zero", "mode", "autocast_dtype",
    "batch_size", "grad_accum", "deepspeed_zero"}; a setting the file leaves out or sets to
    "auto" is absent (the command's own option or default decides it).

    "auto" is resolved as the Hugging Face integration resolves it
    (transformers.integrations.deepspeed, HfTrainerDeepSpeedConfig): micro-batch, gradient
    accumulation and bf16/fp16 from the training arguments (here -B, --grad-accum, --mode);
    reduce_bucket_size = hidden_size^2, and at stage 3 stage3_prefetch_bucket_size =
    int(0.9 hidden_size^2), stage3_param_persistence_threshold = 10 hidden_size. A bad file,
    an unknown key or a value of the wrong type raises ConfigError naming the option."""
    from pathlib import Path

    from ...documents import parse_document, read_text_file

    raw = parse_document(read_text_file(Path(path), "deepspeed_config"), True,
                         "deepspeed_config", Path(path))
    if not isinstance(raw, dict):
        raise ConfigError("deepspeed_config", f"{path}: expected a JSON object")
    return ds_settings(raw, cfg, where=f"{path}: ")


def _int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            value != int(value)):
        raise ConfigError("deepspeed_config", f"{where}{key} must be a whole number >= 0 or "
                                              f"\"auto\", got {value!r}")
    return int(value)


def ds_settings(raw: dict[str, Any], cfg: GPTConfig, where: str = "") -> dict[str, Any]:
    """`read_ds_config` on a parsed ds_config object."""
    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise ConfigError("deepspeed_config", f"{where}unknown keys {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for key, field in (("train_micro_batch_size_per_gpu", "batch_size"),
                       ("gradient_accumulation_steps", "grad_accum")):
        if key in raw and raw[key] != "auto":
            out[field] = _int(raw[key], key, where)
    enabled = {}
    for section in ("bf16", "fp16"):
        sec = raw.get(section, {})
        if not isinstance(sec, dict):
            raise ConfigError("deepspeed_config", f"{where}{section} must be an object")
        flag = sec.get("enabled", False if section in raw else None)
        if flag not in (True, False, None, "auto"):
            raise ConfigError("deepspeed_config", f"{where}{section}.enabled must be true, false "
                                                  f"or \"auto\", got {flag!r}")
        enabled[section] = flag
    if True in enabled.values():
        out["mode"] = "mixed"
        out["autocast_dtype"] = "bf16" if enabled["bf16"] is True else "fp16"
    elif enabled["bf16"] is False and enabled["fp16"] in (False, None) and (
            "bf16" in raw or "fp16" in raw):
        out["mode"] = "fp32"
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError("deepspeed_config", f"{where}zero_optimization must be an object")
    bad = sorted(set(zero) - set(ZERO_KEYS))
    if bad:
        raise ConfigError("deepspeed_config", f"{where}zero_optimization has unknown keys "
                                              f"{', '.join(bad)}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError("deepspeed_config", f"{where}zero_optimization.stage must be 0-3, got "
                                              f"{stage!r}")
    out["zero"] = stage
    h = cfg.n_embd  # the model's hidden_size
    auto = {"reduce_bucket_size": h * h}
    if stage == 3:
        auto.update(stage3_prefetch_bucket_size=int(0.9 * h * h),
                    stage3_param_persistence_threshold=10 * h)
    pairs = []
    for key in ZERO_DEFAULTS:
        if key not in zero:
            continue
        value = zero[key]
        if key == "contiguous_gradients":
            if not isinstance(value, bool):
                raise ConfigError("deepspeed_config", f"{where}zero_optimization.{key} must be "
                                                      f"true or false, got {value!r}")
        elif value == "auto":
            if key not in auto:
                continue  # the Hugging Face integration leaves it to DeepSpeed's default
            value = auto[key]
        else:
            value = _int(value, f"zero_optimization.{key}", where)
        if value != ZERO_DEFAULTS[key]:
            pairs.append((key, value))
    out["deepspeed_zero"] = tuple(pairs)
    return out


def ds_config_dict(setup: TrainingSetup, workload: Workload) -> dict[str, Any]:
    """The ds_config DeepSpeed runs the set-up with: its stage, bf16/fp16 in mode mixed, the
    micro-batch and accumulation, and the zero_optimization sizes that differ from the
    defaults."""
    mixed = setup.mode == "mixed"
    return {"train_micro_batch_size_per_gpu": workload.batch_size,
            "gradient_accumulation_steps": workload.grad_accum,
            "zero_optimization": {"stage": setup.zero, **dict(setup.engine_settings)},
            "bf16": {"enabled": mixed and setup.autocast_dtype == "bf16"},
            "fp16": {"enabled": mixed and setup.autocast_dtype == "fp16"},
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}


def describe_buffers(setup: TrainingSetup) -> str:
    """The DeepSpeed buffer sizes of the set-up, for the first line of a command."""
    s = zero_settings(setup)
    given = dict(setup.engine_settings)
    keys = ["reduce_bucket_size", "allgather_bucket_size"] if setup.zero < 3 else [
        "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters"]
    parts = [f"{k} {s[k]:,}" for k in keys]
    if not s["contiguous_gradients"]:
        parts.append("contiguous_gradients off")
    src = "ds_config" if given else "DeepSpeed's defaults"
    return f"buckets ({src}): " + ", ".join(parts)


__all__ = ["DeepSpeed", "ZERO_DEFAULTS", "deepspeed_adjust", "deepspeed_buffers",
           "deepspeed_rank_states",
           "deepspeed_resident", "describe_buffers", "ds_config_dict", "ds_settings",
           "flat_group_elements", "read_ds_config", "stage3_partition_elements",
           "stage3_persistent_elements", "zero_settings"]
