"""`gptcalc presets`: the named models and where their numbers come from."""

from __future__ import annotations

import dataclasses

import click

from ..params import count_params
from ..presets import PRESETS, from_name
from ..units import si
from .options import json_option
from .render import emit_json, envelope, print_table


@click.command("presets")
@json_option()
def command(as_json: bool) -> None:
    """List the presets with their sizes and exact parameter counts."""
    rows = []
    for name, p in PRESETS.items():
        cfg = from_name(name)
        rows.append(dict(name=name, arch=p.arch, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_kv_head=cfg.kv_heads, n_embd=cfg.n_embd, block_size=cfg.block_size,
                         vocab_size=cfg.vocab_size, d_ff=cfg.ffn_dim,
                         params=count_params(cfg).total, note=p.note,
                         config=dataclasses.asdict(cfg)))
    if as_json:
        emit_json({**envelope(None), "presets": rows})
        return
    print_table("Presets",
                ["name", "arch", "L", "H", "kv", "E", "T", "V", "d_ff", "params", "note"],
                [[r["name"], r["arch"], r["n_layer"], r["n_head"], r["n_kv_head"], r["n_embd"],
                  r["block_size"], r["vocab_size"], r["d_ff"], si(r["params"]), r["note"]]
                 for r in rows])
