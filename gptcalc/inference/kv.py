"""The KV cache: bytes per token and per sequence on one device, the one rule every inference
figure (`serve`'s pool, `infer`'s roofline, `memory`'s KV line) counts with.

Per token and layer, one of tp GPUs caches

    grouped-query attention   2 x max(1, n_kv_head / tp) x head_dim    K and V of its heads
    multi-head latent         kv_lora_rank + qk_rope_head_dim          the whole latent

elements. Tensor parallelism splits the key/value heads; with fewer heads than GPUs each GPU
keeps one whole head, replicated (vLLM: vllm/config/model.py, `ModelConfig.get_num_kv_heads`,
`max(1, total_num_kv_heads // tensor_parallel_size)`; vllm/model_executor/layers/linear.py,
`QKVParallelLinear`, `num_kv_head_replicas`). MLA's latent is shared by every head, so every GPU
caches all of it (vLLM's `MLAAttentionSpec`). A sliding-window layer caches at most its window
(`gptcalc.layers.kv_tokens_per_layer`); pipeline parallelism gives each stage an even share of
the layers.
"""

from __future__ import annotations

from ..config import GPTConfig
from ..errors import ConfigError, one_of
from ..layers import global_layers, kv_elements_per_token, kv_tokens_per_layer, sliding_layers

# bytes per element; per-tensor scales ignored; fp32 is what vLLM's "auto" caches for fp32 weights
KV_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def kv_heads_per_device(cfg: GPTConfig, tp: int) -> int:
    """Key/value heads one of tp GPUs caches: n_kv_head / tp, or one replicated head when there
    are fewer heads than GPUs, max(1, n_kv_head // tp) (vLLM's `ModelConfig.get_num_kv_heads`).
    With at least as many heads as GPUs, tp must divide them."""
    if cfg.kv_heads >= tp and cfg.kv_heads % tp:
        raise ConfigError("tp", f"tp {tp} must divide the {cfg.kv_heads} key/value heads")
    return max(1, cfg.kv_heads // tp)


def kv_elements_per_token_layer(cfg: GPTConfig, tp: int = 1) -> int:
    """Cached elements per token in one layer on one of tp GPUs: MLA's latent and shared rotary
    key, kv_lora_rank + qk_rope_head_dim, on every GPU; else K and V of the device's heads,
    2 x kv_heads_per_device x head_dim."""
    if cfg.mla:
        return kv_elements_per_token(cfg)
    return 2 * kv_heads_per_device(cfg, tp) * cfg.head_size


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per cached element of `kv_dtype` (fp8 and int8: 1 byte; scales not counted)."""
    return KV_DTYPES[one_of("kv_dtype", kv_dtype, tuple(KV_DTYPES))]


def kv_bytes_per_token_layer(cfg: GPTConfig, tp: int = 1, kv_dtype: str = "bf16") -> int:
    """Cached bytes per token in one layer on one GPU: `kv_elements_per_token_layer` x the
    element size of `kv_dtype`."""
    return kv_elements_per_token_layer(cfg, tp) * kv_dtype_bytes(kv_dtype)


def kv_bytes_per_block(cfg: GPTConfig, block_size: int, tp: int = 1,
                       kv_dtype: str = "bf16") -> int:
    """One block: block_size tokens of every layer, L x block_size x bytes per token-layer."""
    return cfg.n_layer * block_size * kv_bytes_per_token_layer(cfg, tp, kv_dtype)


def kv_cache_bytes(cfg: GPTConfig, batch_size: int, context: int, dtype_bytes: int,
                   tp: int = 1, pp: int = 1) -> int:
    """KV cache per device of B sequences of `context` tokens:

        B x kv_elements_per_token_layer(tp) x (global layers x context
                                               + sliding layers x min(context, window))
          x dtype_bytes // pp

    the elements per token and layer on one of tp GPUs (`kv_elements_per_token_layer`: the
    device's K/V heads, replicated when tp exceeds them, or MLA's whole latent), a pipeline
    stage holding an even share of the layers of each kind."""
    full, windowed = kv_tokens_per_layer(cfg, context)
    token_layers = global_layers(cfg) * full + sliding_layers(cfg) * windowed
    return batch_size * kv_elements_per_token_layer(cfg, tp) * token_layers * dtype_bytes // pp


__all__ = ["KV_DTYPES", "kv_bytes_per_block", "kv_bytes_per_token_layer", "kv_cache_bytes",
           "kv_dtype_bytes", "kv_elements_per_token_layer", "kv_heads_per_device"]
