"""The Python API hands back the library's own numbers, memory included, and stays torch-free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gptcalc

ROOT = Path(__file__).resolve().parents[1]


def test_summary_holds_params_flops_and_memory():
    cfg, wl = gptcalc.load(preset="gpt2", batch_size=2, seq_len=512)
    s = gptcalc.summarize(cfg, wl)
    assert s.params.total == 124_439_808  # released GPT-2 small (see test_params)
    # GPT-2 is trained in bf16 autocast over fp32 weights by default: 4-byte weights and
    # gradients, AdamW's 8 bytes per parameter plus one 4-byte step per tensor (148 tensors in
    # the released checkpoint's state dict, less the tied head)
    assert (s.memory.weights, s.memory.gradients) == (4 * 124_439_808, 4 * 124_439_808)
    assert s.memory.optimizer == 8 * 124_439_808 + 4 * 148
    setup = gptcalc.TrainingSetup(mode="mixed", zero=3, dp=2)
    sharded = gptcalc.summarize(cfg, wl, training=setup)
    assert sharded.memory.weights < s.memory.weights  # ZeRO-3 shards the 16-bit weights
    assert gptcalc.to_dict(s)["memory"]["peak"]["bytes"] == s.memory.peak.bytes


def test_memory_names_load_lazily():
    code = ("import sys, gptcalc; before = 'gptcalc.memory' in sys.modules; "
            "gptcalc.memory_report; print(before, 'gptcalc.memory' in sys.modules, "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "True", "False"], out.stderr
