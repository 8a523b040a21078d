"""torchtune's activation offloading rule run on the reference model (CPU): which saved tensors
OffloadActivations would copy to the host and which stay on the device.

torchtune (torchtune/training/_activation_offloading.py, `OffloadActivations.pack_tensor`,
`get_act_offloading_ctx_manager`) offloads a saved tensor of at least `min_offload_size` bytes
(element size x elements of the tensor as saved) that is not a Parameter or Buffer, except
under the output head (a `NoOpManager` around it) and in the loss, which runs outside the
context. Its copies need an accelerator; on CPU the same predicate is applied to each tensor
autograd packs, and the tensors are left where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptcalc.memory.offload import MIN_OFFLOAD_BYTES

from .memory import autocast_context, build_for, make_batch, storage_key


@dataclass(frozen=True)
class OffloadCount:
    device: int  # storages kept on the device, each once
    host: int  # storages offloaded, each once
    host_copies: int  # what torchtune copies: every offloaded pack, a storage packed twice twice


def measure_offload(cfg, workload, setup) -> OffloadCount:
    model = build_for(cfg, setup)
    idx, targets = make_batch(cfg, workload)
    excluded = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    state = {"on": True}
    kept: dict[int, int] = {}
    moved: dict[int, int] = {}
    copies = [0]
    # the head and the loss after it: outside the offloading (NoOpManager, loss after return)
    model.lm_head.register_forward_pre_hook(lambda *a: state.update(on=False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in excluded or not t.untyped_storage().nbytes():
            return t
        if state["on"] and t.element_size() * t.nelement() >= MIN_OFFLOAD_BYTES:
            moved[key] = t.untyped_storage().nbytes()
            copies[0] += t.element_size() * t.nelement()
        else:
            kept[key] = t.untyped_storage().nbytes()
        return t

    op_checkpoint = getattr(model, "op_checkpoint", None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast_context(setup, "cpu"):
            model(idx, targets)
    # op-level checkpointing's kept outputs: its cache, which no saved-tensor hook sees
    for t in op_checkpoint.cached() if op_checkpoint is not None else ():
        key = storage_key(t)
        if key not in excluded and key not in moved:
            kept[key] = t.untyped_storage().nbytes()
    device = sum(v for k, v in kept.items() if k not in moved)
    return OffloadCount(device, sum(moved.values()), copies[0])


__all__ = ["OffloadCount", "measure_offload"]
