"""Training layouts that fit a GPU's memory, ranked by their estimated step time.

A layout is data parallelism dp, tensor parallelism tp (sequence parallel with it where tp
divides the sequence), pipeline stages pp, a training engine at one of its ZeRO stages, and an
activation recomputation; a plan is a layout with the micro-batch B and the accumulation
(grad_accum = global batch / (dp x B)) that reach the global batch. Its peak is the step peak
of `gptcalc.memory` on its most loaded device, exactly what `gptcalc memory` prints for it.

    step seconds = hardware FLOPs of the step / (gpus x dense peak x utilisation)
                   x (1 + (pp - 1) / grad_accum)

The FLOPs are `gptcalc.flops`' exact count, recomputed forward work included (`time`'s model
with the utilisation applied to the FLOPs a step executes, so recomputing costs time), times
the 1F1B schedule's pipeline bubble, (pp - 1) idle micro-batch slots per pp - 1 + m
(Narayanan et al. 2021, sec. 2.2). Communication, data loading and kernel efficiency at small
micro-batches are not modelled; the utilisation absorbs them.

The search space: tp in 1, 2, 4, 8 (one node of 8 GPUs) as the model's heads and widths allow;
pp dividing the blocks; dp dividing the global batch; at most `max_gpus` = dp x tp x pp; every
registered engine at each ZeRO stage it runs (ZeRO 1-3 only with dp > 1: with one replica there
is nothing to shard); recomputation none, selective or full. Under LoRA only data parallelism
(the memory model's scope). The micro-batch is the largest that fits (no pipeline: the time
does not depend on it, and a larger one runs matmuls better), or 1 under a pipeline (the most
micro-batches, the smallest bubble).

Pruning rests on monotony the tests check by brute force: without a pipeline a step's peak
grows with B at a given accumulation (under one, where the accumulation is the schedule's
micro-batches, the last stage keeps every micro-batch's logits and input gradients: each B is
tried), shrinks as dp grows past 1 (more sharding, a smaller micro-batch; one replica has no
data-parallel buffers, so dp = 1 is compared with itself only) and as recomputation keeps less
(none > selective > full). The search is best-first on a lower bound of each layout's time: a
layout's memory is evaluated only when it could rank, and a group of layouts (tp, pp, engine,
stage, one replica or several) that does not fit at its largest dp with full recomputation is
never evaluated again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config import GPTConfig
from .errors import ConfigError, fraction, positive_int
from .flops import count_flops
from .memory import step_peak, validate_setup
from .memory.engines import engine_named, names
from .training import resolve_training
from .training_setup import TrainingSetup
from .workload import Workload

# recomputation modes the planner tries, the one that keeps most first
PLANNED_RECOMPUTE = ("none", "selective", "full")
TP_SIZES = (1, 2, 4, 8)  # tensor parallelism within one node of 8 GPUs (NVLink)
# Llama 2 trained with a global batch of 4M tokens (Touvron et al. 2023, sec. 2.2)
DEFAULT_TOKENS_PER_STEP = 2**22
DEFAULT_MAX_GPUS = 1024


@dataclass(frozen=True)
class Layout:
    """How the devices are used: dp x tp x pp GPUs, an engine at a ZeRO stage, recomputation."""

    dp: int
    tp: int
    pp: int
    sp: bool
    engine: str
    zero: int
    recompute: str

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def group(self) -> tuple:
        """The layouts whose peaks the search compares: all but dp and recomputation, and
        whether there is more than one replica (data parallelism's buffers, such as DDP's
        gradient buckets, exist only then)."""
        return (self.tp, self.pp, self.sp, self.engine, self.zero, self.dp > 1)


@dataclass(frozen=True)
class Plan:
    """A layout at a micro-batch that fits: its set-up, peak per GPU (bytes) and time."""

    layout: Layout
    setup: TrainingSetup
    micro_batch: int
    grad_accum: int
    peak: int
    step_seconds: float
    tokens_per_second: float
    mfu: float  # model FLOPs per second over gpus x dense peak, the plan's implied MFU

    @property
    def gpus(self) -> int:
        return self.layout.gpus


@dataclass(frozen=True)
class Closest:
    """When nothing fits: the layout whose smallest peak comes nearest the budget."""

    layout: Layout
    micro_batch: int
    grad_accum: int
    peak: int


@dataclass(frozen=True)
class PlanSearch:
    """The plans found (best first), and how much was evaluated to find them."""

    plans: list[Plan]
    closest: Closest | None  # set when no layout fits
    layouts: int  # candidate layouts in the search space
    evaluations: int  # step peaks computed


def global_batch(seq_len: int, sequences: int | None = None,
                 tokens_per_step: int | None = None) -> int:
    """Sequences per optimizer step: `sequences`, or `tokens_per_step` / seq_len (a whole
    number), or DEFAULT_TOKENS_PER_STEP / seq_len (at least one sequence)."""
    if sequences is not None and tokens_per_step is not None:
        raise ConfigError("global_batch", "give --global-batch or --tokens-per-step, not both")
    if sequences is not None:
        return positive_int("global_batch", sequences)
    if tokens_per_step is not None:
        positive_int("tokens_per_step", tokens_per_step)
        if tokens_per_step % seq_len:
            raise ConfigError("tokens_per_step", f"{tokens_per_step:,} tokens is not a whole "
                                                 f"number of {seq_len:,}-token sequences")
        return tokens_per_step // seq_len
    return max(1, DEFAULT_TOKENS_PER_STEP // seq_len)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def engine_stages(engines: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """(engine, ZeRO stage) pairs to plan: every registered engine (or those of `engines`) at
    each stage it runs, but an engine's stage 0 only when that is all it runs (DeepSpeed at
    ZeRO 0 replicates every state as DistributedDataParallel does)."""
    out = []
    for name in engines or names():
        stages = engine_named(name).stages
        out += [(name, z) for z in stages if z > 0 or stages == (0,)]
    return out


def candidate_layouts(cfg: GPTConfig, seq_len: int, batch: int, max_gpus: int,
                      lora: bool = False, engines: tuple[str, ...] | None = None
                      ) -> list[Layout]:
    """Every layout of the search space (module docstring); validity against the model is
    checked later, when a layout is evaluated."""
    tps = (1,) if lora else tuple(t for t in TP_SIZES if cfg.n_head % t == 0)
    pps = (1,) if lora else divisors(cfg.n_layer)
    out = []
    for tp in tps:
        for pp in (p for p in pps if tp * p <= max_gpus):
            for dp in (d for d in divisors(batch) if d * tp * pp <= max_gpus):
                for engine, zero in engine_stages(engines):
                    if zero and dp == 1:
                        continue
                    out += [Layout(dp, tp, pp, tp > 1 and seq_len % tp == 0, engine, zero, r)
                            for r in PLANNED_RECOMPUTE]
    return out


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The 1F1B schedule's idle time over its busy time: (pp - 1) / m (Narayanan et al.
    2021, sec. 2.2); 0 without a pipeline."""
    return (pp - 1) / micro_batches


