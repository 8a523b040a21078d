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
