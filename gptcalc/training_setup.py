"""How a model is trained (`TrainingSetup`): precision, optimizer, recomputation, kernels,
parallel layout and engine, and the options each of them takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, boolean, nonneg_int, one_of, positive_int, probability
from .optimizers import DEFAULT as DEFAULT_OPTIMIZER
from .optimizers import names as optimizer_names

MODES = ("fp32", "amp", "mixed", "bf16")
# the optimizers registered in `gptcalc.optimizers` (one module each), the default first; a set-up
# is checked against the registry as it is when the set-up is made
OPTIMIZERS = optimizer_names()
AUTOCAST_DTYPES = ("bf16", "fp16")
# recompute: none; selective, the attention core (Korthikanti et al. 2022, sec. 5); op,
# torchtitan's op-level selective checkpointing (matmul and attention-kernel outputs kept but
# every second matmul); full, every block (only its input kept)
RECOMPUTE = ("none", "selective", "op", "full")
ATTN_IMPLS = ("manual", "sdpa")
DEVICES = ("cpu", "cuda")
# megatron-core: Megatron-Core's GPT model (gptcalc.memory.profile_megatron), with Transformer
# Engine's modules or its local ones (`megatron_te`); litgpt: litgpt's GPT and its full
# fine-tune loop (gptcalc.memory.profile_litgpt)
IMPLS = ("reference", "transformers", "paper", "megatron-core", "litgpt")
# the loss over the logits: standard (the whole logits, cross_entropy over them); chunked
# (torchtune's CEWithChunkedOutputLoss: the head's output in loss_chunks chunks of tokens, each
# upcast to fp32 in the loss); fused (Liger's fused linear cross entropy: the logits made one
# chunk of rows at a time inside the loss, the head's gradients computed in the forward)
LOSSES = ("standard", "chunked", "fused")
# torchtune's CEWithChunkedOutputLoss(num_output_chunks=8)
DEFAULT_LOSS_CHUNKS = 8
ZERO_STAGES = (0, 1, 2, 3)
# PyTorch's CUDA caching allocator: default (a segment per cudaMalloc) or expandable
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); gptcalc.memory.allocator simulates both
ALLOCATORS = ("default", "expandable")
# torch.distributed.pipelining's schedules: ScheduleGPipe, Schedule1F1B,
# ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (gptcalc.schedules replays them)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
# the schedules that run more than one virtual stage (model chunk) per pipeline rank
VIRTUAL_SCHEDULES = ("interleaved-1f1b", "zero-bubble")
# torch.compile of the training step: none (eager); blocks (torchtitan's per-block compile:
# each transformer block one compiled graph, partitioned by AOTAutograd's min-cut
# partitioner); model (the blocks and the loss, torchtitan's compile components model + loss)
COMPILES = ("none", "blocks", "model")
# torchao float8 training of the blocks' Linears (Float8Linear): none; tensorwise (one fp32
# scale per tensor); rowwise (one fp32 scale per row of each operand)
FLOAT8 = ("none", "tensorwise", "rowwise")
# how FSDP1 accumulates micro-batches: every one but the last under `no_sync()` (the Hugging
# Face Trainer through accelerate), or each reduce-scattered (`sync_each_batch`, a plain loop)
FSDP1_SYNCS = ("no-sync", "each-batch")
# Liger's Triton kernels that replace transformers' modules (liger_kernel/transformers/
# monkey_patch.py, apply_liger_kernel_to_llama's rms_norm, swiglu and rope): LigerRMSNorm,
# LigerSwiGLUMLP and liger_rotary_pos_emb; their fused loss is --loss fused
LIGER_KERNELS = ("rms_norm", "swiglu", "rope")


def liger_kernels(text: str) -> tuple[str, ...]:
    """The Liger kernels a --liger list names, in `LIGER_KERNELS` order: "none" (or "") is
    none, "all" every one; ConfigError("liger") for a name Liger's Llama patch has not."""
    names = [n.strip() for n in str(text).replace(" ", ",").split(",") if n.strip()]
    if names in ([], ["none"]):
        return ()
    if names == ["all"]:
        return LIGER_KERNELS
    for n in names:
        if n not in LIGER_KERNELS:
            raise ConfigError("liger", f"unknown Liger kernel {n!r}: give none, all or a list "
                                       f"of {', '.join(LIGER_KERNELS)}")
    return tuple(k for k in LIGER_KERNELS if k in names)


