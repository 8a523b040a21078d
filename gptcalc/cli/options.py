"""Model and workload options shared by every command, and their resolution into configs."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import click

from ..config import ARCHS, ConfigError, GPTConfig, Workload, validate_workload
from ..presets import DEFAULT_PRESET, PRESETS, from_name, preset as get_preset

# config field -> the option a user typed; errors name the option, not the field
_OPTIONS = {
    "preset": "--preset", "arch": "--arch", "batch_size": "--batch-size",
    "block_size": "--block-size", "seq_len": "--seq-len", "n_embd": "--n-embd",
    "n_layer": "--n-layer", "n_head": "--n-head", "ffn_mult": "--ffn-mult", "d_ff": "--d-ff",
    "n_kv_head": "--n-kv-head", "head_dim": "--head-dim", "vocab_size": "--vocab-size",
    "dropout": "--dropout",
}


def option_for(field: str) -> str:
    """The command-line spelling of a config field (switches are set with --set)."""
    if field in _OPTIONS:
        return _OPTIONS[field]
    if field in {f.name for f in dataclasses.fields(GPTConfig)}:
        return f"--set {field}"
    return f"--{field.replace('_', '-')}"


def _size(*names: str, help: str) -> Callable:
    return click.option(*names, type=int, default=None, help=help)


_MODEL_OPTIONS = [
    click.option("--preset", default=None, metavar="NAME",
                 help=f"Named model (see `gptcalc presets`); default {DEFAULT_PRESET}."),
    click.option("--arch", default=None, metavar="FAMILY",
                 help=f"Family of switches: {', '.join(ARCHS)}; default the preset's."),
    _size("-B", "--batch-size", help="B: sequences per step (default: the preset's, else 1)."),
    _size("-T", "--block-size", help="T: context length the model is built for."),
    _size("--seq-len", help="Tokens per sequence of the workload, at most T (default T)."),
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
]


def model_options(command: Callable) -> Callable:
    """Add the model and workload options; the command receives `model=(cfg, workload)`."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        picked = {k: kwargs.pop(k) for k in MODEL_KEYS}
        return command(model=resolve(**picked), **kwargs)

    for option in reversed(_MODEL_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


# the keyword each of _MODEL_OPTIONS passes to the command
MODEL_KEYS = ("preset", "arch", "batch_size", "block_size", "seq_len", "n_embd", "n_layer",
              "n_head", "ffn_mult", "d_ff", "n_kv_head", "head_dim", "vocab_size", "dropout",
              "sets")


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_sets(sets: tuple[str, ...]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise ConfigError("set", f"expected FIELD=VALUE, got {item!r}")
        if key not in fields:
            raise ConfigError("set", f"unknown field {key!r}; fields: {', '.join(fields)}")
        out[key] = _parse_value(value)
    return out


def resolve(preset: str | None = None, arch: str | None = None, batch_size: int | None = None,
            seq_len: int | None = None, sets: tuple[str, ...] = (), **sizes: Any
            ) -> tuple[GPTConfig, Workload]:
    """Preset, then family, then explicit sizes and --set switches; explicit options win."""
    name = preset or DEFAULT_PRESET
    base = get_preset(name)
    overrides = {k: v for k, v in sizes.items() if v is not None}
    overrides.update(parse_sets(sets))
    cfg = from_name(name, arch=arch, **overrides)
    workload = Workload(batch_size=batch_size if batch_size is not None else base.batch_size,
                        seq_len=seq_len if seq_len is not None else cfg.block_size)
    validate_workload(cfg, workload)
    return cfg, workload


def describe(cfg: GPTConfig, workload: Workload | None = None) -> str:
    """One line naming the model's sizes and, when given, the workload."""
    parts = [f"L={cfg.n_layer}", f"H={cfg.n_head}", f"E={cfg.n_embd}", f"T={cfg.block_size}",
             f"V={cfg.vocab_size}", f"d_ff={cfg.hidden_size}"]
    if cfg.kv_heads != cfg.n_head:
        parts.append(f"kv_heads={cfg.kv_heads}")
    if workload is not None:
        parts += [f"B={workload.batch_size}", f"seq_len={workload.seq_len}"]
    return " ".join(parts)


__all__ = ["PRESETS", "describe", "model_options", "option_for", "resolve"]
