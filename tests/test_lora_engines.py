"""LoRA under the data-parallel engines (FSDP2, DDP, ZeroRedundancyOptimizer, DeepSpeed's ZeRO
1-3): a frozen base has
no gradients, so no engine buffers, reduce-scatters or keeps gradients for it. gptcalc's states
and step peak against the engines run on 2 gloo ranks over the reference model with PEFT-shaped
adapters."""

from __future__ import annotations

import pytest

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.memory import state_bytes, step_peak
from gptcalc.memory.engines import resident
from gptcalc.memory.engines.fsdp2 import (FIRST_BLOCK_REDUCE, LAST_BLOCK_GRADIENTS,
                                          LAST_BLOCK_REDUCE, ROOT_GRADIENTS,
                                          fsdp2_adapter_elements, fsdp2_gradient_elements)
from gptcalc.memory.ledger import Phase
from gptcalc.memory.peak import stage_ledger

# the twins' model: a Llama-shaped reference model whose weights outweigh its activations
TINY = from_name("debug", arch="llama", n_layer=2, n_embd=128, n_head=4, vocab_size=512,
                 block_size=32, dropout=0.0)


def _lora(**kw) -> TrainingSetup:
    kw.setdefault("lora_targets", ("q", "v"))
    return TrainingSetup(lora_rank=kw.pop("lora_rank", 4), keep_logits=False, **kw)


def test_fsdp2_lora_states_as_measured():
    # FSDP2 (fully_shard per block and at the root) on 2 gloo ranks, torch 2.13, reference
    # model with LoRA r 4 on q, v: weights, gradients and AdamW states per rank, tensor nbytes
    st = state_bytes(TINY, _lora(dp=2, zero=3, engine="fsdp2"))
    assert (st.weights, st.gradients, st.optimizer) == (1_320_192, 8_192, 16_416)
    # ZeRO-2 shards the frozen base as ZeRO-3 does (FSDP2 reshards after backward)
    st = state_bytes(TINY, _lora(dp=2, zero=2, engine="fsdp2"))
    assert (st.weights, st.gradients, st.optimizer) == (1_320_192, 8_192, 16_416)
    # MixedPrecisionPolicy: fp32 shards (the master weights), fp32 gradients, AdamW's 8 bytes
    every = ("q", "k", "v", "o", "up", "gate", "down")
    st = state_bytes(TINY, _lora(dp=2, zero=3, engine="fsdp2", mode="mixed",
                                 lora_targets=every))
    assert (st.weights, st.gradients, st.optimizer) == (1_359_104, 47_104, 94_320)


def test_frozen_weights_have_no_fsdp2_gradients():
    setup = _lora(dp=2, zero=3, engine="fsdp2")
    grad = fsdp2_gradient_elements(TINY, setup)
    assert grad == fsdp2_adapter_elements(TINY, setup)
    # lora_A (4, 128) and lora_B (128, 4) of q and of v (4 kv heads of 32), per block; the
    # measured gradient shards, 8,192 B a rank, are 2 blocks of them in fp32 over 2 ranks
    assert grad == {"root": 0, "block": 2 * (4 * 128 + 128 * 4)}
    lines = stage_ledger(TINY, Workload(1, 8), setup, "first")
    assert lines.get(Phase.BACKWARD_END, ROOT_GRADIENTS) == 0
    for phase, term in ((Phase.BACKWARD_END, FIRST_BLOCK_REDUCE),
                        (Phase.REDUCE_SCATTER, LAST_BLOCK_REDUCE),
                        (Phase.REDUCE_SCATTER, LAST_BLOCK_GRADIENTS)):
        assert lines.get(phase, term) == 4 * grad["block"]