# the bitsandbytes release assumed unless --bnb-version names another (the one measured)
DEFAULT_BNB_VERSION = "0.50.0"
# bitsandbytes 0.43.2 (2024-07-23, CHANGELOG "QLoRA mem bug (#1270)", commit 9e75374):
# MatMul4Bit.forward stores ctx.tensors = (None, B) where it stored (A, B)
MATMUL4BIT_FREES_INPUT = (0, 43, 2)


def bnb_version_tuple(version: str) -> tuple[int, int, int]:
    """'0.43.1' -> (0, 43, 1); '0.44' -> (0, 44, 0); a suffix such as .post1 is ignored."""
    parts = str(version).split(".")
    try:
        nums = [int(p) for p in parts[:3]]
    except ValueError:
        raise ConfigError("bnb_version", f"a bitsandbytes release is numbers such as 0.43.1, "
                                         f"got {version!r}") from None
    if len(parts) < 2 or any(n < 0 for n in nums):
        raise ConfigError("bnb_version", f"a bitsandbytes release is numbers such as 0.43.1, "
                                         f"got {version!r}")
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


def matmul4bit_keeps_input(setup: "TrainingSetup") -> bool:
    """Whether bitsandbytes' 4-bit matmul keeps its input for backward: releases before
    0.43.2 (bitsandbytes/autograd/_functions.py, MatMul4Bit.forward: ctx.tensors = (A, B)
    whenever A needs a gradient), under an NF4 base."""
    return setup.base_dtype == "nf4" and bnb_version_tuple(setup.bnb_version) < (
        MATMUL4BIT_FREES_INPUT)


# The set-up in sections: every TrainingSetup field in exactly one (tests/test_schema.py says
# so). A field is declared once: its name, type and default in TrainingSetup, its section here,
# its help and command-line spelling in `gptcalc.schema`; a config file holds one table per
# section and --save-config writes them. A new field goes into the class and into one section.
SECTIONS: dict[str, tuple[str, ...]] = {
    "precision": ("mode", "autocast_dtype"),
    "optimizer": ("optimizer", "optimizer_in_backward"),
    "parallel": ("dp", "zero", "tp", "pp", "pp_schedule", "pp_virtual", "sp", "ep", "cp",
                 "engine", "distributed_optimizer", "engine_settings", "fsdp1_sync"),
    "stack": ("recompute", "attn_impl", "device", "impl", "megatron_te", "loss", "loss_chunks",
              "keep_logits", "allocator", "compile", "float8", "offload_activations",
              "overhead", "liger"),
    "finetune": ("lora_rank", "lora_targets", "dora", "lora_dropout", "base_dtype",
                 "double_quant", "bnb_version", "kbit_prepare"),
}


def section_of(field: str) -> str:
    """The section a TrainingSetup field belongs to."""
    for name, fields in SECTIONS.items():
        if field in fields:
            return name
    raise KeyError(f"{field} is in no section of gptcalc.training_setup.SECTIONS")


