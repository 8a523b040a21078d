"""The communication model against the engines themselves, on 2 gloo ranks: every gradient
all-reduce DDP issues, counted by a communication hook, equals `ddp_buckets`' count and bytes
at both sides of a bucket boundary (bucket_cap_mb scaled down to a stack of 32 x 32 fp32
Linears); every collective FSDP2 and DeepSpeed ZeRO 1-2 issue in a step of the reference
model, counted by wrapping torch.distributed's functions in each rank
(benchmarks/comm_twin.py), equals `gptcalc.time.comm.collectives`' list: kind, bytes and
group, call for call, with DeepSpeed's reduce bucket exactly full and one element short."""

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

    cases = [c for c in twin_cases() if c[0] != "DeepSpeed ZeRO-3"]
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
