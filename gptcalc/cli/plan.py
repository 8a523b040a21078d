"""`gptcalc plan`: the parallel layouts that fit a GPU, fastest first, each with the
`gptcalc memory` command that reproduces its peak. One screen by default: the answer and its
assumptions first, a short ranked table, the command that reproduces the answer; `--detail`
adds the full table, every plan's command and the fewest GPUs that fit."""

from __future__ import annotations

import functools
import shlex
import textwrap
from typing import Any, Callable

import click

from ..config import GPTConfig
from ..errors import ConfigError
from ..memory.engines import names
from ..gpus import gpu as find_gpu, require_peak, usable_memory
from ..plan import (DEFAULT_MAX_EVALUATIONS, DEFAULT_MAX_GPUS, TIE_RULE, Layout, Plan,
                    PlanSearch, global_batch as sequences, layout_setup, search)
from ..schema import MODEL_OPTIONS, OPTIONS
from ..time import check_positive
from ..training import resolve_training
from ..units import binary_bytes
from ..workload import Workload
from .options import (MODEL_KEYS, click_option, count_option, current_recipe, describe,
                      detail_option, gpu_option, gpus_option, json_option, mfu_option,
                      model_options, peak_precision_option, setup_source, tokens_option,
                      tokens_per_step_option)
from .render import emit_json, envelope, print_line, print_table

# the training options a plan keeps as given (its layout, recomputation and micro-batch are
# the planner's)
KEPT = ("mode", "optimizer", "autocast_dtype", "attn", "impl", "overhead", "lora_rank",
        "lora_targets", "weights_dtype")
# model options the planner sets itself, or that write files
_PLANNED = ("batch_size", "grad_accum", "seq_len", "save_config")
SHORT_TOP = 5  # plans the default screen lists
DEFAULT_TOP = 10  # plans --detail and --json list
SCREEN = 80  # columns of the default screen


def _typed_model_options(command: Callable) -> Callable:
    """Hand the command the model options as given (`typed`, by keyword) beside the resolved
    model: the commands that reproduce a plan repeat them."""
    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        return command(**kwargs, typed={k: kwargs.get(k) for k in MODEL_KEYS})
    return wrapper


def _kept_options(command):
    for name in reversed(KEPT):
        command = click_option(OPTIONS[name])(command)
    return command


@click.command("plan")
@_typed_model_options
@model_options
@gpu_option("Accelerator (see `gptcalc gpus`): its usable memory (what "
            "torch.cuda.mem_get_info reports) and dense peak.")
@click_option(OPTIONS["gpu_memory"], help="Memory per GPU, e.g. 80GiB (default: the --gpu's).")
@count_option("--global-batch", help="Sequences per optimizer step (default: 4M tokens' worth, "
                                     "2^22 / seq-len).")
@tokens_per_step_option("Tokens per optimizer step, a multiple of --seq-len.")
@click.option("--max-gpus", type=int, default=DEFAULT_MAX_GPUS, show_default=True,
              help="Largest GPU count to plan for.")
@gpus_option("Plan for exactly this many GPUs: its layouts, fastest first.")
@tokens_option("With --days: the training tokens to finish; the plan is the fewest GPUs whose "
               "step time finishes them in time.")
@click.option("--days", type=float, default=None,
              help="With --tokens: the days the training may take.")
@click.option("--max-evaluations", type=int, default=DEFAULT_MAX_EVALUATIONS,
              show_default=True, help="Bound on the step peaks the search computes; past it "
                                      "the search stops and says so.")
@click.option("--engines", default=None, metavar="LIST",
              help="Engines to plan with, e.g. fsdp2,megatron (default: every engine; see "
                   "`--engine` of `gptcalc memory`).")
@click.option("--top", type=int, default=None,
              help=f"Plans to list (default: {SHORT_TOP} on screen, {DEFAULT_TOP} with --detail "
                   "or --json).")
@detail_option("Every plan listed with its command, the fewest GPUs that fit, what was searched "
               "and the tie rule.")
@mfu_option("Override: a utilisation of the dense peak by the FLOPs a step executes "
            "(recomputation included), in (0, 1], instead of the step model (`gptcalc time`'s "
            "compute, communication and bubble).")
