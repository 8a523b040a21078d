"""The step's allocation sequence (gptcalc.memory.reserved) and what it reserves: the replay
holds, at its fullest, exactly the step peak the ledger computes; its reserved bytes are steady
after `STEPS` steps; the command line prints them; and torchtitan's published max reserved
memory, against which the gap is stated."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.memory.allocator import simulate
from gptcalc.memory.engines.fsdp2 import FSDP2
from gptcalc.memory.ledger import LOGITS, Phase
from gptcalc.memory.peak import stage_ledger, step_peak
from gptcalc.memory.reserved import (CUDA_CONTEXT_BYTES, STEPS, nccl_buffer_bytes,
                                     nvidia_smi_lines, reserved_bytes, stage_reserved,
                                     step_events)

GiB = 1 << 30


def live_peak(events) -> int:
    """The most bytes the events hold at once, unrounded."""
    live = peak = 0
    sizes: dict = {}
    for event in events:
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
        elif event[0] == "free":
            live -= sizes.pop(event[1])
        peak = max(peak, live)
    return peak


def cuda(**kw) -> TrainingSetup:
    return TrainingSetup(device="cuda", attn_impl="sdpa", **kw)


# one-device and data-parallel set-ups of every engine that shards over dp alone
LAYOUTS = [dict(mode="amp"), dict(mode="bf16"), dict(mode="amp", dp=4, engine="ddp"),
           dict(mode="mixed", dp=4, zero=2, engine="fsdp2"),
           dict(mode="mixed", dp=4, zero=3, engine="fsdp2"),
           dict(mode="mixed", dp=4, zero=1, engine="deepspeed"),
           dict(mode="mixed", dp=4, zero=2, engine="deepspeed"),
           dict(mode="mixed", dp=4, zero=3, engine="deepspeed"),
           dict(mode="amp", dp=4, zero=1, engine="zero-redundancy")]
setups = st.builds(
    lambda layout, recompute, keep, optimizer: cuda(**layout, recompute=recompute,
                                                    keep_logits=keep, optimizer=optimizer),
    st.sampled_from(LAYOUTS), st.sampled_from(["none", "selective", "op", "full"]),
    st.booleans(), st.sampled_from(["adamw", "sgd-momentum", "lion"]))
# LoRA on every Linear: the adapters' own saved lines (`lora/...`) are made in each block and
# the head's with the head. The replay splits a line evenly over the blocks, where LoRA's first
# block saves less than the others (nothing ahead of it needs a gradient), so its moments are
# near the ledger's, not equal: the tests below draw it, the moment-exact one above does not
lora_setups = st.builds(lambda s, mode: dataclasses.replace(
    s, lora_rank=8, lora_targets=("all",), mode=mode, optimizer="adamw"),
    setups, st.sampled_from(["amp", "bf16", "mixed"]))
models = st.builds(lambda name, layers: from_name(name, n_layer=layers),
                   st.sampled_from(["gpt2", "llama3-8b", "debug-moe"]), st.integers(1, 4))
workloads = st.builds(Workload, st.integers(1, 4), st.sampled_from([64, 256, 1024]),
                      st.integers(1, 2))


def marked(events) -> dict:
    """The live bytes at each moment's mark in the last step (the steady one)."""
    live, sizes, out = 0, {}, {}
    for event in events:
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
        elif event[0] == "free":
            live -= sizes.pop(event[1])
        else:
            out[event[1]] = live
    return out


def drawn(cfg, wl, setup) -> None:
    """A set-up the calculator refuses (op recomputation of MoE blocks) is not drawn."""
    try:
        step_peak(cfg, wl, setup)
    except ConfigError:
        assume(False)


