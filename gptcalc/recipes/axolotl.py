"""An axolotl config (YAML) as gptcalc's options.

Keys as axolotl's shipped examples spell them (examples/llama-3/*.yml,
axolotl-ai-cloud/axolotl at ba1be71d), read as axolotl reads them:

- `base_model` is a Hub id or a folder (--hf-config);
- `bf16` (true or "auto") loads the model in bf16 (utils/config's normalize_config:
  cfg.torch_dtype) and autocasts through the Trainer: a full fine-tune is pure bf16 (--mode
  bf16); under `adapter` lora/qlora PEFT keeps the adapters fp32 over the 16-bit base
  (--mode amp);
- `load_in_4bit` is bitsandbytes' NF4 with double-quantised constants
  (bnb_4bit_use_double_quant=True in axolotl's loader: --weights-dtype nf4-dq);
- `lora_target_linear` is PEFT's all-linear (--lora-targets all); `lora_target_modules` the
  model's own module names;
- `optimizer`, `gradient_checkpointing`, `deepspeed` and `fsdp` go to the Hugging Face Trainer
  (`gptcalc.recipes.hf_trainer`), with `fsdp_version` 2 as FSDP2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Reading, Recipe
from .hf_trainer import model_path, trainer_settings

IGNORED = (
    "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code", "strict",
    "datasets", "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir",
    "lora_model_dir", "sample_packing", "eval_sample_packing", "pad_to_sequence_len",
    "lora_alpha", "peft_use_rslora", "lora_fan_in_fan_out", "wandb_project", "wandb_entity",
    "wandb_watch", "wandb_name", "wandb_run_id", "wandb_log_model", "num_epochs", "max_steps",
    "lr_scheduler", "learning_rate", "cosine_min_lr_ratio", "tf32", "resume_from_checkpoint",
    "auto_resume_from_checkpoints", "logging_steps", "warmup_steps", "warmup_ratio",
    "evals_per_epoch", "saves_per_epoch", "eval_steps", "save_steps", "save_strategy",
    "eval_strategy", "save_total_limit", "weight_decay", "special_tokens", "tokens",
    "hub_model_id", "hub_strategy", "chat_template", "train_on_inputs", "group_by_length",
    "seed", "max_grad_norm", "early_stopping_patience", "local_rank", "debug",
    "flash_attention", "sdp_attention", "xformers_attention", "gradient_checkpointing_kwargs",
    "dataset_processes", "eval_table_size", "eval_max_new_tokens", "logging_dir",
    "load_best_model_at_end", "save_safetensors", "hf_use_auth_token", "is_llama_derived_model",
    "fsdp_final_state_dict_type", "gptq", "bnb_config_kwargs",
)
OFF = {"load_in_8bit": False, "torch_compile": False, "peft_use_dora": False,
       "lora_modules_to_save": None, "unsloth_lora_mlp": False, "unsloth_lora_qkv": False,
       "unsloth_lora_o": False, "liger_rms_norm": False, "liger_glu_activation": False,
       "liger_fused_linear_cross_entropy": False, "liger_rope": False, "plugins": None,
       "lora_dropout": 0.0}
READ = ("base_model", "base_model_config", "load_in_4bit", "adapter", "sequence_len", "lora_r",
        "lora_target_linear", "lora_target_modules", "micro_batch_size",
        "gradient_accumulation_steps", "optimizer", "bf16", "fp16", "gradient_checkpointing",
        "deepspeed", "fsdp", "fsdp_config", "fsdp_version")


def read_axolotl(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """An axolotl config (parsed YAML) as options."""
    r = Reading(path, "axolotl")
    for key, value in doc.items():
        if key in READ:
            continue
        if key in OFF:
            if value not in (OFF[key], None, []) and not (key == "lora_dropout" and value == 0):
                r.refuse(key, value)
            r.ignore(key, "off")
        elif key in IGNORED:
            r.ignore(key, "data, logging, saving, the tokenizer or a hyperparameter")
        else:
            raise r.unknown(key)
    model = doc.get("base_model_config") or doc.get("base_model")
    r.set("base_model", "hf_config", model_path(r, "base_model", model))
    if doc.get("sequence_len") is not None:
        r.set("sequence_len", "seq_len", r.count("sequence_len", doc["sequence_len"]))
    r.set("micro_batch_size", "batch_size",
          r.count("micro_batch_size", doc.get("micro_batch_size", 1)))
    r.set("gradient_accumulation_steps", "grad_accum",
          r.count("gradient_accumulation_steps", doc.get("gradient_accumulation_steps", 1)))
    adapter = doc.get("adapter")
    four_bit = r.flag("load_in_4bit", doc.get("load_in_4bit", False))
    if adapter in ("lora", "qlora"):
        r.set("lora_r", "lora_rank", r.count("lora_r", doc.get("lora_r", 8)))
        if doc.get("lora_target_linear"):
            targets = "all"
        else:
            modules = doc.get("lora_target_modules") or []
            if isinstance(modules, str):
                modules = [modules]
            targets = ",".join(r.text("lora_target_modules", m) for m in modules)
            if not targets:
                raise r.fail("a LoRA adapter needs lora_target_modules or lora_target_linear")
        r.set("lora_target_linear" if targets == "all" else "lora_target_modules",
              "lora_targets", targets)
        if four_bit or adapter == "qlora":
            r.set("load_in_4bit", "weights_dtype", "nf4-dq")
    elif adapter is not None:
        r.refuse("adapter", adapter, option="lora_rank")
    elif four_bit:
        raise r.fail("load_in_4bit without an adapter: a 4-bit base is frozen")
    bf16 = doc.get("bf16", False)
    weights = "bf16" if bf16 in (True, "auto") else ("fp16" if doc.get("fp16") else "fp32")
    settings = {k: doc[k] for k in ("bf16", "fp16", "deepspeed", "optimizer") if k in doc}
    if "gradient_checkpointing" in doc:
        settings["gradient_checkpointing"] = doc["gradient_checkpointing"]
    if doc.get("fsdp") or doc.get("fsdp_config"):
        config = {k.removeprefix("fsdp_"): v for k, v in (doc.get("fsdp_config") or {}).items()}
        config["version"] = doc.get("fsdp_version", config.get("version", 1))
        settings["fsdp"] = doc.get("fsdp") or True
        settings["fsdp_config"] = config
    trainer_settings(r, settings, weights, adapters=adapter in ("lora", "qlora"))
    return r.recipe()


__all__ = ["read_axolotl"]
