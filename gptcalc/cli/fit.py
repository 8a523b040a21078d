"""What fits one device, for `memory --gpu-memory` and `memory --gpu`: the verdict
(`gptcalc.memory.verdict`: what the card must hold, reserved + CUDA context + NCCL buffers,
against its usable memory), the largest micro-batch and training sequence, the longest
inference context, and, when the step does not fit, the smallest changes of options that make
it fit, each one the command's own set-up resolved again with those options and judged by the
same verdict."""

from __future__ import annotations

from typing import Any

from ..config import GPTConfig
from ..errors import ConfigError
from ..gpus import GPUS, gpu as find_gpu, usable_memory
from ..memory import MemoryReport, max_context
from ..memory.verdict import Verdict, largest_batch, largest_seq_len, verdict, verdict_floor
from ..training_setup import RECOMPUTE, TrainingSetup
from ..units import binary_bytes
from ..workload import Workload
from .options import SetupSource, resolve_given
from .render import print_wrapped

NO_FILE = SetupSource()  # a set-up read from options alone

# the most data-parallel ranks the advice looks for a ZeRO-3 layout among
_MAX_DP = 1 << 16
# GPUs per node of the cards people train on (DGX/HGX H100, H200, A100 boards hold 8): past one
# node, data parallelism grows by whole nodes
NODE_GPUS = 8


def device_budget(gpu_name: str | None, gpu_memory: int | None) -> int | None:
    """Bytes per device: --gpu-memory, or the catalogue memory of --gpu; None without either."""
    if gpu_name is None:
        return gpu_memory
    if gpu_memory is not None:
        raise ConfigError("gpu", "give --gpu or --gpu-memory, not both")
    return usable_memory(find_gpu(gpu_name))


def fit_section(cfg: GPTConfig, wl: Workload, setup: TrainingSetup, rep: MemoryReport,
                budget: int, gpu_name: str | None, given: dict[str, Any],
                ds: dict[str, Any] | None, reserved: list[int] | None = None,
                source: SetupSource = NO_FILE) -> dict[str, Any]:
    """The JSON's `fit`: the verdict on `budget` bytes, what fits them, and `advice` when the
    step does not. `reserved`: `rank_reserved`'s list, when the command has it; `source`: the
    config file the set-up was read over, for the advice's set-ups."""
    v = verdict(cfg, wl, setup, budget, allocated=rep.peak.bytes, reserved=reserved)
    fit = {"budget": budget, "gpu": find_gpu(gpu_name).name if gpu_name else None,
           "verdict": v.as_dict(),
           "max_batch": largest_batch(cfg, wl, setup, budget),
           "max_seq_len": largest_seq_len(cfg, wl, setup, budget),
           "max_context": max_context(cfg, wl.batch_size, setup, budget)}
    fit["advice"] = [] if v.fits else advice(cfg, wl, setup, v, budget, fit, given, ds,
                                                  source)
    return fit


def advice(cfg: GPTConfig, wl: Workload, setup: TrainingSetup, v: Verdict, budget: int,
           fit: dict[str, Any], given: dict[str, Any], ds: dict[str, Any] | None,
           source: SetupSource = NO_FILE) -> list[dict[str, Any]]:
    """Options that, added to the command, make its step fit `budget`: the largest micro-batch
    that fits; the longest sequence that fits; the mildest recomputation; ZeRO-3 over the
    fewest data-parallel ranks; QLoRA's 4-bit base (with LoRA); and the smallest catalogue card
    with the memory. Where no single change of the set-up fits, full recomputation with each of
    the others, the longest sequence included. Each {"options", "peak", "must_hold"}."""
    def judge(changes: dict[str, Any], workload: Workload = wl) -> Verdict | None:
        return _judge(cfg, workload, given, ds, changes, budget, source)

    out: list[dict[str, Any]] = []
    if fit["max_batch"] and fit["max_batch"] < wl.batch_size:
        b = fit["max_batch"]
        out.append(_entry({"batch_size": b},
                          judge({}, Workload(b, wl.seq_len, wl.grad_accum))))
    if fit["max_seq_len"] and fit["max_seq_len"] < wl.seq_len:
        s = fit["max_seq_len"]
        out.append(_entry({"seq_len": s}, judge({}, Workload(wl.batch_size, s, wl.grad_accum))))
    if fit["max_batch"]:
        return [a for a in out if a] + _card(v, budget)
    recompute = _mildest(judge, [{"recompute": r} for r in
                                 RECOMPUTE[RECOMPUTE.index(setup.recompute) + 1:]])
    singles = [recompute, _fewest_ranks(judge, setup, {})]
    full = {"recompute": "full"}
    if recompute is None and setup.recompute != "full":  # checkpointing and a shorter sequence
        singles.append(_longest_with(cfg, wl, given, ds, full, budget, source))
    if setup.lora_rank and given.get("weights_dtype") != "int4" and setup.base_dtype != "nf4":
        singles.append(_mildest(judge, [{"weights_dtype": "int4"}]))
    if not any(singles) and setup.recompute != "full":
        singles.append(_fewest_ranks(judge, setup, full))
        if setup.lora_rank and setup.base_dtype != "nf4":
            singles.append(_mildest(judge, [{**full, "weights_dtype": "int4"}]))
    return [a for a in out + singles if a] + _card(v, budget)


