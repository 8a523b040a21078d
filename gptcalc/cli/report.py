"""`gptcalc report`: the whole analysis of a model in one directory (Markdown, HTML, plots)."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import GPTConfig
from ..workload import Workload
from ..gpus import gpu as find_gpu
from ..units import si
from .extras import require
from .options import (assumptions, gpu_option, measure_device_option, model_name,
                      model_options, out_option, pop_training, training_options, training_setup)
from .render import print_line


@click.command("report")
@model_options
@out_option("gptcalc-report", "Directory for report.md, report.html and the PNG plots.")
@measure_device_option("Where the reference model is measured (auto: CUDA if any).")
@gpu_option("Accelerator for the time and serving section (see `gptcalc gpus`).")
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
    setup = training_setup(cfg, training, ctx=ctx)
    print_line(assumptions(cfg, wl, setup))
    name = model_name(ctx)
    find_gpu(gpu_name)  # an unknown name fails here, before the slow part
    r = build_report(cfg, wl, out_dir, device=device, name=name, progress=not quiet,
                     gpu=gpu_name, setup=setup)
    f = r.facts
    tensors = ("real tensors" if f["tensors"] == "real" else
               "SHAPE-ONLY tensors (too slow to run for real here)")
    print_line(f"{name}: {r.facts['params']:,} parameters ({si(f['params'])}); verified on "
               f"{f['device']}, {f['checks_agreeing']} of {f['checks']} checks agree, "
               f"{tensors}; FLOPs per token ~ T^{f['exponent_per_token']:.2f} over the "
               f"sweep, attention part T^{f['exponent_attention']:.2f}, one token without a KV "
               f"cache T^{f['exponent_no_cache']:.2f}")
    print_line(f"wrote {r.markdown}, {r.html} and {len(r.plots)} plots: "
               + ", ".join(p.path.name for p in r.plots))
