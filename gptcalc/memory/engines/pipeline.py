"""torch.distributed.pipelining's Schedule1F1B, per stage.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ..ledger import GRADIENTS, Ledger, Phase, Term
from .base import Step


KEPT_LOGITS = Term("pipeline: earlier micro-batches' logits (kept for the merged output)")
GRADIENTS_OVER_MICRO_BATCHES = Term("gradients (accumulating over micro-batches)")


def pipeline_adjust(ledger: Ledger, step: Step) -> None:
    """What Schedule1F1B (pp micro-batches) holds on the last stage beyond one micro-batch's
    tensors (measured with MemTracker on CPU/gloo, torch 2.13):

    - the schedule keeps every micro-batch's output (the logits) to return them merged at the
      end of the step: pp - 1 earlier micro-batches' logits beside the current one;
    - the last stage runs each micro-batch's backward right after its forward, so from the
      second micro-batch on the stage's gradients of the earlier ones are alive (the first
      stage runs all pp forwards before its first backward: it holds none at its peak).
    Nothing unless pp > 1, on the last stage. Applied after the engine's terms, whatever the
    engine."""
    setup = step.setup
    if setup.pp == 1 or step.stage != "last":
        return
    kept = (setup.pp - 1) * step.logits
    for phase in (*ledger.forward_phases(), Phase.BACKWARD_START):
        ledger.add(phase, KEPT_LOGITS, kept)
        ledger.add(phase, GRADIENTS_OVER_MICRO_BATCHES, step.gradients)
    ledger.add(Phase.BACKWARD_LAST_BLOCK, KEPT_LOGITS, kept)
    ledger.replace(Phase.BACKWARD_LAST_BLOCK, GRADIENTS, step.gradients)
    ledger.add(Phase.BACKWARD_END, KEPT_LOGITS, kept)


__all__ = ["GRADIENTS_OVER_MICRO_BATCHES", "KEPT_LOGITS", "pipeline_adjust"]
