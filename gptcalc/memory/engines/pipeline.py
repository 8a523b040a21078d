"""A pipeline schedule's own terms per stage (torch.distributed.pipelining's schedules, as
`gptcalc.schedules` replays them).

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...schedules import holds_head, stage_hold
from ..ledger import GRADIENTS, Ledger, Phase, Term
from .base import Step


KEPT_LOGITS = Term("pipeline: earlier micro-batches' logits (kept for the merged output)")
GRADIENTS_OVER_MICRO_BATCHES = Term("gradients (accumulating over micro-batches)")


def pipeline_adjust(ledger: Ledger, step: Step) -> None:
    """What a pipeline schedule holds on a stage beyond the micro-batches' saved tensors, at
    the stage's heaviest moment (`schedules.stage_hold`; measured with MemTracker on CPU/gloo,
    torch 2.13):

    - the last stage keeps every micro-batch's output (the logits) to return them merged at
      the end of the step (`schedule.step`'s return_outputs): m - 1 earlier micro-batches'
      logits beside the current one;
    - where a backward has run on the stage before that moment (1F1B's stages that run more
      micro-batches than their warm-up forwards: the last always; GPipe's never), the
      stage's gradients of the earlier micro-batches are alive.
    Nothing unless pp > 1. Applied after the engine's terms, whatever the engine."""
    setup = step.setup
    if setup.pp == 1:
        return
    hold = stage_hold(step.cfg, step.workload, setup, step.stage)
    kept = (hold.micro_batches - 1) * step.logits if holds_head(setup, step.stage) else 0
    grads = step.gradients if hold.backward_done else 0
    for phase in (*ledger.forward_phases(), Phase.BACKWARD_START):
        ledger.add(phase, KEPT_LOGITS, kept)
        ledger.add(phase, GRADIENTS_OVER_MICRO_BATCHES, grads)
    ledger.add(Phase.BACKWARD_LAST_BLOCK, KEPT_LOGITS, kept)
    if grads:
        ledger.replace(Phase.BACKWARD_LAST_BLOCK, GRADIENTS, step.gradients)
    ledger.add(Phase.BACKWARD_END, KEPT_LOGITS, kept)


__all__ = ["GRADIENTS_OVER_MICRO_BATCHES", "KEPT_LOGITS", "pipeline_adjust"]
