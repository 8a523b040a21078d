"""--config / --save-config and the Python API: round trips, precedence, stored sections, errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import event, example, given, settings, strategies as st

import gptcalc
from gptcalc import ConfigError, GPTConfig, Workload
from gptcalc.cli import cli
from gptcalc.configfile import parse_config, read_config_file

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def ok(*args: str) -> str:
    r = invoke(*args)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def fails(*args: str) -> str:
    r = invoke(*args)
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.output
    return r.stderr


# --- round trip: what --save-config writes, --config reads back to byte-identical output ---------

# (command, model options, command-only options that are not part of the saved model)
ROUND_TRIPS = [
    ("params", (), ()),
    ("params", ("--preset", "gpt2"), ()),
    ("params", ("--preset", "llama3-8b", "--set", "tie_embeddings=true", "--d-ff", "1000"), ()),
    ("flops", ("--preset", "debug", "--arch", "llama", "-B", "3", "--seq-len", "8"), ()),
    ("flops", ("--preset", "shakespeare-char", "--arch", "notes", "--set", "qkv_layout=separate",
               "--set", "head_dim=32", "--n-kv-head", "2",
               "--dropout", "0.1"), ("--causal",)),
    ("flops", ("--preset", "gpt3-xl", "--set", "rotary_pct=0.5", "--set", "pos_embedding=rotary",
               "--set", "parallel_residual=on"), ("--recompute", "selective")),
]


@pytest.mark.parametrize("fmt", ["toml", "json"])
@pytest.mark.parametrize("command,model,extra", ROUND_TRIPS,
                         ids=[" ".join((c, *m, *e)) for c, m, e in ROUND_TRIPS])
def test_save_then_load_gives_identical_output(command, model, extra, fmt, tmp_path):
    saved = tmp_path / f"effective.{fmt}"
    first = ok(command, *model, *extra, "--json", "--save-config", str(saved))
    assert ok(command, "--config", str(saved), *extra, "--json") == first


def test_saved_file_is_complete_over_any_preset(tmp_path):
    saved = tmp_path / "s.toml"
    first = ok("params", "--preset", "llama3-8b", "--json", "--save-config", str(saved))
    # a different preset underneath: the file sets every field, so nothing of gpt2 leaks through
    assert ok("params", "--preset", "gpt2", "--config", str(saved), "--json") == first


@st.composite
def configs(draw):
    H = draw(st.integers(1, 4))
    hd = draw(st.sampled_from([2, 4, 8]))
    fields = dict(
        n_head=H, n_embd=H * hd, n_layer=draw(st.integers(1, 3)),
        vocab_size=draw(st.integers(1, 128)), block_size=draw(st.integers(1, 16)),
        n_kv_head=draw(st.none() | st.sampled_from([k for k in range(1, H + 1) if H % k == 0])),
        head_dim=draw(st.none() | st.sampled_from([2, 4])),
        d_ff=draw(st.none() | st.integers(1, 64)), ffn_mult=draw(st.integers(1, 4)),
        dropout=draw(st.sampled_from([0.0, 0.1, 0.25, 1 / 3])),
        qkv_layout=draw(st.sampled_from(["fused", "separate"])),
        pos_embedding=draw(st.sampled_from(["learned", "sinusoidal", "rotary", "none"])),
        norm=draw(st.sampled_from(["layernorm", "layernorm_nobias", "rmsnorm"])),
        mlp=draw(st.sampled_from(["relu", "gelu", "gelu_tanh", "swiglu"])),
        rotary_pct=draw(st.sampled_from([1.0, 0.5])),
    )
    for name in ("qkv_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "tie_embeddings",
                 "final_norm", "embd_dropout", "parallel_residual"):
        fields[name] = draw(st.booleans())
    try:
        cfg = GPTConfig(**fields)
    except ConfigError:
        cfg = GPTConfig(**{**fields, "pos_embedding": "learned"})
    return cfg


@settings(max_examples=60, deadline=None)
@given(cfg=configs(), batch=st.integers(1, 64), fmt=st.sampled_from(["toml", "json"]),
       data=st.data())
def test_api_round_trip_any_config(cfg, batch, fmt, data, tmp_path_factory):
    wl = Workload(batch, data.draw(st.integers(1, cfg.block_size)))
    path = tmp_path_factory.mktemp("rt") / f"c.{fmt}"
    sections = {"training": {"dtype": "bf16", "zero_stage": 2, "lr": 3e-4,
                             "optimizer": {"name": "adamw", "betas": [0.9, 0.95]}}}
    gptcalc.save_config(path, cfg, wl, sections)
    setup = gptcalc.resolve_setup(config=path)
    assert (setup.config, setup.workload) == (cfg, wl)
    assert setup.sections == sections


# --- precedence: preset < hf-config < config file < explicit options ---------------------------


def test_precedence(tmp_path):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "intermediate_size": 128,
                              "vocab_size": 100, "max_position_embeddings": 32}))
    conf = tmp_path / "c.toml"
    conf.write_text("[model]\nn_layer = 3\nvocab_size = 90\n[workload]\nbatch_size = 5\n")
    # hf over preset: hf sizes, hf switches
    cfg, wl = gptcalc.load(preset="gpt2", hf_config=hf)
    assert (cfg.n_embd, cfg.n_layer, cfg.norm, wl.batch_size) == (64, 4, "rmsnorm", 1)
    # config file over hf
    cfg, wl = gptcalc.load(hf_config=hf, config=conf)
    assert (cfg.n_layer, cfg.vocab_size, cfg.n_embd, wl.batch_size) == (3, 90, 64, 5)
    # explicit over config file
    cfg, wl = gptcalc.load(hf_config=hf, config=conf, n_layer=2, batch_size=7)
    assert (cfg.n_layer, cfg.vocab_size, wl.batch_size) == (2, 90, 7)
    # and the same through the CLI
    out = json.loads(ok("params", "--hf-config", str(hf), "--config", str(conf), "-L", "2",
                        "--json"))
    assert (out["config"]["n_layer"], out["config"]["vocab_size"]) == (2, 90)


def test_config_file_names_preset_arch_and_relative_hf_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 97,
         "n_positions": 16}))
    conf = tmp_path / "c.toml"
    conf.write_text('hf_config = "m"\nbatch_size = 2\n')
    cfg, wl = gptcalc.load(config=conf)
    assert (cfg.n_embd, cfg.block_size, wl.batch_size) == (32, 16, 2)
    conf.write_text('[model]\npreset = "gpt2"\narch = "llama"\n')
    cfg, _ = gptcalc.load(config=conf)
    assert (cfg.n_embd, cfg.norm) == (768, "rmsnorm")
    # an explicit preset wins over the file's
    cfg, _ = gptcalc.load(config=conf, preset="debug")
    assert (cfg.n_embd, cfg.norm) == (32, "rmsnorm")


def test_training_section_is_stored_and_written_back(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('[model]\nn_layer = 2\n[training]\ndtype = "bf16"\nzero_stage = 3\n'
                    '[training.optimizer]\nname = "adamw"\n[parallel]\ntp = 2\n')
    setup = gptcalc.resolve_setup(config=conf)
    assert setup.sections == {"training": {"dtype": "bf16", "zero_stage": 3,
                                           "optimizer": {"name": "adamw"}},
                              "parallel": {"tp": 2}}
    out = tmp_path / "out.toml"
    ok("params", "--config", str(conf), "--save-config", str(out))
    assert read_config_file(out).sections == setup.sections


# --- file errors: one line, naming --config ----------------------------------------------------


@pytest.mark.parametrize("name,text,needle", [
    ("a.toml", "n_layer = = 3", "not valid TOML"),
    ("a.json", "{", "not valid JSON"),
    ("a.json", "[]", "must hold a table"),
    ("a.toml", "[model]\nn_layers = 3", "unknown key [model] 'n_layers'"),
    ("a.toml", "n_layer = 'x'", "n_layer must be an integer"),
    ("a.toml", "n_layer = 0", "n_layer must be positive"),
    ("a.toml", "qkv_bias = 'maybe'", "qkv_bias must be true or false"),
    ("a.toml", "dropout = nan", "dropout must be in [0, 1)"),
    ("a.toml", "[workload]\nbatch_size = -1", "batch_size must be a positive integer"),
    ("a.toml", "[workload]\nbs = 1", "unknown key [workload] 'bs'"),
    ("a.toml", "[optimiser]\nlr = 1", "unknown section [optimiser]"),
    ("a.toml", "training = 3", "training must be a table"),
    ("a.toml", "n_layer = 2\n[model]\nn_layer = 3", "n_layer is set twice"),
    ("a.toml", "[model]\narch = 'bert'", "unknown arch 'bert'"),
    ("a.toml", "[model]\nn_head = 5", "does not divide"),
    ("a.toml", "[workload]\nseq_len = 100000", "exceeds block_size"),
])
def test_bad_config_files(name, text, needle, tmp_path):
    path = tmp_path / name
    path.write_text(text)
    err = fails("params", "--config", str(path))
    assert err.startswith("Error: --config:"), err
    assert needle in err, err


def test_unreadable_and_missing_config(tmp_path):
    assert "no such file" in fails("flops", "--config", str(tmp_path / "nope.toml"))
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\xfa")
    assert "not UTF-8" in fails("flops", "--config", str(tmp_path / "bin.toml"))
    assert "not a regular file" in fails("flops", "--config", str(tmp_path))  # a directory


def test_save_config_errors(tmp_path):
    assert fails("params", "--save-config", str(tmp_path / "x.yaml")).startswith(
        "Error: --save-config:")
    assert "cannot write" in fails("params", "--save-config", str(tmp_path / "no" / "x.toml"))


# --- the Python API ----------------------------------------------------------------------------


def test_api_load_and_summarize_are_plain_dataclasses():
    cfg, wl = gptcalc.load(preset="gpt2", batch_size=8, seq_len=512, n_layer=6)
    assert (cfg.n_layer, wl.batch_size, wl.seq_len) == (6, 8, 512)
    s = gptcalc.summarize(cfg, wl)
    d = gptcalc.to_dict(s)
    assert d["params"]["total"] == s.params.total
    json.dumps(d)  # plain data all the way down


def test_api_errors_are_config_errors():
    with pytest.raises(ConfigError) as e:
        gptcalc.load(preset="gpt2", n_embd=0)
    assert e.value.field == "n_embd"
    with pytest.raises(ConfigError) as e:
        gptcalc.load(no_such_field=1)
    assert e.value.field == "no_such_field"
    with pytest.raises(ConfigError):
        gptcalc.load(preset="nope")


def test_import_gptcalc_stays_light():
    code = ("import sys, gptcalc, gptcalc.cli; "
            "print(sorted(m for m in ('torch', 'fvcore', 'matplotlib', 'transformers') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_parse_config_accepts_auto_and_null():
    for doc in ({"model": {"n_kv_head": "auto"}}, {"n_kv_head": None}):
        assert parse_config(doc).model == {"n_kv_head": None}
    assert dataclasses.asdict(gptcalc.load(n_kv_head="auto", preset="gpt2")[0])["n_kv_head"] is None


# --- the memory command's training and parallel settings live in [training] and [parallel] ---

MEMORY_SETTINGS = ("--mode", "mixed", "--optimizer", "sgd-momentum", "--recompute", "selective",
                   "--attn", "sdpa", "--zero", "2", "--dp", "2", "--tp", "2", "--sp")


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_memory_settings_round_trip_through_the_file(fmt, tmp_path):
    saved = tmp_path / f"memory.{fmt}"
    first = ok("memory", "--preset", "gpt2", "-B", "4", *MEMORY_SETTINGS, "--json",
               "--save-config", str(saved))
    assert json.loads(first)["setup"]["zero"] == 2
    # nothing but the file: the same setup, the same bytes
    assert ok("memory", "--config", str(saved), "--json") == first
    # an explicit option still wins over the file
    assert json.loads(ok("memory", "--config", str(saved), "--zero", "0", "--json")
                      )["setup"]["zero"] == 0


@pytest.mark.parametrize("table,line,word", [
    ("training", 'mode = "fp64"', "[training] mode"),
    ("training", 'modee = "fp32"', "unknown keys modee"),
    ("parallel", "zero = 7", "[parallel] ZeRO stage"),
])
def test_bad_memory_settings_in_a_file_name_the_file(table, line, word, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(f"[{table}]\n{line}\n")
    err = fails("memory", "--config", str(path))
    assert "--config" in err and word in err


# --- every option that changes the memory answer is saved ------------------------------------

DS_CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                   "stage3_prefetch_bucket_size": 1000,
                                   "stage3_param_persistence_threshold": 10},
             "bf16": {"enabled": True}}


@pytest.mark.parametrize("fmt", ["toml", "json"])
@pytest.mark.parametrize("options", [
    ("--zero", "2", "--offload-optimizer", "cpu"),
    ("--zero", "3", "--offload-param", "cpu", "--offload-optimizer", "cpu"),
    ("--zero", "3", "--offload-param", "nvme", "--offload-optimizer", "nvme"),
    ("--deepspeed-config", "DS", "--dp", "4"),
])
def test_memory_s_engine_settings_survive_a_round_trip(options, fmt, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(DS_CONFIG))
    options = [str(ds) if o == "DS" else o for o in options]
    saved = tmp_path / f"run.{fmt}"
    first = json.loads(ok("memory", "--preset", "gpt2", *options, "--json", "--save-config",
                          str(saved)))
    again = json.loads(ok("memory", "--config", str(saved), "--json"))
    assert again["peak"] == first["peak"] and again["setup"] == first["setup"]
    assert again["breakdown"] == first["breakdown"]


def test_an_offload_device_in_a_config_file_is_checked(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "gpt2"\n[parallel]\nzero = 3\noffload_param = "gpu"\n')
    r = CliRunner().invoke(cli, ["memory", "--config", str(path)])
    assert r.exit_code == 2 and r.stderr.startswith("Error: --config: ")
    assert "offload_param" in r.stderr


# --- any set of memory's options: --save-config then --config gives the same answer -----------

# each option that changes memory's answer, with values that exercise it (a set-up the rules
# refuse is skipped: it has no answer to save)
MEMORY_OPTIONS = {
    "--mode": ["fp32", "amp", "mixed", "bf16"],
    "--optimizer": ["adamw", "sgd-momentum", "adamw8bit", "lion", "adafactor"],
    "--autocast-dtype": ["bf16", "fp16"],
    "--recompute": ["none", "selective", "op", "full"],
    "--attn": ["sdpa", "manual"],
    "--impl": ["reference", "paper", "megatron-core"],
    "--loss": ["standard", "chunked", "fused"],
    "--loss-chunks": ["4", "16"],
    "--keep-logits": [], "--no-keep-logits": [],
    "--optimizer-in-backward": [],
    "--allocator": ["default", "expandable"],
    "--compile": ["none", "blocks", "model"],
    "--float8": ["none", "tensorwise", "rowwise"],
    "--offload-activations": [],
    "--overhead": ["1GiB", "123456"],
    "--zero": ["0", "1", "2", "3"],
    "--engine": ["ddp", "deepspeed", "fsdp2", "megatron", "zero-redundancy"],
    "--offload-optimizer": ["cpu", "nvme"],
    "--offload-param": ["cpu"],
    "--no-distributed-optimizer": [],
    "--dp": ["2", "4"],
    "--tp": ["2"],
    "--pp": ["2", "4"],
    "--pp-schedule": ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"],
    "--pp-virtual": ["2"],
    "--sp": [],
    "--cp": ["2"],
    "--lora-rank": ["8"],
    "--lora-targets": ["q,v", "all"],
    "--weights-dtype": ["nf4", "int4"],
    "--bnb-version": ["0.43.1"],
    "--device": ["cuda", "cpu"],
    "-B": ["1", "3"],
    "--grad-accum": ["2", "4"],
    "--seq-len": ["256", "1000"],
    "-L": ["4", "6"],
    "--set": ["norm=rmsnorm", "n_kv_head=4", "mlp=swiglu"],
}


@st.composite
def memory_options(draw) -> list[str]:
    names = draw(st.sets(st.sampled_from(sorted(MEMORY_OPTIONS)), min_size=1, max_size=5))
    out: list[str] = []
    for name in names:
        values = MEMORY_OPTIONS[name]
        out += [name] + ([draw(st.sampled_from(values))] if values else [])
    return out


# what a command asks of the configuration rather than part of it, the command line's only
# (schema's _DEVICE options; --context, the inference run whose KV cache is sized): given again
QUESTIONS = st.sampled_from([(), ("--gpu", "h100-sxm"), ("--gpu-memory", "2GiB"),
                             ("--context", "512"), ("--gpus-per-node", "4")])


@settings(max_examples=80, deadline=None)
# a budget nothing fits: the advice resolves the set-up again with --zero 3 (found by the draw)
@example(options=["--device", "cpu"], fmt="toml", asked=("--gpu-memory", "2GiB"))
@given(options=memory_options(), fmt=st.sampled_from(["toml", "json"]), asked=QUESTIONS)
def test_any_memory_options_survive_save_config_then_config(options, fmt, asked,
                                                             tmp_path_factory):
    saved = tmp_path_factory.mktemp("saved") / f"run.{fmt}"
    first = invoke("memory", "--preset", "gpt2", *options, *asked, "--json",
                   "--save-config", str(saved))
    event("refused" if first.exit_code == 2 else "answered")
    if first.exit_code == 2:  # refused: no answer to save
        return
    assert first.exit_code == 0, first.output
    again = invoke("memory", "--config", str(saved), *asked, "--json")
    assert again.exit_code == 0, (options, saved.read_text(), again.output)
    assert again.stdout == first.stdout, (options, saved.read_text())


@pytest.mark.parametrize("saved_with, then", [
    ((), ("--zero", "3", "--dp", "8")),          # the engine follows the ZeRO stage
    (("--zero", "2", "--dp", "2"), ("--zero", "0")),  # and the precision the engine
])
def test_a_saved_file_with_other_options_answers_as_those_options_typed(saved_with, then,
                                                                         tmp_path):
    saved = tmp_path / "run.toml"
    ok("memory", "--preset", "gpt2", *saved_with, "--save-config", str(saved))
    typed = json.loads(ok("memory", "--preset", "gpt2", *saved_with, *then, "--json"))
    again = json.loads(ok("memory", "--config", str(saved), *then, "--json"))
    assert again["setup"] == typed["setup"] and again["peak"] == typed["peak"]
