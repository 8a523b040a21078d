"""Model and workload options shared by every command, and their resolution into configs."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import click

from .. import api
from ..api import Setup
from ..coerce import coerce_field, field_kinds
from ..config import GPTConfig
from ..errors import ConfigError
from ..gpus import DEFAULT_GPU
from ..layers import HYBRID_COMMANDS, hybrid_refusal
from ..workload import Workload
from ..configfile import FORMATS, write_config_file
from ..presets import PRESETS
from ..schema import (LEGACY_TRAINING, MODEL_OPTIONS, OPTIONS, SETUP_TABLES, TRAINING_OPTIONS,
                      Option, byte_size, cli_spelling)
from ..training import PARALLEL_DEFAULTS

# What `model_options` and `world_size_option` resolve once per command, kept in the command's
# context; the functions below take that context as a parameter (a command takes it with
# click.pass_context), never the running one implicitly.
_SECTIONS_KEY = "gptcalc.config_sections"
_SETUP_KEY = "gptcalc.setup"
_RECIPE_KEY = "gptcalc.recipe"
# the config-file tables the training set-up is read from
READ_TABLES = (LEGACY_TRAINING, *SETUP_TABLES)


def option_for(field: str) -> str:
    """The command-line spelling of a config field or option; errors name the option a user
    typed, not the field."""
    return cli_spelling(field)


class ByteSize(click.ParamType):
    """A size option: "80GiB", "80GB" (10^9), "512B"; a bad one is one line naming the option
    (ConfigError, exit code 2). `exact` False floors a fraction of a byte; `zero_ok` takes 0."""

    name = "size"

    def __init__(self, exact: bool = True, zero_ok: bool = False) -> None:
        self.exact, self.zero_ok = exact, zero_ok

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        return byte_size(param.name if param else "size", value, self.exact, self.zero_ok)


def targets_given(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--lora-targets as typed: a blank list is a mistake, not the default targets."""
    if value is not None and not value.replace(",", " ").strip():
        raise ConfigError("lora_targets", "give at least one target, e.g. q,v")
    return value


def out_dir_given(ctx: click.Context, param: click.Parameter, value: str | Path | None
                  ) -> Path | None:
    """--out as typed: an empty name is a mistake, not the working folder."""
    if value is not None and not str(value).strip():
        raise ConfigError("out", "give a folder name; an empty one is the working folder")
    return None if value is None else Path(value)


# options a command builds with a callback of its own
_CALLBACKS = {"lora_targets": targets_given}


def click_option(opt: Option, help: str | None = None, **changes: Any) -> Callable:
    """The click option of a declaration (`gptcalc.schema.OPTIONS`); default None, so a value
    from a config file or the family's default applies unless the option is given. A command
    that reads it its own way gives its own `help` phrase, and `changes` to click's settings
    (its default, `type`)."""
    help = opt.help if help is None else help
    if opt.kind == "flag":
        return click.option(f"{opt.cli}/--no-{opt.cli[2:]}", opt.keyword,
                            **{"default": None, "help": help, **changes})
    names = (opt.short, opt.cli) if opt.short else (opt.cli,)
    kind = {"int": int, "float": float, "text": None, "size": ByteSize(zero_ok=opt.zero_ok),
            "choice": click.Choice(opt.choices) if opt.choices else None}[opt.kind]
    settings = {"type": kind, "default": None, "metavar": opt.metavar, "multiple": opt.multiple,
                "callback": _CALLBACKS.get(opt.name), "help": help, **changes}
    return click.option(*names, opt.keyword, **settings)


_MODEL_OPTIONS = [click_option(OPTIONS[name]) for name in MODEL_OPTIONS]


def gpu_option(help: str = "Accelerator (see `gptcalc gpus`).") -> Callable:
    """--gpu NAME (the command's `gpu_name`), a catalogue card, DEFAULT_GPU when not given;
    `help` says what the command reads of it."""
    return click_option(OPTIONS["gpu"], help=help, default=DEFAULT_GPU, show_default=True)


def json_option(help: str = "Machine-readable output.") -> Callable:
    """--json (the command's `as_json`): the command's answer as one JSON document."""
    return click.option("--json", "as_json", is_flag=True, help=help)