@settings(max_examples=40, deadline=None)
@given(models, st.builds(Workload, st.integers(1, 4), st.sampled_from([64, 256, 1024])), setups)
def test_each_moment_of_the_replay_is_the_ledgers(cfg, wl, setup):
    """One micro-batch: the events are the ledger's terms made and freed in the step's order,
    so at each moment's mark of a steady step they hold the ledger's total, to the byte (each
    total is split over tensors by integer division: at most a byte per tensor less). Two
    exceptions, both the ledger's: its last-block moment leaves out the logits a loop keeps
    through backward, which the replay holds; and at FSDP2's reduce-scatter it keeps part of the
    last block's saved tensors, which the replay has freed."""
    drawn(cfg, wl, setup)
    ledger = stage_ledger(cfg, wl, setup, "first")
    events = step_events(cfg, wl, setup)
    tensors = sum(1 for e in events if e[0] == "alloc")
    kept = ledger.get(Phase.BACKWARD_START, LOGITS)
    for phase, live in marked(events).items():
        want = ledger.total(phase) + (kept if phase == Phase.BACKWARD_LAST_BLOCK else 0)
        low = 0 if phase == Phase.REDUCE_SCATTER else want - tensors
        assert low <= live <= want, phase
    assert set(marked(events)) == set(ledger.phases)


@settings(max_examples=25, deadline=None)
@given(models, st.builds(Workload, st.integers(1, 4), st.sampled_from([64, 256, 1024])),
       st.sampled_from([dict(mode="amp"), dict(mode="bf16"),
                        dict(mode="mixed", dp=4, zero=3, engine="fsdp2")]),
       st.sampled_from(["none", "selective", "op", "full"]))
def test_offloaded_activations_leave_the_device_in_the_replay(cfg, wl, layout, recompute):
    """--offload-activations: the forward copies the offloaded lines to the host and frees
    them, the ledger's stash and brought-back terms stand for those still (or again) on the
    device, and the embeddings' offloaded inputs come back for their backward; so at each
    mark the replay holds the ledger's total as without offloading (the same two exceptions),
    and never keeps an offloaded line from the forward to its block's backward."""
    setup = cuda(**layout, recompute=recompute, offload_activations=True)
    drawn(cfg, wl, setup)
    ledger = stage_ledger(cfg, wl, setup, "first")
    events = step_events(cfg, wl, setup)
    tensors = sum(1 for e in events if e[0] == "alloc")
    kept = ledger.get(Phase.BACKWARD_START, LOGITS)
    for phase, live in marked(events).items():
        want = ledger.total(phase) + (kept if phase == Phase.BACKWARD_LAST_BLOCK else 0)
        low = 0 if phase == Phase.REDUCE_SCATTER else want - tensors
        assert low <= live <= want, phase
    assert set(marked(events)) == set(ledger.phases)


def test_offloading_llama3_8b_replays_no_offloaded_line_on_the_device():
    """The case that showed the defect: llama3-8b at 8,192 tokens, amp, offloaded. The replay
    once kept every offloaded line on the device beside the stash and the brought-back block,
    holding 76 GiB more than the ledger at the forward's end (193.4 against 117.1 GiB)."""
    cfg, wl = from_name("llama3-8b"), Workload(1, 8192)
    setup = cuda(mode="amp", offload_activations=True)
    events = step_events(cfg, wl, setup)
    ledger = stage_ledger(cfg, wl, setup, "first")
    assert marked(events)[Phase.FORWARD_END] <= ledger.total(Phase.FORWARD_END)
    assert live_peak(events) <= step_peak(cfg, wl, setup).bytes


# With gradient accumulation the replay makes the first micro-batch's gradients block by block
# and accumulates the second's into them, where the ledger's moments count an engine's
# buffers whole or not at all (FSDP2's reduce-scatter input and, at its reduce-scatter, the
# head's new gradients beside the accumulated ones; DeepSpeed ZeRO-3's gathered parameters):
# the replay's fullest moment may differ from the step peak by up to a block's gradients and an
# engine buffer; 8% covers that on the models drawn here. One micro-batch: exact (above), the
# kept logits at the last block's backward included.
REPLAY_GAP = 0.08


def replayed_peak(cfg, wl, setup) -> int:
    """The step peak as the replay holds it: the ledger's fullest moment with the logits a loop
    keeps counted at the last block's backward too (the ledger's one exception, above)."""
    ledger = stage_ledger(cfg, wl, setup, "first")
    kept = ledger.get(Phase.BACKWARD_START, LOGITS)
    return max(ledger.total(p) + (kept if p == Phase.BACKWARD_LAST_BLOCK else 0)
               for p in ledger.phases)


@settings(max_examples=30, deadline=None)
@given(models, workloads, st.one_of(setups, lora_setups))
# kept logits at the last block's backward: 8.2% above the ledger's step peak on this MoE
# block under selective recompute (the draw that failed when the gap was taken from step_peak)
@example(from_name("debug-moe", n_layer=1), Workload(1, 256),
         cuda(mode="bf16", recompute="selective", keep_logits=True))
