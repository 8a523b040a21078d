"""Saved activations under torch.autocast on CPU (modes amp and mixed, bf16 and fp16), exact:
activations and autocast's 16-bit weight copies each equal to what the saved-tensor meter
measures, over every switch of the reference model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import Workload, from_name
from gptcalc.memory import TrainingSetup, saved_activations
from reference_model.memory import saved_for

from ._strategies import configs_and_workloads

torch.set_num_threads(1)

setups = st.builds(TrainingSetup, mode=st.sampled_from(["amp", "mixed"]),
                   autocast_dtype=st.sampled_from(["bf16", "fp16"]),
                   attn_impl=st.sampled_from(["manual", "sdpa"]),
                   recompute=st.sampled_from(["none", "selective", "full"]))


def _split(lines: dict[str, int]) -> tuple[int, int]:
    copies = sum(v for k, v in lines.items() if k.startswith("weight_copy/"))
    return sum(lines.values()) - copies, copies


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(configs_and_workloads(), setups)
def test_autocast_saved_bytes_exact_cpu(cw, setup):
    cfg, wl = cw
    measured = saved_for(cfg, wl, setup)
    assert (measured.activation_bytes, measured.weight_copy_bytes) == _split(
        saved_activations(cfg, wl, setup))


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({
    "arch": st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
    "qkv_layout": st.sampled_from(["fused", "separate", "per_head"]),
    "pos": st.sampled_from(["learned", "rotary", "none"]),
    "rotary_pct": st.sampled_from([1.0, 0.5, 0.25]), "parallel": st.booleans(),
    "gqa": st.booleans(), "B": st.integers(1, 3), "S": st.integers(1, 4),
    "H": st.integers(1, 2), "dropout": st.sampled_from([0.0, 0.1])}), setups)
def test_autocast_saved_bytes_exact_at_layout_edges(d, setup):
    """B, S or H of 1 (matmul saves views), partial rotary, GQA, parallel residual."""
    gqa = d["gqa"] and d["qkv_layout"] != "per_head" and d["H"] > 1
    cfg = from_name("debug", arch=d["arch"], qkv_layout=d["qkv_layout"], pos_embedding=d["pos"],
                    rotary_pct=d["rotary_pct"], parallel_residual=d["parallel"],
                    n_kv_head=1 if gqa else None, n_head=d["H"], n_embd=16 * d["H"], n_layer=1,
                    block_size=4, vocab_size=11, dropout=d["dropout"])
    wl = Workload(d["B"], d["S"])
    measured = saved_for(cfg, wl, setup)
    assert (measured.activation_bytes, measured.weight_copy_bytes) == _split(
        saved_activations(cfg, wl, setup))


def test_amp_gpt2_block_by_hand():
    """One gpt2 block (E=16, H=2, T=8, V=32, fused qkv, GELU, no dropout), B=2, S=8 under bf16
    autocast, counted by hand from the meter's dump (N = 16 tokens):
    weight copies: c_attn 16*48, c_proj 16*16, c_fc 16*64, mlp c_proj 64*16, lm_head (tied)
    32*16, 2 bytes each = 2*(768+256+1024+1024+512) = 7168.
    activations: 3 LayerNorms in fp32 (input 16*16*4 + mean, rstd 16*4 each) = 3*1152; q/k/v
    input, c_proj input, MLP input, lm_head input bf16 16*16*2 each = 4*512; copies of q, k^T and
    v and the softmax output (att @ v saves it, no dropout) 2*2*8*8*2 each = 4*512 (bf16: CPU
    autocast runs softmax in 16 bit); causal mask 64; GELU input and
    c_proj input 16*64*2 each = 2*2048; fp32 log-probs 16*32*4 = 2048; total weight 4;
    idx, targets, positions 128 + 128 + 64.
    """
    cfg = from_name("debug", arch="gpt2", n_layer=1, n_head=2, n_embd=16, block_size=8,
                    vocab_size=32, dropout=0.0)
    setup = TrainingSetup(mode="amp")
    acts, copies = _split(saved_activations(cfg, Workload(2, 8), setup))
    assert copies == 7168
    assert acts == 3 * 1152 + 4 * 512 + 4 * 512 + 64 + 2 * 2048 + 2048 + 4 + 128 + 128 + 64
    measured = saved_for(cfg, Workload(2, 8), setup)
    assert (measured.activation_bytes, measured.weight_copy_bytes) == (acts, copies)
    assert {t.dtype for t in measured.tensors if t.category == "autocast/weight_copy"} == {
        "bfloat16"}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "mixed"])
def test_no_weight_copies_without_fp32_weights_under_autocast(mode):
    cfg = from_name("debug", arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=8,
                    vocab_size=32)
    setup = TrainingSetup(mode=mode)
    assert saved_for(cfg, Workload(2, 4), setup).weight_copy_bytes == 0
    assert _split(saved_activations(cfg, Workload(2, 4), setup))[1] == 0


@pytest.mark.parametrize("mode, autocast_dtype", [("amp", "bf16"), ("amp", "fp16"),
                                                  ("mixed", "bf16"), ("fp32", "bf16")])
def test_logits_bytes_exact_cpu(mode, autocast_dtype):
    """The logits the model returns are the lm_head's output: 16-bit under autocast (the Linear
    runs in the autocast dtype), fp32 in fp32; the cross entropy's log-probabilities are fp32
    under autocast (measured: LogSoftmaxBackward0's saved result)."""
    from gptcalc.memory import logits_bytes
    from reference_model.memory import autocast_context, build_for, make_batch

    cfg = from_name("debug", arch="gpt2", n_layer=1, n_head=2, n_embd=16, block_size=8,
                    vocab_size=32)
    wl, setup = Workload(2, 8), TrainingSetup(mode=mode, autocast_dtype=autocast_dtype)
    model = build_for(cfg, setup)
    idx, targets = make_batch(cfg, wl)
    with autocast_context(setup, "cpu"):
        logits, _ = model(idx, targets)
    saved = saved_for(cfg, wl, setup)
    log_probs = sum(t.nbytes for t in saved.tensors if "LogSoftmaxBackward0" in t.saved_by)
    assert logits_bytes(cfg, wl, setup) == logits.nbytes
    assert saved_activations(cfg, wl, setup)["cross_entropy/log_probs"] == log_probs
