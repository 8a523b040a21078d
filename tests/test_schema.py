"""The shared input checks (gptcalc.errors), the option declarations and byte sizes
(gptcalc.schema), the ByteSize click type, and config files refusing tables nothing reads."""

from __future__ import annotations

import math

import click
import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.cli.options import ByteSize, MODEL_KEYS, option_for
from gptcalc.configfile import SECTIONS, WORKLOAD_KEYS
from gptcalc.errors import (ConfigError, boolean, fraction, integer, nonneg_int, one_of,
                            positive_int, probability)
from gptcalc.schema import OPTIONS, TABLES, byte_size, table_keys
from gptcalc.training import PARALLEL_DEFAULTS, training_table_defaults
from gptcalc import from_name


def _field_of(check, *args) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        check(*args)
    assert "\n" not in e.value.message
    return e.value


@pytest.mark.parametrize("value", [True, 1.0, "3", None, 0, -1, 10**301])
def test_integer_refuses(value):
    assert _field_of(positive_int, "dp", value).field == "dp"


def test_integer_ranges_and_wording():
    assert integer("dp", 3) == 3 and nonneg_int("zero", 0) == 0
    assert _field_of(positive_int, "n_layer", 0).message == "n_layer must be positive, got 0"
    assert _field_of(nonneg_int, "lora_rank", -1).message == \
        "lora_rank must not be negative, got -1"
    assert "must be >= 4" in _field_of(integer, "x", 3, 4).message
    assert "at most 10^300" in _field_of(positive_int, "V", 10**301).message


def test_boolean_choice_and_numbers():
    assert boolean("sp", False) is False
    for bad in (0, 1, "true", None):
        assert _field_of(boolean, "sp", bad).field == "sp"
    assert one_of("mode", "amp", ("fp32", "amp")) == "amp"
    assert "must be one of fp32, amp" in _field_of(one_of, "mode", "fp64", ("fp32", "amp")).message
    assert _field_of(one_of, "zero", True, (0, 1, 2, 3)).field == "zero"  # True is not 1 here
    assert fraction("mfu", 1) == 1.0 and probability("dropout", 0) == 0
    for bad in (0, 1.5, math.nan, math.inf, True, "0.5"):
        assert _field_of(fraction, "mfu", bad).field == "mfu"
    assert _field_of(probability, "dropout", 1.0).message == "dropout must be in [0, 1), got 1.0"


@pytest.mark.parametrize("value,expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("512B", 512), (1024, 1024),
])
def test_byte_size(value, expected):
    assert byte_size("gpu_memory", value) == expected


def test_byte_size_options():
    assert byte_size("non_torch", "0", zero_ok=True) == 0
    assert byte_size("overhead", 0, zero_ok=True) == 0
    assert byte_size("gpu_memory", "23.58GiB", exact=False) == int(23.58 * 2**30)
    for bad in ("24", "0GiB", "lots", "-1GiB", True, 0):
        assert _field_of(byte_size, "gpu_memory", bad).field == "gpu_memory"


def _one_line(args):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.output
    return r.stderr


@pytest.mark.parametrize("args,option", [
    (["memory", "--gpu-memory", "lots"], "--gpu-memory"),
    (["memory", "--overhead", "2 apples"], "--overhead"),
    (["serve", "--non-torch", "much"], "--non-torch"),
    (["memory", "--dp", "0"], "--dp"),
    (["memory", "--context", "0"], "--context"),
])
def test_a_bad_value_is_one_line_naming_the_option(args, option):
    assert _one_line(args).startswith(f"Error: {option}: ")


def test_the_byte_size_type_through_click():
    @click.command()
    @click.option("--size", type=ByteSize())
    def show(size):
        click.echo(repr(size))

    assert CliRunner().invoke(show, ["--size", "80GB"]).stdout == f"{80 * 10**9}\n"
    with pytest.raises(ConfigError) as e:  # the gptcalc group turns this into one line
        show.main(["--size", "80"], standalone_mode=False)
    assert e.value.field == "size"


def test_overhead_is_a_size_and_round_trips(tmp_path):
    import json

    saved = tmp_path / "run.toml"
    r = CliRunner().invoke(cli, ["memory", "--overhead", "2GiB", "--json", "--save-config",
                                 str(saved)])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["overhead"] == 2 * 2**30
    again = CliRunner().invoke(cli, ["memory", "--config", str(saved), "--json"])
    assert again.exit_code == 0, again.stderr
    assert again.stdout == r.stdout


@pytest.mark.parametrize("table", ["inference", "serving", "optimiser"])
def test_an_unread_config_table_is_refused(table, tmp_path):
    path = tmp_path / "a.toml"
    path.write_text(f"[{table}]\nx = 1\n")
    err = _one_line(["params", "--config", str(path)])
    assert err.startswith("Error: --config:") and f"unknown section [{table}]" in err


def test_the_declarations_agree_with_their_readers():
    assert SECTIONS == TABLES and "inference" not in TABLES
    assert set(WORKLOAD_KEYS) == {"batch_size", "seq_len", "grad_accum"}
    assert set(table_keys("parallel")) == set(PARALLEL_DEFAULTS)
    assert set(table_keys("training")) == set(training_table_defaults(from_name("gpt2")))
    assert "sets" in MODEL_KEYS and option_for("batch_size") == "--batch-size"
    assert option_for("qkv_bias") == "--set qkv_bias" and option_for("set") == "--set"
    for opt in OPTIONS.values():
        assert opt.cli.startswith("--") and opt.help
        assert opt.kind in ("int", "float", "text", "choice", "size", "flag")
