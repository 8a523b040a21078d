"""bitsandbytes' AdamW family (bitsandbytes/optim/optimizer.py, `Optimizer2State`, 0.50): the
8-bit block-wise AdamW8bit, and the paged optimizers PagedAdamW8bit and PagedAdamW (32-bit).

`Optimizer2State.get_state_buffer`: on CUDA a paged optimizer's state1 and state2 of a tensor of
at least 10^5 elements are `F.get_paged` buffers, cudaMallocManaged (unified) memory outside
PyTorch's caching allocator, paged to the host under memory pressure; smaller tensors' states,
the absmax vectors and the quantization maps are ordinary device tensors. On CPU paged
optimizers fall back to ordinary tensors (with a warning)."""

from __future__ import annotations

import math
from typing import ClassVar

from .base import Optimizer, register

# `min_8bit_size=4096` (smaller tensors keep 32-bit states), `blocksize = 256` in init_state (one
# fp32 absmax per block of each state), and the two quantization maps `name2qmap["dynamic"]` /
# `["udynamic"]` (`F.create_dynamic_map`, 256 fp32 each), made once per optimizer and shared by
# every tensor
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_BYTES = 2 * 256 * 4
# get_state_buffer: `if not self.is_paged or p.numel() < 1e5: return torch.zeros_like(...)`
PAGED_MIN_ELEMENTS = 10**5


def bnb_8bit_state_bytes(n: int) -> int:
    """Bytes of bitsandbytes' AdamW8bit states for one tensor of `n` elements.

    `Optimizer2State.init_state`: a tensor with fewer than min_8bit_size (4096) elements keeps
    fp32 state1 and state2, 8 n, whatever its dtype; a larger one keeps uint8 state1 and state2
    (2 n) and an fp32 `absmax1` and `absmax2` of ceil(n / 256) blocks each. The quantization
    maps are the optimizer's, not the tensor's (`AdamW8bit.fixed_bytes`); `step` is a Python
    int.
    """
    if n < BNB_MIN_8BIT_SIZE:
        return 8 * n
    return 2 * n + 2 * 4 * -(-n // BNB_BLOCKSIZE)


def bnb_8bit_update_temporaries(n: int, device: str, param_bytes: int) -> int:
    """Bytes bitsandbytes' AdamW allocates while it updates one tensor of `n` elements.

    CUDA: its fused kernels (`optimizer_update_8bit_blockwise`, `optimizer_update_32bit` in
    bitsandbytes/backends/cuda/ops.py) update the parameter and the states in place: none.
    CPU (bitsandbytes/backends/cpu/ops.py, 0.50): `_optimizer_update_8bit_blockwise_cpu`
    dequantizes both states to fp32 (2 x 4 n), upcasts the gradient (`g.float() *
    gnorm_scale`, 4 n) and, while `denom = (state2.sqrt() / correction2)` is made, holds the
    square root and the quotient (2 x 4 n): 20 n, plus the fp32 copy of a 16-bit parameter
    (`p.data.float()`, 4 n). A tensor under min_8bit_size takes `_optimizer_update_32bit_cpu`:
    the fp32 gradient, the square root and `sqrt + eps` (12 n), plus the 16-bit parameter's
    copy."""
    if device == "cuda":
        return 0
    copy = 4 * n if param_bytes != 4 else 0
    return (20 if n >= BNB_MIN_8BIT_SIZE else 12) * n + copy


class AdamW8bit(Optimizer):
    name = "adamw8bit"
    help = "bitsandbytes' AdamW8bit: 8-bit block-wise states"
    state_tensors: ClassVar[int] = 2
    shaped: ClassVar[bool] = True

    def tensor_state_bytes(self, shape: tuple[int, ...], mode: str) -> int:
        """`bnb_8bit_state_bytes` beside mode mixed's 4-byte master copy per element."""
        n = math.prod(shape)
        return (4 * n if mode == "mixed" else 0) + bnb_8bit_state_bytes(n)

    def fixed_bytes(self, sizes: list[int]) -> int:
        """The two quantization maps (`BNB_QMAP_BYTES`), made when a first tensor of at least
        min_8bit_size elements gets 8-bit states."""
        return BNB_QMAP_BYTES if any(n >= BNB_MIN_8BIT_SIZE for n in sizes) else 0

    def buffer_bytes(self, shape: tuple[int, ...], mode: str) -> int:
        """state1 and state2 (the absmax vectors are ordinary device tensors)."""
        n = math.prod(shape)
        return 8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        return bnb_8bit_update_temporaries(n, device, param_bytes)


class PagedAdamW8bit(AdamW8bit):
    name = "paged_adamw8bit"
    help = "bitsandbytes' PagedAdamW8bit: AdamW8bit's states in CUDA unified memory"
    paged_min_elements: ClassVar[int | None] = PAGED_MIN_ELEMENTS


# optim_bits=32: state1 and state2 in fp32 whatever the parameters' dtype (init_state's
# `dtype = torch.float32`), 8 bytes per element; mode mixed: + the fp32 master copy
ADAMW_32BIT_BYTES = {"fp32": 8, "amp": 8, "mixed": 12, "bf16": 8}


class PagedAdamW(Optimizer):
    name = "paged_adamw"
    help = "bitsandbytes' PagedAdamW: 32-bit states in CUDA unified memory"
    state_tensors: ClassVar[int] = 2
    paged_min_elements: ClassVar[int | None] = PAGED_MIN_ELEMENTS

    def per_param_bytes(self, mode: str) -> int:
        return ADAMW_32BIT_BYTES[mode]

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        """The 32-bit update: in place on CUDA; on CPU `_optimizer_update_32bit_cpu`
        (`bnb_8bit_update_temporaries` of a tensor under min_8bit_size)."""
        if device == "cuda":
            return 0
        return 12 * n + (4 * n if param_bytes != 4 else 0)


register(AdamW8bit())
register(PagedAdamW8bit())
register(PagedAdamW())