@peak_precision_option()
@_kept_options
@json_option("Machine-readable output (bytes, seconds).")
@click.pass_context
def command(ctx: click.Context, model: tuple[GPTConfig, Workload], gpu_name: str,
            gpu_memory: int | None, global_batch: int | None, tokens_per_step: int | None,
            max_gpus: int, gpus: int | None, tokens: int | None, days: float | None,
            max_evaluations: int, engines: str | None, top: int | None, detail: bool,
            mfu: float | None, precision: str, as_json: bool, typed: dict[str, Any],
            **given: Any) -> None:
    """The data, tensor, pipeline and context layouts, engines and recomputation that fit a
    training step in each GPU's memory, ranked by step time (`gptcalc time`'s model); each with
    the `gptcalc memory` command that reproduces its peak. One screen: the answer first, the
    five fastest; --detail: ten, every command, the fewest GPUs. --gpus N: the layouts of N
    GPUs; --tokens T --days D: the fewest GPUs that finish T tokens in D days."""
    cfg, wl = model
    options = _given_model(typed, current_recipe(ctx))
    source = setup_source(ctx)
    _refuse_workload(options)
    g = find_gpu(gpu_name)
    require_peak(g, precision)
    budget = gpu_memory if gpu_memory is not None else usable_memory(g)
    batch = sequences(wl.seq_len, global_batch, tokens_per_step)
    deadline = _deadline(tokens, days, batch * wl.seq_len)
    kept = {k: v for k, v in given.items() if v is not None}

    def setup_for(layout: Layout):
        return layout_setup(cfg, layout, kept, source.sections, source.from_hf)

    resolve_training(cfg, source.sections, kept, source.from_hf)  # a bad option fails here, by name
    full = detail or as_json  # the whole answer, not one screen's
    listed = top if top is not None else DEFAULT_TOP if full else SHORT_TOP
    found = search(cfg, wl.seq_len, batch, budget, g, precision, mfu, max_gpus, top=listed,
                   setup_for=setup_for, lora=bool(kept.get("lora_rank")),
                   engines=_engines(engines), gpus=gpus, max_step_seconds=deadline,
                   order="gpus" if deadline is not None else "time",
                   max_evaluations=max_evaluations, judged=True, fewest=full)
    line = _assumptions(g.name, budget, precision, mfu, batch, wl.seq_len, max_gpus, gpus,
                        tokens, days)
    device = ["--gpu-memory", _size(gpu_memory)] if gpu_memory is not None else ["--gpu", g.name]

    def command_of(plan: Plan) -> str:
        return _command(plan, wl.seq_len, device, kept, options)
    commands = [command_of(p) for p in found.plans]
    fewest = found.fewest
    if as_json:
        emit_json(_json(cfg, wl.seq_len, batch, budget, line, found, commands, fewest,
                        None if fewest is None else command_of(fewest)))
        return
    answer = _answer(cfg, budget, max_gpus, line, found, gpus, deadline is not None)
    if detail:
        _render(answer, found, commands, fewest, deadline is not None)
    else:
        _screen(answer, found, commands)


def _deadline(tokens: int | None, days: float | None, step_tokens: int) -> float | None:
    """The longest step time that finishes `tokens` in `days` (both given, or neither)."""
    if (tokens is None) != (days is None):
        raise ConfigError("days" if days is None else "tokens",
                          "give --tokens and --days together")
    if tokens is None:
        return None
    check_positive(days, "days")
    return days * 86_400 * step_tokens / tokens


def _given_model(typed: dict[str, Any], current: tuple[Any, dict[str, Any]] | None
                 ) -> dict[str, Any]:
    """The model options as given: typed, or filled from the --recipe's files (`current`,
    the command's recipe and the options typed beside it) where not typed."""
    if current is None:
        return typed
    from ..recipes import apply_recipe

    recipe, given = current
    filled = apply_recipe(recipe, given)
    return {k: filled.get(k, v) for k, v in typed.items()}


def _refuse_workload(options: dict[str, Any]) -> None:
    for key in ("batch_size", "grad_accum"):
        if options.get(key) is not None:
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


def _model_args(options: dict[str, Any]) -> list[str]:
    """The model options as given (`_given_model`), for the command that re-runs a plan."""
    out: list[str] = []
    for name in MODEL_OPTIONS:
        opt = OPTIONS[name]
        value = options.get(opt.keyword)
        if name in _PLANNED or value is None or value == ():
            continue
        for item in (value if opt.multiple else (value,)):
            out += [opt.cli, str(item)]
    return out


def _size(n: int) -> str:
    return f"{n // 2**30}GiB" if n % 2**30 == 0 else f"{n}B"


def _command(plan: Plan, seq_len: int, device: list[str], kept: dict[str, Any],
             options: dict[str, Any]) -> str:
    """`gptcalc memory ...` with every setting of the plan spelt out; `options`: the model
    options as given."""
    lay = plan.layout
    args = ["gptcalc", "memory", *_model_args(options), "--seq-len", str(seq_len),
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
    elif options.get("config"):
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
            "mfu": plan.mfu, "must_hold": plan.must_hold}


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
    return [str(i), f"{p.gpus:,}", _shape(lay),
            _engine(lay), lay.recompute, f"{p.micro_batch} x {p.grad_accum}",
            binary_bytes(p.peak), f"{p.step_seconds:,.2f}", f"{p.tokens_per_second:,.0f}"]


def _seconds(s: float) -> str:
    """Seconds to three significant figures at least (a small model's step is milliseconds)."""
    return f"{s:,.0f}" if s >= 100 else f"{s:.2f}" if s >= 1 else f"{s:.3g}"


def _shape(lay: Layout) -> str:
    """dp x tp x pp (x cp), sp and interleaved chunks: how the table writes a layout."""
    return f"{lay.dp} x {lay.tp} x {lay.pp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "") + (
        " sp" if lay.sp else "") + (f" v{lay.virtual}" if lay.virtual > 1 else "")


