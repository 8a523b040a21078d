"""Training layouts that fit a GPU's memory, ranked by their step time.

A layout is data parallelism dp, tensor parallelism tp (sequence parallel with it where tp
divides the sequence), pipeline stages pp (1F1B, or interleaved 1F1B with two chunks per stage
where they divide the blocks), context parallelism cp, a training engine at one of its ZeRO
stages, and an activation recomputation; a plan is a layout with the micro-batch B and the
accumulation (grad_accum = global batch / (dp x B)) that reach the global batch. Its peak is
the step peak of `gptcalc.memory` on its most loaded device, exactly what `gptcalc memory`
prints for it; its step time is `gptcalc.time.step_time`'s, exactly what `gptcalc time` prints
for it (compute op by op, exposed communication, the bubble). With a given utilisation (`mfu`)
the step time is instead the FLOPs a step executes over gpus x dense peak x utilisation,
stretched by the 1F1B bubble (pp - 1) / grad_accum.

The search space: tp in 1, 2, 4, 8 (one node of 8 GPUs) as the model's heads and widths allow;
pp dividing the blocks; cp in 1, 2, 4, 8 dividing the sequence into chunks of at least
`MIN_CP_CHUNK` tokens (context parallelism is for long sequences); dp dividing the global batch;
at most `max_gpus` = dp x tp x pp x cp (or exactly `gpus`); every registered engine at each
ZeRO stage it runs (ZeRO 1-3 only with dp > 1: with one replica there is nothing to shard);
recomputation none, selective or full. Under LoRA only data parallelism (the memory model's
scope). The micro-batch is the largest that fits (no pipeline: a larger one runs matmuls
better and gathers FSDP's shards fewer times), or the smallest that fits under a pipeline (the
most micro-batches, the smallest bubble).

Pruning rests on monotony the tests check by brute force: without a pipeline a step's peak
grows with B at a given accumulation (under one, where the accumulation is the schedule's
micro-batches, the last stage keeps every micro-batch's logits and input gradients: each B is
tried), shrinks as dp grows past 1 (more sharding, a smaller micro-batch; one replica has no
data-parallel buffers, so dp = 1 is compared with itself only) and as recomputation keeps less
(none > selective > full). The search is best-first on a lower bound of each layout's step
time (its executed FLOPs at the card's best efficiency, no memory traffic, communication or
bubble): a layout's memory is evaluated only when it could rank, a group of layouts (tp, pp,
cp, schedule, engine, stage, one replica or several) that does not fit at its largest dp with
full recomputation is never evaluated again, a pipeline's micro-batch whose first or last
rank alone overflows is ruled out before every rank is replayed, and every step peak is
computed once, for the ranking and the fewest-GPU answer alike. The search stops after
`max_evaluations` step peaks and says so.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config import GPTConfig
from .errors import ConfigError, fraction, positive_int
from .flops import count_flops
from .params import count_params
from .gpus import GPU, require_peak
from .memory import step_peak, validate_setup
from .memory.verdict import Verdict, verdict, verdict_floor
from .memory.ledger import (GRADIENTS, OPTIMIZER_STATES, OPTIMIZER_TEMPORARIES, WEIGHTS,
                             Phase)
from .memory.peak import StepAccount, step_account
from .memory.reserved import nvidia_smi_lines
from .schedules import stage_hold
from .memory.engines import engine_named, names
from .training import resolve_training
from .time import step_time
from .training_setup import TrainingSetup
from .workload import Workload

# recomputation modes the planner tries, the one that keeps most first
PLANNED_RECOMPUTE = ("none", "selective", "full")
TP_SIZES = (1, 2, 4, 8)  # tensor parallelism within one node of 8 GPUs (NVLink)
CP_SIZES = (1, 2, 4, 8)
# context parallel's smallest chunk per rank: below it the ring's messages are too small to hide
# behind attention (torchtitan and Megatron-LM use cp for 32K-token and longer sequences)
MIN_CP_CHUNK = 4096
# a bound on the step peaks one search computes; past it the search says it stopped
DEFAULT_MAX_EVALUATIONS = 20_000
# the ranking's rule for equal step times, printed with every plan list
TIE_RULE = ("equal step times: fewer GPUs, then fewer pipeline stages, narrower tensor "
            "parallelism, less recomputation, lower peak")
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
    cp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def group(self) -> tuple:
        """The layouts whose peaks the search compares: all but dp and recomputation, and
        whether there is more than one replica (data parallelism's buffers, such as DDP's
        gradient buckets, exist only then)."""
        return (self.tp, self.pp, self.sp, self.cp, self.schedule, self.virtual, self.engine,
                self.zero, self.dp > 1)


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
    # what the card must hold by `memory`'s verdict (`Verdict.must_hold`); None where the
    # search fits by the allocated peak alone (not `judged`)
    must_hold: int | None = None

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
    fewest: Plan | None = None  # the fastest plan on the fewest GPUs that fit
    capped: bool = False  # stopped at max_evaluations step peaks


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
                      lora: bool = False, engines: tuple[str, ...] | None = None,
                      gpus: int | None = None) -> list[Layout]:
    """Every layout of the search space (module docstring), exactly `gpus` GPUs when given;
    validity against the model is checked later, when a layout is evaluated."""
    tps = (1,) if lora else tuple(t for t in TP_SIZES if cfg.n_head % t == 0)
    pps = (1,) if lora else divisors(cfg.n_layer)
    cps = (1,) if lora else tuple(c for c in CP_SIZES if seq_len % (2 * c) == 0
                                  and seq_len // c >= MIN_CP_CHUNK or c == 1)
    limit = gpus or max_gpus
    out = []
    for tp, pp, cp in ((t, p, c) for t in tps for p in pps for c in cps if t * p * c <= limit):
        schedules = [("1f1b", 1)] + ([("interleaved-1f1b", 2)] if pp > 1 and (
            cfg.n_layer // pp) % 2 == 0 else [])
        for dp in divisors(batch):
            if dp * tp * pp * cp > limit or (gpus and dp * tp * pp * cp != gpus):
                continue
            for (engine, zero), (schedule, v) in ((e, s) for e in engine_stages(engines)
                                                  for s in schedules):
                if zero and dp * cp == 1:
                    continue
                out += [Layout(dp, tp, pp, tp > 1 and seq_len % tp == 0, engine, zero, r, cp,
                               schedule, v) for r in PLANNED_RECOMPUTE]
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
               "recompute": layout.recompute, "cp": layout.cp, "pp_schedule": layout.schedule,
               "pp_virtual": layout.virtual}
    return resolve_training(cfg, sections, options, from_hf)[0]


def states_lower_bound(cfg: GPTConfig, setup: TrainingSetup, gradients: bool = True) -> int:
    """Bytes every step peak of `setup` holds at least on its most loaded rank, at the
    optimizer step: its share of the model (tp x pp) as weights (over dp x cp under ZeRO-3)
    and gradients (over dp x cp from ZeRO-2) in their stored dtype, and for AdamW its two
    fp32 states and, under mode mixed, the fp32 master weights (over dp x cp when the
    optimizer is sharded). 0 where the set-up can keep states off the GPU, in other dtypes
    or free gradients early (LoRA, a quantised base, an engine's offload or other settings,
    the optimizer in backward), which this bound does not follow."""
    if (setup.lora_rank or setup.engine_settings or setup.base_dtype != "same"
            or setup.optimizer_in_backward or setup.optimizer != "adamw"):
        return 0
    params = count_params(cfg).total / (setup.tp * setup.pp)
    shard = setup.dp * setup.cp
    weights = params * setup.weight_bytes / (shard if setup.zero == 3 else 1)
    grads = params * setup.weight_bytes / (shard if setup.zero >= 2 else 1) if gradients else 0
    sharded = setup.zero >= 1 or (setup.engine == "megatron" and setup.distributed_optimizer)
    states = (8 + (4 if setup.mode == "mixed" else 0)) * params / (shard if sharded else 1)
    return int(weights + grads + states)


def activations_lower_bound(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """Bytes of saved activations the first pipeline rank (the only rank without one) holds
    at least at its heaviest moment: every block of each micro-batch alive then
    (`schedules.stage_hold`'s held_layers) keeps at least its input, b S/cp E in the residual
    stream's dtype, sequence-sharded over tp under sp (what full recomputation saves of a
    block; the other recomputations save it and more). 0 where activations can leave the GPU
    (offloaded) or the set-up is outside `states_lower_bound`'s scope."""
    if setup.offload_activations or states_lower_bound(cfg, setup) == 0:
        return 0
    held = stage_hold(cfg, workload, setup, "first").held_layers
    tokens = workload.batch_size * workload.seq_len // setup.cp
    return held * tokens * cfg.n_embd * setup.stream_bytes // (setup.tp if setup.sp else 1)