def test_the_replay_at_its_fullest_is_near_the_step_peak(cfg, wl, setup):
    drawn(cfg, wl, setup)
    events = step_events(cfg, wl, setup)
    peak = replayed_peak(cfg, wl, setup)
    assert abs(live_peak(events) - peak) <= peak * REPLAY_GAP


@settings(max_examples=25, deadline=None)
@given(models, workloads, st.one_of(setups, lora_setups), st.booleans())
def test_the_cache_is_steady_after_the_replayed_steps(cfg, wl, setup, expandable):
    """A further step reuses the cached segments: the reserved bytes after `STEPS` steps are
    those of any longer run (they never shrink, so they are its max_memory_reserved)."""
    setup = dataclasses.replace(setup, allocator="expandable" if expandable else "default")
    drawn(cfg, wl, setup)
    short = simulate(step_events(cfg, wl, setup, steps=STEPS), expandable)
    longer = simulate(step_events(cfg, wl, setup, steps=STEPS + 2), expandable)
    assert short.reserved == longer.reserved
    assert short.reserved >= short.peak_allocated


@settings(max_examples=30, deadline=None)
@given(models, workloads, lora_setups)
@example(from_name("llama3-8b", n_layer=2), Workload(1, 1024),
         cuda(mode="amp", lora_rank=8, lora_targets=("all",)))
def test_lora_reserved_covers_the_allocated_peak(cfg, wl, setup):
    # every saved line the step peak counts is made in the replay, the adapters' too
    drawn(cfg, wl, setup)
    assert reserved_bytes(cfg, wl, setup) >= step_peak(cfg, wl, setup).bytes


def test_reserved_covers_the_peak_and_takes_the_most_loaded_stage():
    cfg, wl = from_name("gpt2"), Workload(4, 1024)
    setup = cuda(mode="amp", pp=2)
    per_stage = [stage_reserved(cfg, wl, setup, s) for s in ("first", "last")]
    assert reserved_bytes(cfg, wl, setup) == max(per_stage)
    assert reserved_bytes(cfg, wl, setup) >= step_peak(cfg, wl, setup).bytes


def test_blocks_repeat_the_same_tensors():
    # a stage simulated with fewer blocks makes the same per-block tensors, fewer times
    cfg, wl, setup = from_name("gpt2"), Workload(2, 256), cuda(mode="amp")
    full, two = step_events(cfg, wl, setup), step_events(cfg, wl, setup, blocks=2)
    block = {e[1][:2] + e[1][3:]: e[2] for e in full if e[0] == "alloc" and len(e[1]) == 4
             and e[1][1] == "block"}
    assert block and all(block[e[1][:2] + e[1][3:]] == e[2] for e in two
                         if e[0] == "alloc" and len(e[1]) == 4 and e[1][1] == "block")
    assert len(two) < len(full)


def test_every_block_is_simulated_because_reserved_is_not_linear_in_blocks():
    """One more block does not always add the same reserved bytes (a tensor that found a hole
    needs a new segment, or the other way round), so extrapolating from a few simulated blocks
    would not be exact: the stage's reserved bytes are those of all its blocks."""
    cfg, wl, setup = from_name("gpt2"), Workload(8, 1024), cuda(mode="amp")
    r = [stage_reserved(cfg, wl, setup, "first", blocks=n) for n in range(1, 6)]
    assert len({b - a for a, b in zip(r, r[1:])}) > 1
    assert reserved_bytes(cfg, wl, setup) == stage_reserved(cfg, wl, setup, "first",
                                                            blocks=cfg.n_layer)


def test_nccl_buffers_per_communicator():
    # 4 MiB (NCCL_BUFFSIZE) x 32 channels x 2 ring peers = 256 MiB per parallel group
    assert nccl_buffer_bytes(cuda()) == 0
    assert nccl_buffer_bytes(cuda(dp=8)) == 256 << 20
    assert nccl_buffer_bytes(cuda(mode="mixed", dp=8, tp=2, engine="megatron")) == 512 << 20
    lines = nvidia_smi_lines(10 * GiB, cuda(dp=8))
    assert sum(lines.values()) == 10 * GiB + CUDA_CONTEXT_BYTES + (256 << 20)


