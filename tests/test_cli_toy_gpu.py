"""A GPU is one catalogue entry: a toy card registered from this file alone answers
`memory --gpu`, whose verdict reads the card's usable memory."""

from __future__ import annotations

import dataclasses
import json

from click.testing import CliRunner

from gptcalc import gpus as catalogue
from gptcalc.cli import cli


def test_a_toy_gpu_answers_memory(monkeypatch):
    toy = dataclasses.replace(catalogue.GPUS["h100-sxm"], name="toy", memory_bytes=8 * 2**30,
                              usable_memory_bytes=7 * 2**30, source="toy")
    monkeypatch.setitem(catalogue.GPUS, "toy", toy)
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--gpu", "toy", "--json"])
    assert r.exit_code == 0, r.output
    fit = json.loads(r.stdout)["fit"]
    assert fit["gpu"] == "toy" and fit["budget"] == 7 * 2**30
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--gpu", "toy"])
    assert r.exit_code == 0 and "toy (7.00 GiB usable)" in r.stdout