def _words(lay: Layout) -> str:
    """The layout in words, for the answer's sentence."""
    parts = [f"dp {lay.dp}", f"tp {lay.tp}" + (" (sp)" if lay.sp else ""),
             f"pp {lay.pp}" + (f" ({lay.schedule}, {lay.virtual} chunks a stage)"
                               if lay.virtual > 1 else "")]
    return " x ".join(parts + ([f"cp {lay.cp}"] if lay.cp > 1 else []))


def _answer(cfg: GPTConfig, budget: int, max_gpus: int, line: str, found: PlanSearch,
            gpus: int | None, deadline: bool) -> str:
    """The answer, then the assumptions it rests on: the first paragraph of the text."""
    if found.plans:
        p = found.plans[0]
        what = ("Fewest GPUs that finish in time" if deadline else
                f"Fastest on {gpus:,} GPUs" if gpus else "Fastest that fits")
        held = "" if p.must_hold is None else (
            f", {binary_bytes(p.must_hold)} to hold of {binary_bytes(budget)} (margin "
            f"{binary_bytes(budget - p.must_hold)})")
        head = (f"{what}: {p.gpus:,} GPUs as {_words(p.layout)}, {_engine(p.layout)}, "
                f"recompute {p.layout.recompute}, micro-batch {p.micro_batch}, accumulation "
                f"{p.grad_accum}: {_seconds(p.step_seconds)} s per step, "
                f"{p.tokens_per_second:,.0f} tokens/s, peak {binary_bytes(p.peak)} per "
                f"GPU{held}.")
    else:
        c = found.closest
        near = "" if c is None else (
            f"; closest: {c.layout.gpus:,} GPUs, dp {c.layout.dp} x tp {c.layout.tp} x pp "
            f"{c.layout.pp}, {_engine(c.layout)}, recompute {c.layout.recompute}, micro-batch "
            f"{c.micro_batch} x {c.grad_accum}: peak {binary_bytes(c.peak)}, "
            f"{binary_bytes(c.peak - budget)} over")
        what = "finishes in time" if deadline else f"fits {binary_bytes(budget)} per GPU"
        head = f"No layout {what} within {max_gpus:,} GPUs{near}."
    return f"{head} {line}; model {describe(cfg)}."


def _print_wrapped(text: str, width: int = SCREEN) -> None:
    for piece in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False):
        print_line(piece)


def _print_command(label: str, command: str, width: int = SCREEN) -> None:
    """A shell command over lines of at most `width` columns, continued with a backslash; an
    option stays on the line of its value."""
    words: list[str] = []
    for word in shlex.split(command):
        quoted = shlex.quote(word)
        if words and words[-1].startswith("-") and not word.startswith("-"):
            words[-1] += " " + quoted
        else:
            words.append(quoted)
    lines, current = [], label.rstrip()
    for word in words:
        if len(current) + 1 + len(word) > width - 2 and current.strip():
            lines.append(current + " \\")
            current = "   "
        current += " " + word
    for text in [*lines, current]:
        print_line(text)


def _short_table(plans: list[Plan], width: int = SCREEN) -> list[str]:
    """The ranked plans as plain columns within `width`: the layout, engine, recomputation,
    micro-batch, peak and step time (tokens per second are the step's tokens over it)."""
    head = ["#", "GPUs", "dp x tp x pp", "engine", "recompute", "B x acc", "peak GiB",
            "step s"]
    rows = [[str(i), f"{p.gpus:,}", _shape(p.layout), _engine(p.layout), p.layout.recompute,
             f"{p.micro_batch}x{p.grad_accum}", f"{p.peak / 2**30:.2f}",
             _seconds(p.step_seconds)] for i, p in enumerate(plans, 1)]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    gap = 2 if sum(widths) + 2 * (len(widths) - 1) <= width else 1
    left = {2, 3, 4}  # text columns; numbers to the right

    def fmt(row: list[str]) -> str:
        return (" " * gap).join(c.ljust(w) if i in left else c.rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return [fmt(head), *map(fmt, rows)]


def _capped(found: PlanSearch) -> str:
    return (f"The search stopped after {found.evaluations:,} step peaks (--max-evaluations): "
            "the plans below are the best found before it, not necessarily the best")


def _screen(answer: str, found: PlanSearch, commands: list[str]) -> None:
    """One screen of at most 80 columns: the answer and its assumptions, the ranked plans,
    the command that reproduces the first, and what --detail adds."""
    _print_wrapped(answer)
    if found.capped:
        _print_wrapped(_capped(found))
    if not found.plans:
        return
    for text in _short_table(found.plans):
        print_line(text)
    _print_command("#1:", commands[0])
    _print_wrapped("--detail: every plan's command, the fewest GPUs that fit, the search's "
                   "size and its tie rule")


def _render(answer: str, found: PlanSearch, commands: list[str], fewest: Plan | None,
            deadline: bool) -> None:
    """--detail: the answer, the full table with every plan's command, the fewest GPUs."""
    _print_wrapped(answer)
    if found.capped:
        print_line(_capped(found))
    if not found.plans:
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
