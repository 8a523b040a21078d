"""FSDP1's collectives and their overlap in the step-time model: every collective FSDP1 issues
in a step on 2 gloo ranks (benchmarks/comm_twin.py, `fsdp1_cases`), counted call for call
(kind, bytes, group), equals `gptcalc.time.comm.collectives` at --zero 2 and 3, one and two
micro-batches each synced and under no_sync, and flat parameters at both sides of
the padding to a multiple of dp; the closed form of `fsdp1_rounds` equals a replay of FSDP1's
shard state micro-batch by micro-batch; the exposed seconds at their limits; `gptcalc time`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import from_name
from gptcalc.cli import cli
from gptcalc.gpus import gpu
from gptcalc.time import PARTS, step_time
from gptcalc.time.comm import accumulation_assumption, collectives, fsdp1_rounds
from gptcalc.training_setup import TrainingSetup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

H100 = gpu("h100-sxm")
LLAMA8 = from_name("llama3-8b")


def fsdp1(zero=3, mode="mixed", dp=8, no_sync=0) -> TrainingSetup:
    """FSDP1 accumulating each micro-batch synced, or (no_sync) under `no_sync()`."""
    return TrainingSetup(dp=dp, zero=zero, mode=mode, engine="fsdp1", attn_impl="sdpa",
                         device="cuda", fsdp1_sync="no-sync" if no_sync else "each-batch")


@pytest.fixture(scope="module")
def counted():
    """Every case of `comm_twin.fsdp1_cases` counted on 2 gloo ranks in one launch (about a
    minute on 2 shared cores)."""
    from comm_twin import count_collectives, fsdp1_cases

    cases = fsdp1_cases()
    return dict(zip([c[0] for c in cases], zip(cases, count_collectives([c[1:] for c in cases]))))


@pytest.mark.slow
def test_fsdp1_collectives_equal_the_model(counted):
    from comm_twin import modelled

    unequal = [label for label, ((_, cfg, wl, setup), calls) in counted.items()
               if sorted(modelled(cfg, wl, setup)) != sorted(calls)]
    assert not unequal
    assert len(counted) == 8


# The two-block Llama of the twin (E 64, 2 KV heads of 16, d_ff 176, V 1601): a block's flat
# parameter is 2 norms + q, k, v, o + gate, up, down = 64 + 4,096 + 2 x 2,048 + 4,096 + 64
# + 3 x 11,264 = 46,208 elements, the root's the embedding, the final norm and the head:
# 2 x 1,601 x 64 + 64 = 204,992; all even (no padding at dp 2), bf16 gathers, fp32 reductions
BLOCK, ROOT = 46_208, 204_992


@pytest.mark.slow
def test_fsdp1_counts_by_strategy_and_accumulation(counted):
    def calls(label):
        return Counter((k, b) for k, b, _ in counted[label][1])

    rs = {("reduce-scatter", 4 * ROOT): 1, ("reduce-scatter", 4 * BLOCK): 2}
    # FULL_SHARD: the root gathered once (kept for backward), each block before its forward
    # and again before its backward
    assert calls("FSDP1 --zero 3") == {("all-gather", 2 * ROOT): 1,
                                       ("all-gather", 2 * BLOCK): 4, **rs}
    assert calls("FSDP1 --zero 2") == {("all-gather", 2 * ROOT): 1,
                                       ("all-gather", 2 * BLOCK): 2, **rs}
    # two micro-batches, the first under no_sync: one reduction per unit; SHARD_GRAD_OP keeps
    # every unit gathered through the no_sync backward, so the second forward gathers nothing
    assert calls("FSDP1 --zero 3, 2 micro-batches, no_sync") == {
        ("all-gather", 2 * ROOT): 2, ("all-gather", 2 * BLOCK): 8, **rs}
    assert calls("FSDP1 --zero 2, 2 micro-batches, no_sync") == calls("FSDP1 --zero 2")
    # each micro-batch synced (the default): everything of one micro-batch, twice
    for zero in (3, 2):
        one = calls(f"FSDP1 --zero {zero}")
        assert calls(f"FSDP1 --zero {zero}, 2 micro-batches") == {
            k: 2 * n for k, n in one.items()}


@pytest.mark.slow
def test_fsdp1_padding_to_a_multiple_of_dp(counted):
    # the Llama's root flat parameter is even (ROOT, gathered as is); the GPT-2 shape's (E 63,
    # 3 blocks, head tied, block size 32) is wte, wpe, ln_f weight and bias, each starting at a
    # multiple of 8 bf16 elements (16 bytes): 100,863 -> 100,864, + 2,016 = 102,880, + 63 ->
    # 102,944, + 63 = 103,007 (odd), padded to 103,008
    def root(label):  # the one all-gather issued once (the blocks' at least twice each)
        return [b for (k, b, _), n in Counter(counted[label][1]).items()
                if k == "all-gather" and n == 1]

    assert root("FSDP1 --zero 3") == [2 * ROOT]
    assert root("GPT-2 shape, E 63, FSDP1 --zero 3") == [2 * 103_008]
    # the reduce-scatter input is the padded flat gradient too (fp32)
    assert ("reduce-scatter", 4 * 103_008, 2) in counted["GPT-2 shape, E 63, FSDP1 --zero 3"][1]


def _replay(zero: int, m: int, blocks: int, no_sync: bool) -> Counter:
    """FSDP1's shard state replayed micro-batch by micro-batch (torch 2.13
    _runtime_utils.py): a unit is gathered when it is needed and not unsharded; after its
    forward a block is freed under FULL_SHARD (never the root); after its backward a unit is
    reduced when the backward syncs, and freed when it syncs or under FULL_SHARD."""
    units = ["root"] + [f"block{i}" for i in range(blocks)]
    unsharded = dict.fromkeys(units, False)
    out: Counter = Counter()
    for i in range(m):
        sync = not no_sync or i == m - 1
        for u in units:  # forward
            if not unsharded[u]:
                out["gather", u[:4]] += 1
                unsharded[u] = True
            if u != "root" and zero == 3:
                unsharded[u] = False
        for u in reversed(units):  # backward: the blocks last to first, the root's end
            if not unsharded[u]:
                out["gather", u[:4]] += 1
                unsharded[u] = True
            if sync:
                out["reduce", u[:4]] += 1
            if sync or zero == 3:
                unsharded[u] = False
    return out


@settings(max_examples=40, deadline=None)
@given(zero=st.sampled_from([2, 3]), m=st.integers(1, 6), layers=st.integers(1, 5),
       no_sync=st.booleans())
def test_fsdp1_rounds_equal_a_replay_of_its_shard_state(zero, m, layers, no_sync):
    cfg = from_name("debug", arch="llama", n_layer=layers)
    s = fsdp1(zero, dp=2, no_sync=int(no_sync))
    got: Counter = Counter()
    for x in collectives(cfg, s, 1, 32, m, 8):
        unit = "root" if x.size == _root_bytes(cfg, s, x.kind) else "bloc"
        got["gather" if x.kind == "all-gather" else "reduce", unit] += x.count
    assert got == _replay(zero, m, layers, no_sync)
    assert sum(n for n, *_ in fsdp1_rounds(s, m)) == m


def _root_bytes(cfg, setup, kind):
    from gptcalc.memory.engines.fsdp1 import compute_bytes, fsdp1_units, reduce_bytes

    per = compute_bytes(setup) if kind == "all-gather" else reduce_bytes(setup)
    return fsdp1_units(cfg, setup)["root"].padded * per


def _per_call(t, kind, phase):
    return [x.seconds / x.collective.count for x in t.collectives
            if x.collective.kind == kind and x.collective.phase == phase]


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("m, no_sync", [(1, 0), (4, 0), (4, 1)])
def test_fsdp1_exposed_seconds_at_their_limits(zero, m, no_sync):
    # nothing to hide behind (compute 0): every collective exposed; compute without end: the
    # root's and the first block's gathers of each gathering forward and the first block's and
    # the root's reduce-scatters of each synced backward
    from gptcalc.time.step import _exposed_fsdp1

    s = fsdp1(zero, no_sync=no_sync)
    t = step_time(LLAMA8, s, 1, 8192, m, H100)
    rounds, L = fsdp1_rounds(s, m), LLAMA8.n_layer
    assert _exposed_fsdp1(t.collectives, rounds, L, 0.0, 0.0) == pytest.approx(
        sum(x.seconds for x in t.collectives), rel=1e-12)
    g_root, g_block = _per_call(t, "all-gather", "forward")
    r_root, r_block = _per_call(t, "reduce-scatter", "backward")
    forwards = sum(n for n, fwd, _, _ in rounds if fwd)
    synced = sum(n for n, _, _, sync in rounds if sync)
    assert _exposed_fsdp1(t.collectives, rounds, L, 1e9, 1e9) == pytest.approx(
        forwards * (g_root + g_block) + synced * (r_root + r_block), rel=1e-12)


def test_fsdp1_backward_overlap_at_both_sides_of_the_compute():
    # FULL_SHARD, one micro-batch: the backward hides L block gathers and L - 1 block
    # reduce-scatters; at exactly that much backward compute nothing more is exposed, a
    # nanosecond less exposes a nanosecond
    from gptcalc.time.step import _exposed_fsdp1

    s = fsdp1(3)
    t = step_time(LLAMA8, s, 1, 8192, 1, H100)
    rounds, L = fsdp1_rounds(s, 1), LLAMA8.n_layer
    g_root, g_block = _per_call(t, "all-gather", "forward")
    r_root, r_block = _per_call(t, "reduce-scatter", "backward")
    behind = L * g_block + (L - 1) * r_block
    at = _exposed_fsdp1(t.collectives, rounds, L, 1e9, behind)
    assert at == pytest.approx(g_root + g_block + r_root + r_block, rel=1e-12)
    assert _exposed_fsdp1(t.collectives, rounds, L, 1e9, behind - 1e-9) == pytest.approx(
        at + 1e-9, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(zero=st.sampled_from([2, 3]), dp=st.sampled_from([1, 2, 8, 64]), m=st.integers(1, 8),
       b=st.integers(1, 4), mode=st.sampled_from(["mixed", "fp32", "bf16"]),
       no_sync=st.sampled_from([0, 1]))
def test_fsdp1_parts_sum_to_the_step(zero, dp, m, b, mode, no_sync):
    s = fsdp1(zero, mode, dp, no_sync=no_sync)
    t = step_time(LLAMA8, s, b, 4096, m, H100)
    assert set(t.parts) == set(PARTS)
    assert sum(t.parts.values()) == pytest.approx(t.step_seconds, rel=1e-12)
    assert all(v >= 0 for v in t.parts.values())
    assert t.parts["comm/dp"] == 0 and (t.parts["comm/fsdp"] > 0) == (dp > 1)
    assert t.parts["comm/fsdp"] <= sum(x.seconds for x in t.collectives) * 1.0000001


def test_fsdp1_time_command():
    # Llama 3 8B (model card: V 128,256, E 4,096, 8 KV heads of 128, d_ff 14,336, head untied):
    # the root's flat parameter is the embedding, the final norm and the head, 2 x 128,256 x
    # 4,096 + 4,096 = 1,050,677,248 elements; a block's 2 x 4,096 + 2 x 4,096^2 + 2 x 4,096
    # x 1,024 + 3 x 4,096 x 14,336 = 218,112,000; both multiples of 8 (no padding at dp 8);
    # gathered in bf16, reduced in fp32
    args = ["time", "--preset", "llama3-8b", "--engine", "fsdp1", "--zero", "3", "--dp", "8",
            "--gpu", "h100-sxm"]
    r = CliRunner().invoke(cli, args + ["--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["step_parts"]["comm/fsdp"] > 0 and d["step_parts"]["comm/dp"] == 0
    assert [(c["kind"], c["bytes"], c["count"]) for c in d["collectives"]] == [
        ("all-gather", 2 * 1_050_677_248, 1), ("all-gather", 2 * 218_112_000, 32),
        ("all-gather", 2 * 218_112_000, 32), ("reduce-scatter", 4 * 1_050_677_248, 1),
        ("reduce-scatter", 4 * 218_112_000, 32)]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0 and "comm/fsdp" in text.output
    # --zero 2 (SHARD_GRAD_OP): no gather in backward
    z2 = json.loads(CliRunner().invoke(cli, args[:6] + ["2"] + args[7:] + ["--json"]).output)
    assert [c["count"] for c in z2["collectives"]] == [1, 32, 1, 32]
    # with accumulation the first line says how the gradients are reduced
    ga = json.loads(CliRunner().invoke(cli, args + ["--grad-accum", "2", "--json"]).output)
    assert "FSDP1 accumulates under no_sync" in ga["assumptions"]  # the Trainer's, the default
    each = json.loads(CliRunner().invoke(cli, args + ["--grad-accum", "2", "--json",
                                                      "--fsdp1-sync", "each-batch"]).output)
    assert "FSDP1 reduce-scatters every micro-batch" in each["assumptions"]
    assert each["assumptions"].count("FSDP1 reduce-scatters") == 1
    assert "reduce-scatters" not in d["assumptions"]
    assert "under no_sync" in accumulation_assumption(fsdp1(no_sync=1), 2)


def test_fsdp1_accumulation_each_synced_and_under_no_sync():
    # four micro-batches, each synced (the default): per unit four reductions and, at --zero 2,
    # four gathers; under no_sync (accelerate's default) one reduction per unit and, at
    # --zero 2, one gather
    def counts(zero, **kw):
        return [(x.kind, x.phase, x.count) for x in collectives(LLAMA8, fsdp1(zero, **kw), 1,
                                                                 8192, 4, 8)]

    assert counts(3, no_sync=1) == [
        ("all-gather", "forward", 4), ("all-gather", "forward", 128),
        ("all-gather", "backward", 128), ("reduce-scatter", "backward", 1),
        ("reduce-scatter", "backward", 32)]
    assert counts(2, no_sync=1) == [
        ("all-gather", "forward", 1), ("all-gather", "forward", 32),
        ("reduce-scatter", "backward", 1), ("reduce-scatter", "backward", 32)]
    assert counts(2) == [("all-gather", "forward", 4), ("all-gather", "forward", 128),
                         ("reduce-scatter", "backward", 4), ("reduce-scatter", "backward", 128)]
    a = step_time(LLAMA8, fsdp1(3, no_sync=1), 1, 8192, 4, H100)
    b = step_time(LLAMA8, fsdp1(3), 1, 8192, 4, H100)
    assert a.parts["comm/fsdp"] < b.parts["comm/fsdp"]
