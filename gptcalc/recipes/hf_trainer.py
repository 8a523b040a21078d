"""Hugging Face TrainingArguments (a JSON file, as `HfArgumentParser.parse_json_file` reads it)
as gptcalc's options, and the settings the Trainer shares with axolotl.

Keys as transformers' TrainingArguments spells them (transformers/training_args.py, 5.24), and
the model and data arguments of the example scripts that read the same file
(examples/pytorch/language-modeling/run_clm.py: model_name_or_path, torch_dtype, block_size).
What each setting does there:

- `bf16`/`fp16` autocast the forward over the weights the model was loaded in: fp32 unless
  `torch_dtype` says otherwise (--mode amp; bf16 weights: --mode bf16); under a DeepSpeed
  config its "auto" bf16 section takes `bf16` (--mode mixed);
- `gradient_checkpointing` (`activation_checkpointing` from 5.x) checkpoints every decoder
  layer (--recompute full);
- `fsdp` is FSDP2 unless `fsdp_config.version` is 1: full_shard is reshard_after_forward True
  (ZeRO-3), shard_grad_op False (ZeRO-2); its MixedPrecisionPolicy under bf16 is --mode mixed;
- `optim` names the optimizer (OptimizerNames); the Trainer frees the logits before backward
  (--no-keep-logits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Reading, Recipe

# OptimizerNames -> gptcalc's optimizer
OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
         "adamw_bnb_8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
         "paged_adamw_8bit": "paged_adamw8bit", "adafactor": "adafactor", "sgd": "sgd"}
# TrainingArguments fields that change nothing a step holds on the device
IGNORED_FIELDS = (
    "output_dir", "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "optim_args", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "average_tokens_across_devices",
    "max_grad_norm", "label_smoothing_factor", "bf16_full_eval", "fp16_full_eval", "tf32",
    "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
    "torch_compile_backend", "torch_compile_mode", "neftune_noise_alpha",
    "torch_empty_cache_steps", "logging_dir", "logging_strategy", "logging_steps",
    "logging_first_step", "log_on_each_node", "logging_nan_inf_filter",
    "include_num_input_tokens_seen", "log_level", "log_level_replica", "disable_tqdm",
    "report_to", "run_name", "project", "eval_strategy", "evaluation_strategy", "eval_steps",
    "eval_delay", "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start",
    "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
    "include_for_metrics", "batch_eval_metrics", "save_only_model", "save_strategy",
    "save_steps", "save_on_each_node", "save_total_limit", "save_safetensors",
    "enable_jit_checkpoint", "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id",
    "hub_strategy", "hub_always_push", "hub_revision", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "full_determinism", "seed", "data_seed",
    "accelerator_config", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns",
    "label_names", "train_sampling_strategy", "group_by_length", "length_column_name",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "ddp_static_graph", "ddp_backend", "ddp_timeout", "debug", "skip_memory_metrics",
    "do_train", "do_eval", "do_predict", "resume_from_checkpoint", "local_rank",
    "overwrite_output_dir", "use_cache",
)
# run_clm.py's ModelArguments and DataTrainingArguments that change nothing a step holds
IGNORED_SCRIPT = (
    "config_name", "tokenizer_name", "cache_dir", "use_fast_tokenizer", "model_revision",
    "token", "trust_remote_code", "low_cpu_mem_usage", "dataset_name", "dataset_config_name",
    "train_file", "validation_file", "max_train_samples", "max_eval_samples", "streaming",
    "validation_split_percentage", "overwrite_cache", "preprocessing_num_workers",
    "keep_linebreaks", "model_type", "config_overrides",
)
OFF = {"torch_compile": False, "use_liger_kernel": False, "auto_find_batch_size": False,
       "parallelism_config": None, "liger_kernel_config": None, "optim_target_modules": None,
       "use_cpu": False}
READ = ("model_name_or_path", "torch_dtype", "dtype", "block_size", "max_seq_length",
        "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
        "gradient_checkpointing", "activation_checkpointing", "optim", "deepspeed", "fsdp",
        "fsdp_config")


def read_hf_trainer(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """TrainingArguments (a parsed JSON object) as options."""
    r = Reading(path, "Hugging Face TrainingArguments")
    for key, value in doc.items():
        if key in READ:
            continue
        if key in OFF:
            if value not in (OFF[key], None):
                r.refuse(key, value)
            r.ignore(key, "off")
        elif key in IGNORED_FIELDS or key in IGNORED_SCRIPT:
            r.ignore(key, "logging, saving, evaluation, data or a hyperparameter")
        else:
            raise r.unknown(key)
    if "model_name_or_path" in doc:
        r.set("model_name_or_path", "hf_config", model_path(r, "model_name_or_path",
                                                            doc["model_name_or_path"]))
    for key in ("block_size", "max_seq_length"):
        if doc.get(key) is not None:
            r.set(key, "seq_len", r.count(key, doc[key]))
    r.set("per_device_train_batch_size", "batch_size",
          r.count("per_device_train_batch_size", doc.get("per_device_train_batch_size", 8)))
    r.set("gradient_accumulation_steps", "grad_accum",
          r.count("gradient_accumulation_steps", doc.get("gradient_accumulation_steps", 1)))
    dtype = doc.get("torch_dtype", doc.get("dtype"))
    weights = "bf16" if dtype in ("bfloat16", "bf16") else (
        "fp32" if dtype in (None, "auto", "float32", "fp32") else dtype)
    trainer_settings(r, doc, weights, adapters=False)
    return r.recipe()


def model_path(r: Reading, key: str, value: Any) -> str:
    """A model named by a recipe: a Hub id (org/name) or a path, a relative one taken from the
    recipe's folder when it exists there."""
    text = r.text(key, value)
    beside = r.path.parent / text
    return str(beside) if not Path(text).is_absolute() and beside.exists() else text


