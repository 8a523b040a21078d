"""Reading a user's DeepSpeed ds_config.json, and writing the one a set-up runs with.

`read_ds_config` turns the file into gptcalc settings (ZeRO stage, precision, micro-batch,
accumulation, zero_optimization sizes), resolving "auto" as the Hugging Face integration does;
a command reads the file once and passes the settings on. `ds_config_dict` is the reverse: the
ds_config DeepSpeed runs a `TrainingSetup` with. Every failure is one ConfigError naming
--deepspeed-config.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from .config import GPTConfig
from .documents import parse_document, read_text_file
from .errors import MAX_SIZE, ConfigError
from .training_setup import TrainingSetup
from .workload import Workload

# DeepSpeedZeroConfig's defaults (deepspeed/runtime/zero/config.py), in ds_config's spelling
ZERO_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,  # elements, in the communication dtype
    "allgather_bucket_size": 500_000_000,  # elements (stages 1-2)
    "stage3_prefetch_bucket_size": 50_000_000,  # elements
    "stage3_param_persistence_threshold": 100_000,  # elements of one parameter
    "stage3_model_persistence_threshold": sys.maxsize,  # elements of all persistent ones
    "stage3_max_live_parameters": 1_000_000_000,  # elements
    "stage3_max_reuse_distance": 1_000_000_000,  # elements
    "sub_group_size": 1_000_000_000,  # elements of one optimizer sub-group (stage 3)
    "contiguous_gradients": True,
}
# the offload sections of zero_optimization (runtime/zero/offload_config.py,
# DeepSpeedZeroOffloadOptimizerConfig and DeepSpeedZeroOffloadParamConfig), flattened as
# "<section>" (its device) and "<section>_<key>"; pin_memory, fast_init and the pipelining
# switches change where or how fast, not how many bytes, and are read and ignored
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
OFFLOAD_DEFAULTS: dict[str, object] = {
    "offload_optimizer": "none",
    "offload_optimizer_buffer_count": 4,  # NVMe swap buffers of the largest sub-group
    "offload_optimizer_ratio": 1.0,  # the fraction of sub-groups offloaded
    "offload_param": "none",
    "offload_param_buffer_count": 5,  # NVMe swap buffers
    "offload_param_buffer_size": 100_000_000,  # elements of one swap buffer
    "offload_param_max_in_cpu": 1_000_000_000,  # elements kept in host memory under NVMe
}
# the keys of each offload section that gptcalc reads (a number) or reads and ignores
OFFLOAD_KEYS = {"offload_optimizer": (("buffer_count", "ratio"),
                                      ("device", "nvme_path", "pin_memory", "fast_init",
                                       "pipeline_read", "pipeline_write", "pipeline")),
                "offload_param": (("buffer_count", "buffer_size", "max_in_cpu"),
                                  ("device", "nvme_path", "pin_memory"))}
# the zero_optimization keys gptcalc reads from a ds_config; any other key is reported
ZERO_KEYS = ("stage", *ZERO_DEFAULTS, "overlap_comm", "reduce_scatter", "allgather_partitions",
             "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
             "memory_efficient_linear", *OFFLOAD_KEYS)
# The top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py, DeepSpeedConfig and the
# section parsers it calls; names in deepspeed/runtime/constants.py), each read, ignored or
# refused here. Read: the batch, the precision, ZeRO, and activation checkpointing's placement.
READ_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16",
             "bfloat16", "fp16", "zero_optimization", "activation_checkpointing")
# keys that change nothing a rank holds in memory, each with its reason (read and ignored)
IGNORED_KEYS: dict[str, str] = {
    "train_batch_size": "B x grad_accum x dp: the micro-batch and accumulation decide a rank",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "timing logs",
    "dump_state": "prints the config",
    "memory_breakdown": "prints memory use",
    "timers": "timing logs",
    "log_level": "logging",
    "flops_profiler": "a profiler's counts, no tensors kept",
    "tensorboard": "a monitor",
    "wandb": "a monitor",
    "csv_monitor": "a monitor",
    "comet": "a monitor",
    "comms_logger": "logs collectives",
    "optimizer": "the optimizer is --optimizer's; its hyperparameters change no byte",
    "scheduler": "a learning-rate schedule",
    "gradient_clipping": "scales the gradients in place",
    "prescale_gradients": "scales the gradients in place",
    "gradient_predivide_factor": "scales the gradients in place",
    "gradient_allreduce_op": "mean or sum of the same buffers",
    "communication_data_type": "the reduction's dtype; ZeRO's buckets are counted in the "
                               "gradients' dtype",
    "seq_parallel_communication_data_type": "Ulysses sequence parallel's, which gptcalc does "
                                            "not run",
    "disable_allgather": "broadcast in place of all-gather, the same partitions",
    "disable_python_gc": "when Python's collector runs",
    "zero_allow_untested_optimizer": "a permission",
    "zero_force_ds_cpu_optimizer": "a permission",
    "managed_gradient_accumulation": "who calls the step at the accumulation boundary",
    "checkpoint": "saving and loading checkpoints",
    "datastates_ckpt": "an asynchronous checkpoint engine",
    "aio": "NVMe read and write block sizes and queue depth",
    "dataloader_drop_last": "the data loader",
    "vocabulary_size": "a tensor-core alignment warning",
    "use_data_before_expert_parallelism": "the order of the process groups",
}
# keys that turn on a feature gptcalc does not model: refused when they do (`feature_on`)
REFUSED_KEYS: dict[str, str] = {
    "pipeline": "DeepSpeed's pipeline engine (PipelineModule) is not modelled",
    "autotuning": "the autotuner runs many set-ups",
    "data_efficiency": "data sampling and random-LTD change the tokens a layer sees",
    "hybrid_engine": "the RLHF hybrid engine's inference containers are not modelled",
    "torch_autocast": "DeepSpeed's torch autocast mode is not modelled: use bf16/fp16",
    "compile": "DeepCompile's passes change what is saved and gathered",
    "tensor_parallel": "AutoTP training is not modelled: give --tp without a ds_config",
    "expert_parallel": "AutoEP is not modelled",
    "weight_quantization": "quantized weights are not modelled",
    "data_types": "a gradient-accumulation or parameter dtype of its own is not modelled",
}
# keys DeepSpeed 0.19 itself refuses (deepspeed/runtime/config.py,
# _REMOVED_TOP_LEVEL_CONFIG_KEYS): the feature was removed
REMOVED_KEYS = ("amp", "compression_training", "curriculum_learning", "eigenvalue",
                "elasticity", "graph_harvesting", "nebula", "progressive_layer_drop",
                "quantize_training", "sparse_attention", "sparse_gradients")
# bf16 and fp16 keys that keep the master weights, gradients or optimizer states in 16 bit
# (precision_config.py, DeepSpeedBF16Config and DeepSpeedFP16Config): refused when true
MASTER_DTYPE_KEYS = ("bf16_master_weights_and_grads", "bf16_optimizer_states",
                     "fp16_master_weights_and_grads")
KNOWN_KEYS = (*READ_KEYS, *IGNORED_KEYS, *REFUSED_KEYS, *REMOVED_KEYS)
# activation_checkpointing's keys (runtime/activation_checkpointing/config.py): the two that
# place the checkpoints are read; contiguous_memory_optimization is refused (its buffers of
# number_checkpoints partitions are not modelled); the others time or log
CHECKPOINT_KEYS = ("partition_activations", "cpu_checkpointing")
CHECKPOINT_IGNORED = ("number_checkpoints", "synchronize_checkpoint_boundary", "profile")


def feature_on(key: str, value: Any) -> bool:
    """Whether a REFUSED_KEYS section turns its feature on: its "enabled" (compile's
    "deepcompile"), tensor_parallel's autotp_size above 1, data_types' grad_accum_dtype or
    param_dtype set, any other section that holds a setting."""
    if not isinstance(value, dict):
        return bool(value)
    if key == "compile":
        return bool(value.get("deepcompile"))
    if key == "tensor_parallel":
        return (value.get("autotp_size") or 0) > 1
    if key == "data_types":
        return any(value.get(k) is not None for k in ("grad_accum_dtype", "param_dtype"))
    if "enabled" in value:
        return bool(value["enabled"])
    return bool(value)


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
    raw = parse_document(read_text_file(Path(path), "deepspeed_config"), True,
                         "deepspeed_config", Path(path))
    if not isinstance(raw, dict):
        raise ConfigError("deepspeed_config", f"{path}: expected a JSON object")
    return ds_settings(raw, cfg, where=f"{path}: ")


def _int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            isinstance(value, float) and not math.isfinite(value)) or (
            value != int(value) or value > MAX_SIZE):
        raise ConfigError("deepspeed_config", f"{where}{key} must be a whole number >= 0 or "
                                              f"\"auto\", got {_shown(value)}")
    return int(value)


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SIZE:
        return f"a {value.bit_length()}-bit integer"
    return repr(value)


def ds_settings(raw: dict[str, Any], cfg: GPTConfig, where: str = "") -> dict[str, Any]:
    """`read_ds_config` on a parsed ds_config object."""
    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise ConfigError("deepspeed_config", f"{where}unknown keys {', '.join(unknown)}")
    removed = sorted(set(raw) & set(REMOVED_KEYS))
    if removed:
        raise ConfigError("deepspeed_config", f"{where}{removed[0]}: DeepSpeed 0.19 removed "
                                              f"this feature and refuses the key")
    refused = [k for k in sorted(set(raw) & set(REFUSED_KEYS)) if feature_on(k, raw[k])]
    if refused:
        raise ConfigError("deepspeed_config", f"{where}{refused[0]}: {REFUSED_KEYS[refused[0]]}")
    if "bf16" not in raw and "bfloat16" in raw:  # the old name, read when bf16 is absent
        raw = {**raw, "bf16": raw["bfloat16"]}      # (precision_config.get_bfloat16_config)
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
        if not (isinstance(flag, bool) or flag is None or flag == "auto"):
            raise ConfigError("deepspeed_config", f"{where}{section}.enabled must be true, false "
                                                  f"or \"auto\", got {flag!r}")
        enabled[section] = flag
        own = [k for k in MASTER_DTYPE_KEYS if sec.get(k)]
        if own:
            raise ConfigError("deepspeed_config", f"{where}{section}.{own[0]}: 16-bit master "
                                                  f"weights or optimizer states are not "
                                                  f"modelled")
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
    if type(stage) is not int or stage not in (0, 1, 2, 3):
        raise ConfigError("deepspeed_config", f"{where}zero_optimization.stage must be 0-3, got "
                                              f"{_shown(stage)}")
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
    out["deepspeed_zero"] = (tuple(pairs) + offload_pairs(zero, stage, where)
                             + checkpoint_pairs(raw.get("activation_checkpointing", {}), where))
    return out


def checkpoint_pairs(section: Any, where: str = "") -> tuple:
    """activation_checkpointing's placement of deepspeed.checkpointing's checkpoints as
    (key, True) pairs: partition_activations (each tensor-parallel rank keeps 1/tp of every
    checkpoint) and cpu_checkpointing (checkpoints kept in host memory)."""
    if not isinstance(section, dict):
        raise ConfigError("deepspeed_config", f"{where}activation_checkpointing must be an "
                                              f"object")
    bad = sorted(set(section) - set(CHECKPOINT_KEYS) - set(CHECKPOINT_IGNORED)
                 - {"contiguous_memory_optimization"})
    if bad:
        raise ConfigError("deepspeed_config", f"{where}activation_checkpointing has unknown "
                                              f"keys {', '.join(bad)}")
    if section.get("contiguous_memory_optimization"):
        raise ConfigError("deepspeed_config", f"{where}activation_checkpointing."
                                              f"contiguous_memory_optimization: its buffers "
                                              f"are not modelled")
    pairs = []
    for key in CHECKPOINT_KEYS:
        value = section.get(key, False)
        if not isinstance(value, bool):
            raise ConfigError("deepspeed_config", f"{where}activation_checkpointing.{key} must "
                                                  f"be true or false, got {value!r}")
        if value:
            pairs.append((key, True))
    return tuple(pairs)


def offload_pairs(zero: dict[str, Any], stage: int, where: str = "") -> tuple:
    """The offload sections of a zero_optimization object as (key, value) pairs that differ
    from `OFFLOAD_DEFAULTS`: each section's device under the section's name, its sizes as
    "<section>_<key>". offload_param needs stage 3 (stage3.py's `_configure_offloading`;
    stages 1-2 read offload_optimizer only)."""
    pairs = []
    for section, (numbers, ignored) in OFFLOAD_KEYS.items():
        sec = zero.get(section)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            raise ConfigError("deepspeed_config", f"{where}zero_optimization.{section} must be "
                                                  f"an object")
        bad = sorted(set(sec) - set(numbers) - set(ignored))
        if bad:
            raise ConfigError("deepspeed_config", f"{where}zero_optimization.{section} has "
                                                  f"unknown keys {', '.join(bad)}")
        device = sec.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            raise ConfigError("deepspeed_config", f"{where}zero_optimization.{section}.device "
                                                  f"must be none, cpu or nvme, got {device!r}")
        if device != "none" and section == "offload_param" and stage != 3:
            raise ConfigError("deepspeed_config", f"{where}offload_param needs "
                                                  f"zero_optimization.stage 3, got {stage}")
        if device == "none":
            continue
        pairs.append((section, device))
        for key in numbers:
            if key not in sec:
                continue
            name = f"{section}_{key}"
            if key == "ratio":
                value = sec[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                        0 <= value <= 1):
                    raise ConfigError("deepspeed_config", f"{where}zero_optimization.{section}."
                                                          f"ratio must be in [0, 1], got "
                                                          f"{value!r}")
                value = float(value)
            else:
                value = _int(sec[key], f"zero_optimization.{section}.{key}", where)
            if value != OFFLOAD_DEFAULTS[name]:
                pairs.append((name, value))
    return tuple(pairs)


def zero_section(settings: tuple) -> dict[str, Any]:
    """The zero_optimization entries of `engine_settings` pairs, offload sections nested as a
    ds_config spells them ({"offload_optimizer": {"device": "cpu"}})."""
    out: dict[str, Any] = {}
    for key, value in settings:
        if key in CHECKPOINT_KEYS:
            continue
        section = next((s for s in OFFLOAD_KEYS if key == s or key.startswith(s + "_")), None)
        if section is None:
            out[key] = value
        elif key == section:
            out.setdefault(section, {})["device"] = value
        else:
            out.setdefault(section, {})[key[len(section) + 1:]] = value
    return out


def ds_config_dict(setup: TrainingSetup, workload: Workload) -> dict[str, Any]:
    """The ds_config DeepSpeed runs the set-up with: its stage, bf16/fp16 in mode mixed, the
    micro-batch and accumulation, and the zero_optimization sizes that differ from the
    defaults."""
    mixed = setup.mode == "mixed"
    offload = any(k in OFFLOAD_KEYS for k, _ in setup.engine_settings)
    # a torch client optimizer under offload (DeepSpeedCPUAdam needs a compiled op)
    force = {"zero_force_ds_cpu_optimizer": False} if offload else {}
    checkpoints = [(k, v) for k, v in setup.engine_settings if k in CHECKPOINT_KEYS]
    return {**force, "train_micro_batch_size_per_gpu": workload.batch_size,
            "gradient_accumulation_steps": workload.grad_accum,
            "zero_optimization": {"stage": setup.zero, **zero_section(setup.engine_settings)},
            "bf16": {"enabled": mixed and setup.autocast_dtype == "bf16"},
            "fp16": {"enabled": mixed and setup.autocast_dtype == "fp16"},
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
            **({"activation_checkpointing": dict(checkpoints)} if checkpoints else {})}


__all__ = ["CHECKPOINT_IGNORED", "CHECKPOINT_KEYS", "IGNORED_KEYS", "KNOWN_KEYS",
           "MASTER_DTYPE_KEYS", "OFFLOAD_DEFAULTS", "OFFLOAD_DEVICES", "OFFLOAD_KEYS",
           "READ_KEYS", "REFUSED_KEYS", "REMOVED_KEYS", "ZERO_DEFAULTS", "ZERO_KEYS",
           "checkpoint_pairs", "ds_config_dict", "ds_settings", "feature_on", "offload_pairs",
           "read_ds_config", "zero_section"]
