"""The Python API hands back the library's own numbers, memory included, and stays torch-free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gptcalc

ROOT = Path(__file__).resolve().parents[1]
N = 124_439_808  # released GPT-2 small (see test_params)
TENSORS = 148  # GPT-2's parameter tensors, the tied one once: wte, wpe, 12 x 12 per block, ln_f


def test_summary_holds_params_flops_and_memory():
    cfg, wl = gptcalc.load(preset="gpt2", batch_size=2, seq_len=1024)
    s = gptcalc.summarize(cfg, wl)
    assert s.params.total == N
    # nanoGPT transformer_sizing.ipynb: training FLOPs of one 1024-token sequence
    assert s.flops.training_total == 874_944_921_600
    assert s.inference.prefill == 291_648_307_200  # the same notebook's forward_total
    # fp32 AdamW: 4-byte weights and gradients, two 4-byte moments per parameter and a 4-byte
    # step counter per tensor (torch.optim.AdamW)
    assert (s.memory.weights, s.memory.gradients) == (4 * N, 4 * N)
    assert s.memory.optimizer == 8 * N + 4 * TENSORS
    # ZeRO-3 over 2 ranks with mixed precision (Rajbhandari et al. 2020: 2 + 2 + 12 bytes per
    # parameter, all sharded), DeepSpeed's default: flat partitions of N / 2 elements each,
    # and every parameter of at most 1e5 elements also kept whole
    # (stage3_param_persistence_threshold): GPT-2's LayerNorms and biases, 13 E per block + 2 E
    setup = gptcalc.TrainingSetup(mode="mixed", zero=3, dp=2)
    sharded = gptcalc.summarize(cfg, wl, training=setup)
    persistent = 12 * 13 * 768 + 2 * 768
    assert (sharded.memory.weights, sharded.memory.gradients) == (
        2 * (N // 2 + persistent), 2 * (N // 2))
    assert sharded.memory.breakdown["state"]["optimizer/states"] == 12 * (N // 2)
    # FSDP2 shards dim 0 of every tensor, padded to a multiple of 2 (the 50,257-row embedding:
    # 25,129 rows on rank 0, 768 padding); under MixedPrecisionPolicy the shards stay fp32 and
    # are the master weights: 4 + 4 + 8 bytes per element of the shard
    fsdp = gptcalc.summarize(cfg, wl, training=gptcalc.TrainingSetup(mode="mixed", zero=3, dp=2,
                                                                     engine="fsdp2"))
    half = N // 2 + 768 // 2
    assert (fsdp.memory.weights, fsdp.memory.gradients) == (4 * half, 4 * half)
    assert fsdp.memory.optimizer == 8 * half + 4 * TENSORS
    assert gptcalc.to_dict(s)["memory"]["peak"]["bytes"] == s.memory.peak.bytes


def test_memory_names_load_lazily():
    code = ("import sys, gptcalc; before = 'gptcalc.memory' in sys.modules; "
            "gptcalc.memory_report; print(before, 'gptcalc.memory' in sys.modules, "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "True", "False"], out.stderr


def test_a_config_file_sizes_the_same_training_step_in_the_api_and_the_cli(tmp_path):
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli

    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "llama2-7b"\n[workload]\nbatch_size = 2\nseq_len = 1024\n'
                    '[training]\nmode = "mixed"\nrecompute = "full"\n[parallel]\nzero = 3\n'
                    'dp = 8\n')
    setup = gptcalc.resolve_setup(config=path)
    training = gptcalc.training_for(setup)
    assert (training.mode, training.recompute, training.zero, training.dp) == ("mixed", "full",
                                                                               3, 8)
    api_peak = gptcalc.summarize(setup.config, setup.workload, training=training).memory.peak
    out = CliRunner().invoke(cli, ["memory", "--config", str(path), "--json"])
    assert json.loads(out.output)["peak"] == api_peak.bytes
