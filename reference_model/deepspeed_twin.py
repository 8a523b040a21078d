"""DeepSpeed's ZeRO (stages 1-3) on its CPU accelerator: one rank of `run_layout`'s engines.

DeepSpeed runs on CPU ranks with `DS_ACCELERATOR=cpu` over gloo; the client optimizer is
`torch.optim.AdamW` (DeepSpeed's own CPUAdam needs a compiled op). The ds_config is the one
gptcalc models (`gptcalc.dsconfig.ds_config_dict`): the ZeRO stage, bf16 in
mode mixed (the module cast to bf16, fp32 master partition) or fp32, the micro-batch, and the
bucket sizes of the set-up (DeepSpeed's defaults or a user's ds_config). The loss is computed
as the reference model's mixed mode computes it: under CPU autocast, which with bf16 weights
casts only the cross entropy to fp32.

What a rank holds is measured from every live tensor storage (a `gc` walk, storages counted
once): DeepSpeed's flat buffers are plain tensors made by the engine, invisible to a tracker
that only follows the module and the optimizer. The step peak is MemTracker's (torch.distributed
._tools.mem_tracker) with every storage alive at the step's start named with `track_external`,
so the flat buffers made at initialisation are counted from the start.
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch

from .rank import LiveSaved, _Engine, _storage_key, storage_bytes


def live_tensors(skip: set[int] = frozenset()) -> list[torch.Tensor]:
    """One tensor per distinct storage alive in this process (a garbage-collector walk), less
    the storages in `skip`."""
    gc.collect()
    out: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            key = _storage_key(obj)
            if key not in skip and obj.untyped_storage().nbytes():
                out.setdefault(key, obj)
    return list(out.values())


class DeepSpeedRank(_Engine):
    """deepspeed.initialize over the model with an AdamW client optimizer."""

    def build(self) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import torch.distributed as dist

        # DeepSpeed reads the rendezvous from the environment (else it tries MPI discovery);
        # the process group itself is the one `_worker` made
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world),
                          LOCAL_RANK=str(self.rank), LOCAL_WORLD_SIZE=str(self.world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT",
                                                                               "29500"))
        import deepspeed
        from deepspeed.utils import logger

        from gptcalc.dsconfig import ds_config_dict

        logger.setLevel("WARNING")
        deepspeed.init_distributed(dist_backend="gloo")
        assert dist.is_initialized()
        module = self.model.module
        opt = self.optimizer(module.parameters())
        config = ds_config_dict(self.setup, self.wl)
        self.engine, self.opt, _, _ = deepspeed.initialize(model=module, optimizer=opt,
                                                           config=config)
        self.raw = module
        self.model.module = self.engine

    @property
    def tracked_module(self) -> torch.nn.Module:
        return self.raw

    def context(self):
        if self.setup.mode == "mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, live: LiveSaved | None = None, flops: bool = False) -> None:
        with live.hooks() if live else contextlib.nullcontext(), self.context():
            out, loss = self.model.loss(self.idx, self.targets)
        if not self.setup.keep_logits:
            out = None  # the loop drops the logits before backward (the Trainer's)
        self.engine.backward(loss)
        del out, loss
        self.engine.step()

    def tracker(self):
        from .memory import _global_peak_tracker

        t = _global_peak_tracker()
        skip = {_storage_key(b) for b in self.raw.buffers()}
        t.track_external(*live_tensors(skip))
        return t

    def states(self) -> tuple[int, int, int]:
        """Weights: the 16-bit (fp32 in mode fp32) parameter storages (stages 1-2: the flat
        buffer the parameters are views of; stage 3: the flat partition buffer and the
        persistent parameters). Gradients: none are held after the step (-1: not measured).
        Optimizer: the fp32 partitions and AdamW's states."""
        o = self.opt
        if self.setup.zero >= 3:
            # under offload_param the partitions live in host memory, not lp_param_buffer
            flat = [o.lp_param_buffer] if getattr(o, "lp_param_buffer", None) is not None else []
            weights = [*flat, *(p.data for p in self.raw.parameters()),
                       *self.frozen_partitions(host=False)]
            fp32 = list(o.fp32_partitioned_groups_flat)
        else:
            weights = list(o.bit16_groups_flat)
            fp32 = list(o.single_partition_of_fp32_groups)
        state = [v for s in o.optimizer.state.values() for v in s.values()]
        return storage_bytes(weights), -1, storage_bytes(fp32 + state)

    def frozen_partitions(self, host: bool) -> list[torch.Tensor]:
        """Stage 3 under LoRA: the partitions (`ds_tensor`) of the frozen parameters, which
        DeepSpeed keeps outside its optimizer's flat buffers; `host`: those offload_param
        places in host memory (the non-persistent ones), else those on the device."""
        from gptcalc.memory.engines import deepspeed as ds

        moved = ds.offload_devices(self.setup)[1] != "none"
        return [p.ds_tensor for p in self.raw.parameters()
                if not p.requires_grad and getattr(p, "ds_tensor", None) is not None
                and (moved and not p.ds_persist) == host]

    def host(self) -> dict[str, int]:
        """The storages DeepSpeed keeps in host memory under offload (on the CPU accelerator
        the device is the host too: the structures are DeepSpeed's own), by gptcalc's lines
        (`gptcalc.memory.engines.deepspeed.deepspeed_host`); {} without offload."""
        from gptcalc.memory.engines import deepspeed as ds

        o, (opt_dev, param_dev) = self.opt, ds.offload_devices(self.setup)
        if opt_dev == param_dev == "none":
            return {}
        state = [v for s in o.optimizer.state.values() for v in s.values()]
        if self.setup.zero <= 2:
            fp32 = list(o.single_partition_of_fp32_groups)
            return {ds.HOST_STATES: storage_bytes(fp32 + state),
                    ds.HOST_FP32_GRADS: storage_bytes([f.grad for f in fp32]),
                    ds.HOST_COPY_BACK: storage_bytes(
                        o.param_buffer_of_bit16_for_cpu_offload_groups),
                    ds.HOST_STAGING: storage_bytes([o.temp_grad_buffer_for_cpu_offload])}
        out = {}
        if opt_dev != "none":
            fp32 = list(o.fp32_partitioned_groups_flat)
            out = {ds.HOST_GRAD16: storage_bytes([o.grad_partitions_flat_buffer]),
                   ds.HOST_STATES: storage_bytes(fp32 + state),
                   ds.HOST_FP32_GRADS: storage_bytes([f.grad for f in fp32])}
        if param_dev != "none":
            out[ds.HOST_PARAMS] = storage_bytes(o.param_groups_fp16_flat_cpu_memory)
            if self.setup.lora_rank:
                out[ds.HOST_FROZEN_PARAMS] = storage_bytes(self.frozen_partitions(host=True))
        return out


__all__ = ["DeepSpeedRank", "live_tensors"]
