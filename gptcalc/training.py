"""The training set-up of a command or a script: explicit values > a config file's tables (one
per section of the set-up, `training_setup.SECTIONS`, or the flat [training] of earlier
releases beside [parallel]) > the family's usual set-up (`training_defaults`) > the defaults
TrainingSetup declares.

The CLI's `memory`, `report` and `plot` and the Python API resolve it here, so the same inputs
size the same training step.
"""

from __future__ import annotations

from typing import Any, Mapping

from .config import GPTConfig
from .dsconfig import read_ds_config
from .schema import LEGACY_TRAINING, OPTIONS, SETUP_TABLES, byte_size, table_keys
from .errors import ConfigError
from .families import family_of
from .training_setup import ZERO_STAGES, TrainingSetup, field_defaults

# The families whose notebooks train in fp32 with a written-out attention on a CPU (Karpathy's
# "Let's build GPT" and the decoder-only notes); everything else
# (GPT-2, Llama and every Hugging Face model) is trained the way people train today: bf16
# autocast over fp32 weights, SDPA (flash attention), CUDA kernels.
NOTEBOOK_FAMILIES = ("tutorial", "notes")


def training_defaults(cfg: GPTConfig, hf: bool = False) -> dict[str, Any]:
    """The set-up a model of this family is usually trained with: `mode`, `attn`, `device`,
    `impl`, `keep_logits`. The tutorial and notes families: fp32, manual attention, CPU (the
    reference model, as their notebooks run it), the logits held through backward (their loop
    keeps `logits, loss = model(x, y)` until the next step). Others: amp (bf16), SDPA, CUDA,
    the logits dropped before backward (the Hugging Face Trainer's compute_loss, torchtitan,
    torchtune); a Hugging Face config (`hf`) is
    counted as transformers' modules save it where that profile models its switches (with the
    class's default attention: eager for Gemma 2), else as the reference model saves it."""
    if not hf and family_of(cfg) in NOTEBOOK_FAMILIES:
        return {"mode": "fp32", "attn": "manual", "device": "cpu", "impl": "reference",
                "keep_logits": True}
    impl = "transformers" if hf and _transformers_modelled(cfg) else "reference"
    attn = "sdpa"
    if impl == "transformers":  # the class's own default (Gemma 2: eager, no SDPA path)
        from .memory.profile_transformers import default_attention  # torch-free

        attn = default_attention(cfg)
    return {"mode": "amp", "attn": attn, "device": "cuda", "impl": impl, "keep_logits": False}


def _transformers_modelled(cfg: GPTConfig) -> bool:
    """False when the transformers profile has not measured a switch of `cfg` (MoE, MLA,
    Gemma's norms, ...): such a Hugging Face config is then counted as the reference model
    saves it, and the assumptions line says so."""
    from .memory.profile_transformers import transformers_family  # torch-free

    try:
        transformers_family(cfg)
    except ConfigError:  # a switch not measured, or no class with these switches
        return False
    return True


def default_setup(cfg: GPTConfig, hf: bool = False, **changes: Any) -> TrainingSetup:
    """`TrainingSetup` with the family's `training_defaults`, then `changes`."""
    d = training_defaults(cfg, hf)
    fields = {"mode": d["mode"], "attn_impl": d["attn"], "device": d["device"],
              "impl": d["impl"], "keep_logits": d["keep_logits"], **changes}
    return TrainingSetup(**fields)


# the table value of an option that is not set: no --engine (the ZeRO stage's default), no
# --lora-targets, no --weights-dtype (the mode's dtype); a field default that TOML cannot hold
# (None, a tuple) is not set either
NOT_SET = ""
_UNSET_OPTIONS = ("weights_dtype",)


def _table_defaults(table: str, family: Mapping[str, Any]) -> dict[str, Any]:
    """A config-file table's keys and their values when nothing sets them: the family's usual
    set-up (`training_defaults`, by option name), else the default TrainingSetup declares."""
    fields, out = field_defaults(), {}
    for key in table_keys(table):
        value = family[key] if key in family else fields[OPTIONS[key].field]
        scalar = isinstance(value, (bool, int, float, str)) and key not in _UNSET_OPTIONS
        out[key] = value if scalar else NOT_SET
    return out


PARALLEL_DEFAULTS = _table_defaults("parallel", {})


def training_table_defaults(cfg: GPTConfig, from_hf: bool = False) -> dict[str, Any]:
    """The set-up's keys outside [parallel] (the flat [training] table) and their values when
    nothing sets them."""
    return _table_defaults(LEGACY_TRAINING, training_defaults(cfg, hf=from_hf))


def setup_table_defaults(cfg: GPTConfig, from_hf: bool = False) -> dict[str, dict[str, Any]]:
    """Each section's table and its values when nothing sets them."""
    family = training_defaults(cfg, hf=from_hf)
    return {table: _table_defaults(table, family) for table in SETUP_TABLES}