def step_seconds(flops: float, gpus: int, peak_flops: float, utilisation: float, pp: int,
                 micro_batches: int) -> float:
    """flops / (gpus x peak x utilisation), stretched by the pipeline bubble."""
    return flops / (gpus * peak_flops * utilisation) * (1 + bubble_fraction(pp, micro_batches))


def layout_setup(cfg: GPTConfig, layout: Layout, given: Mapping[str, Any] | None = None,
                 sections: Mapping[str, Any] | None = None, from_hf: bool = False
                 ) -> TrainingSetup:
    """The TrainingSetup `gptcalc memory` resolves for the layout's options and `given` (the
    other training options, by option name) over a config file's `sections`."""
    options = {**(given or {}), "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
               "sp": layout.sp, "engine": layout.engine, "zero": layout.zero,
               "recompute": layout.recompute}
    return resolve_training(cfg, sections, options, from_hf)[0]


class _Evaluator:
    """Step peaks of layouts, each computed once, and what their failures rule out."""

    def __init__(self, cfg: GPTConfig, seq_len: int, batch: int, budget: int,
                 setup_for: Callable[[Layout], TrainingSetup]) -> None:
        self.cfg, self.seq_len, self.batch, self.budget = cfg, seq_len, batch, budget
        self.setup_for = setup_for
        self.setups: dict[Layout, TrainingSetup | None] = {}
        self.peaks: dict[tuple, int] = {}
        self.failed: dict[tuple, list[tuple[int, int]]] = {}  # group -> (dp, recompute index)
        self.gates: dict[tuple, bool] = {}
        self.closest: Closest | None = None

    def setup(self, layout: Layout) -> TrainingSetup | None:
        """The layout's set-up, None when the model or the engine refuses it."""
        if layout not in self.setups:
            try:
                setup = self.setup_for(layout)
                validate_setup(self.cfg, Workload(1, self.seq_len), setup)
            except ConfigError:
                setup = None
            self.setups[layout] = setup
        return self.setups[layout]

    def peak(self, setup: TrainingSetup, b: int) -> int:
        accum = self.batch // (setup.dp * b)
        key = (setup, b, accum)
        if key not in self.peaks:
            self.peaks[key] = step_peak(self.cfg, Workload(b, self.seq_len, accum), setup).bytes
        return self.peaks[key]

    def fits(self, setup: TrainingSetup, b: int) -> bool:
        return self.peak(setup, b) <= self.budget

    def ruled_out(self, layout: Layout) -> bool:
        """Whether a failure already seen implies this one: the same group at a dp at least
        as large with recomputation keeping at most as much."""
        r = PLANNED_RECOMPUTE.index(layout.recompute)
        return any(dp >= layout.dp and rf >= r for dp, rf in self.failed.get(layout.group, ()))

    def fail(self, layout: Layout, setup: TrainingSetup | None) -> None:
        """Record a layout no micro-batch fits (and the nearest miss of a valid one)."""
        self.failed.setdefault(layout.group, []).append(
            (layout.dp, PLANNED_RECOMPUTE.index(layout.recompute)))
        if setup is None:
            return
        n = self.batch // layout.dp
        b = min((1, n), key=lambda x: self.peak(setup, x))
        if self.closest is None or self.peak(setup, b) < self.closest.peak:
            self.closest = Closest(layout, b, n // b, self.peak(setup, b))

    def micro_batch(self, layout: Layout) -> int:
        """The plan's micro-batch (module docstring), 0 when none fits. Below B = n (the
        whole per-replica batch, no accumulation) the peak grows with B; B = n drops the
        gradients kept between micro-batches, so it is tried on its own."""
        setup = self.setup(layout)
        if setup is None or self.ruled_out(layout):
            return 0
        n = self.batch // layout.dp
        if layout.pp > 1:  # the smallest that fits: more micro-batches can hold more
            order = tuple(divisors(n))
        elif self.fits(setup, n):
            return n
        else:
            order = (1,)
        b = next((x for x in order if self.fits(setup, x)), 0)
        if b == 0:
            self.fail(layout, setup)
        elif layout.pp == 1:
            below = [d for d in divisors(n) if d < n]
            lo, hi = 0, len(below)  # below[lo] fits; find the last that does
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.fits(setup, below[mid]) else (lo, mid)
            b = below[lo]
        return b

    def gate(self, layout: Layout, largest_dp: int) -> bool:
        """Whether the layout's group fits at all: at its largest dp with full recomputation
        (the least memory the group has), evaluated once per group."""
        if layout.group not in self.gates:
            best = Layout(largest_dp, layout.tp, layout.pp, layout.sp, layout.engine,
                          layout.zero, PLANNED_RECOMPUTE[-1])
            self.gates[layout.group] = self.micro_batch(best) > 0
        return self.gates[layout.group]


def search(cfg: GPTConfig, seq_len: int, batch: int, budget: int, peak_flops: float,
           utilisation: float = 0.4, max_gpus: int = DEFAULT_MAX_GPUS, top: int | None = None,
           setup_for: Callable[[Layout], TrainingSetup] | None = None, lora: bool = False,
           order: str = "time", engines: tuple[str, ...] | None = None) -> PlanSearch:
    """The plans that fit `budget` bytes per GPU for `batch` sequences of `seq_len` tokens per
    step, best first: by step time, then fewer GPUs (`order` "time"), or by GPUs, then time
    (`order` "gpus"); the first `top` of them, or every one (None). `setup_for` gives a
    layout's TrainingSetup (default: `layout_setup` with the family's usual set-up); `engines`
    limits the engines tried (default every registered one)."""
    positive_int("seq_len", seq_len)
    positive_int("max_gpus", max_gpus)
    utilisation = fraction("mfu", utilisation)
    if top is not None:
        positive_int("top", top)
    setup_for = setup_for or (lambda layout: layout_setup(cfg, layout))
    flops = {r: count_flops(cfg, Workload(1, seq_len), recompute=r) for r in PLANNED_RECOMPUTE}
    for name in engines or ():
        engine_named(name)  # an unknown name is ConfigError("engine")
    layouts = candidate_layouts(cfg, seq_len, batch, max_gpus, lora, engines)
    largest = {}
    for layout in layouts:
        largest[layout.group] = max(largest.get(layout.group, 0), layout.dp)
    ev = _Evaluator(cfg, seq_len, batch, budget, setup_for)

    def timed(layout: Layout, b: int, peak: int) -> tuple:
        m = batch // (layout.dp * b)
        fc = flops[layout.recompute]
        s = step_seconds(batch * fc.hardware_total, layout.gpus, peak_flops, utilisation,
                         layout.pp, m)
        ties = (layout.pp, layout.tp, PLANNED_RECOMPUTE.index(layout.recompute), peak,
                layout.engine, layout.zero, layout.dp)
        return (s, layout.gpus, *ties) if order == "time" else (layout.gpus, s, *ties)

    def evaluate(layout: Layout) -> tuple | None:
        if not ev.gate(layout, largest[layout.group]):
            return None
        b = ev.micro_batch(layout)
        if not b:
            return None
        setup, m = ev.setup(layout), batch // (layout.dp * b)
        peak = ev.peak(setup, b)
        key = timed(layout, b, peak)
        s = key[0] if order == "time" else key[1]
        fc = flops[layout.recompute]
        plan = Plan(layout, setup, b, m, peak, s, batch * seq_len / s,
                    batch * fc.training_total / (s * layout.gpus * peak_flops))
        return key, plan

    # the bound: the micro-batch of most micro-batches (B = 1), the smallest peak (0)
    bounds = [(timed(layout, 1, 0), i, None, layout) for i, layout in enumerate(layouts)]
    plans = _best_first(bounds, evaluate, top)
    return PlanSearch(plans, None if plans else ev.closest, len(layouts), len(ev.peaks))


def _best_first(bounds: list, evaluate: Callable, top: int | None) -> list[Plan]:
    """Pop layouts by a lower bound of their key; an evaluated plan goes back in at its own
    key, so a plan comes out only when nothing left could come before it."""
    heapq.heapify(bounds)
    out: list[Plan] = []
    while bounds and (top is None or len(out) < top):
        key, i, plan, layout = heapq.heappop(bounds)
        if plan is not None:
            out.append(plan)
            continue
        found = evaluate(layout)
        if found is not None:
            heapq.heappush(bounds, (found[0], i, found[1], layout))
    return out


__all__ = ["DEFAULT_MAX_GPUS", "DEFAULT_TOKENS_PER_STEP", "PLANNED_RECOMPUTE", "TP_SIZES",
           "Closest", "Layout", "Plan", "PlanSearch", "bubble_fraction", "candidate_layouts",
           "divisors", "engine_stages", "global_batch", "layout_setup", "search",
           "step_seconds"]
