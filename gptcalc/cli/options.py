"""Model and workload options shared by every command, and their resolution into configs."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import click

from .. import api
from ..api import Setup
from ..coerce import coerce_field, field_kinds
from ..config import GPTConfig
from ..errors import ConfigError
from ..families import ARCHS
from ..workload import Workload
from ..configfile import FORMATS, write_config_file
from ..lora import TARGETS_HELP
from ..presets import DEFAULT_PRESET, PRESETS
from ..training import PARALLEL_DEFAULTS

_SECTIONS_KEY = "gptcalc.config_sections"
_SETUP_KEY = "gptcalc.setup"

# config field -> the option a user typed; errors name the option, not the field
_OPTIONS = {
    "preset": "--preset", "arch": "--arch", "batch_size": "--batch-size",
    "block_size": "--block-size", "seq_len": "--seq-len", "n_embd": "--n-embd",
    "n_layer": "--n-layer", "n_head": "--n-head", "ffn_mult": "--ffn-mult", "d_ff": "--d-ff",
    "n_kv_head": "--n-kv-head", "head_dim": "--head-dim", "vocab_size": "--vocab-size",
    "dropout": "--dropout", "grad_accum": "--grad-accum", "hf_config": "--hf-config", "config": "--config",
    "save_config": "--save-config", "set": "--set",
}


def option_for(field: str) -> str:
    """The command-line spelling of a config field (switches are set with --set)."""
    if field in _OPTIONS:
        return _OPTIONS[field]
    if field in {f.name for f in dataclasses.fields(GPTConfig)}:
        return f"--set {field}"
    return f"--{field.replace('_', '-')}"


def targets_given(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--lora-targets as typed: a blank list is a mistake, not the default targets."""
    if value is not None and not value.replace(",", " ").strip():
        raise ConfigError("lora_targets", "give at least one target, e.g. q,v")
    return value


def _size(*names: str, help: str) -> Callable:
    return click.option(*names, type=int, default=None, help=help)


_MODEL_OPTIONS = [
    click.option("--preset", default=None, metavar="NAME",
                 help=f"Named model (see `gptcalc presets`); default {DEFAULT_PRESET}."),
    click.option("--arch", default=None, metavar="FAMILY",
                 help=f"Family of switches: {', '.join(ARCHS)}; default the preset's."),
    _size("-B", "--batch-size", help="B: the micro-batch, sequences one device holds per "
                                     "forward/backward (default: the preset's, else 1)."),
    _size("--grad-accum", help="Micro-batches accumulated per optimizer step (default 1); the "
                               "global batch is B x dp x grad-accum."),
    _size("-T", "--block-size", help="T: context length the model is built for."),
    _size("--seq-len", help="Tokens per sequence of the workload, at most T (default T; "
                            "for --hf-config at most 4096)."),
    _size("-E", "--n-embd", help="E: embedding width (d_model)."),
    _size("-L", "--n-layer", help="L: number of blocks."),
    _size("-H", "--n-head", help="H: attention (query) heads."),
    _size("-F", "--ffn-mult", help="F: MLP expansion, d_ff = F*E."),
    _size("--d-ff", help="Explicit MLP hidden width (overrides F)."),
    _size("--n-kv-head", help="Key/value heads (grouped-query attention)."),
    _size("--head-dim", help="Width of one head (default E/H)."),
    _size("-V", "--vocab-size", help="V: vocabulary size."),
    click.option("--dropout", type=float, default=None, help="Dropout probability."),
    click.option("--set", "sets", multiple=True, metavar="FIELD=VALUE",
                 help="Set any architecture switch, e.g. --set qkv_bias=false --set norm=rmsnorm."),
    click.option("--hf-config", default=None, metavar="PATH|ORG/NAME[@REV]",
                 help="A Hugging Face config.json (or its directory), or a Hub id read through "
                      "huggingface_hub's cache (HF_HUB_OFFLINE, HF_TOKEN; a local path wins): "
                      "llama, mistral, mixtral, qwen2/3(-moe), deepseek_v3, gemma 1-3, gpt_oss, "
                      "phi, phi3, olmo2, starcoder2, falcon, opt, bloom, ... (see README)."),
    click.option("--config", default=None, metavar="FILE",
                 help="A gptcalc config file (TOML or .json): [model], [workload], [training]."),
    click.option("--save-config", default=None, metavar="FILE",
                 help="Write the effective configuration to FILE (.toml or .json) for --config."),
]


