"""How the size and the cost of a model grow with its context length T, measured.

Two claims are tested on the reference PyTorch model built at several T: (1) that the model size
is independent of T, and (2) the estimate, sometimes given for a plain implementation, that the
time to predict or train one token is O[T V E + L (T^3 + T^2 H + T E^2)], i.e. cubic in T.
Parameters are counted with `numel()`, FLOPs with `torch.utils.flop_counter.FlopCounterMode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from gptcalc.config import GPTConfig
from gptcalc.flops import forward_flops, matmul_flops
from gptcalc.params import count_params

# FlopCounterMode op names that compute attention (q @ k^T and att @ v); every other counted op
# (mm, addmm) is a weight matmul. Manual attention (q @ k^T, att @ v) runs them as bmm.
ATTENTION_OPS = ("bmm", "baddbmm", "_scaled_dot_product")
ATTENTION_KEYS = ("attention/scores", "attention/values")

# Above this many forward FLOPs for the largest sweep point a real run is too slow for a report
# that should finish in about a minute; such sweeps run on the meta device (shapes only, the
# same ops counted, nothing computed). CPU: ~30 GFLOP is a few seconds on two cores.
REAL_RUN_BUDGET_FLOPS = {"cpu": 40e9, "cuda": 20e12}


@dataclass(frozen=True)
class SizePoint:
    block_size: int
    measured_params: int  # sum of numel() over model.parameters(), tied weight once
    analytic_params: int  # gptcalc.count_params
    position_params: int  # the learned position table, T x E (0 for other encodings)
    mask_buffer_elements: int  # the T x T causal-mask buffers: not parameters


@dataclass(frozen=True)
class CostPoint:
    block_size: int  # the model is built with this T and run on a sequence of T tokens
    forward_flops: int  # measured, whole sequence (= one generated token without a KV cache)
    attention_flops: int  # measured, the attention ops alone (q @ k^T, att @ v)
    decode_flops: int  # measured: one new token at context T with a KV cache
    analytic_forward_flops: int
    analytic_decode_flops: int

    @property
    def per_token(self) -> float:
        return self.forward_flops / self.block_size

    @property
    def attention_per_token(self) -> float:
        return self.attention_flops / self.block_size


@dataclass(frozen=True)
class Fit:
    """y = c * T^exponent by least squares on log y vs log T."""

    exponent: float
    coefficient: float


def fit_power(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    import numpy as np

    slope, intercept = np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)
    return Fit(float(slope), float(math.exp(intercept)))


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """y = a + b T by least squares; returns (a, b, largest relative residual)."""
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    resid = float(np.max(np.abs(a + b * x - y) / y))
    return float(a), float(b), resid


def sweep_block_sizes(cfg: GPTConfig, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to 4 T (at least 8 points' worth of range)."""
    top = max(4 * cfg.block_size, 8 * smallest)
    out, t = [], smallest
    while t <= top:
        out.append(t)
        t *= 2
    return out


def choose_device(cfg: GPTConfig, block_sizes: Sequence[int], device: str) -> str:
    """`device`, or "meta" when a real forward of the largest point would blow the time budget."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    T = max(block_sizes)
    biggest = sum(forward_flops(cfg.replace(block_size=T), T).values())
    too_big_memory = count_params(cfg.replace(block_size=T)).total * 4 > 8 * 2**30
    return "meta" if biggest > REAL_RUN_BUDGET_FLOPS[kind] or too_big_memory else device


def _model(cfg: GPTConfig, device: str):
    from reference_model.measure import meta_model
    from reference_model.model import build_model

    if device == "meta":
        return meta_model(cfg).eval()
    return build_model(cfg, device=device).eval()


def measure_sizes(cfg: GPTConfig, block_sizes: Sequence[int], device: str = "cpu"
                  ) -> list[SizePoint]:
    """Parameters and mask-buffer elements of the reference model at each block size."""
    points = []
    for T in block_sizes:
        c = cfg.replace(block_size=T)
        model = _model(c, "meta")  # counting numel() needs shapes only
        masks = sum(b.numel() for name, b in model.named_buffers() if name.endswith("tril"))
        points.append(SizePoint(
            block_size=T,
            measured_params=sum(p.numel() for p in model.parameters()),
            analytic_params=count_params(c).total,
            position_params=count_params(c).components["embedding/position"],
            mask_buffer_elements=masks,
        ))
    return points


def position_share(points: Sequence[SizePoint]) -> float:
    """The learned position table's share of the measured model at the largest T swept, in
    percent (0 without a learned table): the one figure the report's text and its plot quote."""
    last = max(points, key=lambda p: p.block_size)
    return 100 * last.position_params / last.measured_params


