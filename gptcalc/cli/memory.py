"""`gptcalc memory`: bytes per device of weights, gradients, optimizer, activations, the peak."""

from __future__ import annotations

import dataclasses

import click

from ..config import GPTConfig
from ..errors import positive_int
from ..training_setup import TrainingSetup
from ..workload import Workload
from ..memory import MemoryReport, memory_report
from ..memory.engines import engine_for
from ..memory.load import LoadPhase, load_phase
from ..memory.reserved import (MAX_SIMULATED_BLOCKS, RESERVED_LINE, nvidia_smi_lines,
                               rank_reserved)
from ..schedules import pp_rank as pipeline_rank
from ..units import binary_bytes
from ..schema import OPTIONS
from .fit import device_budget, fit_section, render_fit, verdict_lines
from .options import (assumptions, click_option, context_option, current_recipe,
                      deepspeed_settings, deepspeed_workload, describe, detail_option,
                      json_option, model_options, setup_source, training_options,
                      training_setup, world_size_option)
from .render import emit_json, envelope, print_table, print_wrapped

# ranks (GPUs) per node, for the host memory a node needs: an 8-GPU server (DGX/HGX)
DEFAULT_GPUS_PER_NODE = 8


@click.command("memory")
@world_size_option
@model_options
@training_options()
@click_option(OPTIONS["gpu"])
@click_option(OPTIONS["gpu_memory"])
@click_option(OPTIONS["gpus_per_node"])
@context_option("KV-cache context in tokens (default seq-len).")
@detail_option("Every quantity: the full table, the peak's terms, each saved tensor, the stages, "
               "the paper's figures for comparison.")
@json_option("Machine-readable output (bytes).")
@click.pass_context
def command(ctx: click.Context, model: tuple[GPTConfig, Workload], gpu_name, gpu_memory,
            gpus_per_node, context, detail, as_json, **given) -> None:
    """Memory per device of one training step, and the KV cache of an inference run.

    Defaults follow how each family is trained (printed on the first line); settings not given
    as options come from the --config file's [training] and [parallel] tables, and
    --save-config writes them there."""
    cfg, wl = model
    source = setup_source(ctx)
    ds = deepspeed_settings(cfg, given, source)  # the ds_config, read once
    wl = deepspeed_workload(cfg, wl, given, ds, source, ctx.params)
    setup = training_setup(cfg, given, ds, ctx=ctx)
    recipe = current_recipe(ctx)
    if context is not None:
        positive_int("context", context)
    node = DEFAULT_GPUS_PER_NODE if gpus_per_node is None else gpus_per_node
    positive_int("gpus_per_node", node)
    budget = device_budget(gpu_name, gpu_memory)
    rep = memory_report(cfg, wl, setup, context)
    # the CUDA caching allocator's reserved bytes and what nvidia-smi shows (CUDA only)
    per_rank = rank_reserved(cfg, wl, setup) if setup.device == "cuda" else None
    smi = None if per_rank is None else nvidia_smi_lines(max(per_rank), setup)
    fit = None if budget is None else fit_section(cfg, wl, setup, rep, budget, gpu_name, given,
                                                  ds, per_rank, source)
    if per_rank and rep.stages:
        rep = dataclasses.replace(rep, stages=[dataclasses.replace(s, reserved=r)
                                               for s, r in zip(rep.stages, per_rank)])
    load = load_phase(cfg, setup)  # QLoRA quantised as it loads (CUDA, transformers)
    if as_json:
        emit_json({**_json(cfg, wl, setup, rep, fit, node, smi, recipe),
                   "load": load.as_dict() if load else None})
        return
    if detail:
        _render(cfg, wl, setup, rep, fit, node, smi, recipe, load)
    else:
        _render_short(cfg, wl, setup, rep, fit, node, smi, recipe, load)


def _json(cfg, wl, setup: TrainingSetup, rep: MemoryReport, fit, node: int,
          smi: dict[str, int] | None, recipe) -> dict:
    out = {**envelope(cfg, wl, setup),
           "setup": dataclasses.asdict(setup), "assumptions": assumptions(cfg, wl, setup),
           "global_batch": rep.global_batch,
           "weights": rep.weights, "gradients": rep.gradients, "optimizer": rep.optimizer,
           "activations": rep.activations, "weight_copies": rep.weight_copies,
           "activations_paper": rep.activations_paper,
           "logits": rep.logits, "kv_cache": rep.kv_cache, "resident": rep.resident,
           "peak": rep.peak.bytes,
           "peak_phase": rep.peak.phase,
           "peak_stage": rep.peak.stage if isinstance(rep.peak.stage, str) else "middle",
           "peak_rank": pipeline_rank(setup, rep.peak.stage),
           "stages": [s.as_dict() for s in rep.stages],
           "peak_phases": rep.peak.phases, "overhead": setup.overhead,
           "reserved": smi[RESERVED_LINE] if smi else None,
           "nvidia_smi": sum(smi.values()) if smi else None,
           "breakdown": {**rep.breakdown, "nvidia_smi": smi or {}},
           "host": rep.host, "host_total": rep.host_total, "gpus_per_node": node,
           "host_per_node": rep.host_total * node}
    if fit:
        out["fit"] = fit
    if recipe is not None:
        rec, _ = recipe
        out["recipe"] = {"path": str(rec.path), "kind": rec.kind,
                         "read": [{"key": k, "setting": v} for k, v in rec.read],
                         "ignored": [{"key": k, "why": v} for k, v in rec.ignored]}
    return out