def model_options(command: Callable) -> Callable:
    """Add the model and workload options; the command receives `model=(cfg, workload)`."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        picked = {k: kwargs.pop(k) for k in MODEL_KEYS}
        save_to = picked.pop("save_config")
        if save_to is not None and not str(save_to).lower().endswith(FORMATS):
            raise ConfigError("save_config", f"{save_to}: the file name must end in .toml or .json")
        setup = resolve_setup(**picked)
        ctx = click.get_current_context()
        ctx.meta[_SECTIONS_KEY] = dict(setup.sections)
        ctx.meta[_SETUP_KEY] = setup
        result = command(model=(setup.config, setup.workload), **kwargs)
        if save_to is not None:  # after the command, so it can record its own sections
            write_config_file(save_to, setup.config, setup.workload, ctx.meta[_SECTIONS_KEY])
        return result

    for option in reversed(_MODEL_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


# the keyword each of _MODEL_OPTIONS passes to the command
MODEL_KEYS = ("preset", "arch", "batch_size", "grad_accum", "block_size", "seq_len", "n_embd", "n_layer",
              "n_head", "ffn_mult", "d_ff", "n_kv_head", "head_dim", "vocab_size", "dropout",
              "sets", "hf_config", "config", "save_config")


def parse_sets(sets: tuple[str, ...]) -> dict[str, Any]:
    """`--set FIELD=VALUE` items as typed GPTConfig fields (later items win)."""
    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ConfigError("set", f"expected FIELD=VALUE, got {item!r}")
        if key not in field_kinds():
            raise ConfigError("set", f"unknown field {key!r}; fields: {', '.join(field_kinds())}")
        try:
            out[key] = coerce_field(key, value)
        except ConfigError as e:
            raise ConfigError("set", e.message) from None
    return out


def resolve_setup(preset: str | None = None, arch: str | None = None,
                  batch_size: int | None = None, seq_len: int | None = None,
                  sets: tuple[str, ...] = (), hf_config: str | None = None,
                  config: str | None = None, grad_accum: int | None = None,
                  **sizes: Any) -> Setup:
    """The command line's model: preset < --hf-config < --config < explicit options and --set."""
    overrides = {k: v for k, v in sizes.items() if v is not None}
    overrides.update(parse_sets(sets))
    return api.resolve_setup(preset=preset, hf_config=hf_config, config=config, arch=arch,
                             batch_size=batch_size, seq_len=seq_len, overrides=overrides,
                             grad_accum=grad_accum)


def current_setup() -> Setup | None:
    """The resolved model of the running command (None outside a command)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(_SETUP_KEY) if ctx else None


def config_section(name: str) -> dict[str, Any]:
    """A section of the running command's --config file (e.g. "training"), or {} if none.

    Commands that add their own settings (training, parallelism) read their defaults here and
    call `record_section` with their effective values so --save-config writes them."""
    ctx = click.get_current_context(silent=True)
    sections = ctx.meta.get(_SECTIONS_KEY, {}) if ctx else {}
    return dict(sections.get(name, {}))


def record_section(name: str, values: dict[str, Any]) -> None:
    """Make `values` the section `name` that --save-config writes for the running command."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta.setdefault(_SECTIONS_KEY, {})[name] = dict(values)


def describe(cfg: GPTConfig, workload: Workload | None = None) -> str:
    """One line naming the model's sizes and, when given, the workload."""
    parts = [f"L={cfg.n_layer}", f"H={cfg.n_head}", f"E={cfg.n_embd}", f"T={cfg.block_size}",
             f"V={cfg.vocab_size}", f"d_ff={cfg.ffn_dim}"]
    if cfg.kv_heads != cfg.n_head:
        parts.append(f"kv_heads={cfg.kv_heads}")
    if workload is not None:
        parts += [f"B={workload.batch_size}", f"seq_len={workload.seq_len}"]
        if workload.grad_accum > 1:
            parts.append(f"grad_accum={workload.grad_accum}")
    return " ".join(parts)


# --- the training set-up: memory, report and plot share these options ---------------------------



