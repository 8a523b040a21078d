"""The bytes of a model's weights in the dtypes inference engines store them in: 16 bit, fp8,
and weight-only int8 / int4 with their quantisation scales, or as a checkpoint's
quantization_config stores them (`gptcalc.inference.quant`). (KV-cache elements:
`gptcalc.inference.kv`.)"""

from __future__ import annotations

import math
from fractions import Fraction

from ..config import GPTConfig
from ..errors import ConfigError, one_of, positive_int
from ..inventory import inventory, tied_head_weight
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


# --- where the weights live across pipeline stages, data-parallel ranks and expert parallelism --


def pp_partition(n_layer: int, pp: int) -> tuple[int, ...]:
    """Decoder layers of each of pp pipeline stages as vLLM splits them
    (vllm/distributed/utils.py, `get_pp_indices`, vllm-project/vllm@5a6541db): n_layer // pp
    each, and the remainder r one more each on the r stages before the last
    (partitions[-2], partitions[-3], ...: the last stage holds the final norm and lm_head, and
    with r <= pp - 2 the first, which holds the embedding, is spared too)."""
    positive_int("pp", pp)
    if pp > n_layer:
        raise ConfigError("pp", f"pp {pp} exceeds the model's {n_layer} layers")
    parts = [n_layer // pp] * pp
    for i in range(2, n_layer % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def _first_layers(cfg: GPTConfig, n: int) -> GPTConfig | None:
    """The model cut to its first n blocks (None for none): every layer-kind rule (MoE steps,
    dense layers, attention patterns) counts from block 0, so blocks [a, b) are the difference
    of the cuts at b and a."""
    return None if n == 0 else cfg.replace(n_layer=n)


def _linear_bytes(cfg: GPTConfig, dtype: WeightsDtype, m) -> int:
    """Bytes of the `m.count` Linears of one kind in `dtype` (weights, scales, biases), as
    `weight_bytes` counts them."""
    bias = m.count * m.out_features * unquantised_bytes(dtype) if m.bias else 0
    if isinstance(dtype, Quantization):
        weight, scales, kept = quantized_linear_bytes(dtype, cfg, m)
        return weight + scales + kept * 2 + bias
    if dtype in ("int8", "int4"):
        scales = m.count * math.ceil(m.in_features / GROUP_SIZE) * m.out_features * SCALE_BYTES
    elif dtype == "fp8":
        scales = m.count * FP8_SCALE_BYTES
    else:
        scales = 0
    return math.ceil(m.weights * WEIGHT_DTYPES[dtype]) + scales + bias


def block_weight_parts(cfg: GPTConfig | None, dtype: WeightsDtype = "bf16") -> dict[str, int]:
    """The blocks' weight bytes in three parts that split differently across GPUs:
    experts: the routed experts (their Linears and biases); replicated: the blocks' norms and
    MoE routers (`replicated_weight_bytes` less the norms outside the blocks); split: the rest,
    cut tp ways. Zeros for no blocks (None)."""
    if cfg is None:
        return {"split": 0, "replicated": 0, "experts": 0}
    a = unquantised_bytes(dtype)
    outer = [t for t in inventory(cfg) if t.place != "block"]
    total = sum(weight_bytes(cfg, dtype).values()) - sum(t.numel * a for t in outer)
    experts = sum(_linear_bytes(cfg, dtype, m) for m in block_linears(cfg)
                  if m.name.startswith("moe.experts"))
    outer_norms = sum(t.numel * a for t in outer if t.role == "norm")
    replicated = replicated_weight_bytes(cfg, dtype) - outer_norms
    return {"split": total - experts - replicated, "replicated": replicated, "experts": experts}


def outer_tensors(cfg: GPTConfig, first: bool, last: bool, pp: int = 1) -> list:
    """The tensors outside the blocks a pipeline stage holds: the embedding's on the first
    stage (token embedding, a position table, OPT's projection in, BLOOM's embedding norm), the
    head's on the last (final norm, OPT's projection out, an untied lm_head), and with a tied
    head at pp > 1 the token embedding's matrix again on the last stage (vLLM's last stage
    builds its own embedding to tie the lm_head to: vllm/model_executor/models/llama.py,
    `LlamaModel.__init__`, `is_first_rank or (tie_word_embeddings and is_last_rank)`)."""
    out = [t for t in inventory(cfg) if (first and t.place == "embedding")
           or (last and t.place == "head")]
    tied = tied_head_weight(cfg)
    if last and not first and pp > 1 and tied is not None:
        out.append(tied)
    return out


def stage_weight_bytes(cfg: GPTConfig, dtype: WeightsDtype = "bf16", tp: int = 1,
                       layers: tuple[int, int] | None = None, pp: int = 1, dp: int = 1,
                       expert_parallel: bool = False) -> int:
    """Weight bytes on one GPU of the pipeline stage holding blocks [start, end) (default all),
    tp GPUs to a stage and dp replicas:

        split / tp + replicated                 the blocks' attention, dense MLPs, shared
                                                experts; norms and routers whole
      + experts / (tp x dp)                     routed experts, each cut across every GPU of
                                                the tp x dp ranks (vLLM flattens tp across dp
                                                for the MoE layers), or with expert_parallel
      + experts x ceil(n / (tp x dp)) / n       whole experts, n / (tp x dp) of them per rank,
                                                the remainder one more each on the first ranks
                                                (the heaviest GPU's share)
      + `outer_tensors` in the unquantised dtype, vocabulary rows split tp ways

    Sources: vllm/model_executor/layers/fused_moe/config.py, `FusedMoEParallelConfig.make`
    (`flatten_tp_across_dp`; with enable_expert_parallel ep_size = tp x dp and the experts' tp
    1; vllm-project/vllm@00c1c6a2) and `determine_expert_map` (base = n // ep_size, the first
    n % ep_size ranks one more); attention and dense layers stay tensor-parallel within each dp
    rank (a dp rank is a whole engine)."""
    return sum(stage_weight_parts(cfg, dtype, tp, layers, pp, dp, expert_parallel).values())


def stage_weight_parts(cfg: GPTConfig, dtype: WeightsDtype = "bf16", tp: int = 1,
                       layers: tuple[int, int] | None = None, pp: int = 1, dp: int = 1,
                       expert_parallel: bool = False) -> dict[str, int]:
    """`stage_weight_bytes` as {"blocks": the stage's blocks, "outer": embedding and head}."""
    start, end = (0, cfg.n_layer) if layers is None else layers
    hi = block_weight_parts(_first_layers(cfg, end), dtype)
    lo = block_weight_parts(_first_layers(cfg, start), dtype)
    part = {k: hi[k] - lo[k] for k in hi}
    shards = tp * dp
    if expert_parallel and cfg.moe:
        experts = part["experts"] * math.ceil(cfg.n_expert / shards) // cfg.n_expert
    else:
        experts = part["experts"] // shards
    a = unquantised_bytes(dtype)
    outer = outer_tensors(cfg, start == 0, end == cfg.n_layer, pp)
    whole = sum(t.numel * a for t in outer if t.split != "vocab")
    vocab = sum(t.numel * a for t in outer if t.split == "vocab")
    return {"blocks": part["split"] // tp + part["replicated"] + experts,
            "outer": whole + vocab // tp}
