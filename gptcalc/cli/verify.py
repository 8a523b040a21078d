"""`gptcalc verify`: build the reference PyTorch model and check every analytic count against it."""

from __future__ import annotations

import dataclasses
import time

import click

from ..config import GPTConfig
from ..errors import ConfigError, nonneg_int, positive_int
from ..workload import Workload
from ..memory import TrainingSetup
from .extras import require
from ..schema import OPTIONS
from .options import (click_option, describe, json_option, measure_device_option, model_options,
                      setup_option, training_engine_option)
from .render import emit_json, envelope, print_line, print_table


@click.command("verify")
@model_options
@measure_device_option("Where to build the model; auto = cuda when available.")
@setup_option("attn", "Attention: tril mask, masked_fill and softmax, or SDPA.")
@click.option("--tensors", type=click.Choice(["auto", "real", "shape-only"]), default="auto",
              show_default=True,
              help="Run on real tensors, or count on meta/fake tensors (shapes only); auto picks "
                   "real when the model fits and runs in seconds.")
@setup_option("mode", "Precision of the memory checks' training steps (amp: 16-bit autocast).")
@setup_option("optimizer", "The optimizer of the memory checks' training steps.")
@setup_option("recompute", "Activation recomputation in the memory checks "
                           "(torch.utils.checkpoint).")
@click.option("--max-layers", type=int, default=None,
              help="Verify at most this many blocks (same widths); the output says so.")
@setup_option("dp", "Data-parallel ranks: a distributed step under PyTorch's engines (gloo).")
@setup_option("zero", "ZeRO stage with --dp (run by --engine).")
@training_engine_option("The engine a distributed verify runs (an engine whose twin cannot run "
                        "here says so):")
@click_option(OPTIONS["deepspeed_config"], help="A ds_config.json whose zero_optimization "
              "bucket sizes the DeepSpeed twin runs with (default DeepSpeed's own).")
@setup_option("tp", "Tensor-parallel ranks (DTensor, Megatron's layout).")
@setup_option("sp", "Sequence parallel norms (with --tp).", show_default=False)
@setup_option("pp", "Pipeline stages (torch.distributed.pipelining; micro-batches: --grad-accum "
                    "when above 1, else pp).")
@setup_option("pp_schedule", "The pipeline schedule, as `gptcalc memory` takes it.")
@setup_option("pp_virtual", "Model chunks per pipeline stage (interleaved-1f1b, zero-bubble).")
@setup_option("impl", type=click.Choice(["reference", "transformers"]),
              help="The model trained by a distributed verify: this project's reference "
                   "model or the transformers model of the same config.")
@json_option()
def command(model: tuple[GPTConfig, Workload], device: str, attn: str, tensors: str,
            mode: str, optimizer: str, recompute: str, max_layers: int | None,
            dp: int, zero: int, engine: str | None, deepspeed_config: str | None, tp: int,
            sp: bool, pp: int, pp_schedule: str, pp_virtual: int, impl: str,
            as_json: bool) -> int:
    """Analytic params, FLOPs and memory against a real PyTorch GPT (fvcore, FlopCounterMode,
    saved_tensors_hooks, MemTracker); exit 1 if any check fails. With --dp, --tp or --pp above
    1: one training step per rank under FSDP2, ZeroRedundancyOptimizer, DDP, DTensor
    tensor/sequence parallel or a pipeline schedule, every rank's states, resident bytes, saved
    activations, step peak and FLOPs checked."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        positive_int(name, value)
    nonneg_int("zero", zero)
    require("verify", "torch", "fvcore")
    cfg, wl = model
    if dp > 1 or tp > 1 or pp > 1 or zero or sp or engine or impl != "reference":
        from .verify_distributed import run

        return run(cfg, wl, device=device, attn=attn, tensors=tensors, mode=mode,
                   optimizer=optimizer, recompute=recompute, max_layers=max_layers,
                   layout=dict(dp=dp, zero=zero, tp=tp, sp=sp, pp=pp, pp_schedule=pp_schedule,
                               pp_virtual=pp_virtual, engine=engine), impl=impl,
                   as_json=as_json, deepspeed_config=deepspeed_config)
    import torch

    from reference_model.verify import setup_json, verify

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA is not available on this machine")
    start = time.perf_counter()
    training = TrainingSetup(mode=mode, optimizer=optimizer, recompute=recompute)
    setup, checks = verify(cfg, wl, device, attn, tensors, max_layers, training)
    seconds = time.perf_counter() - start
    ok = all(c.ok for c in checks)
    if as_json:
        emit_json({**envelope(cfg, wl, training={"mode": mode, "optimizer": optimizer,
                                                   "recompute": recompute}),
                   "device": device, "torch": torch.__version__, "ok": ok,
                   "verified_config": dataclasses.asdict(setup.config), **setup_json(setup),
                   "seconds": round(seconds, 3), "checks": [c.as_dict() for c in checks]})
        return 0 if ok else 1
    print_line(describe(setup.config, wl) + f"  device={device} attn={attn} mode={mode} "
               f"optimizer={optimizer} recompute={recompute} tensors={setup.tensors} "
               f"torch={torch.__version__}")
    for note in setup.notes:
        print_line(f"[bold yellow]{note}[/bold yellow]")
    rows = [[c.name, f"{c.analytic:,}", f"{c.measured:,}", f"{c.difference:+,}",
             "[green]ok[/green]" if c.ok else "[bold red]FAIL[/bold red]"] for c in checks]
    failed = sum(not c.ok for c in checks)
    print_table("Analytic vs measured", ["check", "analytic", "measured", "difference", "ok"], rows,
                caption=_caption(checks, seconds))
    if failed:
        print_line(f"[bold red]{failed} check(s) failed[/bold red]")
    return 0 if ok else 1


def _caption(checks, seconds: float) -> str:
    exact = sum(c.difference == 0 for c in checks)
    near = sum(c.ok and c.difference != 0 for c in checks)
    text = f"{exact}/{len(checks)} checks exact"
    if near:
        text += f", {near} more within its stated tolerance (--json lists it)"
    return text + f" in {seconds:.1f} s"
