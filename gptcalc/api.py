"""The Python API: build a model from a preset, a Hugging Face config.json or a config file, with
overrides, and get its counts as plain dataclasses. The CLI resolves its options through the same
`resolve_setup`, so a script and a command given the same inputs see the same model.

    import gptcalc
    cfg, wl = gptcalc.load(hf_config="path/to/config.json", batch_size=8, seq_len=2048)
    s = gptcalc.summarize(cfg, wl)
    s.params.total, s.flops.training_total, dataclasses.asdict(s)

Precedence, lowest first: preset < hf_config < config file < explicit arguments (`arch`, sizes,
switches). See docs/python-api.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .coerce import coerce_field
from .config import GPTConfig
from .errors import ConfigError
from .workload import Workload, validate_workload
from .configfile import ConfigFile, read_config_file, write_config_file
from . import flops as _flops
from .flops import FlopCount, InferenceFlops
from .params import ParamCount, count_params
from .presets import DEFAULT_PRESET, arch_switches, preset as get_preset, preset_fields


@dataclass(frozen=True)
class Setup:
    """A resolved model, its workload, and the config-file sections later commands read
    (e.g. `sections["parallel"]`), kept as the file wrote them."""

    config: GPTConfig
    workload: Workload
    sections: dict[str, Any] = field(default_factory=dict)
    from_hf: bool = False  # the model came from a Hugging Face config.json (transformers' modules)
    # that config.json's quantization_config as the file states it (None: none, or no file);
    # gptcalc.inference.quant reads it
    quantization: Mapping[str, Any] | None = None
    # the config.json's multimodal encoders (its vision_config, audio_config, ... keys) that the
    # language model's counts leave out
    encoders: tuple[str, ...] = ()


# the sub-configs of a multimodal checkpoint's encoders (transformers' Gemma 3, Mllama,
# Qwen2-VL, LLaVA: vision_config; Qwen2-Audio, Whisper-style towers: audio_config)
ENCODER_CONFIGS = ("vision_config", "audio_config")


def resolve_setup(preset: str | None = None, hf_config: str | Path | Mapping | None = None,
                  config: str | Path | ConfigFile | None = None, arch: str | None = None,
                  batch_size: int | None = None, seq_len: int | None = None,
                  overrides: Mapping[str, Any] | None = None,
                  grad_accum: int | None = None) -> Setup:
    """Layer the sources, lowest first: preset (its family's switches and its sizes), hf_config,
    the config file's [model] (its own arch switches, then its fields), then the explicit `arch`
    and `overrides`. A preset or hf_config named in the file counts as the file's; an explicit
    one wins over it. Without a preset or hf_config, the default preset is the base.

    Errors are ConfigError naming where the bad value came from: "config" or "hf_config" for a
    file, else the field (which the CLI maps to its option).
    """
    from .hf import hf_fields, read_hf_json

    for name, value in (("preset", preset), ("arch", arch)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(name, f"{name} must be a name, got {value!r}")
    cf = config if isinstance(config, ConfigFile) else (
        read_config_file(config) if config is not None else ConfigFile())
    file_model = dict(cf.model)
    preset_name = preset or file_model.pop("preset", None)
    file_model.pop("preset", None)
    hf = hf_config if hf_config is not None else file_model.pop("hf_config", None)
    file_model.pop("hf_config", None)
    file_arch = file_model.pop("arch", None)

    fields: dict[str, Any] = {}
    origin: dict[str, str] = {}  # field -> where its value came from

    def layer(values: Mapping[str, Any], source: str) -> None:
        for k, v in values.items():
            fields[k] = v
            origin[k] = source

    if preset_name is not None or hf is None:
        p = get_preset(preset_name or DEFAULT_PRESET)
        layer(arch_switches(p.arch), "preset")
        swapped = next((a for a in (arch, file_arch) if a is not None), None)
        layer(preset_fields(p, swapped), "preset")
    quantization, encoders = None, ()
    if hf is not None:
        raw = hf if isinstance(hf, Mapping) else read_hf_json(hf)
        layer(hf_fields(raw), "hf_config")
        quantization = raw.get("quantization_config")
        encoders = tuple(k for k in ENCODER_CONFIGS if isinstance(raw.get(k), Mapping))
    if file_arch is not None:
        try:
            layer(arch_switches(file_arch), "config")
        except ConfigError as e:
            raise ConfigError("config", f"{cf.path}: {e.message}") from None
    layer(file_model, "config")
    if arch is not None:
        layer(arch_switches(arch), "arch")
    layer({k: coerce_field(k, v) for k, v in (overrides or {}).items()}, "explicit")

    try:
        cfg = GPTConfig(**fields)
    except ConfigError as e:
        source = origin.get(e.field)
        if source == "config":
            raise ConfigError("config", f"{cf.path}: {e.message}") from None
        if source == "hf_config":
            raise ConfigError("hf_config", e.message) from None
        raise

    if batch_size is None:
        batch_size = cf.workload.get("batch_size")
    if batch_size is None:  # the preset's batch, where it names one; a config.json names none
        batch_size = get_preset(preset_name).batch_size if preset_name else (
            1 if hf is not None else get_preset(DEFAULT_PRESET).batch_size)
    explicit_seq = seq_len is not None
    if seq_len is None:
        seq_len = cf.workload.get("seq_len", default_seq_len(cfg, from_hf=hf is not None))
    grad_accum = cf.workload.get("grad_accum", 1) if grad_accum is None else grad_accum
    workload = Workload(batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum)
    try:
        validate_workload(cfg, workload)
    except ConfigError as e:
        if not explicit_seq and "seq_len" in cf.workload:
            raise ConfigError("config", f"{cf.path}: {e.message} (set --seq-len)") from None
        raise
    return Setup(config=cfg, workload=workload, sections=dict(cf.sections),
                 from_hf=hf is not None and preset_name is None, quantization=quantization,
                 encoders=encoders)


# A Hugging Face config states the longest context the model supports (Mistral-Nemo: 1,024,000
# tokens), not the length it is trained or fine-tuned at; 4,096 tokens is Llama 2's training
# context and a common fine-tuning length.
HF_TRAINING_SEQ_LEN = 4096


def default_seq_len(cfg: GPTConfig, from_hf: bool = False) -> int:
    """The workload's sequence length when none is given: the block size T of a preset (the
    context it was trained at), at most `HF_TRAINING_SEQ_LEN` for a Hugging Face config."""
    return min(cfg.block_size, HF_TRAINING_SEQ_LEN) if from_hf else cfg.block_size


def load(preset: str | None = None, hf_config: str | Path | Mapping | None = None,
         config: str | Path | None = None, arch: str | None = None,
         batch_size: int | None = None, seq_len: int | None = None,
         **overrides: Any) -> tuple[GPTConfig, Workload]:
    """(GPTConfig, Workload) from a preset, a Hugging Face config.json (path, directory or
    dict) and/or a gptcalc config file, then `arch` and any GPTConfig field as a keyword."""
    s = resolve_setup(preset=preset, hf_config=hf_config, config=config, arch=arch,
                      batch_size=batch_size, seq_len=seq_len, overrides=overrides)
    return s.config, s.workload


def save_config(path: str | Path, cfg: GPTConfig, workload: Workload,
                sections: Mapping[str, Any] | None = None) -> Path:
    """Write a config file (.toml or .json) that `load(config=path)` reads back unchanged."""
    return write_config_file(path, cfg, workload, sections)


if TYPE_CHECKING:  # annotations only; summarize imports gptcalc.memory when called
    from .training_setup import TrainingSetup
    from .memory import MemoryReport


@dataclass(frozen=True)
class Summary:
    """Everything gptcalc computes for one model and workload, as plain dataclasses.

    `dataclasses.asdict(summary)` gives nested dicts of exact ints (floats only for per-token
    values that do not divide evenly)."""

    config: GPTConfig
    workload: Workload
    params: ParamCount
    flops: FlopCount  # per sequence; see FlopCount's properties for totals
    inference: InferenceFlops
    memory: "MemoryReport"  # gptcalc.memory.memory_report: bytes per device, the step peak


def _require(name: str, value: Any, kind: type, what: str) -> None:
    """ConfigError(name) unless `value` is a `kind` (a bool is not an int here)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(name, f"{name} must be {what}, got {value!r}")


