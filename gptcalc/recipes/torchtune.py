"""A torchtune recipe config (YAML) as gptcalc's options.

Keys as torchtune's shipped configs spell them (recipes/configs/*/*.yaml, and the recipes that
read them: recipes/full_finetune_*.py, recipes/lora_finetune_*.py; pytorch/torchtune at
0b3e04ad). What each setting does there:

- `model._component_` names a model builder: `torchtune.models.<family>.<name>`, with `lora_`
  (LoRA adapters on a frozen base) or `qlora_` (the base in torchao's NF4, 4 bits a weight with
  8-bit block scales per 64 and fp32 scales of those per 256: counted as bitsandbytes' NF4 with
  double-quantised constants, --weights-dtype nf4-dq) before the name;
- `lora_attn_modules` q_proj, k_proj, v_proj, output_proj; `apply_lora_to_mlp` the three MLP
  projections; `apply_lora_to_output` the output head;
- `dtype: bf16` builds the model in bf16 (weights, adapters, gradients and AdamW states all
  bf16: --mode bf16); fp32 keeps everything fp32;
- `enable_activation_checkpointing` wraps every transformer layer (--recompute full);
- `loss: CEWithChunkedOutputLoss` is --loss chunked (its num_output_chunks, 8 by default);
- the recipes free the logits before backward (`del logits`): --no-keep-logits;
- the distributed recipes shard with FSDP2 (`fsdp_reshard_after_forward`, True by default, is
  ZeRO-3) over the world's ranks, which the file does not give: --dp.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .base import Reading, Recipe, flatten, section_of

COMPONENT = re.compile(r"torchtune\.models\.(\w+)\.(lora_|qlora_)?(\w+)")
# torchtune's model builders (torchtune/models/*/_model_builders.py) -> (preset, overrides):
# Llama 3.1's tensors are Llama 3's (its longer context and rotary scaling change no tensor)
MODELS: dict[str, tuple[str, dict[str, int]]] = {
    "llama2_7b": ("llama2-7b", {}),
    "llama3_8b": ("llama3-8b", {}),
    "llama3_70b": ("llama3-70b", {}),
    "llama3_1_8b": ("llama3-8b", {}),
    "llama3_1_70b": ("llama3-70b", {}),
    "llama3_1_405b": ("llama3.1-405b", {}),
}
# lora_attn_modules' names -> gptcalc's
ATTN_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
OPTIMIZERS = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adamw",
              "bitsandbytes.optim.AdamW8bit": "adamw8bit",
              "bitsandbytes.optim.PagedAdamW8bit": "paged_adamw8bit",
              "torch.optim.SGD": "sgd"}
LOSSES = {"torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
          "torch.nn.CrossEntropyLoss": "standard"}
SECTIONS = {
    "checkpointer": "where the weights are read and written",
    "dataset": "the data", "metric_logger": "logging", "profiler": "the profiler",
    "lr_scheduler": "the learning-rate schedule", "output_dir": "an output folder",
    "seed": "seeding", "shuffle": "the data order", "epochs": "how many steps",
    "max_steps_per_epoch": "how many steps", "log_every_n_steps": "logging",
    "log_peak_memory_stats": "logging", "log_level": "logging",
    "resume_from_checkpoint": "checkpoints", "save_adapter_weights_only": "checkpoints",
    "low_cpu_ram": "host memory while loading", "clip_grad_norm": "gradient clipping",
    "custom_sharded_layers": "FSDP's wrapping of the embeddings and head",
    "run_val_every_n_steps": "validation", "dataset_val": "validation",
    "tokenizer": "the tokenizer",
    "optimizer": "the optimizer's hyperparameters",
    "model.lora_alpha": "the adapters' scale, a number in the forward",
}
OFF = {"compile": False, "enable_activation_offloading": False, "fsdp_cpu_offload": False,
       "model.use_dora": False, "model.lora_dropout": 0.0}
READ = ("model._component_", "model.lora_attn_modules", "model.apply_lora_to_mlp",
        "model.apply_lora_to_output", "model.lora_rank", "model.quantize_base",
        "tokenizer.max_seq_len", "batch_size",
        "gradient_accumulation_steps", "optimizer._component_", "optimizer.momentum",
        "optimizer_in_bwd", "loss._component_", "loss.num_output_chunks", "device", "dtype",
        "enable_activation_checkpointing", "fsdp_reshard_after_forward")


def read_torchtune(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """A torchtune config (parsed YAML) as options."""
    r = Reading(path, "torchtune")
    keys = flatten(doc)
    for key, value in keys.items():
        if key in READ:
            continue
        if key in OFF:
            if value not in (OFF[key], None) and not (key == "model.lora_dropout" and value == 0):
                r.refuse(key, value)
            r.ignore(key, "off")
            continue
        why = section_of(key, SECTIONS)
        if why is None:
            raise r.unknown(key)
        r.ignore(key, why)
    _model(r, keys)
    if "tokenizer.max_seq_len" in keys and keys["tokenizer.max_seq_len"] is not None:
        r.set("tokenizer.max_seq_len", "seq_len",
              r.count("tokenizer.max_seq_len", keys["tokenizer.max_seq_len"]))
    else:
        r.ignore("tokenizer.max_seq_len", "null: sequences as long as the data's; --seq-len "
                                          "gives them (default the model's T)")
    r.set("batch_size", "batch_size", r.count("batch_size", keys.get("batch_size", 1)))
    accum = r.count("gradient_accumulation_steps", keys.get("gradient_accumulation_steps", 1))
    r.set("gradient_accumulation_steps", "grad_accum", accum)
    dtype = keys.get("dtype", "bf16")
    if dtype not in ("bf16", "fp32"):
        r.refuse("dtype", dtype, option="mode")
    else:
        r.set("dtype", "mode", "bf16" if dtype == "bf16" else "fp32")
    _optimizer(r, keys)
    loss = keys.get("loss._component_", "torchtune.modules.loss.CEWithChunkedOutputLoss")
    if loss in LOSSES:
        r.set("loss._component_", "loss", LOSSES[loss])
        if LOSSES[loss] == "chunked" and "loss.num_output_chunks" in keys:
            r.set("loss.num_output_chunks", "loss_chunks",
                  r.count("loss.num_output_chunks", keys["loss.num_output_chunks"]))
    else:
        r.refuse("loss._component_", loss, option="loss")
    ckpt = r.flag("enable_activation_checkpointing",
                  keys.get("enable_activation_checkpointing", False))
    r.set("enable_activation_checkpointing", "recompute", "full" if ckpt else "none")
    device = keys.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise r.fail(f"device must be cuda or cpu, got {device!r}")
    r.set("device", "device", device)
    if "fsdp_reshard_after_forward" in keys or "fsdp_cpu_offload" in keys:
        r.set("fsdp_*", "engine", "fsdp2")
        reshard = r.flag("fsdp_reshard_after_forward", keys.get("fsdp_reshard_after_forward",
                                                                True))
        r.set("fsdp_reshard_after_forward", "zero", 3 if reshard else 2)
        if not given.get("dp"):
            r.ignore("(world size)", "not in the file: --dp gives the data-parallel ranks")
    r.set("(training loop)", "keep_logits", False)
    return r.recipe()


def _model(r: Reading, keys: dict[str, Any]) -> None:
    component = r.text("model._component_", keys.get("model._component_"))
    m = COMPONENT.fullmatch(component)
    if not m or m.group(3) not in MODELS:
        known = ", ".join(f"torchtune.models.<family>.[lora_|qlora_]{n}" for n in MODELS)
        raise r.fail(f"model._component_ {component} has no gptcalc preset; known: {known}")
    preset, sizes = MODELS[m.group(3)]
    r.set("model._component_", "preset", preset)
    for option, value in sizes.items():
        r.set("model._component_", option, value)
    if not m.group(2):
        return
    names = keys.get("model.lora_attn_modules", []) or []
    for name in names:
        if name not in ATTN_TARGETS:
            raise r.fail(f"model.lora_attn_modules: {name!r} is not one of "
                         f"{', '.join(ATTN_TARGETS)}")
    targets = [t for n, t in ATTN_TARGETS.items() if n in names]  # the model's order
    if r.flag("model.apply_lora_to_mlp", keys.get("model.apply_lora_to_mlp", False)):
        targets += ["gate", "up", "down"]
    if r.flag("model.apply_lora_to_output", keys.get("model.apply_lora_to_output", False)):
        targets.append("lm_head")
    if not targets:
        raise r.fail("a LoRA model with no lora_attn_modules, MLP or output adapters")
    r.set("model.lora_rank", "lora_rank", r.count("model.lora_rank", keys.get("model.lora_rank")))
    r.set("model.lora_attn_modules", "lora_targets", ",".join(targets))
    if m.group(2) == "qlora_" or keys.get("model.quantize_base"):
        r.set("model._component_", "weights_dtype", "nf4-dq")


def _optimizer(r: Reading, keys: dict[str, Any]) -> None:
    name = keys.get("optimizer._component_", "torch.optim.AdamW")
    if name not in OPTIMIZERS:
        r.refuse("optimizer._component_", name, option="optimizer")
        return
    choice = OPTIMIZERS[name]
    if choice == "sgd" and keys.get("optimizer.momentum", 0):
        choice = "sgd-momentum"
    r.set("optimizer._component_", "optimizer", choice)
    if r.flag("optimizer_in_bwd", keys.get("optimizer_in_bwd", False)):
        r.set("optimizer_in_bwd", "optimizer_in_backward", True)


__all__ = ["MODELS", "read_torchtune"]