def typed_value(section: str, key: str, value: Any, default: Any, where: str = "") -> Any:
    """A [section] value of a config file, which must have its default's type: TOML and JSON
    have real booleans and integers, so `sp = "false"` is a mistake, not false."""
    kind = type(default)
    if kind is bool:
        ok, wanted = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, wanted = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is str:
        ok, wanted = isinstance(value, str), "a name (a string)"
    else:
        ok, wanted = True, ""
    if not ok:
        raise ConfigError("config", f"{where}[{section}] {key} must be {wanted}, got {value!r}")
    return value


def _file_values(sections: Mapping[str, Any], where: str = ""
                 ) -> tuple[dict[str, Any], dict[str, str]]:
    """The set-up's keys a config file sets, from its section tables and the flat [training]
    of earlier releases, and the table each came from. A key outside its table, or set in two
    tables, is an error naming the table."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for table in (LEGACY_TRAINING, *SETUP_TABLES):
        got = sections.get(table) or {}
        known = table_keys(table)
        unknown = sorted(set(got) - set(known))
        if unknown:
            raise ConfigError("config", f"{where}[{table}] has unknown keys "
                                        f"{', '.join(unknown)}; known: {', '.join(known)}")
        for key, value in got.items():
            if key in values:
                raise ConfigError("config", f"{where}[{table}] {key} is set in "
                                            f"[{origin[key]}] too")
            values[key], origin[key] = value, table
    return values, origin


def lora_fields(cfg: GPTConfig, rank: Any, targets: Any, weights_dtype: Any, mode: str
                ) -> dict[str, Any]:
    """The LoRA fields of a TrainingSetup from a rank, a target list ("q,v", "all") and the
    frozen base's dtype ("bf16"; "nf4": NF4 with fp32 absmax; "nf4-dq" or its alias "int4":
    QLoRA's NF4 with double-quantised constants)."""
    from .lora import parse_targets

    targets = targets or None  # "" (a saved file's default) is no targets
    weights_dtype = weights_dtype or None
    if not rank:
        if targets is not None:
            raise ConfigError("lora_targets", "give --lora-rank too")
        if weights_dtype in NF4_DTYPES:
            raise ConfigError("weights_dtype", "a 4-bit (NF4) base is frozen: QLoRA needs "
                                               "--lora-rank")
        return {}
    if weights_dtype is not None and mode == "fp32":
        raise ConfigError("weights_dtype", "mode fp32 keeps an fp32 base; use --mode amp (a "
                                           "16-bit base, fp32 adapters) with --weights-dtype")
    return {"lora_rank": rank, "lora_targets": parse_targets(targets, cfg),
            "base_dtype": "nf4" if weights_dtype in NF4_DTYPES else "same",
            "double_quant": weights_dtype != "nf4"}


# --weights-dtype's 4-bit bases: plain NF4, and double-quantised (int4 is its older name)
NF4_DTYPES = ("nf4", "nf4-dq", "int4")


