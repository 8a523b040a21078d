"""`gptcalc params`: the exact parameter count, by component."""

from __future__ import annotations

import click

from ..config import GPTConfig, Workload
from ..params import count_params
from ..units import si
from .options import describe, model_options
from .render import emit_json, model_json, print_line, print_table


@click.command("params")
@model_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(model: tuple[GPTConfig, Workload], as_json: bool) -> None:
    """Exact parameter count (a tied weight once) and its breakdown by component."""
    cfg, _ = model
    p = count_params(cfg)
    if as_json:
        emit_json({**model_json(cfg), "total": p.total, "non_embedding": p.non_embedding,
                   "active": p.active, "components": p.components})
        return
    print_line(describe(cfg))
    rows = [[k, f"{v:,}", si(v), f"{100 * v / p.total:.2f}%"]
            for k, v in p.components.items() if v]
    print_table("Parameters", ["component", "exact", "SI", "share"], rows,
                total_row=["total", f"{p.total:,}", si(p.total), "100.00%"],
                caption=f"non-embedding (Kaplan): {p.non_embedding:,} ({si(p.non_embedding)})"
                + (f"; active per token (top-{cfg.n_expert_active} of {cfg.n_expert} experts, "
                   f"embeddings included): {p.active:,} ({si(p.active)})" if cfg.moe else ""))
