"""Context parallel's ring attention, measured: what torch's ring allocates beyond its inputs.

torch's `context_parallel` dispatches only SDPA's CUDA kernels, so on CPU the ring itself is
called: `_templated_ring_attention` and `_templated_ring_attention_backward` (torch 2.13,
torch/distributed/tensor/experimental/_context_parallel/_attention.py) with the CPU flash
kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, whose output and logsumexp have
the CUDA flash kernel's shapes and dtypes), every rank of the ring in turn in this process on
a fake process group (`FakeStore`: the collectives return buffers of the real sizes). A
dispatch mode counts the bytes of every storage made inside the call, alive until freed, and
keeps the high-water mark; the inputs (q, k, v, and in the backward the output, logsumexp and
output gradient) are not counted.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The high-water mark of bytes in storages made under the mode (`peak`); the storages of
    `inputs` are not counted (views of them are not new)."""

    def __init__(self, inputs: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.live = {t.untyped_storage().data_ptr(): 0 for t in inputs}
        self.now = self.peak = 0

    def _free(self, key: int, nbytes: int) -> None:
        self.now -= nbytes
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) is not torch.Tensor:  # the collectives' wrappers hold a plain tensor
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in self.live or nbytes == 0:
                continue
            self.live[key] = nbytes
            self.now += nbytes
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def ring_rank_peaks(rank: int, cp: int, batch: int, heads: int, tokens: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes one rank's ring attention holds at its highest beyond its
    inputs: q, k and v of `heads` heads and `tokens` local tokens each (k and v with every
    query head, as after repeat_interleave), causal, the default load balancing and rotation."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=cp, store=FakeStore())
    try:
        group = dist.group.WORLD
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(batch, heads, tokens, head_dim, generator=gen, dtype=dtype)
                   for _ in range(3))
        forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        with LiveBytes((q, k, v)) as fwd:
            out, lse = ring._templated_ring_attention(group, 2, forward, q, k, v,
                                                      is_causal=True)[:2]
        grad = torch.randn(out.shape, generator=gen, dtype=dtype)
        with LiveBytes((q, k, v, out, lse, grad)) as bwd:
            ring._templated_ring_attention_backward(group, 2, backward, grad, "grad_out", q, k,
                                                    v, out, lse, True, dropout_p=0.0)
        return fwd.peak, bwd.peak
    finally:
        dist.destroy_process_group()


def ring_peaks(cp: int, batch: int, heads: int, tokens: int, head_dim: int,
               dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """The largest forward and backward of `ring_rank_peaks` over the cp ranks."""
    peaks = [ring_rank_peaks(r, cp, batch, heads, tokens, head_dim, dtype) for r in range(cp)]
    return max(p[0] for p in peaks), max(p[1] for p in peaks)


__all__ = ["LiveBytes", "ring_peaks", "ring_rank_peaks"]