def test_qlora_70b_over_two_gpus_holds_no_base_gradients():
    # `memory --preset llama3-70b --engine fsdp2 --zero 3 --dp 2 --lora-rank 16 --lora-targets
    # all --weights-dtype int4`: at the end of backward a rank holds its adapters' gradients
    # (fp32 shards) and the root's unsharded parameters, not the base's 141 GB of fp32 shards
    cfg = from_name("llama3-70b")
    setup = TrainingSetup(dp=2, zero=3, engine="fsdp2", lora_rank=16, mode="mixed",
                          lora_targets=("q", "k", "v", "o", "up", "gate", "down"),
                          base_dtype="nf4", attn_impl="sdpa", device="cuda")
    ledger = stage_ledger(cfg, Workload(1, 8192), setup, "first")
    st = state_bytes(cfg, setup)
    assert st.gradients == 414_187_520  # 207,093,760 adapter parameters x 4 B / 2
    end = ledger.terms(Phase.BACKWARD_END)
    assert sum(v for t, v in end.items() if "gradient" in t.label.lower()) <= st.gradients
    # before: 169,941,326,816 B, the base's fp32 shards counted as gradients
    assert ledger.total(Phase.BACKWARD_END) < 30 * 2**30


def test_ddp_buckets_only_the_adapters():
    from gptcalc.memory.engines.ddp import ddp_gradient_buckets
    setup = _lora(dp=2, zero=0)
    assert ddp_gradient_buckets(TINY, setup) == state_bytes(TINY, setup).gradients == 16_384
    assert resident(TINY, setup)["DDP gradient buckets"] == 16_384


def test_zero_redundancy_partitions_the_adapters_alone():
    # ZeroRedundancyOptimizer over the adapters alone: 8 tensors of 512 elements, 4 a rank
    # (measured on 2 gloo ranks, torch 2.13: 16,400 B of AdamW states and step counters)
    st = state_bytes(TINY, _lora(dp=2, zero=1, engine="zero-redundancy"))
    assert st.optimizer == 8 * 4 * 512 + 4 * 4 == 16_400


# ---------------------------------------------------------------------------- the twins

torch = pytest.importorskip("torch")

# the engines' twins on 2 gloo ranks: FSDP2 ZeRO-3 and 2 in fp32 and in MixedPrecisionPolicy,
# GPT-2's fused qkv, an adapted head, a longer batch, DDP, ZeroRedundancyOptimizer, DeepSpeed
EVERY = ("q", "k", "v", "o", "up", "gate", "down")
GPT2 = from_name("debug", arch="gpt2", n_layer=2, n_embd=128, n_head=4, vocab_size=512,
                 block_size=32, dropout=0.0)
TWIN_LAYOUTS = [
    (TINY, Workload(1, 8), _lora(dp=2, zero=3, engine="fsdp2")),
    (TINY, Workload(1, 8), _lora(dp=2, zero=2, engine="fsdp2")),
    (TINY, Workload(1, 8), _lora(dp=2, zero=3, engine="fsdp2", mode="mixed", lora_targets=EVERY)),
    (TINY, Workload(1, 8), _lora(dp=2, zero=2, engine="fsdp2", mode="mixed", lora_targets=EVERY)),
    (GPT2, Workload(1, 8), _lora(dp=2, zero=3, engine="fsdp2",
                                 lora_targets=("qkv", "o", "up", "down"))),
    (TINY, Workload(1, 8), _lora(dp=2, zero=3, engine="fsdp2", lora_targets=("down", "lm_head"))),
    (TINY, Workload(4, 32), _lora(dp=2, zero=3, engine="fsdp2")),
    (TINY, Workload(1, 8), _lora(dp=2, zero=0)),
    (TINY, Workload(2, 32), _lora(dp=2, zero=0, lora_targets=EVERY)),
    (TINY, Workload(1, 8), _lora(dp=2, zero=1, engine="zero-redundancy")),
    # DeepSpeed's defaults (a 5e8-element reduce bucket), then small buckets so that the rest
    # of the step shows
    (TINY, Workload(1, 8), _lora(dp=2, zero=1, engine="deepspeed")),
    (TINY, Workload(2, 32), _lora(dp=2, zero=1, engine="deepspeed", engine_settings=(
        ("reduce_bucket_size", 4096), ("allgather_bucket_size", 4096)))),
    (TINY, Workload(2, 32), _lora(dp=2, zero=2, engine="deepspeed", mode="mixed",
                                  lora_targets=EVERY, engine_settings=(
                                      ("reduce_bucket_size", 4096),
                                      ("allgather_bucket_size", 4096)))),
]