def resolve_training(cfg: GPTConfig, sections: Mapping[str, Any] | None = None,
                     given: Mapping[str, Any] | None = None, from_hf: bool = False,
                     where: str = "", ds: Mapping[str, Any] | None = None,
                     ) -> tuple[TrainingSetup, dict[str, dict[str, Any]]]:
    """The TrainingSetup and the effective table of each section (for writing a config file
    back; `sections` may hold the flat [training] of earlier releases instead). `given` uses
    the option names (`attn`, `weights_dtype`, ...); a bad value from the file is reported
    against the config file and its table. `ds`: the settings of
    given["deepspeed_config"] when the caller has read it already (`read_ds_config`)."""
    sections, given = sections or {}, dict(given or {})
    sections, engine_table = _engine_keys(sections, given, where)
    ds_zero: tuple = ()
    from_file = bool(given.get("deepspeed_config"))
    if from_file:
        given, ds_zero = _with_ds_config(cfg, given, ds)
    filed_engine = next((t.get("engine") for t in (sections.get("parallel"), sections.get(
        LEGACY_TRAINING)) if isinstance(t, Mapping) and t.get("engine")), None)
    ds_zero = _with_offload(given, ds_zero, from_file, filed_engine)
    in_file, origin = _file_values(sections, where)
    values: dict[str, Any] = {}
    for defaults in setup_table_defaults(cfg, from_hf).values():
        for key, default in defaults.items():
            if given.get(key) is not None:
                values[key] = given[key]
            elif key in in_file:
                values[key] = typed_value(origin[key], key, in_file[key], default, where)
            else:
                values[key] = default
    from .memory.engines import default_engine, engine_for, engine_named, names

    zero = values["zero"]
    if not values["engine"] and zero in ZERO_STAGES and not isinstance(zero, bool):
        values["engine"] = default_engine(zero).name
    if given.get("mode") is None and "mode" not in origin and (
            values["engine"] in names() and engine_named(values["engine"]).mixed_by_default):
        values["mode"] = "mixed"  # the engine's own mixed precision is how it is run
    _engine_impl(cfg, values, given, set(origin), values["engine"])
    if values["impl"] == "transformers" and given.get("attn") is None and "attn" not in origin:
        from .memory.profile_transformers import default_attention  # torch-free

        if default_attention(cfg) == "manual":  # a class with eager attention only (BLOOM)
            values["attn"] = "manual"
    if values["impl"] == "litgpt":  # litgpt's bf16-true, its loop holding the logits
        for key, value in (("mode", "bf16"), ("keep_logits", True)):
            if given.get(key) is None and key not in origin:
                values[key] = value
    tables = {table: {k: values[k] for k in table_keys(table)} for table in SETUP_TABLES}
    tables["parallel"].update(engine_table)
    # what the engine derives is left out of the tables unless chosen (the engine from the ZeRO
    # stage, the precision from the engine), so that a file read back with other options
    # (--zero 3, or the fit advice's) derives them again as the same options typed would
    if given.get("engine") is None and "engine" not in origin:
        del tables["parallel"]["engine"]
    if not from_hf and given.get("mode") is None and "mode" not in origin:
        del tables["precision"]["mode"]
    fields = dict(values)
    overhead = fields.pop("overhead")
    try:
        fields.update(lora_fields(cfg, fields.pop("lora_rank"), fields.pop("lora_targets"),
                                  fields.pop("weights_dtype"), fields["mode"]))
        overhead = byte_size("overhead", overhead, zero_ok=True)
        setup = TrainingSetup(attn_impl=fields.pop("attn"), overhead=overhead, **fields,
                              engine_settings=ds_zero)
        engine_for(setup)  # the engine runs this set-up
    except ConfigError as e:
        key = "attn" if e.field == "attn_impl" else e.field
        if key in origin:  # the bad value came from the file, not an option
            raise ConfigError("config", f"{where}[{origin[key]}] {e.message}") from None
        raise
    return setup, tables


# the [parallel] keys that are the engine's own settings rather than TrainingSetup fields: the
# ds_config the set-up was read from (its bucket sizes, prefetch and persistence thresholds)
# and DeepSpeed's offload devices; --save-config writes them, --config reads them back
ENGINE_KEYS = ("deepspeed_config", "offload_optimizer", "offload_param")
OFFLOAD_DEVICES = ("cpu", "nvme", "none")