def _training_option_list(with_device: bool) -> list[Callable]:
    from ..training_setup import (ATTN_IMPLS, AUTOCAST_DTYPES, ENGINES, IMPLS, MODES, OPTIMIZERS,
                                  RECOMPUTE)

    opts = [
        click.option("--mode", type=click.Choice(MODES), default=None,
                     help="Precision: fp32, amp (fp32 states, 16-bit autocast), mixed (the "
                          "engine's own: DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy, "
                          "Megatron-LM's bf16; on one device or DDP ZeRO's 2+2+12), bf16 (pure). "
                          "Default: mixed under deepspeed, fsdp2 and megatron; else amp, or fp32 "
                          "for the tutorial and notes families."),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None,
                     help="adamw (default), sgd, sgd-momentum."),
        click.option("--autocast-dtype", type=click.Choice(AUTOCAST_DTYPES), default=None,
                     help="16-bit dtype of amp and mixed (default bf16)."),
        click.option("--recompute", type=click.Choice(RECOMPUTE), default=None,
                     help="Activation recomputation (default none)."),
        click.option("--attn", type=click.Choice(ATTN_IMPLS), default=None,
                     help="Attention: sdpa (flash-type kernel; default) or manual (S x S scores "
                          "saved; the tutorial and notes families' default)."),
        click.option("--impl", type=click.Choice(IMPLS), default=None,
                     help="Whose saved tensors: reference (this project's model; presets' "
                          "default), transformers (--hf-config's default) or paper (Korthikanti "
                          "et al. 2022)."),
        click.option("--overhead", default=None, metavar="SIZE",
                     help="Bytes added to every phase of the peak for what is not modelled (CUDA "
                          "context, fragmentation, communication buffers), e.g. 2GiB; default "
                          "0."),
        click.option("--zero", type=int, default=None, help="ZeRO stage 0-3 (default 0)."),
        click.option("--engine", type=click.Choice(ENGINES), default=None,
                     help="The training engine whose sharding and buffers are counted: "
                          "deepspeed (default for --zero 1-3), fsdp2 (FSDP2 fully_shard: "
                          "--zero 2 or 3 = reshard_after_forward False/True), megatron "
                          "(Megatron-LM's distributed optimizer, from its documentation; no "
                          "twin runs here), ddp (default for --zero 0), zero-redundancy "
                          "(PyTorch's ZeroRedundancyOptimizer, --zero 1)."),
        click.option("--deepspeed-config", default=None, metavar="FILE",
                     help="A DeepSpeed ds_config.json: its ZeRO stage, bf16/fp16, micro-batch, "
                          "accumulation and bucket sizes (\"auto\" as the Hugging Face "
                          "integration fills it); options given explicitly must agree with it."),
        click.option("--distributed-optimizer/--no-distributed-optimizer", default=None,
                     help="Megatron-LM's distributed optimizer (default on): fp32 master "
                          "weights and Adam states sharded over dp."),
        click.option("--dp", type=int, default=None, help="Data-parallel replicas (default 1)."),
        click.option("--tp", type=int, default=None, help="Tensor-parallel ranks (default 1)."),
        click.option("--pp", type=int, default=None, help="Pipeline stages, 1F1B (default 1)."),
        click.option("--sp/--no-sp", default=None, help="Sequence parallel (with tp)."),
        click.option("--ep", type=int, default=None,
                     help="Expert-parallel ranks: each holds n_expert/ep routed experts "
                          "(default 1)."),
        click.option("--lora-rank", type=int, default=None,
                     help="LoRA fine-tuning at this rank: a frozen base, trainable adapters "
                          "(default 0: full training)."),
        click.option("--lora-targets", default=None, metavar="LIST", callback=targets_given,
                     help=TARGETS_HELP),
        click.option("--weights-dtype", type=click.Choice(["bf16", "int4"]), default=None,
                     help="The frozen base under LoRA: bf16 (default) or int4 = QLoRA's NF4 with "
                          "double-quantised constants."),
    ]
    if with_device:
        opts.append(click.option(
            "--device", type=click.Choice(["cpu", "cuda"]), default=None,
            help="The device trained on, whose kernels decide what is saved: cuda (default) or "
                 "cpu (the tutorial and notes families' default; where the reference model is "
                 "measured exactly)."))
    return opts


TRAINING_KEYS = ("mode", "optimizer", "autocast_dtype", "recompute", "attn", "impl", "overhead",
                 "zero", "engine", "deepspeed_config", "distributed_optimizer", "dp", "tp", "pp", "sp", "ep",
                 "lora_rank", "lora_targets", "weights_dtype")


def training_options(with_device: bool = True) -> Callable:
    """Add the training set-up's options (precision, optimizer, recomputation, attention,
    implementation profile, overhead, parallel layout, and optionally --device)."""
    def decorate(command: Callable) -> Callable:
        for option in reversed(_training_option_list(with_device)):
            command = option(command)
        return command
    return decorate


