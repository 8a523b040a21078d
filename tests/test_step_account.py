"""The step account: one build per (config, workload, set-up, stage), read by the peak, the
memory report, the pipeline ranks and the allocator replay; nothing rebuilds it."""

from __future__ import annotations

import pytest

from gptcalc.inventory import inventory
from gptcalc.memory import memory_report, peak
from gptcalc.memory.ledger import WEIGHTS, LedgerError, Phase
from gptcalc.memory.reserved import rank_reserved
from gptcalc.presets import from_name
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload

CFG = from_name("gpt2", n_layer=8, n_embd=64, n_head=4, vocab_size=256, block_size=128)
WL = Workload(2, 64, 8)


@pytest.fixture
def builds(monkeypatch):
    """The number of step builds since the fixture started (caches emptied first)."""
    count = [0]
    build = peak.build_account

    def counted(*args):
        count[0] += 1
        return build(*args)
    monkeypatch.setattr(peak, "build_account", counted)
    peak._account.cache_clear()
    yield count
    peak._account.cache_clear()


@pytest.mark.parametrize("pp,schedule", [(1, "1f1b"), (2, "1f1b"), (4, "1f1b"), (4, "gpipe")])
def test_one_build_per_pipeline_rank(builds, pp, schedule):
    setup = TrainingSetup(pp=pp, pp_schedule=schedule, device="cuda")
    rep = memory_report(CFG, WL, setup)
    assert builds[0] == pp
    assert len(rep.stages) == (pp if pp > 1 else 0)
    # the allocator replay of every rank reads the same accounts
    rank_reserved(CFG, WL, setup)
    assert builds[0] == pp


def test_context_parallel_builds_once(builds):
    memory_report(CFG, WL, TrainingSetup(cp=2, dp=2, device="cuda", attn_impl="sdpa"))
    assert builds[0] == 1


def test_a_cached_account_equals_a_fresh_build():
    setup = TrainingSetup(pp=4, zero=1, dp=2, mode="mixed")
    for stage in ("first", 1, 2, "last"):
        cached = peak.step_account(CFG, WL, setup, stage)
        fresh = peak.build_account(CFG, WL, setup, stage)
        assert cached.ledger.labelled() == fresh.ledger.labelled()
        assert cached.states == fresh.states and cached.activations == fresh.activations


def test_a_built_ledger_is_read_not_changed():
    ledger = peak.stage_ledger(CFG, WL, TrainingSetup(), "first")
    with pytest.raises(LedgerError):
        ledger.replace(Phase.FORWARD_END, WEIGHTS, 0)


def test_inventory_is_made_once_and_each_caller_gets_its_own_list():
    first = inventory(CFG)
    first.clear()
    assert inventory(CFG) and inventory(CFG) is not inventory(CFG)
    assert inventory(CFG)[0] is inventory(CFG)[0]  # the same frozen tensors, made once
