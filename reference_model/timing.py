"""Wall time of the reference model's decode on CPU, with and without a KV cache.

The measured twin of the decode roofline's shape: with a cache, one new token costs a constant
(the weights) plus a term linear in the context (its query against the cached keys), small on a
tiny model; without one (the tutorial's generate) the whole context runs through the model again, so
the time per token grows with the context. Times are medians of `repeats` runs after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from gptcalc import GPTConfig

from .model import build_model


@dataclass(frozen=True)
class DecodeTiming:
    context: int  # tokens the new token attends to, itself included
    seconds_with_cache: float  # one decode step against a KV cache of context - 1 tokens
    seconds_without_cache: float  # the same token by a forward over all `context` tokens


def timing_config(cfg: GPTConfig) -> GPTConfig:
    """A tiny model of cfg's family (its switches, GQA or not): L=2, E=64, 4 heads, T=512,
    V <= 512, d_ff = 4E, full rotary: small enough to time in a second on a CPU."""
    kv = None if cfg.kv_heads == cfg.n_head or cfg.qkv_layout == "per_head" else 2
    return cfg.replace(n_layer=2, n_embd=64, n_head=4, n_kv_head=kv, head_dim=None, d_ff=None,
                       ffn_mult=4, vocab_size=min(cfg.vocab_size, 512), block_size=512,
                       rotary_pct=1.0, dropout=0.0)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocator and kernel selection
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def decode_times(cfg: GPTConfig, contexts: Sequence[int] = (16, 64, 128, 256, 512),
                 repeats: int = 5, batch_size: int = 1, seed: int = 0) -> list[DecodeTiming]:
    """Time one decoded token at each context (2 <= context <= T), with and without a cache."""
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: steadier times on a shared machine
    try:
        return [_time_context(model, cfg, c, repeats, batch_size, gen) for c in contexts]
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def _time_context(model, cfg: GPTConfig, c: int, repeats: int, batch_size: int,
                  gen: torch.Generator) -> DecodeTiming:
    if not 2 <= c <= cfg.block_size:
        raise ValueError(f"context {c} must be in [2, block_size {cfg.block_size}]")
    idx = torch.randint(cfg.vocab_size, (batch_size, c), generator=gen)
    cache = model.new_kv_cache()
    model(idx[:, :-1], kv_cache=cache)  # the prefill of the first c - 1 tokens
    # each step appends to the cache (torch.cat makes new tensors): restart from a copy
    step = lambda: model(idx[:, -1:], kv_cache=[list(kv) for kv in cache])  # noqa: E731
    return DecodeTiming(c, _median_seconds(step, repeats),
                        _median_seconds(lambda: model(idx), repeats))
