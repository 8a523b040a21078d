"""FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`) on one gloo rank of this machine:
each block wrapped as its own unit (`ModuleWrapPolicy` over the model's block class) and the
root as the last, PyTorch's defaults otherwise (BackwardPrefetch.BACKWARD_PRE, no forward
prefetch, limit_all_gathers) with use_orig_params=True (the Trainer's default, and what
torch.compile and frozen parameters need); `--zero 3` is ShardingStrategy.FULL_SHARD, `--zero 2`
SHARD_GRAD_OP. FSDP1 refuses a CPU-only machine unless its device is given: `device_id=cpu`.
With LoRA the wrap policy is PEFT's (`peft_wrap_policy`): a unit per lora_A and lora_B beside the
blocks, as the Trainer wraps a PEFT model. With the workload's grad_accum m > 1 a step runs m
micro-batches before the optimizer step, every one but the last under `no_sync()` as the Trainer
runs them through accelerate (`fsdp1_sync` no-sync), or each synced (each-batch).

The step peak is MemTracker's (it follows FSDP1's storage resizes of the flat parameters'
unsharded buffers); the states are the flat parameters' sharded storages, their sharded
gradients and the optimizer's states over the original parameters' shard views.
"""

from __future__ import annotations

import torch

from .rank import _Engine


def peft_wrap_policy(block_class: type):
    """PEFT's `fsdp_auto_wrap_policy` (peft/utils/other.py, PEFT 0.21), which the Trainer sets
    on accelerate's FSDP1 plugin for a PEFT model (transformers' `update_fsdp_plugin_peft`):
    a unit per leaf module whose weight trains (each adapter's lora_A and lora_B), or per
    transformer block (`transformer_auto_wrap_policy`), whichever matches."""
    import functools

    from torch.distributed.fsdp.wrap import (_or_policy, lambda_auto_wrap_policy,
                                             transformer_auto_wrap_policy)

    def trains(module: torch.nn.Module) -> bool:
        return (len(list(module.named_children())) == 0
                and getattr(module, "weight", None) is not None and module.weight.requires_grad)

    return functools.partial(_or_policy, policies=[
        functools.partial(lambda_auto_wrap_policy, lambda_fn=trains),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})])


class FSDP1Rank(_Engine):
    def build(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        s = self.setup
        strategy = ShardingStrategy.FULL_SHARD if s.zero == 3 else ShardingStrategy.SHARD_GRAD_OP
        # mode mixed: bf16 compute over the fp32 flat parameters, fp32 reduction (torchtitan's
        # policy, as the FSDP2 twin runs it)
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if (
            s.mode == "mixed") else None
        block_class = type(self.model.blocks[0])
        policy = peft_wrap_policy(block_class) if s.lora_rank else ModuleWrapPolicy({block_class})
        self.fsdp = FSDP(self.model.module, auto_wrap_policy=policy,
                         sharding_strategy=strategy, mixed_precision=mp,
                         device_id=torch.device("cpu"), use_orig_params=True)
        self.model.module = self.fsdp
        self.opt = self.optimizer(self.fsdp.parameters())

    def step(self, live=None, flops: bool = False) -> None:
        """One optimizer step over the workload's grad_accum micro-batches (`fsdp1_sync`);
        `moments["gradients held"]`: the bytes of the flat parameters' gradients when the last
        micro-batch starts (under no_sync the unsharded ones it kept, else the sharded ones)."""
        import contextlib

        m = self.wl.grad_accum
        if m == 1:
            return super().step(live, flops)
        quiet = self.setup.fsdp1_sync == "no-sync"
        self.opt.zero_grad(set_to_none=True)
        for i in range(m):
            if i and getattr(self, "memtracker", None):  # it tracks a module once a region
                self.memtracker.reset_mod_stats()  # (its device-wide peak is kept)
            if i == m - 1:
                from .rank import storage_bytes

                self.moments = {"gradients held": storage_bytes(
                    f.grad for f in self.flat_parameters())}
            sync = contextlib.nullcontext() if i == m - 1 or not quiet else self.fsdp.no_sync()
            with sync, live.hooks() if live else contextlib.nullcontext(), self.context():
                out, loss = self.model.loss(self.idx, self.targets)
                if not self.setup.keep_logits:
                    out = None  # the Trainer drops the logits before backward
                loss.backward()
            del out, loss
        if not flops:
            self.opt.step()
        else:
            self.opt.zero_grad(set_to_none=True)

    def context(self):
        import contextlib

        if self.setup.mode == "mixed":  # the loss in fp32 on the bf16 logits, as under FSDP2
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def tracker(self):
        from .memory import _global_peak_tracker

        t = _global_peak_tracker()
        # FSDP1's original parameters are views of the flat parameter (not leaves) while a unit
        # is unsharded: MemTracker's gradient hooks cannot be put on them; the total it keeps
        # does not need them (they only name a storage's category)
        track = t._track_module_params_and_buffers
        t._track_module_params_and_buffers = lambda module, install_grad_hooks=True: track(
            module, install_grad_hooks=False)
        t.track_external(self.tracked_module, self.opt, *self.flat_parameters())
        self.memtracker = t
        return t

    def flat_parameters(self) -> list[torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return [h.flat_param for m in FSDP.fsdp_modules(self.fsdp)
                for h in [m._handle] if h is not None]

    def states(self) -> tuple[int, int, int]:
        from .rank import storage_bytes

        flat = self.flat_parameters()
        # the sharded gradient lives on the flat parameter (the original parameters' .grad
        # are views of it, use_orig_params)
        grads = [getattr(f, "_saved_grad_shard", None) if f.grad is None else f.grad
                 for f in flat]
        return storage_bytes(flat), storage_bytes(grads), storage_bytes(self.opt_state())
