"""LoRA step peak of transformers models as PEFT trains them, predicted and measured.

    PYTHONPATH=. python benchmarks/lora_peak.py [--batch 4] [--seq-len 64]

For each family of tests/test_lora_peak.py (a tiny config built with
AutoModelForCausalLM.from_config, random weights) and targets (gptcalc's default, PEFT's where
it has one, and all = PEFT's all-linear): `gptcalc memory --hf-config DIR --impl transformers
--mode fp32 --device cpu --lora-rank 8 --lora-targets T` against one steady-state fp32 AdamW
step of the PEFT-wrapped model on CPU: its saved tensors (saved_tensors_hooks) and its peak
(MemTracker). Needs transformers and peft.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from click.testing import CliRunner  # noqa: E402

from gptcalc.cli import cli  # noqa: E402
from reference_model import transformers_twin as tw  # noqa: E402
from tests.test_lora_peak import CASES, RANK, default, peft_model  # noqa: E402


def predict(raw: dict, targets: str, B: int, S: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        r = CliRunner().invoke(cli, ["memory", "--hf-config", d, "-B", str(B), "--seq-len",
                                     str(S), "--mode", "fp32", "--device", "cpu", "--impl",
                                     "transformers", "--lora-rank", str(RANK),
                                     "--lora-targets", targets, "--json"])
    if r.exit_code:
        raise SystemExit(r.output)
    return json.loads(r.output)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    B, S = args.batch, args.seq_len
    print(f"B={B} seq_len={S} rank={RANK} fp32 AdamW, CPU; bytes")
    print(f"{'family':10} {'targets':16} {'saved pred':>11} {'saved meas':>11} "
          f"{'peak pred':>10} {'peak meas':>10} {'error':>8}  phase")
    for name, raw in CASES.items():
        for targets in (default(raw), "all"):
            out = predict(raw, targets, B, S)
            model = peft_model(raw, targets)
            idx, labels = tw.make_batch(raw["vocab_size"], B, S)
            saved = sum(t.nbytes for t in tw.measure_saved(model, idx, labels).tensors)
            peak = tw.measure_step_peak(model, idx, labels).peak_bytes
            pred_saved = sum(out["breakdown"]["activations"].values())
            err = 100 * (out["peak"] - peak) / peak
            print(f"{name:10} {targets:16} {pred_saved:>11,} {saved:>11,} {out['peak']:>10,} "
                  f"{peak:>10,} {err:>+7.3f}%  {out['peak_phase']}", flush=True)


if __name__ == "__main__":
    main()
