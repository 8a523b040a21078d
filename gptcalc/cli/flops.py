"""`gptcalc flops`: FLOPs per token and per step, by component, beside the published rules."""

from __future__ import annotations

from typing import Any

import click

from ..config import GPTConfig
from ..workload import Workload
from ..flops import (NONMATMUL_COST, FlopCount, count_flops, inference_flops,
                     published_estimates)
from ..units import si
from .options import (context_option, describe, json_option, model_options, prompt_len_option,
                      setup_option)
from .render import emit_json, envelope, print_line, print_table


@click.command("flops")
@model_options
@click.option("--causal", is_flag=True,
              help="Count only the pairs the mask keeps: the causal half, a sliding window's "
                   "band (default: the full S x S).")
@setup_option("recompute", "Activation recomputation; adds forward work (hardware FLOPs).")
@prompt_len_option("Prefill prompt length (default seq-len).")
@context_option("Context of the decoded token, cached keys plus itself (default seq-len).")
@json_option()
def command(model: tuple[GPTConfig, Workload], causal: bool, recompute: str,
            prompt_len: int | None, context: int | None, as_json: bool) -> None:
    """Matmul FLOPs (2 per multiply-accumulate) of training and inference, exact."""
    cfg, wl = model
    fc = count_flops(cfg, wl, causal=causal, recompute=recompute)
    # `is None`, not `or`: an explicit --prompt-len 0 is an error, not the default
    inf = inference_flops(cfg, wl.seq_len if prompt_len is None else prompt_len,
                          wl.seq_len if context is None else context)
    conventions = published_estimates(cfg, wl.seq_len)
    if as_json:
        emit_json(_json(cfg, wl, fc, inf, conventions, causal, recompute))
        return
    _render(cfg, wl, fc, inf, conventions, causal)


def _json(cfg, wl, fc: FlopCount, inf, conventions, causal, recompute) -> dict[str, Any]:
    tok = fc.per_token
    return {
        **envelope(cfg, wl, training={"recompute": recompute}),
        "attention": "causal" if causal else "full",
        "recompute": recompute,
        "forward_per_token": tok(fc.forward_total),
        "backward_per_token": tok(fc.backward_total),
        "training_per_token": tok(fc.training_total),
        "hardware_training_per_token": tok(fc.hardware_total),
        "training_per_step": wl.batch_size * fc.hardware_total,
        "components": {k: {"forward_per_token": tok(v), "backward_per_token": tok(fc.backward[k]),
                           "recompute_per_token": tok(fc.recompute[k])}
                       for k, v in fc.forward.items()},
        "nonmatmul_per_sequence": fc.nonmatmul,
        "nonmatmul_cost_per_element": NONMATMUL_COST,
        "conventions": conventions,
        "inference": {"prompt_len": inf.prompt_len, "context": inf.context,
                      "prefill": inf.prefill, "decode_per_token": inf.decode_per_token,
                      "decode_per_token_no_cache": inf.decode_per_token_no_cache},
    }


def _render(cfg, wl, fc: FlopCount, inf, conventions, causal) -> None:
    tok, B = fc.per_token, wl.batch_size
    print_line(describe(cfg, wl) + f"  attention: {'causal half' if causal else 'full S x S'}")
    rows = [[k, si(tok(v)), si(tok(fc.backward[k])), si(tok(fc.recompute[k])),
             si(B * (v + fc.backward[k] + fc.recompute[k]))]
            for k, v in fc.forward.items() if v]
    total = fc.training_total
    print_table("Matmul FLOPs (2 per multiply-accumulate)",
                ["component", "forward/token", "backward/token", "recompute/token", "per step"],
                rows, total_row=["total", si(tok(fc.forward_total)), si(tok(fc.backward_total)),
                                 si(tok(fc.hardware_total - total)), si(B * fc.hardware_total)],
                caption=f"training per token: {tok(total):,} FLOPs (model), "
                        f"{tok(fc.hardware_total):,} (hardware, with recomputation)")
    nm = [[k, si(v), si(B * v)] for k, v in fc.nonmatmul.items() if v]
    costs = ", ".join(f"{k} {v}" for k, v in NONMATMUL_COST.items())
    print_table("Non-matmul forward FLOPs", ["component", "per sequence", "per step"], nm,
                caption=f"FLOPs per element: {costs}")
    exact = tok(total)
    conv = [["exact (this model)", f"{exact:,}", si(exact), "1.0000"]] + [
        [name, f"{v:,}", si(v), f"{v / exact:.4f}"] for name, v in conventions.items()]
    print_table("Training FLOPs per token: published shorthands", ["rule", "FLOPs", "SI", "/exact"],
                conv)
    print_table("Inference (matmul FLOPs per sequence)", ["quantity", "FLOPs", "SI"], [
        [f"prefill of {inf.prompt_len} tokens", f"{inf.prefill:,}", si(inf.prefill)],
        [f"decode 1 token at context {inf.context}, KV cache", f"{inf.decode_per_token:,}",
         si(inf.decode_per_token)],
        [f"decode 1 token at context {inf.context}, no cache",
         f"{inf.decode_per_token_no_cache:,}", si(inf.decode_per_token_no_cache)],
    ])
