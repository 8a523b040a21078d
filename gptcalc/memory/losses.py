"""The loss over the logits, by how it is computed (`TrainingSetup.loss`): what it saves for
backward, what it holds beside that at the forward's end and at the backward's start, and how
much of the logits exists at all.

- standard: the model returns the whole logits, N x V, and cross_entropy takes them (under
  autocast on an fp32 copy); its terms are the implementation profile's.
- chunked: torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/
  ce_chunked_output_loss.py, `forward` and `compute_cross_entropy`, in eager mode): the model
  applies its head to `loss_chunks` chunks of tokens (`tensor_split` along the sequence) and
  returns them as a list; the loss upcasts one chunk at a time (`.float()`) and sums
  cross_entropy(reduction="sum") over the chunks, divided by the count of counted targets.
- fused: Liger's fused linear cross entropy (liger_kernel/ops/fused_linear_cross_entropy.py,
  `fused_linear_cross_entropy_forward` and `LigerFusedLinearCrossEntropyFunction`): the head's
  matmul runs inside the loss on chunks of rows, each chunk's logits overwritten by their
  gradient, and the gradients of the head's input and weight are computed in the forward and
  saved for backward; the logits never exist beyond one chunk.

N = b S tokens, V' = ceil(V / tp) the vocabulary shard of a device, P the head's input width.
"""

from __future__ import annotations

from ..config import GPTConfig
from ..training_setup import TrainingSetup
from ..workload import Workload


def chunk_rows(workload: Workload, chunks: int) -> list[int]:
    """Rows (tokens) of each chunk of `torch.tensor_split(x, chunks, dim=1)` over a (b, S, .)
    tensor, in order: the first S mod n chunks have ceil(S / n) positions, the rest floor(S / n)
    (torch.tensor_split's documented rule), each times the micro-batch b."""
    return [chunk_row(workload, chunks, i) for i in range(chunks)]


