"""Context parallelism: torch's ring attention (torch.distributed.tensor.experimental.
context_parallel, as torchtitan runs it), per rank.

The sequence is cut into 2 cp chunks and rank i keeps chunks i and 2cp-1-i (torch 2.13,
torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py,
`_HeadTailLoadBalancer`, the default of `context_parallel` for causal attention; it asserts
that 2 cp divides the sequence). Every layer outside attention then runs on the rank's T/cp
tokens, and attention's own saved tensors (the flash kernel's q, k, v, output and logsumexp)
are those of T/cp tokens too: a rank's activations, logits and loss are those of a sequence of
T/cp tokens (`local_workload`). torchtitan folds cp into FSDP's mesh (dp_shard x cp, its
`ParallelDims.dp_shard_cp`): parameters, gradients and optimizer states are sharded, and
gradients reduced, over dp x cp ranks (`sharding_setup`). What the ring adds is transient: the
exchanged keys and values and the merge of the partial outputs in the forward
(`ring_forward_bytes`), the exchanged keys and values and the gradients passed around the ring
in the backward (`ring_backward_bytes`), inside one layer's attention at a time.

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import GPTConfig
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload


def check_context_parallel(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                           engine_runs_it: bool = True) -> None:
    """Raise ConfigError("cp") for a set-up torch's ring attention does not run: the head-tail
    split needs 2 cp to divide the sequence (`_HeadTailLoadBalancer`); the ring dispatches
    only SDPA's CUDA kernels (`_sdpa_handler`: flash, efficient, cuDNN; CPU's
    `_scaled_dot_product_flash_attention_for_cpu` has no sharding strategy) with is_causal
    (load balancing requires it: no sliding window, ALiBi bias, sink logits or MLA's unequal
    head widths); `engine_runs_it`: the engine's data-parallel group can be the dp x cp mesh."""
    c = setup.cp
    if c == 1:
        return
    if workload.seq_len % (2 * c):
        raise ConfigError("cp", f"context parallel cuts the sequence into 2 x cp = {2 * c} "
                                f"chunks: seq_len {workload.seq_len} is not a multiple of "
                                f"{2 * c}")
    if setup.attn_impl != "sdpa" or setup.device != "cuda":
        raise ConfigError("cp", "context parallel's ring runs SDPA's CUDA kernels: give --attn "
                                "sdpa --device cuda")
    odd = [name for name, on in (("sliding windows", cfg.sliding_window is not None),
                                 ("ALiBi", cfg.pos_embedding == "alibi"),
                                 ("attention sinks", cfg.attn_sinks), ("MLA", cfg.mla)) if on]
    if odd:
        raise ConfigError("cp", f"context parallel's ring runs plain causal attention, not "
                                f"{', '.join(odd)}")
    if not engine_runs_it:
        raise ConfigError("cp", "context parallel is modelled as torch's ring over a dp x cp "
                                "data-parallel mesh (FSDP2, DDP, ZeroRedundancyOptimizer), not "
                                "under this engine")


def local_workload(workload: Workload, setup: TrainingSetup) -> Workload:
    """The workload one context-parallel rank runs: T/cp tokens of each sequence."""
    if setup.cp == 1:
        return workload
    return replace(workload, seq_len=workload.seq_len // setup.cp)


def sharding_setup(setup: TrainingSetup) -> TrainingSetup:
    """The set-up the engine shards states with: cp folded into dp (torchtitan's dp_shard x
    cp FSDP mesh; the gradients are reduced over the same ranks)."""
    if setup.cp == 1:
        return setup
    return replace(setup, dp=setup.dp * setup.cp, cp=1)


def _ring_sizes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                ) -> tuple[int, int, int, int]:
    """(Q, K, L, a): elements of the rank's q and of its k (and of v), of the logsumexp, and
    the bytes of one element, per device. k and v enter SDPA with every query head (the
    reference model's repeat_interleave, torchtitan's repeat_kv); heads are split over tp.
    Scope: q, k and v contiguous in (b, H, S, D), as the reference model's repeated heads are;
    transposed views of (b, S, H, D), as torchtitan passes them, make the ring copy them
    (`key.contiguous()`) and change the layout of its chunks, which is not counted (on fake
    ranks with the CPU kernel: up to 0.75 Q a more in the forward and 1.5 Q a in the
    backward, with b and H above 1)."""
    b, t = workload.batch_size, setup.tp
    tokens = workload.seq_len // setup.cp
    q = b * tokens * cfg.q_width // t
    return q, q, b * tokens * cfg.n_head // t, setup.act_bytes


def ring_forward_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """The most bytes one layer's ring attention forward holds beyond its inputs, on the most
    loaded rank (torch 2.13, _context_parallel/_attention.py, `_templated_ring_attention` with
    the default `_AllGatherRotater` and `convert_to_f32`; the last rank, whose every step
    merges a whole output). With Q, K and L the rank's q, k and logsumexp elements and a the
    activations' bytes:

        all-gathered k and v of every rank         2 K cp a
        the step's output                          a Q
        merged output, its step's fp32 copy (none
        when a = 4), out - block_out, the product  4 Q (3 + [a != 4])
        merged, step and sigmoid logsumexps        12 L

    at `_SDPAMerger._merge_one`'s product, the last step. Zero without context parallel."""
    if setup.cp == 1:
        return 0
    Q, K, L, a = _ring_sizes(cfg, workload, setup)
    return 2 * K * setup.cp * a + a * Q + 4 * Q * (3 + (a != 4)) + 12 * L


def ring_backward_bytes(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """The most bytes one layer's ring attention backward holds beyond its inputs (q, k, v,
    the output, the logsumexp and the output's gradient), on the most loaded rank (torch 2.13,
    `_templated_ring_attention_backward`: k and v all-gathered as in the forward; fp32
    accumulators of dq, dk and dv; dk and dv concatenated and passed around the ring by
    `_AllToAllRotater`, fp32, sent and received; each step's 16-bit gradients). The larger of
    rank 0's high-water mark (every later step takes the second half of q, its output and
    logsumexp) and the last rank's (every later step the first half of k and v):

        2 K cp a + max((4 + 3a/2) Q + (24 + 6a) K + 2 L',  3a Q + (32 + 3a) K)

    (Q, K, L, a as in `ring_forward_bytes`); 2 L' the contiguous copy of the logsumexp's
    second half (fp32, L/2), none when b x H / tp is 1 (the half is contiguous already). Zero
    without context parallel."""
    if setup.cp == 1:
        return 0
    Q, K, L, a = _ring_sizes(cfg, workload, setup)
    copied = workload.batch_size * cfg.n_head // setup.tp > 1
    first = (4 + 3 * a // 2) * Q + (24 + 6 * a) * K + (2 * L if copied else 0)
    last = 3 * a * Q + (32 + 3 * a) * K
    return 2 * K * setup.cp * a + max(first, last)


__all__ = ["check_context_parallel", "local_workload", "ring_backward_bytes",
           "ring_forward_bytes", "sharding_setup"]