def _engine_keys(sections: Mapping[str, Any], given: dict[str, Any], where: str = ""
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`sections` without the file's ENGINE_KEYS, which fill `given` (in place) where no
    option set them, and the effective ENGINE_KEYS as --save-config writes them (the ds_config
    as an absolute path)."""
    from pathlib import Path

    from .errors import one_of

    parallel = dict(sections.get("parallel", {}))
    for key in ENGINE_KEYS:
        if key not in parallel:
            continue
        value = typed_value("parallel", key, parallel.pop(key), "", where)
        if key != "deepspeed_config":
            try:
                one_of(key, value, OFFLOAD_DEVICES)
            except ConfigError as e:
                raise ConfigError("config", f"{where}[parallel] {e.message}") from None
        if given.get(key) is None:
            given[key] = value
    table = {k: given[k] for k in ENGINE_KEYS if given.get(k) is not None}
    if "deepspeed_config" in table:
        table["deepspeed_config"] = str(Path(table["deepspeed_config"]).resolve())
    return {**sections, "parallel": parallel}, table


def _engine_impl(cfg: GPTConfig, training: dict[str, Any], given: Mapping[str, Any],
                 filed: set, engine: str) -> None:
    """The engine's own implementation profile where neither an option nor the file names one
    (`Engine.default_impl`) and it models every switch of `cfg` (else the family's stays, and
    the first line says which), and that implementation's training loop: one that drops the
    logits with the forward (`Engine.loop_keeps_logits` False) sets keep_logits off unless
    given."""
    from .memory.activations import profile_models
    from .memory.engines import engine_named, names

    if engine not in names() or engine_named(engine).default_impl is None:
        return
    chosen = engine_named(engine)
    if (given.get("impl") is None and "impl" not in filed
            and profile_models(chosen.default_impl, cfg)):
        training["impl"] = chosen.default_impl
    if (training["impl"] == chosen.default_impl and not chosen.loop_keeps_logits
            and given.get("keep_logits") is None and "keep_logits" not in filed):
        training["keep_logits"] = False


def ds_agreed(path: str, ds: Mapping[str, Any], given: Mapping[str, Any],
              keys: tuple[str, ...]) -> dict[str, Any]:
    """The ds_config's values of `keys` (those it sets), each checked against the option of
    the same name: one given explicitly that disagrees is ConfigError("deepspeed_config")."""
    out = {}
    for key in keys:
        if key not in ds:
            continue
        if given.get(key) is not None and given[key] != ds[key]:
            raise ConfigError("deepspeed_config", f"{path}: the file says {key} {ds[key]} but "
                                                  f"--{key.replace('_', '-')} is {given[key]}")
        out[key] = ds[key]
    return out


def _with_ds_config(cfg: GPTConfig, given: dict[str, Any], ds: Mapping[str, Any] | None = None
                    ) -> tuple[dict[str, Any], tuple]:
    """`given` with a ds_config's stage and precision filled in where no option set them
    (an option that disagrees with the file is an error), the engine DeepSpeed, and the
    file's zero_optimization sizes; the file is read here unless `ds` holds its settings."""
    path = given.pop("deepspeed_config")
    if ds is None:
        ds = read_ds_config(path, cfg)
    given.update(ds_agreed(path, ds, given, ("zero", "mode", "autocast_dtype")))
    if given.get("engine") not in (None, "deepspeed"):
        raise ConfigError("deepspeed_config", f"{path}: a ds_config is DeepSpeed's; --engine is "
                                              f"{given['engine']}")
    given["engine"] = "deepspeed"
    return given, ds["deepspeed_zero"]


def _with_offload(given: dict[str, Any], ds_zero: tuple, from_file: bool,
                  file_engine: Any = None) -> tuple:
    """The engine settings with --offload-optimizer and --offload-param (popped from `given`)
    in place of the ds_config's devices; one that disagrees with the file is an error. An
    offload implies the DeepSpeed engine (`given["engine"]`)."""
    pairs = dict(ds_zero)
    for key in ("offload_optimizer", "offload_param"):
        value = given.pop(key, None)
        if value is None:
            continue
        if from_file and pairs.get(key, "none") != value:
            raise ConfigError(key, f"the ds_config says {key} {pairs.get(key, 'none')}")
        if value == "none":
            pairs = {k: v for k, v in pairs.items() if k != key and not k.startswith(key + "_")}
        else:
            pairs[key] = value
    offloaded = [k for k in ("offload_optimizer", "offload_param") if k in pairs]
    # FSDP2's own offload, the engine given or (unless given) the config file's
    if offloaded and (given.get("engine") or file_engine) == "fsdp2":
        return _fsdp2_offload(pairs)
    if offloaded:
        if given.get("engine") == "fsdp1":
            key = offloaded[0]
            raise ConfigError(key, f"--{key.replace('_', '-')} with --engine fsdp1 is not "
                                   f"modelled (FSDP1's CPUOffload); FSDP2's is (--engine fsdp2 "
                                   f"--offload-param cpu), DeepSpeed's too (--engine deepspeed)")
        if given.get("engine") not in (None, "", "deepspeed"):
            key = offloaded[0]
            raise ConfigError(key, f"--{key.replace('_', '-')} is DeepSpeed's offload; with "
                                   f"--engine {given['engine']} it is not modelled (give "
                                   f"--engine deepspeed)")
        given["engine"] = "deepspeed"
    return tuple(pairs.items())


def _fsdp2_offload(pairs: dict[str, Any]) -> tuple:
    """FSDP2's CPUOffloadPolicy as --offload-param cpu: it moves the sharded parameters,
    their gradients and the optimizer step to the host together, so --offload-optimizer cpu
    may accompany it but not stand alone; NVMe is DeepSpeed's."""
    if pairs.get("offload_param", "none") != "cpu" or pairs.get(
            "offload_optimizer", "cpu") != "cpu":
        key = "offload_optimizer" if pairs.get("offload_param") == "cpu" else "offload_param"
        raise ConfigError(key, "with --engine fsdp2 only --offload-param cpu "
                               "(CPUOffloadPolicy) is modelled; --offload-optimizer alone and "
                               "nvme are DeepSpeed's")
    return (("offload_param", "cpu"),)


def training_for(setup: Any, **given: Any) -> TrainingSetup:
    """The TrainingSetup of a resolved model (`gptcalc.resolve_setup` / the CLI's model): its
    config file's set-up tables and the family's defaults, overridden by
    `given` (option names: mode, attn, device, impl, dp, zero, lora_rank, ...)."""
    return resolve_training(setup.config, setup.sections, given, setup.from_hf)[0]


__all__ = ["PARALLEL_DEFAULTS", "lora_fields", "resolve_training", "setup_table_defaults",
           "training_for", "training_table_defaults", "typed_value"]
