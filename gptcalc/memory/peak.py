"""The peak of one training step per device, as a phase model.

A steady-state step (optimizer states exist; `zero_grad(set_to_none=True)` before it) passes
through five moments (six with SDPA's CPU math path in 16 bit) where live memory can peak.
Each is a sum of named terms:

- forward end: weights, optimizer states, every saved activation, the logits and the loss's
  own transients (what the implementation's loss holds while it is computed);
- backward start: the same, with the logits' gradient being made by the cross entropy;
- backward, last block: saved activations less the loss's, the head's gradients, and the
  largest in-flight tensors of one block's backward (the attention core's or the MLP's);
- backward end: every gradient, a tied embedding's gradient being summed, and the logits the
  caller still holds;
- optimizer step: weights, gradients, optimizer states and the update's temporaries;
- forward, attention core (SDPA's CPU math path on 16-bit inputs only): the saved activations
  made up to the last block's attention core beside the path's fp32 copies, score stacks and
  output (`sdpa_math_output_transients`).

Saved activations go down and gradients up through backward one block at a time, so between
its first and last block live memory moves linearly and the largest value sits at one end: the
phases above cover both ends. `overhead` (framework context, allocator fragmentation,
communication buckets) is added to every phase and always printed: nothing is hidden in a
tolerance. The moments and terms are a `ledger.Ledger`; the set-up's engine then adds or
replaces its own terms and moments (`engines.adjust`: FSDP2's unsharded groups, DDP's
buckets, DeepSpeed's buffers, the pipeline schedule's kept outputs). What is not modelled:
allocator rounding; the measured error against PyTorch's trackers is stated by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..schedules import Stage, StageHold, holds_embedding, stage_hold
from ..schedules import holds_head as stage_holds_head
from ..training_setup import TrainingSetup
from ..workload import Workload
from .activations import device_activations, dtensor_tp, saved_in, transformers_loss
from .context_parallel import (local_workload, ring_backward_bytes, ring_forward_bytes,
                               sharding_setup)
from .compiled import compiled_loss_transients, loss_saves_logits
from .engines import Step, adjust, engine_for, generation, host, resident, state_bytes
from .losses import chunked_loss_transients, fused_loss_transients, logits_alive
from .ledger import (ATTENTION_CORE_TRANSIENTS, BLOCK_GRADIENTS, EMBEDDING_INPUTS, GRADIENTS,
                     GRADIENTS_ACCUMULATING, LOGITS, LOSS_GRADIENT, LOSS_LOGITS_COPY,
                     OFFLOAD_STASH, OFFLOADED_BACK, OPTIMIZER_STATES, OPTIMIZER_TEMPORARIES,
                     OVERHEAD, RECOMPUTED_BLOCK, RING_BACKWARD_BUFFERS, RING_FORWARD_BUFFERS,
                     SAVED, SAVED_TO_ATTENTION_CORE, TARGETS, TIED_EMBEDDING_GRADIENT, WEIGHTS,
                     Ledger, Phase)
from .offload import brought_back_bytes, check_offload, forward_stash_bytes, offload_split
from .profile_litgpt import litgpt_loop, litgpt_loss_transients
from ..optimizers import StepView
from ..optimizers import generation as optimizer_generation
# each optimizer's update of one tensor, read where the step's temporaries are summed
from ..optimizers.adafactor import adafactor_update_temporaries
from ..optimizers.bnb import bnb_8bit_update_temporaries
from ..optimizers.lion import lion_update_temporaries
from ..optimizers.muon import muon_update_temporaries
from .states import StateBytes, largest_tensor, optimizer_of, stage_tensors


@dataclass(frozen=True)
class StepPeak:
    """The largest phase of one training step on the most loaded device."""

    bytes: int
    phase: str  # the label of a `ledger.Phase`: "forward end", "backward start", ...
    stage: Stage  # "first", "last" or a middle pipeline rank (one device when pp == 1)
    why: str
    phases: dict[str, int]  # each phase's total, by label
    lines: dict[str, int] = field(default_factory=dict)  # the terms of the peak phase, by label


def loss_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                    ) -> dict[str, int]:
    """What the loss holds beyond the saved tensors and the logits, at the forward's end and at
    the backward's start, on the device that computes it (vocabulary-parallel over tp).

    Reference model and paper, standard loss: forward: autocast (amp, mixed) runs the cross
    entropy on an fp32 copy of the 16-bit logits (N V 4). backward: log_softmax's backward
    holds the incoming gradient and its result, two N x V tensors in the log-probabilities'
    dtype (fp32 under autocast). transformers: its profile's measured terms
    (`activations.transformers_loss`). megatron-core (its vocab-parallel cross entropy,
    megatron/core/tensor_parallel/cross_entropy.py): the fp32 copy of the logits becomes the
    saved softmax in place, nothing beside it at the forward's end; backward turns that softmax
    into the gradient in place and the upcast's backward makes the logits' gradient in the
    compute dtype, N V a. The chunked and fused losses: `losses`; a compiled loss:
    `compiled.compiled_loss_transients`.
    """
    if loss_saves_logits(setup):  # a compiled loss: Inductor's fused kernels
        return compiled_loss_transients(cfg, workload, setup)
    if setup.loss == "chunked":
        return chunked_loss_transients(cfg, workload, setup)
    if setup.loss == "fused":
        return fused_loss_transients(cfg, workload, setup)
    if setup.impl == "litgpt":  # full.py's chunked_cross_entropy: the profile's own terms
        return litgpt_loss_transients(cfg, workload, setup)
    if setup.impl == "transformers":  # its loss upcasts and shifts: the profile's own terms
        return {k: v // setup.tp for k, v in transformers_loss(cfg, workload, setup).items()}
    n = workload.batch_size * workload.seq_len * -(-cfg.vocab_size // setup.tp)
    if setup.impl == "megatron-core":
        return {"forward": 0, "backward": n * setup.act_bytes}
    autocast = setup.mode in ("amp", "mixed")
    lp = 4 if autocast else setup.act_bytes
    # loss_parallel (torch.distributed.tensor.parallel.loss,
    # _nll_loss_and_log_softmax_backward): `(zeros_like(x) + exp(x)) * grad_output` holds three
    # vocabulary shards at once beside the saved log-probabilities x
    held = 3 if dtensor_tp(setup) else 2
    return {"forward": 4 * n if autocast else 0, "backward": held * n * lp}


def attention_backward_freed(cfg: GPTConfig, acts: dict[str, int], setup: TrainingSetup,
                             blocks: int | None = None) -> int:
    """What one block's backward has released, per device, by the time its written-out
    attention core holds its score gradients: the dropped probabilities `att @ v` saved (its
    backward has run) and, in a block without experts whose MLP has its own input, everything
    the MLP side saved (ln_2, the MLP: its backward runs first, also in a parallel block, whose
    MLP branch is made after the attention's). One block's share of `acts`' layer lines, which
    hold `blocks` block-micro-batches (default L: one micro-batch of every block)."""
    per_block = max(1, cfg.n_layer if blocks is None else blocks)
    freed = ["layer/attn/dropped"]
    if not (cfg.parallel_residual and cfg.shared_norm) and not cfg.n_expert:
        freed += [k for k in acts if k.startswith(("layer/ln_2/", "layer/mlp/"))]
    return sum(acts.get(k, 0) for k in freed) // per_block


def block_backward_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                              freed: int = 0) -> int:
    """The largest set of gradients in flight inside one block's backward, per device, less
    what the block has freed by then.

    Attention written out (manual, SDPA's CPU math path with dropout, or megatron-core without
    Transformer Engine, in the compute dtype): the gradients of the probabilities and of the
    scores, 2 b H S^2 in the scores' dtype, beside q's and k's gradient, less what the block has
    released before (`freed`: `attention_backward_freed`). A fused kernel (SDPA's flash type,
    Transformer Engine's under megatron-core): the gradients of q, k and v, N (Dq + 2 Dkv). MLP: the hidden gradient and the activation's input gradient (gated MLPs:
    gate and up), 2 N d_ff (3 for SwiGLU). Tensor parallel divides heads and d_ff. Plus the
    residual stream's gradient and its copy for the branch, 2 N E in the stream's dtype.
    """
    b, S, t = workload.batch_size, workload.seq_len, setup.tp
    N, a, r = b * S, setup.act_bytes, setup.stream_bytes
    fused = setup.attn_impl == "sdpa" and (cfg.dropout == 0 or setup.device == "cuda")
    if setup.impl == "megatron-core":  # TE's fused attention, or Megatron's unfused core
        fused = setup.megatron_te
    if fused:
        attn = N * (cfg.q_width + 2 * cfg.kv_width) * a // t
    else:
        m = a if setup.attn_impl == "manual" or setup.impl == "megatron-core" else 4
        attn = (2 * b * cfg.n_head * S * S * m + 2 * N * cfg.q_width * m) // t - freed
    mlp = (3 if cfg.mlp in GATED_MLPS else 2) * N * cfg.ffn_dim * a // t
    return max(attn, mlp) + 2 * N * cfg.n_embd * r


def sdpa_math_path_16bit(cfg: GPTConfig, setup: TrainingSetup) -> bool:
    """Whether SDPA runs its decomposed math path on CPU with 16-bit inputs (computed in fp32):
    dropout > 0 without recomputation, causal (no ALiBi bias, no MLA), the reference model."""
    return (setup.attn_impl == "sdpa" and setup.device == "cpu" and cfg.dropout > 0
            and setup.act_bytes != 4 and setup.recompute == "none" and setup.impl != "transformers"
            and cfg.pos_embedding != "alibi" and not cfg.mla and not cfg.attn_sinks)


def sdpa_math_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """Bytes SDPA's CPU math path (taken with dropout) holds beside what it saves, at its last
    saving op (att @ v's operands; checkpoint's early stop ends a recomputation there, before
    the matmul runs). The path upcasts 16-bit q, k, v to fp32, scales q and k (keeping their
    strides), and matmul folds (b, H) into one batch dimension: a view when b, H or S is 1
    (for v also when contiguous: grouped-query's repeat), else a contiguous copy, which matmul
    saves in place of the operand. Alive at the end beside the saved tensors: the float causal
    mask (S^2 fp32); the scaled k when it was copied (fp32, N Dq; the scaled q is dropped
    before); each 16-bit upcast that matmul did not save (q's and k's always, v's when copied),
    and a 16-bit copy of the dropped probabilities (b H S^2); with grouped-query heads the
    core's 16-bit repeats of k and v (N Dq each). The core receives q, k, v in the compute
    dtype (under amp the model casts them before it). Measured with a per-op MemTracker trace
    of the math path (torch 2.13 CPU)."""
    b, S = workload.batch_size, workload.seq_len
    N, a, Dq = b * S, setup.act_bytes, cfg.q_width
    folds = b == 1 or cfg.n_head == 1 or S == 1
    gqa = cfg.kv_heads != cfg.n_head
    k_view, v_view = folds, folds or gqa
    out = S * S * 4 + (0 if k_view else N * Dq * 4)
    if a != 4:
        out += (2 + (not v_view)) * N * Dq * 4 + b * cfg.n_head * S * S * a
        if gqa:  # the core's grouped-query repeats of k and v, 16-bit, before the upcast
            out += 2 * N * Dq * a
    return out


def sdpa_math_output_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                                ) -> int:
    """CPU SDPA math path, 16-bit: what the forward holds beside the saved tensors while the
    path casts its fp32 output back to 16 bit, the largest moment inside the attention core:
    `sdpa_math_transients` (alive at att @ v's operands), att @ v's fp32 output and its 16-bit
    cast, N Dq (4 + a), and the core's inputs, which no op saves (the path computes on fp32
    copies) but the block still holds: each distinct storage q, k and v are views of (the fused
    projection's output N (Dq + 2 Dkv) a, or each projection's own; a q or k that rotary or a
    q/k norm made anew; under amp also the model's 16-bit casts of fp32 ones). Under amp the
    attention's fp32 argument (ln_1's output, N E 4), whose 16-bit cast c_attn saved.
    Measured with a per-op MemTracker trace (torch 2.13 CPU)."""
    from .profile_reference import _qk_sources
    from .profile_reference_modern import SavedLines

    b, S = workload.batch_size, workload.seq_len
    N, a, Dq = b * S, setup.act_bytes, cfg.q_width
    amp = setup.mode == "amp"
    sources = _qk_sources(cfg, N, a, amp, SavedLines())
    inputs = sum({name: nbytes for name, nbytes, _w, _e in sources.values()}.values())
    inputs += sum(N * width * a for _n, _b, width, elem in sources.values() if elem != a)
    return (sdpa_math_transients(cfg, workload, setup) + N * Dq * (4 + a) + inputs
            + (N * cfg.n_embd * 4 if amp else 0))


def saved_before_attention_core(cfg: GPTConfig, acts: dict[str, int], setup: TrainingSetup,
                                blocks: int | None = None) -> int:
    """Saved bytes alive when the forward reaches the last block's attention core output, per
    device: the embeddings', every earlier block's, the last block's ln_1 and attention core
    (its input projection and amp's 16-bit copy of that projection's weight); not yet the
    output projection's input, the residual dropout, ln_2, the MLP, the head or the loss, nor
    the batch (made before the step). `acts` hold `blocks` block-micro-batches (default L)."""
    per_block = max(1, cfg.n_layer if blocks is None else blocks)
    later = ("layer/attn/out_input", "layer/attn/resid_dropout_mask", "weight_copy/attention/out")
    out = 0
    for k, v in acts.items():
        if k.startswith(("final/", "cross_entropy/", "input/", "weight_copy/lm_head")):
            continue
        made = k.startswith(("layer/ln_1/", "layer/attn/", "weight_copy/attention/"))
        if k.startswith(("layer/", "weight_copy/")) and (not made or k in later):
            v -= v // per_block  # the last block has not made it yet
        out += v
    return out


def recomputed_block(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """What recomputation makes again inside one block's backward, per device: the tensors a
    plain block saves less those the recomputed one kept (full: the whole block beside its
    input; selective: the attention core; op: the block less the matmul and attention-kernel
    outputs torchtitan's policy keeps). Korthikanti et al. 2022, sec. 5."""
    if setup.recompute == "none":
        return 0
    from dataclasses import replace

    def layer(s: TrainingSetup) -> int:  # one block of one micro-batch, tp-sharded
        lines = device_activations(cfg, workload, replace(s, pp=1, pp_virtual=1))
        return saved_in(lines, "layer") // cfg.n_layer
    return max(0, layer(replace(setup, recompute="none")) - layer(setup))


def optimizer_temporaries(cfg: GPTConfig, setup: TrainingSetup, st: StateBytes) -> int:
    """Bytes the optimizer's update allocates beside the states: its own step's temporaries
    (`Optimizer.step_temporaries` over the device's tensors: AdamW's foreach path on CUDA over
    its ZeRO partition, one tensor at a time elsewhere, the largest it steps, as the engine
    gives it: `Engine.largest_optimizer_tensor`, a DeepSpeed flat partition is one; on CPU
    AdamW's previous tensor's temporary too, `Engine.optimizer_step_pairs`), in the
    dtype of the weights the optimizer steps (fp32 master weights in mode mixed), and in mode
    mixed the fp32 master weights' gradients, as the engine keeps them
    (`Engine.master_gradient_bytes`).
    """
    engine = engine_for(setup)
    shard = -(-st.params // setup.dp)
    masters = engine.master_gradient_bytes(setup, st.params)
    wb = 4 if setup.mode in ("fp32", "amp", "mixed") else 2
    view = StepView(
        device=setup.device, param_bytes=wb,
        stepped=shard if engine.optimizer_sharded(setup) else st.params,
        largest_stepped=lambda: engine.largest_optimizer_tensor(cfg, setup, st.params),
        largest_param=lambda: largest_tensor(cfg, setup),
        tensors=lambda: stage_tensors(cfg, setup, "first"),
        pairs=lambda: engine.optimizer_step_pairs(cfg, setup, st.stage))
    return masters + optimizer_of(setup).step_temporaries(view)


def optimizer_in_backward(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                          ledger: Ledger) -> None:
    """The gradient and step terms when each parameter steps in its post-accumulate-grad hook
    (torchtune's optimizer_in_bwd: one optimizer per parameter, `step()` then `zero_grad()` in
    the hook registered with `Tensor.register_post_accumulate_grad_hook`). Every gradient is
    freed by its own hook, so at the end of backward and in the last step only the largest
    parameter's gradient exists (wb x `largest_tensor`), beside the temporaries of its one
    update (`optimizer_temporaries` over that tensor alone: AdamW's foreach path over one
    tensor on CUDA, wb n; mode mixed's fp32 master gradient of that tensor). The hooks run
    inside backward, so those temporaries are also counted in the last block's backward and
    at its end, beside the saved activations. Measured against MemTracker on the reference
    model (CPU, gpt2 and llama, fp32 and bf16, AdamW and Lion, B 2 and 8): from 0.5% below to
    7.7% above (the steps inside a block's backward are not walked op by op: the gradients a
    block's hooks have already freed are still counted there). torchtune refuses it with gradient accumulation (the hook would
    step every micro-batch)."""
    if workload.grad_accum > 1:
        raise ConfigError("optimizer_in_backward", "each parameter steps in its gradient hook: "
                                                   "not with gradient accumulation > 1")
    n = largest_tensor(cfg, setup)
    one = setup.weight_bytes * n
    wb = 4 if setup.mode in ("fp32", "amp", "mixed") else 2
    temps = 4 * n if setup.mode == "mixed" else 0
    temps += optimizer_of(setup).update_temporaries(n, setup.device, wb)
    ledger.replace(Phase.BACKWARD_END, GRADIENTS, one)
    # the hooks step inside backward: a block's parameter updates beside its saved activations
    ledger.add(Phase.BACKWARD_LAST_BLOCK, OPTIMIZER_TEMPORARIES, temps)
    ledger.add(Phase.BACKWARD_END, OPTIMIZER_TEMPORARIES, temps)
    ledger.replace(Phase.OPTIMIZER_STEP, GRADIENTS, one)
    ledger.replace(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES, temps)


@dataclass(frozen=True, eq=False)
class StepAccount:
    """One device of one pipeline stage through one training step, built once per (config,
    workload, set-up, stage) by `step_account` and read by every figure of that step: the
    peak (`step_peak`), `memory`'s report and pipeline ranks (`summary`), the allocator replay
    (`reserved`). Under context parallel `workload` and `setup` are the rank's own (its T/cp
    tokens, states sharded over dp x cp: `context_parallel.local_workload`, `sharding_setup`)
    and the ledger holds the ring attention's moments too."""

    cfg: GPTConfig
    workload: Workload  # the rank's micro-batch
    setup: TrainingSetup  # the rank's sharding
    stage: Stage
    states: StateBytes
    activations: dict[str, int]  # every saved line (`activations.device_activations`)
    offloaded: dict[str, int]  # of those, what activation offloading moves to the host
    hold: StageHold  # the blocks and micro-batches alive at the stage's heaviest moment
    holds_head: bool  # the device computes the logits and the loss
    ledger: Ledger  # each moment's terms, engine's included; frozen

    @cached_property
    def totals(self) -> dict[Phase, int]:
        return {p: self.ledger.total(p) for p in self.ledger.phases}

    @cached_property
    def peak_phase(self) -> Phase:
        """The moment with the most bytes (the first of equal ones)."""
        return max(self.totals, key=self.totals.get)

    @cached_property
    def resident(self) -> dict[str, int]:
        """What the device keeps between optimizer steps (`engines.resident`)."""
        return resident(self.cfg, self.setup, self.stage)

    @cached_property
    def host(self) -> dict[str, int]:
        """What the host holds for the device (`engines.host`)."""
        return host(self.cfg, self.setup, self.stage)


def step_account(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
                 ) -> StepAccount:
    """The `StepAccount` of one device of pipeline stage `stage` ("first", "last" or a pipeline
    rank), made by `build_account` once per configuration, workload, set-up and stage (all
    frozen) and state of the engine and optimizer registries."""
    return _account(cfg, workload, setup, stage, (generation(), optimizer_generation()))


# a command asks for the same step many times (its peak, its report, each pipeline rank, the
# allocator replay; plan and fit advice per candidate micro-batch)
@lru_cache(maxsize=4096)
def _account(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage,
             _generation: tuple[int, int]) -> StepAccount:
    return build_account(cfg, workload, setup, stage)


def build_account(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
                  ) -> StepAccount:
    """Each moment's terms on one device of pipeline stage `stage`: the step's own, then the
    engine's and the pipeline schedule's (`engines.adjust`), with the states, saved lines and
    offload split they were made from. Under pipelining the moments are those of the
    micro-batch at which the stage holds the most (`schedules.stage_hold`); the gradients of
    earlier micro-batches are the schedule's terms. Under context parallel, the step of one
    rank's T/cp tokens over states sharded on dp x cp ranks (`context_parallel.local_workload`,
    `sharding_setup`), then the ring attention's own moments (`ring_attention_phases`).
    Use `step_account`, which builds each step once."""
    account = rank_account(cfg, local_workload(workload, setup), sharding_setup(setup), stage)
    if setup.cp > 1:
        ring_attention_phases(cfg, workload, setup, stage, account.ledger,
                              account.activations)
    account.ledger.freeze()
    return account


def stage_ledger(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
                 ) -> Ledger:
    """The (frozen) ledger of `step_account`: each moment's terms on one device of `stage`."""
    return step_account(cfg, workload, setup, stage).ledger


def ring_attention_phases(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: str,
                          ledger: Ledger, acts: dict[str, int]) -> None:
    """The last block's ring attention under context parallel, as two moments of the rank's
    ledger (made on its T/cp tokens, the engine's terms in it).

    forward: the forward end's terms without the logits and the loss's (not made yet), the
    saved activations up to the last block's attention core (`saved_before_attention_core`),
    and the ring's forward buffers (`context_parallel.ring_forward_bytes`).
    backward: the last block's backward's terms, its block gradients in flight replaced by the
    ring's backward buffers (`ring_backward_bytes`), the attention output's gradient
    (N Dq a / tp) and the residual stream's gradient and its copy (2 N E, the stream's dtype);
    with full or selective recomputation the ring's forward runs again inside the backward,
    so the larger of the two rings is counted. `acts`: the rank's saved lines."""
    local, sharded = local_workload(workload, setup), sharding_setup(setup)
    forward = ledger.terms(Phase.FORWARD_END)
    for term in (SAVED, LOGITS, LOSS_LOGITS_COPY):
        forward.pop(term)
    ledger.open(Phase.RING_FORWARD, {
        SAVED_TO_ATTENTION_CORE: saved_before_attention_core(cfg, acts, sharded), **forward,
        RING_FORWARD_BUFFERS: ring_forward_bytes(cfg, workload, setup)})
    n = local.tokens
    dout = n * cfg.q_width * setup.act_bytes // setup.tp
    again = ring_forward_bytes(cfg, workload, setup) if setup.recompute in (
        "full", "selective") else 0
    backward = ledger.terms(Phase.BACKWARD_LAST_BLOCK)
    backward.pop(BLOCK_GRADIENTS)
    ledger.open(Phase.RING_BACKWARD, {
        **backward, RING_BACKWARD_BUFFERS: max(ring_backward_bytes(cfg, workload, setup) + dout,
                                               again)
        + 2 * n * cfg.n_embd * setup.stream_bytes})


def rank_account(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
                 ) -> StepAccount:
    """`build_account` of a set-up without context parallel (or of one context-parallel
    rank's own tokens and sharding), its ledger not yet frozen."""
    st = state_bytes(cfg, setup, stage)
    acts = device_activations(cfg, workload, setup, stage)
    hold = stage_hold(cfg, workload, setup, stage)
    blocks = hold.held_layers
    check_offload(setup)
    # what the device keeps of them (all, unless they are offloaded to the host)
    kept_acts, offloaded = offload_split(cfg, setup, acts, blocks)
    saved = sum(kept_acts.values())
    holds_head = setup.pp == 1 or stage_holds_head(setup, stage)
    # the logits as the loss reads them, and as the training loop holds them through backward
    alive = logits_alive(cfg, workload, setup, engine_for(setup).torch_pipelining)
    logits = alive["forward"] if holds_head else 0
    kept = alive["backward"] if holds_head else 0
    # a compiled loss saves the logits (a saved line) until its backward; the loop's own
    # reference to them counts again only after it
    kept_at_start = 0 if loss_saves_logits(setup) else kept
    if loss_saves_logits(setup):
        logits = 0
    loss = loss_transients(cfg, workload, setup) if holds_head else {"forward": 0,
                                                                     "backward": 0}
    loss_saved = saved_in(kept_acts, "cross_entropy")
    # the head's backward (final norm, lm_head) runs before any block's and frees its inputs
    head_saved = saved_in(kept_acts, "final")
    # with gradient accumulation the gradients of earlier micro-batches are alive throughout
    # (under pipelining --grad-accum counts the schedule's micro-batches: `pipeline_adjust`)
    grads_early = st.gradients if workload.grad_accum > 1 and setup.pp == 1 else 0
    base = {WEIGHTS: st.weights, OPTIMIZER_STATES: st.optimizer, OVERHEAD: setup.overhead}
    engine = engine_for(setup)
    head_grads = 0
    if holds_head and not setup.lora_rank:  # the lm_head's gradient (own or tied), made
        # before the last block's
        shard = -(-cfg.vocab_size // setup.tp) * cfg.n_embd
        split = setup.dp if engine.head_gradient_sharded(setup) else 1
        head_grads = setup.weight_bytes * -(-shard // split)
    # a tied token embedding's backward makes its own gradient and sums it with the lm_head's
    # out of place (AccumulateGrad): two V x E tensors in flight at the end of backward
    tied_grad = 0
    if cfg.tie_embeddings and holds_embedding(setup, stage) and not setup.lora_rank:
        shard = -(-cfg.vocab_size // setup.tp) * cfg.n_embd
        tied_grad = 2 * setup.weight_bytes * -(-shard // (setup.dp if setup.zero >= 2 else 1))
    ledger = Ledger()
    ledger.open(Phase.FORWARD_END, {**base, SAVED: saved, LOGITS: logits,
                                    LOSS_LOGITS_COPY: loss["forward"],
                                    GRADIENTS_ACCUMULATING: grads_early})
    ledger.open(Phase.BACKWARD_START, {**base, SAVED: saved, LOGITS: kept_at_start,
                                       LOSS_GRADIENT: loss["backward"],
                                       GRADIENTS_ACCUMULATING: grads_early})
    # the logits a loop keeps are alive here too but are not counted: the block's gradients in
    # flight are counted whole at once, more than are alive at any one instant of its backward,
    # and counting both overshoots MemTracker (debug GPT-2, L 2, E 64, V 128, fp32, 8 x 16 tokens:
    # the last block's measured backward peak 2,762,232 B, this moment 2,793,200 B, with the
    # logits 2,858,736 B; the DDP, FSDP2 and optimizer-in-backward twins likewise)
    ledger.open(Phase.BACKWARD_LAST_BLOCK, {
        **base, SAVED: saved - loss_saved - head_saved,
        RECOMPUTED_BLOCK: recomputed_block(cfg, workload, setup),
        GRADIENTS: max(grads_early, head_grads),
        BLOCK_GRADIENTS: block_backward_transients(
            cfg, workload, setup, attention_backward_freed(cfg, acts, setup, blocks))})
    ledger.open(Phase.BACKWARD_END, {
        **base, GRADIENTS: st.gradients, TIED_EMBEDDING_GRADIENT: tied_grad, LOGITS: kept,
        EMBEDDING_INPUTS: saved_in(acts, "embedding", "input")})
    ledger.open(Phase.OPTIMIZER_STEP, {
        **base, GRADIENTS: st.gradients,
        OPTIMIZER_TEMPORARIES: optimizer_temporaries(cfg, setup, st),
        TARGETS: 8 * workload.tokens if holds_head else 0})
    if sdpa_math_path_16bit(cfg, setup):
        # inside the last block's forward; the engine's forward-end terms apply here too
        ledger.open(Phase.ATTENTION_CORE, {
            **base, SAVED_TO_ATTENTION_CORE: saved_before_attention_core(cfg, acts, setup,
                                                                  blocks),
            ATTENTION_CORE_TRANSIENTS: sdpa_math_output_transients(cfg, workload,
                                                                   setup) // setup.tp,
            GRADIENTS_ACCUMULATING: grads_early})
    if setup.optimizer_in_backward:
        optimizer_in_backward(cfg, workload, setup, ledger)
    if setup.offload_activations:
        stash = forward_stash_bytes(cfg, setup, offloaded, blocks)
        ledger.add(Phase.FORWARD_END, OFFLOAD_STASH, stash)
        ledger.add(Phase.BACKWARD_START, OFFLOAD_STASH, stash)
        ledger.add(Phase.BACKWARD_LAST_BLOCK, OFFLOADED_BACK,
                   brought_back_bytes(cfg, setup, offloaded, blocks))
    if setup.impl == "litgpt":  # its rope cache; the loop's logits bound to the next step
        litgpt_loop(ledger, cfg, workload, setup)
    # an engine's own moment (FSDP2's root all-gather at backward start) starts from the
    # forward's tensors without the loss's transients
    forward = {**base, SAVED: saved, LOGITS: kept_at_start, GRADIENTS_ACCUMULATING: grads_early}
    adjust(ledger, Step(cfg, workload, setup, stage, logits, st.gradients, forward))
    return StepAccount(cfg=cfg, workload=workload, setup=setup, stage=stage, states=st,
                       activations=acts, offloaded=offloaded, hold=hold, holds_head=holds_head,
                       ledger=ledger)


def pipeline_ranks(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                   ) -> list[Stage]:
    """The pipeline ranks whose peaks can differ, one of each kind: ranks with the same blocks,
    the same micro-batches alive at their heaviest moment and neither the embedding nor the
    head hold the same bytes (1F1B's middle ranks differ in what they hold; GPipe's do not).
    The first and last are "first" and "last"."""
    if setup.pp == 1:
        return ["first"]
    out: list[Stage] = ["first"]
    seen = set()
    for r in range(1, setup.pp - 1):
        h = stage_hold(cfg, workload, setup, r)
        key = (h.layers, h.held_layers, h.backward_done)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out + ["last"]


def stage_why(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage) -> str:
    """Why a pipeline stage is the most loaded, in words."""
    h = stage_hold(cfg, workload, setup, stage)
    name = stage if isinstance(stage, str) else f"rank {stage}"
    parts = [f"{h.layers} blocks", f"{h.held_layers} block-micro-batches of activations alive "
             f"under {setup.pp_schedule} ({h.micro_batches} micro-batches)"]
    if stage_holds_head(setup, stage):
        parts.append("the logits and the lm_head")
    elif holds_embedding(setup, stage):
        parts.append("the embeddings")
    return f"the {name} pipeline stage is the most loaded (it holds {', '.join(parts)})"


def step_peak(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
              stage: Stage | None = None) -> StepPeak:
    """The peak of one training step on the most loaded device: the largest phase of
    `stage_ledger` over the pipeline ranks (`pipeline_ranks`: the first holds the most
    micro-batches of activations under 1F1B, the last the logits and the head); on a device of
    `stage` when given."""
    best: StepPeak | None = None
    stages = (stage,) if stage is not None else pipeline_ranks(cfg, workload, setup)
    for stage in stages:
        account = step_account(cfg, workload, setup, stage)
        totals, phase = account.totals, account.peak_phase
        if best is None or totals[phase] > best.bytes:
            why = phase.why
            if setup.pp > 1:
                why += "; " + stage_why(cfg, workload, setup, stage)
            best = StepPeak(bytes=totals[phase], phase=phase.label, stage=stage, why=why,
                            phases={p.label: v for p, v in totals.items()},
                            lines=account.ledger.labelled()[phase.label])
    assert best is not None
    return best


__all__ = ["StepAccount", "StepPeak", "adafactor_update_temporaries", "attention_backward_freed",
           "block_backward_transients", "bnb_8bit_update_temporaries", "build_account",
           "lion_update_temporaries", "loss_transients", "muon_update_temporaries",
           "optimizer_in_backward", "optimizer_temporaries", "pipeline_ranks", "rank_account",
           "recomputed_block", "ring_attention_phases", "saved_before_attention_core",
           "sdpa_math_output_transients", "sdpa_math_path_16bit", "sdpa_math_transients",
           "stage_ledger", "stage_why", "step_account", "step_peak"]
