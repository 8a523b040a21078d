"""The bytes of a model's weights in the dtypes inference engines store them in: 16 bit, fp8,
and weight-only int8 / int4 with their quantisation scales. (KV-cache elements:
`gptcalc.inference.kv`.)"""

from __future__ import annotations

import math
from fractions import Fraction

from ..config import GPTConfig
from ..errors import one_of
from ..linears import block_linears
from ..params import count_params

# bytes per weight element, widest first; int8 / int4 also store one fp16 scale per GROUP_SIZE
# weights; fp32 is vLLM's --dtype float32 (every weight, and the activations, in 4 bytes)
WEIGHT_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": Fraction(1, 2)}
GROUP_SIZE = 128  # int8/int4: one scale per 128 consecutive input weights of an output (GPTQ/AWQ)
SCALE_BYTES = 2  # fp16 scale per group
FP8_SCALE_BYTES = 4  # fp8: one fp32 scale per matrix (per-tensor scaling)


def weight_bytes(cfg: GPTConfig, dtype: str = "bf16") -> dict[str, int]:
    """Bytes of the weights by part; the values sum to the model's weight bytes.

    quantised: the block Linears' weight matrices in `dtype`; scales: int8/int4 one fp16 scale
    per group of 128 input weights of each output (ceil(in / 128) x out per matrix), fp8 one fp32
    per matrix, none for 16-bit; other: embeddings, lm_head, norms and biases, kept 16-bit
    (GPTQ, AWQ and bitsandbytes leave them unquantised), or 32-bit with fp32 weights."""
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


def unquantised_bytes(dtype: str) -> int:
    """Bytes per element of what `dtype` leaves unquantised (embeddings, norms, biases), and of
    the activations a forward with such weights runs in: 4 for fp32, else 2 (bf16 or fp16)."""
    return 4 if dtype == "fp32" else 2


def device_weight_bytes(cfg: GPTConfig, dtype: str = "bf16", tp: int = 1) -> int:
    """Weight bytes on one of tp devices (`weight_bytes` summed): the norms replicated, every
    other weight split tp ways (Megatron)."""
    norms = unquantised_bytes(dtype) * sum(v for k, v in count_params(cfg).components.items()
                                           if k.startswith("norm/"))
    return (sum(weight_bytes(cfg, dtype).values()) - norms) // tp + norms