def run(*args: str):
    return CliRunner().invoke(cli, ["memory", *args])


def test_memory_prints_reserved_and_what_nvidia_smi_shows():
    r = run("--preset", "gpt2", "-B", "4", "--device", "cuda", "--allocator", "expandable",
            "--detail")
    assert r.exit_code == 0, r.output
    assert "caching allocator expandable segments" in r.output.splitlines()[0]
    assert "reserved by the caching allocator (expandable segments" in r.output
    assert "what nvidia-smi shows:" in r.output
    r = run("--preset", "gpt2", "-B", "4", "--device", "cuda", "--dp", "8", "--json")
    out = json.loads(r.stdout)
    assert out["setup"]["allocator"] == "default"
    assert out["reserved"] >= out["peak"]
    assert out["nvidia_smi"] == sum(out["breakdown"]["nvidia_smi"].values())
    assert out["breakdown"]["nvidia_smi"]["NCCL buffers"] == 256 << 20


def test_no_reserved_on_cpu():
    # PyTorch's CPU allocator caches nothing: no reserved figure
    out = json.loads(run("--preset", "shakespeare-char", "--device", "cpu", "--json").stdout)
    assert out["reserved"] is None and out["nvidia_smi"] is None
    assert out["breakdown"]["nvidia_smi"] == {}


def test_a_bad_allocator_is_one_line_naming_the_option():
    r = run("--preset", "gpt2", "--allocator", "cudaMallocAsync")
    assert r.exit_code == 2
    assert "--allocator" in r.output and "Traceback" not in r.output


# torchtitan's published runs, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan,
# torchtitan 9dec370, torch 1963fc8): the "Memory(GiB)" column is train.py's
# `device_mem_stats.max_reserved_gib` (train.py line 393 at 9dec370: torch.cuda.memory_stats'
# "reserved_bytes.all.peak"). Llama 3.1 8B, FSDP (fully_shard per block and at the root,
# ZeRO-3; bf16 parameters, fp32 reduction), local batch 2, seq_len 8192 (train_configs/
# llama3_8b.toml), op-level selective activation checkpointing, `del pred` before backward
# (train.py line 307), AdamW. Table 1 (line 27): 8 GPUs, 82.4 GiB; Table 3 (line 44): 128 GPUs,
# 67.0 GiB.
TORCHTITAN_FSDP = [(8, 82.4), (128, 67.0)]
# gptcalc's reserved sits below the measured: the replay does not make a block's own
# transients (each op's outputs before autograd frees them, the op-level recomputation's);
# torch differs (end of 2024 vs 2.13). FSDP2's sharded gradients are replayed on the
# reduce-scatter stream's own pool and its all-gather buffers on the copy-in stream's. The gap
# is 5.5% at dp 8 (77.85 GiB) and 4.7% at dp 128 (63.83 GiB); with the all-gather buffers on
# the compute stream it was 8.2% and 7.7% (75.64, 61.85 GiB), with the gradients there too
# 11.6% and 8.0%. Stated as at most 10% below, never above: the gap reached plus 4.5 points
# for the unreplayed transients and the torch versions, which a model change may move.
TORCHTITAN_GAP = 0.10


@pytest.mark.parametrize("dp,measured_gib", TORCHTITAN_FSDP)
def test_torchtitan_llama3_8b_fsdp_max_reserved(dp, measured_gib):
    cfg, wl = from_name("llama3-8b"), Workload(2, 8192)
    setup = cuda(mode="mixed", engine="fsdp2", zero=3, dp=dp, recompute="op",
                 keep_logits=False)
    reserved = reserved_bytes(cfg, wl, setup) / GiB
    assert (1 - TORCHTITAN_GAP) * measured_gib <= reserved <= measured_gib


