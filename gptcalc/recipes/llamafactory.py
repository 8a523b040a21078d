"""A LLaMA-Factory training config (YAML, `llamafactory-cli train FILE`) as gptcalc's options.

Keys as LLaMA-Factory's hparams spell them (src/llamafactory/hparams/model_args.py,
data_args.py, finetuning_args.py, and TrainingArguments'; hiyouga/LLaMA-Factory at ff6d4d12),
read as its loader and trainer use them:

- `stage` sft or pt trains a causal LM; the preference and reward stages (dpo, kto, rm, ppo)
  hold a reference or value model and are not modelled;
- `finetuning_type: lora` puts adapters of `lora_rank` on `lora_target` ("all": every linear
  but the head, --lora-targets all) over the base in the compute dtype (bf16 under `bf16`),
  the adapters upcast to fp32 (--mode amp); `full` trains every parameter, upcast to fp32
  (--mode amp over fp32 weights) unless `pure_bf16` (--mode bf16);
- `quantization_bit: 4` with `quantization_method: bnb` is bitsandbytes' NF4
  (`quantization_type`), with double quantisation unless `double_quantization: false`;
  LLaMA-Factory does not call peft's prepare_model_for_kbit_training (--no-kbit-prepare);
- gradient checkpointing is on unless `disable_gradient_checkpointing` (--recompute full);
- `cutoff_len` is the longest row (--seq-len); `flash_attn` auto, fa2 and sdpa are --attn sdpa,
  disabled is eager (--attn manual);
- `enable_liger_kernel` applies Liger's Llama defaults (--liger all, --loss fused);
- `deepspeed`, `bf16`/`fp16`, `optim` and the batch as the Trainer reads them
  (`gptcalc.recipes.hf_trainer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import READ, Reading, Recipe, ignored, off, refused, shown, RecipeFormat, register_format
from .hf_trainer import TRAINER_KEYS, liger_kernel, model, targets, trainer_settings

STAGES = ("sft", "pt")
_DATA = ignored("the data, its template and loading")
_MODEL = ignored("where the model and tokenizer come from")
# the one table of LLaMA-Factory's own keys; TrainingArguments' follow the Trainer's table
KEYS: dict[str, tuple] = {
    **TRAINER_KEYS,
    **dict.fromkeys(("template", "dataset", "eval_dataset", "dataset_dir", "media_dir",
                     "train_on_prompt", "mask_history", "streaming", "buffer_size",
                     "mix_strategy", "interleave_probs", "overwrite_cache",
                     "preprocessing_batch_size", "preprocessing_num_workers", "max_samples",
                     "eval_num_beams", "ignore_pad_token_for_loss", "val_size",
                     "eval_on_each_dataset", "tool_format", "default_system",
                     "enable_thinking", "tokenized_path", "data_shared_file_system",
                     "image_max_pixels", "image_min_pixels", "video_max_pixels",
                     "video_min_pixels", "video_fps", "video_maxlen"), _DATA),
    **dict.fromkeys(("packing", "neat_packing"), ignored("how rows are filled: --seq-len is "
                                                          "the row")),
    **dict.fromkeys(("trust_remote_code", "cache_dir", "use_fast_tokenizer", "resize_vocab",
                     "split_special_tokens", "new_special_tokens", "model_revision",
                     "low_cpu_mem_usage", "hf_hub_token", "ms_hub_token", "om_hub_token",
                     "print_param_status", "infer_backend", "infer_dtype", "offload_folder",
                     "quantization_device_map", "train_from_scratch", "rope_scaling"),
                    _MODEL),
    **dict.fromkeys(("lora_alpha", "use_rslora", "loraplus_lr_ratio", "loraplus_lr_embedding",
                     "create_new_adapter", "moe_aux_loss_coef", "use_reentrant_gc",
                     "plot_loss", "include_effective_tokens_per_second", "compute_accuracy",
                     "freeze_vision_tower", "freeze_multi_modal_projector",
                     "freeze_language_model"), ignored("a hyperparameter, a plot or a "
                                                       "module frozen anyway")),
    **dict.fromkeys(("pref_beta", "pref_ftx", "pref_loss", "dpo_label_smoothing",
                     "simpo_gamma", "kto_chosen_weight", "kto_rejected_weight", "ref_model",
                     "reward_model", "ppo_epochs"), ignored("read only by the preference "
                                                           "and reward stages")),
    "additional_target": off(None, "fully trained modules beside the adapters are not "
                                   "modelled"),
    "pissa_init": off(False, "PiSSA's initialisation is not modelled"),
    "use_unsloth": off(False, "unsloth's kernels are not modelled"),
    "enable_liger_kernel": READ,
    "shift_attn": off(False, "shift short attention is not modelled"),
    "mixture_of_depths": off(None, "mixture of depths is not modelled"),
    "upcast_layernorm": off(False, "fp32 norms are not modelled"),
    "upcast_lmhead_output": off(False, "an fp32 head output is not modelled"),
    "adapter_name_or_path": refused("training on top of saved adapters is not modelled"),
    **dict.fromkeys(("model_name_or_path", "stage", "finetuning_type", "pure_bf16",
                     "lora_rank", "lora_target", "quantization_bit", "quantization_method",
                     "quantization_type", "double_quantization",
                     "disable_gradient_checkpointing", "cutoff_len", "flash_attn",
                     "lora_dropout", "use_dora"), READ),
}
FLASH = {"auto": "sdpa", "fa2": "sdpa", "sdpa": "sdpa", "disabled": "manual"}


def read_llamafactory(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """A LLaMA-Factory config (parsed YAML) as options."""
    r = Reading(path, "LLaMA-Factory")
    r.walk(doc, KEYS)
    stage = doc.get("stage", "sft")
    if stage not in STAGES:
        raise r.fail(f"stage = {shown(stage)}: a preference or reward stage (a policy beside "
                     f"a reference, reward or value model) is not modelled")
    if "model_name_or_path" not in doc:
        raise r.fail("model_name_or_path is missing")
    model(r, "model_name_or_path", doc["model_name_or_path"], given)
    if doc.get("cutoff_len") is not None:
        r.set("cutoff_len", "seq_len", r.count("cutoff_len", doc["cutoff_len"]))
    else:  # LLaMA-Factory's default cutoff_len
        r.set("cutoff_len", "seq_len", 2048)
    r.set("per_device_train_batch_size", "batch_size",
          r.count("per_device_train_batch_size", doc.get("per_device_train_batch_size", 8)))
    r.set("gradient_accumulation_steps", "grad_accum",
          r.count("gradient_accumulation_steps", doc.get("gradient_accumulation_steps", 1)))
    kind = doc.get("finetuning_type", "lora")
    pure = r.flag("pure_bf16", doc.get("pure_bf16", False))
    if kind == "lora":
        r.set("lora_rank", "lora_rank", r.count("lora_rank", doc.get("lora_rank", 8)))
        r.adapter_options(doc, "lora_dropout", "use_dora")
        r.set("lora_target", "lora_targets", targets(r, "lora_target",
                                                     doc.get("lora_target", "all")))
        weights = "bf16" if doc.get("bf16") or pure else "fp32"
        _quantization(r, doc)
    elif kind == "full":
        weights = "bf16" if pure else "fp32"
        if doc.get("quantization_bit") is not None:
            raise r.fail("quantization_bit with finetuning_type full: a quantised base is "
                         "frozen")
    else:
        raise r.fail(f"finetuning_type = {shown(kind)}: only lora and full are modelled")
    flash = doc.get("flash_attn", "auto")
    if not isinstance(flash, str) or flash not in FLASH:
        r.refuse("flash_attn", flash, "this attention implementation is not modelled",
                 option="attn")
    else:
        r.set("flash_attn", "attn", FLASH[flash])
    if r.flag("enable_liger_kernel", doc.get("enable_liger_kernel", False)):
        # the sft and pt stages call apply_liger_kernel_to_<model>() with Liger's defaults
        # (model/model_utils/liger_kernel.py; other stages keep the logits)
        liger_kernel(r, "enable_liger_kernel")
    settings = {k: v for k, v in doc.items() if k in TRAINER_KEYS}
    settings["gradient_checkpointing"] = not r.flag(
        "disable_gradient_checkpointing", doc.get("disable_gradient_checkpointing", False))
    trainer_settings(r, settings, weights, adapters=kind == "lora" and not pure, given=given)
    return r.recipe()


def _quantization(r: Reading, doc: dict[str, Any]) -> None:
    bits = doc.get("quantization_bit")
    if bits is None:
        return
    method = doc.get("quantization_method", "bnb")
    if bits != 4 or method != "bnb":
        r.refuse("quantization_bit", bits, "only bitsandbytes' 4-bit (quantization_method bnb) "
                                           "is modelled", option="weights_dtype")
        return
    kind = doc.get("quantization_type", "nf4")
    if kind != "nf4":
        r.refuse("quantization_type", kind, "4-bit weights other than NF4 are not modelled",
                 option="weights_dtype")
        return
    double = r.flag("double_quantization", doc.get("double_quantization", True))
    r.set("quantization_bit", "weights_dtype", "nf4-dq" if double else "nf4")


__all__ = ["KEYS", "read_llamafactory"]

# keys only LLaMA-Factory's configs hold
LLAMAFACTORY = ("stage", "finetuning_type", "template", "cutoff_len", "lora_target")
register_format(RecipeFormat("LLaMA-Factory", (".yaml", ".yml"),
                             lambda doc: any(k in doc for k in LLAMAFACTORY), read_llamafactory,
                             order=40))
