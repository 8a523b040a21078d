"""The step-time model: its parts, NCCL's bus-bandwidth definitions, placement on nodes, DDP's
bucket boundary, overlap per engine, the bubble per schedule, and `gptcalc time`'s output."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import from_name
from gptcalc.cli import cli
from gptcalc.gpus import gpu
from gptcalc.time import PARTS, collective_seconds, step_time
from gptcalc.time.comm import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, collectives,
                               ddp_buckets, placement)
from gptcalc.training_setup import TrainingSetup

H100, A100 = gpu("h100-sxm"), gpu("a100-sxm-80gb")
LLAMA8, LLAMA70 = from_name("llama3-8b"), from_name("llama3-70b")


def setup(**kw) -> TrainingSetup:
    base = dict(mode="bf16", attn_impl="sdpa", device="cuda", engine="fsdp2", zero=3)
    return TrainingSetup(**{**base, **kw})


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]),
       dp=st.sampled_from([1, 2, 8, 32]), cp=st.sampled_from([1, 2]),
       m=st.integers(1, 8), b=st.integers(1, 4),
       engine=st.sampled_from([("fsdp2", 3), ("fsdp2", 2), ("ddp", 0), ("deepspeed", 1),
                               ("deepspeed", 3), ("megatron", 0), ("zero-redundancy", 1)]),
       recompute=st.sampled_from(["none", "selective", "full"]),
       schedule=st.sampled_from(["1f1b", "interleaved-1f1b", "zero-bubble"]))
def test_parts_sum_to_the_step(tp, pp, dp, cp, m, b, engine, recompute, schedule):
    s = setup(tp=tp, pp=pp, dp=dp, cp=cp, sp=tp > 1, engine=engine[0], zero=engine[1],
              recompute=recompute, pp_schedule=schedule,
              pp_virtual=2 if schedule != "1f1b" else 1)
    t = step_time(LLAMA70, s, b, 4096, m, H100)
    assert set(t.parts) == set(PARTS)
    assert sum(t.parts.values()) == pytest.approx(t.step_seconds, rel=1e-12)
    assert all(v >= 0 for v in t.parts.values())
    assert 0 < t.mfu < 1
    assert t.tokens_per_step == b * m * dp * 4096


def test_collective_time_follows_nccls_bus_bandwidth():
    # nccl-tests: all-reduce busbw = algbw x 2(n-1)/n, all-gather busbw = algbw x (n-1)/n;
    # latency 8.4 us + 5.7 us per NVLink step (NCCL tuning.cc ring/Simple), two passes for AR
    size, n = 1e9, 8
    ar = collective_seconds("all-reduce", size, n, n, False, H100)
    assert ar == pytest.approx(size * 2 * 7 / 8 / 370e9 + 8.4e-6 + 2 * 7 * 5.7e-6)
    ag = collective_seconds("all-gather", size, n, n, False, H100)
    assert ag == pytest.approx(size * 7 / 8 / 370e9 + 8.4e-6 + 7 * 5.7e-6)
    # one rank per node over 4 nodes: the one NIC's 50 GB/s; a 4-rank ring's 3 steps all over
    # the network (NCCL tuning.cc: nInterSteps = nodes - 1)
    x = collective_seconds("reduce-scatter", size, 4, 1, True, H100)
    assert x == pytest.approx(size * 3 / 4 / 50e9 + 8.4e-6 + 3 * 6.6e-6)
    # 16 ranks on 2 nodes: 14 steps within a node, 1 across
    z = collective_seconds("all-gather", size, 16, 8, True, H100)
    assert z == pytest.approx(size * 15 / 16 / 370e9 + 8.4e-6 + 14 * 5.7e-6 + 6.6e-6)
    # all-reduce over 16 ranks on 2 nodes: ring within (7 steps), tree across (1), two passes
    y = collective_seconds("all-reduce", size, 16, 8, True, H100)
    assert y == pytest.approx(size * 2 * 15 / 16 / 370e9 + 8.4e-6 + 2 * (7 * 5.7e-6 + 6.6e-6))
    assert collective_seconds("all-reduce", size, 1, 1, False, H100) == 0


def test_placement_on_nodes_of_eight():
    assert placement(8, 1, 8) == (8, False)  # tp 8: one node
    assert placement(16, 1, 8) == (8, True)
    assert placement(4, 8, 8) == (1, True)  # dp over nodes when tp = 8
    assert placement(2, 4, 8) == (2, False)  # stride 4 x 2 = 8: still one node
    assert placement(4, 4, 8) == (2, True)  # stride 4 x 4 = 16: two nodes


@pytest.mark.parametrize("extra,buckets", [
    (0, 1), (1, 2), (DDP_BUCKET_BYTES, 2), (DDP_BUCKET_BYTES + 1, 3)])
def test_ddp_bucket_boundary(extra, buckets):
    # DDP: a first bucket of 1 MiB, then 25 MiB buckets (torch.nn.parallel.DistributedDataParallel)
    assert ddp_buckets(DDP_FIRST_BUCKET_BYTES + extra) == buckets


def test_tensor_parallel_collectives_per_block():
    # sequence parallel: forward 2 all-gathers + 2 reduce-scatters per block, backward the same
    # (Korthikanti et al. 2022, sec. 4.2.2), and one of each for the embedding and the head,
    # each of b x s x E x 2 bytes; the parallel loss's 3 all-reduces of an fp32 per token; the
    # 65 RMSNorm weights' gradients (4,096 bf16) all-reduced at AdamW's 3 reads
    s = setup(tp=8, sp=True, dp=1, zero=0, engine="ddp")
    tp = [c for c in collectives(LLAMA8, s, 2, 4096, 3, 8) if c.part == "tp"]
    got: dict = {}
    for c in tp:
        got[c.kind, c.size] = got.get((c.kind, c.size), 0) + c.count
    assert got == {("all-gather", 2 * 4096 * 4096 * 2): 3 * (32 * 4 + 2),
                   ("reduce-scatter", 2 * 4096 * 4096 * 2): 3 * (32 * 4 + 2),
                   ("all-reduce", 2 * 4096 * 4): 3 * 3,
                   ("all-reduce", 4096 * 2): (2 * 32 + 1) * 3}
    assert not any(c.crosses_nodes for c in tp)


def test_fsdp_collectives_hide_behind_compute_tensor_parallel_does_not():
    big = step_time(LLAMA8, setup(dp=8), 4, 8192, 1, H100)
    assert big.parts["comm/fsdp"] < 0.01 * big.step_seconds  # prefetch hides it
    tp = step_time(LLAMA8, setup(dp=1, tp=8, sp=True, zero=0, engine="ddp"), 4, 8192, 1, H100)
    raw = sum(x.seconds for x in tp.collectives if x.collective.part == "tp")
    assert tp.parts["comm/tp"] == pytest.approx(raw)


def test_bubble_per_schedule():
    base = dict(dp=1, tp=8, sp=True, pp=8, zero=0, engine="megatron")
    one = step_time(LLAMA70, setup(**base), 1, 4096, 16, H100)
    inter = step_time(LLAMA70, setup(**base, pp_schedule="interleaved-1f1b", pp_virtual=2), 1,
                      4096, 16, H100)
    zb = step_time(LLAMA70, setup(**base, pp_schedule="zero-bubble", pp_virtual=2), 1, 4096,
                   16, H100)
    # 1F1B: (p - 1) slots; interleaved: (p - 1) / v slots (Narayanan et al. 2021)
    slot = (one.step_seconds - one.parts["bubble"] - one.parts["comm/dp"]
            - one.parts["optimizer"]) / 16
    assert one.parts["bubble"] == pytest.approx(7 * slot)
    assert inter.parts["bubble"] < one.parts["bubble"] and zb.parts["bubble"] < inter.parts[
        "bubble"]
    assert step_time(LLAMA70, setup(dp=8), 1, 4096, 16, H100).parts["bubble"] == 0


@pytest.mark.parametrize("slow,fast", [
    (dict(recompute="full"), dict(recompute="none")),
    (dict(recompute="full"), dict(recompute="selective")),
    (dict(), dict(compile="model")),
    (dict(), dict(float8="tensorwise")),
    (dict(pp=4, tp=2, sp=True, zero=0, engine="megatron"),
     dict(pp=4, tp=2, sp=True, zero=0, engine="megatron", pp_schedule="interleaved-1f1b",
          pp_virtual=2)),
])
def test_each_change_moves_the_step_the_way_it_does_on_a_gpu(slow, fast):
    a = step_time(LLAMA8, setup(dp=8, **slow), 2, 8192, 4, H100)
    b = step_time(LLAMA8, setup(dp=8, **fast), 2, 8192, 4, H100)
    assert b.step_seconds < a.step_seconds


def test_a_slower_network_slows_only_communication():
    s = setup(dp=64, tp=8, sp=True, zero=1, engine="deepspeed")
    fast = step_time(LLAMA70, s, 1, 4096, 4, H100)
    slow = step_time(LLAMA70, s, 1, 4096, 4, H100, inter=5e9)
    assert slow.parts["compute"] == fast.parts["compute"]
    assert slow.parts["comm/dp"] > fast.parts["comm/dp"]
    assert slow.parts["comm/tp"] == fast.parts["comm/tp"]  # tp stays within a node


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_time_json_keys_and_the_mfu_override():
    r = run("time", "--preset", "llama3-8b", "--seq-len", "4096", "--dp", "8", "--engine",
            "fsdp2", "--zero", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {"step_seconds", "tokens_per_second", "mfu", "step_parts"} <= set(out)
    assert sum(out["step_parts"].values()) == pytest.approx(out["step_seconds"])
    assert out["tokens_per_second"] == pytest.approx(8 * 4096 / out["step_seconds"])
    assert out["gpus"] == 8
    r = run("time", "--preset", "llama3-8b", "--seq-len", "4096", "--gpus", "8", "--mfu", "0.5",
            "--json")
    out2 = json.loads(r.stdout)
    assert out2["mfu"] == 0.5 and out2["step_parts"] is None and out2["mfu_source"] == "given"
    assert out2["gpus"] == 8


def test_gpus_fills_data_parallel():
    out = json.loads(run("time", "--preset", "gpt2", "--gpus", "16", "--tp", "2", "--json")
                     .stdout)
    assert out["setup"]["dp"] == 8 and out["gpus"] == 16


BAD = [(["--gpus", "7", "--tp", "2"], "--gpus"), (["--gpus", "8", "--dp", "2"], "--gpus"),
       (["--node-size", "0"], "--node-size"),
       (["--intra-node-bandwidth", "-1"], "--intra-node-bandwidth"),
       (["--inter-node-bandwidth", "nan"], "--inter-node-bandwidth")]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_layout_or_network_is_one_line(args, option):
    r = run("time", "--preset", "gpt2", *args)
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and r.stderr.count("\n") == 1 and option in r.stderr, r.stderr


def test_a_card_without_network_figures_is_refused_by_name():
    import gptcalc.gpus as catalogue
    bare = dataclasses.replace(H100, name="bare", intra_node_busbw=None, inter_node_busbw=None)
    catalogue.GPUS["bare"] = bare
    try:
        r = run("time", "--preset", "gpt2", "--gpu", "bare", "--gpus", "2")
    finally:
        del catalogue.GPUS["bare"]
    assert r.exit_code == 2 and "--gpu" in r.stderr


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2, 4]),
       dp=st.sampled_from([1, 2, 8]), cp=st.sampled_from([1, 2]), b=st.integers(1, 4),
       engine=st.sampled_from([("fsdp2", 3), ("ddp", 0), ("deepspeed", 1), ("megatron", 0)]),
       recompute=st.sampled_from(["none", "selective", "full"]),
       mode=st.sampled_from(["bf16", "mixed", "fp32"]), compile_=st.sampled_from(["none",
                                                                                  "blocks"]))
def test_a_ranks_compute_is_computed_once_per_the_fields_it_reads(tp, pp, dp, cp, b, engine,
                                                                   recompute, mode, compile_):
    """micro_batch_compute keeps one result per layout-but-dp, precision, compile and
    recomputation: a set-up seen first with another engine, stage or dp gives what the
    computation itself gives for this one."""
    from gptcalc.time.compute import _uncached_compute, micro_batch_compute

    s = setup(tp=tp, pp=pp, dp=dp, cp=cp, sp=tp > 1, engine=engine[0], zero=engine[1],
              recompute=recompute, mode=mode, compile=compile_)
    other = dataclasses.replace(s, dp=dp * 2, engine="fsdp2", zero=2)
    micro_batch_compute(LLAMA8, other, b, 4096, H100)  # seen first
    assert micro_batch_compute(LLAMA8, s, b, 4096, H100) == _uncached_compute(
        LLAMA8, s, b, 4096, H100)


def test_fsdp_exposes_the_first_gather_and_the_last_reduce_scatter_and_slows_what_it_hides():
    """Llama 3 8B on 8 H100s, FSDP2 ZeRO-3: the collectives hide behind compute but for each
    micro-batch's first all-gather and the step's last reduce-scatter; the hidden rest slows
    the compute it overlaps by 18.9% of its time (arXiv 2507.03114's average)."""
    from gptcalc.time.step import OVERLAP_SLOWDOWN

    assert OVERLAP_SLOWDOWN == 0.189
    m = 4
    t = step_time(LLAMA8, setup(dp=8, mode="mixed"), 2, 8192, m, H100)
    fsdp = [x for x in t.collectives if x.collective.part == "fsdp"]
    gather = next(x for x in fsdp if x.collective.kind == "all-gather")
    scatter = next(x for x in fsdp if x.collective.kind == "reduce-scatter")
    exposed = m * gather.seconds / gather.collective.count \
        + scatter.seconds / scatter.collective.count
    total = sum(x.seconds for x in fsdp)
    assert total < t.parts["compute"] / 3  # hidden but for the two ends
    assert t.parts["comm/fsdp"] == pytest.approx(exposed + 0.189 * (total - exposed))


def test_fsdp_gathers_beyond_the_forward_are_exposed_on_a_slow_network():
    """The forward's gathers hide behind the forward alone: on a network slow enough that they
    outlast it, the excess is exposed, even where all collectives would fit in all compute."""
    s = setup(dp=64, mode="mixed")
    fast = step_time(LLAMA8, s, 2, 8192, 1, H100)
    fwd_gathers = sum(x.seconds for x in fast.collectives if x.collective.kind ==
                      "all-gather") / 2
    compute = fast.parts["compute"]
    # an inter-node bandwidth at which the forward's gathers take 60% of all compute: more
    # than the forward (a third), all collectives (gathers x 2 + fp32 reduce-scatters) less
    # than twice the compute
    slow = step_time(LLAMA8, s, 2, 8192, 1, H100,
                     inter=H100.inter_node_busbw * fwd_gathers / (0.6 * compute))
    gathers = [x for x in slow.collectives if x.collective.kind == "all-gather"]
    ahead = sum(x.seconds for x in gathers) / 2
    assert ahead > slow.parts["compute"] / 3
    assert slow.parts["comm/fsdp"] > ahead - slow.parts["compute"] / 3 > 0


@pytest.mark.parametrize("pp, zero, gather_rounds, reduce_rounds", [
    # m = 6 micro-batches. Without pipelining every micro-batch gathers each group (again
    # before its backward at --zero 3) and reduce-scatters its gradients.
    (1, 2, 6, 6),
    (1, 3, 2 * 6, 6),
    # torch.distributed.pipelining turns gradient sync and the reshard after backward off
    # until its last micro-batch (torch/distributed/pipelining/stage.py): one reduce-scatter
    # a step; --zero 2 keeps the stage gathered from the first forward to the step's end,
    # --zero 3 still reshards after each forward
    (2, 2, 1, 1),
    (2, 3, 2 * 6, 1),
])
def test_fsdp2_under_pipelining_gathers_and_reduces_once_a_step(pp, zero, gather_rounds,
                                                                reduce_rounds):
    """Llama 3 8B (32 blocks) on dp 8: the first stage's groups are the root (embedding) and
    32 / pp blocks, each gathered and reduced once a round."""
    s = setup(dp=8, pp=pp, zero=zero, mode="mixed")
    blocks = 32 // pp
    rows = sorted((x.kind, x.count) for x in collectives(LLAMA8, s, 1, 8192, 6, 8)
                  if x.part == "fsdp")
    assert rows == [("all-gather", gather_rounds), ("all-gather", gather_rounds * blocks),
                    ("reduce-scatter", reduce_rounds), ("reduce-scatter", reduce_rounds * blocks)]


def test_fsdp2_under_pipelining_exposes_one_first_gather_a_step():
    """At --zero 2 under pipelining the stage's first gather opens only the step's first
    forward: exposed once, not once per micro-batch."""
    m = 8
    t = step_time(LLAMA70, setup(dp=16, pp=4, tp=8, sp=True, zero=2, mode="mixed"),
                  1, 8192, m, H100)
    fsdp = [x for x in t.collectives if x.collective.part == "fsdp"]
    gather = next(x for x in fsdp if x.collective.kind == "all-gather")
    scatter = next(x for x in fsdp if x.collective.kind == "reduce-scatter")
    assert gather.collective.count == 1  # the root group, once a step
    exposed = gather.seconds + scatter.seconds / scatter.collective.count
    total = sum(x.seconds for x in fsdp)
    assert total < t.parts["compute"] / 3
    assert t.parts["comm/fsdp"] == pytest.approx(exposed + 0.189 * (total - exposed))
