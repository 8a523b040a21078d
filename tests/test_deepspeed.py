"""DeepSpeed's ZeRO 1-3 (gptcalc.memory.engines.deepspeed) against DeepSpeed itself on its CPU
accelerator (2 gloo ranks), and the ds_config reader."""

from __future__ import annotations

import json

import pytest

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.memory import step_peak
from gptcalc.memory.engines import resident
from gptcalc.dsconfig import ds_settings, read_ds_config

LLAMA = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                  vocab_size=1601, block_size=32)
# buckets small enough that the model, not DeepSpeed's 5e8-element defaults, decides the peak;
# 512 makes the 4,096-element projections partitioned at stage 3, the 64-element norms persist
SMALL = {"reduce_bucket_size": 4096, "allgather_bucket_size": 4096,
         "stage3_prefetch_bucket_size": 4096, "stage3_param_persistence_threshold": 512,
         "stage3_max_live_parameters": 65536}
# measured: 4 B (stages 1-2) or 8 B (stage 3) of DeepSpeed's own 0-d fp32 scalars that gptcalc
# does not model, of 2.4 MB to 2 GB resident; the step peak 0.022% low at stage 2, 28 B at 3
RESIDENT_TOLERANCE = 0.01
PEAK_TOLERANCE = 0.03


def test_auto_is_resolved_as_the_hugging_face_integration_does():
    # transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_finalize:
    # reduce_bucket_size = hidden^2; stage 3: prefetch int(0.9 hidden^2), persistence 10 hidden
    raw = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
           "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_max_live_parameters": 1e9}}
    out = ds_settings(raw, from_name("gpt2"))
    assert out["zero"] == 3 and out["grad_accum"] == 4
    assert "batch_size" not in out and "mode" not in out  # "auto": the command's own options
    assert dict(out["deepspeed_zero"]) == {"reduce_bucket_size": 768 * 768,
                                           "stage3_prefetch_bucket_size": 530_841,
                                           "stage3_param_persistence_threshold": 7680}


