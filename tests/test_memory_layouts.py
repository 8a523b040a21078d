"""Per-device memory under parallel layouts: micro-batch semantics, sharded rows, 1F1B stages."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.memory import (device_activations, kv_cache_bytes, max_batch, max_context,
                            max_seq_len, memory_report, state_bytes, step_peak)
from gptcalc.memory.engines import engine_for
from gptcalc.memory.engines.ddp import ddp_gradient_buckets

GIB = 2**30


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["gpt2", "llama2-7b", "llama3-8b", "gpt3-13b"]),
       dp=st.sampled_from([1, 3, 8]), zero=st.sampled_from([0, 1, 2, 3]),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       mode=st.sampled_from(["fp32", "amp", "mixed", "bf16"]),
       attn=st.sampled_from(["manual", "sdpa"]),
       recompute=st.sampled_from(["none", "selective", "full"]),
       B=st.sampled_from([1, 2, 5]), accum=st.sampled_from([1, 4]))
def test_no_row_is_larger_than_the_peak_that_contains_it(name, dp, zero, tp, pp, sp, mode, attn,
                                                         recompute, B, accum):
    cfg = from_name(name)
    wl = Workload(B, 512, accum)
    setup = TrainingSetup(mode=mode, attn_impl=attn, recompute=recompute, device="cuda", dp=dp,
                          zero=zero, tp=tp, pp=pp, sp=sp and tp > 1)
    rep = memory_report(cfg, wl, setup)
    for row in ("weights", "gradients", "optimizer", "activations", "weight_copies", "logits"):
        assert getattr(rep, row) <= rep.peak.bytes, row
    assert rep.weights + rep.optimizer + rep.activations <= rep.peak.bytes
    assert sum(rep.peak.lines.values()) == rep.peak.bytes
    # sharding never makes a device hold more than one device alone would, but for what the
    # engines add: plain DDP's gradient buckets (a second copy of the gradients, PyTorch's
    # default), DeepSpeed's buffers and its fp32 partition copy beside fp32 weights, and the
    # pipeline schedule's outputs of earlier micro-batches, which it keeps to merge, and
    # DeepSpeed stage 3's flat buffer of gradient partitions, alive for the whole run, and its
    # weights beyond an even partition (small parameters kept whole beside their partitions,
    # stage3_param_persistence_threshold, and per-parameter padding); a pipeline's pp
    # micro-batches accumulate gradients as grad_accum does
    alone = dataclasses.replace(setup, dp=1, zero=0, tp=1, pp=1, sp=False, engine=None)
    buckets = ddp_gradient_buckets(cfg, setup)
    kept = sum(v for k, v in rep.peak.lines.items() if k.startswith(("pipeline:", "DeepSpeed")))
    if engine_for(setup).name == "deepspeed" and zero and mode == "fp32":
        kept += 4 * -(-state_bytes(cfg, setup, rep.peak.stage).params // dp)
    if engine_for(setup).name == "deepspeed" and zero == 3:
        st = state_bytes(cfg, setup, rep.peak.stage)
        kept += st.gradients + st.weights - setup.weight_bytes * -(-st.params // dp)
    alone_wl = Workload(B, 512, max(accum, 2) if pp > 1 else accum)
    assert rep.peak.bytes - buckets - kept <= step_peak(cfg, alone_wl, alone).bytes


def test_dp_never_has_to_divide_the_micro_batch():
    # -B is the micro-batch one device holds; the global batch is derived
    cfg = from_name("llama2-7b")
    setup = TrainingSetup(mode="mixed", zero=3, dp=8)
    rep = memory_report(cfg, Workload(4, 4096, grad_accum=2), setup)
    assert rep.global_batch == 4 * 8 * 2


def test_gpt3_175b_activations_reproduce_korthikanti_et_al():
    # Korthikanti et al. 2022, Table 2: with tensor and sequence parallelism and selective
    # recomputation a layer keeps sbh * 34/t bytes; GPT-3 175B (Brown et al. 2020: h = 12288,
    # L = 96, a = 96) at s = 2048, b = 1, t = 8
    cfg = from_name("gpt3-175b")
    setup = TrainingSetup(mode="mixed", tp=8, sp=True, pp=8, recompute="selective")
    rep = memory_report(cfg, Workload(1, 2048), setup)
    assert rep.breakdown["activations_paper"]["layers"] == 2048 * 1 * 12288 * 96 * 34 // 8
    # the README's example: every per-device row is at most the peak
    for row in (rep.weights, rep.gradients, rep.optimizer, rep.activations, rep.logits):
        assert row <= rep.peak.bytes


def test_the_first_pipeline_stage_holds_pp_micro_batches():
    # 1F1B (Narayanan et al. 2021): the first stage runs pp forwards before its first backward,
    # so it holds pp micro-batches of its L/pp layers = L layers of one micro-batch
    cfg, wl = from_name("gpt2"), Workload(2, 1024)
    one = TrainingSetup(mode="bf16", attn_impl="sdpa", device="cuda")
    four = dataclasses.replace(one, pp=4)
    layers = sum(v for k, v in device_activations(cfg, wl, one).items() if k.startswith("layer/"))
    first = device_activations(cfg, wl, four, "first")
    last = device_activations(cfg, wl, four, "last")
    assert sum(v for k, v in first.items() if k.startswith("layer/")) == layers
    assert sum(v for k, v in last.items() if k.startswith("layer/")) == layers // 4
    assert not any(v for k, v in first.items() if k.startswith("cross_entropy/"))


def test_tensor_parallel_shards_heads_and_vocabulary():
    cfg, wl = from_name("llama3-8b"), Workload(1, 4096)
    # KV cache: 2 x L x context x n_kv_head x head_dim x 2 bytes; tp shards the 8 KV heads
    assert kv_cache_bytes(cfg, 1, 4096, 2, tp=8) == 2 * 32 * 4096 * 1 * 128 * 2
    # Megatron's vocabulary-parallel head: ceil(128256 / 8) rows of 4096 per rank
    rep = memory_report(cfg, wl, TrainingSetup(mode="bf16", tp=8, attn_impl="sdpa"))
    assert rep.logits == 4096 * (128256 // 8) * 2


def test_zero3_states_per_device():
    # ZeRO paper (Rajbhandari et al. 2020, Fig. 1): mixed precision Adam keeps 16 bytes per
    # parameter; stage 3 over N_d devices keeps 16 * Psi / N_d (7.5B model, 64 devices: 1.9 GB).
    cfg = from_name("llama2-7b")
    st_ = state_bytes(cfg, TrainingSetup(mode="mixed", optimizer="adamw", zero=3, dp=64))
    n = 6_738_415_616  # transformers' LlamaForCausalLM count for Llama-2-7b-hf
    shard = -(-n // 64)
    # DeepSpeed (stage3_param_persistence_threshold, 1e5 elements by default) also keeps the
    # 2 x 32 + 1 RMSNorm weights of 4,096 elements whole on every rank
    assert (st_.weights, st_.gradients) == (2 * (shard + 65 * 4096), 2 * shard)
    assert st_.breakdown["optimizer/states"] == 12 * shard


def test_largest_micro_batch_and_sequence_are_exact_boundaries():
    cfg = from_name("llama3-8b")
    setup = TrainingSetup(mode="bf16", attn_impl="sdpa", device="cuda", zero=3, dp=8)
    wl = Workload(1, 4096)
    budget = 80 * GIB
    b = max_batch(cfg, wl, setup, budget)
    assert step_peak(cfg, Workload(b, 4096), setup).bytes <= budget
    assert step_peak(cfg, Workload(b + 1, 4096), setup).bytes > budget
    s = max_seq_len(cfg, wl, setup, budget)
    assert step_peak(cfg.replace(block_size=s + 1), Workload(1, s), setup).bytes <= budget
    assert step_peak(cfg.replace(block_size=s + 1), Workload(1, s + 1), setup).bytes > budget
    c = max_context(cfg, 1, setup, budget)
    assert c > cfg.block_size  # a memory bound past the positions the model has
    assert max_context(cfg, 1, setup, 1) == 0


def test_a_huge_budget_has_no_hidden_ceiling():
    cfg = from_name("debug")
    setup = TrainingSetup()
    b = max_batch(cfg, Workload(1, 16), setup, 2**50)
    assert b > 2_097_151
    assert step_peak(cfg, Workload(b + 1, 16), setup).bytes > 2**50
