"""torch.distributed.pipelining's Schedule1F1B, per stage.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...training_setup import TrainingSetup
from ...workload import Workload


def pipeline_phase_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                         stage: str, logits: int, gradients: int) -> dict[str, dict[str, int]]:
    """What Schedule1F1B (pp micro-batches) holds on the last stage beyond one micro-batch's
    tensors (measured with MemTracker on CPU/gloo, torch 2.13):

    - the schedule keeps every micro-batch's output (the logits) to return them merged at the
      end of the step: pp - 1 earlier micro-batches' logits beside the current one;
    - the last stage runs each micro-batch's backward right after its forward, so from the
      second micro-batch on the stage's gradients of the earlier ones are alive (the first
      stage runs all pp forwards before its first backward: it holds none at its peak).
    Empty unless pp > 1."""
    if setup.pp == 1 or stage != "last":
        return {}
    kept = {"pipeline: earlier micro-batches' logits (kept for the merged output)":
            (setup.pp - 1) * logits}
    grads = {"gradients (accumulating over micro-batches)": gradients}
    return {"forward end": {**kept, **grads}, "backward start": {**kept, **grads},
            "backward, last block": {**kept, "gradients": gradients},
            "backward end": kept, "optimizer step": {}}


__all__ = ["pipeline_phase_terms"]
