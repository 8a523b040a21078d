"""Inference on accelerators: memory, and the roofline of prefill and decode.

Roofline (Williams et al. 2009): a phase takes max(FLOPs / peak FLOP/s, bytes / bandwidth); the
larger term names its bound. Per device, with tp-way tensor parallelism (Megatron: every matrix
split tp ways; the KV cache as `gptcalc.inference.kv` counts it, one replicated key/value head
per GPU when tp exceeds the heads; communication not counted). With such replication the
replicated K/V projections' weights and FLOPs are still counted split tp ways.

- prefill: one forward over B prompts of p tokens (gptcalc.flops.inference_flops, attention over
  the full p x p, logits for every position); bytes = the weights read once + the KV cache
  written.
- decode: one step gives each of the B sequences one token. FLOPs = B x decode FLOPs at context
  c (a KV cache: one query against c keys); bytes = the weights read once + the KV cache read at
  context c. Both are affine in c, so their means over the gen_len steps (c = p + 1 .. p + g, the
  new token's own key and value included) are their values at the mean context p + (g + 1) / 2;
  the per-token time is taken at that mean. The weights read include the token embedding, of
  which a step gathers only B rows (1.9% of Llama-2-7B): an upper bound by that much.
- the batch where decode turns compute-bound: the smallest B with B f / P >= (W + B k) / BW
  (f FLOPs and k KV bytes per sequence and step, W weight bytes, P peak, BW bandwidth); none
  when k / BW >= f / P, i.e. when attention over the cache is itself memory-bound at any batch.

Matmuls run at the GPU's 16-bit peak (bf16; fp16 for fp16 weights): weight-only quantisation
(int8, int4 and fp8 weights here) dequantises to 16 bits before the matmul.

Expected times divide each roofline term by an efficiency: `flops_efficiency` (default 0.5, an
assumption: large training runs report 40-55% of peak, PaLM 46.2% (Chowdhery et al. 2022); a
prefill is the same matmuls) and `bandwidth_efficiency` (default 0.685: gpt-fast's Llama-2-7B
bf16 at batch 1 on an A100-80GB moves 1,397.31 GB/s of the 2,039 GB/s peak at 104.9 tokens/s,
gpt-fast README, "Benchmarks"). The expected time of a phase is the larger expected term.

Memory per device: the GPU's usable memory (torch.cuda.mem_get_info's total, `gptcalc.gpus`)
against weights (with quantisation scales), the KV cache at prompt + gen tokens, and
the activation peak of the prefill chunked as vLLM does by default on this GPU
(`prefill_activation_bytes`, the model of `gptcalc.inference.pool`). Scope: no framework overhead,
CUDA context, paged-cache fragmentation or communication buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ..config import GPTConfig
from ..errors import ConfigError, fraction, positive_int
from ..flops import inference_flops, matmul_flops
from ..gpus import GPU, require_bandwidth, require_peak
from .kv import kv_cache_bytes, kv_dtype_bytes, kv_heads_per_device
from .pool import gpu_memory, profile_activation_bytes
from .sampler import sm_count
from .servers import release
from .vllm import persistent_moe_workspace, sort_free_sampler, vllm_defaults
from .weights import device_weight_bytes, unquantised_bytes, weight_bytes

ACT_BYTES = 2  # 16-bit activations
DEFAULT_FLOPS_EFFICIENCY = 0.5
DEFAULT_BANDWIDTH_EFFICIENCY = 0.685


def compute_precision(weights_dtype: str) -> str:
    """The peak a model's matmuls run at: fp32 weights in fp32 (PyTorch's default, no TF32),
    fp16 in fp16, every other dtype (bf16, and weight-only quantisation) in bf16."""
    return weights_dtype if weights_dtype in ("fp32", "fp16") else "bf16"


def prefill_activation_bytes(cfg: GPTConfig, batch_size: int, prompt_len: int, tp: int = 1,
                             chunk: int = 2048, max_seqs: int = 256, act_bytes: int = 2,
                             gpu_name: str = "") -> int:
    """Activation peak of the prefill of B prompts of p tokens, as a serving engine runs it:
    chunked, at most `chunk` tokens (max_num_batched_tokens) of at most `max_seqs` sequences
    (max_num_seqs) per forward, logits for the last token of each sequence only; the peak of the
    largest chunk by `gptcalc.inference.pool.profile_activation_bytes` (the model a serving
    engine's profile run uses), its sampler the newest vLLM release's on `gpu_name`."""
    tokens = min(batch_size * prompt_len, chunk)
    seqs = min(batch_size, max_seqs, tokens)
    return sum(profile_activation_bytes(cfg, tokens, seqs, tp, act_bytes,
                                        sort_free=sort_free_sampler(release("vllm")),
                                        sms=sm_count(gpu_name),
                                        moe_kept=persistent_moe_workspace(release("vllm"))
                                        ).values())


@dataclass(frozen=True)
class Phase:
    """One phase on one device: its FLOPs and bytes, and the two roofline terms."""

    flops: Fraction
    bytes: Fraction
    peak_flops: float
    bandwidth: float

    @property
    def compute_seconds(self) -> float:
        return float(self.flops / Fraction(self.peak_flops))

    @property
    def memory_seconds(self) -> float:
        return float(self.bytes / Fraction(self.bandwidth))

    @property
    def seconds(self) -> float:
        """Roofline: the larger of the two terms."""
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    def expected_seconds(self, flops_efficiency: float, bandwidth_efficiency: float) -> float:
        return max(self.compute_seconds / flops_efficiency,
                   self.memory_seconds / bandwidth_efficiency)


@dataclass(frozen=True)
class Serving:
    """Memory and roofline of generating gen_len tokens after a prompt, per device."""

    gpu: str
    tp: int
    batch_size: int
    prompt_len: int
    gen_len: int
    weights_dtype: str
    kv_dtype: str
    weights: dict[str, int]  # the whole model's weight bytes by part (weight_bytes)
    weights_bytes: int  # per device
    kv_cache_bytes: int  # per device, at prompt_len + gen_len tokens
    activation_bytes: int  # per device, prefill
    memory_bytes: int  # per device, the GPU's
    prefill: Phase
    decode: Phase  # one step at the mean context
    weights_read: int  # bytes per decode step per device (= weights_bytes)
    kv_per_sequence: Fraction  # KV bytes read per sequence per step at the mean context
    decode_flops_per_sequence: Fraction  # per step at the mean context, per device
    flops_efficiency: float
    bandwidth_efficiency: float

    @property
    def mean_context(self) -> Fraction:
        return self.prompt_len + Fraction(self.gen_len + 1, 2)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.memory_bytes

    @property
    def decode_seconds_per_token(self) -> float:
        """One decode step: every sequence of the batch gets one token."""
        return self.decode.seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """Per sequence; the batch produces batch_size times as many."""
        return 1 / self.decode_seconds_per_token

    @property
    def expected_decode_seconds_per_token(self) -> float:
        return self.decode.expected_seconds(self.flops_efficiency, self.bandwidth_efficiency)

    @property
    def expected_prefill_seconds(self) -> float:
        return self.prefill.expected_seconds(self.flops_efficiency, self.bandwidth_efficiency)

    @property
    def compute_bound_batch(self) -> int | None:
        """Smallest batch whose decode step is compute-bound on the roofline (None: never)."""
        return crossing_batch(self.decode_flops_per_sequence, self.kv_per_sequence,
                              self.weights_read, self.decode.peak_flops, self.decode.bandwidth)

    @property
    def compute_bound_batch_weights_only(self) -> int | None:
        """The same crossing if the KV cache cost nothing to read (the usual rule of thumb,
        batch ~ peak / bandwidth x bytes per weight / 2)."""
        return crossing_batch(self.decode_flops_per_sequence, Fraction(0), self.weights_read,
                              self.decode.peak_flops, self.decode.bandwidth)


def crossing_batch(flops_per_sequence: Fraction, kv_per_sequence: Fraction, weights: int,
                   peak_flops: float, bandwidth: float) -> int | None:
    """Smallest B with B f / P >= (W + B k) / BW, exactly; None when k / BW >= f / P."""
    P, BW = Fraction(peak_flops), Fraction(bandwidth)
    gain = Fraction(flops_per_sequence) / P - Fraction(kv_per_sequence) / BW
    if gain <= 0:
        return None
    return max(1, math.ceil(Fraction(weights) / BW / gain))


def serving(cfg: GPTConfig, gpu: GPU, batch_size: int = 1, prompt_len: int = 128,
            gen_len: int = 128, tp: int = 1, weights_dtype: str = "bf16",
            kv_dtype: str = "bf16", flops_efficiency: float = DEFAULT_FLOPS_EFFICIENCY,
            bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY) -> Serving:
    """Memory and roofline of B sequences: a prefill of prompt_len tokens, then gen_len decode
    steps, on tp GPUs; see the module docstring for the model."""
    for field, value in (("tp", tp), ("batch_size", batch_size), ("gen_len", gen_len)):
        positive_int(field, value)
    if cfg.n_head % tp:
        raise ConfigError("tp", f"tp {tp} must divide the {cfg.n_head} query heads")
    kv_heads_per_device(cfg, tp)  # tp divides the key/value heads, or exceeds them
    kv_b = kv_dtype_bytes(kv_dtype)
    if prompt_len + gen_len > cfg.block_size:  # blame the one that alone leaves no room
        raise ConfigError("prompt_len" if prompt_len >= cfg.block_size else "gen_len",
                          f"prompt {prompt_len} + {gen_len} generated tokens exceed "
                          f"block_size {cfg.block_size}")
    fe = fraction("flops_efficiency", flops_efficiency)
    be = fraction("bandwidth_efficiency", bandwidth_efficiency)
    precision = compute_precision(weights_dtype)
    if gpu.peak_flops(precision) is None and gpu.peak_flops("fp16") is not None:
        raise ConfigError("weights_dtype", f"{gpu.name} has no {precision} peak (its tensor "
                                           "cores run fp16): use fp16 weights")
    peak = require_peak(gpu, precision)
    bw = require_bandwidth(gpu)
    memory = gpu_memory(gpu)  # usable: torch.cuda.mem_get_info's total
    chunk, max_seqs = vllm_defaults(memory, gpu.name)
    inf = inference_flops(cfg, prompt_len, prompt_len + gen_len)  # validates prompt_len
    parts = weight_bytes(cfg, weights_dtype)
    w_dev = device_weight_bytes(cfg, weights_dtype, tp)
    kv_token = Fraction(kv_cache_bytes(cfg, 1, 1, kv_b, tp=tp))  # per sequence per token
    # decode FLOPs at context c are a + b c (matmul_flops is affine in the scored pairs)
    a = sum(matmul_flops(cfg, 1, 0).values())
    b = sum(matmul_flops(cfg, 1, 1).values()) - a
    c_mean = prompt_len + Fraction(gen_len + 1, 2)
    f_seq = (a + b * c_mean) / tp
    kv_seq = kv_token * c_mean
    prefill = Phase(Fraction(batch_size * inf.prefill, tp),
                    w_dev + batch_size * prompt_len * kv_token, peak, bw)
    decode = Phase(batch_size * f_seq, w_dev + batch_size * kv_seq, peak, bw)
    return Serving(
        gpu=gpu.name, tp=tp, batch_size=batch_size, prompt_len=prompt_len, gen_len=gen_len,
        weights_dtype=weights_dtype, kv_dtype=kv_dtype, weights=parts, weights_bytes=w_dev,
        kv_cache_bytes=kv_cache_bytes(cfg, batch_size, prompt_len + gen_len, kv_b, tp=tp),
        activation_bytes=prefill_activation_bytes(cfg, batch_size, prompt_len, tp, chunk,
                                                  max_seqs, unquantised_bytes(weights_dtype),
                                                  gpu.name),
        memory_bytes=memory, prefill=prefill, decode=decode, weights_read=w_dev,
        kv_per_sequence=kv_seq, decode_flops_per_sequence=f_seq,
        flops_efficiency=fe, bandwidth_efficiency=be,
    )
