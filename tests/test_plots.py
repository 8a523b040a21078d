"""Scaling plots: written, non-empty, labelled; the numbers they mark checked independently."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from gptcalc import Workload, count_params, from_name
from gptcalc.memory import kv_cache_bytes

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plots():
    import torch

    torch.set_num_threads(1)
    from reports import plots

    return plots


@pytest.fixture(scope="module")
def made(plots, tmp_path_factory):
    out = tmp_path_factory.mktemp("plots")
    cfg = from_name("debug")
    return plots.make_plots(out, cfg, Workload(2, 16), "debug",
                            setup=plots.memory_setup(cfg, "cpu")) + [
        plots.plot_measured(out, cfg, "debug")]


def test_every_plot_is_a_real_png(made):
    names = [p.name for p in made]
    assert names == ["params_scaling", "flops_vs_seq_len", "training_memory", "zero_stages",
                     "kv_cache", "measured"]
    for p in made:
        data = p.path.read_bytes()
        assert data[:8] == PNG_MAGIC, p.path
        assert len(data) > 20_000, f"{p.path} is suspiciously small ({len(data)} bytes)"


def test_every_axes_is_labelled_and_has_a_legend(plots, made):
    for p in made:
        axes = plots.SAVED_AXES[p.name]
        assert axes, p.name
        for ax in axes:
            assert ax["xlabel"] and ax["ylabel"] and ax["title"], (p.name, ax)
            assert ax["legend"], (p.name, "no legend")
            assert ax["lines"] + ax["collections"] > 0, (p.name, "nothing drawn")


@pytest.mark.parametrize("name, scales", [
    ("params_scaling", ("log", "log")), ("flops_vs_seq_len", ("log", "log")),
    ("kv_cache", ("log", "log")), ("zero_stages", ("log", "log")),
    # memory is linear in B and quadratic in S: linear axes show that shape
    ("training_memory", ("linear", "linear")),
])
def test_scales(plots, made, name, scales):
    for ax in plots.SAVED_AXES[name]:
        assert (ax["xscale"], ax["yscale"]) == scales


def test_units_in_axis_labels(plots, made):
    ylabels = {n: [a["ylabel"] for a in plots.SAVED_AXES[n]] for n in plots.SAVED_AXES}
    assert all("GiB" in y for y in ylabels["training_memory"])
    assert all("bytes" in y for y in ylabels["kv_cache"])
    assert all("FLOPs" in y for y in ylabels["flops_vs_seq_len"])
    xl = [a["xlabel"] for a in plots.SAVED_AXES["flops_vs_seq_len"]]
    assert all("tokens" in x for x in xl)


def test_presets_are_marked(plots, made):
    legend = plots.SAVED_AXES["params_scaling"][0]["legend"]
    assert "GPT-2 presets" in legend and "GPT-3 presets" in legend


@pytest.mark.parametrize("name", ["shakespeare-char", "gpt2", "gpt3-175b", "debug"])
def test_attention_crossover_closed_form(plots, name):
    # Per token, the weight matmuls cost 2 * (L * (E*3E + E*E + 2*E*d_ff) + E*V) FLOPs and
    # attention (q @ k^T and att @ v over the full S x S) 4 * L * E * S (Vaswani et al. 2017's
    # shapes, H * head_dim = E): they meet at S* = ceil(dense / (4 L E)).
    cfg = from_name(name)
    L, E, V, F = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.ffn_dim
    dense = 2 * (L * (3 * E * E + E * E + 2 * E * F) + E * V)
    assert plots.attention_crossover(cfg) == math.ceil(dense / (4 * L * E))


def test_crossover_of_the_tutorial_model(plots):
    # seeds' model: 6E + V/(2L) = 2304 + 65/12 = 2309.4 -> the first whole S is 2310
    assert plots.attention_crossover(from_name("shakespeare-char")) == 2310


def test_kv_cache_llama2_7b(plots):
    # NVIDIA, "Mastering LLM Techniques: Inference Optimization" (2023): Llama 2 7B, 16-bit,
    # batch 1, 4096 tokens: 1 * 4096 * 2 * 32 * 4096 * 2 bytes, about 2 GB
    assert kv_cache_bytes(from_name("llama2-7b"), 1, 4096, 2) == 4096 * 2 * 32 * 4096 * 2


def test_memory_categories_match_the_reference_model(plots):
    # fp32 AdamW: weights and gradients 4 bytes per parameter, the optimizer two fp32 moments
    # per parameter plus a float32 step counter per tensor (torch.optim.AdamW's state)
    from reference_model.model import build_model

    cfg = from_name("debug")
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    setup = plots.memory_setup(cfg, "cpu")  # GPT-2's family: bf16 autocast over fp32 weights
    cats = plots.memory_categories(cfg, Workload(2, 16), setup)
    assert list(cats) == ["weights", "gradients", "optimizer", "activations", "logits"]
    assert cats["weights"] == cats["gradients"] == 4 * n
    assert cats["optimizer"] == 8 * n + 4 * tensors
    # the bf16 logits: 2 bytes * B * S * V
    assert cats["logits"] == 2 * 2 * 16 * cfg.vocab_size


def test_params_series_is_count_params(plots):
    widths = [64, 128]
    got = plots.params_series("E", widths, lambda e: from_name("gpt2", n_embd=e, n_head=1))
    assert got == [count_params(from_name("gpt2", n_embd=e, n_head=1)).total for e in widths]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptcalc", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a whole process: matplotlib, torch and the reference model load
def test_plot_command_writes_every_png(tmp_path):
    r = _cli("plot", "--preset", "debug", "--out", str(tmp_path), "--measure")
    assert r.returncode == 0, r.stderr
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(["params_scaling.png", "flops_vs_seq_len.png", "training_memory.png",
                           "zero_stages.png", "kv_cache.png", "measured.png"])
    for name in pngs:
        assert name in r.stdout


def test_plot_command_bad_option_is_one_line():
    from click.testing import CliRunner

    from gptcalc.cli import cli

    r = CliRunner().invoke(cli, ["plot", "--preset", "debug", "--n-layer", "0", "--out",
                                 "/tmp/never"])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "--n-layer" in r.stderr
    assert "Traceback" not in r.stderr


