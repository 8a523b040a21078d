"""The step peak under parallelism: each device holds its share, never the whole model's."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import Workload, from_name
from gptcalc.memory import TrainingSetup, parallel_shares, state_bytes, step_peak


def test_zero3_tensor_parallel_gpt3_fits_where_its_shards_do():
    # GPT-3 175B, mixed precision, ZeRO-3 over 64 replicas and tp = 8: each device keeps
    # 16 bytes x 175e9 / 512 ~ 5.1 GiB of states, so a step cannot need anything like the
    # 2 bytes x 175e9 = 326 GiB of unsharded gradients (the bug this test pins).
    cfg, wl = from_name("gpt3-175b"), Workload(64, 2048)
    setup = TrainingSetup(mode="mixed", zero=3, dp=64, tp=8, recompute="full")
    peak = step_peak(cfg, wl, setup)
    states = state_bytes(cfg, setup)
    assert states.total < peak.bytes < 80 * 2**30
    assert "estimate" in peak.why


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["gpt2", "llama2-7b", "gpt3-13b"]), st.sampled_from([1, 2, 4]),
       st.sampled_from([0, 1, 2, 3]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
       st.booleans())
def test_a_device_never_holds_more_than_the_whole_step(name, dp, zero, tp, pp, sp):
    cfg = from_name(name)
    wl = Workload(8, 512)
    alone = TrainingSetup(mode="mixed")
    setup = dataclasses.replace(alone, dp=dp, zero=zero, tp=tp, pp=pp, sp=sp and tp > 1)
    shares = parallel_shares(cfg, wl, setup)
    assert all(0 < v <= 1 for v in shares.values())
    peak = step_peak(cfg, wl, setup).bytes
    assert state_bytes(cfg, setup).total <= peak <= step_peak(cfg, wl, alone).bytes
    assert (shares == {}) == ((dp, zero, tp, pp, sp and tp > 1) == (1, 0, 1, 1, False))
