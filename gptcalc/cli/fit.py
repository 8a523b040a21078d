"""What fits one device, for `memory --gpu-memory` and `memory --gpu`: the largest micro-batch
and training sequence, the longest inference context, and, when no micro-batch fits, the
smallest changes of options that make the step fit, each one the command's own set-up resolved
again with those options and counted with `memory_report`."""

from __future__ import annotations

from typing import Any

from ..config import GPTConfig
from ..errors import ConfigError
from ..gpus import GPUS, gpu as find_gpu, usable_memory
from ..memory import MemoryReport, max_batch, max_context, max_seq_len, memory_report
from ..training_setup import RECOMPUTE, TrainingSetup
from ..units import binary_bytes
from ..workload import Workload
from .options import resolve_given
from .render import print_line, print_table

# the most data-parallel ranks the advice looks for a ZeRO-3 layout among
_MAX_DP = 1 << 16


def device_budget(gpu_name: str | None, gpu_memory: int | None) -> int | None:
    """Bytes per device: --gpu-memory, or the catalogue memory of --gpu; None without either."""
    if gpu_name is None:
        return gpu_memory
    if gpu_memory is not None:
        raise ConfigError("gpu", "give --gpu or --gpu-memory, not both")
    return usable_memory(find_gpu(gpu_name))


def fit_section(cfg: GPTConfig, wl: Workload, setup: TrainingSetup, rep: MemoryReport,
                budget: int, gpu_name: str | None, given: dict[str, Any],
                ds: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON's `fit`: what fits `budget` bytes, and `advice` when no micro-batch does."""
    fit = {"budget": budget, "gpu": find_gpu(gpu_name).name if gpu_name else None,
           "max_batch": max_batch(cfg, wl, setup, budget),
           "max_seq_len": max_seq_len(cfg, wl, setup, budget),
           "max_context": max_context(cfg, wl.batch_size, setup, budget)}
    fit["advice"] = [] if fit["max_batch"] else advice(cfg, wl, setup, rep, budget, fit,
                                                       given, ds)
    return fit


def advice(cfg: GPTConfig, wl: Workload, setup: TrainingSetup, rep: MemoryReport, budget: int,
           fit: dict[str, Any], given: dict[str, Any], ds: dict[str, Any] | None
           ) -> list[dict[str, Any]]:
    """Options that, added to the command, make its step fit `budget`: the longest sequence
    that fits; the mildest recomputation; ZeRO-3 over the fewest data-parallel ranks; QLoRA's
    4-bit base (with LoRA); and the smallest catalogue card with the memory. Where no single
    change fits, the mildest recomputation with each of the others. Each {"options", "peak"}."""
    def peak(changes: dict[str, Any]) -> int | None:
        return _peak(cfg, wl, given, ds, changes)

    out: list[dict[str, Any]] = []
    if fit["max_seq_len"]:
        seq = {"seq_len": fit["max_seq_len"]}
        out.append(_entry(seq, _peak(cfg, Workload(wl.batch_size, fit["max_seq_len"],
                                                   wl.grad_accum), given, ds, {})))
    singles = []
    recompute = _mildest(peak, budget, [{"recompute": r} for r in
                                        RECOMPUTE[RECOMPUTE.index(setup.recompute) + 1:]])
    singles.append(recompute)
    singles.append(_fewest_ranks(peak, budget, setup, {}))
    if setup.lora_rank and given.get("weights_dtype") != "int4" and setup.base_dtype != "nf4":
        singles.append(_mildest(peak, budget, [{"weights_dtype": "int4"}]))
    if not any(singles) and setup.recompute != "full":
        full = {"recompute": "full"}
        singles.append(_fewest_ranks(peak, budget, setup, full))
        if setup.lora_rank and setup.base_dtype != "nf4":
            singles.append(_mildest(peak, budget, [{**full, "weights_dtype": "int4"}]))
    out += [s for s in singles if s]
    card = min((g for g in GPUS.values() if g.usable_memory_bytes and
                g.usable_memory_bytes > budget and g.usable_memory_bytes >= rep.peak.bytes),
               key=lambda g: g.usable_memory_bytes, default=None)
    if card is not None:
        out.append({"options": f"--gpu {card.name}", "peak": rep.peak.bytes})
    return out


def _peak(cfg: GPTConfig, wl: Workload, given: dict[str, Any], ds: dict[str, Any] | None,
          changes: dict[str, Any]) -> int | None:
    """The step peak with `changes` among the options given; None where they are refused."""
    try:
        setup, _ = resolve_given(cfg, {**given, **changes}, ds)
        return memory_report(cfg, wl, setup).peak.bytes
    except ConfigError:
        return None


def _entry(changes: dict[str, Any], peak: int | None) -> dict[str, Any]:
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())
    return {"options": options, "peak": peak}


