"""The pairwise matrix of training options (benchmarks/pairwise.py): every pair of levels is
settled, every refusal is one line naming both options, and the cells the engines' twins run
match gptcalc's step peak."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "pairwise.py"
_SPEC = importlib.util.spec_from_file_location("pairwise", _PATH)
pairwise = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("pairwise", pairwise)  # its dataclasses look their module up
_SPEC.loader.exec_module(pairwise)

TOY = {"a": [("0", ()), ("1", ())], "b": [("0", ()), ("1", ()), ("2", ())],
       "c": [("0", ()), ("1", ())], "d": [("0", ()), ("1", ())]}


def test_the_array_settles_every_pair_and_never_repeats_a_refused_one():
    refused = (("a", 1), ("b", 2))  # a stand-in rule: a 1 cannot meet b 2

    def run(cell):
        if cell["a"] == 1 and cell["b"] == 2:
            return pairwise.Outcome(cell, "refused", "a and b", named=["a", "b"])
        return pairwise.Outcome(cell, "modelled")

    outcomes = pairwise.covering_array(run, TOY)
    ran = [o.cell for o in outcomes if o.status == "modelled"]
    covered = set().union(*(pairwise.pairs_of(c) for c in ran))
    assert covered == pairwise.all_pairs(TOY) - {refused}
    assert sum(o.status == "refused" for o in outcomes) == 1
    # fewer cells than pairs: each cell settles several
    assert len(outcomes) < len(pairwise.all_pairs(TOY)) // 3


def test_every_refusal_is_one_line_naming_both_options():
    outcomes = pairwise.covering_array(pairwise.run_cell)
    refused = [o for o in outcomes if o.status == "refused"]
    assert refused and len(refused) < len(outcomes)
    for o in refused:
        assert o.message.startswith("Error: ") and "\n" not in o.message, o.message
        assert len(o.named) >= 2, (pairwise.label(o.cell), o.message)


torch = pytest.importorskip("torch")


# full training of the matrix's small model (2 x 32 tokens, V 512) outside FSDP2, measured on 2
# gloo ranks, torch 2.13, twice (docs/combinations.md): DDP and ZeroRedundancyOptimizer exact
# (13,907,028 B and 8,659,500 B: the optimizer step, CPU AdamW's previous tensor's temporary
# counted), DeepSpeed ZeRO-2 -0.02% (fp32 and mixed). The DDP and ZeroRedundancyOptimizer peaks
# are the optimizer step, after every collective of the step, so no buffer that gloo's worker
# thread frees late is in them (FSDP2's case below); the bound is the largest measured error,
# 0.02%, with the matrix's 2% as margin, as the LoRA cells (the exact figure is held on one
# process by tests/test_memory_measured.py's AdamW step test)
FULL_TRAINING_GAP = 0.02
# FSDP2's full-training cells on gloo: the fp32 cell measured -5.8% on one 2-core machine
# (9,546,588 B, the same in every run there, loaded or not, 1-8 threads per rank) and -13.0%
# on another (10,334,044 B: 787,456 B more, not reproduced). FSDP2's buffers are freed
# wherever the last reference drops, gloo's worker thread included, so the measured moment
# may hold more than the phase model's; the bound is the larger figure with a margin: 16%
FSDP2_FULL_TRAINING_GAP = 0.16


def bound_of(cell) -> float:
    if cell["adapter"]:
        return pairwise.PEAK_TOLERANCE
    engine = pairwise.OPTIONS["engine"][cell["engine"]][0]
    # FSDP1 (measured +0.01%, tests/test_fsdp1.py) frees its buffers as FSDP2 does
    return FSDP2_FULL_TRAINING_GAP if engine in ("fsdp2", "fsdp1") else FULL_TRAINING_GAP


@pytest.mark.slow
def test_the_twinned_cells_match_the_step_peak():
    outcomes = [pairwise.run_cell(c) for c in pairwise.twin_cells()]
    pairwise.measure(outcomes)
    measured = [o for o in outcomes if o.status == "measured"]
    assert len(measured) == len(outcomes) == 16
    for o in measured:
        assert abs(o.error) <= bound_of(o.cell), (pairwise.label(o.cell), o.error)
