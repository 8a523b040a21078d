"""`gptcalc params`: the exact parameter count, by component, and LoRA adapters."""

from __future__ import annotations

import click

from ..config import GPTConfig
from ..errors import ConfigError
from ..workload import Workload
from ..lora import lora_params, parse_targets
from ..params import count_params
from ..units import si
from ..schema import OPTIONS
from .options import click_option, describe, json_option, model_options
from .render import emit_json, envelope, print_line, print_table


@click.command("params")
@model_options
@click_option(OPTIONS["lora_rank"], metavar="R",
              help="LoRA rank: adapters of r x (in + out) parameters on the targets.")
@click_option(OPTIONS["lora_targets"])
@json_option()
def command(model: tuple[GPTConfig, Workload], lora_rank: int | None, lora_targets: str | None,
            as_json: bool) -> None:
    """Exact parameter count (a tied weight once) and its breakdown by component."""
    cfg, wl = model
    p = count_params(cfg)
    if lora_targets is not None and lora_rank is None:
        raise ConfigError("lora_targets", "needs --lora-rank")
    targets = parse_targets(lora_targets, cfg)
    lora = None if lora_rank is None else lora_params(cfg, lora_rank, targets)
    trainable = p.total if lora is None else sum(lora.values())
    if as_json:
        emit_json({**envelope(cfg, wl), "total": p.total, "non_embedding": p.non_embedding,
                   "active": p.active, "components": p.components,
                   "trainable": trainable,
                   "lora": None if lora is None else {"rank": lora_rank, "targets": list(targets),
                                                      "components": lora}})
        return
    print_line(describe(cfg))
    rows = [[k, f"{v:,}", si(v), f"{100 * v / p.total:.2f}%"]
            for k, v in p.components.items() if v]
    print_table("Parameters", ["component", "exact", "SI", "share"], rows,
                total_row=["total", f"{p.total:,}", si(p.total), "100.00%"],
                caption=f"non-embedding (Kaplan): {p.non_embedding:,} ({si(p.non_embedding)})"
                + (f"; active per token (top-{cfg.n_expert_active} of {cfg.n_expert} experts, "
                   f"embeddings included): {p.active:,} ({si(p.active)})" if cfg.moe else ""))
    if lora is not None:
        print_table(f"LoRA adapters, rank {lora_rank} (r x (in + out) per adapted Linear)",
                    ["target", "trainable", "SI"], [[k, f"{v:,}", si(v)] for k, v in lora.items()],
                    total_row=["trainable", f"{trainable:,}", si(trainable)],
                    caption=f"{100 * trainable / p.total:.4f}% of the {p.total:,} frozen "
                            "parameters")
