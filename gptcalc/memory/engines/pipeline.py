"""A pipeline schedule's own terms per stage (torch.distributed.pipelining's schedules, as
`gptcalc.schedules` replays them).

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...schedules import Stage, holds_head, rank_chunks, stage_hold
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..ledger import GRADIENTS, Ledger, Phase, Term
from .base import Step, engine_for


KEPT_LOGITS = Term("pipeline: earlier micro-batches' logits (kept for the merged output)")
GRADIENTS_OVER_MICRO_BATCHES = Term("gradients (accumulating over micro-batches)")
RECEIVE_BUFFERS = Term("pipeline: p2p receive buffers (one per micro-batch and chunk)")
INPUT_GRADIENTS = Term("pipeline: input gradients kept on the receive buffers")


def stream_buffer_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """One micro-batch's residual stream between stages: b S E in the stream's dtype,
    sequence-sharded under sp."""
    return (workload.batch_size * workload.seq_len * cfg.n_embd * setup.stream_bytes
            // (setup.tp if setup.sp else 1))


def receive_buffers(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage
                    ) -> int:
    """Bytes of the receive buffers a pipeline rank's stages keep beside the saved tensors.

    A PipelineStage allocates, once for the step's m micro-batches and kept across steps, one
    buffer per micro-batch for its input activation (every chunk but the first,
    `_create_act_recv_info`) and one for its output's gradient (every chunk but the last,
    `_create_grad_recv_info`; torch/distributed/pipelining/stage.py, torch 2.13). A received
    activation becomes the chunk's input, which its first block saves: the buffers of the
    micro-batches alive at the stage's heaviest moment are saved activations already. Each
    buffer is one micro-batch's residual stream, b S E in the stream's dtype, sequence-sharded
    under sp."""
    hold = stage_hold(cfg, workload, setup, stage)
    m, last = hold.micro_batches, setup.pp * setup.pp_virtual - 1
    n = stream_buffer_bytes(cfg, workload, setup)
    count = 0
    for alive, c in zip(hold.alive, rank_chunks(setup, stage)):
        count += (m - alive if c != 0 else 0) + (m if c != last else 0)
    return count * n


def input_gradients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, stage: Stage,
                    at_end: bool = False) -> int:
    """Bytes of the input gradients a rank's chunks keep: a received activation is a leaf that
    requires grad, so each backward of a chunk but the first leaves the input's gradient on
    its receive buffer (`.grad`), freed only when the next step begins
    (`_PipelineStageBase.clear_runtime_states`, torch/distributed/pipelining/stage.py,
    torch 2.13). At the stage's heaviest moment: the backwards run by then
    (`StageHold.backwards`); `at_end`: all m per chunk."""
    hold = stage_hold(cfg, workload, setup, stage)
    count = 0
    for done, c in zip(hold.backwards, rank_chunks(setup, stage)):
        if c != 0:
            count += hold.micro_batches if at_end else done
    return count * stream_buffer_bytes(cfg, workload, setup)


def merges_outputs(setup: TrainingSetup) -> bool:
    """Whether the last pipeline stage keeps every micro-batch's output (the logits) until the
    step ends. torch.distributed.pipelining does: its schedules' `step(..., return_outputs=
    True)` (the default) appends each output to `output_chunks` (`save_forward_output`,
    torch/distributed/pipelining/stage.py, torch 2.13) to merge them, and its loss_fn reads
    them without freeing them. Megatron-LM does not: its last stage's forward step returns
    the loss (`forward_step_calc_loss` replaces the output by `loss_func(output_tensor)`,
    megatron/core/pipeline_parallel/schedules.py, NVIDIA/Megatron-LM commit 00611e6e; GPTModel
    computes the per-token loss inside its forward), so only the loss is kept per micro-batch,
    and the logits die with the forward as without a pipeline (`Engine.torch_pipelining`
    False: the engine runs its own schedule)."""
    return setup.pp > 1 and engine_for(setup).torch_pipelining


def pipeline_adjust(ledger: Ledger, step: Step) -> None:
    """What a pipeline schedule holds on a stage beyond the micro-batches' saved tensors, at
    the stage's heaviest moment (`schedules.stage_hold`; measured with MemTracker on CPU/gloo,
    torch 2.13):

    - the last stage keeps every micro-batch's output (the logits) to return them merged at
      the end of the step (`schedule.step`'s return_outputs): m - 1 earlier micro-batches'
      logits beside the current one, where the engine's stages are torch's
      (`merges_outputs`; Megatron-LM keeps only each micro-batch's loss);
    - every moment, where the engine's stages are torch's (`Engine.torch_pipelining`): the
      p2p receive buffers of its chunks (`receive_buffers`) and the input gradients left on
      them by the backwards run so far (`input_gradients`); they grow with m;
    - where a backward has run on the stage before that moment (1F1B's stages that run more
      micro-batches than their warm-up forwards: the last always; GPipe's never), the
      stage's gradients of the earlier micro-batches are alive, as the engine keeps them
      across micro-batches (`Engine.pipeline_accumulation`: FSDP2 defers its reduce-scatter
      and keeps unsharded gradients; at the end of the last backward always).
    Nothing unless pp > 1. Applied after the engine's terms, whatever the engine."""
    setup = step.setup
    if setup.pp == 1:
        return
    hold = stage_hold(step.cfg, step.workload, setup, step.stage)
    kept = (hold.micro_batches - 1) * step.logits if (
        holds_head(setup, step.stage) and merges_outputs(setup)) else 0
    grads = step.gradients if hold.backward_done else 0
    accumulated = engine_for(setup).pipeline_accumulation(step.cfg, setup, step.stage)
    if accumulated is not None:  # the engine's own (FSDP2's unsharded gradients and blocks)
        grads = 0
        for phase in (*ledger.forward_phases(), Phase.BACKWARD_START, Phase.BACKWARD_LAST_BLOCK,
                      Phase.BACKWARD_END):
            for term, nbytes in accumulated.items():
                ledger.add(phase, term, nbytes if hold.backward_done or
                           phase is Phase.BACKWARD_END else 0)
    if engine_for(setup).torch_pipelining:
        buffers = receive_buffers(step.cfg, step.workload, setup, step.stage)
        kept_grads = input_gradients(step.cfg, step.workload, setup, step.stage)
        end_grads = input_gradients(step.cfg, step.workload, setup, step.stage, at_end=True)
        for phase in ledger.phases:
            ledger.add(phase, RECEIVE_BUFFERS, buffers)
            late = phase in (Phase.BACKWARD_END, Phase.OPTIMIZER_STEP)
            ledger.add(phase, INPUT_GRADIENTS, end_grads if late else kept_grads)
    for phase in (*ledger.forward_phases(), Phase.BACKWARD_START):
        ledger.add(phase, KEPT_LOGITS, kept)
        ledger.add(phase, GRADIENTS_OVER_MICRO_BATCHES, grads)
    ledger.add(Phase.BACKWARD_LAST_BLOCK, KEPT_LOGITS, kept)
    if grads:
        ledger.replace(Phase.BACKWARD_LAST_BLOCK, GRADIENTS, step.gradients)
    ledger.add(Phase.BACKWARD_END, KEPT_LOGITS, kept)


__all__ = ["GRADIENTS_OVER_MICRO_BATCHES", "INPUT_GRADIENTS", "KEPT_LOGITS", "RECEIVE_BUFFERS",
           "input_gradients", "merges_outputs", "pipeline_adjust", "receive_buffers", "stream_buffer_bytes"]