# the optimizer step's terms that hold the model's states: none depends on the micro-batch
STATE_TERMS = (WEIGHTS, OPTIMIZER_STATES, GRADIENTS, OPTIMIZER_TEMPORARIES)


def states_at_step(account: StepAccount) -> int:
    """Bytes of a rank's states at its optimizer step (`memory.peak.step_account`'s ledger,
    engine and pipeline terms applied): weights, optimizer states, gradients and the
    optimizer's temporaries. They are the model's states, the same at every micro-batch (a
    test checks it against every micro-batch's ledger), and the rank's peak is at least
    their sum: a rank whose states overflow at one micro-batch overflows at all."""
    terms = account.ledger.terms(Phase.OPTIMIZER_STEP)
    return sum(terms.get(t, 0) for t in STATE_TERMS)


class _Evaluator:
    """Step peaks of layouts, each computed once, and what their failures rule out."""

    def __init__(self, cfg: GPTConfig, seq_len: int, batch: int, budget: int,
                 setup_for: Callable[[Layout], TrainingSetup], judged: bool = False) -> None:
        self.cfg, self.seq_len, self.batch, self.budget = cfg, seq_len, batch, budget
        self.judged = judged  # fit by `memory`'s verdict, not the allocated peak alone
        self.setup_for = setup_for
        self.setups: dict[Layout, TrainingSetup | None] = {}
        self.peaks: dict[tuple, int] = {}
        self.floors: dict[tuple, bool] = {}
        self.verdicts: dict[tuple, Verdict | None] = {}
        self.exact = False  # judge by the whole verdict (a replay each), not its floor
        self.failed: dict[tuple, list[tuple[int, int]]] = {}  # group -> (dp, recompute index)
        self.gates: dict[tuple, bool] = {}
        self.rooms: dict[TrainingSetup, int] = {}
        self.overflowing: set[TrainingSetup] = set()  # no micro-batch fits (`rank_exceeds`)
        self.closest: Closest | None = None
        self.missed: list[tuple[Layout, TrainingSetup]] = []  # valid layouts that failed
        self.pruned: list[tuple[Layout, TrainingSetup]] = []  # by the states bound alone

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
        accum = self.batch // (setup.dp * b)
        if (setup, b, accum) not in self.peaks and (
                setup in self.overflowing or self.bound_exceeds(setup, b, accum)
                or self.rank_exceeds(setup, b, accum)):
            return False
        if self.peak(setup, b) > self.budget or (self.judged and not self.floor(setup, b)):
            return False
        return self.holds(setup, b) if self.exact else True

    def _judge(self, setup: TrainingSetup, b: int, whole: bool) -> Verdict | None:
        """The verdict (`whole`) or its floor of the step at micro-batch b; None where the
        rules refuse the workload (`memory` refuses it too)."""
        accum = self.batch // (setup.dp * b)
        workload = Workload(b, self.seq_len, accum)
        try:
            if not whole:
                return verdict_floor(self.cfg, workload, setup, self.budget)
            return verdict(self.cfg, workload, setup, self.budget,
                           allocated=self.peak(setup, b))
        except ConfigError:
            return None

    def floor(self, setup: TrainingSetup, b: int) -> bool:
        """The verdict's floor (`memory.verdict.verdict_floor`): the allocated peak with the
        CUDA context and NCCL's buffers within the budget; no allocator replay."""
        key = (setup, b)
        if key not in self.floors:
            low = self._judge(setup, b, whole=False)
            self.floors[key] = low is not None and low.fits
        return self.floors[key]

    def holds(self, setup: TrainingSetup, b: int) -> bool:
        """`memory`'s verdict: what the card must hold (reserved, the CUDA context, NCCL's
        buffers; `memory.verdict`) within the budget. It costs an allocator replay, so the
        search ranks on the floor and a plan is confirmed by this before it is answered."""
        key = (setup, b)
        if key not in self.verdicts:
            self.verdicts[key] = self._judge(setup, b, whole=True)
        found = self.verdicts[key]
        return found is not None and found.fits

    def must_hold(self, setup: TrainingSetup, b: int) -> int | None:
        """The verdict's bytes (`Verdict.must_hold`) where `holds` has asked it, else None."""
        found = self.verdicts.get((setup, b))
        return None if found is None else found.must_hold

    def confirmed_micro_batch(self, layout: Layout, b: int) -> int:
        """The plan's micro-batch under the whole verdict: `b` when it holds there, else
        the layout's micro-batch searched again by the verdict (0 when none holds)."""
        setup = self.setup(layout)
        if self.holds(setup, b):
            return b
        self.exact = True
        try:
            return self.micro_batch(layout, record=False)
        finally:
            self.exact = False

    def bound_exceeds(self, setup: TrainingSetup, b: int, accum: int) -> bool:
        """Whether the first rank's weights and optimizer states (`states_lower_bound`
        without the gradients, which an early moment may not hold yet) and the block inputs
        it saves (`activations_lower_bound`) alone overflow the budget."""
        workload = Workload(b, self.seq_len, accum)
        return (states_lower_bound(self.cfg, setup, gradients=False)
                + activations_lower_bound(self.cfg, workload, setup)) > self.room(setup)

    def rank_exceeds(self, setup: TrainingSetup, b: int, accum: int) -> bool:
        """Whether the first or the last pipeline rank alone overflows the budget: the step
        peak is the largest over the ranks (`step_peak`), those two among them, so it
        overflows too; one rank's account instead of every distinct rank's. A rank whose
        states alone overflow (`states_at_step`) does so at every micro-batch: the set-up is
        kept in `overflowing`, and no other micro-batch of it is evaluated."""
        if setup.pp == 1:
            return False
        workload = Workload(b, self.seq_len, accum)
        for stage in ("first", "last"):
            account = step_account(self.cfg, workload, setup, stage)
            if states_at_step(account) > self.room(setup):
                self.overflowing.add(setup)
            if account.totals[account.peak_phase] > self.room(setup):
                return True
        return False

    def room(self, setup: TrainingSetup) -> int:
        """The most a step peak may be: the budget, less (judged by the verdict) the CUDA
        context and NCCL's buffers, which the verdict's floor adds to the peak."""
        if setup not in self.rooms:
            fixed = 0
            if self.judged and setup.device == "cuda":
                smi = nvidia_smi_lines(0, setup)
                fixed = smi["CUDA context"] + smi["NCCL buffers"]
            self.rooms[setup] = self.budget - fixed
        return self.rooms[setup]

    def states_exceed(self, setup: TrainingSetup) -> bool:
        """Whether the states alone overflow the budget (`states_lower_bound`): no micro-batch
        fits, and no step peak needs computing."""
        return states_lower_bound(self.cfg, setup) > self.room(setup)

    def ruled_out(self, layout: Layout) -> bool:
        """Whether a failure already seen implies this one: the same group at a dp at least
        as large with recomputation keeping at most as much."""
        r = PLANNED_RECOMPUTE.index(layout.recompute)
        return any(dp >= layout.dp and rf >= r for dp, rf in self.failed.get(layout.group, ()))

    def fail(self, layout: Layout, setup: TrainingSetup | None) -> None:
        """Record a layout no micro-batch fits (its nearest miss is found only when nothing
        fits: `nearest`)."""
        self.failed.setdefault(layout.group, []).append(
            (layout.dp, PLANNED_RECOMPUTE.index(layout.recompute)))
        if setup is not None:
            self.missed.append((layout, setup))

    def nearest(self, layout: Layout, setup: TrainingSetup) -> None:
        """Keep the layout's smallest peak (B = 1 or the whole share) if it is the nearest
        miss so far."""
        n = self.batch // layout.dp
        b = min((1, n), key=lambda x: self.peak(setup, x))
        if self.closest is None or self.peak(setup, b) < self.closest.peak:
            self.closest = Closest(layout, b, n // b, self.peak(setup, b))

    def micro_batch(self, layout: Layout, record: bool = True) -> int:
        """The plan's micro-batch (module docstring), 0 when none fits. Below B = n (the
        whole per-replica batch, no accumulation) the peak grows with B; B = n drops the
        gradients kept between micro-batches, so it is tried on its own."""
        setup = self.setup(layout)
        if setup is None or self.ruled_out(layout):
            return 0
        if self.states_exceed(setup):
            self.failed.setdefault(layout.group, []).append(
                (layout.dp, PLANNED_RECOMPUTE.index(layout.recompute)))
            self.pruned.append((layout, setup))
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
            if record:
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
            best = dataclasses.replace(layout, dp=largest_dp, recompute=PLANNED_RECOMPUTE[-1])
            self.gates[layout.group] = self.micro_batch(best) > 0
        return self.gates[layout.group]


class _Capped(Exception):
    """The search reached its bound on step peaks."""


def _lower_bound(cfg: GPTConfig, seq_len: int, g: GPU, precision: str, float8: bool
                 ) -> Callable[[Layout, int], float]:
    """A lower bound of a layout's step seconds for `batch` sequences: the FLOPs its compute
    model executes (causal attention, a flash-type backward, the recomputation) spread evenly
    over its GPUs at the card's best peak and best efficiency, and the pipeline bubble's
    (pp - 1) / v slots of one sequence (the smallest micro-batch) at that rate; no memory
    traffic or communication. 0.9 of it, against rounding of the per-rank shares."""
    from .time.compute import ATTENTION_EFFICIENCY, MATMUL_EFFICIENCY

    eff = max(g.matmul_efficiency or MATMUL_EFFICIENCY,
              g.attention_efficiency or ATTENTION_EFFICIENCY)
    # float8 Linears (the set-ups' `float8`, one for every layout) run at the fp8 peak
    peaks = {p for p in (precision, "fp8" if float8 else precision)
             if g.peak_flops(p) is not None}
    fastest = max(require_peak(g, p) for p in peaks)
    per_sequence = {}
    for r in PLANNED_RECOMPUTE:
        fc = count_flops(cfg, Workload(1, seq_len), causal=True, recompute=r,
                         flash_backward=True)
        per_sequence[r] = fc.hardware_total - 3 * fc.forward.get("embedding/proj", 0)

    def bound(layout: Layout, batch: int) -> float:
        # the bubble: (pp - 1) / v slots of at least one sequence each (B >= 1), the
        # schedules planned (1F1B, interleaved 1F1B) leave no slot's compute unexposed
        sequences = batch / layout.dp + (layout.pp - 1) / layout.virtual
        return 0.9 * sequences * per_sequence[layout.recompute] / (
            layout.gpus / layout.dp * fastest * eff)
    return bound


def _check_search(seq_len: int, max_gpus: int, gpus: int | None, max_evaluations: int,
                  mfu: float | None, top: int | None) -> float | None:
    """The search's sizes, each refused in one line naming it; `mfu` checked."""
    positive_int("seq_len", seq_len)
    positive_int("max_gpus", max_gpus)
    if gpus is not None:
        positive_int("gpus", gpus)
    positive_int("max_evaluations", max_evaluations)
    if top is not None:
        positive_int("top", top)
    return None if mfu is None else fraction("mfu", mfu)


def _plan_key(layout: Layout, s: float, peak: int, by: str) -> tuple:
    """A plan's place: by step time, then GPUs (`by` "time"), or by GPUs, then step time;
    then the tie rule (`TIE_RULE`)."""
    ties = (layout.pp, layout.tp, PLANNED_RECOMPUTE.index(layout.recompute), peak,
            layout.cp, layout.schedule, layout.engine, layout.zero, layout.dp)
    return (s, layout.gpus, *ties) if by == "time" else (layout.gpus, s, *ties)


def _search_space(cfg: GPTConfig, seq_len: int, batch: int, max_gpus: int, lora: bool,
                  engines: tuple[str, ...] | None, gpus: int | None) -> tuple:
    """`search`'s space: the FLOPs of one sequence by planned recomputation, the candidate
    layouts, and the most replicas of each layout group (its gate). An unknown engine name
    is ConfigError("engine")."""
    flops = {r: count_flops(cfg, Workload(1, seq_len), recompute=r) for r in PLANNED_RECOMPUTE}
    for name in engines or ():
        engine_named(name)
    layouts = candidate_layouts(cfg, seq_len, batch, max_gpus, lora, engines, gpus)
    largest: dict[tuple, int] = {}
    for layout in layouts:
        largest[layout.group] = max(largest.get(layout.group, 0), layout.dp)
    return flops, layouts, largest


def search(cfg: GPTConfig, seq_len: int, batch: int, budget: int, gpu: GPU,
           precision: str = "bf16", mfu: float | None = None, max_gpus: int = DEFAULT_MAX_GPUS,
           top: int | None = None, setup_for: Callable[[Layout], TrainingSetup] | None = None,
           lora: bool = False, order: str = "time", engines: tuple[str, ...] | None = None,
           gpus: int | None = None, max_step_seconds: float | None = None,
           max_evaluations: int = DEFAULT_MAX_EVALUATIONS, node: int | None = None,
           judged: bool = False, fewest: bool = True) -> PlanSearch:
    """The plans that fit `budget` bytes per GPU for `batch` sequences of `seq_len` tokens per
    step on `gpu`, best first: by step time, then the tie rule (`order` "time"), or by GPUs,
    then time (`order` "gpus"); the first `top` of them, or every one (None); only those of
    exactly `gpus` GPUs, or of at most `max_step_seconds` per step, when given. The answer
    also names the fastest plan on the fewest GPUs, from the same step peaks. `setup_for`
    gives a layout's TrainingSetup (default: `layout_setup` with the family's usual set-up);
    `engines` limits the engines tried (default every registered one); `mfu` replaces the
    step model by a utilisation of the executed FLOPs (module docstring). `judged`: fit by
    `memory.verdict` (as `gptcalc plan` answers), else by the allocated peak alone; `fewest`
    False leaves the fewest-GPU plan out (None) and its search undone."""
    mfu = _check_search(seq_len, max_gpus, gpus, max_evaluations, mfu, top)
    setup_for = setup_for or (lambda layout: layout_setup(cfg, layout))
    peak_flops = require_peak(gpu, precision)
    flops, layouts, largest = _search_space(cfg, seq_len, batch, max_gpus, lora, engines, gpus)
    ev = _Evaluator(cfg, seq_len, batch, budget, setup_for, judged)
    probe = next((x for x in (ev.setup(y) for y in layouts) if x is not None), None)
    bound = _lower_bound(cfg, seq_len, gpu, precision,
                         probe is None or probe.float8 != "none")

    times: dict[tuple[Layout, int], float] = {}  # step seconds by layout and micro-batch

    def seconds(layout: Layout, setup: TrainingSetup, b: int) -> float:
        m = batch // (layout.dp * b)
        if mfu is not None:
            return step_seconds(batch * flops[layout.recompute].hardware_total, layout.gpus,
                                peak_flops, mfu, layout.pp, m)
        if (layout, b) not in times:
            times[layout, b] = step_time(cfg, setup, b, seq_len, m, gpu, precision,
                                         node).step_seconds
        return times[layout, b]

    key = _plan_key

    def evaluate(layout: Layout, by: str) -> tuple | None:
        if len(ev.peaks) >= max_evaluations:
            raise _Capped
        # by GPUs the gate's own evaluation (the group's most replicas) is rarely one the
        # answer needs: it is asked only where it is known already
        gated = by == "time" or layout.group in ev.gates
        if gated and not ev.gate(layout, largest[layout.group]):
            return None
        full = dataclasses.replace(layout, recompute=PLANNED_RECOMPUTE[-1])
        if by == "gpus" and full != layout and not ev.micro_batch(full):
            return None  # the least memory at this dp does not fit: rules out the others
        found = build(layout, ev.micro_batch(layout), by)
        if found is None or not judged:
            return found
        return confirm_bound(layout, found[1], by), found[1]

    def confirm_bound(layout: Layout, plan: Plan, by: str) -> tuple:
        """A lower bound of the plan's key once the verdict confirms it: the verdict may move
        its micro-batch, down without a pipeline (where the step time does not fall as B
        shrinks: a test checks it) and up under one (the least step time of the micro-batches
        from B up), and the peak with it (0 here)."""
        s = plan.step_seconds
        if layout.pp > 1:
            n = batch // layout.dp
            s = min(seconds(layout, plan.setup, b) for b in divisors(n) if b >= plan.micro_batch)
        return key(layout, s, 0, by)

    def confirm(layout: Layout, plan: Plan, by: str) -> tuple | None:
        """The plan as `memory`'s verdict answers it (`_Evaluator.confirmed_micro_batch`)."""
        return build(layout, ev.confirmed_micro_batch(layout, plan.micro_batch), by)

    def build(layout: Layout, b: int, by: str) -> tuple | None:
        if not b:
            return None
        setup, m = ev.setup(layout), batch // (layout.dp * b)
        peak = ev.peak(setup, b)
        s = seconds(layout, setup, b)
        if max_step_seconds is not None and s > max_step_seconds:
            return None
        fc = flops[layout.recompute]
        plan = Plan(layout, setup, b, m, peak, s, batch * seq_len / s,
                    batch * fc.training_total / (s * layout.gpus * peak_flops),
                    ev.must_hold(setup, b))
        return key(layout, s, peak, by), plan

    def bound_key(layout: Layout, by: str) -> tuple:
        if mfu is not None:  # the utilisation model's own bound: B = 1 (most micro-batches)
            return key(layout, step_seconds(batch * flops[layout.recompute].hardware_total,
                                            layout.gpus, peak_flops, mfu, layout.pp,
                                            batch // layout.dp), 0, by)
        return key(layout, bound(layout, batch), 0, by)

    def refine(layout: Layout, by: str) -> tuple | None:
        """A tighter bound, no memory: the step time at its fastest micro-batch (the whole
        share without a pipeline); None when refused or past `max_step_seconds`."""
        if mfu is not None:
            return bound_key(layout, by)
        setup = ev.setup(layout)
        if setup is None:
            return None
        n = batch // layout.dp
        s = min(seconds(layout, setup, b) for b in ((n,) if layout.pp == 1 else divisors(n)))
        if max_step_seconds is not None and s > max_step_seconds:
            return None
        return key(layout, s, 0, by)

    def ranked(by: str, first: int | None) -> list[Plan]:
        # by GPUs every layout on fewer GPUs than the answer has its memory evaluated: a
        # tighter time bound first would only add a step time to each
        stage = 1 if by == "gpus" else 0
        return _best_first([(bound_key(x, by), i, stage, None, x)
                            for i, x in enumerate(candidates)],
                           lambda x: evaluate(x, by), lambda x: refine(x, by), first,
                           (lambda x, plan: confirm(x, plan, by)) if judged else None)

    candidates = [layout for layout in layouts if max_step_seconds is None or (
        mfu is not None or bound(layout, batch) <= max_step_seconds)]
    return _answer(ev, len(layouts), ranked, order, top, fewest)


def _answer(ev: "_Evaluator", n_layouts: int, ranked: Callable, order: str, top: int | None,
            fewest: bool) -> PlanSearch:
    """`search`'s answer: the plans ranked by `order`, the fastest on the fewest GPUs (when
    `fewest`) from the same step peaks, or the nearest miss when nothing fits."""
    capped, plans, least = False, [], None
    try:
        plans = ranked(order, top)
        least = next(iter(ranked("gpus", 1)), None) if fewest else None
    except _Capped:
        capped = True
    if not plans and not capped:  # the nearest miss among the layouts that failed
        for layout, setup in ev.missed + ev.pruned:
            ev.nearest(layout, setup)
    return PlanSearch(plans, None if plans else ev.closest, n_layouts, len(ev.peaks), least,
                      capped)


def _best_first(bounds: list, evaluate: Callable, refine: Callable, top: int | None,
                confirm: Callable | None = None) -> list[Plan]:
    """Pop layouts by a lower bound of their key: a cheap one first, then (`refine`) a tighter
    one, then the layout's own key once its memory is evaluated by the verdict's floor (with
    `confirm`: a lower bound of the key the whole verdict may move it to), then (`confirm`) its
    key once the whole verdict is asked; a plan comes out only when nothing left could come
    before it. The plans are returned in the order of their keys, whatever the bounds."""
    heapq.heapify(bounds)
    out: list[tuple[tuple, int, Plan]] = []
    while bounds and (top is None or len(out) < top):
        key, i, stage, plan, layout = heapq.heappop(bounds)
        if stage == 3 or (stage == 2 and confirm is None):
            out.append((key, i, plan))
            continue
        if stage == 2:
            found = confirm(layout, plan)
            if found is not None:
                heapq.heappush(bounds, (found[0], i, 3, found[1], layout))
            continue
        found = refine(layout) if stage == 0 else evaluate(layout)
        if found is None:
            continue
        if stage == 0:
            heapq.heappush(bounds, (found, i, 1, None, layout))
        else:
            heapq.heappush(bounds, (found[0], i, 2, found[1], layout))
    return [plan for _key, _i, plan in sorted(out, key=lambda x: x[:2])]


__all__ = ["CP_SIZES", "DEFAULT_MAX_EVALUATIONS", "DEFAULT_MAX_GPUS", "DEFAULT_TOKENS_PER_STEP",
           "MIN_CP_CHUNK", "PLANNED_RECOMPUTE", "TIE_RULE", "TP_SIZES",
           "Closest", "Layout", "Plan", "PlanSearch", "bubble_fraction", "candidate_layouts",
           "divisors", "engine_stages", "global_batch", "layout_setup", "search",
           "states_at_step", "states_lower_bound", "activations_lower_bound",
           "step_seconds"]
