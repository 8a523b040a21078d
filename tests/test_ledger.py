"""The step ledger (gptcalc.memory.ledger): terms change only by name, and the JSON keys it
makes are the documented ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.cli import cli
from gptcalc.memory.ledger import (GRADIENTS, SAVED, WEIGHTS, Ledger, LedgerError, Phase,
                                   STEADY_PHASES, Term)
from gptcalc.memory.peak import stage_ledger, step_peak

DOCS = Path(__file__).resolve().parent.parent / "docs" / "json.md"


def test_a_term_is_added_once_and_replaced_only_where_it_is():
    ledger = Ledger()
    ledger.open(Phase.FORWARD_END, {WEIGHTS: 10, SAVED: 5})
    with pytest.raises(LedgerError, match="already"):
        ledger.add(Phase.FORWARD_END, WEIGHTS, 1)
    with pytest.raises(LedgerError, match="not in"):
        ledger.replace(Phase.FORWARD_END, GRADIENTS, 0)
    with pytest.raises(LedgerError, match="not open"):
        ledger.add(Phase.OPTIMIZER_STEP, GRADIENTS, 0)
    with pytest.raises(LedgerError, match="already open"):
        ledger.open(Phase.FORWARD_END, {})
    ledger.replace(Phase.FORWARD_END, SAVED, 7)
    assert ledger.total(Phase.FORWARD_END) == 17
    assert ledger.labelled() == {"forward end": {"weights": 10, "saved activations": 7}}


def test_a_misspelt_term_is_not_the_constant():
    # a term is equal only to itself: a new Term with a base term's label cannot replace it,
    # and two terms with one label in a moment are refused when labels are made
    ledger = Ledger()
    ledger.open(Phase.BACKWARD_END, {GRADIENTS: 3})
    with pytest.raises(LedgerError):
        ledger.replace(Phase.BACKWARD_END, Term("gradients"), 0)
    ledger.add(Phase.BACKWARD_END, Term("gradients"), 1)
    with pytest.raises(LedgerError, match="share a label"):
        ledger.labelled()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["debug", "gpt2", "llama3-8b"]),
       engine_zero=st.sampled_from([(None, 0), ("deepspeed", 1), ("deepspeed", 3), ("fsdp2", 2),
                                    ("fsdp2", 3), ("megatron", 0), ("zero-redundancy", 1)]),
       dp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2]),
       mode=st.sampled_from(["fp32", "amp", "mixed"]), accum=st.sampled_from([1, 2]))
def test_every_moment_of_every_engine_sums_its_terms(name, engine_zero, dp, pp, mode, accum):
    cfg = from_name(name).replace(n_layer=2)
    engine, zero = engine_zero
    if engine == "megatron" and mode == "amp":
        mode = "mixed"
    setup = TrainingSetup(engine=engine, zero=zero, dp=dp, pp=pp, mode=mode, attn_impl="sdpa",
                          device="cuda")
    wl = Workload(1, 64, accum)
    peak = step_peak(cfg, wl, setup)
    assert peak.bytes == max(peak.phases.values()) == sum(peak.lines.values())
    for stage in ("first", "last") if pp > 1 else ("first",):
        ledger = stage_ledger(cfg, wl, setup, stage)
        assert ledger.phases[:5] == STEADY_PHASES
        for phase, lines in ledger.labelled().items():
            assert sum(lines.values()) == ledger.total(Phase(phase))


def _documented_keys(section: str) -> set[str]:
    """The first-column keys of the table under `## `section``."""
    text = DOCS.read_text()
    body = text.split(f"## `{section}`", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for row in re.findall(r"^\| ([^|]+) \|", body, re.M):
        keys |= set(re.findall(r"`([a-z_]+)`", row))
    return keys


def test_memory_json_keys_are_the_documented_ones():
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "-B", "1", "--gpu-memory",
                                 "80GiB", "--zero", "3", "--dp", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    envelope = {"schema", "config", "workload", "training"}
    only_with_recipe = {"recipe"}  # tests/test_recipes.py checks it with --recipe
    assert set(out) - envelope == (_documented_keys("gptcalc memory --json") - envelope
                                   - only_with_recipe)
    text = DOCS.read_text().split("## `gptcalc memory --json`", 1)[1].split("\n## ", 1)[0]
    training_row = next(line for line in text.splitlines() if line.startswith("| `training`"))
    assert set(out["training"]) <= set(re.findall(r"`([a-z0-9_]+)`", training_row))
    breakdown_row = next(line for line in text.splitlines() if line.startswith("| `breakdown`"))
    assert set(out["breakdown"]) <= set(re.findall(r"`([a-z_]+)`", breakdown_row))
    assert "resident" in out and sum(out["breakdown"]["resident"].values()) == out["resident"]
    phases_row = next(line for line in text.splitlines() if line.startswith("| `peak`"))
    assert set(out["peak_phases"]) <= set(re.findall(r"`([a-z ,'-]+)`", phases_row))


def test_every_moment_is_documented():
    text = DOCS.read_text()
    for phase in Phase:
        assert f"`{phase.label}`" in text, phase
