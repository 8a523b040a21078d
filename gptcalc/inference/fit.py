"""What makes a serving engine's pool fit when it does not: one change at a time, each the
smallest that lets the engine start (its pool holds one request of max_model_len tokens,
`KVPool.fits`), every candidate sized by `gptcalc.inference.pool.kv_pool` as the engine would.

- tp: the smallest tensor-parallel degree above the given one that divides the query heads and
  shards the key/value heads (vLLM's rule, `gptcalc.inference.kv`);
- weights dtype: the widest of the serving dtypes narrower than the given one;
- GPU: the catalogue card of the least usable memory above the given memory;
- max_model_len: the longest request the pool holds, only when the weights, the activation
  peak and non-torch memory fit the budget (a shorter request cannot shrink the weights).

Scope: a --non-torch given is kept at every tp; the default follows the tp and GPU tried
(`pool.default_non_torch`, vLLM's custom all-reduce buffers).
"""

from __future__ import annotations

from typing import Any

from ..config import GPTConfig
from ..errors import ConfigError
from ..gpus import GPUS
from .pool import KVPool, gpu_memory, kv_pool
from .quant import Quantization
from .weights import WEIGHT_DTYPES

CHANGES = ("tp", "weights_dtype", "gpu", "max_model_len")  # the keys of `to_fit`
# the widest tensor-parallel group the advice looks at: 128 nodes of 8 GPUs, far beyond any
# serving deployment, and a bound on the search whatever a config's head count
MAX_TP = 1024


def _fits(cfg: GPTConfig, mml: int, memory: int, args: dict[str, Any]) -> bool:
    """The pool of `args` holds one request; a layout the model cannot be cut into (a hybrid's
    Mamba heads that tp does not divide) does not fit."""
    try:
        return kv_pool(cfg, memory, **args).fits(cfg, mml)
    except ConfigError:
        return False


def _shards(cfg: GPTConfig, tp: int) -> bool:
    kv = cfg.kv_heads
    return cfg.n_head % tp == 0 and (kv < tp or kv % tp == 0)


def smallest_fitting_tp(cfg: GPTConfig, mml: int, memory: int, args: dict[str, Any]
                        ) -> int | None:
    """The smallest tp above args["tp"] (up to n_head and MAX_TP) whose pool fits, else None."""
    return next((tp for tp in range(args["tp"] + 1, min(cfg.n_head, MAX_TP) + 1)
                 if _shards(cfg, tp)
                 and _fits(cfg, mml, memory, {**args, "tp": tp})), None)


def widest_fitting_weights_dtype(cfg: GPTConfig, mml: int, memory: int,
                                 args: dict[str, Any]) -> str | None:
    """The widest weights dtype narrower than args["weights_dtype"] whose pool fits (WEIGHT_DTYPES
    in its order: wider first)."""
    given = args["weights_dtype"]
    width = given.bits / 8 if isinstance(given, Quantization) else WEIGHT_DTYPES[given]
    return next((d for d, b in WEIGHT_DTYPES.items() if b < width
                 and _fits(cfg, mml, memory, {**args, "weights_dtype": d})), None)


def smallest_fitting_gpu(cfg: GPTConfig, mml: int, memory: int, args: dict[str, Any]
                         ) -> str | None:
    """The catalogue GPU of the least usable memory above `memory` whose pool fits, with that
    card's engine defaults where none were given."""
    sizes = {g.name: gpu_memory(g) for g in GPUS.values() if g.memory_bytes is not None}
    bigger = sorted((n for n, size in sizes.items() if size > memory), key=sizes.__getitem__)
    return next((n for n in bigger if _fits(cfg, mml, sizes[n], {**args, "gpu_name": n})),
                None)


def longest_fitting_len(cfg: GPTConfig, pool: KVPool, mml: int) -> int | None:
    """The longest request (below mml) the pool holds once, by bisection (the pages a request
    needs grow with its length); None when the weights, activation peak and non-torch memory
    leave no pool."""
    if pool.kv_cache == 0 or not pool.fits(cfg, 1):
        return None
    lo, hi = 1, mml  # pool.fits(cfg, lo) and not pool.fits(cfg, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pool.fits(cfg, mid) else (lo, mid)
    return lo


def to_fit(cfg: GPTConfig, pool: KVPool, mml: int, memory: int, args: dict[str, Any]
           ) -> dict[str, Any]:
    """Each single change (CHANGES) that lets the engine start, None where none does; every
    value None when it starts already. `args` are kv_pool's keyword arguments as given."""
    if pool.fits(cfg, mml):
        return dict.fromkeys(CHANGES)
    return {"tp": smallest_fitting_tp(cfg, mml, memory, args),
            "weights_dtype": widest_fitting_weights_dtype(cfg, mml, memory, args),
            "gpu": smallest_fitting_gpu(cfg, mml, memory, args),
            "max_model_len": longest_fitting_len(cfg, pool, mml)}


__all__ = ["CHANGES", "longest_fitting_len", "smallest_fitting_gpu", "smallest_fitting_tp",
           "to_fit", "widest_fitting_weights_dtype"]
