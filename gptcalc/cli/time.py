"""`gptcalc time`: one step's time and its parts, a token budget's time, and the MFU a measured
run achieved."""

from __future__ import annotations

from typing import Any

import click

import dataclasses

from ..config import GPTConfig
from ..errors import ConfigError, positive_int
from ..workload import Workload
from ..gpus import gpu as find_gpu
from ..time import (StepTime, TrainingTime, achieved_mfu, check_fraction, check_positive,
                    step_time, training_time)
from ..training_setup import TrainingSetup
from ..units import si
from .options import (assumptions, describe, detail_option, float_range, gpu_option,
                      gpus_option, json_option, mfu_option, model_options, peak_precision_option,
                      pop_training, tokens_option, tokens_per_step_option, training_options,
                      training_setup)
from .render import emit_json, envelope, print_table, print_wrapped


def network_options(command):
    """--gpus-per-node, --intra-node-bandwidth and --inter-node-bandwidth: the two-level network
    the step's collectives run on (default: the --gpu's catalogue entry)."""
    for option in reversed([
        click.option("--node-size", "node_size", type=int, default=None, metavar="N",
                     help="GPUs per node for the time model (default: the --gpu's, e.g. 8)."),
        click.option("--intra-node-bandwidth", type=float, default=None, metavar="GB/S",
                     help="NCCL bus bandwidth within a node in GB/s (default: the --gpu's)."),
        click.option("--inter-node-bandwidth", type=float, default=None, metavar="GB/S",
                     help="Network bandwidth per GPU across nodes in GB/s (default: the "
                          "--gpu's).")]):
        command = option(command)
    return command


def network(node_size: int | None, intra: float | None, inter: float | None
            ) -> tuple[int | None, float | None, float | None]:
    """The network options checked, bandwidths in bytes/s."""
    if node_size is not None:
        positive_int("node_size", node_size)
    for name, value in (("intra_node_bandwidth", intra), ("inter_node_bandwidth", inter)):
        if value is not None:
            check_positive(value, name)
    return node_size, intra and intra * 1e9, inter and inter * 1e9


@click.command("time")
@model_options
@training_options()
@tokens_option("Training tokens, e.g. 300e9 (default: 20 per parameter, Chinchilla).")
@gpu_option()
@gpus_option("Number of GPUs (default: the layout's dp x tp x pp x cp; without --dp, the "
             "data-parallel replicas are --gpus / (tp x pp x cp)).")
@network_options
@mfu_option("Override: a model FLOPs utilisation in (0, 1] (model FLOP/s over the dense peak) "
            "instead of the step model's prediction.")
@peak_precision_option("Which dense peak of the GPU to use (fp8: the blocks' Linears run in "
                       "float8).")
@click.option("--tokens-per-second", type=float, default=None,
              help="Measured throughput of the whole job; prints the MFU it achieves.")
@click.option("--seconds-per-step", type=float, default=None,
              help="Measured step time; prints the MFU it achieves (tokens per step below).")
@tokens_per_step_option("Tokens per optimizer step (default B x grad_accum x seq_len x dp).")
@detail_option("Every figure of the budget and the published shorthands' budgets beside the "
               "exact count.")
@json_option()
@float_range
@click.pass_context
def command(ctx: click.Context, model: tuple[GPTConfig, Workload], tokens: int | None, gpu_name: str,
            gpus: int | None, node_size: int | None, intra_node_bandwidth: float | None,
            inter_node_bandwidth: float | None, mfu: float | None, precision: str,
            tokens_per_second: float | None, seconds_per_step: float | None,
            tokens_per_step: int | None, detail: bool, as_json: bool, **given: Any) -> None:
    """One training step's time as the engines spend it (compute, exposed communication by
    kind, the pipeline bubble), tokens/s and the predicted MFU; the time of a token budget by
    the exact FLOP count and by the published shorthands; with a measured throughput, the MFU
    achieved."""
    cfg, wl = model
    setup = _layout(training_setup(cfg, pop_training(given), ctx=ctx), gpus)
    g = find_gpu(gpu_name)
    node, intra, inter = network(node_size, intra_node_bandwidth, inter_node_bandwidth)
    step = step_time(cfg, setup, wl.batch_size, wl.seq_len, wl.grad_accum, g, precision, node,
                     intra, inter)
    given_mfu = mfu is not None
    mfu = check_fraction(mfu, "mfu") if given_mfu else min(1.0, step.mfu)
    t = training_time(cfg, wl, tokens, g, setup.gpus, mfu, precision, setup.recompute)
    measured = _measured(wl, t, tokens_per_second, seconds_per_step, tokens_per_step,
                         setup.dp)
    view = _step_view(step, given_mfu, mfu)
    if as_json:
        emit_json(_json(cfg, wl, setup, t, step, view, measured))
        return
    _render(cfg, wl, setup, g, t, step, view, measured, detail)


