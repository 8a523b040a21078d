"""One real process per command: the installed entry point runs, prints, and exits 0.

Everything else about the commands is tested in-process through click's CliRunner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gptcalc(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "gptcalc", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def test_presets():
    out = json.loads(gptcalc("presets", "--json").stdout)
    assert out["schema"] == "gptcalc/2" and len(out["presets"]) >= 10


def test_params():
    assert "124,439,808" in gptcalc("params", "--preset", "gpt2").stdout


def test_flops():
    # nanoGPT transformer_sizing.ipynb: GPT-2 124M, forward 291,648,307,200 FLOPs per sequence
    out = json.loads(gptcalc("flops", "--preset", "gpt2", "--json").stdout)
    assert out["forward_per_token"] * 1024 == 291_648_307_200


def test_memory():
    out = json.loads(gptcalc("memory", "--preset", "gpt2", "-B", "1", "--json").stdout)
    assert out["weights"] == 4 * 124_439_808  # fp32: 4 bytes per parameter


@pytest.mark.slow  # a whole process importing torch and fvcore
def test_verify():
    pytest.importorskip("torch")
    r = gptcalc("verify", "--preset", "debug", "--device", "cpu")
    assert "torch=" in r.stdout and "checks exact" in r.stdout
