"""`gptcalc memory`: bytes per device of weights, gradients, optimizer, activations, the peak."""

from __future__ import annotations

import click

from ..config import ConfigError, GPTConfig, Workload
from ..memory import (ATTN_IMPLS, AUTOCAST_DTYPES, MODES, OPTIMIZERS, RECOMPUTE, MemoryReport,
                      TrainingSetup, max_batch, max_context, memory_report)
from ..units import binary_bytes, parse_bytes
from .options import describe, model_options, section_settings
from .render import emit_json, model_json, print_line, print_table


@click.command("memory")
@model_options
@click.option("--mode", type=click.Choice(MODES), default=None,
              help="Precision: fp32 (default), amp (fp32 states, 16-bit autocast), mixed (ZeRO's "
                   "2+2+12), bf16 (pure).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None,
              help="adamw (default), sgd, sgd-momentum.")
@click.option("--autocast-dtype", type=click.Choice(AUTOCAST_DTYPES), default=None,
              help="16-bit dtype of amp and mixed (default bf16).")
@click.option("--recompute", type=click.Choice(RECOMPUTE), default=None, help="Default none.")
@click.option("--attn", type=click.Choice(ATTN_IMPLS), default=None, help="Default manual.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Kernels differ in what they save (LayerNorm stats dtype, AdamW path); "
                   "default cpu, where the formulas are measured exactly.")
@click.option("--zero", type=int, default=None, help="ZeRO stage 0-3 (default 0).")
@click.option("--dp", type=int, default=None, help="Data-parallel replicas (default 1).")
@click.option("--tp", type=int, default=None, help="Tensor-parallel ranks (default 1).")
@click.option("--pp", type=int, default=None, help="Pipeline stages (default 1).")
@click.option("--sp/--no-sp", default=None, help="Sequence parallel (with tp).")
@click.option("--gpu-memory", default=None, metavar="SIZE",
              help="Budget per device, e.g. 80GiB: prints the largest batch and context that fit.")
@click.option("--context", type=int, default=None, help="KV-cache context (default seq-len).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (bytes).")
def command(model: tuple[GPTConfig, Workload], gpu_memory, context, as_json, **given) -> None:
    """Memory per device of one training step, exact where PyTorch is measured (DESIGN.md).

    Settings not given as options come from the --config file's [training] and [parallel]
    tables, and --save-config writes them there."""
    cfg, wl = model
    setup = _setup(given)
    rep = memory_report(cfg, wl, setup, context)
    fit = None
    if gpu_memory is not None:
        try:
            budget = parse_bytes(gpu_memory)
        except ValueError as e:
            raise ConfigError("gpu_memory", str(e)) from None
        fit = {"budget": budget, "max_batch": max_batch(cfg, wl.seq_len, setup, budget),
               "max_context": max_context(cfg, wl.batch_size // setup.dp, setup, budget)}
    if as_json:
        emit_json(_json(cfg, wl, setup, rep, fit))
        return
    _render(cfg, wl, setup, rep, fit)


TRAINING_DEFAULTS = {"mode": "fp32", "optimizer": "adamw", "autocast_dtype": "bf16",
                     "recompute": "none", "attn": "manual", "device": "cpu"}
PARALLEL_DEFAULTS = {"zero": 0, "dp": 1, "tp": 1, "pp": 1, "sp": False}


def _setup(given: dict) -> TrainingSetup:
    training, filed = section_settings("training", given, TRAINING_DEFAULTS)
    parallel, filed_p = section_settings("parallel", given, PARALLEL_DEFAULTS)
    try:
        return TrainingSetup(attn_impl=training.pop("attn"), **training, **parallel)
    except ConfigError as e:
        key = "attn" if e.field == "attn_impl" else e.field
        if key in filed | filed_p:  # the bad value came from the file, not an option
            table = "training" if key in filed else "parallel"
            raise ConfigError("config", f"[{table}] {e.message}") from None
        raise


def _json(cfg, wl, setup: TrainingSetup, rep: MemoryReport, fit) -> dict:
    import dataclasses

    out = {**model_json(cfg, wl), "setup": dataclasses.asdict(setup),
           "weights": rep.weights, "gradients": rep.gradients, "optimizer": rep.optimizer,
           "activations": rep.activations, "weight_copies": rep.weight_copies,
           "activations_paper": rep.activations_paper,
           "logits": rep.logits, "kv_cache": rep.kv_cache, "peak": rep.peak.bytes,
           "peak_phase": rep.peak.phase, "peak_phases": rep.peak.phases,
           "breakdown": rep.breakdown}
    if fit:
        out["fit"] = fit
    return out


def _render(cfg, wl, setup: TrainingSetup, rep: MemoryReport, fit) -> None:
    print_line(describe(cfg, wl) + f"  mode={setup.mode} optimizer={setup.optimizer} "
               f"dp={setup.dp} zero={setup.zero} tp={setup.tp} pp={setup.pp} sp={setup.sp}")
    rows = [[k, f"{v:,}", binary_bytes(v)] for k, v in [
        ("weights", rep.weights), ("gradients", rep.gradients), ("optimizer", rep.optimizer),
        ("activations (saved, this implementation)", rep.activations),
        ("autocast 16-bit weight copies (saved)", rep.weight_copies),
        ("activations (Korthikanti et al. 2022)", rep.activations_paper),
        ("logits + cross-entropy log-probs", rep.logits),
        (f"KV cache (inference)", rep.kv_cache)]]
    print_table("Memory per device", ["quantity", "bytes", "binary"], rows,
                total_row=[f"step peak ({rep.peak.phase})", f"{rep.peak.bytes:,}",
                           binary_bytes(rep.peak.bytes)],
                caption=f"peak in {rep.peak.phase}: {rep.peak.why}")
    acts = [[k, f"{v:,}", binary_bytes(v)] for k, v in rep.breakdown["activations"].items() if v]
    print_table("Saved activations, one line per saved tensor kind", ["tensor", "bytes", "binary"],
                acts)
    copies = [[k, f"{v:,}", binary_bytes(v)] for k, v in rep.breakdown["weight_copies"].items()
              if v]
    if copies:
        print_table("Autocast's 16-bit weight copies, saved for backward",
                    ["weights", "bytes", "binary"], copies)
    paper = [[k, f"{v:,}", binary_bytes(v)]
             for k, v in rep.breakdown["activations_paper"].items()]
    print_table("Korthikanti et al. 2022 (16-bit activations, 1-byte masks)",
                ["term", "bytes", "binary"], paper)
    if fit:
        budget = binary_bytes(fit["budget"])
        ctx = f"{fit['max_context']:,} tokens"
        if fit["max_context"] > cfg.block_size:  # a memory bound; positions stop at T
            ctx += f" by memory (the model's block size is {cfg.block_size:,})"
        if fit["max_batch"]:
            print_line(f"budget {budget}: largest batch {fit['max_batch']}, "
                       f"largest KV-cache context {ctx}")
        else:
            states = rep.weights + rep.gradients + rep.optimizer
            print_line(f"budget {budget}: no batch fits (predicted peak "
                       f"{binary_bytes(rep.peak.bytes)} at B={wl.batch_size}; weights, gradients "
                       f"and optimizer alone {binary_bytes(states)}); largest KV-cache context "
                       f"{ctx}")
