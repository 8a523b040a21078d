"""The reference model's blocks compiled as torch.compile compiles them for training: Dynamo
captures each block, AOTAutograd traces its forward and backward into one joint graph, and the
min-cut partitioner (torch/_functorch/partitioners.py, `min_cut_rematerialization_partition`,
torch 2.13: the partitioner Inductor trains with) decides what the forward saves for the
backward.

The partitioned graphs run as traced (no code generation, so no C++ compiler), after Inductor's
decompositions (`select_decomp_table`), so the partitioner sees the ops Inductor would. A block
under torchtitan's op-level checkpointing is compiled with its checkpoint: Dynamo turns the
selective-checkpoint policy into the graph's recompute tags, which the partitioner obeys. What
a compiled block saves is what its compiled autograd Function saves, so
`memory.saved_during` measures it unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .model import GPT
from .recompute import op_policy


def op_context():
    """torchtitan's context_fn (a plain function, as Dynamo needs it): a new op count per
    block forward."""
    from collections import defaultdict

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(op_policy(defaultdict(int)))


def _checkpointed(forward, recompute: str):
    """`forward` under torch.utils.checkpoint as torchtitan wraps a block (torchtitan/
    distributed/activation_checkpoint.py: non-reentrant, preserve_rng_state=False; `op` with
    the op-level policy's context)."""
    from torch.utils.checkpoint import checkpoint

    extra = {"context_fn": op_context} if recompute == "op" else {}

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False,
                          **extra, **kwargs)
    return run


def _as_traced(gm: torch.fx.GraphModule, example_inputs) -> object:
    return make_boxed_func(gm.forward)


def min_cut_backend():
    """torch.compile's backend that partitions as Inductor does and runs the graphs as traced."""
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(fw_compiler=_as_traced, bw_compiler=_as_traced,
                        partition_fn=min_cut_rematerialization_partition,
                        decompositions=select_decomp_table())


def compile_loss(model: GPT) -> GPT:
    """The model's loss compiled on its own, in place: torchtitan's compiled loss function,
    torchtune's compiled `compute_cross_entropy` (one chunk's loss)."""
    backend = min_cut_backend()
    model.loss_fn = torch.compile(model.loss_fn, backend=backend, fullgraph=True)
    model.chunk_loss_fn = torch.compile(model.chunk_loss_fn, backend=backend, fullgraph=True)
    return model


def compile_blocks(model: GPT, recompute: str = "none") -> GPT:
    """Each block of `model` (built without recomputation) compiled on its own, in place:
    torchtitan's `apply_compile`, one torch.compile per transformer block, after its
    activation checkpointing (`op`: torchtitan's op-level policy; `full`: the whole block)."""
    torch._dynamo.reset()
    backend = min_cut_backend()
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        if recompute in ("op", "full"):
            block.forward = _checkpointed(block.forward, recompute)
        blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
    return model


def build_compiled(cfg, setup, device: str = "cpu") -> GPT:
    """The reference model of `setup` with its blocks compiled (`setup.compile` blocks) and its
    loss too (model), recomputation applied under the compile as torchtitan applies it; with
    `setup.lora_rank`, PEFT-shaped adapters added before the compile (torchtune's order:
    the LoRA model is built, then each block compiled)."""
    from dataclasses import replace

    from .memory import build_for

    model = build_for(cfg, replace(setup, recompute="none"), device)
    if setup.lora_rank:  # PEFT-shaped adapters on the frozen model, then the compile
        from .lora import apply_lora

        model = apply_lora(model, setup.lora_rank, setup.lora_targets)
    model = compile_blocks(model, setup.recompute)
    return compile_loss(model) if setup.compile == "model" else model


def measure_compiled_saved(cfg, workload, setup) -> dict[tuple, int]:
    """Every storage the compiled reference model saves for backward in one training forward
    on CPU, deduplicated by storage, parameters and buffers excluded: (dtype, shape of its
    first saved view) -> bytes, summed. The capture of `memory.saved_during` without its
    module hooks (a hook's side effect would break the compiled checkpoint's graph)."""
    from .memory import autocast_context, make_batch, storage_key

    model = build_compiled(cfg, setup)
    idx, targets = make_batch(cfg, workload)
    excluded = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in excluded and key not in seen and t.untyped_storage().nbytes():
            seen[key] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast_context(setup, "cpu"):
            logits, loss = model(idx, targets)
    out: dict[tuple, int] = {}
    for t in seen.values():
        key = (str(t.dtype).replace("torch.", ""), tuple(t.shape))
        out[key] = out.get(key, 0) + t.untyped_storage().nbytes()
    return out


def build_compiled_transformers(cfg, setup, device: str = "cpu"):
    """transformers' causal LM for `cfg` (`transformers_twin.build`, SDPA) compiled whole, as
    the Hugging Face Trainer's `torch_compile` does (accelerate's `prepare_model`:
    `torch.compile(model)`, no fullgraph), with the min-cut partitioner's backend;
    `setup.recompute` full: `gradient_checkpointing_enable()` first, the cache off (as
    checkpointing turns it off, without the warning's graph break)."""
    from .memory import model_dtype
    from .transformers_twin import build, hf_config_for

    # mode mixed: 16-bit weights (the profile counts it as bf16, the masters apart); LoRA
    # under amp: a 16-bit frozen base, fp32 adapters (PEFT's autocast_adapter_dtype)
    lora_amp = bool(setup.lora_rank) and setup.mode == "amp"
    dtype = torch.bfloat16 if lora_amp else model_dtype(setup)
    model = build(hf_config_for(cfg), "sdpa", dtype, device)
    if setup.recompute == "full":
        enable = getattr(model, "activation_checkpointing_enable", None) or \
            model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
    if setup.lora_rank:  # PEFT's get_peft_model before the Trainer compiles the model
        from .transformers_twin import peft_lora

        names = [t if t == "lm_head" or t.endswith("_proj") else f"{t}_proj"
                 for t in setup.lora_targets]
        model = peft_lora(model, setup.lora_rank, names, fp32_adapters=setup.mode != "bf16")
    torch._dynamo.reset()
    return torch.compile(model, backend=min_cut_backend())


def measure_compiled_transformers_saved(cfg, workload, setup) -> dict[tuple, int]:
    """Every storage the compiled transformers model saves for backward in one training
    forward `model(input_ids, labels=labels)` on CPU, as `measure_compiled_saved` captures
    them: (dtype, shape of its first saved view) -> bytes."""
    from .memory import storage_key
    from .transformers_twin import make_batch

    model = build_compiled_transformers(cfg, setup)
    idx, labels = make_batch(cfg.vocab_size, workload.batch_size, workload.seq_len)
    excluded = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in excluded and key not in seen and t.untyped_storage().nbytes():
            seen[key] = t
        return t

    # amp: the weights fp32, the forward under bf16 autocast (the Trainer's `bf16` over fp32
    # weights: accelerate runs the compiled forward under torch.autocast)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if setup.mode == "amp" else \
        contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        out = model(input_ids=idx, labels=labels)
    del out
    res: dict[tuple, int] = {}
    for t in seen.values():
        key = (str(t.dtype).replace("torch.", ""), tuple(t.shape))
        res[key] = res.get(key, 0) + t.untyped_storage().nbytes()
    return res


__all__ = ["build_compiled", "build_compiled_transformers", "compile_blocks", "compile_loss",
           "measure_compiled_saved", "measure_compiled_transformers_saved", "min_cut_backend"]
