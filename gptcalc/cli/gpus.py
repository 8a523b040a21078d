"""`gptcalc gpus`: the accelerator catalogue, dense peaks only."""

from __future__ import annotations

import dataclasses

import click

from ..gpus import GPUS, PRECISIONS
from ..units import binary_bytes
from .render import emit_json, envelope, print_table


@click.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(as_json: bool) -> None:
    """Accelerators: memory (datasheet and usable), dense peak FLOP/s per precision (never
    sparsity figures), memory bandwidth and the datasheet each comes from."""
    if as_json:
        emit_json({**envelope(None), "gpus": [dataclasses.asdict(g) for g in GPUS.values()]})
        return
    tflops = lambda v: "n/a" if v is None else f"{v / 1e12:,.2f}"  # noqa: E731
    size = lambda v: "n/a" if v is None else binary_bytes(v)  # noqa: E731
    rows = [[g.name, size(g.memory_bytes), size(g.usable_memory_bytes),
             *(tflops(g.peak_flops(p)) for p in PRECISIONS),
             "n/a" if g.hbm_bytes_per_second is None else f"{g.hbm_bytes_per_second / 1e9:,.0f}"]
            for g in GPUS.values()]
    print_table("Accelerators: dense peak TFLOP/s (10^12 FLOP/s, no sparsity figures)",
                ["gpu", "memory", "usable", *PRECISIONS, "bandwidth GB/s"], rows,
                caption="usable: torch.cuda.mem_get_info's total, what serving engines size "
                        "against")
    print_table("Sources", ["gpu", "datasheet", "usable memory"],
                [[g.name, g.source, g.usable_source] for g in GPUS.values()])
