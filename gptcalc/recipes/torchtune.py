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
- the recipe script, not the config, decides whether a run is distributed (`tune run
  --nproc_per_node N full_finetune_distributed --config FILE`): on --gpus N above 1 (or --dp),
  or when the file sets `fsdp_*` keys, the distributed recipes shard with FSDP2
  (`fsdp_reshard_after_forward`, True by default, is ZeRO-3) over every rank; the world size
  is not in the file, and a file with `fsdp_*` keys asks for it; without either, one device;
- `compile: True` compiles each layer and the loss (--compile model);
  `enable_activation_offloading` is --offload-activations; `LinearCrossEntropyLoss` is chunked
  like CEWithChunkedOutputLoss (--loss chunked).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..presets import did_you_mean
from ..training_setup import OPTIMIZERS as GPTCALC_OPTIMIZERS
from .base import READ, Reading, Recipe, flatten, ignored, off, shown, RecipeFormat, register_format
from .models import TORCHTUNE, torchtune_preset

COMPONENT = re.compile(r"torchtune\.models\.(\w+)\.(lora_|qlora_)?(\w+)")
# lora_attn_modules' names -> gptcalc's
ATTN_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
OPTIMIZERS = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adamw",
              "bitsandbytes.optim.AdamW8bit": "adamw8bit",
              "bitsandbytes.optim.PagedAdamW8bit": "paged_adamw8bit",
              "torch.optim.SGD": "sgd"}
if "paged_adamw" in GPTCALC_OPTIMIZERS:  # bitsandbytes' PagedAdamW, 32-bit states
    OPTIMIZERS.update({"bitsandbytes.optim.PagedAdamW": "paged_adamw",
                       "bitsandbytes.optim.PagedAdamW32bit": "paged_adamw"})
# the chunked losses: torchtune's CEWithChunkedOutputLoss and LinearCrossEntropyLoss (the head's
# output made and upcast one chunk at a time inside the loss) save what --loss chunked counts
LOSSES = {"torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
          "torchtune.modules.loss.LinearCrossEntropyLoss": "chunked",
          "torch.nn.CrossEntropyLoss": "standard"}
# the one table of a torchtune config's keys
KEYS: dict[str, tuple] = {
    "checkpointer.*": ignored("where the weights are read and written"),
    "dataset.*": ignored("the data"), "metric_logger.*": ignored("logging"),
    "profiler.*": ignored("the profiler"),
    "lr_scheduler.*": ignored("the learning-rate schedule"),
    "output_dir": ignored("an output folder"), "seed": ignored("seeding"),
    "shuffle": ignored("the data order"), "epochs": ignored("how many steps"),
    "max_steps_per_epoch": ignored("how many steps"), "log_every_n_steps": ignored("logging"),
    "log_peak_memory_stats": ignored("logging"), "log_level": ignored("logging"),
    "resume_from_checkpoint": ignored("checkpoints"),
    "save_adapter_weights_only": ignored("checkpoints"),
    "low_cpu_ram": ignored("host memory while loading"),
    "clip_grad_norm": ignored("gradient clipping"),
    "custom_sharded_layers": ignored("FSDP's wrapping of the embeddings and head"),
    "run_val_every_n_steps": ignored("validation"), "dataset_val.*": ignored("validation"),
    "batch_size_val": ignored("validation's batch, run apart from the training step"),
    "tokenizer.*": ignored("the tokenizer"),
    "optimizer.*": ignored("the optimizer's hyperparameters"),
    "model.lora_alpha": ignored("the adapters' scale, a number in the forward"),
    "tensor_parallel_plan.*": ignored("read only with tensor_parallel_dim above 1"),
    "tensor_parallel_dim": off(1, "torchtune's tensor-parallel plan is not modelled"),
    **dict.fromkeys((
        "model._component_", "model.lora_attn_modules", "model.apply_lora_to_mlp",
        "model.apply_lora_to_output", "model.lora_rank", "model.quantize_base",
        "tokenizer.max_seq_len", "batch_size", "gradient_accumulation_steps",
        "optimizer._component_", "optimizer.momentum", "optimizer_in_bwd", "loss.*", "device",
        "dtype", "enable_activation_checkpointing", "enable_activation_offloading", "compile",
        "fsdp_reshard_after_forward", "model.lora_dropout", "model.use_dora",
        "fsdp_cpu_offload"), READ),
}


