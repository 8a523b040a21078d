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




# ---------------------------------------------------------------- the rendered figures' layout
# Checked on the drawn matplotlib figures (text and marker boxes from the Agg renderer), for the
# debug preset (learned positions) and a Llama (rotary positions, no table), as the report draws
# them.

LLAMA = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                  vocab_size=97, block_size=16)


def _context_plots(plots, out, cfg, name):
    from reports import claims

    Ts = claims.sweep_block_sizes(cfg)[:4]
    return plots.plot_context_claims(out, cfg, claims.measure_sizes(cfg, Ts),
                                     claims.measure_costs(cfg, Ts, "meta"), name)


@pytest.fixture(scope="module")
def figures(plots, made, tmp_path_factory):
    """Every figure the report draws, for the debug preset and for a Llama named llama3-8b
    (as the KV-cache plot's own preset list names it)."""
    from types import SimpleNamespace

    out = tmp_path_factory.mktemp("figures")
    figs = {p.name: plots.SAVED_FIGURES[p.name] for p in made}
    # drawing only: timings at the contexts the report measures, made-up seconds
    timings = [SimpleNamespace(context=c, seconds_with_cache=1e-3, seconds_without_cache=c * 1e-4)
               for c in (16, 64, 128, 256, 512)]
    plots.plot_decode_timing(out, timings, from_name("debug"), "debug, shrunk")
    figs["decode_timing"] = plots.SAVED_FIGURES["decode_timing"]
    _context_plots(plots, out, from_name("debug"), "debug")
    figs["context_claims"] = plots.SAVED_FIGURES["context_claims"]
    _context_plots(plots, out, LLAMA, "llama")
    figs["context_claims/llama"] = plots.SAVED_FIGURES["context_claims"]
    for draw in (plots.plot_kv_cache, plots.plot_params):
        stem = draw(out, from_name("llama3-8b"), "llama3-8b").name
        figs[f"{stem}/llama3-8b"] = plots.SAVED_FIGURES[stem]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for fig in figs.values():
        FigureCanvasAgg(fig)  # pyplot's close left a bare canvas: draw as the PNG was drawn
        fig.set_dpi(plots.DPI)
    return figs


def _renderer(fig):
    return fig.canvas.get_renderer()


def _tick_labels(axis):
    """The tick labels an axis draws: major and minor, inside its view, with text."""
    lo, hi = sorted(axis.get_view_interval())
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    return [t.label1 for t in ticks if lo <= t.get_loc() <= hi and t.label1.get_visible()
            and t.label1.get_text()]


def _texts(fig):
    """Every drawn, non-empty tick label, axis label, title and suptitle of `fig`."""
    fig.canvas.draw()
    out = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        out += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        out += _tick_labels(ax.xaxis) + _tick_labels(ax.yaxis)
    return [t for t in out if t.get_visible() and t.get_text()]


def overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    """Pairs of tick labels of one axis whose drawn boxes overlap."""
    fig.canvas.draw()
    r = _renderer(fig)
    clashes = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [(t.get_text(), t.get_window_extent(r)) for t in _tick_labels(axis)]
            clashes += [(a, b) for i, (a, ba) in enumerate(boxes)
                        for b, bb in boxes[i + 1:] if ba.overlaps(bb)]
    return clashes


def texts_outside(fig) -> list[str]:
    """Titles and labels whose drawn box leaves the figure (cut off in the PNG)."""
    r = _renderer(fig)
    box = fig.bbox
    return [t.get_text() for t in _texts(fig)
            if not (box.x0 - 0.5 <= t.get_window_extent(r).x0
                    and t.get_window_extent(r).x1 <= box.x1 + 0.5
                    and box.y0 - 0.5 <= t.get_window_extent(r).y0
                    and t.get_window_extent(r).y1 <= box.y1 + 0.5)]


def duplicate_legend_labels(fig) -> list[str]:
    out = []
    for ax in fig.axes:
        legend = ax.get_legend()
        labels = [t.get_text() for t in legend.get_texts()] if legend else []
        out += sorted({x for x in labels if labels.count(x) > 1})
    return out