def _split(measurement) -> tuple[int, int]:
    """(all FLOPs, attention FLOPs) of a `reference_model.measure.FlopMeasurement`."""
    attention = sum(v for op, v in measurement.by_operator.items()
                    if any(op.split(".")[-1].startswith(a) for a in ATTENTION_OPS))
    return measurement.total, attention


def measure_costs(cfg: GPTConfig, block_sizes: Sequence[int], device: str = "cpu",
                  on_point: Callable[[int], None] | None = None) -> list[CostPoint]:
    """Forward FLOPs of one sequence of T tokens, and of one decoded token at context T with a
    KV cache, measured with FlopCounterMode on the reference model built at each T."""
    import torch

    from reference_model.measure import flopcounter_forward

    points = []
    for T in block_sizes:
        c = cfg.replace(block_size=T)
        model = _model(c, device)
        idx = torch.zeros((1, T), dtype=torch.long, device=device)
        total, attention = _split(flopcounter_forward(model, idx))
        with torch.no_grad():
            # a cache already holding T-1 positions, filled by the model's own prefill (its
            # shapes are the model's: MLA's keys and values differ in width, a window keeps
            # fewer), so the counted step is one new token against T keys, as in generation
            cache = model.new_kv_cache()
            if T > 1:
                model(idx[:, :T - 1], kv_cache=cache)
            decode, _ = _split(flopcounter_forward_cached(model, idx[:, T - 1:], cache))
        points.append(CostPoint(
            block_size=T, forward_flops=total, attention_flops=attention, decode_flops=decode,
            analytic_forward_flops=sum(forward_flops(c, T).values()),
            analytic_decode_flops=sum(matmul_flops(c, queries=1, pairs=T).values()),
        ))
        if on_point is not None:
            on_point(T)
    return points


def flopcounter_forward_cached(model, idx, cache):
    """FlopCounterMode FLOPs of one eval forward of idx against a filled KV cache."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from reference_model.measure import CPU_SDPA_FLOPS, FlopMeasurement

    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as fc:
        model(idx, kv_cache=cache)
    ops = {str(op): int(n) for op, n in fc.get_flop_counts()["Global"].items()}
    return FlopMeasurement(total=int(fc.get_total_flops()), by_operator=ops)


@dataclass(frozen=True)
class CostFindings:
    per_token: Fit  # forward FLOPs per token of a T-token sequence (training / prefill)
    attention_per_token: Fit
    per_sequence: Fit  # one generated token without a KV cache (a whole forward)
    decode_with_cache: Fit
    linear: tuple[float, float, float]  # per-token = a + b T, and the largest relative residual
    local_exponent: float  # slope between the last two points


def cost_findings(points: Sequence[CostPoint]) -> CostFindings:
    Ts = [p.block_size for p in points]
    tok = [p.per_token for p in points]
    a, b = points[-2], points[-1]
    local = math.log(b.per_token / a.per_token) / math.log(b.block_size / a.block_size)
    return CostFindings(
        per_token=fit_power(Ts, tok),
        attention_per_token=fit_power(Ts, [p.attention_per_token for p in points]),
        per_sequence=fit_power(Ts, [p.forward_flops for p in points]),
        decode_with_cache=fit_power(Ts, [p.decode_flops for p in points]),
        linear=fit_linear(Ts, tok),
        local_exponent=local,
    )