def read_torchtune(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """A torchtune config (parsed YAML) as options."""
    r = Reading(path, "torchtune")
    keys = flatten(doc)
    r.walk(keys, KEYS)
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
    if isinstance(loss, str) and loss in LOSSES:
        r.set("loss._component_", "loss", LOSSES[loss])
        if LOSSES[loss] == "chunked" and "loss.num_output_chunks" in keys:
            r.set("loss.num_output_chunks", "loss_chunks",
                  r.count("loss.num_output_chunks", keys["loss.num_output_chunks"]))
    else:
        r.refuse("loss._component_", loss, option="loss")
    ckpt = r.flag("enable_activation_checkpointing",
                  keys.get("enable_activation_checkpointing", False))
    r.set("enable_activation_checkpointing", "recompute", "full" if ckpt else "none")
    if r.flag("enable_activation_offloading", keys.get("enable_activation_offloading", False)):
        r.set("enable_activation_offloading", "offload_activations", True)
    compiled = keys.get("compile", False)
    if isinstance(compiled, dict):
        r.refuse("compile", compiled, "compiling parts apart is not modelled", option="compile")
    elif r.flag("compile", compiled):  # training.compile_model (each layer) and compile_loss
        r.set("compile", "compile", "model")
    device = keys.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise r.fail(f"device must be cuda or cpu, got {shown(device)}")
    r.set("device", "device", device)
    distributed = "fsdp_reshard_after_forward" in keys or "fsdp_cpu_offload" in keys
    ranks = given.get("dp") or given.get("gpus")
    if distributed or (ranks or 1) > 1:  # `tune run --nproc_per_node N <recipe>_distributed`
        key = "fsdp_reshard_after_forward" if distributed else "(--gpus)"
        r.set(key, "engine", "fsdp2")
        reshard = r.flag("fsdp_reshard_after_forward", keys.get("fsdp_reshard_after_forward",
                                                                True))
        r.set(key, "zero", 3 if reshard else 2)
        # fully_shard(..., offload_policy=CPUOffloadPolicy()) (torchtune's shard_model)
        if r.flag("fsdp_cpu_offload", keys.get("fsdp_cpu_offload", False)):
            r.set("fsdp_cpu_offload", "offload_param", "cpu")
        if not given.get("dp"):  # the distributed recipes shard over every rank
            r.set(key, "dp", r.world(key, "(all ranks)", given))
    r.set("(training loop)", "keep_logits", False)
    return r.recipe()


def _model(r: Reading, keys: dict[str, Any]) -> None:
    component = r.text("model._component_", keys.get("model._component_"))
    m = COMPONENT.fullmatch(component)
    preset = torchtune_preset(m.group(3)) if m else None
    if preset is None:
        name = m.group(3) if m else component
        raise r.fail(f"model._component_: {shown(component)} has no gptcalc preset"
                     f"{did_you_mean(name, TORCHTUNE)}")
    r.set("model._component_", "preset", preset)
    if not m.group(2):
        return
    names = keys.get("model.lora_attn_modules", []) or []
    if not isinstance(names, list):
        raise r.fail(f"model.lora_attn_modules must be a list, got {shown(names)}")
    for name in names:
        if not isinstance(name, str) or name not in ATTN_TARGETS:
            raise r.fail(f"model.lora_attn_modules: {shown(name)} is not one of "
                         f"{', '.join(ATTN_TARGETS)}")
    targets = [t for n, t in ATTN_TARGETS.items() if n in names]  # the model's order
    if r.flag("model.apply_lora_to_mlp", keys.get("model.apply_lora_to_mlp", False)):
        targets += ["gate", "up", "down"]
    if r.flag("model.apply_lora_to_output", keys.get("model.apply_lora_to_output", False)):
        targets.append("lm_head")
    if not targets:
        raise r.fail("a LoRA model with no lora_attn_modules, MLP or output adapters")
    r.set("model.lora_rank", "lora_rank", r.count("model.lora_rank", keys.get("model.lora_rank")))
    r.adapter_options(keys, "model.lora_dropout", "model.use_dora")
    r.set("model.lora_attn_modules", "lora_targets", ",".join(targets))
    if m.group(2) == "qlora_" or keys.get("model.quantize_base"):
        r.set("model._component_", "weights_dtype", "nf4-dq")


def _optimizer(r: Reading, keys: dict[str, Any]) -> None:
    name = keys.get("optimizer._component_", "torch.optim.AdamW")
    if not isinstance(name, str) or name not in OPTIMIZERS:
        r.refuse("optimizer._component_", name, option="optimizer")
        return
    choice = OPTIMIZERS[name]
    if choice == "sgd" and keys.get("optimizer.momentum", 0):
        choice = "sgd-momentum"
    r.set("optimizer._component_", "optimizer", choice)
    if r.flag("optimizer_in_bwd", keys.get("optimizer_in_bwd", False)):
        r.set("optimizer_in_bwd", "optimizer_in_backward", True)


__all__ = ["KEYS", "read_torchtune"]

register_format(RecipeFormat(
    "torchtune", (".yaml", ".yml"),
    lambda doc: isinstance(doc.get("model"), dict) and "_component_" in doc["model"],
    read_torchtune, order=10))
