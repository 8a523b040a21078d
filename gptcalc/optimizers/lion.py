"""lion-pytorch's Lion (Chen et al. 2023): one moment."""

from __future__ import annotations

from .base import Optimizer, register

# exp_avg (`zeros_like(p)`), in the parameters' dtype; mode mixed: + the fp32 master copy
LION_BYTES = {"fp32": 4, "amp": 4, "mixed": 8, "bf16": 2}


def lion_update_temporaries(n: int, param_bytes: int) -> int:
    """Bytes lion-pytorch's Lion allocates while it updates one tensor of `n` elements
    (lion_pytorch/lion_pytorch.py, `update_fn`): `exp_avg.clone()` and its `.add(grad)`, two
    tensors in the parameter's dtype, 2 n x param_bytes (the sign is taken in place)."""
    return 2 * n * param_bytes


class Lion(Optimizer):
    name = "lion"
    help = "lion-pytorch's Lion: one moment"

    def per_param_bytes(self, mode: str) -> int:
        return LION_BYTES[mode]

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        return lion_update_temporaries(n, param_bytes)


register(Lion())
