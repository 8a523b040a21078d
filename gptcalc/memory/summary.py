"""Everything `gptcalc memory` answers for one set-up, and the largest training workloads that
fit (batch and sequence); the set-up's rules are `rules`', inference memory `serving`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import GPTConfig
from ..errors import positive_int
from ..inference.kv import kv_cache_bytes
from ..training_setup import TrainingSetup
from ..workload import Workload
from .activations import activations_paper, checkpoints_on_host, logits_bytes
from .peak import StepPeak, step_account, step_peak
from .engines.shards import stage_of
from .rules import validate_setup
from .serving import largest_fitting, serving_dtype_bytes
from .states import STAGES


# the line of `MemoryReport.unified` that is a paged optimizer's states
UNIFIED_OPTIMIZER = "unified memory (paged optimizer states)"


@dataclass(frozen=True)
class MemoryReport:
    """Everything `gptcalc memory` prints; bytes per device of the most loaded pipeline stage
    (the stage that holds the peak), exact integers."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward, incl. the cross entropy's, excl. the index tensors
    weight_copies: int  # autocast's 16-bit copies of fp32 weights saved for backward (amp)
    activations_paper: int
    logits: int
    kv_cache: int
    resident: int  # what the device keeps between optimizer steps (`engines.resident`)
    peak: StepPeak
    global_batch: int  # sequences per optimizer step: B x dp x grad_accum
    breakdown: dict[str, dict[str, int]]
    # what the host holds for the device, by line (DeepSpeed's offloaded states; {} without)
    host: dict[str, int] = field(default_factory=dict)
    # every pipeline rank's figures (`pipeline_stages`); [] without pipelining
    stages: list[StageFigures] = field(default_factory=list)
    # what the device's process holds in CUDA unified memory, by line, outside the caching
    # allocator and so outside the peak and the reserved bytes (a paged optimizer's states,
    # `states.unified_optimizer_bytes`); {} without
    unified: dict[str, int] = field(default_factory=dict)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def categories(self) -> dict[str, int]:
        """The five categories a stacked plot shows: states, everything saved for backward
        (autocast's weight copies included), the logits. They never all peak together
        (gradients appear as activations are freed); `peak` is the modelled peak."""
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations + self.weight_copies,
                "logits": self.logits}


@dataclass(frozen=True)
class StageFigures:
    """One pipeline rank's blocks, what its schedule keeps alive, its states and its peak."""

    rank: int
    layers: int  # blocks the rank holds (all its virtual stages)
    held_layers: int  # block-micro-batches alive at its heaviest moment
    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward then (autocast's weight copies included)
    peak: int
    peak_phase: str
    # torch.cuda.max_memory_reserved on the rank (`reserved.rank_reserved`; set by the command
    # that simulates it, else None)
    reserved: int | None = None

    def as_dict(self) -> dict[str, int | str]:
        return dict(vars(self))


def pipeline_stages(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                    ) -> list[StageFigures]:
    """Every pipeline rank's `StageFigures`, rank 0 first; [] without pipelining."""
    if setup.pp == 1:
        return []
    out = []
    for r in range(setup.pp):
        a = step_account(cfg, workload, setup, stage_of(setup, r))
        st = a.states
        out.append(StageFigures(
            rank=r, layers=a.hold.layers, held_layers=a.hold.held_layers,
            weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
            activations=sum(v for k, v in a.activations.items() if not k.startswith("input/")),
            peak=a.totals[a.peak_phase], peak_phase=a.peak_phase.label))
    return out


def memory_report(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                  context: int | None = None) -> MemoryReport:
    """States, activations (the implementation's and the paper's), logits, the KV cache of an
    inference run at `context` tokens (default seq_len) in the serving dtype, and the step peak,
    all on the device that holds the peak. Under context parallel a rank's states are sharded
    over dp x cp and its activations are those of its T/cp tokens (`context_parallel`)."""
    validate_setup(cfg, workload, setup)
    ctx = workload.seq_len if context is None else context
    positive_int("context", ctx)
    peak = step_peak(cfg, workload, setup)
    global_batch = workload.global_batch(setup.dp)
    stages = pipeline_stages(cfg, workload, setup)
    # the peak device's account, on its rank's tokens and sharding (context parallel)
    account = step_account(cfg, workload, setup, peak.stage)
    workload, setup, st = account.workload, account.setup, account.states
    acts, offloaded = account.activations, account.offloaded
    copies = {k: v for k, v in acts.items() if k.startswith("weight_copy/")}
    acts = {k: v for k, v in acts.items() if k not in copies}
    paper = activations_paper(cfg, workload, setup)
    logits = logits_bytes(cfg, workload, setup) if account.holds_head else 0
    kept = account.resident
    unified = {UNIFIED_OPTIMIZER: st.unified} if st.unified else {}
    kv = kv_cache_bytes(cfg, workload.batch_size, ctx, serving_dtype_bytes(setup), setup.tp,
                        setup.pp)
    return MemoryReport(
        weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
        activations=sum(v for k, v in acts.items() if not k.startswith("input/")),
        weight_copies=sum(copies.values()), activations_paper=sum(paper.values()),
        logits=logits, kv_cache=kv, resident=sum(kept.values()), peak=peak,
        global_batch=global_batch,
        breakdown={"state": st.breakdown, "activations": acts, "weight_copies": copies,
                   "activations_paper": paper, "peak": peak.lines, "resident": kept,
                   "unified": unified},
        host={**account.host,
              **checkpoints_on_host(cfg, workload, setup, peak.stage),
              **{f"saved activations: {k}": v for k, v in offloaded.items()}},
        stages=stages, unified=unified,
    )


def max_batch(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, budget: int) -> int:
    """The largest micro-batch whose step peak fits `budget` bytes per device; 0 if none."""
    def fits(b: int) -> bool:
        wl = Workload(b, workload.seq_len, workload.grad_accum)
        return step_peak(cfg, wl, setup).bytes <= budget
    return largest_fitting(fits, 1) if fits(1) else 0


def max_seq_len(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, budget: int) -> int:
    """The longest training sequence whose step peak fits `budget` bytes at this micro-batch
    (0 if none). A memory bound: past the block size the model has no positions for it."""
    big = cfg.replace(block_size=max(cfg.block_size, 1 << 62)) if (
        cfg.pos_embedding != "learned") else cfg

    def fits(s: int) -> bool:
        if s > big.block_size:
            return False
        wl = Workload(workload.batch_size, s, workload.grad_accum)
        return step_peak(big, wl, setup).bytes <= budget
    # sequence parallel needs tp | S, context parallel 2 cp | S: search in steps of both
    t = math.lcm(setup.tp if setup.sp else 1, 2 * setup.cp if setup.cp > 1 else 1)
    return t * (largest_fitting(lambda k: fits(k * t), 1) if fits(t) else 0)


__all__ = ["MemoryReport", "STAGES", "UNIFIED_OPTIMIZER", "StageFigures", "pipeline_stages", "max_batch", "max_seq_len",
           "memory_report", "validate_setup"]
