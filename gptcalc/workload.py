"""The workload (`Workload`): the micro-batch one device runs, and its fit to the model."""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPTConfig
from .errors import ConfigError, positive_int


@dataclass(frozen=True)
class Workload:
    """What one device runs: a micro-batch of B sequences of `seq_len` tokens (seq_len <= T)
    per forward/backward, `grad_accum` of them per optimizer step.

    B is DeepSpeed's `train_micro_batch_size_per_gpu`; the global batch of a step is
    B x dp x grad_accum (`global_batch`)."""

    batch_size: int = 1  # B: sequences per device per forward/backward (the micro-batch)
    seq_len: int = 1024  # tokens per sequence; at most the block size T
    grad_accum: int = 1  # micro-batches accumulated per optimizer step

    def __post_init__(self) -> None:
        positive_int("batch_size", self.batch_size)
        positive_int("seq_len", self.seq_len)
        positive_int("grad_accum", self.grad_accum)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch_size * self.seq_len

    def global_batch(self, dp: int = 1) -> int:
        """Sequences per optimizer step over `dp` data-parallel replicas: B x dp x grad_accum."""
        return self.batch_size * dp * self.grad_accum

def validate_workload(cfg: GPTConfig, workload: Workload) -> None:
    """A sequence cannot be longer than the context the model was built for."""
    if workload.seq_len > cfg.block_size:
        raise ConfigError(
            "seq_len", f"seq_len {workload.seq_len} exceeds block_size {cfg.block_size}"
        )

