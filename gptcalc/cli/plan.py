"""`gptcalc plan`: the parallel layouts that fit a GPU, fastest first, each with the
`gptcalc memory` command that reproduces its peak."""

from __future__ import annotations

import shlex
from typing import Any

import click

from ..config import GPTConfig
from ..errors import ConfigError
from ..memory.engines import names
from ..gpus import DEFAULT_GPU, gpu as find_gpu, require_peak, usable_memory
from ..plan import (DEFAULT_MAX_EVALUATIONS, DEFAULT_MAX_GPUS, TIE_RULE, Layout, Plan,
                    PlanSearch, global_batch as sequences, layout_setup, search)
from ..schema import MODEL_OPTIONS, OPTIONS
from ..time import check_positive, parse_count
from ..training import resolve_training
from ..units import binary_bytes
from ..workload import Workload
from .options import ByteSize, click_option, config_section, current_setup, describe, model_options
from .render import emit_json, envelope, print_line, print_table

# the training options a plan keeps as given (its layout, recomputation and micro-batch are
# the planner's)
KEPT = ("mode", "optimizer", "autocast_dtype", "attn", "impl", "overhead", "lora_rank",
        "lora_targets", "weights_dtype")
# model options the planner sets itself, or that write files
_PLANNED = ("batch_size", "grad_accum", "seq_len", "save_config")


def _count(name: str, help: str):
    field = name.lstrip("-").replace("-", "_")
    return click.option(name, default=None, metavar="N", help=help,
                        callback=lambda ctx, p, v: None if v is None else parse_count(v, field))


def _kept_options(command):
    for name in reversed(KEPT):
        command = click_option(OPTIONS[name])(command)
    return command


@click.command("plan")
@model_options
@click.option("--gpu", "gpu_name", default=DEFAULT_GPU, show_default=True, metavar="NAME",
              help="Accelerator (see `gptcalc gpus`): its usable memory (what "
                   "torch.cuda.mem_get_info reports) and dense peak.")
@click.option("--gpu-memory", type=ByteSize(), default=None, metavar="SIZE",
              help="Memory per GPU, e.g. 80GiB (default: the --gpu's).")
@_count("--global-batch", "Sequences per optimizer step (default: 4M tokens' worth, "
                          "2^22 / seq-len).")
@_count("--tokens-per-step", "Tokens per optimizer step, a multiple of --seq-len.")
@click.option("--max-gpus", type=int, default=DEFAULT_MAX_GPUS, show_default=True,
              help="Largest GPU count to plan for.")
@click.option("--gpus", type=int, default=None,
              help="Plan for exactly this many GPUs: its layouts, fastest first.")
@_count("--tokens", "With --days: the training tokens to finish; the plan is the fewest GPUs "
                    "whose step time finishes them in time.")
@click.option("--days", type=float, default=None,
              help="With --tokens: the days the training may take.")
@click.option("--max-evaluations", type=int, default=DEFAULT_MAX_EVALUATIONS,
              show_default=True, help="Bound on the step peaks the search computes; past it "
                                      "the search stops and says so.")
@click.option("--engines", default=None, metavar="LIST",
              help="Engines to plan with, e.g. fsdp2,megatron (default: every engine; see "
                   "`--engine` of `gptcalc memory`).")
@click.option("--top", type=int, default=10, show_default=True, help="Plans to list.")
@click.option("--mfu", type=float, default=None,
              help="Override: a utilisation of the dense peak by the FLOPs a step executes "
                   "(recomputation included), in (0, 1], instead of the step model (`gptcalc "
                   "time`'s compute, communication and bubble).")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16",
              show_default=True, help="Which dense peak of the GPU to use.")
@_kept_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (bytes, seconds).")
def command(model: tuple[GPTConfig, Workload], gpu_name: str, gpu_memory: int | None,
            global_batch: int | None, tokens_per_step: int | None, max_gpus: int,
            gpus: int | None, tokens: int | None, days: float | None, max_evaluations: int,
            engines: str | None, top: int, mfu: float | None, precision: str, as_json: bool,
            **given: Any) -> None:
    """The data, tensor, pipeline and context layouts, engines and recomputation that fit a
    training step in each GPU's memory, ranked by step time (`gptcalc time`'s model); each with
    the `gptcalc memory` command that reproduces its peak. --gpus N: the layouts of N GPUs;
    --tokens T --days D: the fewest GPUs that finish T tokens in D days."""
    cfg, wl = model
    _refuse_workload()
    g = find_gpu(gpu_name)
    require_peak(g, precision)
    budget = gpu_memory if gpu_memory is not None else usable_memory(g)
    batch = sequences(wl.seq_len, global_batch, tokens_per_step)
    deadline = _deadline(tokens, days, batch * wl.seq_len)
    kept = {k: v for k, v in given.items() if v is not None}

    def setup_for(layout: Layout):
        return layout_setup(cfg, layout, kept, _sections(), _from_hf())

    resolve_training(cfg, _sections(), kept, _from_hf())  # a bad option fails here, by name
    found = search(cfg, wl.seq_len, batch, budget, g, precision, mfu, max_gpus, top=top,
                   setup_for=setup_for, lora=bool(kept.get("lora_rank")),
                   engines=_engines(engines), gpus=gpus, max_step_seconds=deadline,
                   order="gpus" if deadline is not None else "time",
                   max_evaluations=max_evaluations, judged=True)
    line = _assumptions(g.name, budget, precision, mfu, batch, wl.seq_len, max_gpus, gpus,
                        tokens, days)
    device = ["--gpu-memory", _size(gpu_memory)] if gpu_memory is not None else ["--gpu", g.name]
    commands = [_command(p, wl.seq_len, device, kept) for p in found.plans]
    fewest = found.fewest
    if as_json:
        emit_json(_json(cfg, wl.seq_len, batch, budget, line, found, commands, fewest,
                        None if fewest is None else _command(fewest, wl.seq_len, device, kept)))
        return
    _render(cfg, budget, max_gpus, line, found, commands, fewest, deadline is not None)