def pop_training(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The training options' values, removed from a command's keyword arguments."""
    return {k: kwargs.pop(k) for k in (*TRAINING_KEYS, "device") if k in kwargs}


def training_setup(cfg: GPTConfig, given: dict[str, Any], ds: dict[str, Any] | None = None):
    """The TrainingSetup of the running command (`gptcalc.training.resolve_training`: options >
    the --config file's [training] and [parallel] tables > the family's defaults), recorded so
    --save-config writes it. `ds`: --deepspeed-config's settings, read once by the command
    (`deepspeed_settings`)."""
    from ..training import resolve_training

    s = current_setup()
    ctx = click.get_current_context(silent=True)
    path = ctx.params.get("config") if ctx else None
    setup, tables = resolve_training(cfg, {k: config_section(k) for k in ("training", "parallel")},
                                     given, from_hf=bool(s and s.from_hf),
                                     where=f"{path}: " if path else "", ds=ds)
    for name, table in tables.items():
        record_section(name, table)
    return setup


def deepspeed_settings(cfg: GPTConfig, given: dict[str, Any]) -> dict[str, Any] | None:
    """--deepspeed-config's settings (`gptcalc.dsconfig.read_ds_config`), None without it: a
    command reads the file once, here, and hands the settings to `deepspeed_workload` and
    `training_setup`."""
    path = given.get("deepspeed_config")
    if not path:
        return None
    from ..dsconfig import read_ds_config

    return read_ds_config(path, cfg)


def deepspeed_workload(cfg: GPTConfig, wl: Workload, given: dict[str, Any],
                       ds: dict[str, Any] | None = None) -> Workload:
    """The workload with --deepspeed-config's micro-batch and accumulation where the file
    sets them (not "auto"); -B and --grad-accum given explicitly must agree with it."""
    path = given.get("deepspeed_config")
    if not path:
        return wl
    from ..training import ds_agreed

    if ds is None:
        ds = deepspeed_settings(cfg, given)
    ctx = click.get_current_context(silent=True)
    changes = ds_agreed(path, ds, ctx.params if ctx else {}, ("batch_size", "grad_accum"))
    return dataclasses.replace(wl, **changes) if changes else wl


def assumptions(cfg: GPTConfig, wl: Workload, setup) -> str:
    """One line naming every assumption behind a memory figure."""
    from ..units import binary_bytes

    ds = ""
    if setup.engine_name == "deepspeed" and setup.zero >= 1:
        from ..memory.engines.deepspeed import describe_buffers

        ds = f"; DeepSpeed {describe_buffers(setup)}"
    return (f"Assuming {setup.describe()}{ds}; dropout {cfg.dropout:g}; seq_len {wl.seq_len:,}; "
            f"micro-batch {wl.batch_size} x grad_accum {wl.grad_accum} x dp {setup.dp} = global "
            f"batch {wl.global_batch(setup.dp):,}; overhead {binary_bytes(setup.overhead)}")


# options that name the model rather than change it
_SOURCES = ("preset", "sets", "hf_config", "config", "save_config")


def model_name(ctx: click.Context) -> str:
    """The model's name, with the options that changed it: `gpt2 (n_layer=6)`.

    The name is the preset's, else the Hugging Face model's (`_name_or_path`, else the folder
    holding its config.json), else the config file's preset or model, else the default preset."""
    from ..presets import DEFAULT_PRESET

    params = ctx.params
    changed = [f"{k}={params[k]}" for k in MODEL_KEYS
               if k not in _SOURCES and params.get(k) is not None]
    changed += list(params.get("sets") or ())
    name = params.get("preset") or _file_model_name(params) or DEFAULT_PRESET
    return f"{name} ({', '.join(changed)})" if changed else name


def _file_model_name(params: dict) -> str | None:
    from ..configfile import read_config_file

    hf, config = params.get("hf_config"), params.get("config")
    if hf is None and config is not None:
        model = read_config_file(config).model
        if "preset" in model:
            return model["preset"]
        hf = model.get("hf_config")
        if hf is None:
            return Path(config).stem
    return _hf_name(hf) if hf is not None else None


def _hf_name(path: str) -> str:
    from ..hf import hub_id, read_hf_json

    raw = read_hf_json(path)
    name = raw.get("_name_or_path")
    if isinstance(name, str) and name.strip():
        return name.strip()
    if hub_id(path):
        return str(path)
    p = Path(path).resolve()
    return (p if p.is_dir() else p.parent).name or p.stem


__all__ = ["PARALLEL_DEFAULTS", "PRESETS", "TRAINING_KEYS", "assumptions", "config_section",
           "deepspeed_settings", "deepspeed_workload", "describe", "model_name", "model_options", "option_for", "pop_training", "record_section",
           "resolve_setup", "training_options", "training_setup"]
