"""Saved bytes under each recomputation, predicted against measured, on the reference model and
on transformers models: one row per (model, recompute).

    python benchmarks/recompute_twins.py [--mode fp32|bf16] [--attn sdpa|manual] [-B 2] [-S 64]

Measured: every storage autograd saves in one training forward (saved_tensors_hooks,
deduplicated by storage), plus what the checkpoints keep outside autograd (op: the outputs
torchtitan's policy caches; transformers: the tensors bound into each layer's recomputation).
Predicted: `gptcalc.memory.saved_activations`. Exits 1 if any row is off.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from gptcalc import GPTConfig, Workload, from_name
from gptcalc.memory import TrainingSetup, saved_activations
from reference_model.memory import build_for, make_batch, measure_saved

REFERENCE = {  # name -> from_name arguments (E 64, L 2, H 4, V 256)
    "gpt2": dict(arch="gpt2"),
    "llama (GQA 4/2)": dict(arch="llama", n_kv_head=2),
    "tutorial (per-head)": dict(arch="tutorial"),
}
TRANSFORMERS = {  # name -> tests/test_transformers_twin.py's family
    "transformers gpt2": "gpt2",
    "transformers llama (GQA 4/2)": "llama",
    "transformers qwen2 (GQA 4/2)": "qwen2",
}


def _small(**kw) -> GPTConfig:
    return from_name("debug", n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=256,
                     dropout=0.0, **kw)


def reference_row(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> tuple[int, int]:
    model = build_for(cfg, setup)
    idx, targets = make_batch(cfg, wl)
    measured = measure_saved(model, idx, targets, setup)
    return sum(saved_activations(cfg, wl, setup).values()), sum(
        t.nbytes for t in measured.tensors)


def transformers_row(family: str, wl: Workload, setup: TrainingSetup) -> tuple[int, int]:
    from reference_model import transformers_twin as tw

    gqa = None if family == "gpt2" else 2
    if family == "gpt2":
        cfg = _small(arch="gpt2")
    else:
        cfg = _small(arch="llama", n_kv_head=gqa, qkv_bias=family == "qwen2", d_ff=96)
    dtype = torch.float32 if setup.mode == "fp32" else torch.bfloat16
    model = tw.build(tw.hf_config_for(cfg), None if setup.attn_impl == "sdpa" else "eager",
                     dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tw.apply_recompute(model, setup.recompute)
        idx, labels = tw.make_batch(cfg.vocab_size, wl.batch_size, wl.seq_len)
        measured = tw.measure_saved(model, idx, labels).activation_bytes
    return sum(saved_activations(cfg, wl, setup).values()), measured


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa")
    ap.add_argument("-B", type=int, default=2)
    ap.add_argument("-S", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    wl = Workload(args.B, args.S)
    rows = []
    for name, kw in REFERENCE.items():
        for recompute in ("none", "selective", "op", "full"):
            setup = TrainingSetup(mode=args.mode, attn_impl=args.attn, recompute=recompute)
            rows.append((name, recompute, *reference_row(_small(**kw), wl, setup)))
    for name, family in TRANSFORMERS.items():
        for recompute in ("none", "op", "full"):
            setup = TrainingSetup(mode=args.mode, attn_impl=args.attn, recompute=recompute,
                                  impl="transformers")
            rows.append((name, recompute, *transformers_row(family, wl, setup)))
    print(f"E 64, L 2, H 4, V 256, B {args.B}, S {args.S}, {args.mode}, attn {args.attn}, CPU, "
          f"torch {torch.__version__}")
    print(f"| {'model':<30} | {'recompute':<9} | {'predicted B':>12} | {'measured B':>12} | "
          f"{'error':>6} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 14}|{'-' * 14}|{'-' * 8}|")
    for name, recompute, predicted, measured in rows:
        print(f"| {name:<30} | {recompute:<9} | {predicted:>12,} | {measured:>12,} | "
              f"{predicted - measured:>+6,} |")
    return 0 if all(p == m for *_, p, m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