# measured on 2 gloo ranks, torch 2.13: the FSDP2 layouts' peak is the last block's forward
# all-gather, within 0.1%; the longer batch, DDP and DeepSpeed's ZeRO-1 with small buckets
# peak in the last block's backward, whose gradients in flight the phase model counts up to
# 1.2% high. The bound every pairwise cell of the options is held to, 2%
PEAK_TOLERANCE = 0.02


@pytest.mark.slow
def test_lora_under_the_engines_matches_the_twins():
    from reference_model.distributed import run_each
    for (cfg, wl, setup), results in zip(TWIN_LAYOUTS, run_each(TWIN_LAYOUTS)):
        st = state_bytes(cfg, setup)
        peak = step_peak(cfg, wl, setup).bytes
        for r in results[:1]:  # rank 0, the most loaded (both ranks measure alike here)
            weights = st.weights
            if setup.engine == "deepspeed":  # its twin counts DeepSpeed's flat 16-bit group,
                weights -= st.breakdown["base/weights"]  # not the module's frozen tensors
            assert (weights, st.optimizer) == (r.weights, r.optimizer), setup
            assert r.gradients in (-1, st.gradients), setup  # DeepSpeed's: not measured
            measured = r.peak - r.peak_categories.get("Buffer", 0)
            assert abs(peak - measured) <= PEAK_TOLERANCE * measured, (setup, peak, measured)


# DeepSpeed ZeRO-3 with LoRA on the same 2 gloo ranks (the CPU accelerator, DeepSpeed 0.19),
# DeepSpeed's default thresholds and small ones (persistence 512 elements, buckets 4,096).
# States: the optimizer's (the adapters' fp32 partitions, Adam's states, DeepSpeed's fp32 copy
# in mode fp32, one step counter per sub-group) exact; under the default thresholds every
# tensor of this model is under the persistence threshold (1e5), so each rank holds the whole
# base and adapters beside the adapters' flat partition: the twin's weights exact too. Before
# ZeRO-3's LoRA states were counted this way the base was taken as 1/dp and the fp32 copy
# and the flat partition were missed (weights 1,320,192 B against 2,648,576, optimizer
# 16,416 B against 24,580, fp32). The peak, measured: -0.08% (default thresholds, fp32 and
# mixed), +2.3% (small, fp32) and +1.6% (small, mixed): with small thresholds the stage-3
# gather model counts every non-persistent parameter gathered at the last block's backward,
# about 129 KB more than the twin's moment holds (fp32); the bound is the worst with a margin
DS3_LORA_PEAK_TOLERANCE = 0.03
DS3_SMALL = (("reduce_bucket_size", 4096), ("allgather_bucket_size", 4096),
             ("stage3_prefetch_bucket_size", 4096), ("stage3_param_persistence_threshold", 512),
             ("stage3_max_live_parameters", 65536))
DS3_LAYOUTS = [(TINY, Workload(2, 32), _lora(dp=2, zero=3, engine="deepspeed", attn_impl="sdpa",
                                              mode=mode, engine_settings=settings))
               for mode, settings in (("fp32", ()), ("fp32", DS3_SMALL), ("mixed", DS3_SMALL))]


@pytest.mark.slow
def test_deepspeed_zero3_lora_matches_the_twin():
    from reference_model.distributed import run_each
    for (cfg, wl, setup), results in zip(DS3_LAYOUTS, run_each(DS3_LAYOUTS)):
        st = state_bytes(cfg, setup)
        r = results[0]
        assert st.optimizer == r.optimizer, setup
        if not setup.engine_settings:  # every tensor persistent: the whole model, each rank
            assert st.weights == r.weights, setup
        measured = r.peak - r.peak_categories.get("Buffer", 0)
        peak = step_peak(cfg, wl, setup).bytes
        assert abs(peak - measured) <= DS3_LORA_PEAK_TOLERANCE * measured, (setup, peak,
                                                                            measured)