# --- options several commands take: each flag is declared once, here or in gptcalc.schema ------
# (tests/test_cli_options.py counts the declarations); a command passes the phrase that says
# what it reads of the option. The flags that mean another thing on a serving or measuring
# command than on the training commands, declared once for each meaning:
OTHER_MEANINGS = {
    "--tp": "a server's tensor-parallel GPUs (infer, serve) vs the training layout's",
    "--pp": "a server's pipeline stages (serve) vs the training layout's",
    "--dp": "a server's data-parallel replicas (serve) vs the training layout's",
    "--gpus": "infer's alias of --tp vs a count of GPUs (memory, time, plan)",
    "--engine": "the serving engine (serve) vs the training engine",
    "--weights-dtype": "the served weights (infer, serve) vs LoRA's frozen base (memory)",
    "--device": "where the reference model runs (verify, report) vs whose kernels are counted",
}


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """A whole number of at least 1, or not given; a bad one is one line naming the option."""
    from ..errors import positive_int

    return None if value is None else positive_int(param.name or "value", value)


def detail_option(help: str) -> Callable:
    """--detail: every figure the command has; `help` names what it adds to the one screen."""
    return click.option("--detail", is_flag=True, help=help)


def context_option(help: str) -> Callable:
    """--context N: tokens of context, positive (default the command's, which `help` says)."""
    return click.option("--context", type=int, default=None, metavar="N", callback=_positive,
                        help=help)


def prompt_len_option(help: str) -> Callable:
    """--prompt-len N: prompt tokens per sequence, positive (default the command's)."""
    return click.option("--prompt-len", type=int, default=None, metavar="N", callback=_positive,
                        help=help)


def gen_len_option(help: str, default: int | None = None) -> Callable:
    """--gen-len N: generated tokens per sequence (`default` the command's)."""
    return click.option("--gen-len", type=int, default=default, show_default=default is not None,
                        metavar="N", help=help)


def serving_tp_option(*aliases: str) -> Callable:
    """--tp N of a server: weights and KV heads split over N GPUs (one GPU unless given)."""
    return click.option("--tp", *aliases, "tp", type=int, default=1, show_default=True,
                        help="GPUs in tensor parallel: weights and KV heads split this many "
                             "ways (fewer KV heads than GPUs: one replicated per GPU).")


def kv_dtype_option() -> Callable:
    """--kv-dtype: the KV cache's element type (bf16 unless given)."""
    from ..inference.kv import KV_DTYPES

    return click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default="bf16",
                        show_default=True, help="KV cache elements.")


def serving_weights_option(help: str) -> Callable:
    """--weights-dtype of inference: the served weights' dtype or quantisation."""
    from ..inference.weights import WEIGHT_DTYPES

    return click.option("--weights-dtype", type=click.Choice(list(WEIGHT_DTYPES)), default=None,
                        help=help)


def peak_precision_option(help: str = "Which dense peak of the GPU to use.") -> Callable:
    """--precision: the GPU's dense peak a step time runs at (bf16 unless given)."""
    return click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16",
                        show_default=True, help=help)


def mfu_option(help: str) -> Callable:
    """--mfu: a utilisation in (0, 1] given instead of the step model's."""
    return click.option("--mfu", type=float, default=None, help=help)


def gpus_option(help: str) -> Callable:
    """--gpus N: a count of GPUs (what it means, `help`)."""
    return click.option("--gpus", "gpus", type=int, default=None, metavar="N", help=help)


def count_option(*names: str, help: str) -> Callable:
    """An option taking a whole number written 300e9, 3e11 or 300000000000 (parsed exactly)."""
    from ..time import parse_count

    field = names[0].lstrip("-").replace("-", "_")
    return click.option(*names, default=None, metavar="N", help=help,
                        callback=lambda ctx, p, v: None if v is None else parse_count(v, field))


def tokens_option(help: str) -> Callable:
    """--tokens N: training tokens, e.g. 300e9."""
    return count_option("--tokens", help=help)


def tokens_per_step_option(help: str) -> Callable:
    """--tokens-per-step N: tokens per optimizer step."""
    return count_option("--tokens-per-step", help=help)


def measure_device_option(help: str) -> Callable:
    """--device where the reference model is built and measured: auto (CUDA when there is
    one), cpu or cuda."""
    return click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                        show_default=True, help=help)


def out_option(default: str, help: str) -> Callable:
    """--out DIR (the command's `out_dir`): a folder the command writes, `default` unless
    given; an empty name is refused."""
    return click.option("--out", "out_dir", type=click.Path(file_okay=False),
                        default=Path(default), show_default=True, callback=out_dir_given,
                        help=help)


