"""deepspeed.checkpointing's checkpoints on DeepSpeed's CPU accelerator: what each checkpointed
block keeps between its forward and its backward, under a ds_config's activation_checkpointing.

Every block of the reference model runs inside `deepspeed.checkpointing.checkpoint` (as
Megatron-DeepSpeed wraps its layers), configured with partition_activations and
cpu_checkpointing as the ds_config gives them, on one process: tensor-parallel size 1 (a
partition is the whole checkpoint), or one rank of a larger tensor-parallel group given as
Megatron's mpu (the forward's partition is that rank's slice; the backward, which gathers the
slices over the group, is not run). After the forward each checkpoint's autograd context is
read: the block input's own storage (what stays on the device), the copy the checkpoint keeps
(`saved_data`: in host memory under cpu_checkpointing, DeepSpeed's
`buffer_device = torch.device('cpu')`), and the int64 size tensors beside partitions. Then the
backward runs, so a broken checkpoint fails. DeepSpeed 0.19's cpu_checkpointing without
partition_activations loses the checkpoint on a CPU accelerator (`.to('cpu')` of a CPU tensor
is the tensor itself, whose data is then emptied), as its `configure` documents ("Only works
with partition_activation"): the measured set-up partitions.

Run in a process of its own (`python -m reference_model.ds_checkpointing SPECS`, a JSON list,
prints a JSON list): it initialises deepspeed.comm over a one-rank gloo group.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _rendezvous() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def measure_all(specs: list[dict]) -> list[dict]:
    """`measure` of each spec, in one deepspeed.comm group."""
    _rendezvous()
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    deepspeed.init_distributed("gloo")
    return [measure(spec) for spec in specs]


def measure(spec: dict) -> dict:
    """{"device", "saved", "sizes"}: bytes over every checkpoint of the block inputs' own
    storages, of the copies the checkpoints keep, and of the size tensors. `spec`: "config"
    (GPTConfig fields), "batch", "seq_len", "mode" (fp32 or bf16), "partition", "cpu", and
    optionally "tp" and "rank" (the tensor-parallel group's size and this rank)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from gptcalc import GPTConfig

    from .model import GPT

    tp = spec.get("tp", 1)
    checkpointing.configure(_ModelParallel(spec.get("rank", 0), tp) if tp > 1 else None,
                            partition_activations=spec["partition"],
                            checkpoint_in_cpu=spec["cpu"])
    cfg = GPTConfig(**spec["config"])
    torch.manual_seed(0)
    model = GPT(cfg, "sdpa")
    if spec["mode"] == "bf16":
        model = model.to(torch.bfloat16)
    outputs = []

    class Checkpointed(torch.nn.Module):
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
            y = checkpointing.checkpoint(self.block, x)
            outputs.append(y)
            return y

    model.transformer.h = torch.nn.ModuleList(Checkpointed(b) for b in model.transformer.h)
    idx = torch.randint(cfg.vocab_size, (spec["batch"], spec["seq_len"]))
    _, loss = model(idx, idx)
    out = {"device": 0, "saved": 0, "sizes": 0}
    for y in outputs:
        for t in y.grad_fn.deepspeed_saved_tensors:
            if not torch.is_tensor(t):
                continue
            if t.is_floating_point():
                out["device"] += t.untyped_storage().nbytes()
                out["saved"] += t.saved_data.untyped_storage().nbytes()
            else:
                out["sizes"] += t.untyped_storage().nbytes()
    if tp == 1:  # a partition of tp > 1 is gathered over its group in the backward
        loss.backward()
    return out


class _ModelParallel:
    """The model-parallel coordinates deepspeed.checkpointing reads from Megatron's mpu: rank
    `rank` of `size` tensor-parallel ranks (the forward partitions by them alone)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.size

    def get_model_parallel_group(self) -> None:
        return None


if __name__ == "__main__":
    print(json.dumps(measure_all(json.loads(sys.argv[1]))))
