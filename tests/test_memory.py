"""Analytic memory: ZeRO bytes per parameter, Korthikanti et al.'s formulas, properties, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc import ConfigError, Workload, from_name
from gptcalc.memory import (TrainingSetup, activations_paper, kv_cache_bytes, memory_report,
                            paper_layer_bytes, saved_activations, state_bytes, step_peak,
                            zero_bytes_per_param)

ROOT = Path(__file__).resolve().parents[1]


# Rajbhandari et al. 2020 (ZeRO), sec. 5.1 / Fig. 1: mixed-precision Adam keeps 2 + 2 + 12 = 16
# bytes/param; P_os: 4 + 12/Nd; P_os+g: 2 + 14/Nd; P_os+g+p: 16/Nd. Their 7.5B example with
# Nd = 64 prints 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
@pytest.mark.parametrize("stage, per_param, paper_gb", [
    (0, 16, 120.0), (1, 4 + 12 / 64, 31.4), (2, 2 + 14 / 64, 16.6), (3, 16 / 64, 1.88)])
def test_zero_paper_bytes_per_param(stage, per_param, paper_gb):
    psi = 7_500_000_000
    setup = TrainingSetup(mode="mixed", optimizer="adamw", dp=64, zero=stage)
    total = sum(zero_bytes_per_param(setup, psi).values())
    assert total == pytest.approx(per_param * psi, rel=1e-12)
    assert round(total / 1e9, 2 if stage == 3 else 1) == paper_gb


def test_zero_sharding_is_exact_for_a_model():
    cfg = from_name("gpt2")
    base = state_bytes(cfg, TrainingSetup(mode="mixed", dp=8))
    n = base.params  # 124,439,808 (GPT-2 small, tied), divisible by 8
    assert n % 8 == 0
    z3 = state_bytes(cfg, TrainingSetup(mode="mixed", dp=8, zero=3))
    # DeepSpeed (the default engine of ZeRO-3) partitions every tensor: n / 8 elements per rank
    # (each of GPT-2's tensors divides by 8), and keeps the tensors of at most 1e5 elements
    # (stage3_param_persistence_threshold) whole: 12 x (4 x 768 + 2304 + 768 + 3072 + 768) +
    # 2 x 768 elements of LayerNorms and biases
    persistent = 12 * (4 * 768 + 2304 + 768 + 3072 + 768) + 2 * 768
    assert (z3.weights, z3.gradients) == (2 * (n // 8 + persistent), 2 * (n // 8))
    assert z3.breakdown["optimizer/states"] == 12 * (n // 8)
    # FSDP2 shards each tensor's dim 0, padded to a multiple of dp: only the token embedding's
    # 50,257 rows are uneven, ceil(50257 / 8) = 6,283 rows on rank 0, 7 x 96 elements of padding
    f3 = state_bytes(cfg, TrainingSetup(mode="mixed", dp=8, zero=3, engine="fsdp2"))
    shard = n // 8 + (6283 * 8 - 50257) * 768 // 8
    # MixedPrecisionPolicy: fp32 shards (the master weights), fp32 gradients, AdamW's moments
    assert (f3.weights, f3.gradients) == (4 * shard, 4 * shard)
    assert f3.breakdown["optimizer/states"] == 8 * shard


def test_zero1_shards_whole_tensors_greedily():
    # ZeroRedundancyOptimizer's rule: largest tensor first, each to the least loaded rank
    from gptcalc.memory.engines.zero_redundancy import zero1_partition
    assert zero1_partition((5, 3, 3, 2), 2) == ((0, 3), (1, 2))
    assert zero1_partition((1, 1, 1), 2) == ((0, 2), (1,))


# Korthikanti et al. 2022, Table 2, per layer; GPT-3 175B's shape (their Table 3): a = 96,
# h = 12288, s = 2048, b = 1, t = 8. sbh = 2048*12288 = 25,165,824; 5as/h = 5*96*2048/12288 = 80.
SBH = 2048 * 12288


@pytest.mark.parametrize("t, sp, recompute, expected", [
    (1, False, "none", SBH * (34 + 80)),  # sbh(34 + 5as/h)
    (8, False, "none", SBH * 10 + SBH * 24 // 8 + SBH * 80 // 8),  # sbh(10 + 24/t + 5as/(ht))
    (8, True, "none", SBH * 34 // 8 + SBH * 80 // 8),  # sbh(34/t + 5as/(ht))
    (8, False, "selective", SBH * 10 + SBH * 24 // 8),  # sbh(10 + 24/t)
    (8, True, "selective", SBH * 34 // 8),  # sbh(34/t)
    (1, False, "full", 2 * SBH),  # 2sbh
])
def test_korthikanti_table2(t, sp, recompute, expected):
    assert paper_layer_bytes(2048, 1, 12288, 96, t, sp, recompute) == expected


def test_paper_terms_and_ratio_5as_over_h():
    # their sec. 4: for GPT-3 175B the attention term 5as/h = 80 exceeds 34
    assert 5 * 96 * 2048 // 12288 == 80
    cfg = from_name("gpt3-175b")
    out = activations_paper(cfg, Workload(1, 2048), TrainingSetup(tp=8, sp=True))
    assert out["layers"] == 96 * (SBH * 34 // 8 + SBH * 80 // 8)
    # (4sbh/t)(1 + v/h) = 4sbh/t + 4sbv/t for the output layer (p = 1)
    assert (out["output/final_norm"] + out["output/lm_head_input"]
            + out["output/cross_entropy"]) == 4 * SBH // 8 + 4 * 2048 * 50257 // 8


def test_kv_cache_grouped_query():
    cfg = from_name("llama3-8b")  # 32 layers, 8 KV heads of 128
    # 2 * L * B * ctx * n_kv * hd * 2 bytes = 2*32*1*8192*8*128*2 = 1 GiB exactly
    assert kv_cache_bytes(cfg, 1, 8192, 2) == 2**30


settings_ = settings(max_examples=40, deadline=None)
sizes = st.fixed_dictionaries({
    "arch": st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
    "n_layer": st.integers(1, 4), "n_head": st.sampled_from([2, 4]), "B": st.integers(2, 8),
    "S": st.integers(2, 16), "dropout": st.sampled_from([0.0, 0.1]),
    "mode": st.sampled_from(["fp32", "bf16", "amp", "mixed"]),
    "optimizer": st.sampled_from(["adamw", "sgd", "sgd-momentum"]),
    "attn": st.sampled_from(["manual", "sdpa"]),
    "recompute": st.sampled_from(["none", "selective", "full"])})


def _make(d):
    cfg = from_name("debug", arch=d["arch"], n_layer=d["n_layer"], n_head=d["n_head"],
                    n_embd=32, block_size=16, vocab_size=64, dropout=d["dropout"])
    setup = TrainingSetup(mode=d["mode"], optimizer=d["optimizer"], attn_impl=d["attn"],
                          recompute=d["recompute"])
    return cfg, setup


@settings_
@given(sizes)
def test_breakdowns_sum(d):
    cfg, setup = _make(d)
    rep = memory_report(cfg, Workload(d["B"], d["S"]), setup)
    b = rep.breakdown
    assert rep.weights + rep.gradients + rep.optimizer == sum(b["state"].values())
    assert rep.activations_paper == sum(b["activations_paper"].values())
    assert sum(b["peak"].values()) == rep.peak.bytes
    assert rep.activations == sum(v for k, v in b["activations"].items()
                                  if not k.startswith("input/"))
    assert rep.weight_copies == sum(b["weight_copies"].values())
    assert (rep.weight_copies > 0) == (setup.mode == "amp")
    assert rep.peak.bytes == max(rep.peak.phases.values())


@settings_
@given(sizes)
def test_monotonic_in_batch(d):
    cfg, setup = _make(d)
    small, big = Workload(d["B"], d["S"]), Workload(d["B"] + 1, d["S"])
    assert sum(saved_activations(cfg, small, setup).values()) < sum(
        saved_activations(cfg, big, setup).values())
    assert step_peak(cfg, small, setup).bytes <= step_peak(cfg, big, setup).bytes


@settings_
@given(sizes, st.sampled_from([2, 4, 8]), st.integers(1, 3))
def test_dp_sharding_never_grows_and_stage_order(d, dp, zero):
    cfg, setup = _make(d)
    plain = state_bytes(cfg, setup)
    # DeepSpeed with no persistent parameters at stage 3 (it keeps small ones whole beside
    # their partitions, which can make stage 3 hold more than stage 2 on a tiny model)
    none_kept = (("stage3_param_persistence_threshold", 0),)
    sharded = [state_bytes(cfg, TrainingSetup(mode=setup.mode, optimizer=setup.optimizer, dp=dp,
                                              zero=z, engine_settings=none_kept))
               for z in range(4)]
    assert sharded[0].total == plain.total
    assert all(a.total >= b.total for a, b in zip(sharded[1:], sharded[2:]))
    # DeepSpeed's fp32 partition copy (it keeps one beside fp32 weights as it keeps the master
    # copy in mixed precision) and its padding are all sharding can add: fewer than dp padding
    # elements per tensor (stage 3) or 2 x dp per flat group (stages 1-2), 16 bytes each at most
    from gptcalc.memory.states import stage_tensors
    tensors = sum(t.count for t in stage_tensors(cfg, setup, "first"))
    copy = 4 * -(-plain.params // dp) if setup.mode == "fp32" else 0
    assert sharded[zero].total <= plain.total + copy + 16 * dp * (tensors + 2)


def test_tp_pp_most_loaded_device():
    cfg = from_name("gpt2")
    full = state_bytes(cfg, TrainingSetup())
    tp = state_bytes(cfg, TrainingSetup(tp=4))
    assert tp.params < full.params / 3  # matrices / 4, norms, biases and positions replicated
    pp_first = state_bytes(cfg, TrainingSetup(pp=4), "first")
    pp_last = state_bytes(cfg, TrainingSetup(pp=4), "last")
    # tied head: the last stage keeps its own copy of the 50257 x 768 token embedding
    assert pp_last.params - pp_first.params == 768 * 2 + 0 - 1024 * 768


@pytest.mark.parametrize("args, option", [
    # gpt2's 12 blocks + the embedding and the head split over at most 14 stages (torchtitan)
    (["--tp", "5"], "--tp"), (["--pp", "15"], "--pp"), (["--zero", "4"], "--zero"),
    (["--pp", "2", "--pp-virtual", "2"], "--pp-virtual"),  # 1F1B runs one chunk per stage
    (["--pp", "2", "--pp-schedule", "dualpipe"], "--pp-schedule"),
    # 9 micro-batches in 2 rounds of 4 stages
    (["--pp", "4", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "9"], "--grad-accum"),
    (["--dp", "0"], "--dp"), (["--gpu-memory", "lots"], "--gpu-memory"),
    (["--context", "0"], "--context"), (["--grad-accum", "0"], "--grad-accum")])
def test_cli_errors(args, option):
    r = subprocess.run([sys.executable, "-m", "gptcalc", "memory", "--preset", "gpt2", *args],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0]


def test_cli_json_keys_and_fit():
    r = subprocess.run([sys.executable, "-m", "gptcalc", "memory", "--preset", "gpt2",
                        "--mode", "mixed", "--gpu-memory", "80GiB", "--json"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    d = json.loads(r.stdout)
    for key in ("weights", "gradients", "optimizer", "activations", "activations_paper",
                "logits", "kv_cache", "peak", "breakdown"):
        assert key in d
    assert d["weights"] == 2 * 124_439_808  # 16-bit weights of GPT-2 small (tied)
    assert d["fit"]["max_batch"] >= 1


def test_cli_amp_reports_weight_copies_apart():
    """GPT-2 small under amp: every weight matrix is saved once as a 2-byte autocast copy.
    Matrices from GPT-2's shapes (E=768, 12 layers, V=50257, tied): 12 * (768*2304 + 768*768 +
    2*768*3072) + 50257*768 = 123,532,032 elements (= 124,439,808 parameters less wpe 786,432,
    biases 82,944 and LayerNorms 38,400)."""
    r = subprocess.run([sys.executable, "-m", "gptcalc", "memory", "--preset", "gpt2",
                        "--mode", "amp", "--json"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    d = json.loads(r.stdout)
    assert d["weight_copies"] == 2 * 123_532_032
    assert sum(d["breakdown"]["weight_copies"].values()) == d["weight_copies"]
    assert not any(k.startswith("weight_copy/") for k in d["breakdown"]["activations"])
    text = subprocess.run([sys.executable, "-m", "gptcalc", "memory", "--preset", "gpt2",
                           "--mode", "amp", "--detail"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    assert "weight copies" in text


def test_bad_setup_values():
    with pytest.raises(ConfigError):
        TrainingSetup(mode="fp8")
    with pytest.raises(ConfigError):
        TrainingSetup(zero=-1)
