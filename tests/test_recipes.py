"""--recipe FILE: each kind of recipe, written the way its project ships it (tests/recipes/,
each file naming the one it follows), answers as the options it stands for typed by hand; a
key gptcalc does not know, or a setting it does not model, is one line naming the key and the
file; options typed beside the recipe win."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.recipes import hf_trainer, read_recipe, torchtitan

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "tests" / "recipes"
TITAN = str(RECIPES / "torchtitan_llama3_8b.toml")
TITAN_DEBUG = str(RECIPES / "torchtitan_debug_model.toml")
TUNE = str(RECIPES / "torchtune_llama3_1_8b_qlora.yaml")
AXOLOTL = str(RECIPES / "axolotl_llama3_qlora.yml")
HF = str(RECIPES / "hf_trainer_args.json")
MEGATRON = str(RECIPES / "megatron_gpt3_175b.args")


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def memory(*args: str) -> dict:
    r = invoke("memory", *args, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    out.pop("recipe", None)
    return out


def fails(*args: str) -> str:
    r = invoke(*args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stderr.startswith("Error: --recipe: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.fixture
def llama31(tmp_path) -> str:
    """A local Llama-3.1-8B config.json (as published on the Hub) that stands in for the Hub
    id a recipe names, given as --hf-config beside it."""
    from .test_hf_hub import LLAMA31_8B

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA31_8B))
    return str(path)


# Each recipe and the options it stands for, written from the project's own documentation of
# its keys (the module docstrings of gptcalc.recipes.* cite the file and version of each)
TYPED = {
    # llama3_8b.toml on 8 ranks: FSDP2 (shard degree -1 = all 8) with bf16 MixedPrecisionPolicy,
    # reshard after forward (no pipelining), op-level selective checkpointing, local batch 1
    "torchtitan": ([TITAN, "--dp", "8"],
                   ["--preset", "llama3-8b", "-T", "131072", "--engine", "fsdp2", "--dp", "8",
                    "--zero", "3", "--mode", "mixed", "--recompute", "op", "-B", "1",
                    "--seq-len", "8192", "--no-keep-logits"]),
    # 8B_qlora_single_device.yaml: torchao NF4 base, adapters on q,k,v,o and the MLP, pure
    # bf16, batch 2 x 16, every layer checkpointed, the chunked loss, logits deleted
    "torchtune": ([TUNE],
                  ["--preset", "llama3-8b", "--lora-rank", "8", "--lora-targets",
                   "q,k,v,o,gate,up,down", "--weights-dtype", "nf4-dq", "--mode", "bf16",
                   "-B", "2", "--grad-accum", "16", "--loss", "chunked", "--recompute", "full",
                   "--no-keep-logits"]),
    # axolotl qlora.yml: PEFT all-linear at r=32 over a double-quantised NF4 base, bf16 autocast
    # with fp32 adapters, sequences of 4096, micro-batch 2 x 4, paged 8-bit AdamW, checkpointing
    "axolotl": ([AXOLOTL],
                ["--lora-rank", "32", "--lora-targets", "all", "--weights-dtype", "nf4-dq",
                 "--mode", "amp", "--seq-len", "4096", "-B", "2", "--grad-accum", "4",
                 "--optimizer", "paged_adamw8bit", "--recompute", "full",
                 "--no-keep-logits"]),
    # TrainingArguments: bf16 autocast over an fp32 model, batch 4 x 8, checkpointing, fused
    # AdamW, blocks of 2048 tokens
    "hf": ([HF], ["--mode", "amp", "-B", "4", "--grad-accum", "8", "--recompute", "full",
                  "--seq-len", "2048", "--no-keep-logits"]),
    # the GPT-3 175B script: tp 8, pp 16, fp16 mixed precision without the distributed
    # optimizer, micro-batch 1 of a 1536 global batch on one data-parallel rank
    "megatron": ([MEGATRON],
                 ["--preset", "gpt2", "-L", "96", "-E", "12288", "-H", "96", "--d-ff", "49152",
                  "-T", "2048", "--seq-len", "2048", "-V", "51200", "--dropout", "0.1",
                  "--set", "mlp=gelu", "--engine", "megatron", "--attn", "sdpa", "--tp", "8",
                  "--pp", "16", "--no-distributed-optimizer", "--mode", "mixed",
                  "--autocast-dtype", "fp16", "-B", "1", "--grad-accum", "1536"]),
}


@pytest.mark.parametrize("kind", TYPED)
def test_a_recipe_answers_as_its_options_typed(kind, llama31):
    recipe, typed = TYPED[kind]
    hub = ["--hf-config", llama31] if kind in ("axolotl", "hf") else []
    assert memory("--recipe", *recipe, *hub) == memory(*typed, *hub)


def test_the_recipe_line_and_the_ignored_keys():
    r = invoke("memory", "--recipe", TITAN, "--dp", "8")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Assuming engine fsdp2")
    assert lines[1].startswith(f"recipe: {TITAN} (torchtitan): model.name+flavor -> --preset "
                               "llama3-8b;")
    assert "activation_checkpoint.mode+selective_ac_option -> --recompute op" in lines[1]
    out = json.loads(invoke("memory", "--recipe", TITAN, "--dp", "8", "--json").stdout)
    ignored = {d["key"] for d in out["recipe"]["ignored"]}
    assert {"checkpoint.interval", "metrics.log_freq", "optimizer.lr",
            "quantize.linear.float8.filter_fqns"} <= ignored


def test_the_recipe_json_is_documented():
    out = json.loads(invoke("memory", "--recipe", MEGATRON, "--json").stdout)
    row = next(line for line in (ROOT / "docs" / "json.md").read_text().splitlines()
               if line.startswith("| `recipe` |"))
    for key in (*out["recipe"], *out["recipe"]["read"][0], *out["recipe"]["ignored"][0]):
        assert f"`{key}`" in row, key


def test_options_typed_beside_the_recipe_win():
    out = memory("--recipe", TITAN, "--dp", "8", "-B", "3", "--recompute", "full")
    assert out["workload"]["batch_size"] == 3 and out["setup"]["recompute"] == "full"
    r = invoke("memory", "--recipe", TITAN, "--dp", "8", "-B", "3")
    assert "training.local_batch_size -> --batch-size 1 (overridden by --batch-size)" in r.stdout


def test_a_shard_degree_of_minus_one_is_the_ranks_gpus_or_dp_give():
    # -1 is every rank the other degrees leave: asked for, never taken as one rank
    err = fails("memory", "--recipe", TITAN)
    assert "parallelism.data_parallel_shard_degree = -1" in err and "give --gpus N" in err
    one = memory("--recipe", TITAN, "--gpus", "1")  # one rank: no FSDP, bf16 autocast
    assert one["setup"]["engine"] == "ddp" and one["setup"]["mode"] == "amp"
    four = memory("--recipe", TITAN, "--gpus", "4")
    assert (four["setup"]["engine"], four["setup"]["dp"]) == ("fsdp2", 4)
    assert four == memory("--recipe", TITAN, "--dp", "4")


# torchtitan's flavors (torchtitan/models/llama3/__init__.py at e347b1e5):
# (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, vocab_size)
TITAN_ARGS = {"debugmodel": (256, 6, 16, None, None, 256, 2048),
              "8B": (4096, 32, 32, 8, 1.3, 1024, 128256),
              "70B": (8192, 80, 64, 8, 1.3, 4096, 128256),
              "405B": (16384, 126, 128, 8, 1.2, 4096, 128256)}


@pytest.mark.parametrize("flavor", TITAN_ARGS)
def test_torchtitan_flavors_as_torchtitan_sizes_them(flavor, tmp_path):
    dim, layers, heads, kv, mult, multiple, vocab = TITAN_ARGS[flavor]
    hidden = int(2 * 4 * dim / 3)  # torchtitan's FeedForward: 2/3 of 4 dim, scaled, rounded up
    if mult is not None:
        hidden = int(mult * hidden)
    hidden = multiple * ((hidden + multiple - 1) // multiple)
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nname = "llama3"\nflavor = "{flavor}"\n'
                    '[activation_checkpoint]\nmode = "full"\n')
    out = invoke("params", "--recipe", str(path), "--json")
    assert out.exit_code == 0, out.output
    cfg = json.loads(out.stdout)["config"]
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["vocab_size"]) == (
        dim, layers, heads, vocab)
    assert (cfg["n_kv_head"] or cfg["n_head"]) == (kv or heads)
    assert (cfg["d_ff"] or cfg["ffn_mult"] * cfg["n_embd"]) == hidden
    assert {f for n, f in torchtitan.FLAVORS if n == "llama3"} == set(TITAN_ARGS)


def test_megatron_pads_the_vocabulary_and_builds_gpt3():
    # Megatron-LM's _vocab_size_with_padding: GPT-2's 50257 up to a multiple of 128 x tp 8 =
    # 1024 is 51200; the model is GPT-3 175B (the preset, Brown et al. 2020 Table 2.1) with it
    params = json.loads(invoke("params", "--recipe", MEGATRON, "--json").stdout)
    preset = json.loads(invoke("params", "--preset", "gpt3-175b", "-V", "51200",
                               "--json").stdout)
    assert params["config"]["vocab_size"] == 51200 == math.ceil(50257 / 1024) * 1024
    assert params["total"] == preset["total"]
    text = (RECIPES / "megatron_gpt3_175b.args").read_text()
    one = text.replace("--tensor-model-parallel-size 8", "--tensor-model-parallel-size 1")
    assert _megatron_vocab(one) == "50304"  # 50257 up to a multiple of 128


def test_megatron_launch_script_reads_as_its_argument_file(tmp_path):
    # the shipped script (tests/recipes/shipped/Megatron-LM) names no tokenizer type: refused
    # on it; with the one the .args transcription adds, its arrays answer as that file does
    script = (ROOT / "tests/recipes/shipped/Megatron-LM/examples/gpt3/"
              "train_gpt3_175b_distributed.sh")
    assert "--tokenizer-type = None" in fails("memory", "--recipe", str(script))
    text = script.read_text().replace("DATA_ARGS=(\n", "DATA_ARGS=(\n    --tokenizer-type "
                                      "GPT2BPETokenizer\n")
    path = _write(tmp_path, "train.sh", text)
    assert memory("--recipe", path) == memory("--recipe", MEGATRON)


def _megatron_vocab(text: str) -> str:
    from gptcalc.recipes.megatron import read_megatron

    return str(read_megatron(text, Path("gpt.args"), {}).values["vocab_size"])


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


TITAN_MIN = ('[model]\nname = "llama3"\nflavor = "debugmodel"\n'
             '[activation_checkpoint]\nmode = "none"\n')
TUNE_MIN = "model:\n  _component_: torchtune.models.llama3_1.llama3_1_8b\n"
AXO_MIN = "base_model: {model}\nsequence_len: 512\n"
HF_MIN = '{{"model_name_or_path": "{model}", "per_device_train_batch_size": 1'
MEGA_MIN = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--vocab-size 1000\n")


TITAN_ONE = TITAN_MIN + "[parallelism]\ndata_parallel_shard_degree = 1\n"
TITAN_TWO = TITAN_MIN + "[parallelism]\ndata_parallel_shard_degree = 2\n"  # FSDP2, bf16 policy


@pytest.mark.parametrize("name, text, needle", [
    ("job.toml", TITAN_ONE + "[compile]\nenable = true\ncomponents = [\"loss\"]\n",
     "compile.components = ['loss']: a compiled loss beside an eager model is not modelled"),
    ("job.toml", TITAN_ONE.replace('flavor = "debugmodel"', 'flavor = "debugmodel"\n'
                                   'converters = ["mx"]'),
     "model.converters = ['mx']: converters other than float8"),
    ("job.toml", TITAN_ONE + "[training]\nenable_cpu_offload = true\n",
     "training.enable_cpu_offload = True: CPU offload is FSDP's"),
    ("job.toml", TITAN_ONE.replace("debugmodel", "13B"),
     "model.flavor: llama3 '13B' has no gptcalc preset; llama3's known flavors: debugmodel"),
    ("tune.yaml", TUNE_MIN + "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1bb\n",
     "model._component_: 'torchtune.models.llama3_2.llama3_2_1bb' has no gptcalc preset; "
     "did you mean llama3_2_1b?"),
    ("tune.yaml", TUNE_MIN.replace("llama3_1_8b", "gemma_2b"), "has no gptcalc preset"),
    ("axo.yml", AXO_MIN + "adapter: lora\nlora_target_linear: true\nlora_dropout: yes\n",
     "lora_dropout must be a probability in [0, 1), got True"),
    ("axo.yml", AXO_MIN + "load_in_8bit: true\n",
     "load_in_8bit = True: LLM.int8 weights are not modelled"),
    ("args.json", HF_MIN + ', "use_liger_kernel": true, "liger_kernel_config": '
     '{{"cross_entropy": true}}}}', "liger_kernel_config.cross_entropy = True: Liger's"),
    # the Trainer compiles the whole model; LoRA dropout under compile is not measured
    ("args.json", HF_MIN + ', "torch_compile": true, "use_peft": true, "lora_r": 8, '
     '"lora_dropout": 0.1}}',
     "lora_dropout -> --lora-dropout: --lora-dropout with --compile model is not modelled"),
    ("job.toml", TITAN_ONE + "[compile]\nenable = true\n",
     "compile.enable+components -> --compile: --compile model is modelled for --mode fp32, "
     "mixed or bf16"),
    ("args.json", HF_MIN + ', "fsdp": "full_shard", "fsdp_config": {{"version": 1}}}}',
     "fsdp_config.backward_prefetch = 'NO_PREFETCH': --engine fsdp1 is modelled with "
     "BACKWARD_PRE"),
    ("gpt.args", MEGA_MIN + "--num-experts 8\n", "--num-experts = '8': not modelled"),
])
def test_refusals_are_one_line_naming_the_key_and_the_file(tmp_path, llama31, name, text, needle):
    path = _write(tmp_path, name, text.format(model=llama31))
    err = fails("memory", "--recipe", path)
    # the file as typed, or, where the line would pass 200 characters, its folders elided
    assert needle in err and (path in err or f"/{Path(path).name}:" in err and "…" in err)


@pytest.mark.parametrize("name, text, key", [
    ("job.toml", TITAN_ONE + "[training]\nlocal_batchsize = 2\n", "training.local_batchsize"),
    ("tune.yaml", TUNE_MIN + "batchsize: 2\n", "batchsize"),
    ("axo.yml", AXO_MIN + "micro_batchsize: 2\n", "micro_batchsize"),
    ("args.json", HF_MIN + ', "per_device_batch": 2}}', "per_device_batch"),
    ("gpt.args", MEGA_MIN + "--hiden-size 64\n", "--hiden-size"),
])
def test_a_key_a_reader_does_not_know_is_listed_not_refused(tmp_path, llama31, name, text, key):
    path = _write(tmp_path, name, text.format(model=llama31))
    r = invoke("memory", "--recipe", path)
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("recipe:"))
    assert line.endswith(f"; unread: {key}")


@pytest.mark.parametrize("name, text, typed", [
    # torchtitan: compile.enable compiles each block, and the loss when components lists it
    ("job.toml", TITAN_TWO + "[compile]\nenable = true\n", ["--compile", "model"]),
    ("job.toml", TITAN_TWO + '[compile]\nenable = true\ncomponents = ["model"]\n',
     ["--compile", "blocks"]),
    # float8 converter: tensorwise unless recipe_name says rowwise; the output head stays bf16
    ("job.toml", TITAN_TWO.replace('flavor = "debugmodel"', 'flavor = "debugmodel"\n'
                                   'converters = ["float8"]')
     + '[quantize.linear.float8]\nfilter_fqns = ["output"]\n'
       'enable_fsdp_float8_all_gather = true\n', ["--float8", "tensorwise"]),
    ("job.toml", TITAN_TWO.replace('flavor = "debugmodel"', 'flavor = "debugmodel"\n'
                                   'converters = ["float8"]')
     + '[quantize.linear.float8]\nrecipe_name = "rowwise"\n', ["--float8", "rowwise"]),
    ("job.toml", TITAN_MIN + "[parallelism]\ndata_parallel_shard_degree = 2\n"
                             "context_parallel_degree = 2\n", ["--cp", "2"]),
    ("tune.yaml", TUNE_MIN + "enable_activation_offloading: true\n",
     ["--offload-activations"]),
    ("tune.yaml", TUNE_MIN + "compile: true\n", ["--compile", "model"]),
    # the Trainer's torch_compile compiles the whole transformers model, the loss inside;
    # axolotl hands its torch_compile to the Trainer
    ("args.json", HF_MIN + ', "torch_compile": true}}', ["--compile", "model"]),
    ("axo.yml", AXO_MIN + "torch_compile: true\n", ["--compile", "model"]),
    ("tune.yaml", TUNE_MIN + "loss:\n  _component_: torchtune.modules.loss."
                             "LinearCrossEntropyLoss\n", ["--loss", "chunked"]),
    ("args.json", HF_MIN + ', "optim": "paged_adamw_8bit"}}', ["--optimizer", "paged_adamw8bit"]),
])
def test_a_feature_the_recipe_turns_on_is_its_option(tmp_path, llama31, name, text, typed):
    path = _write(tmp_path, name, text.format(model=llama31))
    hub = ["--hf-config", llama31] if name == "args.json" else []
    with_it = memory("--recipe", path, *hub)
    assert with_it == memory("--recipe", path, *hub, *typed)
    base = text.split("\n[compile]")[0] if "[compile]" in text else None
    if base is not None:  # and the feature changes the answer
        assert with_it != memory("--recipe", _write(tmp_path, "plain.toml", base))


def test_a_refusal_an_option_can_settle(tmp_path):
    # debug_model.toml checkpoints every second block, which is not modelled: --recompute
    # counts another policy in its place, and the pipeline schedule is read only with pp > 1
    err = fails("memory", "--recipe", TITAN_DEBUG, "--gpus", "1")
    assert "selective_ac_option = '2': every n-th block checkpointed is not modelled" in err
    assert "give --recompute" in err
    assert memory("--recipe", TITAN_DEBUG, "--gpus", "1", "--recompute", "full")["setup"][
        "recompute"] == "full"
    axolotl = RECIPES / "axolotl_llama3_qlora.yml"
    shipped = axolotl.read_text().replace("optimizer: paged_adamw_8bit",
                                          "optimizer: paged_adamw_32bit")
    path = _write(tmp_path, "qlora.yml", shipped)
    from gptcalc.training_setup import OPTIMIZERS

    if "paged_adamw" in OPTIMIZERS:  # bitsandbytes' PagedAdamW, 32-bit states
        assert memory("--recipe", path) == memory("--recipe", AXOLOTL, "--optimizer",
                                                  "paged_adamw")
    else:  # not among gptcalc's optimizers
        assert "optimizer = 'paged_adamw_32bit': this optimizer is not modelled" in fails(
            "memory", "--recipe", path)


def test_recipe_and_config_together_is_one_line(tmp_path):
    config = _write(tmp_path, "c.toml", '[model]\npreset = "debug"\n')
    assert "--recipe or --config" in fails("memory", "--recipe", TITAN, "--config", config)


def test_a_hub_id_the_recipe_names_is_read_through_the_cache(tmp_path):
    from .test_hf_hub import LLAMA31_8B, gptcalc, hub_cache

    # a Hub id with no preset of its sizes (a known one answers as its preset, offline)
    recipe = _write(tmp_path, "qlora.yml", Path(AXOLOTL).read_text().replace(
        "NousResearch/Meta-Llama-3-8B", "my-org/llama-3-8b-finetune"))
    home = hub_cache(tmp_path / "hf", "my-org/llama-3-8b-finetune", LLAMA31_8B)
    r = gptcalc("memory", "--recipe", recipe, "--json", home=home)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["config"]["n_kv_head"] == 8 and out["setup"]["lora_rank"] == 32
    assert out["recipe"]["kind"] == "axolotl"


def test_the_trainer_table_is_transformers_own_fields():
    # every field of transformers' TrainingArguments is read or ignored with its reason
    # (training_args.py read as text: importing transformers takes seconds), and every key of
    # the table is one of them or a name older releases used
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    tree = ast.parse((Path(spec.origin).parent / "training_args.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               and n.name == "TrainingArguments")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    older = {"evaluation_strategy", "overwrite_output_dir", "save_safetensors", "logging_dir",
             "hub_private", "warmup_ratio", "group_by_length"}
    table = set(hf_trainer.TRAINER_KEYS)
    assert fields - table == set()
    assert table - fields - older == set()


def test_the_torchtitan_table_is_its_job_config():
    # JobConfig's fields at e347b1e5 (tests/recipes/torchtitan_job_config_fields.txt, listed
    # from torchtitan/config/job_config.py's dataclasses): each has an entry in the table
    from gptcalc.recipes.base import entry

    lines = (RECIPES / "torchtitan_job_config_fields.txt").read_text().splitlines()
    fields = [x for x in lines if x and not x.startswith("#")]
    assert len(fields) > 100
    assert [f for f in fields if entry(torchtitan.KEYS, f) is None] == []


def test_reading_a_recipe_imports_yaml_only_for_yaml():
    code = ("import sys; from gptcalc.recipes import read_recipe; "
            f"read_recipe({TITAN!r}, {{'gpus': 8}}); assert 'yaml' not in sys.modules, 'yaml'; "
            f"read_recipe({TUNE!r}); assert 'yaml' in sys.modules; "
            "assert 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr


def test_the_fixtures_read_every_kind():
    kinds = {read_recipe(p, {"dp": 8}).kind for p in (TITAN, TUNE, AXOLOTL, HF, MEGATRON)}
    assert kinds == {"torchtitan", "torchtune", "axolotl", "Hugging Face TrainingArguments",
                     "Megatron-LM"}


@pytest.mark.parametrize("name, text, needle", [
    ("bomb.yaml", "a: &a {x: 1, y: 2}\nb: {p: *a, q: *a}\nmodel: {_component_: *a}\n",
     "YAML aliases"),
    ("deep.yaml", "base_model: x\nk: " + "[" * 200 + "]" * 200 + "\n", "nests deeper"),
    ("bad.yaml", "base_model: [\n", "not valid YAML"),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ("odd.yaml", "name: x\n", "not a recipe gptcalc reads"),
    ("bad.toml", "[model\n", "not valid TOML"),
    ("bad.json", "{", "not valid JSON"),
    ("gpt.args", "--num-layers 'two\n", "not an argument list"),
    ("gpt.args", "num-layers 2\n", "expected a --flag"),
])
def test_broken_files_are_one_line(tmp_path, name, text, needle):
    assert needle in fails("memory", "--recipe", _write(tmp_path, name, text))


def test_not_a_file_is_one_line(tmp_path):
    assert "is not a regular file" in fails("memory", "--recipe", str(tmp_path))
    assert "no such file" in fails("memory", "--recipe", str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("parallelism, engine, mode", [
    # torchtitan's maybe_enable_amp: autocast on one device or DDP, fully_shard's policy under
    # FSDP, no mixed precision at all with tp or pp but no FSDP
    ("data_parallel_shard_degree = 1", "ddp", "amp"),
    ("data_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 2", "ddp", "amp"),
    ("data_parallel_shard_degree = 2", "fsdp2", "mixed"),
    ("data_parallel_shard_degree = 1\ntensor_parallel_degree = 2", "ddp", "fp32"),
    ("data_parallel_shard_degree = 2\ntensor_parallel_degree = 2", "fsdp2", "mixed"),
])
def test_torchtitan_precision_follows_its_parallelism(tmp_path, parallelism, engine, mode):
    path = _write(tmp_path, "job.toml", TITAN_MIN + "[parallelism]\n" + parallelism + "\n")
    setup = memory("--recipe", path)["setup"]
    assert (setup["engine"], setup["mode"]) == (engine, mode)


def test_the_trainer_hands_deepspeed_and_fsdp_on(tmp_path, llama31):
    # a ds_config beside the recipe (its "auto" bf16 from the Trainer's bf16: mode mixed), and
    # FSDP2 full_shard (reshard after forward: ZeRO-3) with its bf16 MixedPrecisionPolicy
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                  "bf16": {"enabled": "auto"}}))
    ds = _write(tmp_path, "ds_args.json", json.dumps({
        "model_name_or_path": llama31, "bf16": True, "deepspeed": "ds.json",
        "per_device_train_batch_size": 1}))
    setup = memory("--recipe", ds, "--dp", "4")["setup"]
    assert (setup["engine"], setup["zero"], setup["mode"]) == ("deepspeed", 2, "mixed")
    fsdp = _write(tmp_path, "fsdp_args.json", json.dumps({
        "model_name_or_path": llama31, "bf16": True, "fsdp": "full_shard auto_wrap",
        "per_device_train_batch_size": 1}))
    setup = memory("--recipe", fsdp, "--dp", "4")["setup"]
    assert (setup["engine"], setup["zero"], setup["mode"]) == ("fsdp2", 3, "mixed")


@pytest.mark.parametrize("recipe", [TUNE, MEGATRON])
def test_save_config_keeps_what_the_recipe_set(recipe, tmp_path):
    saved = str(tmp_path / "effective.toml")
    assert memory("--recipe", recipe, "--save-config", saved)["peak"] == memory(
        "--config", saved)["peak"]


def test_a_trl_yaml_takes_sftconfigs_own_defaults(tmp_path):
    # trl/trainer/sft_config.py and base_config.py (huggingface/trl at f2cd5771): max_length
    # 1024, gradient_checkpointing True, bf16 True unless fp16; ModelConfig's dtype float32 and
    # lora_r 16, lora_dropout 0.05 under use_peft
    path = _write(tmp_path, "sft.yaml", "model_name_or_path: Qwen/Qwen2.5-0.5B\n")
    typed = ["--preset", "qwen2.5-0.5b", "--impl", "transformers", "-B", "8", "--mode", "amp",
             "--recompute", "full", "--seq-len", "1024", "--no-keep-logits"]
    assert memory("--recipe", path) == memory(*typed)
    fp16 = _write(tmp_path, "fp16.yaml", "model_name_or_path: Qwen/Qwen2.5-0.5B\nfp16: true\n"
                                         "gradient_checkpointing: false\nmax_length: 512\n")
    assert memory("--recipe", fp16) == memory(*typed[:-7], "--autocast-dtype", "fp16",
                                              "--recompute", "none", "--seq-len", "512",
                                              "--no-keep-logits")
    peft = _write(tmp_path, "peft.yaml", "model_name_or_path: Qwen/Qwen2.5-0.5B\nuse_peft: true\n")
    # ModelConfig's lora_dropout 0.05, named on the recipe line as TRL's default
    assert memory("--recipe", peft) == memory(*typed, "--lora-rank", "16", "--lora-dropout",
                                              "0.05")
    r = CliRunner().invoke(cli, ["memory", "--recipe", peft])
    assert "lora_dropout (TRL's default) -> --lora-dropout 0.05" in r.output
    peft0 = _write(tmp_path, "peft0.yaml", "model_name_or_path: Qwen/Qwen2.5-0.5B\n"
                                           "use_peft: true\nlora_dropout: 0\n")
    assert memory("--recipe", peft0) == memory(*typed, "--lora-rank", "16")


@pytest.mark.parametrize("name, text, key", [
    ("sft.yaml", "model_name_or_path: Qwen/Qwen2.5-0.5B\nuse_peft: true\nuse_dora: true\n",
     "use_dora"),
    ("axolotl.yml", "base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 8\n"
     "lora_target_linear: true\npeft_use_dora: true\nbf16: auto\n", "peft_use_dora"),
    ("lf.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\n"
     "finetuning_type: lora\nuse_dora: true\n", "use_dora"),
])
def test_dora_is_read_and_refused_naming_its_key(tmp_path, name, text, key):
    # DoRA is read as --dora; where it is not modelled (the Trainer's bf16 autocast, or
    # gradient checkpointing) the one line names the file, the key and the option
    line = fails("memory", "--recipe", _write(tmp_path, name, text))
    assert f"{key} -> --dora: --dora with " in line and name in line, line


def test_dora_read_from_torchtune_answers_where_modelled(tmp_path):
    # torchtune's model.use_dora and model.lora_dropout as --dora and --lora-dropout: the
    # reference implementation is refused for both, naming the key
    text = ("model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n"
            "  lora_attn_modules: [q_proj, v_proj]\n  lora_rank: 8\n  use_dora: true\n")
    line = fails("memory", "--recipe", _write(tmp_path, "tt.yaml", text))
    assert "model.use_dora -> --dora: " in line, line
    text = text.replace("use_dora: true", "lora_dropout: 0.1")
    line = fails("memory", "--recipe", _write(tmp_path, "tt2.yaml", text))
    assert "model.lora_dropout -> --lora-dropout: " in line, line


def test_lora_dropout_must_be_a_probability(tmp_path):
    text = ("base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 8\n"
            "lora_target_linear: true\nlora_dropout: 1.5\n")
    line = fails("memory", "--recipe", _write(tmp_path, "a.yml", text))
    assert "lora_dropout must be a probability" in line and "a.yml" in line
