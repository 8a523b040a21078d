"""The bytes of a model's weights in the dtypes inference engines store them in: 16 bit, fp8,
and weight-only int8 / int4 with their quantisation scales, or as a checkpoint's
quantization_config stores them (`gptcalc.inference.quant`). (KV-cache elements:
`gptcalc.inference.kv`.)"""

from __future__ import annotations

import math
from fractions import Fraction

from ..config import GPTConfig
from ..errors import one_of
from ..linears import block_linears
from ..params import count_params
from .quant import Quantization, quantized_linear_bytes

# a serving dtype's name (WEIGHT_DTYPES) or a checkpoint's quantisation
WeightsDtype = str | Quantization

# bytes per weight element, widest first; int8 / int4 also store one fp16 scale per GROUP_SIZE
# weights; fp32 is vLLM's --dtype float32 (every weight, and the activations, in 4 bytes)
WEIGHT_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": Fraction(1, 2)}
GROUP_SIZE = 128  # int8/int4: one scale per 128 consecutive input weights of an output (GPTQ/AWQ)
SCALE_BYTES = 2  # fp16 scale per group
FP8_SCALE_BYTES = 4  # fp8: one fp32 scale per matrix (per-tensor scaling)


def weight_bytes(cfg: GPTConfig, dtype: WeightsDtype = "bf16") -> dict[str, int]:
    """Bytes of the weights by part; the values sum to the model's weight bytes.

    quantised: the block Linears' weight matrices in `dtype`; scales: int8/int4 one fp16 scale
    per group of 128 input weights of each output (ceil(in / 128) x out per matrix), fp8 one fp32
    per matrix, none for 16-bit; other: embeddings, lm_head, norms and biases, kept 16-bit
    (GPTQ, AWQ and bitsandbytes leave them unquantised), or 32-bit with fp32 weights.
    A `Quantization`: each block Linear kind by `quant.quantized_linear_bytes` (its scales and
    zero points in scales), the modules it leaves unquantised in 16 bit with the rest."""
    if isinstance(dtype, Quantization):
        return checkpoint_weight_bytes(cfg, dtype)
    one_of("weights_dtype", dtype, tuple(WEIGHT_DTYPES))
    mats = block_linears(cfg)
    n_matrix = sum(m.weights for m in mats)
    if dtype in ("int8", "int4"):
        scales = sum(m.count * math.ceil(m.in_features / GROUP_SIZE) * m.out_features
                         for m in mats) * SCALE_BYTES
    elif dtype == "fp8":
        scales = sum(m.count for m in mats) * FP8_SCALE_BYTES
    else:
        scales = 0
    return {
        "quantised": math.ceil(n_matrix * WEIGHT_DTYPES[dtype]),
        "scales": scales,
        "other": (count_params(cfg).total - n_matrix) * unquantised_bytes(dtype),
    }


def checkpoint_weight_bytes(cfg: GPTConfig, q: Quantization) -> dict[str, int]:
    """`weight_bytes` of a checkpoint quantised as `q`: quantised and scales summed over the
    block Linear kinds, other = every other parameter and the kept Linears' weights x 2."""
    parts = [quantized_linear_bytes(q, cfg, m) for m in block_linears(cfg)]
    quantised = sum(p[0] for p in parts)
    scales = sum(p[1] for p in parts)
    n_quantised = sum(m.weights for m in block_linears(cfg)) - sum(p[2] for p in parts)
    return {"quantised": quantised, "scales": scales,
            "other": (count_params(cfg).total - n_quantised) * 2}


def unquantised_bytes(dtype: WeightsDtype) -> int:
    """Bytes per element of what `dtype` leaves unquantised (embeddings, norms, biases), and of
    the activations a forward with such weights runs in: 4 for fp32, else 2 (bf16 or fp16)."""
    return 4 if dtype == "fp32" else 2


def weights_label(dtype: WeightsDtype) -> str:
    """The name a dtype or quantisation goes by in the output (bf16, "fp8 (128x128 blocks)")."""
    return dtype.label if isinstance(dtype, Quantization) else dtype


def replicated_weight_bytes(cfg: GPTConfig, dtype: WeightsDtype = "bf16") -> int:
    """Weight bytes every one of tp devices holds whole: the norms (the blocks' and the final
    one, and the per-head query/key norms) in the unquantised dtype, and each MoE layer's
    router, a Linear(E, n_expert) that vLLM builds as a ReplicatedLinear
    (vllm/model_executor/models/qwen3_moe.py, mixtral.py, deepseek_v2.py: `self.gate =
    ReplicatedLinear(config.hidden_size, num_experts, ...)`, 0.8 to 0.33), in 16 bit under a
    checkpoint's quantisation (`quant`) and in `dtype` otherwise, as `weight_bytes` counts it."""
    comps = count_params(cfg).components
    norms = sum(v for k, v in comps.items() if k.startswith("norm/") or k == "attention/norm")
    router = comps.get("moe/router", 0)
    router_bytes = 2 if isinstance(dtype, Quantization) else WEIGHT_DTYPES[dtype]
    return unquantised_bytes(dtype) * norms + math.ceil(router * router_bytes)


def device_weight_bytes(cfg: GPTConfig, dtype: WeightsDtype = "bf16", tp: int = 1) -> int:
    """Weight bytes on one of tp devices (`weight_bytes` summed): the norms and MoE routers
    replicated (`replicated_weight_bytes`), every other weight split tp ways (Megatron)."""
    whole = replicated_weight_bytes(cfg, dtype)
    return (sum(weight_bytes(cfg, dtype).values()) - whole) // tp + whole