def test_torchtitan_reserved_falls_with_dp_by_the_published_difference():
    # the published runs differ by 15.4 GiB between dp 8 and dp 128 (82.4 - 67.0): the sharded
    # states and, on the reduce-scatter stream's own pool, the sharded gradients; with the
    # gradients on the compute stream (filling the activations' freed blocks) the replay's
    # difference was 11.2 GiB, then 13.8 GiB, and 14.0 GiB with the all-gather buffers on the
    # copy-in stream's pool
    cfg, wl = from_name("llama3-8b"), Workload(2, 8192)
    gib = {dp: reserved_bytes(cfg, wl, cuda(mode="mixed", engine="fsdp2", zero=3, dp=dp,
                                            recompute="op", keep_logits=False)) / GiB
           for dp, _ in TORCHTITAN_FSDP}
    published = TORCHTITAN_FSDP[0][1] - TORCHTITAN_FSDP[1][1]
    assert 0.85 * published <= gib[8] - gib[128] <= published


# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan 820504e; runs of
# torchtitan 9dec370 and torch 1963fc8, December 2024; Memory(GiB) is max reserved), Llama 3.1
# 70B on 256 H100s, FSDP 32 x TP 8, local batch 16, full activation checkpointing, torch.compile
# + Float8: Table 4's "2D" row; seq_len 8192 from train_configs/llama3_70b.toml at 9dec370,
# loss_parallel on (its default), sequence parallel in its plan (parallelize_llama.apply_tp).
# And Table 5's 1F1B row: Llama 3.1 405B on 512 H100s, FSDP 8 x TP 8 x PP 8, local batch 32 in
# pp = 8 micro-batches (pipeline_parallel_microbatches' default) of 4, seq_len 8192.
TORCHTITAN_FSDP_TP = {"70b": 71.9, "405b-1f1b": 82.5}
TORCHTITAN_FSDP_TP_ARGS = {
    "70b": ["--preset", "llama3.1-70b", "-B", "16", "--dp", "32", "--tp", "8"],
    "405b-1f1b": ["--preset", "llama3.1-405b", "-B", "4", "--grad-accum", "8", "--dp", "8",
                  "--tp", "8", "--pp", "8", "--pp-schedule", "1f1b"],
}
# gptcalc's reserved sits below: 68.96 GiB (-4.1%) for the 70B, 73.36 GiB (-11.1%) for the
# 405B's fullest pipeline rank (68.65 and 72.52 GiB with FSDP2's all-gather buffers on the
# compute stream). Before DTensor's gathered Linear inputs (whole b x S x E, also
# inside the recomputed block) and loss_parallel's third vocabulary shard in the loss's backward
# were counted they read 51.25 GiB (-28.7%) and 69.89 GiB (-15.3%). Not modelled: Float8's
# scales and float8 all-gathers, torch.compile's blocks (full recomputation leaves them only the
# block inputs), the pipeline's p2p and schedule buffers beyond the modelled ones, torch end of
# 2024 vs 2.13. Table 4's "2D + AsyncTP" row (67.6 GiB) sits below this figure: async TP (its
# symmetric-memory collectives under compile) is not modelled. Stated: the 70B within 10%
# below, the 405B within 15% below, never above.
TORCHTITAN_FSDP_TP_GAP = {"70b": 0.10, "405b-1f1b": 0.15}


@pytest.mark.parametrize("run", list(TORCHTITAN_FSDP_TP))
def test_torchtitan_llama3_fsdp_by_tensor_parallel_max_reserved(run):
    args = ["memory", *TORCHTITAN_FSDP_TP_ARGS[run], "--seq-len", "8192", "--engine", "fsdp2",
            "--zero", "3", "--sp", "--recompute", "full", "--no-keep-logits", "--json"]
    out = json.loads(CliRunner().invoke(cli, args).output)
    reserved, published = out["reserved"] / GiB, TORCHTITAN_FSDP_TP[run]
    assert (1 - TORCHTITAN_FSDP_TP_GAP[run]) * published <= reserved <= published


