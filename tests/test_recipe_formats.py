"""Recipe formats by registry: a new kind of recipe file is one module that registers a
`RecipeFormat` (and its test); the dispatcher names no format. A toy format registered here
alone answers `memory --recipe` exactly as the options it stands for typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.recipes import FORMATS, kinds
from gptcalc.recipes.base import (READ, Reading, Recipe, RecipeFormat, formats_for,
                                  register_format, unregister_format)

TOY_KEYS = {"toy_model": READ, "toy_batch": READ}


def read_toy(doc: dict, path: Path, given: dict) -> Recipe:
    r = Reading(path, "toy")
    r.walk(doc, TOY_KEYS)
    r.set("toy_model", "preset", r.text("toy_model", doc["toy_model"]))
    r.set("toy_batch", "batch_size", r.count("toy_batch", doc["toy_batch"]))
    return r.recipe()


@pytest.fixture
def toy():
    fmt = register_format(RecipeFormat("toy", (".yaml", ".yml"), lambda d: "toy_model" in d,
                                       read_toy, order=5))
    yield fmt
    unregister_format("toy")


def memory_json(*args: str) -> dict:
    r = CliRunner().invoke(cli, ["memory", *args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    out.pop("recipe", None)
    return out


def test_toy_format_answers_as_typed(toy, tmp_path):
    f = tmp_path / "toy.yaml"
    f.write_text("toy_model: gpt2\ntoy_batch: 3\n")
    assert "toy" in kinds()
    assert memory_json("--recipe", str(f)) == memory_json("--preset", "gpt2", "-B", "3")


def test_formats_asked_in_order_and_by_suffix():
    yaml = [f.kind for f in formats_for(".yaml")]
    assert yaml[:2] == ["torchtune", "axolotl"] and yaml[-1] == "TRL / alignment-handbook"
    assert [f.kind for f in formats_for(".json")] == ["DeepSpeed config",
                                                      "Hugging Face TrainingArguments"]
    assert [f.kind for f in formats_for(".args")] == ["Megatron-LM"]  # read as text
    assert [f.kind for f in formats_for(".sh")] == ["Megatron-LM"]


def test_unclaimed_document_names_the_formats_tried(tmp_path):
    f = tmp_path / "odd.yaml"
    f.write_text("name: x\n")
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(f)])
    assert r.exit_code == 2
    assert "not a recipe gptcalc reads" in r.output and "axolotl" in r.output
    assert "toy" not in FORMATS


def test_deepspeed_config_as_recipe_is_pointed_to_its_option(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text('{"zero_optimization": {"stage": 3}}')
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(f)])
    assert r.exit_code == 2 and "give it with --deepspeed-config" in r.output
    assert len(r.output.strip().splitlines()) == 1
