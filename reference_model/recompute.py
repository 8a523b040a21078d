"""torchtitan's op-level selective activation checkpointing, for the reference model and the
transformers twin.

torchtitan (torchtitan/distributed/activation_checkpoint.py, `_apply_op_sac`, with the save
list of torchtitan/models/llama3/infra/parallelize.py) wraps each transformer block in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)` whose context
comes from `create_selective_checkpoint_contexts(policy)`. The policy, called on every op the
block's forward dispatches: the outputs of the ops in `OP_SAVE_LIST` are kept (MUST_SAVE),
except every second `aten.mm` of the block (it counts the block's mm's and recomputes the even
ones); every other op is recomputed in backward (PREFER_RECOMPUTE). A Linear with a bias runs
as `aten.addmm`, which is not in the list: it is neither kept nor counted.

`OP_SAVE_LIST` is torchtitan's plus `_scaled_dot_product_flash_attention_for_cpu`, the flash
kernel's CPU counterpart, where SDPA dispatches on CPU (torchtitan lists the CUDA kernels).

What the checkpoint keeps: the block's inputs (saved for backward by the checkpoint itself,
which saved_tensors_hooks see) and the kept op outputs, which the selective-checkpoint context
caches outside autograd; `OpCheckpoint.cached` lists those, for the saved-tensor meters.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

aten = torch.ops.aten
OP_SAVE_LIST = {
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_attention_math.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # torchtitan: the absolute maximum gives low-precision training its scaling factor
    aten.max.default,
}


def op_policy(meta: dict[str, int]):
    """torchtitan's `_custom_policy`: keep the outputs of OP_SAVE_LIST's ops but every second
    mm of the block (`meta` counts them; one `meta` per block forward)."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func == aten.mm.default:
            meta["forward_mm_count"] += 1
        save = func in OP_SAVE_LIST and not (
            func == aten.mm.default and meta["forward_mm_count"] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class OpCheckpoint:
    """The context factory of op-level checkpointing, remembering (weakly) each block's cache
    so that a meter can list what the checkpoint keeps outside autograd."""

    def __init__(self) -> None:
        self._contexts: list[weakref.ref] = []

    def context_fn(self):
        fwd, recompute = create_selective_checkpoint_contexts(op_policy(defaultdict(int)))
        self._contexts.append(weakref.ref(recompute))  # shares the cache with `fwd`
        return fwd, recompute

    def clear(self) -> None:
        self._contexts.clear()

    def cached(self) -> list[torch.Tensor]:
        """The op outputs the live checkpoints hold for their recomputation."""
        out: list[torch.Tensor] = []
        for ref in self._contexts:
            ctx = ref()
            if ctx is None:
                continue
            for entries in ctx.storage.values():
                for entry in entries.values():
                    for leaf in torch.utils._pytree.tree_leaves(entry):
                        value = getattr(leaf, "val", None)  # torch's _VersionWrapper
                        if isinstance(value, torch.Tensor):
                            out.append(value)
        return out


def checkpointed(fn, context: OpCheckpoint | None = None):
    """`fn` run under torch.utils.checkpoint (non-reentrant, RNG state preserved), with
    `context`'s op-level policy when given; a plain call when autograd is off."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        extra = {} if context is None else {"context_fn": context.context_fn}
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra,
                          **kwargs)
    return run


__all__ = ["OP_SAVE_LIST", "OpCheckpoint", "checkpointed", "op_policy"]
