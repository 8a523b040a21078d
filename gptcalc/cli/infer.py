"""`gptcalc infer`: will a model serve on these GPUs, and how fast (roofline and expected)."""

from __future__ import annotations

from typing import Any

import click

from ..api import Setup
from ..config import GPTConfig
from ..workload import Workload
from ..gpus import gpu as find_gpu
from ..inference.roofline import (DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_FLOPS_EFFICIENCY, Serving,
                                  serving)
from ..inference.quant import quantization_from_hf
from ..inference.weights import GROUP_SIZE, WeightsDtype, weights_label
from ..units import binary_bytes, si
from .options import (current_setup, describe, float_range, gen_len_option, gpu_option,
                      json_option, kv_dtype_option, model_options, prompt_len_option,
                      serving_tp_option, serving_weights_option)
from .render import emit_json, envelope, print_line, print_table


@click.command("infer")
@model_options
@gpu_option()
@serving_tp_option("--gpus")
@prompt_len_option("Prompt tokens per sequence (default: 128, or T/2 if smaller).")
@gen_len_option("Generated tokens per sequence (default: 128, or what T leaves if smaller).")
@serving_weights_option(f"Weights; int8/int4 add one fp16 scale per {GROUP_SIZE} weights "
                        "(default: as the --hf-config's quantization_config stores them, else "
                        "bf16).")
@kv_dtype_option()
@click.option("--flops-efficiency", type=float, default=DEFAULT_FLOPS_EFFICIENCY,
              show_default=True, help="Share of the dense peak that matmuls reach (expected).")
@click.option("--bandwidth-efficiency", type=float, default=DEFAULT_BANDWIDTH_EFFICIENCY,
              show_default=True, help="Share of peak bandwidth reached (default: gpt-fast's "
                                      "Llama-2-7B on an A100-80GB).")
