"""`gptcalc serve`: the KV pool a serving engine allocates, and how many requests it holds."""

from __future__ import annotations

from typing import Any

import click

from ..config import GPTConfig
from ..errors import ConfigError, positive_int
from ..workload import Workload
from ..gpus import DEFAULT_GPU, gpu as find_gpu
from ..inference.kv import KV_DTYPES
from ..inference.pool import DEFAULT_NON_TORCH, SERVERS, KVPool, gpu_memory, kv_pool
from ..inference.roofline import (DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_FLOPS_EFFICIENCY,
                                  serving)
from ..inference.weights import WEIGHT_DTYPES
from ..units import binary_bytes
from .infer import _json as infer_json, _ms
from .options import float_range, ByteSize, describe, model_options
from .render import emit_json, envelope, print_line, print_table


@click.command("serve")
@model_options
@click.option("--engine", type=click.Choice(SERVERS), default="vllm", show_default=True,
              help="Serving engine whose KV pool is sized.")
@click.option("--gpu", "gpu_name", default=DEFAULT_GPU, show_default=True, metavar="NAME",
              help="Accelerator (see `gptcalc gpus`): its memory, and its peaks for throughput.")
@click.option("--gpu-memory", type=ByteSize(exact=False), default=None, metavar="SIZE",
              help="Total memory of one GPU as the engine reads it (e.g. 79.22GiB); default "
                   "the --gpu's datasheet figure.")
@click.option("--tp", type=int, default=1, show_default=True,
              help="GPUs in tensor parallel: weights and KV heads split (fewer KV heads than "
                   "GPUs: one replicated per GPU).")
@click.option("--weights-dtype", type=click.Choice(list(WEIGHT_DTYPES)), default="bf16",
              show_default=True, help="Weights.")
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default="bf16",
              show_default=True, help="KV cache elements.")
@click.option("--gpu-memory-utilization", "--mem-fraction-static", "utilization", type=float,
              default=None, help="Share of the GPU's memory the engine may use (vLLM default "
                                 "0.9; SGLang: its memory less a reserve by GPU size).")
@click.option("--max-model-len", type=int, default=None,
              help="Longest request in tokens (default: the model's context T).")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Tokens per forward, the profile run's size (vLLM's default: 8192 on GPUs "
                   "of 70 GiB or more other than A100, else 2048).")
@click.option("--max-num-seqs", type=int, default=None,
              help="Sequences per forward (vLLM's default: 1024 with 8192 tokens, else 256).")
@click.option("--kv-block-size", type=int, default=None,
              help="Tokens per KV block (vLLM's --block-size, default 16; SGLang pages of 1).")
@click.option("--context", type=int, default=None,
              help="Tokens of one request for the concurrency question (default "
                   "--max-model-len).")
@click.option("--gen-len", type=int, default=128, show_default=True,
              help="Of the --context tokens, how many are generated (throughput).")