def trainer_settings(r: Reading, doc: dict[str, Any], weights: str, adapters: bool) -> None:
    """Precision, recomputation, optimizer, DeepSpeed and FSDP as the Trainer reads them;
    `weights`: the dtype the model was loaded in (fp32, bf16); `adapters`: LoRA adapters,
    which PEFT keeps in fp32 over a 16-bit base."""
    bf16, fp16 = doc.get("bf16", False), doc.get("fp16", False)
    if bf16 == "auto":  # axolotl: bf16 where the GPU has it, as every current one does
        bf16 = True
    bf16, fp16 = r.flag("bf16", bf16), r.flag("fp16", bool(fp16))
    ds = doc.get("deepspeed")
    if fp16:
        r.set("fp16", "autocast_dtype", "fp16")
    if ds:
        if not isinstance(ds, str):
            r.refuse("deepspeed", "(an inline object)", "give the ds_config as a file")
        r.set("deepspeed", "deepspeed_config", model_path(r, "deepspeed", ds))
        mode = "mixed" if bf16 or fp16 else "fp32"
    elif weights == "bf16" and not adapters:
        mode = "bf16"
    elif weights not in ("bf16", "fp32"):
        r.refuse("torch_dtype", weights, "a base in this dtype is not modelled", option="mode")
        mode = None
    else:
        mode = "amp" if bf16 or fp16 else "fp32"
    fsdp, fsdp_ckpt = doc.get("fsdp"), False
    if fsdp:
        mode, fsdp_ckpt = _fsdp(r, fsdp, doc.get("fsdp_config") or {}, bf16 or fp16)
    if mode:
        r.set("bf16/fp16", "mode", mode)
    ckpt = doc.get("activation_checkpointing", doc.get("gradient_checkpointing", False))
    ckpt = fsdp_ckpt or ckpt
    if ckpt not in (True, False):
        r.refuse("gradient_checkpointing", ckpt, option="recompute")
    else:
        r.set("gradient_checkpointing", "recompute", "full" if ckpt else "none")
    key = "optimizer" if "optimizer" in doc else "optim"  # axolotl's spelling, the Trainer's
    optim = doc.get(key, "adamw_torch")
    if optim in OPTIM:
        r.set(key, "optimizer", OPTIM[optim])
    else:
        r.refuse(key, optim, option="optimizer")
    r.set("(training loop)", "keep_logits", False)


def _fsdp(r: Reading, fsdp: Any, config: Any, mixed: bool) -> tuple[str, bool]:
    """FSDP through accelerate (TrainingArguments._process_fsdp_args, transformers 5.24): the
    mode, and whether fsdp_config checkpoints every layer."""
    if not isinstance(config, dict):
        raise r.fail(f"fsdp_config must be an object, got {config!r}")
    items = fsdp.split() if isinstance(fsdp, str) else ([] if fsdp is True else list(fsdp))
    if int(config.get("version", config.get("fsdp_version", 2))) != 2:
        r.refuse("fsdp_config.version", 1, "FSDP1's flat parameters are not modelled")
    if "offload" in items or config.get("cpu_offload") or config.get("offload_params"):
        r.refuse("fsdp", fsdp, "FSDP's CPU offload is not modelled")
    reshard = "shard_grad_op" not in items
    reshard = config.get("reshard_after_forward", reshard)
    if str(reshard).lower() not in ("true", "false"):
        raise r.fail(f"fsdp_config.reshard_after_forward must be true or false, got {reshard!r}")
    r.set("fsdp", "engine", "fsdp2")
    r.set("fsdp_config.reshard_after_forward", "zero",
          3 if str(reshard).lower() == "true" else 2)
    for key in config:
        if key not in ("version", "fsdp_version", "reshard_after_forward",
                       "activation_checkpointing", "cpu_offload", "offload_params"):
            r.ignore(f"fsdp_config.{key}", "wrapping, state-dict format or loading")
    ckpt = str(config.get("activation_checkpointing", "false")).lower() == "true"
    return ("mixed" if mixed else "fp32"), ckpt


__all__ = ["OPTIM", "model_path", "read_hf_trainer", "trainer_settings"]
