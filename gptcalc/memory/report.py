"""Everything `gptcalc memory` answers for one set-up, and the largest workloads that fit: the
largest batch and sequence of a training step, the longest context of an inference run (its KV
cache counted by `gptcalc.inference.kv`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import GPTConfig
from ..errors import ConfigError, positive_int
from ..families import modern_switches
from ..inference.kv import kv_cache_bytes
from ..layers import global_layers
from ..schedules import check_pipeline, stage_hold
from ..schedules import holds_head as stage_holds_head
from ..training_setup import TrainingSetup, matmul4bit_keeps_input
from ..workload import Workload, validate_workload
from .finetune import ATTENTION_TARGETS, lora_on_transformers
from .activations import (activations_paper, check_profile, checkpoints_on_host,
                          device_activations, logits_bytes)
from .context_parallel import check_context_parallel, local_workload, sharding_setup
from .offload import offload_split
from .peak import StepPeak, step_peak
from .engines import engine_for, host, resident, state_bytes
from .engines.shards import stage_of
from .states import STAGES, stage_params


# switches beyond the classic blocks whose LoRA memory is measured: sliding windows (PEFT on
# transformers' Mistral, tests/test_lora_peak.py, and the reference model), a shared parallel
# norm (GPT-J's and Phi's block, which the transformers profile does not model: the reference
# model with PEFT-shaped adapters, tests/test_memory_finetune.py)
LORA_MEASURED_SWITCHES = ("sliding windows", "a shared parallel norm")


def validate_setup(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> None:
    """Parallel sizes must divide what they shard (Megatron-LM's rules; the pipeline
    schedules' in `schedules.check_pipeline`); data parallelism shards nothing of the
    micro-batch, so any dp is valid. The engine must run the set-up (`engines.engine_for`),
    context parallel torch's ring (`context_parallel.check_context_parallel`)."""
    engine = engine_for(setup)
    validate_workload(cfg, workload)
    check_context_parallel(cfg, workload, setup, engine.context_parallel)
    t, p = setup.tp, setup.pp
    for what, size in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads),
                       ("d_ff", cfg.ffn_dim), ("n_embd", cfg.n_embd)):
        if size % t:
            raise ConfigError("tp", f"tp {t} does not divide {what} {size}")
    local = workload.seq_len // setup.cp  # a context-parallel rank's tokens
    if setup.sp and t > 1 and (workload.seq_len % t or local % t):
        raise ConfigError("sp", f"sequence parallel needs tp {t} to divide seq_len "
                                f"{workload.seq_len}" + (f" / cp = {local}" if setup.cp > 1
                                                         else ""))
    check_pipeline(cfg, workload, setup)
    if setup.lora_rank and (t > 1 or p > 1):
        raise ConfigError("lora_rank", "LoRA memory is modelled with data parallelism (and ZeRO) "
                                       "only, not with tp or pp")
    unmeasured = [s for s in modern_switches(cfg) if s not in LORA_MEASURED_SWITCHES]
    if cfg.sliding_window is not None and "G" in cfg.attn_pattern.upper():
        unmeasured.append("a pattern of global and sliding layers")  # every layer sliding only
    if setup.lora_rank and unmeasured and not lora_on_transformers(cfg, setup):
        raise ConfigError("lora_rank", "LoRA memory is measured on the classic GPT-2 / Llama "
                                       f"blocks, not with {', '.join(unmeasured)}")
    if setup.lora_rank:
        from ..lora import covered, parse_targets

        parse_targets(",".join(setup.lora_targets), cfg)  # each target exists in this model
        if cfg.moe and matmul4bit_keeps_input(setup):
            raise ConfigError("bnb_version", "the 4-bit inputs bitsandbytes before 0.43.2 keeps "
                                             "are modelled for dense blocks; transformers' fused "
                                             "experts are not bitsandbytes Linears: give "
                                             "--bnb-version 0.43.2 or later")
        if cfg.moe and not covered(cfg, setup.lora_targets) & ATTENTION_TARGETS:
            raise ConfigError("lora_targets", "LoRA on a mixture of experts is modelled with an "
                                              "attention projection among the targets (the "
                                              "first block's experts ahead of the first adapter "
                                              "are not measured)")
    if setup.optimizer == "muon" and (setup.zero or setup.tp > 1 or setup.pp > 1 or setup.ep > 1
                                      or setup.lora_rank or setup.optimizer_in_backward
                                      or not engine_for(setup).replicated(setup)):
        raise ConfigError("optimizer", "muon is modelled on one device or DDP (each rank "
                                       "orthogonalises whole matrices): not with ZeRO, a "
                                       "sharding engine, tp, pp, ep, LoRA or the optimizer in "
                                       "backward")
    if setup.ep > 1 and (not cfg.moe or cfg.n_expert % setup.ep):
        raise ConfigError("ep", f"ep {setup.ep} must divide the routed experts "
                                f"({cfg.n_expert if cfg.moe else 0})")
    check_profile(cfg, setup)


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
        stage = stage_of(setup, r)
        hold = stage_hold(cfg, workload, setup, stage)
        st = state_bytes(cfg, setup, stage)
        acts = device_activations(cfg, workload, setup, stage)
        peak = step_peak(cfg, workload, setup, stage=stage)
        out.append(StageFigures(
            rank=r, layers=hold.layers, held_layers=hold.held_layers,
            weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
            activations=sum(v for k, v in acts.items() if not k.startswith("input/")),
            peak=peak.bytes, peak_phase=peak.phase))
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
    workload, setup = local_workload(workload, setup), sharding_setup(setup)
    st = state_bytes(cfg, setup, peak.stage)
    acts = device_activations(cfg, workload, setup, peak.stage)
    _, offloaded = offload_split(cfg, setup, acts,
                                 stage_hold(cfg, workload, setup, peak.stage).held_layers)
    copies = {k: v for k, v in acts.items() if k.startswith("weight_copy/")}
    acts = {k: v for k, v in acts.items() if k not in copies}
    paper = activations_paper(cfg, workload, setup)
    holds_head = setup.pp == 1 or stage_holds_head(setup, peak.stage)
    logits = logits_bytes(cfg, workload, setup) if holds_head else 0
    kept = resident(cfg, setup, peak.stage)
    kv = kv_cache_bytes(cfg, workload.batch_size, ctx, serving_dtype_bytes(setup), setup.tp,
                        setup.pp)
    return MemoryReport(
        weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
        activations=sum(v for k, v in acts.items() if not k.startswith("input/")),
        weight_copies=sum(copies.values()), activations_paper=sum(paper.values()),
        logits=logits, kv_cache=kv, resident=sum(kept.values()), peak=peak,
        global_batch=global_batch,
        breakdown={"state": st.breakdown, "activations": acts, "weight_copies": copies,
                   "activations_paper": paper, "peak": peak.lines, "resident": kept},
        host={**host(cfg, setup, peak.stage),
              **checkpoints_on_host(cfg, workload, setup, peak.stage),
              **{f"saved activations: {k}": v for k, v in offloaded.items()}},
        stages=pipeline_stages(cfg, workload, setup),
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


__all__ = ["MemoryReport", "STAGES", "StageFigures", "pipeline_stages", "max_batch", "max_seq_len", "memory_report",
           "validate_setup"]


def serving_dtype_bytes(setup: TrainingSetup) -> int:
    """Bytes per element a model trained with `setup` is served in: fp32 stays fp32, every other
    mode serves its 16-bit compute dtype."""
    return 4 if setup.mode == "fp32" else 2


def inference_bytes(cfg: GPTConfig, batch_size: int, context: int, setup: TrainingSetup) -> int:
    """Weights in the serving dtype plus the KV cache (`gptcalc.inference.kv.kv_cache_bytes`),
    on the most loaded device of the set-up's tensor and pipeline layout (activations of one
    decoded token are not counted)."""
    w = serving_dtype_bytes(setup)
    n = max(sum(v.values()) for v in stage_params(cfg, setup).values())
    return n * w + kv_cache_bytes(cfg, batch_size, context, w, setup.tp, setup.pp)


def max_context(cfg: GPTConfig, batch_size: int, setup: TrainingSetup, budget: int
                ) -> int | None:
    """The longest context whose inference memory fits `budget` bytes, exactly: 0 if the
    weights alone do not fit; None when no context is too long (every block's cache is bounded
    by a sliding window). The cache only grows with the context: a doubling search, then
    bisection, with no ceiling."""
    def fits(c: int) -> bool:
        return inference_bytes(cfg, batch_size, c, setup) <= budget
    if not fits(1):
        return 0
    if global_layers(cfg) == 0:
        return None
    return largest_fitting(fits, 1)


def largest_fitting(fits, lo: int) -> int:
    """The largest n >= lo with fits(n), for a monotone `fits` with fits(lo) true: doubling,
    then bisection; exact, with no ceiling."""
    hi = lo * 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
