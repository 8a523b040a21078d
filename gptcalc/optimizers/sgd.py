"""torch.optim.SGD, without and with momentum: both update in place."""

from __future__ import annotations

from typing import ClassVar

from .base import Optimizer, StepView, register


class SGD(Optimizer):
    name = "sgd"
    help = "torch.optim.SGD without momentum: no states"
    state_tensors: ClassVar[int] = 0
    # no states; mode mixed: the fp32 master copy of the weights (4)
    BYTES: ClassVar[dict[str, int]] = {"fp32": 0, "amp": 0, "mixed": 4, "bf16": 0}

    def per_param_bytes(self, mode: str) -> int:
        return self.BYTES[mode]

    def step_temporaries(self, step: StepView) -> int:
        return 0


class SGDMomentum(SGD):
    name = "sgd-momentum"
    help = "torch.optim.SGD with momentum: one momentum_buffer"
    state_tensors: ClassVar[int] = 1
    # momentum_buffer in the parameters' dtype (fp32, or bf16 in mode bf16); mixed: + master
    BYTES: ClassVar[dict[str, int]] = {"fp32": 4, "amp": 4, "mixed": 8, "bf16": 2}


register(SGD())
register(SGDMomentum())
