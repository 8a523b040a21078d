"""--gpus N, the world size, and the names recipes give models: placeholders resolve against
--gpus (or are asked for), --gpus without a recipe is --dp over the other degrees (both sides of
divisibility), Hub ids and torchtune builders name presets, a mistyped preset gets one
suggestion."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.presets import PRESETS
from gptcalc.recipes.models import HUB, TORCHTUNE

from .test_hf_hub import LLAMA31_8B


def run(*args: str):
    return CliRunner().invoke(cli, ["memory", *args])


def memory(*args: str) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    out.pop("recipe", None)
    return out


def one_line(r, option: str) -> str:
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"Error: {option}: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def test_gpus_without_a_recipe_is_dp_over_the_other_degrees():
    base = ["--preset", "llama3.2-1b", "--engine", "fsdp2", "--zero", "3"]
    assert memory(*base, "--gpus", "8") == memory(*base, "--dp", "8")
    assert memory(*base, "--gpus", "8", "--tp", "2") == memory(*base, "--dp", "4", "--tp", "2")
    assert memory(*base, "--gpus", "8", "--dp", "4", "--tp", "2")["setup"]["dp"] == 4


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "6", "--tp", "4"], "6 is not a multiple of tp x pp x cp = 4"),  # 8 divides
    (["--gpus", "8", "--dp", "4"], "8 is not dp x tp x pp x cp = 4"),
    (["--gpus", "0"], "must be a whole number from 1"),
])
def test_gpus_that_do_not_divide_are_one_line(args, needle):
    assert needle in one_line(run("--preset", "debug", *args), "--gpus")


def test_a_torchtitan_shard_degree_of_minus_one_is_gpus_over_the_other_degrees(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n'
                    '[activation_checkpoint]\nmode = "none"\n'
                    '[parallelism]\ntensor_parallel_degree = 2\n')
    setup = memory("--recipe", str(path), "--gpus", "16")["setup"]
    assert (setup["dp"], setup["tp"], setup["engine"]) == (8, 2, "fsdp2")
    err = one_line(run("--recipe", str(path), "--gpus", "7"), "--recipe")
    assert "--gpus 7 is not a multiple of the 2 ranks" in err
    err = one_line(run("--recipe", str(path)), "--recipe")
    assert "data_parallel_shard_degree = -1" in err and "give --gpus N" in err


def test_a_torchtune_config_runs_distributed_on_more_than_one_gpu(tmp_path):
    path = tmp_path / "full.yaml"
    path.write_text("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\n"
                    "batch_size: 2\n")
    typed = ["--preset", "llama3.2-1b", "-B", "2", "--mode", "bf16", "--loss", "chunked",
             "--recompute", "none", "--no-keep-logits", "--seq-len", "1024"]
    assert memory("--recipe", str(path), "--seq-len", "1024") == memory(*typed)
    assert memory("--recipe", str(path), "--seq-len", "1024", "--gpus", "8") == memory(
        *typed, "--engine", "fsdp2", "--zero", "3", "--dp", "8")
    # fsdp_* keys: the distributed recipe, whose world size the file does not give
    path.write_text(path.read_text() + "fsdp_reshard_after_forward: false\n")
    assert "give --gpus N" in one_line(run("--recipe", str(path)), "--recipe")
    assert memory("--recipe", str(path), "--seq-len", "1024", "--gpus", "4")["setup"][
        "zero"] == 2


def test_every_name_a_recipe_gives_is_a_preset():
    assert set(HUB.values()) | set(TORCHTUNE.values()) <= set(PRESETS)


def test_the_families_the_transformers_profile_measures():
    from gptcalc import from_name
    from gptcalc.recipes.models import TRANSFORMERS_MODELLED
    from gptcalc.training import _transformers_modelled

    for name in set(HUB.values()):
        preset = PRESETS[name]
        assert _transformers_modelled(from_name(name)) == (
            preset.hub in TRANSFORMERS_MODELLED), name


def test_a_hub_id_answers_as_its_published_config_json(tmp_path):
    # meta-llama/Llama-3.1-8B's config.json (tests/test_hf_hub.py) and the preset the id names
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA31_8B))
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("model_name_or_path: meta-llama/Llama-3.1-8B\ntorch_dtype: bfloat16\n"
                      "bf16: true\nper_device_train_batch_size: 2\nmax_length: 1024\n")
    by_preset = memory("--recipe", str(recipe))
    by_file = memory("--recipe", str(recipe), "--hf-config", str(config))
    assert by_preset["setup"]["impl"] == by_file["setup"]["impl"] == "transformers"
    for key in ("weights", "gradients", "optimizer", "activations", "logits", "peak"):
        assert by_preset[key] == by_file[key], key


def test_a_hub_id_not_known_offline_names_the_nearest_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-7B-Instruct-1M\n")
    err = one_line(run("--recipe", str(recipe)), "--recipe")
    assert "model_name_or_path -> --hf-config" in err
    assert "-> --hf-config: --preset qwen2.5-7b has the sizes of qwen/qwen2.5-7b-instruct" in err


def test_a_mistyped_preset_gets_one_suggestion():
    err = one_line(run("--preset", "qwen2.5-7"), "--preset")
    assert "did you mean qwen2.5-7b?" in err and "llama2-7b," not in err
    assert "did you mean" not in one_line(run("--preset", "zzzz"), "--preset")


def test_a_trainer_recipe_under_deepspeed_asks_for_the_world_size():
    from pathlib import Path

    shipped = Path(__file__).resolve().parent / "recipes" / "shipped"
    recipe = str(shipped / "LLaMA-Factory/examples/train_full/qwen3_full_sft.yaml")
    err = one_line(run("--recipe", recipe), "--recipe")
    assert "deepspeed = '(all ranks)' is the world's ranks" in err and "give --gpus N" in err
    assert memory("--recipe", recipe, "--gpus", "4")["setup"]["dp"] == 4
    assert memory("--recipe", recipe, "--dp", "2")["setup"]["dp"] == 2