def chunk_row(workload: Workload, chunks: int, i: int) -> int:
    """Rows of chunk `i` of `chunk_rows` (negative: from the end), without listing the chunks:
    the work stays O(1) whatever the count of chunks."""
    b, S = workload.batch_size, workload.seq_len
    i = i % chunks
    return b * (S // chunks + (i < S % chunks))


def liger_chunk_rows(cfg: GPTConfig, workload: Workload) -> int:
    """Rows of one chunk of Liger's fused linear cross entropy (`fused_linear_cross_entropy_
    forward`): inc_factor = ceil(V / P), chunk_size = next_power_of_2(ceil(BT / inc_factor)),
    at most BT, so that one chunk's logits (chunk_size x V) are about the head's input (BT x P)."""
    bt, V, P = workload.tokens, cfg.vocab_size, cfg.embd_dim
    inc_factor = -(-V // P)
    want = -(-bt // inc_factor)
    return min(1 << (want - 1).bit_length(), bt)


def loss_saved_lines(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                     lines: dict[str, int]) -> dict[str, int]:
    """The profile's saved lines (`lines`, one micro-batch, unsharded) with the loss's own.

    chunked: each chunk's log_softmax saves its fp32 output (N V 4 over the chunks, the
    upcast makes them fp32 whatever the mode), each chunk's nll_loss its fp32 total weight
    (4 bytes, n of them), and the division by the count of targets saves that int64 count (8);
    the targets' chunks, copies or views, are N x 8 as before. fused (Liger): no log-probs;
    the head's input gradient, N P in the head input's dtype (the stream's), replaces the
    head's saved input, and the head's weight gradient, V P in the weights' dtype (Liger's
    accum_dtype None), is saved beside it (the head's bias gradient V too where it has one).
    """
    if setup.loss == "standard":
        return lines
    out = {k: v for k, v in lines.items() if not k.startswith("cross_entropy/")}
    N, V = workload.tokens, cfg.vocab_size
    if setup.loss == "chunked":
        out["cross_entropy/log_probs"] = N * V * 4
        out["cross_entropy/total_weight"] = 4 * setup.loss_chunks
        out["cross_entropy/count"] = 8
        return out
    P, w = cfg.embd_dim, setup.weight_bytes
    out.pop("final/lm_head_input", None)
    out["final/head_input_gradient"] = N * P * setup.stream_bytes
    out["cross_entropy/head_weight_gradient"] = V * P * w
    out["cross_entropy/head_bias_gradient"] = V * w if cfg.lm_head_bias else 0
    return out


def chunked_loss_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                            ) -> dict[str, int]:
    """torchtune's chunked loss beside its saved tensors, per device (vocabulary shard V'),
    for chunks of at least two positions.

    forward: at the last chunk's log_softmax, that chunk's fp32 copy of its logits (rows_last
    V' 4; none in fp32, where `.float()` returns the logits themselves). With b > 1 and n > 1
    the targets' chunks are copies (`reshape(-1)` of a slice along the sequence), which
    nll_loss saves beside the batch's own targets: 8 N more, also through the backward.

    backward: autograd runs every chunk's loss backward before the head's (the head's matmuls
    are older nodes), from the last chunk to the first: at chunk j's log_softmax backward the
    incoming fp32 gradient and its result are alive (2 rows_j V' 4), and each chunk done before
    has freed its log-probabilities (rows V' 4) and left its logits' gradient in the logits'
    dtype (rows V' a). Then the head's backward, again from the last chunk: from the second
    chunk on, autograd sums each chunk's weight gradient into the earlier ones out of place
    (three V' P tensors in the compute dtype), when every log-probability is freed and the
    chunks not yet reached still hold their logits' gradients. The largest of those moments
    (the head's input gradients, N P, left out). A frozen head (LoRA) makes no weight
    gradient."""
    V, a, n = -(-cfg.vocab_size // setup.tp), setup.act_bytes, setup.loss_chunks
    last = chunk_row(workload, n, -1)
    N = workload.tokens
    targets = 8 * N if workload.batch_size > 1 and n > 1 else 0
    upcast = 4 * last * V if a != 4 else 0
    # from the last chunk back, chunk j's moment is done_j + 2 rows_j V 4, done_j (the chunks
    # after it: rows V (a - 4), never positive as a <= 4) only falling: over the floor(S / n)
    # chunks, then the ceil(S / n) ones, each run's largest moment is its first (closed form:
    # any count of chunks costs O(1))
    b, S = workload.batch_size, workload.seq_len
    short, wide = n - S % n, S % n  # chunks of floor(S / n) positions, of ceil(S / n)
    largest = 2 * last * V * 4
    if short and wide:
        largest = max(largest, short * b * (S // n) * V * (a - 4)
                      + 2 * b * (S // n + 1) * V * 4)
    if n > 1 and not setup.lora_rank:  # the second chunk's weight-gradient sum in the head
        head = (3 * V * cfg.embd_dim * a + (N - last - chunk_row(workload, n, -2)) * V * a
                - N * V * 4)
        largest = max(largest, head)
    return {"forward": upcast + targets, "backward": largest + targets}


def fused_loss_transients(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                          ) -> dict[str, int]:
    """Liger's fused linear cross entropy beside its saved tensors: forward, one chunk's
    logits (overwritten in place by their gradient, chunk V in the compute dtype) beside its
    input-gradient matmul's output (chunk P, copied into the saved input gradient); the weight
    gradient accumulates in place (addmm into it, as on CUDA from sm80). backward: nothing (the
    saved gradients are returned, scaled by the loss's gradient only when it is not 1)."""
    rows, a = liger_chunk_rows(cfg, workload), setup.act_bytes
    return {"forward": rows * (cfg.vocab_size + cfg.embd_dim) * a, "backward": 0}


def logits_alive(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                 merged: bool = True) -> dict[str, int]:
    """The model's logits, b S V' in the compute dtype, at the forward's end (the loss reads
    them) and from the backward's start to its end (only where the training loop keeps them,
    or a pipeline whose last stage keeps its outputs, `merged`: no node of the loss saves
    them); the fused loss never makes them."""
    if setup.loss == "fused":
        return {"forward": 0, "backward": 0}
    v_shard = -(-cfg.vocab_size // setup.tp)
    logits = workload.batch_size * workload.seq_len * v_shard * setup.act_bytes
    kept = setup.keep_logits or (setup.pp > 1 and merged)
    return {"forward": logits, "backward": logits if kept else 0}


__all__ = ["chunk_rows", "chunked_loss_transients", "fused_loss_transients", "liger_chunk_rows",
           "logits_alive", "loss_saved_lines"]