@settings(max_examples=15, deadline=None)
@given(models, workloads, st.sampled_from([2, 3]), st.sampled_from(["mixed", "bf16"]))
def test_fsdp2_gradients_are_replayed_on_the_reduce_scatter_stream(cfg, wl, zero, mode):
    """Every gradient FSDP2's backward makes past the head's is on the reduce-scatter stream,
    its all-gather buffers on the copy-in stream (tests/test_fsdp2_streams.py), nothing else
    on either; no other engine names a stream."""
    setup = cuda(mode=mode, engine="fsdp2", zero=zero, dp=4)
    drawn(cfg, wl, setup)
    streams: dict = {}
    for e in step_events(cfg, wl, setup):
        if e[0] == "alloc" and len(e) > 3:
            streams.setdefault(e[3], set()).add(e[1][0] if isinstance(e[1], tuple) else e[1])
    assert set(streams) == {"reduce-scatter", "all-gather copy-in"}
    assert "gradients" in streams["reduce-scatter"]
    assert "head gradient" not in streams["reduce-scatter"]
    assert streams["reduce-scatter"] <= {"gradients", "embedding gradients",
                                         "rest of the gradients"}
    assert "all-gather cast" in streams["all-gather copy-in"]
    assert streams["all-gather copy-in"] - {"all-gather cast", "root all-gather output"} <= (
        FSDP2.gather_terms)
    ddp = cuda(mode="amp", engine="ddp", dp=4)
    assert all(len(e) == 3 for e in step_events(cfg, wl, ddp) if e[0] == "alloc")


def test_reserved_is_not_simulated_beyond_the_block_limit():
    # the replay's cost grows with the blocks: a stage deeper than MAX_SIMULATED_BLOCKS gets
    # null and a line saying so, in constant time
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli
    from gptcalc.memory.reserved import MAX_SIMULATED_BLOCKS

    deep = ["memory", "--preset", "gpt2", "-L", str(10**6), "-B", "1", "--seq-len", "64"]
    out = json.loads(CliRunner().invoke(cli, [*deep, "--json"]).output)
    assert out["reserved"] is None and out["nvidia_smi"] is None
    text = CliRunner().invoke(cli, deep).output
    assert f"not simulated above {MAX_SIMULATED_BLOCKS} blocks" in text
    at = ["memory", "--preset", "gpt2", "-L", str(MAX_SIMULATED_BLOCKS), "-B", "1",
          "--seq-len", "64", "--json"]
    assert json.loads(CliRunner().invoke(cli, at).output)["reserved"] > 0


def test_every_pipeline_rank_has_its_reserved_bytes():
    # uneven split (126 blocks over 8 ranks: 15, 16 x 6, 15): each rank's replay, the
    # command's reserved the largest of them
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli

    args = ["memory", "--preset", "llama3.1-405b", "--dp", "8", "--tp", "8", "--pp", "8",
            "--recompute", "full", "--mode", "mixed", "--seq-len", "8192", "-B", "1", "--json"]
    out = json.loads(CliRunner().invoke(cli, args).output)
    per_rank = [s["reserved"] for s in out["stages"]]
    assert len(per_rank) == 8 and all(r >= s["peak"] for r, s in zip(per_rank, out["stages"]))
    assert out["reserved"] == max(per_rank)
    cpu = json.loads(CliRunner().invoke(cli, [*args, "--device", "cpu"]).output)
    assert all(s["reserved"] is None for s in cpu["stages"])


def test_pipelines_beyond_the_replayed_sizes_are_one_line():
    from click.testing import CliRunner

    from gptcalc.cli import cli
    from gptcalc.schedules import MAX_CHUNKS, MAX_MICRO_BATCHES

    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "-L", str(2 * MAX_CHUNKS),
                                 "--pp", str(2 * MAX_CHUNKS), "--seq-len", "64"])
    assert r.exit_code == 2 and "--pp" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--pp", "2", "--seq-len", "64",
                                 "--grad-accum", str(MAX_MICRO_BATCHES + 2)])
    assert r.exit_code == 2 and "--grad-accum" in r.output


def test_context_parallel_reserved_replays_a_ranks_own_tokens():
    # a cp rank's tensors are those of its T/cp tokens with states over dp x cp: where the
    # ring's moments are not the peak, its replay is that of dp x cp ranks at T/cp tokens
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli

    def run(*args):
        out = CliRunner().invoke(cli, ["memory", "--preset", "llama3.1-8b", "-B", "1",
                                       "--engine", "fsdp2", "--zero", "3", "--mode", "mixed",
                                       "--recompute", "full", "--json", *args])
        return json.loads(out.output)
    cp = run("--seq-len", "131072", "--dp", "1", "--cp", "8")
    dp = run("--seq-len", "16384", "--dp", "8")
    assert cp["peak"] == dp["peak"] and cp["peak_phase"] == "backward start"
    assert cp["reserved"] == dp["reserved"] >= cp["peak"]