@json_option()
@float_range
@click.pass_context
def command(ctx: click.Context, model: tuple[GPTConfig, Workload], gpu_name: str, tp: int, prompt_len: int | None,
            gen_len: int | None, weights_dtype: str | None, kv_dtype: str, flops_efficiency: float,
            bandwidth_efficiency: float, as_json: bool) -> None:
    """Memory (weights, KV cache, prefill activations) and whether it fits; prefill and decode
    times on the roofline and expected at the given efficiencies; the batch where decode turns
    compute-bound."""
    cfg, wl = model
    weights, source = weights_used(weights_dtype, current_setup(ctx))
    T = cfg.block_size
    prompt = min(128, max(1, T // 2)) if prompt_len is None else prompt_len
    gen = min(128, max(1, T - prompt)) if gen_len is None else gen_len
    s = serving(cfg, find_gpu(gpu_name), wl.batch_size, prompt, gen, tp, weights, kv_dtype,
                flops_efficiency, bandwidth_efficiency)
    if as_json:
        emit_json(_json(cfg, wl, s))
        return
    _render(cfg, s, source)


def weights_used(given: str | None, setup: Setup | None) -> tuple[WeightsDtype, str]:
    """The weights a serving command sizes and where they come from: --weights-dtype as given
    (over the file's quantisation, named), else the --hf-config's quantization_config, else
    bf16. A quantization_config gptcalc cannot read is refused even when overridden. `setup`:
    the command's resolved model (`current_setup`)."""
    q = quantization_from_hf(setup.quantization if setup is not None else None)
    if given is not None:
        return given, "--weights-dtype" + (f", over --hf-config's {q.label}" if q else "")
    if q is not None:
        return q, "--hf-config's quantization_config"
    return "bf16", "default"


def _json(cfg, wl, s: Serving) -> dict[str, Any]:
    return {**envelope(cfg, wl), **serving_json(s)}


# serving_json's keys, in its order: `serve --json` writes them null when it has no throughput
SERVING_KEYS = (
    "gpu", "tp", "batch_size", "prompt_len", "gen_len", "weights_dtype", "kv_dtype", "weights",
    "weights_bytes", "kv_cache_bytes", "activation_bytes", "total_bytes", "memory_bytes",
    "fits", "mean_context", "prefill_flops", "prefill_bytes", "prefill_seconds",
    "prefill_bound", "expected_prefill_seconds", "decode_flops_per_step",
    "decode_bytes_per_step", "decode_seconds_per_token", "decode_tokens_per_second",
    "decode_batch_tokens_per_second", "decode_bound", "expected_decode_seconds_per_token",
    "expected_decode_tokens_per_second", "compute_bound_batch",
    "compute_bound_batch_weights_only", "flops_efficiency", "bandwidth_efficiency")


def serving_json(s: Serving | None) -> dict[str, Any]:
    """infer's figures by SERVING_KEYS; each None when there is no Serving."""
    if s is None:
        return dict.fromkeys(SERVING_KEYS)
    return {
        "gpu": s.gpu, "tp": s.tp, "batch_size": s.batch_size,
        "prompt_len": s.prompt_len, "gen_len": s.gen_len, "weights_dtype": weights_label(s.weights_dtype),
        "kv_dtype": s.kv_dtype, "weights": s.weights, "weights_bytes": s.weights_bytes,
        "kv_cache_bytes": s.kv_cache_bytes, "activation_bytes": s.activation_bytes,
        "total_bytes": s.total_bytes, "memory_bytes": s.memory_bytes, "fits": s.fits,
        "mean_context": float(s.mean_context),
        "prefill_flops": float(s.prefill.flops), "prefill_bytes": float(s.prefill.bytes),
        "prefill_seconds": s.prefill.seconds, "prefill_bound": s.prefill.bound,
        "expected_prefill_seconds": s.expected_prefill_seconds,
        "decode_flops_per_step": float(s.decode.flops), "decode_bytes_per_step": float(s.decode.bytes),
        "decode_seconds_per_token": s.decode_seconds_per_token,
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "decode_batch_tokens_per_second": s.batch_size * s.decode_tokens_per_second,
        "decode_bound": s.decode.bound,
        "expected_decode_seconds_per_token": s.expected_decode_seconds_per_token,
        "expected_decode_tokens_per_second": 1 / s.expected_decode_seconds_per_token,
        "compute_bound_batch": s.compute_bound_batch,
        "compute_bound_batch_weights_only": s.compute_bound_batch_weights_only,
        "flops_efficiency": s.flops_efficiency, "bandwidth_efficiency": s.bandwidth_efficiency,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def _render(cfg, s: Serving, source: str) -> None:
    print_line(f"Assuming {s.tp} x {s.gpu} (tensor parallel) of {binary_bytes(s.memory_bytes)} "
               f"usable (torch.cuda.mem_get_info's total; datasheet "
               f"{binary_bytes(find_gpu(s.gpu).memory_bytes)}), batch {s.batch_size}, prompt "
               f"{s.prompt_len:,} + {s.gen_len:,} generated tokens, weights {weights_label(s.weights_dtype)} "
               f"({source}), "
               f"KV cache {s.kv_dtype}, efficiency {s.flops_efficiency:g} of the dense FLOP/s "
               f"peak and {s.bandwidth_efficiency:g} of the memory bandwidth")
    print_line(describe(cfg))
    mem = [["weights (incl. quantisation scales)", binary_bytes(s.weights_bytes)],
           [f"KV cache at {s.prompt_len + s.gen_len:,} tokens", binary_bytes(s.kv_cache_bytes)],
           ["prefill activation peak (chunked as vLLM runs it)", binary_bytes(s.activation_bytes)]]
    print_table("Memory per GPU", ["part", "bytes"], mem,
                total_row=["total", binary_bytes(s.total_bytes)],
                caption=f"GPU memory {binary_bytes(s.memory_bytes)}: "
                        f"{'fits' if s.fits else 'does NOT fit'}")
    phases = [[name, si(float(p.flops), "FLOP"), binary_bytes(float(p.bytes)),
               _ms(p.compute_seconds), _ms(p.memory_seconds), p.bound, _ms(p.seconds),
               _ms(p.expected_seconds(s.flops_efficiency, s.bandwidth_efficiency))]
              for name, p in (("prefill", s.prefill),
                              (f"decode step (context {float(s.mean_context):g})", s.decode))]
    print_table("Roofline per GPU", ["phase", "FLOPs", "bytes", "compute", "memory", "bound",
                                     "roofline", "expected"], phases,
                caption=f"expected: FLOPs at {s.flops_efficiency:g} of peak, bytes at "
                        f"{s.bandwidth_efficiency:g} of bandwidth; decode at the mean context "
                        "of the generated tokens")
    roof, exp = s.decode_seconds_per_token, s.expected_decode_seconds_per_token
    rate = [["prefill (time to first token)", _ms(s.prefill.seconds),
             _ms(s.expected_prefill_seconds)],
            ["decode time per token", _ms(roof), _ms(exp)],
            ["tokens/s per sequence", f"{1 / roof:,.1f}", f"{1 / exp:,.1f}"],
            [f"tokens/s for the batch of {s.batch_size}", f"{s.batch_size / roof:,.1f}",
             f"{s.batch_size / exp:,.1f}"]]
    print_table("Throughput", ["quantity", "roofline", "expected"], rate)
    b, w = s.compute_bound_batch, s.compute_bound_batch_weights_only
    ctx = f"context {float(s.mean_context):g}"
    print_line((f"decode never turns compute-bound at {ctx}: each sequence's KV cache takes longer "
                "to read than its FLOPs take to compute" if b is None else
                f"decode turns compute-bound at batch {b:,} ({ctx}, roofline)")
               + ("" if w is None else f"; with the weights alone (no KV cache) at batch {w:,}"))
