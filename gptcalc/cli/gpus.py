"""`gptcalc gpus`: the accelerator catalogue, dense peaks only."""

from __future__ import annotations

import dataclasses

import click

from ..gpus import GPUS, PRECISIONS
from ..units import binary_bytes
from .options import json_option
from .render import emit_json, envelope, print_table


@click.command("gpus")
@json_option()
def command(as_json: bool) -> None:
    """Accelerators: memory (datasheet and usable), dense peak FLOP/s per precision (never
    sparsity figures), memory bandwidth, SMs, node size, intra- and inter-node bandwidth, and
    the source of each."""
    if as_json:
        emit_json({**envelope(None), "gpus": [dataclasses.asdict(g) for g in GPUS.values()]})
        return
    tflops = lambda v: "n/a" if v is None else f"{v / 1e12:,.2f}"  # noqa: E731
    size = lambda v: "n/a" if v is None else binary_bytes(v)  # noqa: E731
    gbs = lambda v: "n/a" if v is None else f"{v / 1e9:,.0f}"  # noqa: E731
    rows = [[g.name, size(g.memory_bytes), size(g.usable_memory_bytes),
             *(tflops(g.peak_flops(p)) for p in PRECISIONS),
             gbs(g.hbm_bytes_per_second), "n/a" if g.sms is None else str(g.sms),
             str(g.gpus_per_node), gbs(g.intra_node_busbw), gbs(g.inter_node_busbw)]
            for g in GPUS.values()]
    print_table("Accelerators: dense peak TFLOP/s (10^12 FLOP/s, no sparsity figures)",
                ["gpu", "memory", "usable", *PRECISIONS, "bandwidth GB/s", "SMs", "node",
                 "intra GB/s", "inter GB/s"], rows,
                caption="usable: torch.cuda.mem_get_info's total, what serving engines size "
                        "against; node: GPUs per server; intra: NCCL ring bus bandwidth within "
                        "a node; inter: network line rate per GPU across nodes")
    print_table("Sources", ["gpu", "datasheet", "usable memory", "fabric"],
                [[g.name, g.source, g.usable_source, g.fabric_source] for g in GPUS.values()])
