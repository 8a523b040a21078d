"""The communication model against DDP itself: every gradient all-reduce DDP issues on gloo,
counted by a communication hook, equals `ddp_buckets`' count and bytes at both sides of a
bucket boundary (bucket_cap_mb scaled down to a stack of 32 x 32 fp32 Linears)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gptcalc.time.comm import ddp_buckets  # noqa: E402

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