def _check_model(cfg: Any, workload: Any = None) -> None:
    _require("cfg", cfg, GPTConfig, "a GPTConfig")
    if workload is not None:
        _require("workload", workload, Workload, "a Workload")


def count_flops(cfg: GPTConfig, workload: Workload, causal: bool = False,
                recompute: str = "none", flash_backward: bool = False) -> FlopCount:
    """Matmul FLOPs of one training step by component (gptcalc.flops.count_flops), with the
    arguments' types checked: `causal="no"` is an error, not a true value."""
    _check_model(cfg, workload)
    _require("causal", causal, bool, "True or False")
    _require("flash_backward", flash_backward, bool, "True or False")
    _require("recompute", recompute, str, f"one of {', '.join(_flops.RECOMPUTE)}")
    return _flops.count_flops(cfg, workload, causal=causal, recompute=recompute,
                              flash_backward=flash_backward)


def inference_flops(cfg: GPTConfig, prompt_len: int, context: int) -> InferenceFlops:
    """Prefill and decode FLOPs (gptcalc.flops.inference_flops); the lengths must be ints."""
    _check_model(cfg)
    _require("prompt_len", prompt_len, int, "an integer")
    _require("context", context, int, "an integer")
    return _flops.inference_flops(cfg, prompt_len, context)


def summarize(cfg: GPTConfig, workload: Workload, causal: bool = False, recompute: str = "none",
              prompt_len: int | None = None, context: int | None = None,
              training: "TrainingSetup | None" = None) -> Summary:
    """Params, training FLOPs, inference FLOPs and memory of `cfg` on `workload`.

    `training` (a TrainingSetup: precision, optimizer, parallelism) sizes the memory; default
    the family's usual set-up (`gptcalc.training.training_defaults`) with this `recompute`, on
    one device."""
    from .training import default_setup
    from .training_setup import TrainingSetup
    from .memory import memory_report  # loaded when asked

    _check_model(cfg, workload)
    for name, value in (("prompt_len", prompt_len), ("context", context)):
        if value is not None:
            _require(name, value, int, "an integer")
    if training is not None:
        _require("training", training, TrainingSetup, "a gptcalc.TrainingSetup")

    prompt = prompt_len if prompt_len is not None else workload.seq_len
    ctx = context if context is not None else workload.seq_len
    return Summary(
        config=cfg,
        workload=workload,
        params=count_params(cfg),
        flops=count_flops(cfg, workload, causal=causal, recompute=recompute),
        inference=inference_flops(cfg, prompt, ctx),
        memory=memory_report(cfg, workload, training or default_setup(cfg, recompute=recompute),
                             ctx),
    )


def to_dict(obj: Any) -> Any:
    """A dataclass (Summary, ParamCount, ...) as plain dicts, for JSON or pandas."""
    return dataclasses.asdict(obj)


__all__ = ["Setup", "Summary", "count_flops", "inference_flops", "load", "resolve_setup",
           "save_config", "summarize", "to_dict"]
