"""Inference on accelerators, per device, in bytes and seconds.

- `weights`: weight bytes per serving dtype, quantisation scales included;
- `kv`: the KV cache per token and per sequence, the one rule of key/value heads under tensor
  parallelism (one replicated head per GPU when tp exceeds them, as vLLM shards them);
- `servers`: the serving-engine interface (`Server`) and its registry, and a release
  (`Release`: the engine generation it runs);
- `sampler`: the bytes of vLLM's sampler pass over the profile run's last tokens;
- `adapters`: the LoRA slots vLLM reserves with --enable-lora;
- `cudagraph`: the serving engines' CUDA graph capture sizes and vLLM's graph estimate by
  release;
- `pool`: the KV pool of a registered serving engine, and the activation peak of a profile
  run;
- `vllm`, `sglang`: the two serving engines, one module each, registered when this package
  is imported;
- `roofline`: memory and the roofline of prefill and decode (`gptcalc infer`).

This package never imports the training-memory package `gptcalc.memory`, nor torch.
"""

from .kv import (KV_DTYPES, kv_bytes_per_block, kv_bytes_per_token_layer, kv_cache_bytes,
                 kv_dtype_bytes, kv_elements_per_token_layer, kv_heads_per_device)
from .pool import (DEFAULT_NON_TORCH, KVPool, gpu_memory, kv_pool, layer_blocks_per_request,
                   profile_activation_bytes)
from .vllm import vllm_defaults  # registers vLLM
from .sglang import sglang_mem_fraction_static  # registers SGLang
from .roofline import (DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_FLOPS_EFFICIENCY, Phase, Serving,
                       crossing_batch, prefill_activation_bytes, serving)
from .weights import GROUP_SIZE, WEIGHT_DTYPES, device_weight_bytes, weight_bytes

__all__ = [
    "DEFAULT_BANDWIDTH_EFFICIENCY", "DEFAULT_FLOPS_EFFICIENCY", "DEFAULT_NON_TORCH", "GROUP_SIZE",
    "KVPool", "KV_DTYPES", "Phase", "Serving", "WEIGHT_DTYPES", "crossing_batch",
    "device_weight_bytes", "gpu_memory", "kv_bytes_per_block", "kv_bytes_per_token_layer",
    "kv_cache_bytes", "kv_dtype_bytes", "kv_elements_per_token_layer", "kv_heads_per_device",
    "kv_pool", "layer_blocks_per_request", "prefill_activation_bytes",
    "profile_activation_bytes", "serving", "sglang_mem_fraction_static", "vllm_defaults",
    "weight_bytes",
]
