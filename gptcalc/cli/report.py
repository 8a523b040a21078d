"""`gptcalc report`: the whole analysis of a model in one directory (Markdown, HTML, plots)."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import GPTConfig, Workload
from ..gpus import DEFAULT_GPU, gpu as find_gpu
from ..units import si
from .extras import require
from .options import (assumptions, model_options, pop_training, training_options,
                      training_setup)
from .render import print_line


@click.command("report")
@model_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("gptcalc-report"), show_default=True,
              help="Directory for report.md, report.html and the PNG plots.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Where the reference model is measured (auto: CUDA if any).")
@click.option("--gpu", "gpu_name", default=DEFAULT_GPU, show_default=True, metavar="NAME",
              help="Accelerator for the time and serving section (see `gptcalc gpus`).")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@training_options(with_device=False)
@click.pass_context
def command(ctx: click.Context, model: tuple[GPTConfig, Workload], out_dir: Path, device: str,
            gpu_name: str, quiet: bool, **given) -> None:
    """Analyse a model: counts, conventions, memory, verification, context scaling, plots.

    The memory section and plots assume the training options (default: the family's usual
    set-up; with --device cpu or cuda, that device's kernels)."""
    require("report", "torch", "fvcore", "matplotlib")
    from reports.report import build_report  # torch and matplotlib load only here

    cfg, wl = model
    training = pop_training(given)
    training["device"] = None if device == "auto" else device
    setup = training_setup(cfg, training)
    print_line(assumptions(cfg, wl, setup))
    name = model_name(ctx)
    find_gpu(gpu_name)  # an unknown name fails here, before the slow part
    r = build_report(cfg, wl, out_dir, device=device, name=name, progress=not quiet,
                     gpu=gpu_name, setup=setup)
    f = r.facts
    print_line(f"{name}: {r.facts['params']:,} parameters ({si(f['params'])}); measured on "
               f"{f['device']}; FLOPs per token ~ T^{f['exponent_per_token']:.2f} over the "
               f"sweep, attention part T^{f['exponent_attention']:.2f}, one token without a KV "
               f"cache T^{f['exponent_no_cache']:.2f}")
    print_line(f"wrote {r.markdown}, {r.html} and {len(r.plots)} plots: "
               + ", ".join(p.path.name for p in r.plots))


# options that name the model rather than change it
_SOURCES = ("preset", "sets", "hf_config", "config", "save_config")


def model_name(ctx: click.Context) -> str:
    """The model's name, with the options that changed it: `gpt2 (n_layer=6)`.

    The name is the preset's, else the Hugging Face model's (`_name_or_path`, else the folder
    holding its config.json), else the config file's preset or model, else the default preset."""
    from ..presets import DEFAULT_PRESET
    from .options import MODEL_KEYS

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
    from ..hf import read_hf_json

    raw = read_hf_json(path)
    name = raw.get("_name_or_path")
    if isinstance(name, str) and name.strip():
        return name.strip()
    p = Path(path).resolve()
    return (p if p.is_dir() else p.parent).name or p.stem
