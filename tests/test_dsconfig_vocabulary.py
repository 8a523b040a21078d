"""The ds_config vocabulary: every top-level key DeepSpeed reads is read, knowingly ignored or
refused (the list taken at test time from the installed DeepSpeed), and the two
activation_checkpointing keys that place checkpoints against deepspeed.checkpointing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gptcalc import GPTConfig, TrainingSetup, Workload, from_name
from gptcalc.dsconfig import (IGNORED_KEYS, KNOWN_KEYS, MASTER_DTYPE_KEYS, READ_KEYS,
                              REFUSED_KEYS, REMOVED_KEYS, ds_config_dict, ds_settings)
from gptcalc.errors import ConfigError
from gptcalc.memory.activations import checkpoints_on_host, device_activations

ROOT = Path(__file__).resolve().parents[1]
GPT2 = from_name("gpt2")
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2}}
# a value that turns each refused section's feature on (its "enabled", compile's deepcompile,
# AutoTP's size, data_types' own dtypes, the pipeline engine's settings)
ON = {"compile": {"deepcompile": True}, "tensor_parallel": {"autotp_size": 2},
      "data_types": {"grad_accum_dtype": "fp32"}, "pipeline": {"stages": 2},
      "weight_quantization": {"quantized_initialization": {"num_bits": 8}}}
OFF = {"compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1},
       "data_types": {"grad_accum_dtype": None}, "pipeline": {}, "weight_quantization": {}}


def deepspeed_top_level_keys() -> set[str]:
    """The top-level keys DeepSpeed reads from a ds_config: DeepSpeedConfig built over a dict
    that records every key looked up in it, and the removed keys it refuses."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import config as dsc

    seen: set[str] = set()

    class Recorded(dict):
        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def get(self, k, *default):
            seen.add(k)
            return super().get(k, *default)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def keys(self):
            class Keys(set):
                def __contains__(self, k):
                    seen.add(k)
                    return set.__contains__(self, k)
            return Keys(super().keys())

    dsc.DeepSpeedConfig(Recorded({"train_micro_batch_size_per_gpu": 1,
                                  "gradient_accumulation_steps": 1}))
    return seen | set(dsc._REMOVED_TOP_LEVEL_CONFIG_KEYS)


@pytest.fixture(scope="module")
def ds_keys() -> set[str]:
    return deepspeed_top_level_keys()


def test_every_key_deepspeed_reads_is_read_ignored_or_refused(ds_keys):
    # a key DeepSpeed starts reading fails here until gptcalc classifies it; a key DeepSpeed
    # stops reading fails too
    assert len(KNOWN_KEYS) == len(set(KNOWN_KEYS))
    assert ds_keys == set(KNOWN_KEYS), (sorted(ds_keys - set(KNOWN_KEYS)),
                                        sorted(set(KNOWN_KEYS) - ds_keys))


def test_removed_keys_are_deepspeeds_own(ds_keys):
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    assert set(REMOVED_KEYS) == set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)


def test_each_key_is_read_ignored_or_refused_by_the_reader(ds_keys):
    baseline = ds_settings(BASE, GPT2)
    for key in sorted(ds_keys):
        if key in READ_KEYS:
            continue
        on = ON.get(key, {"enabled": True})
        if key in IGNORED_KEYS:  # whatever it holds, the settings do not change
            assert ds_settings({**BASE, key: on}, GPT2) == baseline, key
            assert IGNORED_KEYS[key], key  # its reason
            continue
        with pytest.raises(ConfigError) as e:
            ds_settings({**BASE, key: on}, GPT2)
        assert e.value.field == "deepspeed_config" and e.value.message.startswith(key), key
        if key in REFUSED_KEYS:  # off, it changes nothing
            off = OFF.get(key, {"enabled": False})
            assert ds_settings({**BASE, key: off}, GPT2) == baseline, key


def test_deepspeed_refuses_the_removed_keys_too():
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    for key in REMOVED_KEYS:
        with pytest.raises(DeepSpeedConfigError):
            DeepSpeedConfig({**BASE, key: {"enabled": True}})


@pytest.mark.parametrize("raw", [
    {"bfloat16": {"enabled": True}},
    {"bf16": {"enabled": True}, "bfloat16": {"enabled": False}},
    {"bf16": {"enabled": False}, "bfloat16": {"enabled": True}},
])
def test_bfloat16_is_bf16s_old_name_read_as_deepspeed_reads_it(raw):
    from deepspeed.runtime.config import DeepSpeedConfig

    enabled = DeepSpeedConfig({**BASE, **raw}).bfloat16_config.enabled
    out = ds_settings({**BASE, **raw}, GPT2)
    assert (out["mode"], out.get("autocast_dtype")) == (("mixed", "bf16") if enabled else
                                                       ("fp32", None))


@pytest.mark.parametrize("section, key", [("bf16", k) for k in MASTER_DTYPE_KEYS[:2]]
                         + [("fp16", MASTER_DTYPE_KEYS[2])])
def test_16bit_master_states_are_refused(section, key):
    with pytest.raises(ConfigError, match=key):
        ds_settings({**BASE, section: {"enabled": True, key: True}}, GPT2)


