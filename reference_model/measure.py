"""Measurements of the reference model, by the tools that do them: parameters from
`named_parameters()`, forward FLOPs from fvcore's `FlopCountAnalysis`, forward / backward /
generation FLOPs from `torch.utils.flop_counter.FlopCounterMode`.

Both FLOP tools count from tensor shapes alone, so they give the same counts on real tensors, on
the meta device (fvcore: torch.jit traces it) and under `FakeTensorMode` (FlopCounterMode: the
dispatcher picks the same SDPA kernel for a fake CPU tensor as for a real one). `shape_only_models`
builds those stand-ins for models too large or too slow to run for real.

Which SDPA kernel runs matters for the backward count (measured, torch 2.13 CPU):
- eval, or training with dropout 0: `aten._scaled_dot_product_flash_attention_for_cpu` and its
  backward. FlopCounterMode does not register them (they count 0); `CPU_SDPA_FLOPS` registers
  them with torch's own sdpa formulas, whose backward is 2.5x the forward (it recomputes q @ k^T);
- training with dropout > 0: the math path, decomposed into bmm (and softmax, dropout), so the
  backward is the plain 2x. On CUDA the flash / efficient / cuDNN kernels are registered by torch.
`FlopMeasurement.fused_sdpa` says which case happened, so the analytic side can pick
`count_flops(..., flash_backward=...)` by the kernel that actually ran.
"""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from gptcalc import GPTConfig

from .model import GPT, param_key

aten = torch.ops.aten

# fvcore's operator names (by_operator keys) that are matmuls; fvcore counts multiply-accumulates
FVCORE_MATMUL_OPS = ("addmm", "linear", "matmul", "mm", "bmm", "einsum",
                     "scaled_dot_product_attention")


def params_by_key(model: torch.nn.Module) -> dict[str, int]:
    """Parameters by analytic component key; `named_parameters()` lists a tied weight once,
    under the name it was first registered with (the token embedding)."""
    out: Counter[str] = Counter()
    for name, p in model.named_parameters():
        out[param_key(name)] += p.numel()
    return dict(out)


# ---------------------------------------------------------------- fvcore
@contextmanager
def _quiet_torch_jit():
    """fvcore is built on torch.jit (script at import, trace to count), which torch now
    deprecates (a DeprecationWarning in torch 2.13, a FutureWarning, shown to every user, in
    later releases); the warning is about fvcore's internals, not the user's code."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated",
                                    category=category)
            warnings.filterwarnings("ignore", category=category, module=r"(fvcore|iopath)\b")
        yield


def fvcore_sdpa_handle(inputs: list[Any], outputs: list[Any]) -> int:
    """Multiply-accumulates of aten::scaled_dot_product_attention, which fvcore lacks:
    q @ k^T over every (query, key) pair plus att @ v, i.e. B*H*L*S*(d_qk + d_v), the full
    L x S even when causal (as the kernels compute and FlopCounterMode counts)."""
    with _quiet_torch_jit():
        from fvcore.nn.jit_handles import get_shape

    q, k, v = (get_shape(x) for x in inputs[:3])
    return prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


def fvcore_forward_by_operator(model: torch.nn.Module, idx: torch.Tensor) -> dict[str, int]:
    """fvcore's forward count (multiply-accumulates) by operator, model in eval mode."""
    with _quiet_torch_jit():
        from fvcore.nn import FlopCountAnalysis

    was_training = model.training
    model.eval()
    try:
        with _quiet_torch_jit():
            analysis = (FlopCountAnalysis(model, (idx,))
                        .set_op_handle("aten::scaled_dot_product_attention", fvcore_sdpa_handle)
                        .unsupported_ops_warnings(False)
                        .uncalled_modules_warnings(False))
            return {op: int(n) for op, n in analysis.by_operator().items()}
    finally:
        model.train(was_training)


def fvcore_matmul_macs(by_operator: dict[str, int]) -> int:
    return sum(n for op, n in by_operator.items() if op in FVCORE_MATMUL_OPS)


# ---------------------------------------------------------------- FlopCounterMode
def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                            out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch registers the CUDA SDPA kernels but not the CPU one; reuse torch's formulas for it
CPU_SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


@dataclass(frozen=True)
class FlopMeasurement:
    """FlopCounterMode's global total and its per-operator split."""

    total: int
    by_operator: dict[str, int]

    @property
    def fused_sdpa(self) -> bool:
        """A fused SDPA kernel (flash / efficient / cuDNN / CPU flash) ran and was counted."""
        return any("scaled_dot_product" in op for op in self.by_operator)


def _counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)


def _result(fc: FlopCounterMode) -> FlopMeasurement:
    # the global bucket: the root module's misses backward when the loss is taken in forward
    ops = {str(op): int(n) for op, n in fc.get_flop_counts()["Global"].items()}
    return FlopMeasurement(total=int(fc.get_total_flops()), by_operator=ops)


def flopcounter_forward(model: GPT, idx: torch.Tensor) -> FlopMeasurement:
    """Forward FLOPs of one eval-mode forward over idx (B, S)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _counter() as fc:
            model(idx)
    finally:
        model.train(was_training)
    return _result(fc)


def flopcounter_training(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> FlopMeasurement:
    """FLOPs of one training forward (with the loss) and its backward, dropout active."""
    was_training = model.training
    model.train()
    try:
        with _counter() as fc:
            _, loss = model(idx, targets)
            loss.backward()
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return _result(fc)


def flopcounter_generate(model: GPT, prompt: torch.Tensor, max_new_tokens: int,
                         use_kv_cache: bool) -> FlopMeasurement:
    """FLOPs of `model.generate` (eval mode, greedy) from `prompt` (B, P)."""
    was_training = model.training
    model.eval()
    try:
        with _counter() as fc:
            model.generate(prompt, max_new_tokens, use_kv_cache=use_kv_cache, greedy=True)
    finally:
        model.train(was_training)
    return _result(fc)


# ---------------------------------------------------------------- shape-only stand-ins
def meta_model(cfg: GPTConfig, attn_impl: str = "manual") -> GPT:
    """The model built directly on the meta device: parameters have shapes, no storage.
    Enough for parameter counts and for fvcore (torch.jit traces meta tensors)."""
    with torch.device("meta"):
        return GPT(cfg, attn_impl)


def fake_mode():
    """A FakeTensorMode: tensors made inside it carry shape, dtype and device only; ops run
    through the real dispatcher (so SDPA picks the same kernel) without computing anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()
