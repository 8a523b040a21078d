"""Hugging Face TrainingArguments as gptcalc's options: a JSON file (as
`HfArgumentParser.parse_json_file` reads it) or a TRL / alignment-handbook YAML recipe
(`trl sft --config`, alignment-handbook's recipes/*/config_*.yaml: TrainingArguments plus TRL's
model, script and SFT fields), and the settings the Trainer shares with axolotl and
LLaMA-Factory.

Keys as transformers' TrainingArguments spells them (transformers/training_args.py, 5.24), TRL's
ModelConfig, ScriptArguments and SFTConfig (trl/trainer/model_config.py, sft_config.py, at
huggingface/trl f2cd5771) and the example scripts' model and data arguments
(examples/pytorch/language-modeling/run_clm.py: model_name_or_path, torch_dtype, block_size).
What each setting does there:

- `model_name_or_path`: a Hub id whose published config is a preset answers as that preset
  (`gptcalc.recipes.models`), counted as transformers' modules save it (--impl transformers)
  where that profile measures the family, as --hf-config would; any other id or a folder is
  --hf-config;
- `bf16`/`fp16` autocast the forward over the weights the model was loaded in: fp32 unless
  `torch_dtype` says otherwise (--mode amp; bf16 weights: --mode bf16); PEFT keeps LoRA adapters
  fp32 over a 16-bit base (--mode amp); under a DeepSpeed config its "auto" bf16 section takes
  `bf16` (--mode mixed);
- `gradient_checkpointing` (`activation_checkpointing` from 5.x) checkpoints every decoder
  layer (--recompute full);
- `fsdp` is FSDP2, FSDP1 (--engine fsdp1) when `fsdp_config.version` is 1: full_shard is
  reshard_after_forward True
  (ZeRO-3), shard_grad_op False (ZeRO-2); its MixedPrecisionPolicy under bf16 is --mode mixed;
- `deepspeed` names a ds_config: found beside the recipe or in a folder above it (LLaMA-Factory
  and alignment-handbook write paths from the repository's root), else asked for with
  --deepspeed-config; under DeepSpeed or FSDP the world size is the launcher's, not the
  file's: --gpus (or --dp, or a launcher config beside the recipe), asked for without them;
- `optim` names the optimizer (OptimizerNames); `torch_compile` compiles the model, whose
  forward computes the loss from the labels (--compile model); the Trainer frees the logits
  before backward (--no-keep-logits);
- TRL's `use_peft` with `lora_r` and `lora_target_modules` ("all-linear": --lora-targets all),
  `load_in_4bit` with `bnb_4bit_quant_type: nf4` and `use_bnb_nested_quant` (QLoRA:
  --weights-dtype nf4, nf4-dq nested); `max_length` (`max_seq_length` before TRL 0.20) is the
  row length (--seq-len); the embeddings and head stay 16-bit (--no-kbit-prepare: under bf16
  SFTTrainer casts them back after peft's prepare_model_for_kbit_training before TRL 0.22,
  and from 0.22 no longer casts them, `gptcalc.memory.finetune.kbit_prepared`);
- `use_liger_kernel` applies Liger's kernels with `liger_kernel_config` over Liger's Llama
  defaults (rope, rms_norm, swiglu and the fused linear cross entropy): --liger and --loss
  fused;
- `attn_implementation`: flash_attention_2, sdpa and their kernels save what --attn sdpa
  counts; eager saves the attention probabilities (--attn manual);
- a TRL or alignment-handbook YAML takes SFTConfig's own defaults where the file is silent:
  `max_length` 1024, `gradient_checkpointing` true, `bf16` true unless `fp16`, and under
  `use_peft` ModelConfig's `lora_dropout` of 0.05 (--lora-dropout); `use_dora` is --dora.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .base import READ, Reading, Recipe, ignored, off, refused, shown, RecipeFormat, register_format
from ..presets import PRESETS
from ..training_setup import LIGER_KERNELS, OPTIMIZERS
from .models import TRANSFORMERS_MODELLED, hub_preset

# OptimizerNames -> gptcalc's optimizer
OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
         "adamw_bnb_8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
         "paged_adamw_8bit": "paged_adamw8bit", "adafactor": "adafactor", "sgd": "sgd",
         "lion_32bit": "lion"}
# bitsandbytes' PagedAdamW (32-bit states), where gptcalc's optimizers include it
if "paged_adamw" in OPTIMIZERS:
    OPTIM.update(paged_adamw_32bit="paged_adamw", paged_adamw="paged_adamw")
ATTN = {"flash_attention_2": "sdpa", "flash_attention_3": "sdpa", "sdpa": "sdpa",
        "kernels-community/flash-attn": "sdpa", "eager": "manual"}
_LOGGING = ignored("logging, saving, evaluation or the hub")
_HYPER = ignored("a hyperparameter or the schedule")
_DATA = ignored("the data and its loading")
_LOOP = ignored("the training loop's bookkeeping")
_PREFERENCE = refused("a preference step (a policy and a reference model on chosen and "
                      "rejected sequences) is not modelled")
# the one table of TrainingArguments' fields (transformers 5.24), each read or ignored with
# its reason; a test keeps it equal to TrainingArguments.__dataclass_fields__
TRAINER_KEYS: dict[str, tuple] = {
    **dict.fromkeys(("output_dir", "logging_strategy", "logging_steps", "logging_first_step",
                     "log_on_each_node", "logging_nan_inf_filter",
                     "include_num_input_tokens_seen", "log_level", "log_level_replica",
                     "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id",
                     "trackio_bucket_id", "trackio_static_space_id", "eval_strategy",
                     "eval_steps", "eval_delay", "per_device_eval_batch_size",
                     "prediction_loss_only", "eval_on_start", "eval_do_concat_batches",
                     "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics",
                     "batch_eval_metrics", "save_only_model", "save_strategy", "save_steps",
                     "save_on_each_node", "save_total_limit", "enable_jit_checkpoint",
                     "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id",
                     "hub_strategy", "hub_always_push", "hub_revision", "load_best_model_at_end",
                     "metric_for_best_model", "greater_is_better", "bf16_full_eval",
                     "fp16_full_eval", "skip_memory_metrics", "do_train", "do_eval",
                     "do_predict", "resume_from_checkpoint", "debug",
                     "restore_callback_states_from_checkpoint", "ignore_data_skip",
                     "evaluation_strategy", "logging_dir", "save_safetensors",
                     "overwrite_output_dir", "hub_private"), _LOGGING),
    **dict.fromkeys(("num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type",
                     "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "optim_args",
                     "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                     "max_grad_norm", "label_smoothing_factor", "neftune_noise_alpha",
                     "seed", "data_seed", "full_determinism",
                     "average_tokens_across_devices"), _HYPER),
    **dict.fromkeys(("dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor",
                     "dataloader_multiprocessing_context", "dataloader_in_order",
                     "remove_unused_columns", "label_names", "train_sampling_strategy",
                     "group_by_length", "length_column_name"), _DATA),
    **dict.fromkeys(("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
                     "ddp_static_graph", "ddp_backend", "ddp_timeout", "local_rank",
                     "torch_empty_cache_steps", "use_cache"), _LOOP),
    "accelerator_config": READ,
    "tf32": ignored("TF32 matmuls: speed, not memory"),
    "gradient_checkpointing_kwargs": ignored("use_reentrant: how the checkpoint reruns, not "
                                             "what it saves"),
    "activation_checkpointing_kwargs": ignored("how the checkpoint reruns, not what it saves"),
    "torch_compile_backend": ignored("read only with torch_compile"),
    "torch_compile_mode": ignored("read only with torch_compile"),
    **dict.fromkeys(("use_liger_kernel", "liger_kernel_config"), READ),
    "auto_find_batch_size": off(False, "the batch the Trainer finds is not in the file"),
    "parallelism_config": off(None, "accelerate's parallelism config is not modelled"),
    "optim_target_modules": off(None, "GaLore-style optimizers are not modelled"),
    "use_cpu": off(False, "training on the CPU"),
    **dict.fromkeys(("per_device_train_batch_size", "gradient_accumulation_steps", "bf16",
                     "fp16", "gradient_checkpointing", "activation_checkpointing", "optim",
                     "deepspeed", "fsdp", "fsdp_config", "torch_compile"), READ),
}
# TRL's ModelConfig, ScriptArguments and SFTConfig, the example scripts' and the
# alignment-handbook's own fields
MODEL_KEYS: dict[str, tuple] = {
    **dict.fromkeys(("model_name_or_path", "torch_dtype", "dtype", "attn_implementation",
                     "use_peft", "lora_r", "lora_target_modules", "load_in_4bit",
                     "bnb_4bit_quant_type", "use_bnb_nested_quant", "block_size",
                     "max_seq_length", "max_length"), READ),
    **dict.fromkeys(("model_revision", "trust_remote_code", "config_name", "tokenizer_name",
                     "cache_dir", "use_fast_tokenizer", "token", "low_cpu_mem_usage",
                     "model_type", "config_overrides", "tokenizer_name_or_path",
                     "chat_template", "eos_token", "pad_token"),
                    ignored("where the model, tokenizer or chat template come from")),
    **dict.fromkeys(("dataset_name", "dataset_config", "dataset_config_name",
                     "dataset_train_split", "dataset_test_split", "dataset_mixture",
                     "dataset_num_proc", "dataset_text_field", "dataset_kwargs",
                     "dataset_streaming", "train_file", "validation_file", "max_train_samples",
                     "max_eval_samples", "streaming", "validation_split_percentage",
                     "overwrite_cache", "preprocessing_num_workers", "keep_linebreaks",
                     "gradient_checkpointing_use_reentrant", "ignore_bias_buffers"), _DATA),
    # TRL's packing fills each row to max_length, which --seq-len counts; without it rows are
    # at most max_length, which --seq-len counts as the step that peaks
    **dict.fromkeys(("packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
                     "completion_only_loss", "assistant_only_loss", "shuffle_dataset",
                     "eval_packing"), ignored("how rows are filled: --seq-len is the row")),
    "lora_alpha": ignored("the adapters' scale, a number in the forward"),
    "lora_task_type": ignored("the PEFT task's name"),
    "use_rslora": ignored("the adapters' scale"),
    **dict.fromkeys(("lora_dropout", "use_dora"), READ),
    "lora_modules_to_save": off(None, "fully trained modules beside the adapters are not "
                                      "modelled"),
    "load_in_8bit": off(False, "LLM.int8 weights are not modelled"),
    "bnb_4bit_quant_storage": off("uint8", "4-bit weights stored in another dtype are not "
                                           "modelled"),
    "bnb_4bit_compute_dtype": ignored("the dtype the 4-bit weights are dequantised to for "
                                      "the matmul, transient"),
    **dict.fromkeys(("beta", "loss_type", "max_prompt_length", "max_completion_length",
                     "ref_model_init_kwargs", "precompute_ref_log_probs", "rpo_alpha",
                     "reference_free", "generate_during_eval", "num_generations"),
                    _PREFERENCE),
}
KEYS = {**TRAINER_KEYS, **MODEL_KEYS}
# TRL's SFTConfig defaults that differ from TrainingArguments' (trl/trainer/sft_config.py and
# base_config.py at f2cd5771): rows of at most 1024 tokens, every layer checkpointed, bf16
# autocast unless fp16 (set below)
TRL_DEFAULTS = {"max_length": 1024, "gradient_checkpointing": True}
# TRL's ModelConfig.lora_dropout (trl/trainer/model_config.py at f2cd5771)
TRL_LORA_DROPOUT = 0.05


def read_hf_trainer(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """TrainingArguments, with TRL's and the example scripts' fields (a parsed JSON object or
    YAML mapping), as options."""
    kind = "Hugging Face TrainingArguments" if path.suffix.lower() == ".json" else \
        "TRL / alignment-handbook"
    r = Reading(path, kind)
    r.walk(doc, KEYS)
    if kind != "Hugging Face TrainingArguments":
        defaults = {**TRL_DEFAULTS, "bf16": not doc.get("fp16", False)}
        if "max_seq_length" in doc or "block_size" in doc:  # older spellings of max_length
            del defaults["max_length"]
        doc = {**defaults, **doc}
    if "model_name_or_path" in doc:
        model(r, "model_name_or_path", doc["model_name_or_path"], given)
    for key in ("block_size", "max_seq_length", "max_length"):
        if doc.get(key) is not None:
            r.set(key, "seq_len", r.count(key, doc[key]))
    r.set("per_device_train_batch_size", "batch_size",
          r.count("per_device_train_batch_size", doc.get("per_device_train_batch_size", 8)))
    r.set("gradient_accumulation_steps", "grad_accum",
          r.count("gradient_accumulation_steps", doc.get("gradient_accumulation_steps", 1)))
    dtype = doc.get("torch_dtype", doc.get("dtype"))
    weights = "bf16" if dtype in ("bfloat16", "bf16") else (
        "fp32" if dtype in (None, "auto", "float32", "fp32") else dtype)
    peft = r.flag("use_peft", doc.get("use_peft", False))
    if peft:
        _peft(r, doc, TRL_LORA_DROPOUT if kind != "Hugging Face TrainingArguments" else 0.0)
    elif doc.get("load_in_4bit"):
        raise r.fail("load_in_4bit without use_peft: a 4-bit base is frozen")
    attention(r, doc)
    trainer_settings(r, doc, weights, adapters=peft, given=given)
    return r.recipe()


def accelerator_config(r: Reading, config: Any) -> None:
    """TrainingArguments' accelerator_config: `gradient_accumulation_kwargs.sync_each_batch`
    (accelerate's GradientAccumulationPlugin, False by default: the Trainer runs every
    micro-batch but the last under `no_sync()`, transformers 5.24 trainer.py) as
    --fsdp1-sync each-batch (true) or no-sync (false); its other keys are the loop's
    bookkeeping. A path (a JSON file of them) is not read."""
    key = "accelerator_config"
    if config is None:
        return
    if isinstance(config, str):
        r.ignore(key, "a file of accelerate's settings, not read (its sync_each_batch: give "
                      "--fsdp1-sync)")
        return
    if not isinstance(config, dict):
        raise r.fail(f"{key} must be a mapping or a file, got {shown(config)}")
    kwargs = config.get("gradient_accumulation_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise r.fail(f"{key}.gradient_accumulation_kwargs must be a mapping, got "
                     f"{shown(kwargs)}")
    for name, value in kwargs.items():
        where = f"{key}.gradient_accumulation_kwargs.{name}"
        if name == "sync_each_batch":
            r.set(where, "fsdp1_sync", "each-batch" if r.flag(where, value) else "no-sync")
        else:
            r.ignore(where, "the training loop's bookkeeping")
    for name in config:
        if name != "gradient_accumulation_kwargs":
            r.ignore(f"{key}.{name}", "the training loop's bookkeeping")


def _peft(r: Reading, doc: dict[str, Any], dropout: float) -> None:
    """TRL's ModelConfig: LoRA of rank lora_r (16 by default) on lora_target_modules (PEFT's
    default for the family when absent) with lora_dropout (`dropout` by default) and use_dora,
    over a 4-bit base with load_in_4bit."""
    r.set("lora_r", "lora_rank", r.count("lora_r", doc.get("lora_r", 16)))
    r.adapter_options(doc, "lora_dropout", "use_dora", dropout, "TRL's default")
    modules = doc.get("lora_target_modules")
    if modules is not None:
        r.set("lora_target_modules", "lora_targets", targets(r, "lora_target_modules", modules))
    if r.flag("load_in_4bit", doc.get("load_in_4bit", False)):
        kind = doc.get("bnb_4bit_quant_type", "nf4")
        if kind != "nf4":
            r.refuse("bnb_4bit_quant_type", kind, "4-bit weights other than NF4 are not "
                                                  "modelled", option="weights_dtype")
        nested = r.flag("use_bnb_nested_quant", doc.get("use_bnb_nested_quant", False))
        r.set("load_in_4bit", "weights_dtype", "nf4-dq" if nested else "nf4")


def targets(r: Reading, key: str, modules: Any) -> str:
    """LoRA target modules (a list, or one name; "all-linear"/"all" is PEFT's all-linear) as
    --lora-targets."""
    if isinstance(modules, str):
        modules = [m for m in modules.replace(",", " ").split() if m]
    if not isinstance(modules, list) or not modules:
        raise r.fail(f"{key} must be a list of module names, got {shown(modules)}")
    names = [r.text(key, m) for m in modules]
    return "all" if names in (["all-linear"], ["all"]) else ",".join(names)


def attention(r: Reading, doc: dict[str, Any], key: str = "attn_implementation") -> None:
    value = doc.get(key)
    if value is None:
        return
    if not isinstance(value, str) or value not in ATTN:
        r.refuse(key, value, "this attention implementation is not modelled", option="attn")
        return
    r.set(key, "attn", ATTN[value])


def model(r: Reading, key: str, value: Any, given: dict[str, Any]) -> None:
    """The model a recipe names: a Hub id with a preset of its published sizes as --preset,
    any other as --hf-config (a relative folder taken from the recipe's own)."""
    if given.get("preset") or given.get("hf_config"):
        r.ignore(key, "the model typed beside the recipe")
        return
    text = r.text(key, value)
    preset = hub_preset(text)
    if preset is not None and not (r.path.parent / text).exists():
        r.set(key, "preset", preset)
        if PRESETS[preset].hub in TRANSFORMERS_MODELLED:  # the Trainer runs transformers' model
            r.set(key, "impl", "transformers")
    else:
        r.set(key, "hf_config", model_path(r, key, text))


def model_path(r: Reading, key: str, value: Any) -> str:
    """A model named by a recipe: a Hub id (org/name) or a path, a relative one taken from the
    recipe's folder when it exists there."""
    text = r.text(key, value)
    beside = r.path.parent / text
    return str(beside) if not Path(text).is_absolute() and beside.exists() else text


def file_beside(r: Reading, key: str, value: Any) -> Path | None:
    """A file a recipe names by a relative path: beside it, or below one of the folders above
    it (recipes name files from their repository's root); None when none holds it."""
    text = r.text(key, value)
    if len(text) > 4096:
        raise r.fail(f"{key}: a path of {len(text):,} characters")
    p = Path(text)
    if p.is_absolute():
        return p if p.is_file() else None
    for folder in (r.path.parent, *r.path.parent.parents):
        try:
            if (folder / p).is_file():
                return folder / p
        except OSError:  # a name too long for the file system
            raise r.fail(f"{key}: {shown(text)} is not a path this system can open") from None
    return None


def deepspeed_file(r: Reading, key: str, value: Any, given: dict[str, Any]) -> None:
    """A ds_config named by path: --deepspeed-config when found, else asked for (unless it was
    typed)."""
    if given.get("deepspeed_config"):
        r.ignore(key, "--deepspeed-config typed beside the recipe")
        return
    if not isinstance(value, str):
        raise r.fail(f"{key} must name a ds_config file, got {shown(value)}; give the file "
                     f"with --deepspeed-config")
    found = file_beside(r, key, value)
    if found is None:
        raise r.fail(f"{key}: {shown(value)} is not beside the recipe nor in a folder above "
                     f"it; give it with --deepspeed-config FILE")
    r.set(key, "deepspeed_config", str(found))


# what `_apply_liger_kernel_to_instance(model, **config)` applies to Llama, Mistral and Qwen2
# unless the config says otherwise: apply_liger_kernel_to_llama's defaults (liger-kernel 0.8.5,
# liger_kernel/transformers/monkey_patch.py: rope, rms_norm, swiglu and
# fused_linear_cross_entropy True, cross_entropy False)
LIGER_DEFAULTS = {"rope": True, "rms_norm": True, "swiglu": True,
                  "fused_linear_cross_entropy": True, "cross_entropy": False}


def liger_kernel(r: Reading, key: str, config: Any = None) -> None:
    """Liger's kernels as the Trainer applies them (`use_liger_kernel`, transformers/
    integrations/liger.py: `_apply_liger_kernel_to_instance(model, **liger_kernel_config)`) or
    LLaMA-Factory's sft and pt stages (`enable_liger_kernel`, no config): --liger with the
    kernels on, --loss fused with fused_linear_cross_entropy; Liger's plain cross entropy
    (whole logits) is not modelled."""
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise r.fail(f"liger_kernel_config must be a mapping, got {shown(config)}")
    for name in config:
        if name not in LIGER_DEFAULTS:
            r.refuse(f"liger_kernel_config.{name}", config[name], "this Liger option is not "
                                                                 "modelled")
    on = {k: r.flag(f"liger_kernel_config.{k}", config.get(k, v))
          for k, v in LIGER_DEFAULTS.items()}
    if on["cross_entropy"]:
        r.refuse("liger_kernel_config.cross_entropy", True, "Liger's cross entropy over the "
                                                          "whole logits is not modelled")
    r.set(key, "liger", ",".join(k for k in LIGER_KERNELS if on[k]) or "none")
    if on["fused_linear_cross_entropy"]:
        r.set(key, "loss", "fused")


def trainer_settings(r: Reading, doc: dict[str, Any], weights: str, adapters: bool,
                     given: dict[str, Any] | None = None) -> None:
    """Precision, recomputation, compilation, optimizer, DeepSpeed and FSDP (and FSDP1's
    accumulation, `accelerator_config`) as the Trainer reads them; `weights`: the dtype the
    model was loaded in (fp32, bf16); `adapters`: LoRA adapters, which PEFT keeps in fp32 over
    a 16-bit base."""
    given = given or {}
    accelerator_config(r, doc.get("accelerator_config"))
    if r.flag("use_liger_kernel", doc.get("use_liger_kernel", False)):
        liger_kernel(r, "use_liger_kernel", doc.get("liger_kernel_config"))
    elif doc.get("liger_kernel_config") is not None:
        r.ignore("liger_kernel_config", "read only with use_liger_kernel")
    bf16, fp16 = doc.get("bf16", False), doc.get("fp16", False)
    if bf16 == "auto":  # axolotl: bf16 where the GPU has it, as every current one does
        bf16 = True
    bf16, fp16 = r.flag("bf16", bf16), r.flag("fp16", bool(fp16))
    ds = doc.get("deepspeed")
    if fp16:
        r.set("fp16", "autocast_dtype", "fp16")
    if ds:
        deepspeed_file(r, "deepspeed", ds, given)
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
    elif doc.get("fsdp_config"):
        r.ignore("fsdp_config", "read only with fsdp")
    if (ds or fsdp) and not given.get("dp"):  # launched on every rank the launcher has
        key = "deepspeed" if ds else "fsdp"
        r.set(key, "dp", r.world(key, "(all ranks)", given))
    if mode:
        r.set("bf16/fp16", "mode", mode)
    ckpt = doc.get("activation_checkpointing", doc.get("gradient_checkpointing", False))
    ckpt = fsdp_ckpt or ckpt
    if ckpt not in (True, False):
        r.refuse("gradient_checkpointing", ckpt, option="recompute")
    else:
        r.set("gradient_checkpointing", "recompute", "full" if ckpt else "none")
    if r.flag("torch_compile", doc.get("torch_compile", False)):
        r.set("torch_compile", "compile", "model")
    key = "optimizer" if "optimizer" in doc else "optim"  # axolotl's spelling, the Trainer's
    optim = doc.get(key, "adamw_torch")
    if isinstance(optim, str) and optim in OPTIM:
        r.set(key, "optimizer", OPTIM[optim])
    else:
        r.refuse(key, optim, "this optimizer is not modelled", option="optimizer")
    r.set("(training loop)", "keep_logits", False)


def _fsdp(r: Reading, fsdp: Any, config: Any, mixed: bool) -> tuple[str, bool]:
    """FSDP through accelerate (TrainingArguments._process_fsdp_args, transformers 5.24): the
    mode, and whether fsdp_config checkpoints every layer."""
    if not isinstance(config, dict):
        raise r.fail(f"fsdp_config must be an object, got {shown(config)}")
    if isinstance(fsdp, str):
        items = fsdp.split()
    elif fsdp is True:
        items = []
    elif isinstance(fsdp, list) and all(isinstance(x, str) for x in fsdp):
        items = list(fsdp)
    else:
        raise r.fail(f"fsdp must be a string or a list of strings, got {shown(fsdp)}")
    version = config.get("version", config.get("fsdp_version", 2))
    if str(version) not in ("1", "2"):
        raise r.fail(f"fsdp_config.version is 1 or 2, got {shown(version)}")
    if str(version) == "1":  # FullyShardedDataParallel, as --engine fsdp1 models it
        prefetch = str(config.get("backward_prefetch", "NO_PREFETCH")).upper()
        if prefetch != "BACKWARD_PRE":
            r.refuse("fsdp_config.backward_prefetch", prefetch, "--engine fsdp1 is modelled "
                     "with BACKWARD_PRE (the Trainer's default is NO_PREFETCH)")
        if str(config.get("forward_prefetch", "false")).lower() != "false":
            r.refuse("fsdp_config.forward_prefetch", config["forward_prefetch"],
                     "--engine fsdp1 is modelled without forward prefetch")
    if "offload" in items or config.get("cpu_offload") or config.get("offload_params"):
        r.refuse("fsdp", fsdp, "FSDP's CPU offload is not modelled")
    reshard = "shard_grad_op" not in items
    reshard = config.get("reshard_after_forward", reshard)
    if str(reshard).lower() in ("full_shard", "shard_grad_op"):  # FSDP1's strategy names
        reshard = str(reshard).lower() == "full_shard"
    if str(reshard).lower() not in ("true", "false"):
        raise r.fail(f"fsdp_config.reshard_after_forward must be true or false, got "
                     f"{shown(reshard)}")
    r.set("fsdp", "engine", "fsdp1" if str(version) == "1" else "fsdp2")
    r.set("fsdp_config.reshard_after_forward", "zero",
          3 if str(reshard).lower() == "true" else 2)
    for key in config:
        if key not in ("version", "fsdp_version", "reshard_after_forward",
                       "activation_checkpointing", "cpu_offload", "offload_params",
                       "backward_prefetch", "forward_prefetch"):
            r.ignore(f"fsdp_config.{key}", "wrapping, state-dict format or loading")
    ckpt = str(config.get("activation_checkpointing", "false")).lower() == "true"
    return ("mixed" if mixed else "fp32"), ckpt


__all__ = ["KEYS", "MODEL_KEYS", "OPTIM", "TRAINER_KEYS", "accelerator_config", "attention",
           "deepspeed_file", "file_beside", "model", "model_path", "read_hf_trainer", "targets",
           "trainer_settings"]

def _deepspeed_config(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    raise ConfigError("recipe", f"{path} is a DeepSpeed config: give it with --deepspeed-config")


register_format(RecipeFormat(
    "DeepSpeed config", (".json",),
    lambda doc: "zero_optimization" in doc or "train_micro_batch_size_per_gpu" in doc,
    _deepspeed_config, order=10))
register_format(RecipeFormat("Hugging Face TrainingArguments", (".json",), lambda doc: True,
                             read_hf_trainer, order=50))
register_format(RecipeFormat(
    "TRL / alignment-handbook", (".yaml", ".yml"),
    lambda doc: "model_name_or_path" in doc or any(k in TRAINER_KEYS or k in MODEL_KEYS
                                                   for k in doc),
    read_hf_trainer, order=50))