def test_activation_checkpointing_is_read():
    out = ds_settings({**BASE, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": False, "profile": False}}, GPT2)
    assert ("partition_activations", True) in out["deepspeed_zero"]
    assert ("cpu_checkpointing", True) in out["deepspeed_zero"]
    for bad in ({"contiguous_memory_optimization": True}, {"partition": True},
                {"cpu_checkpointing": "yes"}):
        with pytest.raises(ConfigError, match="activation_checkpointing"):
            ds_settings({**BASE, "activation_checkpointing": bad}, GPT2)


def test_the_written_ds_config_keeps_the_checkpoint_settings():
    setup = TrainingSetup(engine="deepspeed", zero=2, recompute="full",
                          engine_settings=(("cpu_checkpointing", True),))
    written = ds_config_dict(setup, Workload(2, 8))
    assert written["activation_checkpointing"] == {"cpu_checkpointing": True}
    assert "cpu_checkpointing" not in written["zero_optimization"]
    assert ds_settings(written, GPT2)["deepspeed_zero"] == (("cpu_checkpointing", True),)


# one rank of deepspeed.checkpointing over the reference model's blocks, DeepSpeed's CPU
# accelerator (tp 1: a partition is the whole checkpoint)
CHECKPOINT_CASES = [
    (dict(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=40), 2, 8, "bf16"),
    (dict(n_layer=3, n_head=4, n_embd=32, block_size=12, vocab_size=50), 1, 12, "fp32"),
]


@pytest.mark.slow
def test_checkpoints_are_placed_as_deepspeed_checkpointing_places_them():
    specs = [dict(config=c, batch=b, seq_len=s, mode=m, partition=True, cpu=cpu)
             for c, b, s, m in CHECKPOINT_CASES for cpu in (True, False)]
    # partition_activations at tp 2: each rank keeps its half (the forward; ranks 0 and 1)
    specs += [dict(config=CHECKPOINT_CASES[0][0], batch=2, seq_len=8, mode="bf16",
                   partition=True, cpu=cpu, tp=2, rank=rank)
              for cpu in (False, True) for rank in (0, 1)]
    r = subprocess.run([sys.executable, "-m", "reference_model.ds_checkpointing",
                        json.dumps(specs)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])
    for spec, got in zip(specs, measured):
        settings = (("partition_activations", True),) + (
            (("cpu_checkpointing", True),) if spec["cpu"] else ())
        setup = TrainingSetup(mode=spec["mode"], recompute="full", engine="deepspeed",
                              engine_settings=settings, attn_impl="sdpa",
                              tp=spec.get("tp", 1))
        cfg, wl = GPTConfig(**spec["config"]), Workload(spec["batch"], spec["seq_len"])
        device = device_activations(cfg, wl, setup)["layer/block_input"]
        host = checkpoints_on_host(cfg, wl, setup)
        kept = got["saved"] if not spec["cpu"] else 0
        assert device == got["device"] + kept, spec
        assert sum(host.values()) == got["sizes"] + (got["saved"] if spec["cpu"] else 0), spec
        # the checkpoint is the block input the plain set-up keeps, over tp
        plain = device_activations(cfg, wl, replace(setup, engine_settings=()))
        assert got["saved"] * setup.tp == plain["layer/block_input"], spec


@pytest.mark.parametrize("raw, key", [({"pipeline": {"stages": 2}}, "pipeline"),
                                      ({"sparse_attention": {"mode": "fixed"}},
                                       "sparse_attention")])
def test_a_refused_key_is_one_line_naming_it(tmp_path, raw, key):
    from click.testing import CliRunner

    from gptcalc.cli import cli

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, **raw}))
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--deepspeed-config",
                                 str(path)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"{key}:" in r.stderr, r.stderr


def test_cpu_checkpointing_moves_the_block_inputs_to_the_host_table(tmp_path):
    from click.testing import CliRunner

    from gptcalc.cli import cli

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "bf16": {"enabled": True},
                                "activation_checkpointing": {"cpu_checkpointing": True}}))
    args = ["memory", "--preset", "gpt2", "--seq-len", "1024", "--recompute", "full",
            "--json"]
    plain = json.loads(CliRunner().invoke(cli, [*args, "-B", "2", "--zero", "2",
                                                "--engine", "deepspeed"]).stdout)
    out = json.loads(CliRunner().invoke(cli, [*args, "--deepspeed-config", str(path)]).stdout)
    inputs = plain["breakdown"]["activations"]["layer/block_input"]
    assert inputs == 12 * 2 * 1024 * 768 * 2  # L x B x S x E, bf16
    assert out["breakdown"]["activations"]["layer/block_input"] == 4 * 12  # 0-d placeholders
    assert out["host"] == {"activation checkpoints (cpu_checkpointing)": inputs}
    assert "in host memory (cpu_checkpointing)" in out["assumptions"]
    moved = inputs - 4 * 12
    assert plain["peak_phases"]["forward end"] - out["peak_phases"]["forward end"] == moved
