"""`gptcalc time`: training time for a token budget, and the MFU a measured run achieved."""

from __future__ import annotations

from typing import Any

import click

from ..config import GPTConfig
from ..errors import ConfigError
from ..workload import Workload
from ..flops import RECOMPUTE
from ..gpus import DEFAULT_GPU, gpu as find_gpu
from ..time import (TrainingTime, achieved_mfu, check_positive, parse_count, tokens_per_step,
                    training_time)
from ..units import si
from .options import float_range, describe, model_options
from .render import emit_json, envelope, print_line, print_table


def count_option(*names: str, help: str):
    """An option taking a whole number written 300e9, 3e11 or 300000000000 (parsed exactly)."""
    field = names[0].lstrip("-").replace("-", "_")
    return click.option(*names, default=None, metavar="N", help=help,
                        callback=lambda ctx, p, v: None if v is None else parse_count(v, field))


@click.command("time")
@model_options
@count_option("--tokens", help="Training tokens, e.g. 300e9 (default: 20 per parameter, "
                               "Chinchilla).")
@click.option("--gpu", "gpu_name", default=DEFAULT_GPU, show_default=True, metavar="NAME",
              help="Accelerator (see `gptcalc gpus`).")
@click.option("--gpus", type=int, default=1, show_default=True, help="Number of GPUs.")
@click.option("--mfu", type=float, default=0.4, show_default=True,
              help="Model FLOPs utilisation, in (0, 1]: model FLOP/s over the dense peak.")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16",
              show_default=True, help="Which dense peak of the GPU to use.")
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="none", show_default=True,
              help="Activation recomputation: adds hardware FLOPs (the HFU shown), not model FLOPs.")
@click.option("--tokens-per-second", type=float, default=None,
              help="Measured throughput of the whole job; prints the MFU it achieves.")
@click.option("--seconds-per-step", type=float, default=None,
              help="Measured step time; prints the MFU it achieves (tokens per step below).")
@count_option("--tokens-per-step", help="Tokens per optimizer step (default B x seq_len x gpus: "
                                        "every GPU a data-parallel rank, no accumulation).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@float_range
def command(model: tuple[GPTConfig, Workload], tokens: int | None, gpu_name: str, gpus: int,
            mfu: float, precision: str, recompute: str, tokens_per_second: float | None,
            seconds_per_step: float | None, tokens_per_step: int | None, as_json: bool) -> None:
    """Training time of a token budget at a given MFU, by the exact FLOP count and by the
    published shorthands; with a measured throughput, the MFU achieved."""
    cfg, wl = model
    t = training_time(cfg, wl, tokens, find_gpu(gpu_name), gpus, mfu, precision, recompute)
    measured = _measured(wl, t, tokens_per_second, seconds_per_step, tokens_per_step)
    if as_json:
        emit_json(_json(cfg, wl, t, measured))
        return
    _render(cfg, wl, t, measured)


def _measured(wl: Workload, t: TrainingTime, per_second: float | None, step_s: float | None,
              per_step: int | None) -> dict[str, Any] | None:
    """The achieved MFU of a measured throughput (--tokens-per-second, or --seconds-per-step
    with the tokens of a step), or None when nothing was measured."""
    if per_second is not None and step_s is not None:
        raise ConfigError("tokens_per_second", "give --tokens-per-second or --seconds-per-step, "
                                               "not both")
    if per_step is not None and step_s is None:
        raise ConfigError("tokens_per_step", "needs --seconds-per-step")
    if per_second is None and step_s is None:
        return None
    option = "tokens_per_second" if per_second is not None else "seconds_per_step"
    check_positive(per_second if per_second is not None else step_s, option)
    step_tokens = per_step or tokens_per_step(wl, t.gpus)
    rate = per_second if per_second is not None else step_tokens / step_s
    mfu = achieved_mfu(t.flops_per_token, rate, t.peak_flops, t.gpus)
    if mfu > 1:
        raise ConfigError(option, f"implies an MFU of {mfu:.3f} > 1, which is impossible: check "
                                  "the measurement, the tokens per step and --gpus")
    return {"tokens_per_second": rate, "tokens_per_step": None if step_s is None else step_tokens,
            "achieved_mfu": mfu, "achieved_days": t.flops_total / (
                rate * t.flops_per_token) / 86_400}


def _json(cfg, wl, t: TrainingTime, measured) -> dict[str, Any]:
    return {
        **envelope(cfg, wl), "tokens": t.tokens, "gpu": t.gpu, "gpus": t.gpus,
        "precision": t.precision, "recompute": t.recompute,
        "flops_per_token": t.flops_per_token, "hardware_flops_per_token": t.hardware_flops_per_token,
        "flops_total": t.flops_total, "peak_flops": t.peak_flops, "mfu": t.mfu, "hfu": t.hfu,
        "seconds": t.seconds, "days": t.days, "gpu_hours": t.gpu_hours,
        "conventions": {k: {"flops_per_token": v, "seconds": t.convention_seconds(k),
                            "days": t.convention_seconds(k) / 86_400}
                        for k, v in t.conventions.items()},
        "achieved_mfu": None if measured is None else measured["achieved_mfu"],
        "measured": measured,
    }


def _render(cfg, wl, t: TrainingTime, measured) -> None:
    print_line(f"Assuming {t.gpus:,} x {t.gpu} at its dense {t.precision} peak, MFU {t.mfu:g} "
               f"(model FLOPs), recompute {t.recompute}, {t.tokens:,} tokens")
    print_line(describe(cfg, wl))
    rows = [
        ["model FLOPs per token (exact, forward + backward)", f"{t.flops_per_token:,}",
         si(t.flops_per_token, "FLOP")],
        [f"hardware FLOPs per token (recompute {t.recompute})", f"{t.hardware_flops_per_token:,}",
         si(t.hardware_flops_per_token, "FLOP")],
        ["tokens", f"{t.tokens:,}", si(t.tokens)],
        ["total model FLOPs", f"{t.flops_total:,}", si(t.flops_total, "FLOP")],
        [f"peak per GPU ({t.gpu}, {t.precision}, dense)", f"{t.peak_flops:,.0f}",
         si(t.peak_flops, "FLOP/s")],
        ["GPUs", f"{t.gpus:,}", ""],
        ["MFU (given) / HFU (implied)", f"{t.mfu:.3f} / {t.hfu:.3f}", ""],
        ["time", f"{t.seconds:,.0f} s", f"{t.days:,.2f} days"],
        ["GPU-hours", f"{t.gpu_hours:,.0f} h", ""],
    ]
    print_table("Training time", ["quantity", "value", ""], rows,
                caption="time = model FLOPs / (GPUs x dense peak x MFU)")
    conv = [["exact (gptcalc)", f"{t.flops_per_token:,}", "1.0000", f"{t.days:,.2f}"]] + [
        [k, f"{v:,}", f"{v / t.flops_per_token:.4f}", f"{t.convention_seconds(k) / 86_400:,.2f}"]
        for k, v in t.conventions.items()]
    print_table(f"The same budget by each shorthand, MFU {t.mfu:g}",
                ["rule", "FLOPs / token", "/ exact", "days"], conv)
    if measured is not None:
        step = ("" if measured["tokens_per_step"] is None
                else f" ({measured['tokens_per_step']:,} tokens per step)")
        print_line(f"measured {measured['tokens_per_second']:,.0f} tokens/s{step}: achieved MFU "
                   f"{measured['achieved_mfu']:.3f}; the budget takes "
                   f"{measured['achieved_days']:,.2f} days at that rate")
