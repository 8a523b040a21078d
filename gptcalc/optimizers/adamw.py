"""torch.optim.AdamW (and Adam, whose states are the same)."""

from __future__ import annotations

from typing import ClassVar

from .base import Optimizer, StepView, register

# exp_avg + exp_avg_sq: fp32 in modes fp32 and amp, bf16 in bf16; mode mixed: the ZeRO paper's
# K (Rajbhandari et al. 2020, sec. 3.1), the fp32 master copy of the weights (4) belongs to the
# optimizer, with Adam's fp32 momentum and variance (4 + 4) = 12
ADAMW_BYTES = {"fp32": 8, "amp": 8, "mixed": 12, "bf16": 4}
# torch.optim.AdamW keeps state["step"] as a 0-d float32 tensor per parameter tensor
STEP_COUNTER_BYTES = 4


class AdamW(Optimizer):
    name = "adamw"
    help = "default; torch.optim.AdamW"
    state_tensors: ClassVar[int] = 2
    step_counter_bytes: ClassVar[int] = STEP_COUNTER_BYTES

    def per_param_bytes(self, mode: str) -> int:
        return ADAMW_BYTES[mode]

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        """CUDA: the foreach path's `_foreach_sqrt` of exp_avg_sq, one tensor of the size of
        those it steps (n x param_bytes). CPU, the single-tensor path: `denom =
        (exp_avg_sq.sqrt() / bias_correction2_sqrt)` makes two tensors of the tensor's size."""
        return param_bytes * n * (1 if device == "cuda" else 2)

    def step_temporaries(self, step: StepView) -> int:
        """CUDA: the foreach path over every tensor the device steps at once (its ZeRO
        partition when sharded). CPU: `_single_tensor_adam` (torch/optim/adam.py) one tensor
        at a time, `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: the loop
        rebinds `denom` only once the new one exists, so the previous tensor's denom is alive
        beside this tensor's two, max over consecutive tensors of (prev + 2 this) x
        param_bytes (`StepView.pairs`; without them, two of the device's largest parameter)."""
        if step.device == "cuda":
            return self.update_temporaries(step.stepped, "cuda", step.param_bytes)
        pairs = list(step.pairs())
        if pairs:
            return max(prev + 2 * n for prev, n in pairs) * step.param_bytes
        return self.update_temporaries(step.largest_param(), "cpu", step.param_bytes)


register(AdamW())
