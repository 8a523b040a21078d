"""Megatron-core's DistributedDataParallel and distributed optimizer (megatron-core 0.16.1,
`megatron.core.distributed.DistributedDataParallel` with use_distributed_optimizer,
`megatron.core.optimizer.get_megatron_optimizer`) on a gloo rank of this machine, around the
reference model, as Megatron-LM sets them up by default: bf16 weights in mixed mode with the
gradients accumulated and reduced in fp32 (Megatron-LM's accumulate_allreduce_grads_in_fp32,
forced under bf16), --overlap-grad-reduce and its buckets as the set-up's engine_settings say
(`gptcalc.time.comm.megatron_settings`), Adam with clip_grad 1.0.

Megatron-core assumes CUDA; `shim_cuda` makes it run on CPU without changing what it
communicates: torch.cuda.current_device() returns "cpu", a device="cuda" argument to a torch
function becomes CPU (a TorchFunctionMode), Tensor.cuda() returns the tensor, and
Tensor.type() names a CPU tensor as its CUDA type (the distributed optimizer checks for
'torch.cuda.BFloat16Tensor'). Transformer Engine and Apex are absent: Megatron-core falls back
to its local multi-tensor kernels.

`MegatronRank` has the runner interface benchmarks/comm_twin.py's `count_collectives`
drives (build, step)."""

from __future__ import annotations

import torch

MEGATRON_CORE_VERSION = "0.16.1"


def shim_cuda() -> None:
    """The CPU stand-ins of the module docstring, in this process."""
    from torch.overrides import TorchFunctionMode

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        name = plain_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type

    def cpu(device):
        if isinstance(device, str) and device.startswith("cuda"):
            return "cpu"
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        return device

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            return func(*args, **kwargs)

    CudaToCpu().__enter__()  # for the rest of this (forked, single-purpose) process


class MegatronRank:
    """One rank: the reference model under Megatron-core's DDP and distributed optimizer over
    all `world` ranks (data parallel only); `step` runs one micro-batch and the optimizer."""

    def __init__(self, cfg, wl, setup, impl, rank, world) -> None:
        from .rank import _batch

        self.cfg, self.wl, self.setup, self.rank, self.world = cfg, wl, setup, rank, world
        self.idx, self.targets = _batch(cfg, wl.batch_size, wl.seq_len, seed=1000 + rank)

    def build(self) -> None:
        shim_cuda()
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import MegatronModule

        from .model import build_model

        parallel_state.initialize_model_parallel()
        bf16 = self.setup.mode == "mixed"
        dtype = torch.bfloat16 if bf16 else torch.float32
        config = TransformerConfig(num_layers=self.cfg.n_layer, hidden_size=self.cfg.n_embd,
                                   num_attention_heads=self.cfg.n_head, bf16=bf16,
                                   params_dtype=dtype, use_cpu_initialization=True)
        gpt = build_model(self.cfg, "manual", dtype=dtype)

        class Wrapped(MegatronModule):  # Megatron-LM's model is a MegatronModule
            def __init__(self) -> None:
                super().__init__(config)
                self.gpt = gpt

            def forward(self, idx, targets):
                return self.gpt(idx, targets)[1]

        from gptcalc.time.comm import megatron_settings

        overlap, bucket = megatron_settings(self.setup)
        self.model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                  grad_reduce_in_fp32=True,
                                                  overlap_grad_reduce=bool(overlap),
                                                  bucket_size=bucket or None), Wrapped())
        self.opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-4, bf16=bf16, clip_grad=1.0,
                            use_distributed_optimizer=True), [self.model])

    def step(self) -> None:
        self.model.zero_grad_buffer()
        self.opt.zero_grad()
        self.model(self.idx, self.targets).float().backward()
        self.model.finish_grad_sync()  # Megatron-LM's forward_backward_func's finalize step
        self.opt.step()


__all__ = ["MEGATRON_CORE_VERSION", "MegatronRank", "shim_cuda"]
