"""The communication model against the engines themselves, on 2 gloo ranks: every gradient
all-reduce DDP issues, counted by a communication hook, equals `ddp_buckets`' count and bytes
at both sides of a bucket boundary (bucket_cap_mb scaled down to a stack of 32 x 32 fp32
Linears); every collective FSDP2 and DeepSpeed ZeRO 1-2 issue in a step of the reference
model, counted by wrapping torch.distributed's functions in each rank
(benchmarks/comm_twin.py), equals `gptcalc.time.comm.collectives`' list: kind, bytes and
group, call for call, with DeepSpeed's reduce bucket exactly full and one element short;
DeepSpeed ZeRO-3 likewise at its steady state, on both sides of its persistence threshold,
its prefetch bucket and its reduce bucket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gptcalc.time.comm import ddp_buckets, deepspeed_reduce_buckets  # noqa: E402

WIDTH = 32
TENSOR = WIDTH * WIDTH * 4  # one Linear's fp32 gradient
CAP = 4 * TENSOR  # a bucket holds four


@pytest.mark.slow
@pytest.mark.parametrize("layers", [4, 5, 8, 9])  # total = cap, cap + one tensor, 2 caps, + one
def test_ddp_all_reduces_equal_the_model(layers):
    from comm_twin import count_ddp

    counted = count_ddp(layers, WIDTH, CAP)
    total = layers * TENSOR
    assert len(counted) == ddp_buckets(total, CAP)
    assert sum(counted) == total
    assert all(b <= CAP for b in counted)


def test_the_model_at_the_default_cap():
    # torch 2.13 DDP at bucket_cap_mb=None: a first bucket of 1 MiB, then 25 MiB buckets
    assert ddp_buckets(2**20) == 1 and ddp_buckets(2**20 + 1) == 2
    assert ddp_buckets(2**20 + 25 * 2**20) == 2 and ddp_buckets(2**20 + 25 * 2**20 + 1) == 3


# The model's trainable elements (its parameters' numel summed, 1601 x 64 token embedding and
# head, two blocks; DeepSpeed's one all-reduce at its default bucket measures 594,816 bytes
# of bf16 = 297,408) and its token embedding's, the last gradient backward produces
TWIN_TOTAL = 297_408
TWIN_EMBEDDING = 1601 * 64


@pytest.fixture(scope="module")
def twin_counts():
    """Every case of `comm_twin.twin_cases` counted on 2 gloo ranks in one launch."""
    pytest.importorskip("deepspeed")
    from comm_twin import count_collectives, twin_cases

    cases = twin_cases()
    return dict(zip([c[0] for c in cases], zip(cases, count_collectives([c[1:] for c in cases]))))


EQUAL_CASES = ["FSDP2 --zero 3", "FSDP2 --zero 2", "FSDP2 --zero 3, fp32", "DeepSpeed ZeRO-1",
               "DeepSpeed ZeRO-2", f"DeepSpeed ZeRO-2, reduce_bucket_size {TWIN_TOTAL:,} (full)",
               f"DeepSpeed ZeRO-2, reduce_bucket_size {TWIN_TOTAL - 1:,} (one over)",
               "DeepSpeed ZeRO-1, 2 micro-batches", "DeepSpeed ZeRO-2, 2 micro-batches",
               "GPT-2 shape, FSDP2 --zero 3", "GPT-2 shape, DeepSpeed ZeRO-2",
               "GPT-2 shape, DeepSpeed ZeRO-1, fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("label", EQUAL_CASES)
def test_fsdp2_and_deepspeed_collectives_equal_the_model(twin_counts, label):
    from comm_twin import modelled

    (_, cfg, wl, setup), counted = twin_counts[label]
    assert sorted(modelled(cfg, wl, setup)) == sorted(counted)


@pytest.mark.slow
def test_the_reduce_bucket_boundary_is_crossed(twin_counts):
    # the gradients' bf16 all-reduces: one full bucket, then the embedding's alone
    def reduces(label):
        return sorted(b for k, b, _ in twin_counts[label][1] if k == "all-reduce" and b > 4)

    assert reduces(EQUAL_CASES[5]) == [2 * TWIN_TOTAL]
    assert reduces(EQUAL_CASES[6]) == sorted([2 * TWIN_EMBEDDING,
                                              2 * (TWIN_TOTAL - TWIN_EMBEDDING)])


def test_deepspeed_buckets_at_both_sides_of_the_boundary():
    # stage_1_and_2.py: the bucket is sent when the next gradient would take it past the size
    assert deepspeed_reduce_buckets([3, 2, 5], 10) == [10]
    assert deepspeed_reduce_buckets([3, 2, 5], 9) == [5, 5]
    assert deepspeed_reduce_buckets([3, 2, 6], 9) == [5, 6]
    assert deepspeed_reduce_buckets([3, 12, 1], 10) == [3, 12, 1]  # a gradient over it: alone


@pytest.fixture(scope="module")
def stage3_counts():
    """`comm_twin.stage3_cases` but the default thresholds (the same calls as the MLP
    threshold's persistent side) counted at their third step, in one launch."""
    pytest.importorskip("deepspeed")
    from comm_twin import STAGE3_WARMUP, count_collectives, stage3_cases

    cases = stage3_cases()[1:]
    counted = count_collectives([c[1:] for c in cases], warmup=STAGE3_WARMUP)
    return dict(zip([c[0] for c in cases], zip(cases, counted)))


MLP = 64 * 176  # one MLP matrix of the twin's Llama: 11,264 elements
QKV = 64 + 64 * (64 + 2 * 2 * 16)  # a norm and q, k, v (two KV heads of 16): 8,256


@pytest.mark.slow
def test_deepspeed_stage3_collectives_equal_the_model(stage3_counts):
    from comm_twin import modelled

    unequal = [label for label, ((_, cfg, wl, setup), counted) in stage3_counts.items()
               if sorted(modelled(cfg, wl, setup)) != sorted(counted)]
    assert not unequal


@pytest.mark.slow
def test_deepspeed_stage3_thresholds_are_crossed(stage3_counts):
    def calls(label, kind="all-gather"):
        return sorted(b for k, b, _ in stage3_counts[label][1] if k == kind)

    whole = calls(f"DeepSpeed ZeRO-3, persistence threshold {MLP:,} (MLP matrices whole)")
    gathered = calls(f"DeepSpeed ZeRO-3, persistence threshold {MLP - 1:,} (MLP matrices "
                     "gathered)")
    # the embedding and head (1,601 x 64 each, bf16) in one call at the forward's start;
    # persistent: 2 blocks x 9 tensors + the final norm, each gathered after the step
    assert len(whole) == 1 + 19 and max(whole) == 2 * 2 * 1601 * 64
    # below it the six MLP matrices join the first call
    assert len(gathered) == 1 + 13 and max(gathered) == 2 * (2 * 1601 * 64 + 6 * MLP)
    # the prefetch bucket: at QKV elements the prefetch stops after v, one more takes o too
    at = calls(f"DeepSpeed ZeRO-3, no persistence or reuse, prefetch {QKV:,}")
    over = calls(f"DeepSpeed ZeRO-3, no persistence or reuse, prefetch {QKV + 1:,}")
    assert 2 * QKV in at and 2 * QKV not in over and 2 * (QKV + 64 * 64) in over
    # the reduce bucket: one reduce-scatter of every gradient, then the embedding's alone
    full = calls(f"DeepSpeed ZeRO-3, reduce_bucket_size {TWIN_TOTAL:,} (full)",
                 "reduce-scatter")
    short = calls(f"DeepSpeed ZeRO-3, reduce_bucket_size {TWIN_TOTAL - 1:,} (one over)",
                  "reduce-scatter")
    assert full == [2 * TWIN_TOTAL]
    assert short == sorted([2 * TWIN_EMBEDDING, 2 * (TWIN_TOTAL - TWIN_EMBEDDING)])


@pytest.mark.parametrize("zero_opt", [
    dict(stage3_max_live_parameters=50_000, stage3_max_reuse_distance=0,
         stage3_prefetch_bucket_size=20_000),
    dict(stage3_max_live_parameters=100_000, stage3_max_reuse_distance=30_000,
         stage3_prefetch_bucket_size=8_257, stage3_param_persistence_threshold=0),
    dict(stage3_max_live_parameters=40_000, stage3_max_reuse_distance=60_000,
         stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=5_000),
])
def test_deepspeed_stage3_gathers_extrapolate_the_full_replay(zero_opt):
    # the model replays a few blocks and adds the middle block's calls for the rest: at 16
    # blocks (more than it replays) the calls equal a replay of all 16
    from gptcalc import TrainingSetup, from_name
    from gptcalc.memory.engines.deepspeed import stage3_blocks, stage3_gathered, stage3_trace
    from gptcalc.time.comm import deepspeed_stage3_gathers

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32, n_layer=16)
    setup = TrainingSetup(dp=2, zero=3, mode="mixed", engine="deepspeed",
                          engine_settings=tuple(zero_opt.items()))
    assert 2 * stage3_blocks(cfg, setup, 0) + 1 < 16
    trace, calls = stage3_trace(cfg, setup, 0, 16), []
    stage3_gathered(trace, setup, calls)
    full: tuple[dict, dict] = ({}, {})
    for at, params in calls:
        side = full[at >= trace.marks["forward_end"]]
        n = sum(-(-trace.sizes[p] // 2) * 2 for p in params)
        side[n] = side.get(n, 0) + 1
    assert deepspeed_stage3_gathers(cfg, setup, 16) == full


@pytest.fixture(scope="module")
def tp_counts():
    """`comm_twin.tp_cases` counted on 2 gloo ranks in one launch (DTensor's functional
    collectives, recorded by `comm_twin.funcol_log`)."""
    from comm_twin import count_collectives, tp_cases

    cases = tp_cases()
    return dict(zip([c[0] for c in cases], zip(cases, count_collectives([c[1:] for c in cases]))))


@pytest.mark.slow
def test_tensor_parallel_collectives_equal_the_model(tp_counts):
    from comm_twin import modelled

    unequal = [label for label, ((_, cfg, wl, setup), counted) in tp_counts.items()
               if sorted(modelled(cfg, wl, setup)) != sorted(counted)]
    assert not unequal


@pytest.mark.slow
def test_tensor_parallel_counts(tp_counts):
    from collections import Counter

    act = 2 * 32 * 64 * 4  # b x s x E, fp32
    loss = 2 * 32 * 4  # one fp32 per token
    # forward: the embedding's and 2 per block; backward: 2 per block and the head's input
    assert Counter(tp_counts["tensor parallel 2"][1]) == {("all-reduce", act, 2): 10,
                                                          ("all-reduce", loss, 2): 3}
    # sequence parallel: each becomes an all-gather and a reduce-scatter; the 5 RMSNorm
    # weights' Partial gradients are all-reduced at each of AdamW's 3 reads, 64 fp32 each:
    # as many bytes as the loss's 64 tokens
    assert 64 * 4 == loss
    assert Counter(tp_counts["tensor parallel 2, sequence parallel"][1]) == {
        ("all-gather", act, 2): 10, ("reduce-scatter", act, 2): 10,
        ("all-reduce", loss, 2): 3 + 5 * 3}


@pytest.mark.slow
def test_pipeline_sends_equal_the_model():
    # torch.distributed.pipelining on 2 ranks, 4 micro-batches of 2 x 32 tokens (16,384 B of
    # fp32 activations each): GPipe and 1F1B send 4 activations (rank 0) or 4 gradients
    # (rank 1); at 2 chunks per rank each rank sends 3 per micro-batch
    from comm_twin import count_collectives, modelled, pp_cases

    cases = pp_cases()
    counted = count_collectives([c[1:] for c in cases])
    for (label, cfg, wl, setup), calls in zip(cases, counted):
        assert sorted(modelled(cfg, wl, setup)) == sorted(calls), label
        assert calls == [("send/recv", 2 * 32 * 64 * 4, 2)] * 4 * (3 if "chunks" in label else 1)


def test_pipeline_sends_per_rank():
    from gptcalc.time.comm import pipeline_sends

    # chunks 0..pv-1, rank r holding r, r + p, ...: the first sends no gradient, the last no
    # activation
    assert pipeline_sends(2, 1) == 1  # rank 0: chunk 0 forward; rank 1: chunk 1 backward
    assert pipeline_sends(4, 1) == 2  # a middle rank both ways
    assert pipeline_sends(2, 2) == 3  # rank 0: chunks 0 (forward) and 2 (both)
    assert pipeline_sends(4, 2) == 4


def _cp_part(cfg, wl, setup):
    from gptcalc.time.comm import collectives

    return sorted((c.kind, int(c.size), c.group) for c in collectives(
        cfg, setup, wl.batch_size, wl.seq_len, 1, 8) if c.part == "cp" for _ in range(c.count))


@pytest.mark.parametrize("case", range(4))
def test_context_parallel_ring_equals_the_model(case):
    # torch's ring attention on a fake group (in this process): per block, forward and
    # backward each all-gather k and v (2 x 32 x 64 elements over the ranks), and backward
    # passes the fp32 dk and dv around the ring cp times (all-to-all permutations)
    pytest.importorskip("torch")
    from comm_twin import count_ring, cp_cases

    label, cfg, wl, setup = cp_cases()[case]
    for rank in (0, setup.cp - 1):
        assert sorted(count_ring(cfg, wl, setup, rank)) == _cp_part(cfg, wl, setup), label
    a, cp = setup.act_bytes, setup.cp
    assert _cp_part(cfg, wl, setup) == sorted(
        [("all-gather", 2 * 2 * 32 * 64 * a, cp)] * 2
        + [("all-to-all", 2 * 2 * 32 * 64 * 4 // cp, cp)] * cp)