def _card(v: Verdict, budget: int) -> list[dict[str, Any]]:
    """The smallest catalogue card whose usable memory holds what this step must hold."""
    card = min((g for g in GPUS.values() if g.usable_memory_bytes and
                g.usable_memory_bytes > budget and g.usable_memory_bytes >= v.must_hold),
               key=lambda g: g.usable_memory_bytes, default=None)
    if card is None:
        return []
    return [{"options": f"--gpu {card.name}", "peak": v.allocated, "must_hold": v.must_hold}]


def _judge(cfg: GPTConfig, wl: Workload, given: dict[str, Any], ds: dict[str, Any] | None,
           changes: dict[str, Any], budget: int, source: SetupSource) -> Verdict | None:
    """The verdict with `changes` among the options given; None where they are refused or
    where even the allocated peak (the lower bound) does not fit."""
    try:
        setup, _ = resolve_given(cfg, {**given, **changes}, ds, source)
        floor = verdict_floor(cfg, wl, setup, budget)
        if not floor.fits:
            return None
        return verdict(cfg, wl, setup, budget, allocated=floor.allocated)
    except ConfigError:
        return None


def _entry(changes: dict[str, Any], v: Verdict | None) -> dict[str, Any] | None:
    if v is None or not v.fits:
        return None
    spelled = {"batch_size": "-B"}
    options = " ".join(f"{spelled.get(k, '--' + k.replace('_', '-'))} {val}"
                       for k, val in changes.items())
    return {"options": options, "peak": v.allocated, "must_hold": v.must_hold}


