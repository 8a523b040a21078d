"""vLLM V1's dummy sampler pass, op for op, measured on CPU.

After the profile forward, vLLM V1 computes the logits of the last token of each of the
N = min(max_num_seqs, max_num_batched_tokens) dummy requests and runs its sampler over them with
temperature 0.5, top-p 0.9, top-k V - 1, no penalties and no logprobs, neither all greedy nor
all random (vllm/v1/worker/gpu_model_runner.py, `_dummy_sampler_run`). The sampler then
(vllm/v1/sample/sampler.py, `Sampler.forward` and `sample`; ops/topk_topp_sampler.py,
`forward_native`, `apply_top_k_top_p`, `random_sample`; FlashInfer's sampler is opt-in):

    logits32 = logits.to(float32); greedy = logits32.argmax(-1); logits32.div_(temperature)
    sorted, idx = logits32.sort(-1)                      top-k: threshold, bool mask, fill
    probs_sort = sorted.softmax(-1); cumsum(out=probs_sort)   top-p: bool mask, fill
    scattered = sorted.scatter(-1, idx, sorted)          back to vocabulary order
    probs = scattered.softmax(-1); q = empty_like(probs).exponential_(); probs.div_(q).argmax

`dummy_sampler_run` does the same with torch on CPU; `measure_sampler_peak` reports the live
bytes at its peak beyond what was live before it (the hidden states of the last tokens and the
output head), by PyTorch's MemTracker.
"""

from __future__ import annotations

import torch

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    top_k_mask = logits_sort.size(1) - k.to(torch.long)
    top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
    top_k_mask = logits_sort < top_k_mask
    logits_sort.masked_fill_(top_k_mask, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _sample(logits: torch.Tensor, temperature: torch.Tensor, k: torch.Tensor,
            p: torch.Tensor) -> torch.Tensor:
    greedy = logits.argmax(dim=-1).view(-1)
    logits = logits.div_(torch.where(temperature < _EPS, 1.0, temperature).unsqueeze(dim=1))
    logits = _top_k_top_p(logits, k, p)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    q.exponential_()
    random = probs.div_(q).argmax(dim=-1).view(-1)
    return torch.where(temperature < _EPS, greedy, random, out=greedy)


def dummy_sampler_run(last_hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The sampled token of each of the N rows of `last_hidden` (N x E), the output head
    `head` (V x E), with vLLM's profile-run sampling parameters."""
    hidden = torch.rand_like(last_hidden)  # vLLM replaces the dummy states by random ones
    logits = hidden @ head.t()  # compute_logits: N x V in the model's dtype
    n, vocab = logits.shape
    full = lambda v: torch.full((n,), v)  # noqa: E731
    # the dummy SamplingMetadata: its penalties are held though no_penalties skips them
    penalties = [full(0.1) for _ in range(3)]  # noqa: F841
    return _sample(logits.to(torch.float32), full(0.5), full(vocab - 1), full(0.9))


def measure_sampler_peak(seqs: int, vocab_size: int, n_embd: int,
                         dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak live tensor bytes of `dummy_sampler_run` over `seqs` rows and a vocabulary of
    `vocab_size`, less what was live before it (MemTracker on CPU)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    g = torch.Generator().manual_seed(0)
    last_hidden = torch.randn(seqs, n_embd, generator=g).to(dtype)
    head = torch.randn(vocab_size, n_embd, generator=g).to(dtype)
    with torch.no_grad():
        dummy_sampler_run(last_hidden, head)  # warm-up
    tracker = MemTracker()
    tracker.track_external(last_hidden, head)
    with tracker, torch.no_grad():
        baseline = sum(s[_TOTAL_KEY] for s in tracker.get_tracker_snapshot().values())
        dummy_sampler_run(last_hidden, head)
    peak = sum(s[_TOTAL_KEY] for s in tracker.get_tracker_snapshot("peak").values())
    return peak - baseline
