"""SGLang's layouts under `serve`: pipeline stages (every GPU sized by the least free memory,
the stages holding the same, smallest token count), data-parallel replicas without DP
attention (separate servers, each the whole model) and --cpu-offload-gb, each against the
engine's rule computed here from the independent pieces (`weights.stage_weight_parts`,
`kv.kv_bytes_per_token_layer`)."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc import from_name
from gptcalc.inference.kv import kv_bytes_per_token_layer
from gptcalc.inference.pool import (DEFAULT_NON_TORCH, TP_NVSWITCH_NON_TORCH, cpu_offload_bytes,
                                    kv_pool)
from gptcalc.inference.sglang import sglang_mem_fraction_static
from gptcalc.inference.weights import pp_partition, stage_weight_parts
from tests.test_serve import run

GiB = 2**30
H100 = int(79.22 * GiB)


def _stages(n_layer: int, pp: int):
    parts = pp_partition(n_layer, pp)
    return [(s, s + n) for s, n in zip(itertools.accumulate((0,) + parts[:-1]), parts)]


@settings(max_examples=30, deadline=None)
@given(n_layer=st.integers(2, 40), pp=st.integers(2, 4), tp=st.sampled_from([1, 2]),
       offload_gib=st.sampled_from([0, 0.5, 3]), preset=st.sampled_from(["llama3-8b",
                                                                          "qwen3-8b"]))
def test_sglang_stages_take_the_fewest_tokens_of_the_least_free_memory(n_layer, pp, tp,
                                                                       offload_gib, preset):
    cfg = from_name(preset).replace(n_layer=n_layer)
    if n_layer < pp:
        return
    offload = cpu_offload_bytes(offload_gib)
    p = kv_pool(cfg, H100, engine="sglang", tp=tp, pp=pp, gpu_name="h100-sxm",
                cpu_offload=offload)
    # python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py, profile_max_num_token:
    # rest = min free memory over the world - total x (1 - mem_fraction_static); tokens =
    # rest // (the stage's layers x KV bytes per token and layer); the stages then agree on
    # the smallest count (sgl-project/sglang pull 10214)
    on_gpu = []
    for layers in _stages(n_layer, pp):
        parts = stage_weight_parts(cfg, "bf16", tp, layers, pp)
        on_gpu.append(sum(parts.values()) - min(offload, parts["blocks"]))
    frac = sglang_mem_fraction_static(H100, tp, pp, cpu_offload=offload > 0)
    rest = int(H100 * frac) - max(on_gpu) - p.non_torch
    per_layer = kv_bytes_per_token_layer(cfg, tp, "bf16")
    expected = min(rest // ((end - start) * per_layer) for start, end in _stages(n_layer, pp))
    assert p.utilization == frac
    assert p.kv_tokens == expected
    assert all(s["kv_blocks"] >= expected for s in p.stages)


def test_an_uneven_split_is_sized_by_its_heaviest_stage():
    # 31 layers over 2 stages: 16 + 15; the first holds one layer more, both hold a vocabulary
    # table: the first stage is the heaviest and the one with the most layers
    cfg = from_name("llama3-8b").replace(n_layer=31)
    p = kv_pool(cfg, H100, engine="sglang", pp=2, gpu_name="h100-sxm")
    first, last = p.stages
    assert (first["layers"], last["layers"]) == (16, 15)
    assert first["weights"] > last["weights"]
    # the last stage's own pool would hold more tokens; it takes the first's count, from the
    # same rest of memory (the first stage's weights)
    assert last["kv_blocks"] > first["kv_blocks"] == p.kv_blocks
    assert p.layers == (0, 16) and p.peer_weights == 0


@pytest.mark.parametrize("tp, pp, reserve", [
    # the newest release's reserve in MiB (arg_groups/memory_hook.py, `handle_gpu_memory_settings`):
    # 512 + 1.5 x chunked_prefill_size 8,192 + 2 x cuda_graph_max_bs 256 + "cfg.tp_size *
    # cfg.pp_size / 8 * 1024", and 8 MiB for each of the 58 prefill graph token counts at pp 1
    # only (pipeline parallelism turns the prefill graphs off)
    (1, 2, 512 + 1.5 * 8192 + 2 * 256 + 2 / 8 * 1024),
    (2, 2, 512 + 1.5 * 8192 + 2 * 256 + 4 / 8 * 1024),
    (2, 1, 512 + 1.5 * 8192 + 2 * 256 + 2 / 8 * 1024 + 58 * 8)])
def test_sglangs_reserve_grows_with_tp_times_pp(tp, pp, reserve):
    p = kv_pool(from_name("llama3-8b"), H100, engine="sglang", tp=tp, pp=pp)
    mib = H100 / 2**20
    assert p.utilization == round((mib - reserve) / mib, 3)  # "round((gpu_mem - reserved_mem)
    # / gpu_mem, 3)"


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-30b-a3b"])
def test_sglang_data_parallel_replicas_each_hold_the_whole_model(preset):
    cfg = from_name(preset)
    one = kv_pool(cfg, H100, engine="sglang", tp=2, gpu_name="h100-sxm")
    two = kv_pool(cfg, H100, engine="sglang", tp=2, dp=2, gpu_name="h100-sxm")
    assert (two.weights, two.kv_cache, two.utilization) == (one.weights, one.kv_cache,
                                                            one.utilization)
    if cfg.moe:  # vLLM cuts the experts over tp x dp instead
        vllm_one = kv_pool(cfg, H100, tp=2, gpu_name="h100-sxm")
        vllm_two = kv_pool(cfg, H100, tp=2, dp=2, gpu_name="h100-sxm")
        assert vllm_two.weights < vllm_one.weights


def test_a_replica_is_its_own_world_for_the_default_non_torch_memory():
    cfg = from_name("llama3-8b")
    sglang = kv_pool(cfg, H100, engine="sglang", dp=2, gpu_name="h100-sxm")
    vllm = kv_pool(cfg, H100, dp=2, gpu_name="h100-sxm")
    assert sglang.non_torch == DEFAULT_NON_TORCH
    assert vllm.non_torch == TP_NVSWITCH_NON_TORCH


@pytest.mark.parametrize("gib", [0.5, 4])
def test_sglang_cpu_offload_grows_the_pool_by_the_offloaded_bytes(gib):
    cfg = from_name("llama3-8b")
    # at one fraction: the default's own change with offload in 0.5.10 to 0.5.14 (no prefill
    # graphs, so no reserve for them) is tests/test_serve.py's
    base = kv_pool(cfg, H100, engine="sglang", tp=2, gpu_name="h100-sxm", utilization=0.83)
    off = kv_pool(cfg, H100, engine="sglang", tp=2, gpu_name="h100-sxm", utilization=0.83,
                  cpu_offload=cpu_offload_bytes(gib))
    assert base.weights - off.weights == off.cpu_offload == int(gib * GiB)
    assert off.kv_cache - base.kv_cache == int(gib * GiB)
    assert off.activation == {}  # SGLang's activations, the offloaded copies too, are outside


def test_sglang_cpu_offload_stops_at_the_decoder_layers():
    cfg = from_name("llama3-8b")
    everything = kv_pool(cfg, H100, engine="sglang", cpu_offload=cpu_offload_bytes(1000))
    outer = stage_weight_parts(cfg, "bf16", 1)["outer"]
    assert everything.weights == outer  # the embedding and the head stay on the GPU


def test_sglang_layouts_through_serve():
    r = run("serve", "--preset", "llama3-8b", "--engine", "sglang", "--pp", "2", "--dp", "2",
            "--cpu-offload-gb", "2")
    assert r.exit_code == 0, r.output
    line = r.stdout.splitlines()[1]
    assert "2 pipeline stages of 16/16 layers" in line
    assert "2 data-parallel replicas (separate servers, each the whole model)" in line
    assert "Host memory: 2.00 GiB of weights per GPU, 8.00 GiB pinned for the 4 GPUs." in r.stdout


# --- prefix caching of a hybrid model's states ------------------------------------------------

QWEN3_NEXT = os.path.join(os.path.dirname(__file__), "hybrid", "qwen3-next-80b-a3b-instruct.json")


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_caching_of_states_is_refused_naming_both_engines(mode):
    r = run("serve", "--hf-config", QWEN3_NEXT, "--tp", "4", "--mamba-cache-mode", mode)
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.output
    assert "--mamba-cache-mode" in r.stderr and "mamba radix cache" in r.stderr


def test_one_state_per_request_is_sized():
    r = run("serve", "--hf-config", QWEN3_NEXT, "--tp", "4", "--max-model-len", "32768",
            "--mamba-cache-mode", "none")
    assert r.exit_code == 0 and r.stdout.startswith("Fits: "), r.output
