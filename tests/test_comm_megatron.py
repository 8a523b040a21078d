"""Megatron-core's distributed optimizer (`gptcalc.time.comm`'s megatron rows): its buffer's
padding on both sides of each boundary, and megatron-core 0.16.1 itself counted on 2 gloo
ranks (reference_model/megatron_optimizer_twin.py, driven by benchmarks/comm_twin.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from gptcalc import TrainingSetup, from_name
from gptcalc.memory.states import stage_tensors
from gptcalc.time.comm import (collectives, megatron_bucket_size, megatron_buckets,
                               module_order_sizes)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# the models of benchmarks/comm_twin.py's `twin_cases` and `megatron_cases`
LLAMA = dict(arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176, vocab_size=1601,
             block_size=32)
GPT2 = dict(arch="gpt2", n_embd=64, n_head=4, vocab_size=1601, block_size=32, n_layer=3)


@pytest.mark.parametrize("sizes, n, elements", [
    ([64], 2, 128),          # one aligned parameter: the bucket pads to lcm(2, 128)
    ([128], 2, 128),         # exactly one bucket alignment
    ([129], 2, 256),         # one over: 192 after the parameter's padding, 256 the bucket's
    ([64, 64], 2, 128),      # parameters at multiples of 64 need no padding between them
    ([1, 65], 2, 256),       # backward's order: 65 -> 128, then 1 -> 64: 192, the bucket 256
    ([384], 3, 384),         # lcm(3, 128) = 384 exactly
    ([385], 3, 768),         # one over
])
def test_megatron_buffer_padding(sizes, n, elements):
    """megatron/core/distributed/param_and_grad_buffer.py (0.16.1): `_pad_start_of_param_if_
    needed` pads each parameter's start to 64 elements, `_pad_end_of_bucket_if_needed` the
    bucket's end to lcm(dp, 128); one bucket without --overlap-grad-reduce."""
    assert megatron_buckets(sizes, n, None) == [elements]
    assert elements % math.lcm(n, 128) == 0


@pytest.mark.parametrize("bucket, buckets", [
    (192, [256, 128]),   # 128 + 64 = 192 >= 192: the bucket closes (padded to 256)
    (193, [384]),        # one over: the last 128 joins (320), one bucket padded to 384
    (320, [384]),        # exactly all of them: closes at the end
])
def test_megatron_bucket_closes_at_its_size(bucket, buckets):
    """A bucket closes once its parameters (in backward's order, each from a multiple of 64)
    span at least the bucket size (`>=` in `_ParamAndGradBuffer.__init__`)."""
    assert megatron_buckets([128, 64, 128], 2, bucket) == buckets


def test_megatron_bucket_size_defaults():
    """distributed_data_parallel.py: max(40,000,000, 1,000,000 x dp) with
    --overlap-grad-reduce, none (one bucket) without; --ddp-bucket-size given wins."""
    def size(dp, **kw):
        return megatron_bucket_size(TrainingSetup(dp=dp, engine="megatron", mode="mixed",
                                                  engine_settings=tuple(kw.items())))

    assert size(40) == 40_000_000 and size(41) == 41_000_000 and size(8) == 40_000_000
    assert size(8, overlap_grad_reduce=0) is None
    assert size(8, bucket_size=1000) == 1000


def test_module_order_is_the_reference_models():
    """Megatron buckets parameters in `parameters()` order reversed: `module_order_sizes`
    equals the reference model's order for the twin's models."""
    pytest.importorskip("torch")
    from reference_model.model import build_model

    for cfg in (from_name("debug", **LLAMA), from_name("debug", **GPT2)):
        setup = TrainingSetup(dp=2, engine="megatron", mode="mixed")
        assert module_order_sizes(stage_tensors(cfg, setup, "first"), 1) == [
            p.numel() for p in build_model(cfg).parameters()]


def _megatron(cfg, mode):
    setup = TrainingSetup(dp=2, engine="megatron", mode=mode, attn_impl="manual")
    return sorted((c.kind, int(c.size), c.count)
                  for c in collectives(cfg, setup, 2, 32, 1, 8) if c.part == "dp")




def test_megatron_distributed_optimizer_as_counted():
    """The figures the twin below counted on megatron-core 0.16.1 (docs/time.md's table): the
    two-block Llama's 297,408 parameters (each a multiple of 64 elements) in a buffer of
    297,472, the next multiple of lcm(2, 128); gradients reduced in fp32 under bf16."""
    cfg = from_name("debug", **LLAMA)
    assert _megatron(cfg, "mixed") == [("all-gather", 594_944, 1), ("all-reduce", 4, 1),
                                       ("reduce-scatter", 1_189_888, 1)]
    assert _megatron(cfg, "fp32") == [("all-gather", 1_189_888, 1), ("all-reduce", 4, 1),
                                      ("reduce-scatter", 1_189_888, 1)]


@pytest.mark.slow
def test_megatron_twin_counts_the_model():
    """Megatron-core's DDP and distributed optimizer on 2 gloo ranks, one step of the two-block
    Llama in mixed precision with --overlap-grad-reduce and a bucket size on each side of the
    head's and final norm's elements (about 60 s): every call's kind and bytes equal the
    model's (benchmarks/comm_twin.py prints the other cases of docs/time.md's table)."""
    if importlib.util.find_spec("megatron") is None \
            or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    from comm_twin import count_collectives, megatron_cases, modelled

    cases = [c for c in megatron_cases() if "--ddp-bucket-size" in c[0]]
    assert len(cases) == 2
    counted = count_collectives([c[1:] for c in cases])
    for (label, cfg, wl, setup), calls in zip(cases, counted):
        assert sorted(calls) == sorted(modelled(cfg, wl, setup)), label
