"""`gptcalc verify`: build the reference PyTorch model and check every analytic count against it."""

from __future__ import annotations

import dataclasses
import time

import click

from ..config import ConfigError, GPTConfig, Workload
from ..memory import MODES, OPTIMIZERS, RECOMPUTE, TrainingSetup
from .extras import require
from .options import describe, model_options
from .render import emit_json, envelope, print_line, print_table


@click.command("verify")
@model_options
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Where to build the model; auto = cuda when available.")
@click.option("--attn", type=click.Choice(["manual", "sdpa"]), default="manual",
              show_default=True, help="Attention: tril mask, masked_fill and softmax, or SDPA.")
@click.option("--tensors", type=click.Choice(["auto", "real", "shape-only"]), default="auto",
              show_default=True,
              help="Run on real tensors, or count on meta/fake tensors (shapes only); auto picks "
                   "real when the model fits and runs in seconds.")
@click.option("--mode", type=click.Choice(MODES), default="fp32", show_default=True,
              help="Precision of the memory checks' training steps (amp: 16-bit autocast).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True)
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="none", show_default=True,
              help="Activation recomputation in the memory checks (torch.utils.checkpoint).")
@click.option("--max-layers", type=int, default=None,
              help="Verify at most this many blocks (same widths); the output says so.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(model: tuple[GPTConfig, Workload], device: str, attn: str, tensors: str,
            mode: str, optimizer: str, recompute: str, max_layers: int | None,
            as_json: bool) -> int:
    """Analytic params, FLOPs and memory against a real PyTorch GPT (fvcore, FlopCounterMode,
    saved_tensors_hooks, MemTracker); exit 1 if any check fails."""
    require("verify", "torch", "fvcore")
    import torch

    from reference_model.verify import setup_json, verify

    cfg, wl = model
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
