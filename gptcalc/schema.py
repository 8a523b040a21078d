"""One declaration per option: its type, range or choices, help, the config-file table it lives
in and its command-line spelling, shared by the CLI, `--config` files and `--save-config`.

The checks of one value are in `gptcalc.errors`; `byte_size` adds the one that parses a size
("80GiB"). The CLI builds its click options from `OPTIONS`, a config file's tables are the
`TABLES` the options name, and an error names the option a user typed (`cli_spelling`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import GPTConfig
from .errors import ConfigError, integer
from .families import ARCHS
from .lora import TARGETS_HELP
from .optimizers import describe as describe_optimizers
from .presets import DEFAULT_PRESET
from .training_setup import (ALLOCATORS, ATTN_IMPLS, AUTOCAST_DTYPES, COMPILES, DEVICES,
                             FLOAT8, FSDP1_SYNCS, IMPLS, LOSSES, MODES, OPTIMIZERS, PP_SCHEDULES,
                             RECOMPUTE, SECTIONS, field_defaults, section_of)
from .units import parse_bytes


def byte_size(field: str, value: Any, exact: bool = True, zero_ok: bool = False) -> int:
    """A size as bytes: an int, or text with its unit ("80GiB", "80GB" = 80 x 10^9, "512B").
    `exact` False floors a fraction of a byte ("23.58GiB" as a tool prints it); `zero_ok`
    accepts 0 ("0" or "0B": none)."""
    if not isinstance(value, str):
        return integer(field, value, min=0 if zero_ok else 1)
    if zero_ok and value.strip().upper() in ("0", "0B"):
        return 0
    try:
        return parse_bytes(value, exact=exact)
    except ValueError as e:
        raise ConfigError(field, str(e)) from None


@dataclass(frozen=True)
class Option:
    """One option. kind: int, float, text, choice, size or flag (an on/off pair);
    `table`: the config-file table that holds it (None: the command line only; "training" or
    "parallel": a TrainingSetup field's option, placed in its field's section); `source`: it
    says where the model comes from rather than changing it; `dest`: the keyword, when not
    `name`; `field`: the TrainingSetup field it sets (filled in for the set-up's options).
    "{default}" in `help` is the field's default as TrainingSetup declares it."""

    name: str
    cli: str
    kind: str
    help: str
    table: str | None = None
    choices: tuple[str, ...] = ()
    short: str | None = None
    metavar: str | None = None
    source: bool = False
    dest: str | None = None
    multiple: bool = False
    zero_ok: bool = False  # a size that may be 0
    field: str | None = None

    @property
    def keyword(self) -> str:
        return self.dest or self.name


def _int(name: str, short: str | None, help: str, table: str = "model") -> Option:
    return Option(name, "--" + name.replace("_", "-"), "int", help, table, short=short)


_MODEL = (
    Option("preset", "--preset", "text", f"Named model (see `gptcalc presets`); default "
           f"{DEFAULT_PRESET}.", "model", metavar="NAME", source=True),
    Option("arch", "--arch", "text", f"Family of switches: {', '.join(ARCHS)}; default the "
           "preset's.", "model", metavar="FAMILY"),
    _int("batch_size", "-B", "B: the micro-batch, sequences one device holds per "
                             "forward/backward (default: the preset's, else 1).", "workload"),
    _int("grad_accum", None, "Micro-batches accumulated per optimizer step (default 1); the "
                             "global batch is B x dp x grad-accum.", "workload"),
    _int("block_size", "-T", "T: context length the model is built for."),
    _int("seq_len", None, "Tokens per sequence of the workload, at most T (default T; for "
                          "--hf-config at most 4096).", "workload"),
    _int("n_embd", "-E", "E: embedding width (d_model)."),
    _int("n_layer", "-L", "L: number of blocks."),
    _int("n_head", "-H", "H: attention (query) heads."),
    _int("ffn_mult", "-F", "F: MLP expansion, d_ff = F*E."),
    _int("d_ff", None, "Explicit MLP hidden width (overrides F)."),
    _int("n_kv_head", None, "Key/value heads (grouped-query attention)."),
    _int("head_dim", None, "Width of one head (default E/H)."),
    _int("vocab_size", "-V", "V: vocabulary size."),
    Option("dropout", "--dropout", "float", "Dropout probability.", "model"),
    Option("set", "--set", "text", "Set any architecture switch, e.g. --set qkv_bias=false "
           "--set norm=rmsnorm.", "model", metavar="FIELD=VALUE", source=True, dest="sets",
           multiple=True),
    Option("hf_config", "--hf-config", "text",
           "A Hugging Face config.json (or its directory), or a Hub id read through "
           "huggingface_hub's cache (HF_HUB_OFFLINE, HF_TOKEN; a local path wins): llama, "
           "mistral, mixtral, qwen2/3(-moe), deepseek_v3, gemma 1-3, gpt_oss, phi, phi3, olmo2, "
           "starcoder2, falcon, opt, bloom, ... (see README).", "model",
           metavar="PATH|ORG/NAME[@REV]", source=True),
    Option("config", "--config", "text", "A gptcalc config file (TOML or .json): [model], "
           "[workload], and the training set-up's [precision], [optimizer], [parallel], [stack] "
           "and [finetune].", metavar="FILE", source=True),
    Option("recipe", "--recipe", "text", "Your own training recipe, read as the options it "
           "stands for: a torchtitan job config (.toml), a torchtune, axolotl, LLaMA-Factory, "
           "TRL or alignment-handbook config (.yaml), Hugging Face TrainingArguments (.json) or "
           "a Megatron-LM argument file; give it twice for a recipe and its accelerate config "
           "(the launcher's engine and world size win); options given beside it win.",
           metavar="FILE", source=True, multiple=True),
    Option("save_config", "--save-config", "text", "Write the effective configuration to FILE "
           "(.toml or .json) for --config.", metavar="FILE", source=True),
)

_TRAINING = (
    Option("mode", "--mode", "choice",
           "Precision: fp32, amp (fp32 states, 16-bit autocast), mixed (the engine's own: "
           "DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy, Megatron-LM's bf16; on one "
           "device or DDP ZeRO's 2+2+12), bf16 (pure). Default: mixed under an engine whose "
           "own precision it is (see --engine); else amp, or fp32 for the tutorial and notes "
           "families.", "training",
           MODES),
    Option("optimizer", "--optimizer", "choice", describe_optimizers(), "training", OPTIMIZERS),
    Option("autocast_dtype", "--autocast-dtype", "choice", "16-bit dtype of amp and mixed "
           "(default {default}).", "training", AUTOCAST_DTYPES),
    Option("recompute", "--recompute", "choice", "Activation recomputation (default {default}).",
           "training", RECOMPUTE),
    Option("attn", "--attn", "choice", "Attention: sdpa (flash-type kernel; default) or manual "
           "(S x S scores saved; the tutorial and notes families' default).", "training",
           ATTN_IMPLS),
    Option("impl", "--impl", "choice", "Whose saved tensors: reference (this project's model; "
           "presets' default), transformers (--hf-config's default), paper (Korthikanti et "
           "al. 2022), megatron-core (Megatron-Core's GPT model; --engine megatron's "
           "default) or litgpt (litgpt's GPT, Llama-family blocks, and its full fine-tune "
           "loop: chunked cross entropy, logits held to the next step).", "training", IMPLS),
    Option("megatron_te", "--megatron-te", "flag", "Under --impl megatron-core: the layer "
           "built from Transformer Engine's modules (default {default}: fused attention, norms "
           "fused into the next Linear); --no-megatron-te: Megatron's local modules (Apex norms, "
           "its unfused attention).", "training"),
    Option("loss", "--loss", "choice", "The loss over the logits: standard (default: the "
           "whole logits, cross_entropy on them), chunked (torchtune's CEWithChunkedOutputLoss: "
           "the head's output in --loss-chunks chunks, each upcast to fp32 in turn; --impl "
           "reference) or fused (Liger's fused linear cross entropy: no logits beyond one chunk "
           "of rows, the head's gradients made in the forward).", "training", LOSSES),
    Option("loss_chunks", "--loss-chunks", "int", "Chunks of tokens of --loss chunked "
           "(default {default}, torchtune's).", "training"),
    Option("keep_logits", "--keep-logits", "flag", "Whether the training loop holds the "
           "logits through backward, as litgpt's loop and the tutorial notebooks' do (their "
           "families' default); otherwise off (--no-keep-logits): dropped before backward, as "
           "the Hugging Face Trainer, torchtitan and torchtune do. A pipeline (--pp > 1) keeps "
           "them either way.",
           "training"),
    Option("optimizer_in_backward", "--optimizer-in-backward", "flag", "Each parameter's "
           "optimizer step runs in its post-accumulate-grad hook and frees its gradient "
           "(torchtune's optimizer_in_bwd): no full set of gradients; not with gradient "
           "accumulation or sharded gradients.", "training"),
    Option("allocator", "--allocator", "choice", "PyTorch's CUDA caching allocator that the "
           "reserved bytes (torch.cuda.max_memory_reserved) are simulated under: default, or "
           "expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).", "training",
           ALLOCATORS),
    Option("compile", "--compile", "choice", "torch.compile: none (default, eager), blocks "
           "(torchtitan's per-block compile: the min-cut partitioner recomputes a block's "
           "cheap pointwise ops in backward) or model (the blocks and the loss: the loss keeps "
           "the logits and two fp32 numbers per token, not fp32 log-probabilities); --impl "
           "reference, and model under --impl transformers (the Hugging Face Trainer's "
           "torch_compile).", "training", COMPILES),
    Option("float8", "--float8", "choice", "torchao float8 training of the blocks' Linears: "
           "none (default), tensorwise or rowwise scaling (what each Linear saves for "
           "backward, and float8 all-gathers under FSDP2 with tensorwise).", "training",
           FLOAT8),
    Option("liger", "--liger", "text", "Liger's Triton kernels patched into transformers' "
           "Llama, Mistral or Qwen2 (--impl transformers): none (default), all, or a list of "
           "rms_norm (LigerRMSNorm: saves its input and an fp32 rstd per row), swiglu "
           "(LigerSwiGLUMLP: saves the gate and up outputs) and rope (in place on q and k); "
           "Liger's fused loss is --loss fused.", "training", metavar="LIST"),
    Option("offload_activations", "--offload-activations", "flag", "Saved activations go "
           "to host memory as they are saved and come back for backward (torchtune's "
           "OffloadActivations): the device keeps tensors under its minimum size and the "
           "output head's; the host row counts the rest (default {default}).", "training"),
    Option("overhead", "--overhead", "size", "Bytes added to every phase of the peak for what "
           "is not modelled (CUDA context, fragmentation, communication buffers), e.g. 2GiB; "
           "default {default}.", "training", metavar="SIZE", zero_ok=True),
    Option("zero", "--zero", "int", "ZeRO stage 0-3 (default {default}).", "parallel"),
    Option("engine", "--engine", "choice", "The training engine whose sharding and buffers "
           "are counted.", "parallel"),
    Option("deepspeed_config", "--deepspeed-config", "text",
           "A DeepSpeed ds_config.json: its ZeRO stage, bf16/fp16, micro-batch, accumulation "
           "and bucket sizes (\"auto\" as the Hugging Face integration fills it); options "
           "given explicitly must agree with it.", metavar="FILE"),
    Option("offload_optimizer", "--offload-optimizer", "choice", "DeepSpeed ZeRO-Offload: "
           "the fp32 master partition, the optimizer states and the fp32 gradients in host "
           "memory (cpu; nvme: on NVMe behind pinned host buffers, ZeRO 3); implies --engine "
           "deepspeed (default none).", choices=("cpu", "nvme", "none")),
    Option("offload_param", "--offload-param", "choice", "DeepSpeed ZeRO-Infinity: the 16-bit "
           "parameter partitions in host memory (cpu) or on NVMe (nvme), gathered to the "
           "device when used; needs --zero 3 (default none). With --engine fsdp2, cpu is FSDP2's "
           "CPUOffloadPolicy: sharded parameters, gradients and optimizer states on the host.",
           choices=("cpu", "nvme", "none")),
    Option("distributed_optimizer", "--distributed-optimizer", "flag",
           "Megatron-LM's distributed optimizer (default {default}): fp32 master weights and Adam "
           "states sharded over dp.", "parallel"),
    Option("fsdp1_sync", "--fsdp1-sync", "choice", "How --engine fsdp1 accumulates "
           "--grad-accum micro-batches: no-sync (default: every one but the last under "
           "no_sync(), keeping each unit's unsharded gradient, as the Hugging Face Trainer runs "
           "it through accelerate) or each-batch (each reduce-scattered: accelerate's "
           "sync_each_batch, a plain loop).", "parallel", FSDP1_SYNCS),
    Option("dp", "--dp", "int", "Data-parallel replicas (default {default}).", "parallel"),
    Option("tp", "--tp", "int", "Tensor-parallel ranks (default {default}).", "parallel"),
    Option("pp", "--pp", "int", "Pipeline stages (default {default}); pp not dividing the layers "
           "splits them as torchtitan does (the first and last stages one block fewer).",
           "parallel"),
    Option("pp_schedule", "--pp-schedule", "choice", "The pipeline schedule (torch.distributed."
           "pipelining's): gpipe, 1f1b (default), interleaved-1f1b or zero-bubble "
           "(ScheduleInterleavedZeroBubble); micro-batches: --grad-accum when above 1, else pp.",
           "parallel", PP_SCHEDULES),
    Option("pp_virtual", "--pp-virtual", "int", "Model chunks (virtual stages) per pipeline "
           "stage, for interleaved-1f1b and zero-bubble (default {default}).", "parallel"),
    Option("sp", "--sp", "flag", "Sequence parallel (with tp).", "parallel"),
    Option("ep", "--ep", "int", "Expert-parallel ranks: each holds n_expert/ep routed experts "
           "(default {default}).", "parallel"),
    Option("cp", "--cp", "int", "Context-parallel ranks: the sequence cut into 2 x cp chunks, "
           "rank i holding chunks i and 2cp-1-i, attention a ring over the ranks (torch's "
           "context_parallel, torchtitan; Megatron-core); parameters sharded over dp x cp; GPUs "
           "= dp x tp x pp x cp (default {default}).", "parallel"),
    Option("lora_rank", "--lora-rank", "int", "LoRA fine-tuning at this rank: a frozen base, "
           "trainable adapters (default {default}: full training).", "training"),
    Option("lora_targets", "--lora-targets", "text", TARGETS_HELP, "training", metavar="LIST"),
    Option("dora", "--dora", "flag", "DoRA (PEFT's LoraConfig(use_dora=True)): each adapted "
           "Linear also trains a magnitude vector of its output width; with --lora-rank.",
           "training"),
    Option("lora_dropout", "--lora-dropout", "float", "LoRA dropout P in [0, 1) (PEFT's "
           "lora_dropout): each adapter drops its own copy of its input, which it keeps for "
           "backward with the dropout's mask (default 0: none); with --lora-rank.", "training",
           metavar="P"),
    Option("weights_dtype", "--weights-dtype", "choice", "The frozen base under LoRA: bf16 "
           "(default); nf4 = bitsandbytes' NF4 with an fp32 absmax per 64 weights; nf4-dq "
           "(or int4) = QLoRA's NF4 with double-quantised constants.", "training",
           ("bf16", "nf4", "nf4-dq", "int4")),
    Option("kbit_prepare", "--kbit-prepare", "flag", "Under an NF4 base: peft's "
           "prepare_model_for_kbit_training leaves every parameter but the 4-bit weights in "
           "fp32 (embeddings, norms, output head), so the residual stream is fp32 and autocast "
           "keeps a 16-bit copy of the head; with --impl transformers, --mode amp and "
           "--recompute full (it turns checkpointing on). Off (default {default}): TRL and "
           "axolotl leave those 16-bit.", "training"),
    Option("bnb_version", "--bnb-version", "text", "The bitsandbytes release under an NF4 base "
           "(default {default}): before 0.43.2 each 4-bit Linear keeps its input for backward.",
           "training", metavar="X.Y.Z"),
    Option("device", "--device", "choice", "The device trained on, whose kernels decide what "
           "is saved: cuda (default) or cpu (the tutorial and notes families' default; where "
           "the reference model is measured exactly).", "training", DEVICES),
)

# the device a step must fit (`memory`); the command line only
_DEVICE = (
    Option("gpu", "--gpu", "text", "A catalogue accelerator (see `gptcalc gpus`) whose usable "
           "memory (what torch.cuda.mem_get_info reports, below the datasheet's) the step must "
           "fit, e.g. h100-sxm; instead of --gpu-memory.", metavar="NAME",
           dest="gpu_name"),
    Option("gpus_per_node", "--gpus-per-node", "int", "Ranks per node, for the host memory "
           "a node needs under DeepSpeed offload (default 8)."),
    Option("gpu_memory", "--gpu-memory", "size", "Memory per device, e.g. 80GiB or 80GB: the "
           "largest micro-batch and training sequence that fit one step, the longest inference "
           "context, and when nothing fits the smallest changes that would.", metavar="SIZE"),
)

# `serve`'s own; the command line only
_SERVE = (
    Option("engine_version", "--engine-version", "text", "The serving engine's release, e.g. "
           "0.6.4 or 0.8.5 (default the newest: vLLM 0.33.0, SGLang 0.5.23): vLLM before 0.8.0 "
           "runs its V0 engine, with its own scheduler defaults.", metavar="X.Y.Z"),
    Option("enable_lora", "--enable-lora", "flag", "vLLM's LoRA serving: --max-loras slots of "
           "rank --max-lora-rank on every block Linear, reserved with the weights (default "
           "off)."),
    Option("max_loras", "--max-loras", "int", "LoRA adapters served at once, the slots vLLM "
           "reserves (default 1, vLLM's); with --enable-lora."),
    Option("max_lora_rank", "--max-lora-rank", "int", "The largest LoRA rank served, each slot's "
           "rank (default 16, vLLM's); with --enable-lora."),
)

# TrainingSetup fields whose option has another name
_OPTION_FIELDS = {"attn": "attn_impl", "weights_dtype": "base_dtype"}


def _shown(value: Any) -> str:
    """A default as help text shows it: on/off for a flag."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _placed(opt: Option) -> Option:
    """A set-up option (table "training" or "parallel") in its TrainingSetup field's section,
    its help's "{default}" that field's default."""
    field = _OPTION_FIELDS.get(opt.name, opt.name)
    if opt.table not in ("training", "parallel") or field not in field_defaults():
        return opt
    return dataclasses.replace(opt, table=section_of(field), field=field, help=opt.help.replace(
        "{default}", _shown(field_defaults()[field])))


_TRAINING = tuple(_placed(o) for o in _TRAINING)

# every declared option, by name; MODEL_OPTIONS, TRAINING_OPTIONS and DEVICE_OPTIONS in
# command-line order
MODEL_OPTIONS = tuple(o.name for o in _MODEL)
TRAINING_OPTIONS = tuple(o.name for o in _TRAINING)
DEVICE_OPTIONS = tuple(o.name for o in _DEVICE)
SERVE_OPTIONS = tuple(o.name for o in _SERVE)
OPTIONS: dict[str, Option] = {o.name: o for o in (*_MODEL, *_TRAINING, *_DEVICE, *_SERVE)}

# the tables of a config file: [model] holds every GPTConfig field too (gptcalc.coerce types
# them); the others hold exactly the options that name them: [workload], and one table per
# section of the training set-up (`training_setup.SECTIONS`). [training] is the flat table that
# earlier releases wrote, every set-up option outside [parallel]; it is still read.
LEGACY_TRAINING = "training"
SETUP_TABLES = tuple(SECTIONS)
TABLES = ("model", "workload", *SETUP_TABLES, LEGACY_TRAINING)


def table_keys(table: str) -> tuple[str, ...]:
    """The keys of a config-file table that options declare, in command-line order ([training]:
    every set-up option outside [parallel])."""
    if table == LEGACY_TRAINING:
        return tuple(o.name for o in OPTIONS.values()
                     if o.table in SETUP_TABLES and o.table != "parallel")
    return tuple(o.name for o in OPTIONS.values() if o.table == table and not o.source)


# TrainingSetup fields that an option of another name sets
_FIELD_OPTIONS = {"attn_impl": "attn", "base_dtype": "weights_dtype",
                  "double_quant": "weights_dtype"}


def cli_spelling(field: str) -> str:
    """The command-line spelling of an option or config field (switches are set with --set)."""
    field = _FIELD_OPTIONS.get(field, field)
    if field in OPTIONS:
        return OPTIONS[field].cli
    if field in {f.name for f in dataclasses.fields(GPTConfig)}:
        return f"--set {field}"
    return f"--{field.replace('_', '-')}"


__all__ = ["DEVICE_OPTIONS", "LEGACY_TRAINING", "MODEL_OPTIONS", "OPTIONS", "SERVE_OPTIONS",
           "SETUP_TABLES", "TABLES", "TRAINING_OPTIONS", "Option",
           "byte_size", "cli_spelling", "table_keys"]