def _deadline(tokens: int | None, days: float | None, step_tokens: int) -> float | None:
    """The longest step time that finishes `tokens` in `days` (both given, or neither)."""
    if (tokens is None) != (days is None):
        raise ConfigError("days" if days is None else "tokens",
                          "give --tokens and --days together")
    if tokens is None:
        return None
    check_positive(days, "days")
    return days * 86_400 * step_tokens / tokens


def _refuse_workload() -> None:
    params = click.get_current_context().params
    for key in ("batch_size", "grad_accum"):
        if params.get(key) is not None:
            raise ConfigError(key, "the planner chooses the micro-batch and the accumulation; "
                                   "give the global batch (--global-batch or --tokens-per-step)")


def _engines(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    chosen = tuple(n.strip() for n in text.split(",") if n.strip())
    if not chosen:
        raise ConfigError("engines", "give at least one engine, e.g. fsdp2")
    unknown = [n for n in chosen if n not in names()]
    if unknown:
        raise ConfigError("engines", f"unknown engine {unknown[0]!r}; engines: "
                                     f"{', '.join(names())}")
    return chosen


def _sections() -> dict[str, Any]:
    return {k: config_section(k) for k in ("training", "parallel")}


def _from_hf() -> bool:
    s = current_setup()
    return bool(s and s.from_hf)


def _model_args() -> list[str]:
    """The model options as typed, for the command that re-runs a plan."""
    params = click.get_current_context().params
    out: list[str] = []
    for name in MODEL_OPTIONS:
        opt = OPTIONS[name]
        value = params.get(opt.keyword)
        if name in _PLANNED or value is None or value == ():
            continue
        for item in (value if opt.multiple else (value,)):
            out += [opt.cli, str(item)]
    return out


def _size(n: int) -> str:
    return f"{n // 2**30}GiB" if n % 2**30 == 0 else f"{n}B"


def _command(plan: Plan, seq_len: int, device: list[str], kept: dict[str, Any]) -> str:
    """`gptcalc memory ...` with every setting of the plan spelt out."""
    lay = plan.layout
    args = ["gptcalc", "memory", *_model_args(), "--seq-len", str(seq_len),
            "-B", str(plan.micro_batch), "--grad-accum", str(plan.grad_accum),
            "--dp", str(lay.dp), "--tp", str(lay.tp), "--pp", str(lay.pp),
            "--zero", str(lay.zero), "--engine", lay.engine, "--recompute", lay.recompute,
            "--mode", plan.setup.mode]
    if lay.cp > 1:
        args += ["--cp", str(lay.cp)]
    if lay.schedule != "1f1b":
        args += ["--pp-schedule", lay.schedule, "--pp-virtual", str(lay.virtual)]
    if lay.sp:
        args.append("--sp")
    elif click.get_current_context().params.get("config"):
        args.append("--no-sp")  # a config file's [parallel] sp must not turn it on
    for name in KEPT:
        if name != "mode" and name in kept:
            value = kept[name]
            args += [OPTIONS[name].cli, _size(value) if name == "overhead" and value else
                     str(value)]
    return shlex.join(args + device)


def _assumptions(gpu: str, budget: int, precision: str, mfu: float | None, batch: int,
                 seq_len: int, max_gpus: int, gpus: int | None, tokens: int | None,
                 days: float | None) -> str:
    timing = (f"step time at MFU {mfu:g} of the FLOPs a step executes (recomputation "
              "included) with the 1F1B bubble, no communication" if mfu is not None else
              "step time as `gptcalc time` predicts it (compute op by op, exposed "
              "communication on the card's two-level network, the bubble)")
    count = f"exactly {gpus:,} GPUs" if gpus else f"at most {max_gpus:,} GPUs"
    goal = "" if tokens is None else (f"; the fewest GPUs that train {tokens:,} tokens in "
                                      f"{days:g} days")
    return (f"Assuming {gpu} with {binary_bytes(budget)} per GPU at its dense {precision} "
            f"peak; {timing}; a plan fits when reserved memory, the CUDA context and NCCL's "
            f"buffers fit, as `gptcalc memory` judges it; global batch {batch:,} sequences of "
            f"{seq_len:,} tokens "
            f"({batch * seq_len:,} tokens per step); {count}, tp within a node of 8{goal}")


def _engine(layout: Layout) -> str:
    return f"{layout.engine} ZeRO-{layout.zero}" if layout.zero else layout.engine


def plan_json(plan: Plan, command: str) -> dict[str, Any]:
    """One plan as `gptcalc plan --json` lists it."""
    lay = plan.layout
    return {"command": command, "gpus": plan.gpus, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
            "cp": lay.cp, "pp_schedule": lay.schedule, "pp_virtual": lay.virtual,
            "sp": lay.sp, "zero": lay.zero, "engine": lay.engine, "mode": plan.setup.mode,
            "recompute": lay.recompute, "micro_batch": plan.micro_batch,
            "grad_accum": plan.grad_accum, "peak": plan.peak,
            "step_seconds": plan.step_seconds, "tokens_per_second": plan.tokens_per_second,
            "mfu": plan.mfu}


def _json(cfg, seq_len, batch, budget, line, found: PlanSearch, commands, fewest, fewest_cmd):
    closest = found.closest
    return {**envelope(cfg), "assumptions": line, "seq_len": seq_len, "global_batch": batch,
            "tokens_per_step": batch * seq_len, "budget": budget,
            "plans": [plan_json(p, c) for p, c in zip(found.plans, commands)],
            "fewest_gpus": None if fewest is None else plan_json(fewest, fewest_cmd),
            "closest": None if closest is None else {
                "gpus": closest.layout.gpus, "dp": closest.layout.dp, "tp": closest.layout.tp,
                "pp": closest.layout.pp, "sp": closest.layout.sp, "zero": closest.layout.zero,
                "engine": closest.layout.engine, "recompute": closest.layout.recompute,
                "micro_batch": closest.micro_batch, "grad_accum": closest.grad_accum,
                "peak": closest.peak},
            "searched": {"layouts": found.layouts, "step_peaks": found.evaluations,
                         "capped": found.capped}, "tie_rule": TIE_RULE}


def _row(i: int, p: Plan) -> list[str]:
    lay = p.layout
    shape = f"{lay.dp} x {lay.tp} x {lay.pp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "") + (
        " sp" if lay.sp else "") + (f" v{lay.virtual}" if lay.virtual > 1 else "")
    return [str(i), f"{p.gpus:,}", shape,
            _engine(lay), lay.recompute, f"{p.micro_batch} x {p.grad_accum}",
            binary_bytes(p.peak), f"{p.step_seconds:,.2f}", f"{p.tokens_per_second:,.0f}"]


