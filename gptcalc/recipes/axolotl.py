"""An axolotl config (YAML) as gptcalc's options.

Keys as axolotl's shipped examples spell them (examples/llama-3/*.yml,
axolotl-ai-cloud/axolotl at ba1be71d), read as axolotl reads them:

- `base_model` is a Hub id or a folder: a Hub id with a preset of its published sizes is
  --preset, any other --hf-config;
- Liger's plugin with `liger_fused_linear_cross_entropy` is --loss fused, and
  `liger_rms_norm`, `liger_glu_activation` and `liger_rope` are --liger rms_norm, swiglu and
  rope (axolotl's LigerPlugin passes each to apply_liger_kernel_to_<model_type>); its LayerNorm
  kernel is not modelled; `fp8` is torchao's float8 Linears (--float8
  tensorwise); `attn_implementation` as the Trainer's;
- `bf16` (true or "auto") loads the model in bf16 (utils/config's normalize_config:
  cfg.torch_dtype) and autocasts through the Trainer: a full fine-tune is pure bf16 (--mode
  bf16); under `adapter` lora/qlora PEFT keeps the adapters fp32 over the 16-bit base
  (--mode amp);
- `load_in_4bit` is bitsandbytes' NF4 with double-quantised constants
  (bnb_4bit_use_double_quant=True in axolotl's loader: --weights-dtype nf4-dq); after
  prepare_model_for_kbit_training the loader casts the norms, embeddings and head back to
  torch_dtype (loaders/model.py, `_configure_embedding_dtypes`): --no-kbit-prepare;
- `lora_target_linear` is PEFT's all-linear (--lora-targets all); `lora_target_modules` the
  model's own module names;
- `optimizer`, `gradient_checkpointing`, `torch_compile`, `deepspeed` and `fsdp` go to the
  Hugging Face Trainer (`gptcalc.recipes.hf_trainer`), with `fsdp_version` 2 as FSDP2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import READ, Reading, Recipe, ignored, off, shown, RecipeFormat, register_format
from .hf_trainer import attention, model, trainer_settings
from .hf_trainer import targets as lora_targets

_SETTINGS = ignored("data, logging, saving, the tokenizer or a hyperparameter")
# axolotl's Liger switches -> the --liger kernels (integrations/liger: rms_norm, swiglu, rope)
LIGER = {"liger_rms_norm": "rms_norm", "liger_glu_activation": "swiglu", "liger_rope": "rope"}
# the one table of an axolotl config's keys (axolotl's examples and its config schema,
# src/axolotl/utils/schemas/config.py, at ba1be71d)
KEYS: dict[str, tuple] = {
    **dict.fromkeys((
        "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code", "strict",
        "datasets", "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir",
        "lora_model_dir", "sample_packing", "eval_sample_packing", "pad_to_sequence_len",
        "lora_alpha", "peft_use_rslora", "lora_fan_in_fan_out", "wandb_project",
        "wandb_entity", "wandb_watch", "wandb_name", "wandb_run_id", "wandb_log_model",
        "num_epochs", "max_steps", "lr_scheduler", "learning_rate", "cosine_min_lr_ratio",
        "cosine_constant_lr_ratio", "tf32", "resume_from_checkpoint",
        "auto_resume_from_checkpoints", "logging_steps", "warmup_steps", "warmup_ratio",
        "evals_per_epoch", "saves_per_epoch", "eval_steps", "save_steps", "save_strategy",
        "eval_strategy", "save_total_limit", "save_only_model", "weight_decay",
        "special_tokens", "tokens", "eot_tokens", "hub_model_id", "hub_strategy",
        "chat_template", "train_on_inputs", "group_by_length", "seed", "max_grad_norm",
        "early_stopping_patience", "local_rank", "debug", "gradient_checkpointing_kwargs",
        "dataset_processes", "eval_table_size", "eval_max_new_tokens", "logging_dir",
        "load_best_model_at_end", "save_safetensors", "hf_use_auth_token",
        "is_llama_derived_model", "fsdp_final_state_dict_type", "gptq", "bnb_config_kwargs",
        "loss_watchdog_threshold", "loss_watchdog_patience", "ddp_find_unused_parameters",
        "flex_attn_compile_kwargs"), _SETTINGS),
    # the attention kernels: flash and SDPA save what --attn sdpa counts
    **dict.fromkeys(("flash_attention", "sdp_attention"), ignored("a flash/SDPA kernel, as "
                                                                  "gptcalc counts")),
    "xformers_attention": off(False, "xformers' attention is not modelled"),
    "load_in_8bit": off(False, "LLM.int8 weights are not modelled"),
    # axolotl hands torch_compile to the Trainer (its causal builder sets
    # training_arguments_kwargs["torch_compile"]), which compiles the whole model
    "torch_compile": READ,
    **dict.fromkeys(("torch_compile_backend", "torch_compile_mode"),
                    ignored("read only with torch_compile")),
    "lora_modules_to_save": off(None, "fully trained modules beside the adapters are not "
                                      "modelled"),
    "unfrozen_parameters": off(None, "training some parameters and freezing the rest is not "
                                     "modelled"),
    **dict.fromkeys(("unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o"),
                    off(False, "unsloth's LoRA kernels are not modelled")),
    **dict.fromkeys((
        "base_model", "base_model_config", "load_in_4bit", "adapter", "sequence_len", "lora_r",
        "lora_target_linear", "lora_target_modules", "micro_batch_size",
        "gradient_accumulation_steps", "optimizer", "bf16", "fp16", "gradient_checkpointing",
        "deepspeed", "fsdp", "fsdp_config", "fsdp_version", "plugins",
        "liger_fused_linear_cross_entropy", "liger_layer_norm", *LIGER, "attn_implementation",
        "fp8",
        "fp8_enable_fsdp_float8_all_gather", "lora_dropout", "peft_use_dora"), READ),
}
PLUGINS = ("axolotl.integrations.liger.LigerPlugin",
           "axolotl.integrations.liger.plugin.LigerPlugin")


def read_axolotl(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """An axolotl config (parsed YAML) as options."""
    r = Reading(path, "axolotl")
    r.walk(doc, KEYS)
    key = "base_model_config" if doc.get("base_model_config") else "base_model"
    model(r, key, doc.get(key), given)
    plugins = doc.get("plugins") or []
    if not isinstance(plugins, list) or any(p not in PLUGINS for p in plugins):
        r.refuse("plugins", plugins, "plugins other than Liger's are not modelled")
    if r.flag("liger_fused_linear_cross_entropy",
              doc.get("liger_fused_linear_cross_entropy", False)):
        if not plugins:
            raise r.fail("liger_fused_linear_cross_entropy without the LigerPlugin in plugins")
        r.set("liger_fused_linear_cross_entropy", "loss", "fused")
    kernels = [(key, k) for key, k in LIGER.items() if r.flag(key, doc.get(key, False))]
    if kernels:
        if not plugins:
            raise r.fail(f"{kernels[0][0]} without the LigerPlugin in plugins")
        r.set("+".join(key for key, _ in kernels), "liger", ",".join(k for _, k in kernels))
    if r.flag("liger_layer_norm", doc.get("liger_layer_norm", False)):
        r.refuse("liger_layer_norm", True, "Liger's LayerNorm kernel is not modelled (Llama, "
                                           "Mistral and Qwen2 have none)", option="liger")
    attention(r, doc)
    if r.flag("fp8", doc.get("fp8", False)):  # torchao's Float8Linear, tensorwise scaling
        sharded = doc.get("fsdp") or doc.get("fsdp_config")
        if sharded and not r.flag("fp8_enable_fsdp_float8_all_gather",
                                  doc.get("fp8_enable_fsdp_float8_all_gather", False)):
            r.refuse("fp8_enable_fsdp_float8_all_gather", False,
                     "float8 Linears with bf16 all-gathers are not modelled")
        r.set("fp8", "float8", "tensorwise")
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
        r.adapter_options(doc, "lora_dropout", "peft_use_dora")
        if doc.get("lora_target_linear"):
            targets = "all"
        else:
            if not doc.get("lora_target_modules"):
                raise r.fail("a LoRA adapter needs lora_target_modules or lora_target_linear")
            targets = lora_targets(r, "lora_target_modules", doc["lora_target_modules"])
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
    settings = {k: doc[k] for k in ("bf16", "fp16", "deepspeed", "optimizer", "torch_compile")
                if k in doc}
    if "gradient_checkpointing" in doc:
        settings["gradient_checkpointing"] = doc["gradient_checkpointing"]
    if doc.get("fsdp") or doc.get("fsdp_config"):
        raw = doc.get("fsdp_config") or {}
        if not isinstance(raw, dict):
            raise r.fail(f"fsdp_config must be a mapping, got {shown(raw)}")
        config = {str(k).removeprefix("fsdp_"): v for k, v in raw.items()}
        config["version"] = doc.get("fsdp_version", config.get("version", 1))
        settings["fsdp"] = doc.get("fsdp") or True
        settings["fsdp_config"] = config
    trainer_settings(r, settings, weights, adapters=adapter in ("lora", "qlora"), given=given)
    return r.recipe()


__all__ = ["read_axolotl"]

register_format(RecipeFormat("axolotl", (".yaml", ".yml"), lambda doc: "base_model" in doc,
                             read_axolotl, order=20))