def training_engine_option(help: str) -> Callable:
    """--engine NAME: a registered training engine (`gptcalc.memory.engines`); `help` is the
    phrase before the engines' list."""
    from .engines import EngineChoice, engine_help

    return click_option(OPTIONS["engine"], help=engine_help(help), type=EngineChoice())


def setup_option(name: str, help: str | None = None, **changes: Any) -> Callable:
    """A training set-up option (`gptcalc.schema.OPTIONS[name]`) on a command that takes it
    with the default TrainingSetup declares rather than a resolved one (`verify`, `flops`)."""
    from ..training_setup import field_defaults

    opt = OPTIONS[name]
    return click_option(opt, help=help, **{"default": field_defaults()[opt.field],
                                           "show_default": True, **changes})


def model_options(command: Callable) -> Callable:
    """Add the model and workload options; the command receives `model=(cfg, workload)`."""

    @click.pass_context
    @functools.wraps(command)
    def wrapper(ctx: click.Context, **kwargs: Any) -> Any:
        picked = {k: kwargs.pop(k) for k in MODEL_KEYS}
        recipe = picked.pop("recipe")
        if recipe:
            _with_recipe(ctx, recipe, picked, kwargs)
        _with_world(ctx, kwargs)
        save_to = picked.pop("save_config")
        if save_to is not None and not str(save_to).lower().endswith(FORMATS):
            raise ConfigError("save_config", f"{save_to}: the file name must end in .toml or .json")
        try:
            setup = resolve_setup(**picked)
            if setup.config.hybrid and ctx.info_name not in HYBRID_COMMANDS:
                source = next((k for k in ("hf_config", "config", "sets") if picked.get(k)),
                              "hf_config")
                raise ConfigError(source, hybrid_refusal(setup.config, ctx.info_name))
            ctx.meta[_SECTIONS_KEY] = dict(setup.sections)
            ctx.meta[_SETUP_KEY] = setup
            result = command(model=(setup.config, setup.workload), **kwargs)
        except ConfigError as e:
            raise _recipe_error(e, ctx) from None
        if save_to is not None:  # after the command, so it can record its own sections
            write_config_file(save_to, setup.config, setup.workload, ctx.meta[_SECTIONS_KEY])
        return result

    for option in reversed(_MODEL_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


def _with_recipe(ctx: click.Context, paths: tuple[str, ...], picked: dict[str, Any],
                 kwargs: dict[str, Any]) -> None:
    """Fill the options not typed from --recipe's files (`gptcalc.recipes`), in place, and in
    the parameters of the command `ctx` as if typed; the command's own options only."""
    from ..recipes import apply_recipe, read_recipes

    if picked.get("config") is not None:
        raise ConfigError("recipe", "give --recipe or --config, not both")
    # a command without the parallel layout answers the same on any world: one rank stands in
    world = typed_gpus(ctx) if _GPUS_KEY in ctx.meta or "dp" in kwargs else 1
    given = {**picked, **kwargs, "gpus": world}
    recipe = read_recipes(paths, {k: v for k, v in given.items() if v not in (None, ())})
    ctx.meta[_RECIPE_KEY] = (recipe, dict(given))
    for keyword, value in apply_recipe(recipe, given).items():
        target = picked if keyword in picked else kwargs if keyword in kwargs else None
        if target is not None:
            target[keyword] = ctx.params[keyword] = value


_GPUS_KEY = "gptcalc.gpus"


def world_size_option(command: Callable) -> Callable:
    """Add --gpus N, the world size: a recipe's placeholders for it (-1, "auto", a launcher's
    process count) resolve against it, and without a recipe that sets the data-parallel size
    it is --dp = N over --tp x --pp x --cp. Outside model_options, so the recipe sees it."""

    @click.pass_context
    @functools.wraps(command)
    def wrapper(ctx: click.Context, **kwargs: Any) -> Any:
        gpus = kwargs.pop("gpus")
        if gpus is not None and not 1 <= gpus <= 2**20:
            raise ConfigError("gpus", f"must be a whole number from 1 to {2**20:,}, got {gpus}")
        ctx.meta[_GPUS_KEY] = gpus
        return command(**kwargs)

    return gpus_option("The world size (GPUs in all): a recipe's -1, auto or process count "
                       "resolves against it; --dp is N / (tp x pp x cp) unless given.")(wrapper)


def typed_gpus(ctx: click.Context) -> int | None:
    """--gpus of the command `ctx`, or None."""
    return ctx.meta.get(_GPUS_KEY)


def _with_world(ctx: click.Context, kwargs: dict[str, Any]) -> None:
    """--gpus N as the data-parallel size when neither --dp nor a recipe gave one: N over the
    other degrees; with --dp given, their product must be N."""
    gpus = typed_gpus(ctx)
    if gpus is None or "dp" not in kwargs:
        return
    others = 1
    for name in ("tp", "pp", "cp"):
        value = kwargs.get(name)
        others *= value if isinstance(value, int) and value > 0 else 1
    if kwargs.get("dp") is None:
        if gpus % others:
            raise ConfigError("gpus", f"{gpus} is not a multiple of tp x pp x cp = {others}")
        kwargs["dp"] = ctx.params["dp"] = gpus // others
    elif kwargs["dp"] * others != gpus:
        raise ConfigError("gpus", f"{gpus} is not dp x tp x pp x cp = {kwargs['dp'] * others}")


def _recipe_error(error: ConfigError, ctx: click.Context) -> ConfigError:
    """An error about a value --recipe set, naming the recipe's file and key."""
    current = current_recipe(ctx)
    if current is None:
        return error
    from ..recipes import recipe_error

    return recipe_error(current[0], current[1], error)


def current_recipe(ctx: click.Context) -> tuple[Any, dict[str, Any]] | None:
    """The --recipe of the command `ctx`: the Recipe, and the options typed beside it; None
    without one."""
    return ctx.meta.get(_RECIPE_KEY)


# the keyword each of _MODEL_OPTIONS passes to the command
MODEL_KEYS = tuple(OPTIONS[name].keyword for name in MODEL_OPTIONS)


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


def current_setup(ctx: click.Context) -> Setup | None:
    """The resolved model of the command `ctx` (None before `model_options` resolved it)."""
    return ctx.meta.get(_SETUP_KEY)


def recorded_sections(ctx: click.Context) -> dict[str, dict[str, Any]]:
    """The sections --save-config writes for the command `ctx`: the --config file's, then what
    the command recorded (`record_section`)."""
    return ctx.meta.setdefault(_SECTIONS_KEY, {})


def config_section(name: str, ctx: click.Context) -> dict[str, Any]:
    """A section of the --config file of the command `ctx` (e.g. "parallel"), or {} if
    none.

    Commands that add their own settings (training, parallelism) read their defaults here and
    call `record_section` with their effective values so --save-config writes them."""
    return dict(recorded_sections(ctx).get(name, {}))


def record_section(name: str, values: dict[str, Any], ctx: click.Context) -> None:
    """Make `values` the section `name` that --save-config writes for the command `ctx`."""
    recorded_sections(ctx)[name] = dict(values)


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


def float_range(command: Callable) -> Callable:
    """For a command that computes in floating point (time, infer, serve): a result past a
    float's range (about 1.8e308; OverflowError, or a JSON value that is not finite) is one
    line naming the option given furthest from 1, the likeliest cause, never a traceback or an
    infinite figure."""
    @click.pass_context
    @functools.wraps(command)
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except OverflowError:
            raise ConfigError(_most_extreme(ctx.params), "a result passes the floating-point "
                              "range (about 1.8e308) with sizes this far from 1") from None
    return wrapper


def _most_extreme(params: dict[str, Any]) -> str:
    """The option (its declared name) whose given number is furthest from 1 on a log scale;
    else the first of --set, --config, --hf-config given; else --preset."""
    import math

    def distance(v: Any) -> float:
        return abs(math.log10(abs(v))) if v else 0.0
    numbers = {k: v for k, v in params.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and v}
    if numbers:
        key = max(numbers, key=lambda k: distance(numbers[k]))
    else:
        key = next((k for k in ("sets", "config", "hf_config") if params.get(k)), "preset")
    return next((o.name for o in OPTIONS.values() if o.keyword == key), key)


# --- the training set-up: memory, report and plot share these options ---------------------------



def _training_option_list(with_device: bool) -> list[Callable]:
    engine = training_engine_option("The training engine whose sharding and buffers are "
                                    "counted:")
    return [engine if name == "engine" else click_option(OPTIONS[name])
            for name in TRAINING_OPTIONS if with_device or name != "device"]


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
    return {k: kwargs.pop(k) for k in TRAINING_OPTIONS if k in kwargs}


@dataclass(frozen=True)
class SetupSource:
    """What a command's training set-up is read from besides its options: the --config file's
    tables as the file holds them (`READ_TABLES`), whether the model is a Hugging Face
    config.json (transformers' modules), and the file's name for errors."""

    sections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    from_hf: bool = False
    where: str = ""


def setup_source(ctx: click.Context) -> SetupSource:
    """The SetupSource of the command `ctx`: its --config file's own tables, not those a
    first resolution recorded for --save-config."""
    s = current_setup(ctx)
    path = ctx.params.get("config")
    sections = dict(s.sections) if s is not None else {}
    return SetupSource({k: dict(sections.get(k, {})) for k in READ_TABLES},
                       bool(s and s.from_hf), f"{path}: " if path else "")


def training_setup(cfg: GPTConfig, given: dict[str, Any], ds: dict[str, Any] | None = None, *,
                   ctx: click.Context):
    """The TrainingSetup of the command `ctx` (`gptcalc.training.resolve_training`: options >
    the --config file's tables > the family's defaults), its tables recorded so --save-config
    writes them by section. `ds`: --deepspeed-config's settings, read once by the command
    (`deepspeed_settings`)."""
    setup, tables = resolve_given(cfg, given, ds, setup_source(ctx))
    recorded = recorded_sections(ctx)
    for name in READ_TABLES:  # the file's flat [training] of earlier releases included
        recorded.pop(name, None)
    for name, table in tables.items():
        record_section(name, table, ctx)
    return setup


def resolve_given(cfg: GPTConfig, given: dict[str, Any], ds: dict[str, Any] | None,
                  source: SetupSource):
    """The TrainingSetup and the effective table of each section for the options `given` over
    `source`, recording nothing (`training_setup` records them): what a command would resolve
    to with other options, as the fit advice asks."""
    from ..training import resolve_training

    return resolve_training(cfg, source.sections, given, from_hf=source.from_hf,
                            where=source.where, ds=ds)


def deepspeed_settings(cfg: GPTConfig, given: dict[str, Any], source: SetupSource
                       ) -> dict[str, Any] | None:
    """--deepspeed-config's settings (`gptcalc.dsconfig.read_ds_config`), None without it: a
    command reads the file once, here, and hands the settings to `deepspeed_workload` and
    `training_setup`."""
    path = _ds_path(given, source)
    if not path:
        return None
    from ..dsconfig import read_ds_config

    return read_ds_config(path, cfg)


def _ds_path(given: dict[str, Any], source: SetupSource) -> str | None:
    """--deepspeed-config, else the --config file's [parallel] deepspeed_config (as
    --save-config writes it)."""
    path = given.get("deepspeed_config")
    if not path:
        path = source.sections.get("parallel", {}).get("deepspeed_config")
    return path if isinstance(path, str) and path else None


def deepspeed_workload(cfg: GPTConfig, wl: Workload, given: dict[str, Any],
                       ds: dict[str, Any] | None, source: SetupSource,
                       typed: Mapping[str, Any]) -> Workload:
    """The workload with --deepspeed-config's micro-batch and accumulation where the file
    sets them (not "auto"); -B and --grad-accum given explicitly (`typed`, the command's
    parameters) must agree with it."""
    path = _ds_path(given, source)
    if not path:
        return wl
    from ..training import ds_agreed

    if ds is None:
        ds = deepspeed_settings(cfg, given, source)
    changes = ds_agreed(path, ds, typed, ("batch_size", "grad_accum"))
    return dataclasses.replace(wl, **changes) if changes else wl


def assumptions(cfg: GPTConfig, wl: Workload, setup) -> str:
    """One line naming every assumption behind a memory figure."""
    from ..memory.engines import describe
    from ..memory.engines.fsdp1 import fsdp1_accumulation
    from ..units import binary_bytes

    return (f"Assuming {describe(setup)}{fsdp1_accumulation(setup, wl.grad_accum)}; "
            f"dropout {cfg.dropout:g}; seq_len {wl.seq_len:,}; "
            f"micro-batch {wl.batch_size} x grad_accum {wl.grad_accum} x dp {setup.dp} = global "
            f"batch {wl.global_batch(setup.dp):,}; overhead {binary_bytes(setup.overhead)}")


# options that name the model rather than change it
_SOURCES = tuple(OPTIONS[name].keyword for name in MODEL_OPTIONS if OPTIONS[name].source)


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


__all__ = ["PARALLEL_DEFAULTS", "PRESETS", "ByteSize", "SetupSource", "assumptions",
           "config_section", "setup_source",
           "deepspeed_settings", "deepspeed_workload", "describe", "model_name", "model_options",
           "option_for", "pop_training", "record_section", "resolve_given", "resolve_setup",
           "training_options", "training_setup"]