def legends_over_data(fig) -> list[str]:
    """Axes whose legend box lies over its own data area (where it can hide a curve), or over
    another text of the figure."""
    fig.canvas.draw()
    r = _renderer(fig)
    bad = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        lb = legend.get_window_extent(r)
        if lb.overlaps(ax.bbox):
            bad.append(f"{ax.get_title()!r}: legend over the data")
        bad += [f"{ax.get_title()!r}: legend over {t.get_text()!r}" for t in _texts(fig)
                if lb.overlaps(t.get_window_extent(r))]
        bad += [f"{ax.get_title()!r}: legend over another axes" for other in fig.axes
                if other is not ax and lb.overlaps(other.bbox)]
    return bad


FIGURE_NAMES = ["params_scaling", "flops_vs_seq_len", "training_memory", "zero_stages",
                "kv_cache", "measured", "decode_timing", "context_claims",
                "context_claims/llama", "kv_cache/llama3-8b", "params_scaling/llama3-8b"]


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_figure_layout(figures, name):
    fig = figures[name]
    assert not duplicate_legend_labels(fig)
    assert not overlapping_tick_labels(fig)
    assert not texts_outside(fig)
    assert not legends_over_data(fig)


def test_the_checks_see_a_bad_figure():
    """The checks above flag what they look for: a legend inside the data holding one label
    twice, crowded tick labels, a title wider than the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1], label="a")
    ax.plot([0, 1], [1, 0], label="a")
    ax.legend(loc="center")
    ax.set_xticks([i / 100 for i in range(0, 101, 5)])
    ax.set_title("a title far too long for a figure three inches wide, cut at both ends")
    fig.canvas.draw()
    assert duplicate_legend_labels(fig) == ["a"]
    assert overlapping_tick_labels(fig)
    assert texts_outside(fig)
    assert legends_over_data(fig)
    plt.close(fig)


def test_workload_marker_inside_the_axes(figures):
    fig = figures["training_memory"]
    for ax in fig.axes:
        (x, y), = [c.get_offsets()[0] for c in ax.collections
                   if c.get_label().startswith("this workload")]
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert x0 < x < x1 and y0 < y < y1, (ax.get_title(), x, ax.get_xlim())


def test_the_models_star_is_on_its_own_curve(figures):
    """The star sits on a curve drawn with the model's own V and T, not on GPT-2/3's."""
    import numpy as np

    for name in ("params_scaling", "params_scaling/llama3-8b"):
        for ax in figures[name].axes:
            (x, y), = [c.get_offsets()[0] for c in ax.collections
                       if c.get_label().startswith("this model (")]
            own, = [ln for ln in ax.lines if ln.get_label().startswith("this model's arch")]
            points = np.column_stack(own.get_data())
            assert any((points == (x, y)).all(axis=1)), (name, x, y)


def test_context_plot_names_the_position_table_only_where_there_is_one(figures):
    gpt = figures["context_claims"].axes[0]
    llama = figures["context_claims/llama"].axes[0]
    assert "learned position table" in gpt.get_title()
    assert "learned position table" not in llama.get_title().replace("no learned", "")
    assert "rotary positions have no table" in " ".join(t.get_text() for t in llama.texts)


def test_context_plot_and_report_quote_one_share(figures):
    from reports import claims

    cfg = from_name("debug")
    sizes = claims.measure_sizes(cfg, claims.sweep_block_sizes(cfg)[:4])
    # the largest T's table (T x E) over the measured count at that T
    share = 100 * sizes[-1].block_size * cfg.n_embd / sizes[-1].measured_params
    note = " ".join(t.get_text() for t in figures["context_claims"].axes[0].texts)
    assert f"{share:.1f}%" in note and claims.position_share(sizes) == pytest.approx(share)


def test_kv_cache_draws_each_model_once(figures):
    legend = figures["kv_cache/llama3-8b"].axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert sum(label.startswith("llama3-8b") for label in labels) == 1
