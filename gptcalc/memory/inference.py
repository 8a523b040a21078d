"""Memory of an inference run: the KV cache and the weights that serve it."""

from __future__ import annotations

from ..config import GPTConfig, TrainingSetup
from .states import stage_params


def kv_cache_bytes(cfg: GPTConfig, batch_size: int, context: int, dtype_bytes: int,
                   tp: int = 1, pp: int = 1) -> int:
    """KV cache: 2 (K and V) x L x B x context x n_kv_head x head_dim x bytes.

    Grouped-query aware (only the n_kv_head key/value heads are cached); per device, tensor
    parallel shards the KV heads and pipeline parallel the layers.
    """
    return (2 * (cfg.n_layer // pp) * batch_size * context * (cfg.kv_heads // tp)
            * cfg.head_size * dtype_bytes)


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


def max_context(cfg: GPTConfig, batch_size: int, setup: TrainingSetup, budget: int) -> int:
    """The longest context whose inference memory fits `budget` bytes, exactly (0 if the
    weights alone do not fit): the KV cache grows linearly, so the boundary is a division."""
    fixed = inference_bytes(cfg, batch_size, 0, setup)
    per_token = kv_cache_bytes(cfg, batch_size, 1, serving_dtype_bytes(setup), setup.tp,
                               setup.pp)
    return max(0, (budget - fixed) // per_token) if budget >= fixed else 0
