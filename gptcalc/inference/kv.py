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
from ..layers import (deltanet_layers, global_layers, kv_elements_per_token, kv_tokens_per_layer,
                      mamba_layers, sliding_layers)

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


__all__ = ["HYBRID_BLOCK_MULTIPLE", "KV_DTYPES", "SSM_CACHE_DTYPES", "hybrid_block_size",
           "hybrid_groups",
           "state_bytes_per_layer", "state_elements_per_layer", "state_layers",
           "kv_bytes_per_block", "kv_bytes_per_token_layer", "kv_cache_bytes",
           "kv_dtype_bytes", "kv_elements_per_token_layer", "kv_heads_per_device"]


# --- hybrid models: the fixed per-sequence state of Mamba and Gated DeltaNet layers ------------
# vLLM's shapes and dtypes: vllm/model_executor/layers/mamba/mamba_utils.py,
# `MambaStateShapeCalculator` and `MambaStateDtypeCalculator` (vllm-project/vllm@02d71083);
# the attention page raised to hold one state page: vllm/model_executor/models/config.py,
# `HybridAttentionMambaModelConfig.verify_and_update_config` (vllm-project/vllm@0144dd5b).
HYBRID_BLOCK_MULTIPLE = 16  # the attention block size a multiple of 16 ("FA only supports ...")


def _divide(n: int, tp: int, what: str) -> int:
    """n / tp, which vLLM's `divide` asserts is exact."""
    if n % tp:
        raise ConfigError("tp", f"tp {tp} must divide the {n} {what}")
    return n // tp


def state_elements_per_layer(cfg: GPTConfig, tp: int = 1) -> dict[str, int]:
    """Elements of one sequence's state in one Mamba or Gated DeltaNet layer on one of tp GPUs,
    {"conv": ..., "ssm": ...}, as vLLM's `MambaStateShapeCalculator` shapes them:

      Mamba-1 (`mamba1_state_shape`)   conv (K - 1) x d_inner/tp,  ssm d_inner/tp x N
      Mamba2  (`mamba2_state_shape`)   conv (K - 1) x (d_inner + 2 G' N)/tp,
                                       ssm h/tp x head_dim x N; G' = G, or tp when tp does
                                       not divide G (`extra_groups_for_head_shards`)
      Gated DeltaNet (`gated_delta_net_state_shape`)
                                       conv (K - 1) x (2 Hk dk + Hv dv)/tp,  ssm Hv/tp x dv x dk

    K the conv width, N d_state, h Mamba2's heads, G its groups; no speculative tokens."""
    if deltanet_layers(cfg):
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        conv = _divide(2 * Hk * dk + Hv * dv, tp, "DeltaNet conv channels")
        return {"conv": (K - 1) * conv,
                "ssm": _divide(Hv, tp, "DeltaNet value heads") * dv * dk}
    D, N, K = cfg.mamba_inner, cfg.mamba_d_state, cfg.mamba_d_conv
    if cfg.mamba_version == 1:
        inner = _divide(D, tp, "Mamba channels")
        return {"conv": (K - 1) * inner, "ssm": inner * N}
    G = cfg.mamba_n_groups
    G += 0 if G % tp == 0 else tp - G  # vLLM's extra_groups_for_head_shards
    return {"conv": (K - 1) * _divide(D + 2 * G * N, tp, "Mamba2 conv channels"),
            "ssm": _divide(cfg.mamba_n_heads, tp, "Mamba2 heads") * cfg.mamba_head_dim * N}


# vLLM's --mamba-ssm-cache-dtype: "auto" keeps the recurrent state in the model's dtype
SSM_CACHE_DTYPES = {"auto": None, "float32": 4, "bfloat16": 2, "float16": 2}


def state_bytes_per_layer(cfg: GPTConfig, tp: int = 1, dtype_bytes: int = 2,
                          ssm_dtype_bytes: int | None = None) -> int:
    """Bytes of one sequence's state in one Mamba / DeltaNet layer on one GPU: vLLM's
    `MambaSpec.page_size_bytes`, the conv state in the model's dtype and the recurrent (ssm)
    state in it too unless --mamba-ssm-cache-dtype says otherwise (`MambaStateDtypeCalculator.
    _mamba_state_dtype`: mamba_cache_dtype "auto" is the model dtype, not --kv-cache-dtype)."""
    el = state_elements_per_layer(cfg, tp)
    return el["conv"] * dtype_bytes + el["ssm"] * (ssm_dtype_bytes or dtype_bytes)


def hybrid_block_size(cfg: GPTConfig, block_size: int | None, tp: int = 1,
                      kv_dtype: str = "bf16", state_dtype_bytes: int = 2,
                      ssm_dtype_bytes: int | None = None) -> int:
    """The attention block size vLLM runs a hybrid model with: the smallest multiple of 16
    tokens whose attention page (block x KV bytes per token and layer) holds one layer's state,

        needed = 16 x ceil(state page / (16 x KV bytes per token-layer))

    taken when --block-size is not given or is below it, else the given size; the state page
    is then padded up to the attention page (`HybridAttentionMambaModelConfig.
    verify_and_update_config`)."""
    token = kv_bytes_per_token_layer(cfg, tp, kv_dtype)
    state = state_bytes_per_layer(cfg, tp, state_dtype_bytes, ssm_dtype_bytes)
    m = HYBRID_BLOCK_MULTIPLE
    needed = m * -(-state // (m * token))
    return needed if block_size is None or block_size < needed else block_size


def state_layers(cfg: GPTConfig) -> int:
    """Layers that keep a per-sequence state: Mamba (Falcon-H1's parallel ones included) and
    Gated DeltaNet layers."""
    return mamba_layers(cfg) + deltanet_layers(cfg)


def hybrid_groups(attention: int, state: int) -> tuple[int, int, int]:
    """(layers per group, attention groups, state groups) of vLLM's hybrid KV cache manager
    (vllm/v1/core/kv_cache_utils.py, `_get_kv_cache_groups_uniform_page_size`,
    vllm-project/vllm@001cabc1): the group size is the fewer layers of the two kinds, or the
    more when they are fewer than 1.5 x the fewer; each kind is cut into ceil(layers / size)
    groups (the last padded). One page tensor per group slot is shared by a layer of every group,
    so a block costs size x page bytes, and a request holds ceil(tokens / block) blocks in each
    attention group and one block in each state group."""
    kinds = [n for n in (attention, state) if n]
    if not kinds:
        return 0, 0, 0
    size = min(kinds)
    if max(kinds) < 1.5 * size:
        size = max(kinds)
    return size, -(-attention // size), -(-state // size)
