"""Recipe files as their projects ship them (tests/recipes/shipped/, each with its repository,
path and commit in MANIFEST.json): each answers exactly as the options typed by hand from its
keys, or is refused in one line naming the key and the file; a recipe with its launcher's
accelerate config answers as the two typed together."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

SHIPPED = Path(__file__).resolve().parent / "recipes" / "shipped"
MANIFEST = json.loads((SHIPPED / "MANIFEST.json").read_text())
FILES = {e["file"]: e for e in MANIFEST["files"]}
ANSWERED = [f for f, e in FILES.items() if e["outcome"] == "answered"]
REFUSED = [f for f, e in FILES.items() if e["outcome"] == "refused"]


def _args(args: list[str]) -> list[str]:
    return [a.replace("{shipped}", str(SHIPPED)) for a in args]


def memory(*args: str) -> dict:
    r = CliRunner().invoke(cli, ["memory", *args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    out.pop("recipe", None)
    return out


def test_the_manifest_holds_every_shipped_file_and_at_least_fifty_recipes():
    on_disk = {str(p.relative_to(SHIPPED)) for p in SHIPPED.rglob("*")
               if p.is_file() and p.name != "MANIFEST.json"}
    assert on_disk == set(FILES)
    assert len(ANSWERED) + len(REFUSED) >= 50
    for e in FILES.values():
        assert e["file"] == f"{e['file'].split('/', 1)[0]}/{e['path']}"
        assert len(e["commit"]) == 40 and e["repository"].count("/") == 1


@pytest.mark.parametrize("name", ANSWERED)
def test_a_shipped_recipe_answers_as_its_options_typed_by_hand(name):
    e = FILES[name]
    run = _args(e["run"])
    assert memory("--recipe", str(SHIPPED / name), *run) == memory(*_args(e["typed"]), *run)


@pytest.mark.parametrize("name", REFUSED)
def test_a_shipped_recipe_refused_names_the_key_and_the_file(name):
    e = FILES[name]
    typed = os.path.relpath(SHIPPED / name)  # as a user types it, from where they stand
    r = CliRunner().invoke(cli, ["memory", "--recipe", typed, *_args(e["run"])])
    assert r.exit_code == 2, r.output
    line = r.stderr
    assert line.count("\n") == 1 and line.startswith("Error: --recipe: ")
    assert len(line.rstrip("\n")) <= 200
    # the file by its name (a long path's folders are elided to keep the line to 200
    # characters), then the key
    assert len(line.rstrip("\n")) <= 200
    assert Path(name).name in line
    if not e["key"].startswith("("):
        assert f"{Path(name).name}: {e['key']}" in line
    # the reason, whole where the line has room; its start where the 200 characters end it
    assert e["reason"] in line or (e["reason"][:80] in line and line.rstrip().endswith("…"))


@pytest.mark.parametrize("pair", MANIFEST["pairs"], ids=lambda p: "+".join(
    Path(f).name for f in p["files"]))
def test_a_recipe_and_its_launcher_config_answer_as_typed_together(pair):
    recipes = [a for f in pair["files"] for a in ("--recipe", str(SHIPPED / f))]
    run = _args(pair["run"])
    assert memory(*recipes, *run) == memory(*_args(pair["typed"]), *run)


def test_the_recipe_lines_of_a_recipe_and_its_launcher():
    sft = SHIPPED / "alignment-handbook/recipes/zephyr-7b-beta/sft/config_full.yaml"
    zero3 = SHIPPED / "trl/trl/accelerate_configs/zero3.yaml"
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(sft), "--recipe", str(zero3),
                                 "--gpus", "8"])
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stdout.splitlines() if x.startswith("recipe: ")]
    assert lines[0].startswith(f"recipe: {sft} (TRL / alignment-handbook): "
                               "model_name_or_path -> --preset mistral-7b-v0.1;")
    assert "bf16/fp16 -> --mode bf16 (overridden by zero3.yaml)" in lines[0]
    assert lines[1].startswith(f"recipe: {zero3} (accelerate): ")
    assert "num_processes" not in lines[1]  # --gpus typed: it gives the world size
    assert "deepspeed_config.zero_stage -> --zero 3" in lines[1]


def test_a_launcher_world_size_is_the_recipe_world_size_unless_gpus_is_typed():
    sft = str(SHIPPED / "alignment-handbook/recipes/zephyr-7b-beta/sft/config_full.yaml")
    zero3 = str(SHIPPED / "trl/trl/accelerate_configs/zero3.yaml")  # num_processes: 8
    assert memory("--recipe", sft, "--recipe", zero3)["setup"]["dp"] == 8
    assert memory("--recipe", sft, "--recipe", zero3, "--gpus", "16")["setup"]["dp"] == 16


def test_two_recipes_need_one_launcher_config():
    sft = str(SHIPPED / "alignment-handbook/recipes/smollm2/sft/config.yaml")
    r = CliRunner().invoke(cli, ["memory", "--recipe", sft, "--recipe", sft])
    assert r.exit_code == 2 and "0 of" in r.stderr and r.stderr.count("\n") == 1