def _layout(setup: TrainingSetup, gpus: int | None) -> TrainingSetup:
    """The set-up with --gpus applied: dp = gpus / (tp x pp x cp) when --dp was not given."""
    if gpus is None:
        return setup
    positive_int("gpus", gpus)
    if gpus == setup.gpus:
        return setup
    inner = setup.tp * setup.pp * setup.cp
    if setup.dp != 1 or gpus % inner:
        raise ConfigError("gpus", f"{gpus:,} GPUs is not the layout's dp x tp x pp x cp = "
                                  f"{setup.gpus:,} (tp x pp x cp = {inner:,}); give one that "
                                  "is, or drop --dp")
    return dataclasses.replace(setup, dp=gpus // inner)


def _step_view(step: StepTime, given: bool, mfu: float) -> dict[str, Any]:
    """The step's seconds, tokens/s and parts: the model's, or at the given MFU (no parts)."""
    if not given:
        return {"step_seconds": step.step_seconds, "tokens_per_second": step.tokens_per_second,
                "mfu": step.mfu, "mfu_source": "predicted", "step_parts": dict(step.parts)}
    seconds = step.model_flops / (step.gpus * step.peak_flops * mfu)
    return {"step_seconds": seconds, "tokens_per_second": step.tokens_per_step / seconds,
            "mfu": mfu, "mfu_source": "given", "step_parts": None}


def _measured(wl: Workload, t: TrainingTime, per_second: float | None, step_s: float | None,
              per_step: int | None, dp: int) -> dict[str, Any] | None:
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
    step_tokens = per_step or wl.batch_size * wl.grad_accum * wl.seq_len * dp
    rate = per_second if per_second is not None else step_tokens / step_s
    mfu = achieved_mfu(t.flops_per_token, rate, t.peak_flops, t.gpus)
    if mfu > 1:
        raise ConfigError(option, f"implies an MFU of {mfu:.3f} > 1, which is impossible: check "
                                  "the measurement, the tokens per step and --gpus")
    return {"tokens_per_second": rate, "tokens_per_step": None if step_s is None else step_tokens,
            "achieved_mfu": mfu, "achieved_days": t.flops_total / (
                rate * t.flops_per_token) / 86_400}


def _collectives(step: StepTime) -> list[dict[str, Any]]:
    return [{"part": x.collective.part, "kind": x.collective.kind, "bytes": x.collective.size,
             "group": x.collective.group, "count": x.collective.count,
             "crosses_nodes": x.collective.crosses_nodes, "seconds": x.seconds}
            for x in step.collectives]


def _json(cfg, wl, setup: TrainingSetup, t: TrainingTime, step: StepTime, view, measured
          ) -> dict[str, Any]:
    return {
        **envelope(cfg, wl, setup), "assumptions": _assumptions(cfg, wl, setup, t, step, view),
        "setup": dataclasses.asdict(setup),
        "tokens": t.tokens, "gpu": t.gpu, "gpus": t.gpus,
        "precision": t.precision, "recompute": t.recompute,
        "flops_per_token": t.flops_per_token, "hardware_flops_per_token": t.hardware_flops_per_token,
        "flops_total": t.flops_total, "peak_flops": t.peak_flops, **view, "hfu": t.hfu,
        "tokens_per_step": step.tokens_per_step, "collectives": _collectives(step),
        "seconds": t.seconds, "days": t.days, "gpu_hours": t.gpu_hours,
        "conventions": {k: {"flops_per_token": v, "seconds": t.convention_seconds(k),
                            "days": t.convention_seconds(k) / 86_400}
                        for k, v in t.conventions.items()},
        "achieved_mfu": None if measured is None else measured["achieved_mfu"],
        "measured": measured,
    }


def _assumptions(cfg, wl, setup: TrainingSetup, t: TrainingTime, step: StepTime, view) -> str:
    how = ("MFU given" if view["mfu_source"] == "given" else
           "step time predicted op by op (compute on the roofline, collectives on the "
           "two-level network, overlap and bubble)")
    return (f"{assumptions(cfg, wl, setup)}; "
            f"{t.gpus:,} x {t.gpu} at its dense {t.precision} peak; {how}; {t.tokens:,} tokens")


def _render(cfg, wl, setup: TrainingSetup, g, t: TrainingTime, step: StepTime, view,
            measured, detail: bool) -> None:
    """The step and the budget's time on one screen; `detail`: every figure of the budget and
    the published shorthands' budgets."""
    print_wrapped(_assumptions(cfg, wl, setup, t, step, view))
    print_wrapped(describe(cfg, wl))
    rows = [["step", f"{view['step_seconds']:,.3f} s", ""]]
    if view["step_parts"]:
        rows += [[f"  {k}", f"{v:,.3f} s", f"{v / view['step_seconds']:.1%}"]
                 for k, v in view["step_parts"].items() if v]
    rows += [["tokens per step", f"{step.tokens_per_step:,}", ""],
             ["tokens/s", f"{view['tokens_per_second']:,.0f}",
              f"{view['tokens_per_second'] / t.gpus:,.0f} per GPU"],
             [f"MFU ({view['mfu_source']})", f"{view['mfu']:.3f}", ""]]
    if detail:
        print_table("One step", ["quantity", "value", "share"], rows,
                    caption="exposed communication only: what compute does not hide")
        _render_budget(t)
    else:
        print_table(None, ["one step (communication: exposed only)", "value", "share"], rows,
                    edge=False)
        print_wrapped(f"Budget: {t.tokens:,} tokens at {t.flops_per_token:,} FLOPs a token, "
                      f"MFU {t.mfu:.3f}, {t.gpus:,} x {t.gpu}: "
                      f"{t.days:,.2f} days, {t.gpu_hours:,.0f} GPU-hours (--detail: more)")
    if measured is not None:
        step_text = ("" if measured["tokens_per_step"] is None
                     else f" ({measured['tokens_per_step']:,} tokens per step)")
        print_wrapped(f"measured {measured['tokens_per_second']:,.0f} tokens/s{step_text}: "
                      f"achieved MFU {measured['achieved_mfu']:.3f}; the budget takes "
                      f"{measured['achieved_days']:,.2f} days at that rate")


def _render_budget(t: TrainingTime) -> None:
    """The token budget's time, each figure, and the same budget by each shorthand."""
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
        ["MFU / HFU (implied)", f"{t.mfu:.3f} / {t.hfu:.3f}", ""],
        ["time", f"{t.seconds:,.0f} s", f"{t.days:,.2f} days"],
        ["GPU-hours", f"{t.gpu_hours:,.0f} h", ""],
    ]
    print_table("Training time", ["quantity", "value", ""], rows,
                caption="time = model FLOPs / (GPUs x dense peak x MFU)")
    conv = [["exact (gptcalc)", f"{t.flops_per_token:,}", "1.0000", f"{t.days:,.2f}"]] + [
        [k, f"{v:,}", f"{v / t.flops_per_token:.4f}", f"{t.convention_seconds(k) / 86_400:,.2f}"]
        for k, v in t.conventions.items()]
    print_table(f"The same budget by each shorthand, MFU {t.mfu:.3f}",
                ["rule", "FLOPs / token", "/ exact", "days"], conv)
