"""`gptcalc verify --dp/--zero/--tp/--sp/--pp`: one training step per rank under PyTorch's
distributed engines, every rank's measurements against the per-rank analytic values."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

from ..config import GPTConfig
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload
from .render import emit_json, envelope, print_line, print_table

# A real run is replaced by a shape-only one (auto) when one rank's step would take longer
# than about this much work on a laptop core (the single-device verify's limit).
REAL_WORK_LIMIT_FLOPS = 3e10


def _tensors(cfg: GPTConfig, wl: Workload, setup: TrainingSetup, tensors: str) -> str:
    from gptcalc.memory.engines import rank_training_flops

    from reference_model.distributed import MAX_RANKS

    if tensors != "auto":
        return tensors
    world = setup.dp * setup.tp * setup.pp
    slow = rank_training_flops(cfg, wl, setup) * 2 > REAL_WORK_LIMIT_FLOPS
    return "shape-only" if slow or world > MAX_RANKS else "real"


def run(cfg: GPTConfig, wl: Workload, *, device: str, attn: str, tensors: str, mode: str,
        optimizer: str, recompute: str, max_layers: int | None, layout: dict, impl: str,
        as_json: bool, deepspeed_config: str | None = None) -> int:
    import torch

    from reference_model.verify import distributed_checks

    if device == "cuda":
        raise ConfigError("device", "the distributed verify runs on CPU ranks (gloo)")
    for name in ("dp", "tp", "pp"):
        if layout[name] < 1:
            raise ConfigError(name, f"--{name} must be at least 1, got {layout[name]}")
    if layout["zero"] not in (0, 1, 2, 3):
        raise ConfigError("zero", f"--zero must be 0, 1, 2 or 3, got {layout['zero']}")
    if layout["sp"] and layout["tp"] == 1:
        raise ConfigError("sp", "--sp needs --tp above 1")
    from reference_model.distributed import check_precision

    check_precision(layout, mode, optimizer, recompute)
    if impl == "transformers":
        from .extras import require

        require("verify", "transformers")
    notes = []
    if max_layers is not None and max_layers < cfg.n_layer:
        notes.append(f"REDUCED: verifying {max_layers} of {cfg.n_layer} blocks (--max-layers); "
                     "widths unchanged, the analytic side uses the same reduced model")
        cfg = cfg.replace(n_layer=max_layers)
    ds_zero: tuple = ()
    if deepspeed_config:
        from ..dsconfig import read_ds_config

        ds_zero = read_ds_config(deepspeed_config, cfg)["deepspeed_zero"]
    setup = TrainingSetup(mode=mode, attn_impl=attn, impl=impl, engine_settings=ds_zero, **layout)
    from reference_model.distributed import check_layout, engine_of

    from ..memory.engines import describe as describe_setup

    picked = _tensors(cfg, wl, setup, tensors)
    check_layout(cfg, wl, setup, impl, picked)
    world = setup.dp * setup.tp * setup.pp
    if picked == "shape-only":
        notes.append(f"SHAPE-ONLY: {world} ranks run one after another in this process on "
                     "FakeTensorMode tensors with a fake process group (FakeStore): the same "
                     "engines, modules and tensor sizes, no arithmetic and no communication")
    start = time.perf_counter()
    with _stdout_to_stderr():  # DeepSpeed's op builds print on stdout, before any JSON
        checks, results = distributed_checks(cfg, wl, setup, impl, picked)
    seconds = time.perf_counter() - start
    ok = all(c.ok for c in checks)
    engine = engine_of(setup)
    if as_json:
        emit_json({**envelope(cfg, wl, training={"mode": mode, "optimizer": optimizer,
                                                   "recompute": recompute}),
                   "device": "cpu", "torch": torch.__version__, "ok": ok,
                   "verified_config": dataclasses.asdict(cfg), "layout": layout,
                   "engine": engine, "impl": impl, "tensors": picked, "world_size": world,
                   "notes": notes, "seconds": round(seconds, 3),
                   "ranks": [r.as_dict() for r in results],
                   "checks": [c.as_dict() for c in checks]})
        return 0 if ok else 1
    print_line(f"{impl} model, {engine} twin: {world} ranks over gloo (127.0.0.1), "
               f"{'shape-only' if picked == 'shape-only' else 'real tensors'}; "
               f"{describe_setup(setup)}; micro-batch {wl.batch_size} x seq_len {wl.seq_len}, "
               f"torch={torch.__version__}")
    for note in notes:
        print_line(f"[bold yellow]{note}[/bold yellow]")
    rows = []
    for c in checks:
        rank, _, quantity = c.name.partition(" ")[2].partition(" ")
        rows.append([rank, quantity, f"{c.analytic:,}", f"{c.measured:,}", f"{c.difference:+,}",
                     f"{c.difference / c.measured:+.2%}" if c.measured else "",
                     "[green]ok[/green]" if c.ok else "[bold red]FAIL[/bold red]"])
    exact = sum(c.difference == 0 for c in checks)
    print_table("Per rank: analytic vs measured",
                ["rank", "quantity", "analytic", "measured", "difference", "error", "ok"], rows,
                caption=f"{exact}/{len(checks)} checks exact, {sum(c.ok for c in checks)} ok "
                        f"within their stated tolerances, in {seconds:.1f} s")
    failed = sum(not c.ok for c in checks)
    if failed:
        print_line(f"[bold red]{failed} check(s) failed[/bold red]")
    return 0 if ok else 1


@contextlib.contextmanager
def _stdout_to_stderr():
    """Standard output, Python's and the file descriptor's (compilers, subprocesses), sent to
    standard error while the measurement runs: stdout holds the results alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)
