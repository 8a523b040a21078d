"""Memory of an inference run: the KV cache and the weights that serve it."""

from __future__ import annotations

from ..config import GPTConfig
from ..training_setup import TrainingSetup
from ..layers import kv_cache_elements
from .states import stage_params


def kv_cache_bytes(cfg: GPTConfig, batch_size: int, context: int, dtype_bytes: int,
                   tp: int = 1, pp: int = 1) -> int:
    """KV cache per device: B x `gptcalc.layers.kv_cache_elements` x bytes.

    Dense attention: 2 (K and V) x L x context x n_kv_head x head_dim per sequence (only the
    n_kv_head key/value heads of grouped-query attention); a sliding-window block caches at most
    its window; multi-head latent attention caches its compressed latent. Per device, tensor
    parallelism shards the KV heads (MLA's latent is shared by every head and is not sharded)
    and pipeline parallelism the blocks (an even share of each kind per stage).
    """
    t = 1 if cfg.mla else tp
    return batch_size * kv_cache_elements(cfg, context) * dtype_bytes // (t * pp)


def serving_dtype_bytes(setup: TrainingSetup) -> int:
    """Bytes per element a model trained with `setup` is served in: fp32 stays fp32, every other
    mode serves its 16-bit compute dtype."""
    return 4 if setup.mode == "fp32" else 2


def inference_bytes(cfg: GPTConfig, batch_size: int, context: int, setup: TrainingSetup) -> int:
    """Weights in the serving dtype plus the KV cache, on the most loaded device (activations of
    one decoded token are not counted)."""
    w = serving_dtype_bytes(setup)
    n = max(sum(v.values()) for v in stage_params(cfg, setup).values())
    return n * w + kv_cache_bytes(cfg, batch_size, context, w, setup.tp, setup.pp)


def max_context(cfg: GPTConfig, batch_size: int, setup: TrainingSetup, budget: int
                ) -> int | None:
    """The longest context whose inference memory fits `budget` bytes, exactly: 0 if the
    weights alone do not fit; None when no context is too long (every block's cache is bounded
    by a sliding window). The cache only grows with the context: a doubling search, then
    bisection, with no ceiling."""
    def fits(c: int) -> bool:
        return inference_bytes(cfg, batch_size, c, setup) <= budget
    if not fits(1):
        return 0
    from ..layers import global_layers

    if global_layers(cfg) == 0:
        return None
    return largest_fitting(fits, 1)


def largest_fitting(fits, lo: int) -> int:
    """The largest n >= lo with fits(n), for a monotone `fits` with fits(lo) true: doubling,
    then bisection; exact, with no ceiling."""
    hi = lo * 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
