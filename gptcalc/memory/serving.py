"""The inference memory of a trained model: its weights in the serving dtype plus the KV cache
(`gptcalc.inference.kv`), and the longest context that fits; `largest_fitting`, the exact
search the largest-workload questions share."""

from __future__ import annotations

from ..config import GPTConfig
from ..inference.kv import kv_cache_bytes
from ..layers import global_layers
from ..training_setup import TrainingSetup
from .states import stage_params


def serving_dtype_bytes(setup: TrainingSetup) -> int:
    """Bytes per element a model trained with `setup` is served in: fp32 stays fp32, every other
    mode serves its 16-bit compute dtype."""
    return 4 if setup.mode == "fp32" else 2


def inference_bytes(cfg: GPTConfig, batch_size: int, context: int, setup: TrainingSetup) -> int:
    """Weights in the serving dtype plus the KV cache (`gptcalc.inference.kv.kv_cache_bytes`),
    on the most loaded device of the set-up's tensor and pipeline layout (activations of one
    decoded token are not counted)."""
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
