"""The engine registry (gptcalc.memory.engines.base): a new engine is its module and its
tests. This file is both for a toy engine: it registers one and every command sees it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.memory import memory_report
from gptcalc.memory.engines import Engine, Step, engine_for, names, register, unregister
from gptcalc.memory.ledger import GRADIENTS, STEADY_PHASES, Ledger, Phase, Term

ROOT = Path(__file__).resolve().parent.parent
BUFFER = Term("toy engine's staging buffer")


class Toy(Engine):
    """Replicates every state, keeps a 1 MiB staging buffer in every moment, and frees the
    gradients before the optimizer step."""

    name = "toy"
    help = "toy (a test's engine)"
    stages = (0, 1)

    def mixed_precision(self, setup: TrainingSetup) -> str:
        return "mixed (the toy's own)"

    def assumptions(self, setup: TrainingSetup) -> str:
        return "; toy buffer 1 MiB"

    def resident(self, cfg, setup, rank):
        return {**super().resident(cfg, setup, rank), "toy buffer": 1 << 20}

    def adjust(self, ledger: Ledger, step: Step) -> None:
        ledger.add_each(STEADY_PHASES, BUFFER, 1 << 20)
        ledger.replace(Phase.OPTIMIZER_STEP, GRADIENTS, 0)


@pytest.fixture
def toy():
    engine = register(Toy())
    yield engine
    unregister("toy")


def test_a_toy_engine_joins_through_the_registry_alone(toy):
    cfg, wl = from_name("debug"), Workload(2, 16)
    plain = memory_report(cfg, wl, TrainingSetup(dp=2))
    rep = memory_report(cfg, wl, TrainingSetup(dp=2, engine="toy"))
    assert "toy" in names() and engine_for(TrainingSetup(engine="toy")) is toy
    assert rep.breakdown["resident"]["toy buffer"] == 1 << 20
    assert rep.peak.lines["toy engine's staging buffer"] == 1 << 20
    # the same states as DDP's replicated ones, without DDP's buckets
    assert rep.weights == plain.weights and rep.optimizer == plain.optimizer
    with pytest.raises(ConfigError) as e:
        engine_for(TrainingSetup(engine="toy", zero=3))
    assert e.value.field == "zero"
    # the command line takes it, and its first line names it
    r = CliRunner().invoke(cli, ["memory", "--preset", "debug", "-B", "2", "--dp", "2",
                                 "--engine", "toy", "--mode", "mixed", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["assumptions"].startswith("Assuming engine toy, mixed (the toy's own)")
    assert "; toy buffer 1 MiB;" in out["assumptions"]
    assert out["breakdown"]["resident"]["toy buffer"] == 1 << 20


def test_an_unknown_engine_is_one_line(toy):
    r = CliRunner().invoke(cli, ["memory", "--preset", "debug", "--engine", "nope"])
    assert r.exit_code == 2 and "--engine" in r.output and "toy" in r.output
    with pytest.raises(ConfigError) as e:
        engine_for(TrainingSetup(engine="nope"))
    assert e.value.field == "engine"


def test_a_name_or_a_default_taken_twice_is_refused():
    with pytest.raises(ValueError, match="registered already"):
        register(type("Again", (Toy,), {"name": "ddp"})())
    with pytest.raises(ValueError, match="default"):
        register(type("Rival", (Toy,), {"name": "rival", "default_for": (0,)})())
    assert "rival" not in names()


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_the_step_the_setup_and_the_command_line_name_no_engine():
    # what sums the step, the training set-up and the CLI ask the registry: an engine's name
    # as a string of their code would be a place a new engine has to be added by hand
    files = [ROOT / "gptcalc/memory/peak.py", ROOT / "gptcalc/training_setup.py",
             *sorted((ROOT / "gptcalc/cli").glob("*.py"))]
    for path in files:
        assert not _string_constants(path) & set(names()), path
