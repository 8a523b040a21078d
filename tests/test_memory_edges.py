"""Saved activations stay exact where layouts change: batch, heads or length of 1 (matmul saves
views, not copies), GPT-NeoX's partial rotary and parallel residual, grouped-query attention;
the step peak stays within its stated tolerance over every switch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import Workload, from_name
from gptcalc.memory import TrainingSetup, saved_activations
from reference_model.memory import REPLAY_TOLERANCE, REPLAY_TOLERANCE_FLOOR_BYTES
from reference_model.replay import replay_peak as step_peak
from reference_model.memory import measure_step_peak_cpu, saved_for

from ._strategies import configs_and_workloads

# exact allocator numbers (MemTracker's step peak) and saved-tensor sets of torch 2.13
pytestmark = pytest.mark.requires_torch_213

torch.set_num_threads(1)

edges = st.fixed_dictionaries({
    "arch": st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
    "qkv_layout": st.sampled_from(["fused", "separate", "per_head"]),
    "pos": st.sampled_from(["learned", "rotary", "none"]),
    "rotary_pct": st.sampled_from([1.0, 0.5, 0.25]),
    "parallel": st.booleans(), "gqa": st.booleans(),
    "B": st.integers(1, 3), "S": st.integers(1, 4), "H": st.integers(1, 2),
    "dropout": st.sampled_from([0.0, 0.1]), "mode": st.sampled_from(["fp32", "bf16"]),
    "attn": st.sampled_from(["manual", "sdpa"]),
})


@settings(max_examples=80, deadline=None)
@given(edges)
def test_saved_activation_bytes_exact_at_layout_edges(d):
    gqa = d["gqa"] and d["qkv_layout"] != "per_head" and d["H"] > 1
    cfg = from_name("debug", arch=d["arch"], qkv_layout=d["qkv_layout"], pos_embedding=d["pos"],
                    rotary_pct=d["rotary_pct"], parallel_residual=d["parallel"],
                    n_kv_head=1 if gqa else None, n_head=d["H"], n_embd=16 * d["H"], n_layer=1,
                    block_size=4, vocab_size=11, dropout=d["dropout"])
    wl, setup = Workload(d["B"], d["S"]), TrainingSetup(attn_impl=d["attn"], mode=d["mode"])
    measured = sum(t.nbytes for t in saved_for(cfg, wl, setup).tensors)
    assert measured == sum(saved_activations(cfg, wl, setup).values())


# The step peak over the whole strategy: every switch, B/S/H down to 1, fp32/bf16/amp/mixed,
# manual/SDPA, AdamW/SGD/SGD-momentum, recompute none/selective/full. Exact for the families'
# defaults (test_memory_measured.py); elsewhere within REPLAY_TOLERANCE (its comment says why).
@settings(max_examples=40, deadline=None)
@given(case=configs_and_workloads(), mode=st.sampled_from(["fp32", "bf16", "amp", "mixed"]),
       attn=st.sampled_from(["manual", "sdpa"]),
       optimizer=st.sampled_from(["adamw", "sgd", "sgd-momentum"]),
       recompute=st.sampled_from(["none", "selective", "full"]))
@pytest.mark.slow
def test_step_peak_within_tolerance_over_the_strategy(case, mode, attn, optimizer, recompute):
    cfg, wl = case
    setup = TrainingSetup(mode=mode, attn_impl=attn, optimizer=optimizer, recompute=recompute)
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    predicted = step_peak(cfg, wl, setup)
    assert sum(predicted.lines.values()) == predicted.bytes
    tolerance = max(REPLAY_TOLERANCE_FLOOR_BYTES, REPLAY_TOLERANCE * measured)
    assert abs(predicted.bytes - measured) <= tolerance, (
        predicted.bytes, measured)


@pytest.mark.parametrize("mode", ["bf16", "amp", "mixed"])
def test_step_peak_sdpa_math_path_16bit_wide_heads(mode):
    """SDPA with dropout on CPU runs its math path, which computes 16-bit q, k, v in fp32: with
    attention wider than the model (n_head * head_dim = 32 > n_embd = 8) the step peaks in the
    forward, inside the last block's attention core, where both predictors once missed the
    path's fp32 copies by 17-24 %."""
    from gptcalc import GPTConfig
    from gptcalc.memory import step_peak as phase_peak
    from reference_model.memory import PHASE_MODEL_TOLERANCE

    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=4, n_embd=8, n_kv_head=4,
                    head_dim=8, ffn_mult=1, dropout=0.1, qkv_layout="fused",
                    pos_embedding="learned", norm="layernorm", mlp="relu")
    wl = Workload(2, 8)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", optimizer="adamw", recompute="none")
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    # MemTracker, torch 2.13 CPU, when written
    assert measured == {"bf16": 37408, "amp": 48640, "mixed": 48800}[mode]
    replayed = step_peak(cfg, wl, setup)
    assert replayed.phase == "forward, attention core"
    assert sum(replayed.lines.values()) == replayed.bytes
    assert abs(replayed.bytes - measured) <= max(REPLAY_TOLERANCE_FLOOR_BYTES,
                                                 REPLAY_TOLERANCE * measured)
    phase = phase_peak(cfg, wl, setup)
    assert phase.phase == "forward, attention core"
    assert abs(phase.bytes - measured) <= PHASE_MODEL_TOLERANCE * measured


def test_replay_sdpa_math_path_16bit_full_recompute():
    """With full recomputation the math path runs whole inside backward, when the block's
    forward is made again: the replay's peak is there, at the recomputed core's output cast."""
    from gptcalc import GPTConfig

    cfg = GPTConfig(block_size=7, vocab_size=5, n_layer=1, n_head=4, n_embd=24, n_kv_head=1,
                    head_dim=32, dropout=0.1)
    wl = Workload(4, 4)
    setup = TrainingSetup(mode="bf16", attn_impl="sdpa", recompute="full")
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    assert measured == 161334  # MemTracker, torch 2.13 CPU, when written
    replayed = step_peak(cfg, wl, setup)
    assert (replayed.phase, replayed.bytes) == ("backward", measured)
    assert "recompute attention core" in replayed.why
