"""transformers' Adafactor (Shazeer & Stern 2018) with its defaults: a factored second moment,
no first moment."""

from __future__ import annotations

import math
from typing import ClassVar

from .base import Optimizer, register

# transformers' Adafactor keeps state["RMS"], the parameter's RMS, as a 0-d fp32 tensor (its
# step is a Python int)
RMS_BYTES = 4


def adafactor_state_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of transformers' Adafactor states for one tensor of `shape` (its defaults:
    beta1=None, so no `exp_avg`).

    transformers/optimization.py, `Adafactor.step`: a tensor of 2 or more dims keeps a factored
    second moment, `exp_avg_sq_row` of shape[:-1] and `exp_avg_sq_col` of shape[:-2] +
    shape[-1:]; a 1-D one the full `exp_avg_sq`. The states are fp32 (made `.to(grad)` after
    16-bit gradients are upcast). Its scalars: `RMS_BYTES`.
    """
    if len(shape) >= 2:
        rows = math.prod(shape[:-1])
        cols = math.prod(shape[:-2]) * shape[-1]
        return 4 * (rows + cols)
    return 4 * math.prod(shape)


def adafactor_update_temporaries(n: int, param_bytes: int) -> int:
    """Bytes transformers' Adafactor allocates while it updates one tensor of `n` elements
    (transformers/optimization.py, `Adafactor.step`, on CPU and CUDA alike): two fp32 tensors
    of the tensor's size at once (`grad**2` and `grad**2 + eps`; the old and the new `update`
    of `_approx_sq_grad` or `exp_avg_sq.rsqrt()`; `update` and `-update`), 8 n, plus the fp32
    copies of a 16-bit gradient and parameter (`grad.float()`, `p.float()`, 4 n each). Not
    counted: a factored update's row and column vectors beside them (`_approx_sq_grad`'s
    factors, 4 (R + C + 1) bytes for an R x C tensor)."""
    return 8 * n + (8 * n if param_bytes != 4 else 0)


class Adafactor(Optimizer):
    name = "adafactor"
    help = "transformers' Adafactor: factored second moment, no first moment"
    shaped: ClassVar[bool] = True
    step_counter_bytes: ClassVar[int] = RMS_BYTES

    def tensor_state_bytes(self, shape: tuple[int, ...], mode: str) -> int:
        """`adafactor_state_bytes` beside mode mixed's 4-byte master copy per element."""
        return (4 * math.prod(shape) if mode == "mixed" else 0) + adafactor_state_bytes(shape)

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        return adafactor_update_temporaries(n, param_bytes)


register(Adafactor())