def _render(cfg, budget, max_gpus, line, found: PlanSearch, commands, fewest,
            deadline: bool) -> None:
    print_line(line)
    print_line(describe(cfg))
    if found.capped:
        print_line(f"The search stopped after {found.evaluations:,} step peaks "
                   "(--max-evaluations): the plans below are the best found before it, not "
                   "necessarily the best")
    if not found.plans:
        c = found.closest
        near = "" if c is None else (
            f"; closest: {c.layout.gpus:,} GPUs, dp {c.layout.dp} x tp {c.layout.tp} x pp "
            f"{c.layout.pp}, {_engine(c.layout)}, recompute {c.layout.recompute}, micro-batch "
            f"{c.micro_batch} x {c.grad_accum}: peak {binary_bytes(c.peak)}, "
            f"{binary_bytes(c.peak - budget)} over")
        what = "finishes in time" if deadline else f"fits {binary_bytes(budget)} per GPU"
        print_line(f"No layout {what} within {max_gpus:,} GPUs{near}")
        return
    title = ("Layouts that finish in time, fewest GPUs first" if deadline else
             "Layouts that fit, fastest first")
    print_table(title,
                ["#", "GPUs", "dp x tp x pp", "engine", "recompute", "B x accum", "peak / GPU",
                 "step s", "tokens/s"],
                [_row(i, p) for i, p in enumerate(found.plans, 1)],
                caption=f"{found.layouts:,} layouts searched, {found.evaluations:,} step peaks "
                        f"computed; {TIE_RULE}")
    for i, c in enumerate(commands, 1):
        print_line(f"{i}: {c}")
    if fewest is not None:
        lay = fewest.layout
        print_line(f"Fewest GPUs: {fewest.gpus:,} (dp {lay.dp} x tp {lay.tp} x pp {lay.pp}"
                   f"{f' x cp {lay.cp}' if lay.cp > 1 else ''}, {_engine(lay)}, recompute "
                   f"{lay.recompute}, micro-batch {fewest.micro_batch} x {fewest.grad_accum}), "
                   f"peak {binary_bytes(fewest.peak)}, {fewest.step_seconds:,.2f} s per step")