def _mildest(judge, tries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first of `tries` that fits."""
    for changes in tries:
        entry = _entry(changes, judge(changes))
        if entry:
            return entry
    return None


def _longest_with(cfg: GPTConfig, wl: Workload, given: dict[str, Any],
                  ds: dict[str, Any] | None, changes: dict[str, Any], budget: int,
                  source: SetupSource) -> dict[str, Any] | None:
    """`changes` together with the longest sequence that fits with them (two changes)."""
    try:
        setup, _ = resolve_given(cfg, {**given, **changes}, ds, source)
    except ConfigError:
        return None
    s = min(largest_seq_len(cfg, wl, setup, budget), wl.seq_len)
    if not s:
        return None
    return _entry({**changes, "seq_len": s},
                  _judge(cfg, Workload(wl.batch_size, s, wl.grad_accum), given, ds, changes,
                         budget, source))


def dp_sizes(most: int) -> list[int]:
    """The data-parallel sizes people run, up to `most`: powers of two within a node (1, 2, 4,
    8), then whole nodes of `NODE_GPUS` (16, 24, 32, ...): a launcher fills nodes (torchrun's
    --nproc-per-node, accelerate's num_processes per machine), so 11 ranks is never a layout
    anyone runs."""
    within = [n for n in (1, 2, 4) if n < NODE_GPUS and n <= most]
    return within + list(range(NODE_GPUS, most + 1, NODE_GPUS))


def _fewest_ranks(judge, setup: TrainingSetup, base: dict[str, Any]) -> dict[str, Any] | None:
    """ZeRO stage 3 over the fewest data-parallel ranks (more than now, among `dp_sizes`) that
    fit: galloping, then bisection over those sizes (sharding only shrinks with more ranks)."""
    def fits(n: int) -> bool:
        v = judge({**base, "zero": 3, "dp": n})
        return v is not None and v.fits
    known = setup.dp if setup.zero == 3 else max(setup.dp, 1) - 1  # the most known not to fit
    sizes = [n for n in dp_sizes(_MAX_DP) if n > known]
    if not sizes or not fits(sizes[-1]):  # not even the most ranks: no search
        return None
    lo, hi, step = -1, 0, 1  # indices into sizes: lo does not fit (-1: none tried), hi fits?
    while not fits(sizes[hi]):
        lo, hi, step = hi, min(hi + step * 2, len(sizes) - 1), step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(sizes[mid]) else (mid, hi)
    changes = {**base, "zero": 3, "dp": sizes[hi]}
    return _entry(changes, judge(changes))


def verdict_lines(fit: dict[str, Any], setup: TrainingSetup) -> list[str]:
    """The verdict, first: fits or not, by how much; then what the card must hold and the
    allocated peak, the lower bound."""
    v = fit["verdict"]
    usable = binary_bytes(fit["budget"])
    card = f"{fit['gpu']} ({usable} usable)" if fit["gpu"] else f"{usable} per device"
    if v["fits"]:
        head = (f"Fits {card}: must hold {binary_bytes(v['must_hold'])}, "
                f"{binary_bytes(v['margin'])} to spare")
    else:
        head = (f"Does not fit {card}: must hold {binary_bytes(v['must_hold'])}, "
                f"{binary_bytes(-v['margin'])} short")
    if v["reserved"] is not None:
        held = (f"reserved {binary_bytes(v['reserved'])} + CUDA context "
                f"{binary_bytes(v['cuda_context'])}")
        if v["nccl_buffers"]:
            held += f" + NCCL buffers {binary_bytes(v['nccl_buffers'])}"
        why = (f"must hold = {held}; allocated peak {binary_bytes(v['allocated_peak'])} "
               "(the lower bound)")
    elif setup.device == "cuda":
        why = (f"must hold = allocated peak {binary_bytes(v['allocated_peak'])} + CUDA context "
               f"{binary_bytes(v['cuda_context'])} + NCCL buffers "
               f"{binary_bytes(v['nccl_buffers'])}: a lower bound (reserved not simulated "
               "above its block limit)")
    else:
        why = f"must hold = allocated peak {binary_bytes(v['allocated_peak'])} (--device cpu)"
    return [head, why]


def render_fit(cfg: GPTConfig, wl: Workload, fit: dict[str, Any], detail: bool) -> None:
    """What fits beside the verdict: the largest micro-batch and sequence, the advice; with
    `detail` the longest inference context too."""
    if fit["max_batch"]:
        bound = (f" (a memory bound: the model's block size is {cfg.block_size:,})"
                 if fit["max_seq_len"] > cfg.block_size else "")
        print_wrapped(f"Largest micro-batch {fit['max_batch']:,} at seq_len {wl.seq_len:,}; "
                   f"longest sequence {fit['max_seq_len']:,} tokens at micro-batch "
                   f"{wl.batch_size}{bound}")
    else:
        longest = (f"the longest sequence that fits is {fit['max_seq_len']:,} tokens at "
                   f"micro-batch {wl.batch_size}" if fit["max_seq_len"]
                   else "no sequence fits either")
        print_wrapped(f"No micro-batch fits at seq_len {wl.seq_len:,}; {longest}")
    if fit["advice"]:
        print_wrapped("To fit, add one of: " + "; ".join(
            f"{a['options']} ({binary_bytes(a['must_hold'])})" for a in fit["advice"]))
    if not detail:
        return
    if fit["max_context"] is None:
        ctx = "no limit by memory (every block's cache is bounded by its sliding window)"
    else:
        ctx = f"{fit['max_context']:,} tokens"
        if fit["max_context"] > cfg.block_size:
            ctx += f" by memory (the model's block size is {cfg.block_size:,})"
    print_wrapped(f"Inference in {binary_bytes(fit['budget'])} per device (weights + KV cache in "
               f"the serving dtype, batch {wl.batch_size}): longest context {ctx}")