def _load_line(load: LoadPhase) -> str:
    """The load phase: the allocated peak while from_pretrained quantises, the reserved bytes
    it leaves (the steps continue from them)."""
    return (f"load (from_pretrained quantising the 16-bit checkpoint to NF4 on the device): "
            f"allocated peak {binary_bytes(load.peak)} (quantising {load.peak_tensor}), "
            f"{binary_bytes(load.allocated)} after; reserved after load "
            f"{binary_bytes(load.reserved)}, which the step's reserved bytes start from")


def _rows(lines: dict[str, int]) -> list[list[str]]:
    return [[k, f"{v:,}", binary_bytes(v)] for k, v in lines.items() if v]


def _render_stages(setup: TrainingSetup, rep: MemoryReport) -> None:
    reserved = rep.stages[0].reserved is not None
    rows = [[str(s.rank), str(s.layers), str(s.held_layers),
             binary_bytes(s.weights + s.gradients + s.optimizer), binary_bytes(s.activations),
             binary_bytes(s.peak), s.peak_phase]
            + ([binary_bytes(s.reserved)] if reserved else []) for s in rep.stages]
    print_table(f"Pipeline stages ({setup.pp_schedule}), per device",
                ["rank", "blocks", "blocks x micro-batches alive", "states", "activations", "peak",
                 "peak phase"] + (["reserved"] if reserved else []), rows)


def _head(cfg, wl, setup: TrainingSetup, fit, recipe) -> None:
    """The verdict first (with a card), then the assumptions, the recipe and the model."""
    if fit:
        for line in verdict_lines(fit, setup):
            print_wrapped(line)
    print_wrapped(assumptions(cfg, wl, setup))
    if recipe is not None:
        from ..recipes import recipe_line

        print_wrapped(recipe_line(*recipe))
    print_wrapped(describe(cfg, wl))


def _rank_line(setup: TrainingSetup, rep: MemoryReport, judged: bool) -> str:
    """Every pipeline rank's allocated peak (and reserved bytes) on one line, rank 0 first, and
    the rank a verdict (`judged`) is on: the one that must hold the most (its reserved bytes
    where simulated, else its allocated peak); beyond `_RANKS_ON_A_LINE` ranks, the heaviest and
    the lightest."""
    stages = rep.stages
    worst = max(stages, key=lambda s: s.peak if s.reserved is None else s.reserved)
    head = f"per pipeline rank ({setup.pp_schedule}" + (
        f"; the verdict is rank {worst.rank}'s)" if judged else ")")
    if len(stages) > _RANKS_ON_A_LINE:
        hi = max(stages, key=lambda s: s.peak)
        lo = min(stages, key=lambda s: s.peak)
        return (f"{head}: allocated peak from {binary_bytes(lo.peak)} (rank {lo.rank}) to "
                f"{binary_bytes(hi.peak)} (rank {hi.rank}); --detail: every rank")
    top = max(max(s.peak, s.reserved or 0) for s in stages)
    unit, size = next((u, b) for u, b in _UNITS if top >= b or b == 1)

    def figures(values) -> str:
        return " ".join(f"{v / size:.2f}" for v in values) + f" {unit}"
    line = f"{head}: allocated peak {figures(s.peak for s in stages)}"
    if all(s.reserved is not None for s in stages):
        line += f"; reserved {figures(s.reserved for s in stages)}"
    return line


def _short_terms(lines: dict[str, int]) -> list[list[str]]:
    """The peak's `_TERMS_SHOWN` largest terms in the step's order, the rest on one row."""
    terms = [(k, v) for k, v in lines.items() if v]
    if len(terms) > _TERMS_SHOWN:
        kept = {k for k, _ in sorted(terms, key=lambda kv: -kv[1])[:_TERMS_SHOWN - 1]}
        rest = [v for k, v in terms if k not in kept]
        terms = [(k, v) for k, v in terms if k in kept] + [
            (f"{len(rest)} smaller terms (--detail: each)", sum(rest))]
    return [[k, binary_bytes(v)] for k, v in terms]


