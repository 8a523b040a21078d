"""Activations per device: what backward keeps, by implementation profile, sharded.

A profile lists the tensors one micro-batch saves for backward, one line per tensor kind, for
the whole model on one device (`reference`: the project's model; `transformers`: Hugging Face
transformers' modules; `paper`: Korthikanti et al. 2022's closed form). `device_activations`
then shards the lines as Korthikanti et al. shard them and counts a pipeline stage's
micro-batches in flight. Logits and the cross entropy's log-probabilities are counted once:
the log-probabilities are a saved tensor (`cross_entropy/...`), the logits a separate row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ..config import GPTConfig
from ..schedules import Stage, holds_embedding, holds_head, stage_hold
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload
from .compiled import compiled_lines
from .float8 import float8_lines
from .losses import logits_alive, loss_saved_lines
from .profile_litgpt import check_litgpt, litgpt_saved
from .profile_megatron import check_megatron_core, megatron_saved, unmodelled
from .profile_reference import reference_saved
from .profile_transformers import transformers_loss_transients, transformers_saved
from .states import autocast_weight_copies


def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                      recompute: str = "none") -> int:
    """Korthikanti et al. 2022, Table 2: activation bytes of one transformer layer.

    16-bit activations and 1-byte dropout masks, F = 4, s sequence, b micro-batch, h hidden,
    a heads, t tensor-parallel size:
      no recomputation, tp:       sbh(10 + 24/t + 5as/(ht))
      no recomputation, tp + sp:  sbh(34/t + 5as/(ht))
      selective, tp:              sbh(10 + 24/t)
      selective, tp + sp:         sbh(34/t)
      full recomputation:         2sbh  (the layer input; with sp Megatron keeps its 1/t shard)
    With t = 1 the first row is the paper's sbh(34 + 5as/h).
    """
    sbh = s * b * h
    attention_core = 5 * a * s * s * b // t  # softmax 2, its dropout mask 1, dropped output 2
    if recompute == "full":
        return 2 * sbh // (t if sp else 1)
    base = 34 * sbh // t if sp else 10 * sbh + 24 * sbh // t
    return base + (attention_core if recompute == "none" else 0)


def paper_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> dict[str, int]:
    """Korthikanti et al. 2022 as a profile: one micro-batch, all L layers, before sharding.

    layers: L x `paper_layer_bytes` with h = E, a = H, s = seq_len, b = the micro-batch, t = 1;
    embedding/dropout: the input embedding's 1-byte dropout mask, sbh; the output terms of
    their sec. 4.3: final LayerNorm input 2sbh, output-projection input 2sbh, fp32 logits for
    the cross entropy 4sbv. As published: 16-bit activations whatever the mode.
    """
    if setup.recompute == "op":
        raise ConfigError("recompute", "Korthikanti et al. 2022 have no op-level recomputation: "
                                       "use --impl reference or transformers for --recompute op")
    s, b, h, a, v = workload.seq_len, workload.batch_size, cfg.n_embd, cfg.n_head, cfg.vocab_size
    return {
        "layer/all": cfg.n_layer * paper_layer_bytes(s, b, h, a, 1, False, setup.recompute),
        "embedding/dropout": s * b * h,
        "final/ln_f/input": 2 * s * b * h,
        "final/lm_head_input": 2 * s * b * h,
        "cross_entropy/log_probs": 4 * s * b * v,
    }


def _transformers(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> dict[str, int]:
    return transformers_saved(cfg, workload.batch_size, workload.seq_len, setup)


PROFILES = {"reference": reference_saved, "transformers": _transformers, "paper": paper_saved,
            "megatron-core": megatron_saved, "litgpt": litgpt_saved}


def profile_models(impl: str, cfg: GPTConfig) -> bool:
    """Whether the `impl` profile models every switch of `cfg` (megatron-core's: not MoE, MLA,
    q/k norms, ...: `profile_megatron.unmodelled`); the others refuse what they lack."""
    return not (impl == "megatron-core" and unmodelled(cfg))


def check_profile(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """ConfigError for a set-up the `setup.impl` profile does not model (megatron-core's
    `check_megatron_core`, litgpt's `check_litgpt`; the others check as they count)."""
    if setup.impl == "megatron-core":
        check_megatron_core(cfg, setup)
    if setup.impl == "litgpt":
        check_litgpt(cfg, setup)


def transformers_loss(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                      ) -> dict[str, int]:
    """transformers' loss path beyond the saved tensors and the logits (`forward`, `backward`):
    the cache's unsaved key/value copies (with LoRA, the first layer's too where its attention
    is frozen: `finetune.first_block_cache_unsaved`) and the loss scalars at the forward's end (plus the
    fp32 upcast of 16-bit logits inside the loss), and the largest of log_softmax's backward
    and the logits' 16-bit gradient at the backward's start."""
    t = transformers_loss_transients(cfg, workload.batch_size, workload.seq_len, setup)
    logits = workload.batch_size * workload.seq_len * cfg.vocab_size * setup.act_bytes

    def moment(name: str) -> int:
        return sum(v for k, v in t.items() if k.startswith(name + "/")) - logits
    upcast = 4 * logits // setup.act_bytes if setup.act_bytes != 4 else 0
    cache = 0
    if setup.lora_rank:  # a frozen first attention saves none of the cache's copies
        from .finetune import first_block_cache_unsaved

        cache = first_block_cache_unsaved(cfg, workload, setup)
    return {"forward": moment("forward_end") + upcast + cache,
            "backward": max(moment("loss_backward"), moment("backward_start")) + cache}


def saved_activations(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                      ) -> dict[str, int]:
    """The `setup.impl` profile's saved bytes of one micro-batch on one device, unsharded.

    Keys: `embedding/...`, `layer/...` (summed over L layers), `final/...`,
    `cross_entropy/...`, `input/...` (the batch's own index tensors), `weight_copy/...`
    (autocast's 16-bit weight copies, mode amp)."""
    amp = setup.mode == "amp"
    if setup.lora_rank and amp and not setup.kbit_prepare:
        # a 16-bit frozen base under autocast computes as 16-bit weights do (fp32 adapters);
        # prepared for k-bit training, its non-4-bit parameters are fp32 (`finetune.kbit_prepared`)
        from dataclasses import replace

        setup = replace(setup, mode="mixed")
    out = loss_saved_lines(cfg, workload, setup, PROFILES[setup.impl](cfg, workload, setup))
    out = float8_lines(cfg, workload, setup, compiled_lines(cfg, workload, setup, out))
    if setup.impl in ("paper", "megatron-core"):  # no LoRA, no autocast weight copies
        return out
    if setup.lora_rank:  # a frozen base: only what the adapters' gradients need
        from .compiled import compiled_transformers_lora_lines
        from .finetune import finetune_saved

        return compiled_transformers_lora_lines(setup, finetune_saved(cfg, workload, setup,
                                                                      out, amp))
    return {**out, **autocast_weight_copies(cfg, setup)}


# Which lines tensor parallelism divides (Korthikanti et al. 2022, sec. 4.2): the attention and
# MLP internals are split by heads / d_ff across the t ranks always; the norms, the inputs of the
# q/k/v and MLP projections, the residual dropout masks and the embedding / final norm are the
# paper's "10sbh" that only sequence parallelism divides. The cross entropy's log-probabilities
# are vocabulary-parallel. Index tensors and the manual path's S x S causal mask stay whole.
_SEQUENCE_SHARDED = ("embedding/", "final/", "layer/ln_", "layer/block_input",
                     "layer/attn/qkv_input", "layer/attn/resid_dropout_mask",
                     "layer/mlp/fc_input", "layer/mlp/dropout_mask", "layer/norm",
                     "layer/moe/router", "layer/moe/topk")
_REPLICATED = ("input/", "layer/attn/causal_mask", "layer/attn/window_mask",
               "cross_entropy/total_weight", "cross_entropy/count",
               # Megatron's vocab-parallel cross entropy: every rank's mask and targets whole
               "cross_entropy/target_mask", "cross_entropy/masked_target",
               "cross_entropy/loss_mask",
               # Megatron's per-layer rotary cos/sin (S x rd) and checkpointed mask type
               "layer/attn/rotary_tables", "layer/attn/rotary_freqs",
               "layer/attn/checkpoint_mask_type",
               # a compiled loss's per-token statistics: every vocabulary shard's rank has all
               "cross_entropy/row_max", "cross_entropy/logsumexp",
               # op-level checkpointing keeps a row-parallel (or replicated) Linear's mm
               # output, the full-width partial sum before its all-reduce / reduce-scatter
               "layer/op/c_proj", "layer/op/mlp_proj", "layer/op/q_a_proj",
               "layer/op/kv_a_proj",
               "layer/rng_state",  # one generator state per block, whatever the layout
               "weight_copy/")  # weight copies arrive tensor-parallel sharded already


# The inputs of the column-parallel Linears under PyTorch's DTensor tensor parallel
# (`parallelize_module`: PrepareModuleInput / ColwiseParallel redistribute the sequence-sharded
# input to Replicate, and the matmul saves that all-gathered tensor, b x S x E whole on every
# rank), where Megatron-LM saves its sequence shard and gathers it again in backward.
_GATHERED = ("layer/attn/qkv_input", "layer/mlp/fc_input", "final/lm_head_input")


def dtensor_tp(setup: TrainingSetup) -> bool:
    """Whether tensor parallel is PyTorch's DTensor `parallelize_module` with `loss_parallel`
    (torchtitan's plan, measured on the reference model; transformers' Linears take the same
    plan), not Megatron-LM's own (the paper's and megatron-core's profiles)."""
    return setup.tp > 1 and setup.impl not in ("paper", "megatron-core")


def _tp_divisor(key: str, setup: TrainingSetup) -> int:
    if key.startswith(_REPLICATED):
        return 1
    if key.startswith(_GATHERED) and dtensor_tp(setup):
        return 1
    if key.startswith(_SEQUENCE_SHARDED):
        return setup.tp if setup.sp else 1
    return setup.tp


def device_activations(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                       stage: Stage = "first") -> dict[str, int]:
    """Saved-activation bytes one device of pipeline stage `stage` holds, by line.

    Tensor/sequence parallel: each line divided as `_tp_divisor` says (the paper's paper layer
    total is split 10sbh by sp and 24sbh + 5as^2b by tp, as in its Table 2). Pipeline: at the
    moment its schedule holds the most (`schedules.stage_hold`), a stage holds `held_layers`
    block-micro-batches of the L blocks' lines (1F1B's first stage: pp micro-batches of L/pp
    blocks, Narayanan et al. 2021, sec. 2.2; Korthikanti et al. 2022, sec. 4.2.3); the
    embedding lines of its alive micro-batches on the first stage, the final norm, lm_head
    input and cross entropy of its alive micro-batches on the last.
    """
    lines = saved_activations(cfg, workload, setup)
    p, L = setup.pp, cfg.n_layer
    hold = stage_hold(cfg, workload, setup, stage)
    out: dict[str, int] = {}
    for key, nbytes in lines.items():
        if key == "layer/all":  # the paper's layer total: 10sbh by sp, the rest by tp
            s, b, h = workload.seq_len, workload.batch_size, cfg.n_embd
            plain = 10 * s * b * h * cfg.n_layer if setup.recompute != "full" else 0
            split = (nbytes - plain) // setup.tp + plain // (setup.tp if setup.sp else 1)
            if setup.recompute == "full" and setup.sp:
                split = nbytes // setup.tp
            out[key] = split * hold.held_layers // L
            continue
        if key.startswith(("layer/", "weight_copy/")) and not key.endswith("lm_head"):
            nbytes = nbytes * hold.held_layers // L  # the stage's blocks x micro-batches alive
        elif key.startswith(("embedding/", "input/idx")):
            nbytes = nbytes * hold.held_embedding if p == 1 or holds_embedding(setup, stage) \
                else 0
        elif p > 1 and not holds_head(setup, stage):  # final norm, head, loss, targets
            nbytes = 0
        elif p > 1:
            nbytes *= hold.held_head
        out[key] = nbytes // _tp_divisor(key, setup)
    return place_checkpoints(cfg, workload, setup, stage, out)


# a checkpointed block input's dimensions (b, S, E): deepspeed.checkpointing saves each
# input's size as an int64 tensor beside its partition
CHECKPOINT_INPUT_DIMS = 3


def checkpoint_placement(setup: TrainingSetup) -> tuple[bool, bool]:
    """(partitioned, on_host) for deepspeed.checkpointing's checkpoints under full
    recomputation: a ds_config's activation_checkpointing.partition_activations and
    cpu_checkpointing (`dsconfig.checkpoint_pairs`)."""
    settings = dict(setup.engine_settings)
    return (setup.recompute == "full" and bool(settings.get("partition_activations")),
            setup.recompute == "full" and bool(settings.get("cpu_checkpointing")))


def _checkpoints(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage) -> int:
    """Checkpointed block inputs one device of `stage` holds: its blocks of each micro-batch
    alive at its fullest moment (`schedules.stage_hold`)."""
    return stage_hold(cfg, workload, setup, stage).held_layers


def place_checkpoints(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage,
                      lines: dict[str, int]) -> dict[str, int]:
    """`lines` with the block inputs full recomputation keeps placed as deepspeed.checkpointing
    places them (deepspeed/runtime/activation_checkpointing/checkpointing.py, 0.19,
    CheckpointFunction.forward): with partition_activations each rank keeps numel / tp of every
    checkpoint (`partition_activations`: a clone of its slice; each tensor-parallel rank its
    own); with cpu_checkpointing the checkpoint (or its partition) is copied to host memory
    (`checkpoints_on_host`). Either way the block input's own storage is replaced by a 0-d
    fp32 tensor (`arg.data = torch.empty([])`), 4 bytes per checkpoint on the device."""
    partitioned, on_host = checkpoint_placement(setup)
    if not (partitioned or on_host) or "layer/block_input" not in lines:
        return lines
    kept = lines["layer/block_input"] // (setup.tp if partitioned else 1)
    placeholders = 4 * _checkpoints(cfg, workload, setup, stage)
    return {**lines, "layer/block_input": placeholders + (0 if on_host else kept)}


def checkpoints_on_host(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                        stage: str = "first") -> dict[str, int]:
    """Host memory deepspeed.checkpointing holds for one device, by line: the checkpoints
    under cpu_checkpointing (`place_checkpoints`: the block inputs, 1/tp of each when
    partitioned), and with partition_activations each checkpoint's size, an int64 tensor of
    its 3 dimensions made on the host (`get_partitioned_activations_for_backward`)."""
    partitioned, on_host = checkpoint_placement(setup)
    out = {}
    if on_host:
        lines = device_activations(cfg, workload, replace(setup, engine_settings=()), stage)
        out["activation checkpoints (cpu_checkpointing)"] = lines.get(
            "layer/block_input", 0) // (setup.tp if partitioned else 1)
    if partitioned:
        out["activation checkpoint sizes (partition_activations)"] = (
            8 * CHECKPOINT_INPUT_DIMS * _checkpoints(cfg, workload, setup, stage))
    return out


def saved_in(acts: Mapping[str, int], *places: str) -> int:
    """Bytes of the saved-tensor lines of `places`: the first part of a line's key, before
    its `/` (`embedding`, `input`, `layer`, `final`, `cross_entropy`, `weight_copy`)."""
    return sum(v for k, v in acts.items() if k.split("/", 1)[0] in places)


def logits_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """The logits of one micro-batch, b x S x V in the compute dtype, vocabulary-parallel over
    tp (Megatron pads V to a multiple of tp), where the loss makes them (not the fused loss:
    `losses.logits_alive`). The cross entropy's saved log-probabilities are a saved activation
    (`cross_entropy/log_probs`), not counted here."""
    return logits_alive(cfg, workload, setup)["forward"]


def activations_paper(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                      ) -> dict[str, int]:
    """Korthikanti et al. 2022's activation memory of the most loaded device, term by term.

    layers: the first stage of a 1F1B pipeline holds pp micro-batches of L/pp layers (their
    sec. 4.2.3) = L x `paper_layer_bytes` with h = E, a = H, s = seq_len, b the micro-batch,
    t = tp. embedding/dropout: the 1-byte dropout mask of the input embeddings of those pp
    micro-batches, sbhp/t with sp (sbhp without). The output terms, counted where pp = 1 (they
    live on the last stage): final LayerNorm input 2sbh/t, output-projection input 2sbh/t (each
    /t only with sp), and fp32 logits for the cross entropy 4sbv/t, i.e. the paper's
    (4sbh/t)(1 + v/h). As published: 16-bit activations whatever the mode. The paper has no
    op-level recomputation: recompute op is compared with its row without recomputation.
    """
    s, b, h, a = workload.seq_len, workload.batch_size, cfg.n_embd, cfg.n_head
    t, p, v = setup.tp, setup.pp, cfg.vocab_size
    recompute = "none" if setup.recompute == "op" else setup.recompute
    ts = t if setup.sp else 1
    return {
        "layers": cfg.n_layer * paper_layer_bytes(s, b, h, a, t, setup.sp, recompute),
        "embedding/dropout": s * b * h * p // ts,
        "output/final_norm": 2 * s * b * h // ts if p == 1 else 0,
        "output/lm_head_input": 2 * s * b * h // ts if p == 1 else 0,
        "output/cross_entropy": 4 * s * b * v // t if p == 1 else 0,
    }