def field_defaults() -> dict[str, Any]:
    """Every TrainingSetup field and its default, as the class declares it."""
    return {f.name: f.default for f in dataclasses.fields(TrainingSetup)}


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is trained, in sections (`SECTIONS`): precision, optimizer, parallel
    layout, stack features (recomputation, kernels, loss, compile, float8, offload) and
    fine-tuning; `setup.section(name)` gives one section's fields.

    mode: fp32 | amp (fp32 weights and gradients, autocast compute in `autocast_dtype`) |
    mixed (ZeRO's accounting: 16-bit weights and gradients + fp32 master weights and states) |
    bf16 (pure bf16 weights, gradients and states). attn_impl: manual (softmax(q k^T) v written
    out, its S x S scores saved) | sdpa (F.scaled_dot_product_attention; a flash-type kernel
    on CUDA). device: whose kernel semantics decide what is saved (CPU and CUDA save different
    dtypes for some ops). impl: the implementation whose saved tensors are counted: the
    project's `reference` model, Hugging Face `transformers`' modules, Korthikanti et al.
    2022's `paper` formula, or Megatron-Core's GPT model (`megatron-core`), built from
    Transformer Engine's modules (`megatron_te`, the default) or its local ones. Parallel
    layout: `dp` data-parallel replicas with ZeRO stage
    `zero`; `tp` tensor-parallel ranks (Megatron-LM) with sequence parallelism `sp`
    (Korthikanti et al. 2022); `pp` pipeline stages run by `pp_schedule` (`PP_SCHEDULES`) with
    `pp_virtual` model chunks per stage (interleaved schedules); `ep` expert-parallel ranks, each
    holding n_expert / ep of every MoE block's routed experts (Lepikhin et al. 2020, GShard);
    `cp` context-parallel ranks, each holding 2 of the sequence's 2 cp chunks, attention run as
    a ring over them (torch's context_parallel as torchtitan runs it, Megatron-core's
    context parallel), the parameters sharded over dp x cp.
    `engine`: the training engine's name (gptcalc.memory.engines: its registry checks it and
    gives the default of the ZeRO stage when None), `engine_settings` the engine's own settings
    that differ from its defaults, as (key, value) pairs (a ds_config's zero_optimization
    sizes); `fsdp1_sync` how FSDP1 accumulates micro-batches (`FSDP1_SYNCS`: no-sync, the
    Hugging Face Trainer's through accelerate, or each-batch).
    `lora_rank` > 0: LoRA fine-tuning of `lora_targets` (gptcalc.lora's names) on a frozen
    base, stored in the mode's dtype or (`base_dtype` nf4) as QLoRA's NF4, its absmax constants
    double-quantised (`double_quant`, bitsandbytes' bnb_4bit_use_double_quant) or fp32;
    `bnb_version` the bitsandbytes release that runs it (before 0.43.2 its 4-bit matmul kept
    its input for backward).
    `kbit_prepare`: peft's prepare_model_for_kbit_training ran on the NF4 model (every
    parameter but the 4-bit weights in fp32, checkpointed blocks; `gptcalc.memory.finetune.
    kbit_prepared`).
    `overhead`: bytes added to every
    phase of the peak for what the model does not cover (framework context, allocator
    fragmentation, communication buckets); 0 unless given, always printed. `loss`: how the
    cross entropy meets the logits (`LOSSES`), `loss_chunks` the chunks of tokens of the
    chunked loss. `keep_logits`: the training loop holds the model's logits through backward
    (the reference model's loop and litgpt's) rather than dropping them before it (Hugging
    Face Trainer, torchtitan's `del pred`, torchtune's `del logits`: the commands' default
    outside the tutorial families). `optimizer_in_backward`: each parameter's optimizer step
    runs in its post-accumulate-grad hook and frees its gradient (torchtune's
    optimizer_in_bwd), so no full set of gradients exists.
    `allocator`: the CUDA caching allocator's mode the reserved bytes are simulated under
    (`ALLOCATORS`).
    `compile`: what torch.compile compiles (`COMPILES`); `float8`: torchao's float8 training of
    the blocks' Linears (`FLOAT8`); `offload_activations`: saved activations go to host memory
    as they are saved (torchtune's OffloadActivations).

    The dataclass defaults are the bare fp32 CPU set-up the reference model is measured in;
    `training_defaults` gives the set-up a family is usually trained with.
    """

    mode: str = "fp32"
    optimizer: str = DEFAULT_OPTIMIZER
    autocast_dtype: str = "bf16"
    recompute: str = "none"
    attn_impl: str = "manual"
    device: str = "cpu"
    impl: str = "reference"
    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    sp: bool = False
    ep: int = 1
    cp: int = 1
    engine: str | None = None
    distributed_optimizer: bool = True
    overhead: int = 0
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    dora: bool = False  # DoRA (PEFT's use_dora): a trained magnitude per adapted Linear
    lora_dropout: float = 0.0  # PEFT's lora_dropout: the probability each adapter drops
    base_dtype: str = "same"
    double_quant: bool = True
    bnb_version: str = DEFAULT_BNB_VERSION
    kbit_prepare: bool = False  # peft's prepare_model_for_kbit_training: fp32 non-4-bit params
    engine_settings: tuple[tuple[str, int], ...] = ()
    fsdp1_sync: str = "no-sync"  # FSDP1's accumulation (`FSDP1_SYNCS`, engines/fsdp1.py)
    loss: str = "standard"
    loss_chunks: int = DEFAULT_LOSS_CHUNKS
    keep_logits: bool = True
    optimizer_in_backward: bool = False
    allocator: str = "default"
    megatron_te: bool = True
    compile: str = "none"
    float8: str = "none"
    offload_activations: bool = False
    liger: str = "none"  # Liger's kernels patched into transformers' model (`LIGER_KERNELS`)

    def section(self, name: str) -> dict[str, Any]:
        """The fields of one section (`SECTIONS`) and their values: `setup.section("parallel")`."""
        return {f: getattr(self, f) for f in SECTIONS[name]}

    def __post_init__(self) -> None:
        for name, choices in (("mode", MODES), ("optimizer", optimizer_names()),
                              ("autocast_dtype", AUTOCAST_DTYPES), ("recompute", RECOMPUTE),
                              ("attn_impl", ATTN_IMPLS), ("device", DEVICES), ("impl", IMPLS),
                              ("loss", LOSSES), ("allocator", ALLOCATORS),
                              ("pp_schedule", PP_SCHEDULES), ("compile", COMPILES),
                              ("float8", FLOAT8), ("fsdp1_sync", FSDP1_SYNCS)):
            one_of(name, getattr(self, name), choices)
        for name in ("dp", "tp", "pp", "ep", "cp", "pp_virtual"):
            positive_int(name, getattr(self, name))
        if self.pp_virtual > 1 and self.pp_schedule not in VIRTUAL_SCHEDULES:
            raise ConfigError("pp_virtual", f"{self.pp_schedule} runs one model chunk per "
                                            "stage: virtual stages need --pp-schedule "
                                            "interleaved-1f1b or zero-bubble")
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        boolean("sp", self.sp)
        if self.engine is not None and not isinstance(self.engine, str):
            raise ConfigError("engine", f"engine must be a name, got {self.engine!r}")
        boolean("distributed_optimizer", self.distributed_optimizer)
        nonneg_int("lora_rank", self.lora_rank)
        if self.lora_rank and not self.lora_targets:
            raise ConfigError("lora_targets", "a LoRA rank needs targets, e.g. q,v")
        boolean("dora", self.dora)
        if self.dora and not self.lora_rank:
            raise ConfigError("dora", "DoRA decomposes LoRA's adapted weights: give --lora-rank")
        probability("lora_dropout", self.lora_dropout)
        if self.lora_dropout and not self.lora_rank:
            raise ConfigError("lora_dropout", "LoRA dropout drops the adapters' input: give "
                                              "--lora-rank")
        one_of("base_dtype", self.base_dtype, ("same", "nf4"))
        boolean("double_quant", self.double_quant)
        bnb_version_tuple(self.bnb_version)
        if self.base_dtype == "nf4" and not self.lora_rank:
            raise ConfigError("weights_dtype", "a 4-bit (NF4) base is frozen: QLoRA needs "
                                               "--lora-rank")
        boolean("kbit_prepare", self.kbit_prepare)  # its pairs: memory.finetune
        nonneg_int("overhead", self.overhead)
        positive_int("loss_chunks", self.loss_chunks)
        boolean("keep_logits", self.keep_logits)
        boolean("optimizer_in_backward", self.optimizer_in_backward)
        boolean("megatron_te", self.megatron_te)
        boolean("offload_activations", self.offload_activations)
        if self.optimizer_in_backward and self.zero >= 2:
            raise ConfigError("optimizer_in_backward", "each parameter steps in its gradient "
                                                       "hook on its whole gradient: not with "
                                                       "sharded gradients (ZeRO 2 or 3)")
        if liger_kernels(self.liger) and self.impl != "transformers":
            raise ConfigError("liger", "Liger's kernels patch transformers' model classes: "
                                       "--liger needs --impl transformers")
        if liger_kernels(self.liger) and self.compile != "none":
            raise ConfigError("liger", "Liger's kernels are measured without --compile: give "
                                       "--liger none or leave --compile out")
        if liger_kernels(self.liger) and self.lora_rank:  # measured: PEFT's LoRA, one device
            for on, what in ((self.dora, "--dora"), (self.lora_dropout, "--lora-dropout"),
                             (self.kbit_prepare, "--kbit-prepare"),
                             (self.zero, "--zero (sharded states: FSDP, DeepSpeed)")):
                if on:
                    raise ConfigError("liger", f"Liger's kernels with LoRA are measured "
                                               f"without {what}: give --liger none or leave "
                                               f"it out")
        if self.loss == "chunked" and self.impl == "transformers":
            raise ConfigError("loss", "transformers' models return the logits whole; the "
                                      "chunked output is torchtune's: use --impl reference")

    @property
    def gpus(self) -> int:
        """Devices the layout spans: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight (and of one gradient): fp32, or 16 bit in mixed and bf16."""
        return 4 if self.mode in ("fp32", "amp") else 2

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element: fp32, or the 16-bit compute dtype."""
        return 4 if self.mode == "fp32" else 2

    @property
    def stream_bytes(self) -> int:
        """Bytes of one residual-stream element: the weights' dtype (fp32 weights keep the
        stream fp32 under amp: a 16-bit branch output added to it promotes to fp32)."""
        return self.weight_bytes

    def describe(self, mixed: str, merges_outputs: bool = True) -> str:
        """Every assumption of the set-up in words but its engine's (`gptcalc.memory.engines.
        describe` puts them first): `mixed` is what mode mixed means under the engine,
        `merges_outputs` whether its pipeline keeps every micro-batch's output."""
        amp_weights = "16-bit frozen base, fp32 adapters" if self.lora_rank else "fp32 weights"
        prec = {"fp32": "fp32", "amp": f"amp ({self.autocast_dtype} autocast, {amp_weights})",
                "mixed": mixed, "bf16": "pure bf16"}[self.mode]
        schedule = ""
        if self.pp > 1:
            schedule = f" ({self.pp_schedule}" + (
                f", {self.pp_virtual} virtual stages" if self.pp_virtual > 1 else "") + ")"
        layout = f"dp={self.dp} zero={self.zero} tp={self.tp} sp={'on' if self.sp else 'off'}" \
                 f" pp={self.pp}{schedule}" + (f" ep={self.ep}" if self.ep > 1 else "") + (
                     f" cp={self.cp} (ring attention, head-tail chunks, parameters sharded "
                     f"over dp x cp; {self.gpus:,} GPUs = dp x tp x pp x cp)" if self.cp > 1
                     else "")
        tune = ""
        if self.lora_rank:
            base = ("an NF4 (QLoRA, double-quantised" if self.double_quant else
                    "an NF4 (fp32 absmax") if self.base_dtype == "nf4" else "a frozen"
            if self.base_dtype == "nf4":
                keeps = "keeps each 4-bit Linear's input" if matmul4bit_keeps_input(self) \
                    else "4-bit Linears keep no input"
                base += f", bitsandbytes {self.bnb_version}: {keeps})"
                if self.kbit_prepare:
                    base += (" prepared for k-bit training (peft: embeddings, norms and "
                             "head in fp32)")
            kind = "DoRA" if self.dora else "LoRA"
            dropped = f" (dropout {self.lora_dropout:g})" if self.lora_dropout else ""
            tune = (f", {kind} r={self.lora_rank}{dropped} on {','.join(self.lora_targets)} "
                    f"over {base} base")
        optimizer = self.optimizer + (" in backward" if self.optimizer_in_backward else "")
        alloc = ("expandable segments" if self.allocator == "expandable" else
                 "default segments")
        return (f"{prec}, {optimizer}, {self.describe_impl()}, recompute "
                f"{self.recompute}{tune}{self.describe_stack()}, "
                f"{self.describe_loss(merges_outputs)}, "
                f"caching allocator {alloc}, {layout}")

    def describe_impl(self) -> str:
        """The attention kernel, the device and whose saved tensors are counted, in words."""
        if self.impl == "megatron-core":
            modules = ("with Transformer Engine (fused attention, LayerNormLinear)"
                       if self.megatron_te else "without Transformer Engine (unfused attention)")
            return f"megatron-core implementation {modules}, {self.device.upper()} kernels"
        return (f"attention {self.attn_impl}, {self.device.upper()} kernels, {self.impl} "
                f"implementation")

    def describe_stack(self) -> str:
        """torch.compile, float8 and activation offloading in words (empty when all are off)."""
        parts = []
        if self.compile != "none":
            parts.append({"blocks": "compiled blocks (min-cut partitioner)",
                          "model": "compiled blocks and loss (min-cut partitioner)"}[
                self.compile])
        if self.float8 != "none":
            parts.append(f"float8 {self.float8} Linears (torchao)")
        if self.offload_activations:
            parts.append("activations offloaded to the host (torchtune)")
        if liger_kernels(self.liger):
            parts.append(f"Liger's {'/'.join(liger_kernels(self.liger))} kernels")
        return "".join(", " + p for p in parts)

    def describe_loss(self, merges_outputs: bool = True) -> str:
        """The loss and what the training loop does with the logits, in words; a pipeline
        that `merges_outputs` keeps every micro-batch's logits (`engines.pipeline`)."""
        loss = {"standard": "standard loss", "fused": "fused linear cross-entropy loss (Liger)",
                "chunked": f"chunked loss ({self.loss_chunks} chunks, torchtune)"}[self.loss]
        if self.loss == "fused":
            return loss + ", no logits"
        if self.pp > 1 and not self.keep_logits and merges_outputs:
            # torch.distributed.pipelining's last stage keeps its outputs to merge them;
            # Megatron-LM's keeps only each micro-batch's loss (engines.pipeline.merges_outputs)
            return loss + ", logits kept through backward (the pipeline merges outputs)"
        return loss + (", logits kept through backward" if self.keep_logits
                       else ", logits dropped before backward")