@click.option("--non-torch", type=ByteSize(exact=False, zero_ok=True), default=None,
              metavar="SIZE",
              help=f"Memory outside PyTorch beyond the CUDA context (NCCL, cuBLAS) "
                   f"(default {binary_bytes(DEFAULT_NON_TORCH)}, as vLLM logs it).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@float_range
def command(model: tuple[GPTConfig, Workload], engine: str, gpu_name: str,
            gpu_memory: int | None, tp: int, weights_dtype: str, kv_dtype: str,
            utilization: float | None, max_model_len: int | None,
            max_num_batched_tokens: int | None, max_num_seqs: int | None,
            kv_block_size: int | None, context: int | None, gen_len: int, non_torch: int | None,
            as_json: bool) -> None:
    """The engine's memory per GPU (weights, profile-run activation peak, non-torch, KV pool),
    its blocks and tokens, the requests of --max-model-len and --context tokens it holds at
    once, and prefill/decode throughput at that concurrency (infer's roofline)."""
    cfg, wl = model
    g = find_gpu(gpu_name)
    total = gpu_memory or gpu_memory_for(g)
    # the scheduler's options are checked as given, also under an engine that does not read them
    for field, value in (("max_model_len", max_model_len), ("context", context),
                         ("gen_len", gen_len), ("max_num_batched_tokens", max_num_batched_tokens),
                         ("max_num_seqs", max_num_seqs)):
        if value is not None:
            positive_int(field, value)
    mml = cfg.block_size if max_model_len is None else max_model_len
    if mml > cfg.block_size:  # as vLLM allows with VLLM_ALLOW_LONG_MAX_MODEL_LEN
        cfg = cfg.replace(block_size=mml)
    ctx = mml if context is None else context
    if ctx > mml:
        raise ConfigError("context", f"{ctx:,} exceeds --max-model-len {mml:,}")
    if gen_len >= ctx:
        raise ConfigError("gen_len", f"{gen_len:,} leaves no prompt in --context {ctx:,}")
    nt = non_torch
    pool = kv_pool(cfg, total, engine, tp, weights_dtype, kv_dtype, utilization,
                   max_num_batched_tokens, max_num_seqs, kv_block_size,
                   DEFAULT_NON_TORCH if nt is None else nt, g.name)
    conc = {str(mml): pool.max_concurrency(cfg, mml), str(ctx): pool.max_concurrency(cfg, ctx)}
    batch = min(int(conc[str(ctx)]), pool.max_num_seqs)  # the scheduler's cap
    s = None
    precision = "fp16" if weights_dtype == "fp16" else "bf16"
    if batch >= 1 and g.peak_flops(precision) is not None and g.hbm_bytes_per_second:
        s = serving(cfg, g, batch, ctx - gen_len, gen_len, tp, weights_dtype, kv_dtype,
                    DEFAULT_FLOPS_EFFICIENCY, DEFAULT_BANDWIDTH_EFFICIENCY)
    given = {"utilization": utilization, "max_model_len": max_model_len,
             "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
             "block_size": kv_block_size, "context": context, "non_torch": nt}
    line = _assumptions(pool, g.name, total, tp, weights_dtype, kv_dtype, mml, ctx, gen_len,
                        gpu_memory is None, {k for k, v in given.items() if v is None})
    if cfg.moe and pool.activation:
        line += "; MoE layers' activations as one dense MLP of width d_ff"
    if as_json:
        emit_json(_json(cfg, wl, pool, conc, mml, ctx, s, line))
        return
    _render(cfg, pool, conc, mml, ctx, s, line)


def gpu_memory_for(g) -> int:
    return gpu_memory(g)


def _assumptions(p: KVPool, gpu: str, total: int, tp: int, wd: str, kd: str, mml: int,
                 ctx: int, gen: int, datasheet: bool, defaults: set[str]) -> str:
    def d(name: str) -> str:
        return " (default)" if name in defaults else ""

    knob = "mem_fraction_static" if p.engine == "sglang" else "gpu_memory_utilization"
    seqs = min(p.max_num_seqs, p.max_num_batched_tokens)
    profile = ("no profile run (activations live outside the fraction)" if p.engine == "sglang"
               else f"profile run of {p.max_num_batched_tokens:,} tokens"
                    f"{d('max_num_batched_tokens')} in {seqs:,} sequences (max_num_seqs "
                    f"{p.max_num_seqs:,}{d('max_num_seqs')})")
    return (f"Assuming {p.engine} on {tp} x {binary_bytes(total)} "
            f"({gpu + ' datasheet' if datasheet else 'given'}; throughput at {gpu}'s peaks), "
            f"weights {wd}, KV cache {kd}, {knob} {p.utilization:g}{d('utilization')}, "
            f"max_model_len {mml:,}{d('max_model_len')}, {profile}, blocks of {p.block_size} "
            f"tokens{d('block_size')}, non-torch {binary_bytes(p.non_torch)}{d('non_torch')}, "
            f"requests of {ctx:,} tokens{d('context')} ({gen:,} generated), 16-bit "
            "activations")


def _json(cfg, wl, p: KVPool, conc, mml, ctx, s, line) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s is not None:
        out.update(infer_json(cfg, wl, s))
    out.update({
        **envelope(cfg, wl), "assumptions": line, "engine": p.engine,
        "gpu_memory_bytes": p.gpu_memory_bytes, "utilization": p.utilization,
        "max_model_len": mml, "context": ctx, "max_num_batched_tokens": p.max_num_batched_tokens,
        "max_num_seqs": p.max_num_seqs, "block_size": p.block_size,
        "weights": p.weights, "activation_peak": p.activation_peak,
        "activation": p.activation, "non_torch": p.non_torch, "kv_cache": p.kv_cache,
        "kv_blocks": p.kv_blocks, "kv_tokens": p.kv_tokens, "max_concurrency": conc,
        "fits": p.kv_cache > 0 and conc[str(mml)] >= 1,
    })
    return out


def _render(cfg, p: KVPool, conc, mml, ctx, s, line) -> None:
    print_line(line)
    print_line(describe(cfg))
    rows = [[f"budget: {binary_bytes(p.gpu_memory_bytes)} x {p.utilization:g}",
             binary_bytes(p.budget)],
            ["weights", binary_bytes(p.weights)]]
    rows += [[f"activation peak: {k}", binary_bytes(v)] for k, v in p.activation.items()]
    rows += [["non-torch (NCCL, cuBLAS; beyond the CUDA context)", binary_bytes(p.non_torch)]]
    print_table("Memory per GPU", ["part", "bytes"], rows,
                total_row=["KV cache pool", binary_bytes(p.kv_cache)],
                caption=f"{p.kv_blocks:,} blocks of {p.block_size} tokens = {p.kv_tokens:,} "
                        f"tokens ({binary_bytes(p.bytes_per_block)} per block)")
    c_rows = [[f"{int(k):,}", f"{v:,.2f}x"] for k, v in conc.items()]
    print_table("Maximum concurrency", ["tokens per request", "requests at once"], c_rows)
    if p.kv_cache <= 0 or conc[str(mml)] < 1:
        print_line(f"the pool does not hold one request of max_model_len {mml:,} tokens: the "
                   "engine refuses to start; lower --max-model-len or raise the utilization")
    if s is None:
        if conc[str(ctx)] >= 1:
            print_line("no throughput: the GPU has no peak figure for these weights (a T4 "
                       "runs fp16)")
        return
    rate = [["prefill of the batch", _ms(s.prefill.seconds), _ms(s.expected_prefill_seconds)],
            ["decode step", _ms(s.decode_seconds_per_token),
             _ms(s.expected_decode_seconds_per_token)],
            [f"decode tokens/s for {s.batch_size:,} requests",
             f"{s.batch_size / s.decode_seconds_per_token:,.1f}",
             f"{s.batch_size / s.expected_decode_seconds_per_token:,.1f}"]]
    print_table(f"Throughput at {s.batch_size:,} requests of {ctx:,} tokens",
                ["quantity", "roofline", "expected"], rate,
                caption=f"infer's roofline at {s.flops_efficiency:g} of peak FLOP/s and "
                        f"{s.bandwidth_efficiency:g} of bandwidth")
