"""A torchtitan job config (TOML) as gptcalc's options.

Keys as torchtitan's JobConfig spells them (torchtitan/config/job_config.py and the shipped
torchtitan/models/llama3/train_configs/*.toml, pytorch/torchtitan at e347b1e5, the last release
of TOML job configs). What each setting does is read from the same version:

- precision: `training.dtype = "bfloat16"` trains in pure bf16 (no fp32 copy); otherwise
  `mixed_precision_param` is FSDP2's MixedPrecisionPolicy when the data-parallel shard degree
  is above 1, else torch.autocast (single device or DDP over `data_parallel_replicate_degree`),
  and nothing (fp32) with tensor or pipeline parallelism but no FSDP (maybe_enable_amp);
- `data_parallel_shard_degree = -1` is "the ranks left over": the world size is not in the
  file, so --gpus gives it (the shard degree is --gpus over the replicate, tensor, pipeline
  and context degrees; --dp gives the shard degree itself), and without either it is asked
  for, never taken as 1;
- `compile.enable` compiles every block (--compile blocks), and the loss when `components`
  lists it (--compile model); `model.converters = ["float8"]` is torchao's float8 Linears
  (--float8 tensorwise, or rowwise by `recipe_name`); `context_parallel_degree` is --cp;
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

from .base import READ, Reading, Recipe, flatten, ignored, off, shown, RecipeFormat, register_format

# torchtitan's model flavors (torchtitan/models/<name>/__init__.py at e347b1e5) -> (preset,
# overrides, positions). Llama 3: every flavor's max_seq_len is 131072 (TransformerModelArgs) and
# its d_ff is torchtitan's FeedForward rule: int(2 * 4 * dim / 3), times ffn_dim_multiplier,
# rounded up to multiple_of. Qwen3 (qwen3_args): the released models' sizes, max_seq_len 4096.
FLAVORS: dict[tuple[str, str], tuple[str, dict[str, int], int]] = {
    # dim=256, n_layers=6, n_heads=16, vocab_size=2048; d_ff = 682 rounded up to 256 = 768
    ("llama3", "debugmodel"): ("llama3-8b", {"n_layer": 6, "n_embd": 256, "n_head": 16,
                                             "n_kv_head": 16, "d_ff": 768,
                                             "vocab_size": 2048}, 131072),
    ("llama3", "8B"): ("llama3-8b", {}, 131072),
    ("llama3", "70B"): ("llama3-70b", {}, 131072),
    ("llama3", "405B"): ("llama3.1-405b", {}, 131072),
    ("qwen3", "0.6B"): ("qwen3-0.6b", {}, 4096),
    ("qwen3", "1.7B"): ("qwen3-1.7b", {}, 4096),
    ("qwen3", "4B"): ("qwen3-4b", {}, 4096),
    ("qwen3", "8B"): ("qwen3-8b", {}, 4096),
    ("qwen3", "14B"): ("qwen3-14b", {}, 4096),
    ("qwen3", "32B"): ("qwen3-32b", {}, 4096),
    # vocab 2048, dim 256, 8 layers, 16 heads of 128, 8 KV heads, hidden_dim 3072, tied
    ("qwen3", "debugmodel"): ("qwen3-0.6b", {"n_layer": 8, "n_embd": 256, "n_head": 16,
                                             "n_kv_head": 8, "d_ff": 3072,
                                             "vocab_size": 2048}, 4096),
}

ALL_RANKS = -1  # data_parallel_shard_degree: the ranks the other degrees leave
# the one table of JobConfig's keys (torchtitan/config/job_config.py at e347b1e5)
KEYS: dict[str, tuple] = {
    "job.*": ignored("where outputs go and how the job is described"),
    "profiling.*": ignored("the profiler's schedule and output"),
    "metrics.*": ignored("logging"),
    "lr_scheduler.*": ignored("the learning-rate schedule"),
    "checkpoint.*": ignored("saving and loading checkpoints (between steps, not in one)"),
    "comm.*": ignored("collective timeouts and traces"),
    "validation.*": ignored("the validation loop, run apart from the training step"),
    "fault_tolerance.*": ignored("TorchFT's replica groups (off unless enabled)"),
    "experimental.*": ignored("imports of user modules"),
    "debug.*": ignored("seeds and determinism"),
    "memory_estimation.*": ignored("torchtitan's own estimator"),
    "training.dataloader.*": ignored("the data loader's workers"),
    "model.hf_assets_path": ignored("the tokenizer and weights folder"),
    "model.tokenizer_path": ignored("the tokenizer file"),
    "model.print_after_conversion": ignored("printing"),
    **dict.fromkeys(("optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps",
                     "optimizer.weight_decay"), ignored("a hyperparameter")),
    "optimizer.implementation": ignored("how the update runs (fused, foreach), not the "
                                        "states it keeps"),
    "training.dataset": ignored("the data"), "training.dataset_path": ignored("the data"),
    "training.steps": ignored("how many steps, not one step's memory"),
    "training.max_norm": ignored("gradient clipping's threshold"),
    "training.gc_freq": ignored("Python's garbage collection"),
    "training.gc_debug": ignored("debugging"),
    "training.seed": ignored("seeding"), "training.deterministic": ignored("determinism"),
    "training.mixed_precision_reduce": ignored("float32 is its one value (FSDP's reductions)"),
    "parallelism.enable_async_tensor_parallel": ignored("overlaps tp's collectives with "
                                                        "compute"),
    "parallelism.context_parallel_rotate_method": ignored("context parallelism's collective"),
    "parallelism.context_parallel_load_balancer": ignored("context parallelism's sharding "
                                                          "order"),
    "parallelism.expert_parallel_comm_backend": ignored("the all-to-all's implementation"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": ignored("overlap of "
                                                                     "communication"),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns":
        ignored("the MoE router's matmuls under op-level checkpointing"),
    "activation_checkpoint.early_stop": ignored("when recomputation stops, not what is saved"),
    "activation_checkpoint.preserve_rng_state": ignored("RNG bookkeeping"),
    "activation_checkpoint.determinism_check": ignored("a check"),
    "activation_checkpoint.debug": ignored("debugging"),
    "activation_checkpoint.memory_budget": ignored("read only by mode memory_budget"),
    "activation_checkpoint.visualize_memory_budget_pareto": ignored("a plot"),
    "compile.backend": ignored("the compiler backend (inductor)"),
    # the converters' settings act only when model.converters names them (read below)
    "quantize.*": READ, "float8.*": READ, "mx.*": READ,
    "training.enable_cpu_offload": READ,
    "training.compile": READ,  # the older spelling of compile.enable
    "parallelism.enable_compiled_autograd": off(False, "compiled autograd is not modelled"),
    "parallelism.expert_tensor_parallel_degree": off(1, "tensor parallelism inside the "
                                                        "experts is not modelled"),
    "parallelism.pipeline_parallel_schedule_csv": off("", "a schedule from a file is not "
                                                          "modelled"),
    "parallelism.pipeline_parallel_split_points": off([], "uneven pipeline stages are not "
                                                          "modelled"),
    "parallelism.module_fqns_per_model_part": off(None, "uneven pipeline stages are not "
                                                        "modelled"),
    "parallelism.pipeline_parallel_layers_per_stage": off(None, "uneven pipeline stages are "
                                                                "not modelled"),
    "parallelism.pipeline_parallel_first_stage_less_layers": off(1, "uneven pipeline stages "
                                                                    "are not modelled"),
    "parallelism.pipeline_parallel_last_stage_less_layers": off(1, "uneven pipeline stages "
                                                                   "are not modelled"),
    **dict.fromkeys((
        "model.name", "model.flavor", "model.converters", "optimizer.name",
        "optimizer.early_step_in_backward", "training.local_batch_size", "training.batch_size",
        "training.global_batch_size", "training.seq_len", "training.dtype",
        "training.mixed_precision_param", "parallelism.data_parallel_replicate_degree",
        "parallelism.data_parallel_shard_degree", "parallelism.fsdp_reshard_after_forward",
        "parallelism.tensor_parallel_degree", "parallelism.disable_loss_parallel",
        "parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_schedule",
        "parallelism.pipeline_parallel_microbatch_size", "parallelism.expert_parallel_degree",
        "parallelism.context_parallel_degree", "activation_checkpoint.mode",
        "activation_checkpoint.selective_ac_option", "compile.enable", "compile.components"),
        READ),
}
# JobConfig's defaults of the keys read (job_config.py at e347b1e5)
DEFAULTS = {"model.name": "llama3", "model.flavor": "debugmodel", "model.converters": [],
            "optimizer.name": "AdamW", "optimizer.early_step_in_backward": False,
            "training.local_batch_size": 8, "training.global_batch_size": -1,
            "training.seq_len": 2048, "training.dtype": "float32",
            "training.mixed_precision_param": "bfloat16", "training.enable_cpu_offload": False,
            "parallelism.data_parallel_replicate_degree": 1,
            "parallelism.data_parallel_shard_degree": ALL_RANKS,
            "parallelism.fsdp_reshard_after_forward": "default",
            "parallelism.tensor_parallel_degree": 1, "parallelism.disable_loss_parallel": False,
            "parallelism.pipeline_parallel_degree": 1,
            "parallelism.pipeline_parallel_schedule": "1F1B",
            "parallelism.pipeline_parallel_microbatch_size": 1,
            "parallelism.expert_parallel_degree": 1, "parallelism.context_parallel_degree": 1,
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "2",
            "compile.enable": False, "compile.components": ["model", "loss"]}


def read_torchtitan(doc: dict[str, Any], path: Path, given: dict[str, Any]) -> Recipe:
    """A torchtitan job config (parsed TOML) as options; `given`: the options typed beside it
    (--dp completes `data_parallel_shard_degree = -1`)."""
    r = Reading(path, "torchtitan")
    keys = flatten(doc)
    r.walk(keys, KEYS)
    v = {k: keys.get(k, d) for k, d in DEFAULTS.items()}
    if "training.batch_size" in keys:  # the older spelling of local_batch_size
        v["training.local_batch_size"] = keys["training.batch_size"]
    if "training.compile" in keys:  # the older spelling of compile.enable
        v["compile.enable"] = keys["training.compile"]
    _model(r, v["model.name"], v["model.flavor"])
    _optimizer(r, v)
    _parallel(r, v, given)
    _recompute(r, v["activation_checkpoint.mode"], v["activation_checkpoint.selective_ac_option"])
    _compile(r, v)
    _converters(r, keys, v)
    r.set("training.seq_len", "seq_len", r.count("training.seq_len", v["training.seq_len"]))
    r.set("(training loop)", "keep_logits", False)
    return r.recipe()


def _compile(r: Reading, v: dict[str, Any]) -> None:
    """compile.enable: torchtitan compiles each transformer block (apply_compile), and the
    loss when `components` names it: --compile blocks, or model with the loss."""
    if not r.flag("compile.enable", v["compile.enable"]):
        return
    parts = v["compile.components"]
    if not isinstance(parts, list) or not all(isinstance(x, str) for x in parts):
        raise r.fail(f"compile.components must be a list of names, got {shown(parts)}")
    if "model" not in parts:
        r.refuse("compile.components", parts, "a compiled loss beside an eager model is not "
                                              "modelled", option="compile")
        return
    r.set("compile.enable+components", "compile", "model" if "loss" in parts else "blocks")


def _converters(r: Reading, keys: dict[str, Any], v: dict[str, Any]) -> None:
    """model.converters: "float8" is torchao's float8 training of the Linears
    (quantize.linear.float8: recipe_name None is tensorwise scaling, whose FSDP2 all-gathers
    are float8 when enable_fsdp_float8_all_gather); other converters are not modelled."""
    converters = v["model.converters"]
    if isinstance(converters, str):
        converters = [converters]
    if not isinstance(converters, list) or not all(isinstance(x, str) for x in converters):
        raise r.fail(f"model.converters must be a list of names, got {shown(converters)}")
    for key in keys:
        if key.split(".")[0] in ("quantize", "float8", "mx") and not (
                "float8" in converters and (key.startswith("quantize.linear.float8.")
                                            or key.startswith("float8."))):
            r.ignore(key, "configures a converter that model.converters does not turn on")
    others = [c for c in converters if c != "float8"]
    if others:
        r.refuse("model.converters", others, "converters other than float8 (MX, quantized "
                                             "grouped matmuls) are not modelled")
    if "float8" not in converters:
        return
    p = "quantize.linear.float8." if any(k.startswith("quantize.") for k in keys) else "float8."
    f8 = {k[len(p):]: val for k, val in keys.items() if k.startswith(p)}
    for name, value in f8.items():
        if name in ("precompute_float8_dynamic_scale_for_fsdp", "emulate"):
            r.ignore(p + name, "when the scales are computed, or float8 emulated")
        elif name == "filter_fqns":
            if not isinstance(value, list) or not set(value) <= {"output", "router.gate"}:
                r.refuse(p + name, value, "float8 Linears other than the blocks' are not "
                                          "modelled")
            r.ignore(p + name, "the output head (and a router) stays bf16, as gptcalc counts")
        elif name not in ("recipe_name", "enable_fsdp_float8_all_gather"):
            r.unread.append(p + name)
    recipe = f8.get("recipe_name") or "tensorwise"
    if recipe not in ("tensorwise", "rowwise"):
        r.refuse(p + "recipe_name", recipe, "float8 with this scaling is not modelled")
    if r.values.get("mode") == "fp32":
        raise r.fail("model.converters = ['float8'] over fp32 Linear inputs (tensor or pipeline "
                     "parallelism without FSDP: no autocast) is not modelled")
    sharded = r.values.get("engine") == "fsdp2"
    if recipe == "tensorwise" and sharded and not r.flag(
            p + "enable_fsdp_float8_all_gather", f8.get("enable_fsdp_float8_all_gather", False)):
        r.refuse(p + "enable_fsdp_float8_all_gather", False, "float8 Linears with bf16 "
                                                             "all-gathers are not modelled")
    r.set("model.converters", "float8", recipe)


def _model(r: Reading, name: Any, flavor: Any) -> None:
    key = (r.text("model.name", name), r.text("model.flavor", flavor))
    if key not in FLAVORS:
        known = ", ".join(f for n, f in FLAVORS if n == key[0])
        known = f"; {key[0]}'s known flavors: {known}" if known else (
            f"; known models: {', '.join(sorted({n for n, _ in FLAVORS}))}")
        raise r.fail(f"model.flavor: {key[0]} {shown(key[1])} has no gptcalc preset{known}")
    preset, sizes, positions = FLAVORS[key]
    r.set("model.name+flavor", "preset", preset)
    for option, value in {**sizes, "block_size": positions}.items():
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
    tp = r.count(p + "tensor_parallel_degree", v[p + "tensor_parallel_degree"])
    pp = r.count(p + "pipeline_parallel_degree", v[p + "pipeline_parallel_degree"])
    cp = r.count(p + "context_parallel_degree", v[p + "context_parallel_degree"])
    if shard != ALL_RANKS:
        shard = r.count(p + "data_parallel_shard_degree", shard)
    elif given.get("dp"):  # the ranks left over, as --dp gives them
        shard = given["dp"]
    else:  # the ranks left over: --gpus over the other degrees
        shard = r.world(p + "data_parallel_shard_degree", ALL_RANKS, given,
                        replicate * tp * pp * cp)
    if shard > 1 and replicate > 1:
        r.refuse(p + "data_parallel_replicate_degree", replicate,
                 "HSDP (replicated shard groups) is not modelled", option="dp")
    local = r.count("training.local_batch_size", v["training.local_batch_size"])
    dtype, param = v["training.dtype"], v["training.mixed_precision_param"]
    if dtype not in ("bfloat16", "float32") or param not in ("bfloat16", "float32"):
        raise r.fail(f"training.dtype and mixed_precision_param are bfloat16 or float32, got "
                     f"{shown(dtype)}, {shown(param)}")
    fsdp = shard > 1
    # maybe_enable_amp (torchtitan/distributed/utils.py): fully_shard's policy under FSDP;
    # torch.autocast on one device or DDP; none with tp or pp but no FSDP
    autocast = tp == 1 and pp == 1
    mode = "bf16" if dtype == "bfloat16" else "fp32" if param == "float32" else (
        "mixed" if fsdp else "amp" if autocast else "fp32")
    r.set("training.dtype+mixed_precision_param", "mode", mode)
    if fsdp:
        r.set(p + "data_parallel_shard_degree", "engine", "fsdp2")
        if not (v[p + "data_parallel_shard_degree"] == ALL_RANKS and given.get("dp")):
            r.set(p + "data_parallel_shard_degree", "dp", shard)
        policy = v[p + "fsdp_reshard_after_forward"]
        if policy not in ("default", "always", "never"):
            raise r.fail(f"{p}fsdp_reshard_after_forward is default, always or never, got "
                         f"{shown(policy)}")
        reshard = policy == "always" or (policy == "default" and pp == 1)
        r.set(p + "fsdp_reshard_after_forward", "zero", 3 if reshard else 2)
    # apply_fsdp's CPUOffloadPolicy, which torchtitan applies only under FSDP
    if r.flag("training.enable_cpu_offload", v["training.enable_cpu_offload"]):
        if not fsdp:
            r.refuse("training.enable_cpu_offload", True, "CPU offload is FSDP's: "
                     "data_parallel_shard_degree above 1")
        r.set("training.enable_cpu_offload", "offload_param", "cpu")
    if not fsdp:
        r.set(p + "data_parallel_replicate_degree", "dp", replicate)
    r.set(p + "tensor_parallel_degree", "tp", tp)
    if cp > 1:
        r.set(p + "context_parallel_degree", "cp", cp)
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
                     f"op or a whole number; got {shown(mode)}, {shown(option)}")


__all__ = ["FLAVORS", "read_torchtitan"]

register_format(RecipeFormat("torchtitan", (".toml",), lambda doc: True, read_torchtitan))
