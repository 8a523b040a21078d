"""A torchtitan job config (TOML) as gptcalc's options.

Keys as torchtitan's JobConfig spells them (torchtitan/config/job_config.py and the shipped
torchtitan/models/llama3/train_configs/*.toml, pytorch/torchtitan at e347b1e5, the last release
of TOML job configs). What each setting does is read from the same version:

- precision: `training.dtype = "bfloat16"` trains in pure bf16 (no fp32 copy); otherwise
  `mixed_precision_param` is FSDP2's MixedPrecisionPolicy when the data-parallel shard degree
  is above 1, else torch.autocast (single device or DDP over `data_parallel_replicate_degree`),
  and nothing (fp32) with tensor or pipeline parallelism but no FSDP (maybe_enable_amp);
- `data_parallel_shard_degree = -1` is "the ranks left over": the world size is not in the
  file, so --dp gives it (1 without it: no FSDP, as torchtitan on one device);
- `fsdp_reshard_after_forward`: "always" is ZeRO-3, "never" ZeRO-2, "default" ZeRO-3 without
  pipelining and ZeRO-2 with it (torchtitan/distributed's apply_fsdp);
- tensor parallelism shards the norms' activations over the sequence (SequenceParallel in
  torchtitan's plan): --sp with --tp;
- activation checkpointing: "full" wraps every block; "selective" with "op" is the op-level
  policy (--recompute op); a number n checkpoints every n-th block, which gptcalc does not
  model except n = 1 (every block: full);
- the training loop frees the logits before backward (`del pred`): --no-keep-logits.

torchtitan wraps the token embedding as an FSDP unit of its own and the final norm with the
head as another (llama3/infra/parallelize.py, apply_fsdp); gptcalc's FSDP2 engine counts the
blocks as units and everything else in the root, so at the start of backward it holds the
embedding unsharded where torchtitan has resharded it (V x E / dp elements against V x E).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Reading, Recipe, flatten, section_of

# torchtitan's model flavors (torchtitan/models/llama3/__init__.py, llama3_args, at e347b1e5):
# (name, flavor) -> (preset, overrides); every flavor's max_seq_len is 131072 (TransformerModelArgs)
# and its d_ff is torchtitan's FeedForward rule: int(2 * 4 * dim / 3), times ffn_dim_multiplier,
# rounded up to multiple_of
FLAVORS: dict[tuple[str, str], tuple[str, dict[str, int]]] = {
    # dim=256, n_layers=6, n_heads=16, vocab_size=2048; d_ff = 682 rounded up to 256 = 768
    ("llama3", "debugmodel"): ("llama3-8b", {"n_layer": 6, "n_embd": 256, "n_head": 16,
                                             "n_kv_head": 16, "d_ff": 768,
                                             "vocab_size": 2048}),
    ("llama3", "8B"): ("llama3-8b", {}),
    ("llama3", "70B"): ("llama3-70b", {}),
    ("llama3", "405B"): ("llama3.1-405b", {}),
}
MAX_SEQ_LEN = 131072

# sections that configure nothing a step holds in memory
SECTIONS = {
    "job": "where outputs go and how the job is described",
    "profiling": "the profiler's schedule and output",
    "metrics": "logging",
    "lr_scheduler": "the learning-rate schedule",
    "checkpoint": "saving and loading checkpoints (between steps, not in one)",
    "comm": "collective timeouts and traces",
    "validation": "the validation loop, run apart from the training step",
    "fault_tolerance": "TorchFT's replica groups (off unless enabled)",
    "experimental": "imports of user modules",
    "debug": "seeds and determinism",
    "memory_estimation": "torchtitan's own estimator",
    "training.dataloader": "the data loader's workers",
}
IGNORED = {
    "model.hf_assets_path": "the tokenizer and weights folder",
    "model.tokenizer_path": "the tokenizer file",
    "model.print_after_conversion": "printing",
    "optimizer.lr": "a hyperparameter", "optimizer.beta1": "a hyperparameter",
    "optimizer.beta2": "a hyperparameter", "optimizer.eps": "a hyperparameter",
    "optimizer.weight_decay": "a hyperparameter",
    "optimizer.implementation": "how the update runs (fused, foreach), not the states it keeps",
    "training.dataset": "the data", "training.dataset_path": "the data",
    "training.steps": "how many steps, not one step's memory",
    "training.max_norm": "gradient clipping's threshold",
    "training.gc_freq": "Python's garbage collection", "training.gc_debug": "debugging",
    "training.seed": "seeding", "training.deterministic": "determinism",
    "training.mixed_precision_reduce": "float32 is its one value (FSDP's reductions)",
    "parallelism.enable_async_tensor_parallel": "overlaps tp's collectives with compute",
    "parallelism.context_parallel_rotate_method": "context parallelism's collective",
    "parallelism.context_parallel_load_balancer": "context parallelism's sharding order",
    "parallelism.expert_parallel_comm_backend": "the all-to-all's implementation",
    "parallelism.pipeline_parallel_expert_parallel_overlap": "overlap of communication",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns":
        "the MoE router's matmuls under op-level checkpointing",
    "activation_checkpoint.early_stop": "when recomputation stops, not what is saved",
    "activation_checkpoint.preserve_rng_state": "RNG bookkeeping",
    "activation_checkpoint.determinism_check": "a check",
    "activation_checkpoint.debug": "debugging",
    "activation_checkpoint.memory_budget": "read only by mode memory_budget",
    "activation_checkpoint.visualize_memory_budget_pareto": "a plot",
    "compile.components": "read only when compile is enabled",
    "compile.backend": "read only when compile is enabled",
}
# the float8 and MX settings configure converters that model.converters turns on
CONVERTER_SECTIONS = ("float8", "mx", "quantize")
# (key, its value that changes nothing) for the settings gptcalc does not model
OFF = {"training.enable_cpu_offload": False, "training.compile": False, "compile.enable": False,
       "parallelism.enable_compiled_autograd": False, "parallelism.context_parallel_degree": 1,
       "parallelism.expert_tensor_parallel_degree": 1,
       "parallelism.pipeline_parallel_schedule_csv": "",
       "parallelism.pipeline_parallel_split_points": [],
       "parallelism.module_fqns_per_model_part": None,
       "parallelism.pipeline_parallel_layers_per_stage": None,
       "parallelism.pipeline_parallel_first_stage_less_layers": 1,
       "parallelism.pipeline_parallel_last_stage_less_layers": 1}
READ = ("model.name", "model.flavor", "model.converters", "optimizer.name",
        "optimizer.early_step_in_backward", "training.local_batch_size", "training.batch_size",
        "training.global_batch_size", "training.seq_len", "training.dtype",
        "training.mixed_precision_param", "parallelism.data_parallel_replicate_degree",
        "parallelism.data_parallel_shard_degree", "parallelism.fsdp_reshard_after_forward",
        "parallelism.tensor_parallel_degree", "parallelism.disable_loss_parallel",
        "parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_schedule",
        "parallelism.pipeline_parallel_microbatch_size", "parallelism.expert_parallel_degree",
        "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option")
# JobConfig's defaults of the keys read (job_config.py at e347b1e5)
DEFAULTS = {"model.name": "llama3", "model.flavor": "debugmodel", "model.converters": [],
            "optimizer.name": "AdamW", "optimizer.early_step_in_backward": False,
            "training.local_batch_size": 8, "training.global_batch_size": -1,
            "training.seq_len": 2048, "training.dtype": "float32",
            "training.mixed_precision_param": "bfloat16",
            "parallelism.data_parallel_replicate_degree": 1,
            "parallelism.data_parallel_shard_degree": -1,
            "parallelism.fsdp_reshard_after_forward": "default",
            "parallelism.tensor_parallel_degree": 1, "parallelism.disable_loss_parallel": False,
            "parallelism.pipeline_parallel_degree": 1,
            "parallelism.pipeline_parallel_schedule": "1F1B",
            "parallelism.pipeline_parallel_microbatch_size": 1,
            "parallelism.expert_parallel_degree": 1,
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "2"}


def read_torchtitan(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """A torchtitan job config (parsed TOML) as options; `given`: the options typed beside it
    (--dp completes `data_parallel_shard_degree = -1`)."""
    r = Reading(path, "torchtitan")
    keys = flatten(doc)
    converters = keys.get("model.converters", [])
    for key, value in keys.items():
        why = section_of(key, SECTIONS) or IGNORED.get(key)
        if why is None and key.split(".")[0] in CONVERTER_SECTIONS and not converters:
            why = "configures a converter (float8, MX) that model.converters does not turn on"
        if why is not None:
            r.ignore(key, why)
        elif key in OFF:
            if value != OFF[key]:
                r.refuse(key, value)
            r.ignore(key, "off")
        elif key not in READ:
            raise r.unknown(key)
    if converters:
        r.refuse("model.converters", converters)
    v = {k: keys.get(k, d) for k, d in DEFAULTS.items()}
    if "training.batch_size" in keys:  # the older spelling of local_batch_size
        v["training.local_batch_size"] = keys["training.batch_size"]
    _model(r, v["model.name"], v["model.flavor"])
    _optimizer(r, v)
    _parallel(r, v, given)
    _recompute(r, v["activation_checkpoint.mode"], v["activation_checkpoint.selective_ac_option"])
    r.set("training.seq_len", "seq_len", r.count("training.seq_len", v["training.seq_len"]))
    r.set("(training loop)", "keep_logits", False)
    return r.recipe()


def _model(r: Reading, name: Any, flavor: Any) -> None:
    key = (r.text("model.name", name), r.text("model.flavor", flavor))
    if key not in FLAVORS:
        known = ", ".join(f"{n} {f}" for n, f in FLAVORS)
        raise r.fail(f"model {key[0]} flavor {key[1]} has no gptcalc preset; known: {known}")
    preset, sizes = FLAVORS[key]
    r.set("model.name+flavor", "preset", preset)
    for option, value in {**sizes, "block_size": MAX_SEQ_LEN}.items():
        r.set("model.flavor", option, value)


def _optimizer(r: Reading, v: dict[str, Any]) -> None:
    name = r.text("optimizer.name", v["optimizer.name"])
    if name in ("AdamW", "Adam"):
        r.set("optimizer.name", "optimizer", "adamw")
    else:
        r.refuse("optimizer.name", name, option="optimizer")
    if r.flag("optimizer.early_step_in_backward", v["optimizer.early_step_in_backward"]):
        r.set("optimizer.early_step_in_backward", "optimizer_in_backward", True)


def _parallel(r: Reading, v: dict[str, Any], given: dict[str, Any]) -> None:
    p = "parallelism."
    replicate = r.count(p + "data_parallel_replicate_degree",
                        v[p + "data_parallel_replicate_degree"])
    shard = v[p + "data_parallel_shard_degree"]
    if shard != -1:
        shard = r.count(p + "data_parallel_shard_degree", shard)
    elif replicate == 1:  # the ranks left over: --dp gives the world's data-parallel ranks
        shard = given.get("dp") or 1
    else:
        shard = 1
    if shard > 1 and replicate > 1:
        r.refuse(p + "data_parallel_replicate_degree", replicate,
                 "HSDP (replicated shard groups) is not modelled", option="dp")
    tp = r.count(p + "tensor_parallel_degree", v[p + "tensor_parallel_degree"])
    pp = r.count(p + "pipeline_parallel_degree", v[p + "pipeline_parallel_degree"])
    local = r.count("training.local_batch_size", v["training.local_batch_size"])
    dtype, param = v["training.dtype"], v["training.mixed_precision_param"]
    if dtype not in ("bfloat16", "float32") or param not in ("bfloat16", "float32"):
        raise r.fail(f"training.dtype and mixed_precision_param are bfloat16 or float32, got "
                     f"{dtype!r}, {param!r}")
    fsdp = shard > 1
    # maybe_enable_amp (torchtitan/distributed/utils.py): fully_shard's policy under FSDP;
    # torch.autocast on one device or DDP; none with tp or pp but no FSDP
    autocast = tp == 1 and pp == 1
    mode = "bf16" if dtype == "bfloat16" else "fp32" if param == "float32" else (
        "mixed" if fsdp else "amp" if autocast else "fp32")
    r.set("training.dtype+mixed_precision_param", "mode", mode)
    if fsdp:
        r.set(p + "data_parallel_shard_degree", "engine", "fsdp2")
        if v[p + "data_parallel_shard_degree"] != -1:  # -1: --dp gave it
            r.set(p + "data_parallel_shard_degree", "dp", shard)
        policy = v[p + "fsdp_reshard_after_forward"]
        if policy not in ("default", "always", "never"):
            raise r.fail(f"{p}fsdp_reshard_after_forward is default, always or never, got "
                         f"{policy!r}")
        reshard = policy == "always" or (policy == "default" and pp == 1)
        r.set(p + "fsdp_reshard_after_forward", "zero", 3 if reshard else 2)
    else:
        r.set(p + "data_parallel_replicate_degree", "dp", replicate)
    r.set(p + "tensor_parallel_degree", "tp", tp)
    if tp > 1:
        r.set(p + "tensor_parallel_degree", "sp", True)
        if r.flag(p + "disable_loss_parallel", v[p + "disable_loss_parallel"]):
            r.refuse(p + "disable_loss_parallel", True)
    r.set(p + "pipeline_parallel_degree", "pp", pp)
    r.set(p + "expert_parallel_degree", "ep", r.count(p + "expert_parallel_degree",
                                                      v[p + "expert_parallel_degree"]))
    micro = local
    if pp > 1:
        if str(v[p + "pipeline_parallel_schedule"]).lower() != "1f1b":
            r.refuse(p + "pipeline_parallel_schedule", v[p + "pipeline_parallel_schedule"],
                     "only 1F1B is modelled", option="pp")
        micro = r.count(p + "pipeline_parallel_microbatch_size",
                        v[p + "pipeline_parallel_microbatch_size"])
        if local % micro:
            raise r.fail(f"training.local_batch_size {local} is not a multiple of "
                         f"{p}pipeline_parallel_microbatch_size {micro}")
    r.set("training.local_batch_size", "batch_size", micro)
    accum = local // micro
    total = v["training.global_batch_size"]
    if total != -1:
        total = r.count("training.global_batch_size", total)
        dp = shard if fsdp else replicate
        if total % (local * dp):
            raise r.fail(f"training.global_batch_size {total} is not a multiple of "
                         f"local_batch_size x data-parallel degree = {local * dp}")
        accum *= total // (local * dp)
    if accum > 1:
        r.set("training.global_batch_size", "grad_accum", accum)


def _recompute(r: Reading, mode: Any, option: Any) -> None:
    key = "activation_checkpoint.mode"
    if mode == "none":
        r.set(key, "recompute", "none")
    elif mode == "full":
        r.set(key, "recompute", "full")
    elif mode == "selective" and str(option) == "op":
        r.set(key + "+selective_ac_option", "recompute", "op")
    elif mode == "selective" and str(option).isdigit() and int(option) == 1:
        r.set(key + "+selective_ac_option", "recompute", "full")  # every block
    elif mode == "selective" and str(option).isdigit() and int(option) > 1:
        r.refuse("activation_checkpoint.selective_ac_option", option,
                 "every n-th block checkpointed is not modelled", option="recompute")
    elif mode == "memory_budget":
        r.refuse(key, mode, "the compiler's memory-budget partitioner is not modelled",
                 option="recompute")
    else:
        raise r.fail(f"{key} is none, full, selective or memory_budget, with selective_ac_option "
                     f"op or a whole number; got {mode!r}, {option!r}")


__all__ = ["FLAVORS", "read_torchtitan"]
