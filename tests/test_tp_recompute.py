"""Tensor parallel as torchtitan applies it (DTensor `parallelize_module` with sequence
parallel norms and `loss_parallel`), full activation checkpointing of every block, FSDP2 around
it: gptcalc's saved activations and step peak against the twin (reference_model.distributed)
on gloo ranks."""

from __future__ import annotations

import os

import pytest

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.memory import device_activations, step_peak
from gptcalc.memory.activations import dtensor_tp

# a Llama-shaped reference model whose vocabulary is 16 E, as Llama 3's (128,256 / 8,192)
TINY = from_name("debug", arch="llama").replace(n_embd=64, n_head=4, n_kv_head=2, n_layer=2,
                                                d_ff=224, vocab_size=1024, block_size=64,
                                                tie_embeddings=False)
WL = Workload(4, 64)


def tp2(recompute: str, cfg=TINY) -> TrainingSetup:  # the tp engine trains fp32
    return TrainingSetup(tp=2, sp=True, mode="fp32", attn_impl="sdpa", device="cpu",
                         recompute=recompute, keep_logits=False)


def fsdp2_tp2(recompute: str) -> TrainingSetup:  # FSDP2 (dp 2) x tp 2, torchtitan's policy
    return TrainingSetup(dp=2, tp=2, sp=True, zero=3, engine="fsdp2", mode="mixed",
                         attn_impl="sdpa", device="cpu", recompute=recompute, keep_logits=False)


# Measured on gloo ranks, torch 2.13 CPU (reference_model.distributed.run_layouts, rank 0; every
# rank measures the same): the peak of live saved-for-backward bytes (saved_tensors_hooks) and
# the step peak (MemTracker for tp alone, FSDPMemTracker for FSDP2 x tp), the tracker's Buffer
# category (the model's rotary tables) left out. (set-up, recompute, vocabulary) -> (saved, peak)
MEASURED = {
    ("tp2", "none", 1024): (2_370_052, 5_405_280),
    ("tp2", "full", 1024): (725_508, 3_760_736),
    ("fsdp2_tp2", "none", 1024): (1_451_268, 3_946_336),
    ("fsdp2_tp2", "full", 1024): (626_948, 3_122_016),
    ("fsdp2_tp2", "full", 64): (135_428, 1_171_164),
}
# gptcalc's peak sits below the measured by the loss's few index tensors it does not model
# (8,456 B at V 1024: the target mask and the masked targets of loss_parallel's backward), and
# by 2,696 B at V 64 (-0.16% to -0.27% in all); the phase model's backward start and last-block
# moments are otherwise those measured. Without loss_parallel's third vocabulary shard the
# V 1024 peaks were 15% low, without the whole gathered inputs the V 64 one 3% low: 1%.
PEAK_GAP = 0.01


def _layout(name: str, recompute: str):
    return tp2(recompute) if name == "tp2" else fsdp2_tp2(recompute)


@pytest.mark.parametrize("key", list(MEASURED), ids=lambda k: "-".join(map(str, k)))
def test_saved_and_peak_are_the_measured_ones(key):
    name, recompute, vocab = key
    cfg, setup = TINY.replace(vocab_size=vocab), _layout(name, recompute)
    saved, peak = MEASURED[key]
    assert sum(device_activations(cfg, WL, setup).values()) == saved
    calc = step_peak(cfg, WL, setup).bytes
    assert (1 - PEAK_GAP) * peak <= calc <= peak


def test_column_parallel_inputs_are_saved_whole():
    # ColwiseParallel's input is redistributed from the sequence shard to Replicate and the
    # matmul saves that all-gathered b x S x E tensor; the norms keep their sequence shards
    whole = device_activations(TINY, WL, TrainingSetup(mode="fp32", attn_impl="sdpa"))
    split = device_activations(TINY, WL, tp2("none"))
    for key in ("layer/attn/qkv_input", "layer/mlp/fc_input", "final/lm_head_input"):
        assert split[key] == whole[key]
    for key in ("layer/ln_1/input", "layer/block_input", "final/ln_f/input"):
        assert split.get(key, 0) == whole.get(key, 0) // 2
    # Megatron-LM saves its sequence shard and gathers it again in backward
    assert not dtensor_tp(TrainingSetup(tp=2, sp=True, impl="megatron-core"))
    assert not dtensor_tp(TrainingSetup(tp=1))


# --------------------------------------------------------------------------- the twin itself

torch = pytest.importorskip("torch")


# gloo runs tp's collectives synchronously, in the measured thread; FSDP2's buffers are freed
# on gloo's worker thread, which has moved a measured FSDP2 peak by up to 7 points on a busy CI
# machine (a pairwise cell at -13.0% where it measures -5.8% here): 8% beside PEAK_GAP
TWIN_GAP = 0.08


def _check(results, cfg, setup):
    from reference_model.verify import layout_checks

    checks = layout_checks(cfg, WL, setup, results)
    saved = [c for c in checks if "saved activation" in c.name]
    assert saved and all(c.difference == 0 for c in saved), [c.as_dict() for c in saved]
    for r in results:
        measured = r.peak - r.peak_categories.get("Buffer", 0)
        calc = step_peak(cfg, WL, setup).bytes
        assert (1 - PEAK_GAP - TWIN_GAP) * measured <= calc <= (1 + TWIN_GAP) * measured


@pytest.mark.slow
def test_tensor_parallel_twin_with_full_recomputation():
    # 2 gloo ranks, two set-ups in one launch: about 40 s on two busy cores
    from reference_model.distributed import run_layouts

    setups = [tp2("none"), tp2("full")]
    for setup, results in zip(setups, run_layouts(TINY, WL, setups)):
        assert len(results) == 2
        _check(results, TINY, setup)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GPTCALC_FOUR_RANK_TWINS"),
                    reason="4 ranks: set GPTCALC_FOUR_RANK_TWINS=1")
def test_fsdp2_by_tensor_parallel_twin_with_full_recomputation():
    # dp 2 x tp 2 = 4 gloo ranks, FSDP2's MixedPrecisionPolicy, about a minute on two cores
    from reference_model.distributed import run_layouts

    setups = [fsdp2_tp2("none"), fsdp2_tp2("full")]
    for setup, results in zip(setups, run_layouts(TINY, WL, setups)):
        assert len(results) == 4
        _check(results, TINY, setup)