def _mildest(peak, budget: int, tries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first of `tries` whose peak fits."""
    for changes in tries:
        p = peak(changes)
        if p is not None and p <= budget:
            return _entry(changes, p)
    return None


def _fewest_ranks(peak, budget: int, setup: TrainingSetup, base: dict[str, Any]
                  ) -> dict[str, Any] | None:
    """ZeRO stage 3 over the fewest data-parallel ranks (more than now) whose peak fits:
    doubling, then bisection (sharding only shrinks with more ranks)."""
    def fits(n: int) -> bool:
        p = peak({**base, "zero": 3, "dp": n})
        return p is not None and p <= budget
    lo = setup.dp if setup.zero == 3 else max(setup.dp, 1) - 1  # the most ranks known not to fit
    hi = max(lo * 2, 2)
    while not fits(hi):
        if hi >= _MAX_DP:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    changes = {**base, "zero": 3, "dp": hi}
    return _entry(changes, peak(changes))


def render_fit(cfg: GPTConfig, wl: Workload, rep: MemoryReport, fit: dict[str, Any]) -> None:
    budget = binary_bytes(fit["budget"])
    if fit["gpu"]:
        budget += f" ({fit['gpu']})"
    if fit["max_batch"]:
        print_line(f"Training in {budget} per device: largest micro-batch {fit['max_batch']:,} "
                   f"at seq_len {wl.seq_len:,}; longest sequence {fit['max_seq_len']:,} tokens at "
                   f"micro-batch {wl.batch_size}"
                   + (f" (a memory bound: the model's block size is {cfg.block_size:,})"
                      if fit["max_seq_len"] > cfg.block_size else ""))
    else:
        states = rep.weights + rep.gradients + rep.optimizer
        longest = (f"the longest sequence that fits is {fit['max_seq_len']:,} tokens at "
                   f"micro-batch {wl.batch_size}" if fit["max_seq_len"]
                   else "no sequence fits either")
        print_line(f"Training in {budget} per device: no micro-batch fits at seq_len "
                   f"{wl.seq_len:,} (peak {binary_bytes(rep.peak.bytes)} at B={wl.batch_size}; "
                   f"weights, gradients and optimizer states alone {binary_bytes(states)}); "
                   f"{longest}")
        if fit["advice"]:
            print_table(f"What fits {binary_bytes(fit['budget'])}: add to the command",
                        ["options", "peak", "binary"],
                        [[a["options"], f"{a['peak']:,}", binary_bytes(a["peak"])]
                         for a in fit["advice"]],
                        caption="--gpu NAME in place of --gpu-memory" if any(
                            a["options"].startswith("--gpu ") for a in fit["advice"]) else None)
    if fit["max_context"] is None:
        ctx = "no limit by memory (every block's cache is bounded by its sliding window)"
    else:
        ctx = f"{fit['max_context']:,} tokens"
        if fit["max_context"] > cfg.block_size:
            ctx += f" by memory (the model's block size is {cfg.block_size:,})"
    print_line(f"Inference in {budget} per device (weights + KV cache in the serving dtype, "
               f"batch {wl.batch_size}): longest context {ctx}")