# terms of the peak the one-screen answer lists (more: the largest, then the rest summed)
_TERMS_SHOWN = 5
# ranks whose figures one line lists (more: the heaviest and the lightest)
_RANKS_ON_A_LINE = 16
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _render_short(cfg, wl, setup: TrainingSetup, rep: MemoryReport, fit, node: int,
                  smi: dict[str, int] | None, recipe, load: LoadPhase | None = None) -> None:
    """One screen: the verdict (on the worst pipeline rank), the assumptions, the peak's terms
    on the most loaded rank, every rank's peak on a line, what fits; --detail prints the
    rest."""
    _head(cfg, wl, setup, fit, recipe)
    stage = ""
    if setup.pp > 1:
        stage = f"; rank {pipeline_rank(setup, rep.peak.stage)}, the most loaded"
    # binary units only: the exact bytes are in --detail and --json
    print_table(None, ["the step's peak per device", "bytes"], _short_terms(rep.peak.lines),
                total_row=[f"allocated peak ({rep.peak.phase}{stage})",
                           binary_bytes(rep.peak.bytes)], edge=False)
    if rep.stages:
        print_wrapped(_rank_line(setup, rep, judged=bool(fit)))
    if smi and not fit:
        print_wrapped(f"reserved {binary_bytes(smi[RESERVED_LINE])}; what nvidia-smi shows: "
                   f"{binary_bytes(sum(smi.values()))} (with the CUDA context and NCCL "
                   "buffers, estimated)")
    elif setup.device == "cuda" and not smi:
        print_wrapped(f"reserved: not simulated above {MAX_SIMULATED_BLOCKS} blocks on a stage")
    if load:
        print_wrapped(_load_line(load))
    if rep.host:
        print_wrapped(f"host memory per rank (offloaded): {binary_bytes(rep.host_total)}; per "
                   f"node ({node} ranks) {binary_bytes(rep.host_total * node)}")
    for line, nbytes in rep.unified.items():  # CUDA unified memory: outside peak and reserved
        print_wrapped(f"{line}: {nbytes:,} B ({binary_bytes(nbytes)}), outside the peak and the "
                   "reserved bytes")
    if fit:
        render_fit(cfg, wl, fit, detail=False)


def _render(cfg, wl, setup: TrainingSetup, rep: MemoryReport, fit, node: int,
            smi: dict[str, int] | None, recipe, load: LoadPhase | None = None) -> None:
    _head(cfg, wl, setup, fit, recipe)
    stage = ""
    if setup.pp > 1:
        stage = f", pipeline rank {pipeline_rank(setup, rep.peak.stage)} (the most loaded)"
    rows = _rows({
        "weights": rep.weights, "gradients": rep.gradients, "optimizer": rep.optimizer,
        f"activations saved for backward ({setup.impl})": rep.activations,
        "autocast 16-bit weight copies (saved)": rep.weight_copies,
        "logits": rep.logits, "overhead (given)": setup.overhead})
    rows.append(["activations, Korthikanti et al. 2022 (for comparison)",
                 f"{rep.activations_paper:,}", binary_bytes(rep.activations_paper)])
    rows.append(["KV cache of an inference run (not part of training)", f"{rep.kv_cache:,}",
                 binary_bytes(rep.kv_cache)])
    rows.append([f"resident between steps ({engine_for(setup).name}: weights, optimizer states, "
                 "kept gradients and buffers)", f"{rep.resident:,}", binary_bytes(rep.resident)])
    if smi:
        reserved = smi[RESERVED_LINE]
        rows.append([f"reserved by the caching allocator ({setup.allocator} segments; "
                     "torch.cuda.max_memory_reserved)", f"{reserved:,}", binary_bytes(reserved)])
    rows += _rows(rep.unified)  # CUDA unified memory: outside the peak and the reserved bytes
    if rep.host:
        rows.append(["host memory per rank (offloaded; not on the device)",
                     f"{rep.host_total:,}", binary_bytes(rep.host_total)])
    print_table(f"Memory per device{stage}", ["quantity", "bytes", "binary"], rows,
                total_row=[f"step peak ({rep.peak.phase})", f"{rep.peak.bytes:,}",
                           binary_bytes(rep.peak.bytes)],
                caption=f"peak at {rep.peak.why}")
    if smi:
        print_wrapped(f"what nvidia-smi shows: {binary_bytes(sum(smi.values()))} = "
                   + " + ".join(f"{k} {binary_bytes(v)}" for k, v in smi.items() if v)
                   + " (the CUDA context and NCCL buffers estimated)")
    elif setup.device == "cuda":
        print_wrapped(f"reserved: not simulated above {MAX_SIMULATED_BLOCKS} blocks on a stage")
    if load:
        print_wrapped(_load_line(load))
    print_table(f"The peak, {rep.peak.phase}: its terms", ["term", "bytes", "binary"],
                _rows(rep.peak.lines))
    if rep.host:
        print_table("host: what the host holds per rank (offloaded)",
                    ["line", "bytes", "binary"], _rows(rep.host),
                    total_row=[f"per node ({node} ranks)", f"{rep.host_total * node:,}",
                               binary_bytes(rep.host_total * node)])
    if setup.lora_rank:
        print_table("Model states: the frozen base and the adapters", ["line", "bytes", "binary"],
                    _rows(rep.breakdown["state"]))
    if rep.stages:
        _render_stages(setup, rep)
    print_table(f"Saved activations ({setup.impl}), one line per saved tensor kind",
                ["tensor", "bytes", "binary"], _rows(rep.breakdown["activations"]))
    if fit:
        render_fit(cfg, wl, fit, detail=True)
    if recipe is not None and recipe[0].ignored:
        print_table("recipe keys read and knowingly ignored (they do not change a step's "
                    "memory)", ["key", "why"], [list(kv) for kv in recipe[0].ignored])

