"""Megatron-core's distributed optimizer (`gptcalc.time.comm`'s megatron rows): its buffer's
padding on both sides of each boundary, and megatron-core 0.16.1 itself counted on 2 gloo
ranks (reference_model/megatron_twin.py, driven by benchmarks/comm_twin.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from gptcalc import TrainingSetup, from_name
from gptcalc.time.comm import collectives, megatron_buffer_elements

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("sizes, n, elements", [
    ([64], 2, 128),          # one aligned parameter: the bucket pads to lcm(2, 128)
    ([128], 2, 128),         # exactly one bucket alignment
    ([129], 2, 256),         # one over: 192 after the parameter's padding, 256 the bucket's
    ([64, 64], 2, 128),      # parameters at multiples of 64 need no padding between them
    ([65, 1], 2, 256),       # 65 -> 128, then 1 -> 64: 192, the bucket 256
    ([384], 3, 384),         # lcm(3, 128) = 384 exactly
    ([385], 3, 768),         # one over
])
def test_megatron_buffer_padding(sizes, n, elements):
    """megatron/core/distributed/param_and_grad_buffer.py (0.16.1): `_pad_start_of_param_if_
    needed` pads each parameter's start to 64 elements, `_pad_end_of_bucket_if_needed` the
    bucket's end to lcm(dp, 128)."""
    assert megatron_buffer_elements(sizes, n) == elements
    assert elements % math.lcm(n, 128) == 0


def _megatron(cfg, mode):
    setup = TrainingSetup(dp=2, engine="megatron", mode=mode, attn_impl="manual")
    return sorted((c.kind, int(c.size), c.count)
                  for c in collectives(cfg, setup, 2, 32, 1, 8) if c.part == "dp")


LLAMA = dict(arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176, vocab_size=1601,
             block_size=32)


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
    Llama, mixed and fp32 (about 60 s): every call's kind and bytes equal the model's."""
    if importlib.util.find_spec("megatron") is None \
            or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    from comm_twin import count_collectives, megatron_cases, modelled

    cases = megatron_cases()[:2]
    counted = count_collectives([c[1:] for c in cases])
    for (label, cfg, wl, setup), calls in zip(cases, counted):
        assert sorted(calls) == sorted(modelled(cfg, wl, setup)), label
