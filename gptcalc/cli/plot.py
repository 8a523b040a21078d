"""`gptcalc plot`: the scaling plots of a model as PNG files."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import GPTConfig
from ..workload import Workload
from .extras import require
from .options import (assumptions, model_name, model_options, out_option, pop_training,
                      training_options, training_setup)
from .render import print_line


@click.command("plot")
@model_options
@out_option("gptcalc-plots", "Directory for the PNGs.")
@click.option("--measure", is_flag=True,
              help="Overlay points measured on the reference model (small sizes, CPU).")
@training_options()
@click.pass_context
def command(ctx: click.Context, model: tuple[GPTConfig, Workload], out_dir: Path,
            measure: bool, **given) -> None:
    """Parameters, FLOPs per token, training memory and KV cache vs the sizes that drive them.

    The training memory plot assumes the training options (default: the family's usual
    set-up, printed first)."""
    require("plot", "matplotlib", *(("torch",) if measure else ()))
    from reports import plots  # matplotlib loads only here

    from reports.output import moved, staged_output

    cfg, wl = model
    setup = training_setup(cfg, pop_training(given), ctx=ctx)
    print_line(assumptions(cfg, wl, setup))
    name = model_name(ctx)
    with staged_output(out_dir) as staging:
        made = plots.make_plots(staging, cfg, wl, name, setup=setup)
        if measure:
            made.append(plots.plot_measured(staging, cfg, name))
    for p in (moved(p, staging, out_dir) for p in made):
        print_line(f"{p.path}  {p.title}")
