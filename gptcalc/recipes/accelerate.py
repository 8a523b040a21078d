"""An accelerate launcher config (YAML, `accelerate launch --config_file FILE`) as gptcalc's
options: how many processes, which engine shards them, and its precision. Given beside a
training recipe (`--recipe sft.yaml --recipe zero3.yaml`), its engine and precision win over
the recipe's, as `accelerate launch` gives them to the Trainer.

Keys as accelerate's config files spell them (src/accelerate/commands/config/config_args.py
and the templates in examples/config_yaml_templates; huggingface/accelerate at 16cb6eb8):

- `num_processes` is every process over all machines: the world size, replaced by --gpus when
  that is typed;
- `distributed_type`: NO and MULTI_GPU (DDP: --dp) leave the precision to the recipe; DEEPSPEED
  is --engine deepspeed with `deepspeed_config.zero_stage` and its offload devices, or the
  ds_config of `deepspeed_config_file`; FSDP with `fsdp_version: 2` is --engine fsdp2, with
  `fsdp_version: 1` (its default) --engine fsdp1 (BACKWARD_PRE prefetch, no forward prefetch)
  (`fsdp_reshard_after_forward` true, or FULL_SHARD: ZeRO-3; SHARD_GRAD_OP: ZeRO-2), and
  FSDP1 (accelerate's default version) is not modelled;
- `mixed_precision` bf16 or fp16 is the engine's own mixed precision (--mode mixed) under
  DeepSpeed and FSDP; fp8 is not modelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import READ, Reading, Recipe, flatten, ignored, off, shown, RecipeFormat, register_format
from .hf_trainer import deepspeed_file

_LAUNCH = ignored("how the processes are started and reach each other")
# the one table of an accelerate config's keys
KEYS: dict[str, tuple] = {
    **dict.fromkeys(("compute_environment", "debug", "machine_rank", "main_training_function",
                     "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster",
                     "tpu_use_sudo", "main_process_ip", "main_process_port", "gpu_ids",
                     "enable_cpu_affinity", "num_machines", "dynamo_config.*",
                     "deepspeed_config.deepspeed_multinode_launcher",
                     "deepspeed_config.deepspeed_hostfile", "tpu_name", "tpu_zone",
                     "commands", "command_file", "mpirun_config.*"), _LAUNCH),
    "downcast_bf16": ignored("TPUs only"),
    **dict.fromkeys(("deepspeed_config.zero3_init_flag", "deepspeed_config.zero3_save_16bit_model",
                     "deepspeed_config.gradient_clipping",
                     "deepspeed_config.gradient_accumulation_steps"),
                    ignored("loading, saving or a hyperparameter the Trainer sets")),
    **dict.fromkeys(("fsdp_config.fsdp_auto_wrap_policy", "fsdp_config.fsdp_backward_prefetch",
                     "fsdp_config.fsdp_forward_prefetch",
                     "fsdp_config.fsdp_cpu_ram_efficient_loading",
                     "fsdp_config.fsdp_state_dict_type", "fsdp_config.fsdp_sync_module_states",
                     "fsdp_config.fsdp_use_orig_params",
                     "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                     "fsdp_config.fsdp_min_num_params", "fsdp_config.fsdp_limit_all_gathers"),
                    ignored("wrapping, prefetching, state-dict format or loading")),
    "use_cpu": off(False, "training on the CPU"),
    "fp8_config.*": off(None, "float8 through accelerate is not modelled"),
    "parallelism_config.*": off(None, "accelerate's parallelism config (tp, cp) is not "
                                      "modelled"),
    "megatron_lm_config.*": off(None, "Megatron-LM through accelerate is not modelled"),
    **dict.fromkeys(("distributed_type", "num_processes", "mixed_precision",
                     "deepspeed_config.zero_stage", "deepspeed_config.offload_optimizer_device",
                     "deepspeed_config.offload_param_device",
                     "deepspeed_config.deepspeed_config_file", "fsdp_config.fsdp_version",
                     "fsdp_config.fsdp_sharding_strategy",
                     "fsdp_config.fsdp_reshard_after_forward",
                     "fsdp_config.fsdp_activation_checkpointing",
                     "fsdp_config.fsdp_offload_params"), READ),
}
TYPES = ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP")
RESHARD = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}


def is_accelerate(doc: dict[str, Any]) -> bool:
    """Whether a YAML mapping is an accelerate config (it names a distributed_type or a
    compute_environment)."""
    return "distributed_type" in doc or "compute_environment" in doc


def world_of(doc: dict[str, Any]) -> int | None:
    """An accelerate config's num_processes when it is a positive whole number, else None."""
    n = doc.get("num_processes")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def read_accelerate(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """An accelerate config (parsed YAML) as options."""
    r = Reading(path, "accelerate")
    r.launcher = True
    for section in ("deepspeed_config", "fsdp_config"):
        if doc.get(section) is not None and not isinstance(doc[section], dict):
            raise r.fail(f"{section} must be a mapping, got {shown(doc[section])}")
    keys = flatten(doc)
    r.walk(keys, KEYS)
    kind = doc.get("distributed_type", "NO")
    if kind not in TYPES:
        r.refuse("distributed_type", kind, f"only {', '.join(TYPES)} are modelled")
    if given.get("dp"):
        r.ignore("num_processes", "--dp typed beside the config")
    elif given.get("gpus"):
        r.ignore("num_processes", f"--gpus {given['gpus']} typed beside the config")
    elif kind == "NO":
        r.set("distributed_type", "dp", 1)
    else:
        r.set("num_processes", "dp", r.count("num_processes", doc.get("num_processes", 1)))
    precision = doc.get("mixed_precision", "no")
    if precision not in ("no", "bf16", "fp16"):
        r.refuse("mixed_precision", precision, "this precision is not modelled", option="mode")
    if kind == "DEEPSPEED":
        _deepspeed(r, keys, precision, given)
    elif kind == "FSDP":
        _fsdp(r, keys, precision)
    return r.recipe()


def _deepspeed(r: Reading, keys: dict[str, Any], precision: str,
               given: dict[str, Any]) -> None:
    p = "deepspeed_config."
    r.set("distributed_type", "engine", "deepspeed")
    if p + "deepspeed_config_file" in keys:
        deepspeed_file(r, p + "deepspeed_config_file", keys[p + "deepspeed_config_file"],
                       given)
        return
    stage = keys.get(p + "zero_stage", 2)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise r.fail(f"{p}zero_stage must be 0, 1, 2 or 3, got {shown(stage)}")
    r.set(p + "zero_stage", "zero", stage)
    for name, option in (("offload_optimizer_device", "offload_optimizer"),
                         ("offload_param_device", "offload_param")):
        device = keys.get(p + name, "none")
        if device not in ("none", "cpu", "nvme"):
            raise r.fail(f"{p}{name} must be none, cpu or nvme, got {shown(device)}")
        if device != "none":
            r.set(p + name, option, device)
    r.set("mixed_precision", "mode", "mixed" if precision != "no" else "fp32")
    if precision == "fp16":
        r.set("mixed_precision", "autocast_dtype", "fp16")


def _fsdp(r: Reading, keys: dict[str, Any], precision: str) -> None:
    p = "fsdp_config."
    version = keys.get(p + "fsdp_version", 1)
    if str(version) not in ("1", "2"):
        raise r.fail(f"{p}fsdp_version is 1 or 2, got {shown(version)}")
    if str(version) == "1":  # accelerate's default: FullyShardedDataParallel, as modelled
        prefetch = str(keys.get(p + "fsdp_backward_prefetch", "NO_PREFETCH")).upper()
        if prefetch != "BACKWARD_PRE":
            r.refuse(p + "fsdp_backward_prefetch", prefetch, "--engine fsdp1 is modelled with "
                     "BACKWARD_PRE (accelerate's default is NO_PREFETCH)")
        if keys.get(p + "fsdp_forward_prefetch", False) not in (False, "false"):
            r.refuse(p + "fsdp_forward_prefetch", keys[p + "fsdp_forward_prefetch"],
                     "--engine fsdp1 is modelled without forward prefetch")
    r.set("distributed_type", "engine", "fsdp1" if str(version) == "1" else "fsdp2")
    offload = p + "fsdp_offload_params"
    if r.flag(offload, keys.get(offload, False)):
        if str(version) == "1":
            r.refuse(offload, keys[offload], "FSDP1's CPU offload is not modelled; FSDP2's "
                     "is (fsdp_version 2: --engine fsdp2 --offload-param cpu)")
        # fully_shard's CPUOffloadPolicy (accelerate's fsdp2_prepare_model)
        r.set(offload, "offload_param", "cpu")
    if p + "fsdp_reshard_after_forward" in keys:
        value = keys[p + "fsdp_reshard_after_forward"]
        reshard = RESHARD.get(str(value).upper()) if isinstance(value, str) else value
        if not isinstance(reshard, bool):
            raise r.fail(f"{p}fsdp_reshard_after_forward must be true or false, got "
                         f"{shown(value)}")
        key = p + "fsdp_reshard_after_forward"
    else:
        strategy = keys.get(p + "fsdp_sharding_strategy", "FULL_SHARD")
        reshard = RESHARD.get(str(strategy).upper())
        if reshard is None:
            r.refuse(p + "fsdp_sharding_strategy", strategy, "only FULL_SHARD and SHARD_GRAD_OP "
                                                             "are modelled", option="zero")
            reshard = True
        key = p + "fsdp_sharding_strategy"
    r.set(key, "zero", 3 if reshard else 2)
    r.set("mixed_precision", "mode", "mixed" if precision != "no" else "fp32")
    if precision == "fp16":
        r.set("mixed_precision", "autocast_dtype", "fp16")
    if r.flag(p + "fsdp_activation_checkpointing",
              keys.get(p + "fsdp_activation_checkpointing", False)):
        r.set(p + "fsdp_activation_checkpointing", "recompute", "full")


__all__ = ["KEYS", "is_accelerate", "read_accelerate", "world_of"]

register_format(RecipeFormat("accelerate", (".yaml", ".yml"), is_accelerate, read_accelerate,
                             order=30))