def test_precision_and_stage_come_from_the_file():
    cfg = from_name("gpt2")
    assert ds_settings({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, cfg)[
        "mode"] == "mixed"
    fp16 = ds_settings({"fp16": {"enabled": True}}, cfg)
    assert (fp16["mode"], fp16["autocast_dtype"], fp16["zero"]) == ("mixed", "fp16", 0)
    assert ds_settings({"bf16": {"enabled": False}}, cfg)["mode"] == "fp32"


@pytest.mark.parametrize("raw, words", [
    ({"zero_optimisation": {}}, "unknown keys zero_optimisation"),
    ({"zero_optimization": {"stage": 4}}, "stage must be 0-3"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, "whole number"),
    ({"zero_optimization": {"bucket": 1}}, "unknown keys bucket"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled"),
])
def test_bad_ds_configs_name_the_key(raw, words):
    with pytest.raises(ConfigError, match=words):
        ds_settings(raw, from_name("gpt2"))


def test_a_file_that_is_not_json_is_one_error(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{stage: 3")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_ds_config(str(bad), from_name("gpt2"))
    with pytest.raises(ConfigError):
        read_ds_config(str(tmp_path / "missing.json"), from_name("gpt2"))


def test_stage3_keeps_its_reduce_bucket_and_gradient_partitions():
    # DeepSpeed's defaults: one 5e8-element bf16 reduce bucket for the whole run (stage3.py,
    # _setup_for_real_optimizer) and a 1-byte inf/nan tracker
    kept = resident(LLAMA, TrainingSetup(mode="mixed", dp=2, zero=3))
    assert kept["DeepSpeed reduce bucket (reduce_bucket_size)"] == 2 * 500_000_000
    assert kept["DeepSpeed inf/nan tracker"] == 1
    assert "DeepSpeed reduce bucket (reduce_bucket_size)" not in resident(
        LLAMA, TrainingSetup(mode="mixed", dp=2, zero=2))


CASES = [(z, mode, buckets) for z in (1, 2, 3) for mode in ("mixed", "fp32")
         for buckets in ("default", "small")]
TWIN_WORKLOAD = Workload(2, 32)


def _case_setup(zero: int, mode: str, buckets: str) -> TrainingSetup:
    return TrainingSetup(dp=2, zero=zero, engine="deepspeed", mode=mode,
                         engine_settings=tuple(SMALL.items()) if buckets == "small" else ())


def _threshold_setup(zero: dict) -> TrainingSetup:
    return TrainingSetup(dp=2, zero=3, engine="deepspeed", mode="mixed",
                         engine_settings=tuple({**SMALL, **zero}.items()))


@pytest.fixture(scope="module")
def twin_runs():
    """Every DeepSpeed twin of this module (CASES, then THRESHOLD_CASES) on 2 gloo ranks, in
    one `run_layouts`: the ranks start and import DeepSpeed once, each set-up runs in its own
    forked copy of them. Per-rank results by set-up."""
    pytest.importorskip("deepspeed")
    from reference_model.distributed import run_layouts

    setups = [_case_setup(*c) for c in CASES] + [_threshold_setup(z) for z in THRESHOLD_CASES]
    return dict(zip(setups, run_layouts(LLAMA, TWIN_WORKLOAD, setups)))


@pytest.mark.slow
@pytest.mark.parametrize("zero, mode, buckets", CASES)
def test_deepspeed_twin_resident_and_peak(twin_runs, zero, mode, buckets):
    setup = _case_setup(zero, mode, buckets)
    wl = TWIN_WORKLOAD
    peak = step_peak(LLAMA, wl, setup, stage="first").bytes
    for r in twin_runs[setup]:
        kept = sum(resident(LLAMA, setup, "first", r.rank).values())
        assert abs(kept - r.resident) <= RESIDENT_TOLERANCE * r.resident, (kept, r.resident)
        # the reference model's own buffers (causal mask, rotary tables) are not the engine's
        measured = r.peak - r.peak_categories.get("Buffer", 0)
        assert abs(peak - measured) <= PEAK_TOLERANCE * measured, (peak, measured)


def test_ds_config_json_round_trip(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}))
    out = read_ds_config(str(path), from_name("gpt2"))
    assert out["zero"] == 1 and out["deepspeed_zero"] == ()  # the default is no change


# ---------------------------------------------------------------- stage 3's gathered parameters

from gptcalc.memory.engines.deepspeed import (  # noqa: E402
    stage3_blocks, stage3_gathered, stage3_moments, stage3_trace)
from gptcalc.memory.ledger import Phase  # noqa: E402

# persistence 512 keeps LLAMA's 64-element norms whole; every other threshold is varied
TINY_PERSIST = (("stage3_param_persistence_threshold", 512),)


def _setup(**zero) -> TrainingSetup:
    return TrainingSetup(dp=1, zero=3, mode="mixed",
                         engine_settings=TINY_PERSIST + tuple(zero.items()))


def test_replay_follows_the_coordinators_available_count():
    # DeepSpeed 0.19 on its CPU accelerator, LLAMA, one rank, second step, reuse distance 0
    # and prefetch bucket 5,000: PartitionedParameterCoordinator.__n_available_params after
    # each fetch_sub_module of the forward (read in a hook around it), root to lm_head
    measured = [102464, 108608, 12288, 23552, 34816, 46080, 48128, 52224, 61440, 68608,
                79872, 182336, 182336, 188480, 194624] + [297088] * 14
    setup = _setup(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=5000)
    _, after = stage3_gathered(stage3_trace(LLAMA, setup, 0, 2), setup)
    assert after[:len(measured)] == measured


@pytest.mark.parametrize("zero, forward_end", [
    # DeepSpeed 0.19, CPU accelerator, LLAMA, second step: the non-persistent parameters
    # all-gathered or in flight when the loss is computed (ds_status AVAILABLE or INFLIGHT)
    ({}, 297088),  # the defaults: all of them
    ({"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}, 0),
    ({"stage3_max_reuse_distance": 102465, "stage3_prefetch_bucket_size": 0}, 102464),  # head
    ({"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 5000}, 297088),
    ({"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 5000,
      "stage3_max_live_parameters": 110000}, 113728),
])
def test_forward_end_gathered_elements(zero, forward_end):
    assert stage3_moments(LLAMA, _setup(**zero), 0)[Phase.FORWARD_END] == forward_end


@pytest.mark.parametrize("name, zero", [
    ("llama3-8b", {}), ("llama3-8b", {"stage3_max_reuse_distance": 3 * 10**8}),
    ("llama3-8b", {"stage3_prefetch_bucket_size": 10**9, "stage3_max_live_parameters": 2e9}),
    ("gpt2", {}), ("gpt2", {"stage3_max_reuse_distance": 10**7}),
])
def test_the_replay_over_a_few_blocks_equals_the_replay_over_all(name, zero):
    cfg = from_name(name)
    setup = TrainingSetup(dp=8, zero=3, mode="mixed",
                          engine_settings=tuple((k, int(v)) for k, v in zero.items()))
    few = stage3_blocks(cfg, setup, 0)
    assert stage3_moments(cfg, setup, 0, few) == stage3_moments(cfg, setup, 0, cfg.n_layer)


def test_llama3_70b_holds_about_one_head_and_a_few_modules_not_the_model():
    # defaults at 70B: the head (V E = 1.05e9 elements) is reused next, nothing else is within
    # the 1e9 reuse distance; the prefetcher holds at most a module or two beyond the bucket
    cfg = from_name("llama3-70b")
    setup = TrainingSetup(dp=32, zero=3, mode="mixed")
    out = stage3_moments(cfg, setup, 0)
    head = cfg.vocab_size * cfg.n_embd
    assert head <= out[Phase.FORWARD_END] < head + 2 * cfg.n_embd * cfg.ffn_dim
    assert stage3_blocks(cfg, setup, 0) < cfg.n_layer


# the thresholds scaled to LLAMA (head 102,464 elements; largest block Linear 11,264): each
# alone and in pairs, at 0 and between module sizes
THRESHOLD_CASES = [
    {"stage3_max_reuse_distance": 0},
    {"stage3_prefetch_bucket_size": 0},
    {"stage3_max_live_parameters": 0},
    {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
    {"stage3_max_reuse_distance": 102465, "stage3_prefetch_bucket_size": 0},
    {"stage3_max_reuse_distance": 11265, "stage3_prefetch_bucket_size": 0},
    {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 5000},
    {"stage3_prefetch_bucket_size": 5000, "stage3_max_live_parameters": 110000,
     "stage3_max_reuse_distance": 0},
]


@pytest.mark.slow
@pytest.mark.parametrize("zero", THRESHOLD_CASES, ids=lambda z: ",".join(
    f"{k.replace('stage3_', '')}={v}" for k, v in z.items()))
def test_deepspeed_twin_peak_under_scaled_thresholds(twin_runs, zero):
    setup = _threshold_setup(zero)
    peak = step_peak(LLAMA, TWIN_WORKLOAD, setup, stage="first").bytes
    for r in twin_runs[setup]:
        measured = r.peak - r.peak_categories.get("Buffer", 0)
        assert abs(peak - measured) <= PEAK_TOLERANCE * measured, (peak, measured)
