"""How often one `gptcalc memory` builds the step account, the inventory and the engine: once
per pipeline rank for the step it answers, and never the same (configuration, workload,
set-up, stage) twice when --gpu adds what fits (each candidate micro-batch, sequence, context
and advice is a step of its own)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gptcalc import inventory as inventory_module
from gptcalc.cli import cli
from gptcalc.memory import peak
from gptcalc.memory.engines import base


@pytest.fixture
def builds(monkeypatch):
    """The (config, workload, set-up, stage) of every step build, the caches emptied first."""
    made = []
    build = peak.build_account

    def counted(cfg, workload, setup, stage):
        made.append((cfg, workload, setup, stage))
        return build(cfg, workload, setup, stage)

    monkeypatch.setattr(peak, "build_account", counted)
    for cache in (peak._account, base._engine_for, inventory_module._inventory):
        cache.cache_clear()
    yield made
    peak._account.cache_clear()


def _memory(*args: str) -> None:
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", *args])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("pp", [1, 4])
def test_one_build_per_pipeline_rank(builds, pp):
    _memory("--pp", str(pp))
    assert len(builds) == pp
    assert len({(setup, workload) for _, workload, setup, _ in builds}) == 1
    assert inventory_module._inventory.cache_info().misses == 1  # the inventory made once
    assert base._engine_for.cache_info().misses == 1  # the engine looked up and checked once


@pytest.mark.parametrize("pp", [1, 4])
def test_what_fits_never_rebuilds_a_step(builds, pp):
    _memory("--gpu", "h100-sxm", "--pp", str(pp))
    assert len(builds) == len(set(builds))
    # the answered step comes first, once per rank; the rest are other steps
    cfg, workload, setup, _ = builds[0]
    answered = [b for b in builds if b[:3] == (cfg, workload, setup)]
    assert builds[:pp] == answered and len(answered) == pp
    assert len(builds) > pp
