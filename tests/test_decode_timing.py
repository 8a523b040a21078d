"""The measured twin of the decode roofline: the reference model's decode timed on the CPU, its
plot and the report's "Time and serving" section."""

from __future__ import annotations

from gptcalc import Workload, from_name
from reference_model.timing import decode_times, timing_config


def test_a_kv_cache_keeps_the_time_per_token_flat_and_without_it_grows():
    cfg = timing_config(from_name("gpt2"))
    short, long = decode_times(cfg, contexts=(16, 512), repeats=3)
    assert short.context == 16 and long.context == 512
    # the roofline's shape: a forward over 512 tokens does 32x the weight work of one token;
    # the cached step barely changes (its attention term is small at E = 64)
    assert long.seconds_without_cache > 4 * long.seconds_with_cache
    assert long.seconds_without_cache > 2 * short.seconds_without_cache
    assert long.seconds_with_cache < 4 * short.seconds_with_cache


def test_timing_config_keeps_the_family():
    for name in ("llama3-8b", "shakespeare-char", "gpt2"):
        cfg, tiny = from_name(name), timing_config(from_name(name))
        assert (tiny.mlp, tiny.norm, tiny.qkv_layout, tiny.pos_embedding) == \
            (cfg.mlp, cfg.norm, cfg.qkv_layout, cfg.pos_embedding)
        assert (tiny.kv_heads < tiny.n_head) == (cfg.kv_heads < cfg.n_head)


def test_plot_and_report_section(tmp_path):
    from reports.document import to_markdown
    from reports.plots import SAVED_AXES
    from reports.report import _time_blocks

    blocks, plot = _time_blocks(from_name("debug"), Workload(2, 16), "a100-sxm-80gb", tmp_path,
                                "debug")
    md = to_markdown(blocks)
    assert "## Time and serving" in md and "a100-sxm-80gb" in md and "Chinchilla" in md
    assert plot.path.exists() and plot.path.name == "decode_timing.png"
    axes = SAVED_AXES["decode_timing"]
    assert axes[0]["lines"] == 2 and axes[0]["xscale"] == "log" and "ms" in axes[0]["ylabel"]
    cpu_blocks, _ = _time_blocks(from_name("debug"), Workload(2, 16), "cpu", tmp_path, "debug")
    assert "no peak figures" in to_markdown(cpu_blocks)
