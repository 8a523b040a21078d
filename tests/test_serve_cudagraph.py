"""CUDA graphs under `serve`: vLLM's capture sizes and graph estimate against a published log,
the releases that take the estimate from the pool, --enforce-eager, and SGLang's capture
batch sizes by GPU memory."""

from __future__ import annotations

import pytest

from gptcalc import from_name
from gptcalc.inference.cudagraph import (LOGGED_SAMPLE, sglang_capture_bs,
                                         sglang_cuda_graph_max_bs, vllm_capture_sizes,
                                         vllm_graph_counts, vllm_graph_estimate_bytes)
from gptcalc.inference.pool import kv_pool
from tests.test_serve import run, serve_json

GiB = 2**30
MiB = 2**20
H100 = int(79.19 * GiB)
ARGS = dict(gpu_name="h100-sxm", non_torch=GiB // 4, max_num_batched_tokens=8192,
            max_num_seqs=1024, utilization=0.95)

# vLLM 0.19.0 serving Llama-3.1-8B-Instruct on one H100 at max_num_seqs 1024 and
# max_num_batched_tokens 8192: the compilation config it prints (llm-d-incubation/
# llm-d-planner@d3121e05, accuracy/results/v0.19.0/logs/
# meta-llama-llama-3-1-8b--h100-80gb--tp1pp1dp1--16384.log, "'cudagraph_capture_sizes': [...]")
LOGGED_CAPTURE_SIZES = [
    1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152,
    160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256, 272, 288, 304, 320, 336,
    352, 368, 384, 400, 416, 432, 448, 464, 480, 496, 512]
# the same log: "Estimated CUDA graph memory: 0.84 GiB total"; "Graph capturing finished in 3
# secs, took 0.91 GiB"; "increase --gpu-memory-utilization from 0.9500 to 0.9606 to maintain
# the same effective KV cache size", total memory 79.19 GiB
LOGGED_ESTIMATE_GIB = 0.84
LOGGED_CAPTURE_GIB = 0.91
LOGGED_UTILIZATION_RAISED = 0.9606
# The estimate is vLLM's own extrapolation from two graphs; its log puts the capture 7.7%
# above it ("difference: 0.07 GiB (7.7%)"): the bound the default may claim against a capture
GRAPH_TOLERANCE = 0.08


def test_the_capture_sizes_are_the_logged_ones():
    assert vllm_capture_sizes(1024, 8192) == LOGGED_CAPTURE_SIZES
    assert vllm_graph_counts(1024, 8192) == {"PIECEWISE": 51, "FULL": 51}


@pytest.mark.parametrize("seqs, largest", [(3, 4), (4, 8), (127, 248), (128, 256),
                                           (255, 496), (256, 512), (1024, 512)])
def test_the_largest_capture_size_on_both_sides_of_each_step(seqs, largest):
    # m = min(2 x max_num_seqs, 512): 8 first at m = 8, 256 first at m = 256 (0.20.0: no
    # sizes appended)
    assert vllm_capture_sizes(seqs, 8192, "0.20.0")[-1] == largest


@pytest.mark.parametrize("tokens, largest", [(255, 248), (256, 256), (511, 496), (512, 512)])
def test_max_num_batched_tokens_caps_the_capture_sizes(tokens, largest):
    assert vllm_capture_sizes(1024, tokens, "0.20.0")[-1] == largest


@pytest.mark.parametrize("seqs, full", [(255, 34), (256, 35)])
def test_full_decode_graphs_stop_at_max_num_seqs(seqs, full):
    # 256 and 255 sequences both capture PIECEWISE up to 512 (m 512, 510 -> 496); FULL decode
    # graphs only up to max_num_seqs one-token requests, 256 included at 256
    counts = vllm_graph_counts(seqs, 8192, "0.30.0")
    assert counts["FULL"] == full


@pytest.mark.parametrize("version, appended", [("0.20.0", False), ("0.20.1", True)])
def test_max_num_batched_tokens_is_captured_from_0_20_1(version, appended):
    # vllm/config/vllm.py: "ensure max_num_tokens is captured if within max capture size"
    assert (300 in vllm_capture_sizes(1024, 300, version)) is appended
    assert vllm_capture_sizes(1024, 300, version)[-1] == (300 if appended else 288)


@pytest.mark.parametrize("version, largest, count", [("0.27.0", 512, 51), ("0.28.0", 1024, 83)])
def test_a_b200_captures_up_to_1024_from_0_28(version, largest, count):
    # default_max_graph_size = 1024 if current_platform.is_device_capability_family(100)
    sizes = vllm_capture_sizes(1024, 8192, version, sm100=True)
    assert (sizes[-1], len(sizes)) == (largest, count)
    assert vllm_capture_sizes(1024, 8192, version)[-1] == 512  # not on an H100


@pytest.mark.parametrize("version, appended", [("0.30.0", False), ("0.31.0", True)])
def test_max_num_seqs_is_captured_from_0_31(version, appended):
    # uniform_decode_sizes = [max_num_seqs] when it is at most the capture ceiling
    sizes = vllm_capture_sizes(100, 8192, version)
    assert (100 in sizes) is appended
    assert vllm_graph_counts(100, 8192, version)["FULL"] == 3 + 12 + appended  # 1, 2, 4, 8..96


def test_the_estimate_is_the_logged_total():
    est = vllm_graph_estimate_bytes(vllm_graph_counts(1024, 8192))
    assert est == 260 * MiB + 50 * 6 * MiB + 50 * 6 * MiB  # the log's two per-mode lines
    assert round(est / GiB, 2) == LOGGED_ESTIMATE_GIB
    assert round(0.95 + est / H100, 4) == LOGGED_UTILIZATION_RAISED
    assert abs(est / GiB - LOGGED_CAPTURE_GIB) <= GRAPH_TOLERANCE * LOGGED_CAPTURE_GIB


def test_one_graph_per_mode_holds_only_the_shared_memory():
    assert vllm_graph_estimate_bytes({"PIECEWISE": 1, "FULL": 1}) == max(
        LOGGED_SAMPLE["PIECEWISE"][0], LOGGED_SAMPLE["FULL"][0])
    assert vllm_graph_estimate_bytes({"PIECEWISE": 0, "FULL": 0}) == 0
    # a per-graph sample below 1 MiB counts as 1 MiB
    assert vllm_graph_estimate_bytes({"PIECEWISE": 3}, {"PIECEWISE": (MiB, 10)}) == 3 * MiB


@pytest.mark.parametrize("version, in_pool", [("0.19.1", False), ("0.20.0", True),
                                               ("0.21.0", True)])
def test_the_pool_pays_for_the_graphs_from_0_20(version, in_pool):
    # vllm/envs.py, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: default "0" in the 0.19.1 wheel,
    # "1" in 0.20.0's and 0.21.0's
    cfg = from_name("llama3-8b")
    pool = kv_pool(cfg, H100, engine_version=version, **ARGS)
    eager = kv_pool(cfg, H100, engine_version=version, enforce_eager=True, **ARGS)
    est = 860 * MiB
    assert pool.cuda_graphs == est and eager.cuda_graphs == 0
    assert pool.cuda_graphs_in_pool is in_pool
    assert eager.kv_cache - pool.kv_cache == (est if in_pool else 0)


def test_0_19_0_is_the_logged_pool():
    # the same log: "Available KV cache memory: 58.11 GiB", the estimate logged, not taken
    pool = kv_pool(from_name("llama3-8b"), H100, engine_version="0.19.0", **ARGS)
    assert pool.cuda_graphs == 860 * MiB and not pool.cuda_graphs_in_pool
    assert round(pool.kv_cache / GiB, 2) == 58.17  # test_serve's pinned 0.19.0 row


@pytest.mark.parametrize("version, modelled", [("0.18.1", False), ("0.19.0", True)])
def test_the_estimate_is_modelled_from_0_19(version, modelled):
    pool = kv_pool(from_name("llama3-8b"), H100, engine_version=version, **ARGS)
    assert (pool.cuda_graphs is not None) is modelled
    assert bool(pool.graph_sizes) is modelled


@pytest.mark.parametrize("version, preset, weights, nothing", [
    # each release's vllm/config/vllm.py, `_is_default_v2_model_runner_model` and
    # DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, read from its wheel; Model Runner V2's
    # profile_cudagraph_memory returns 0 from 0.22.0 to 0.28.x
    ("0.21.0", "llama3-8b", "bf16", False),   # no default V2 runner yet
    ("0.22.0", "llama3-8b", "bf16", False),   # only Qwen3ForCausalLM listed
    ("0.22.0", "qwen3-8b", "bf16", True),
    ("0.23.0", "llama3-8b", "bf16", True),    # Llama listed, dense, unquantised
    ("0.23.0", "llama3-8b", "fp8", False),    # quantised: V1
    ("0.24.0", "llama3-8b", "fp8", True),     # listed is enough
    ("0.24.0", "qwen3-30b-a3b", "bf16", False),  # Qwen3MoeForCausalLM not listed
    ("0.24.0", "deepseek-v2-lite", "bf16", True),
    ("0.25.0", "qwen3-30b-a3b", "bf16", False),  # MoE, not listed
    ("0.25.0", "gpt2", "bf16", True),         # any dense model
    ("0.28.0", "llama3-8b", "bf16", True),
    ("0.29.0", "llama3-8b", "bf16", False),   # the V2 runner estimates
])
def test_model_runner_v2_takes_nothing_from_the_pool_until_0_29(version, preset, weights,
                                                                nothing):
    cfg = from_name(preset)
    pool = kv_pool(cfg, H100, engine_version=version, weights_dtype=weights, **ARGS)
    assert (pool.cuda_graphs == 0) is nothing
    assert pool.cuda_graphs_in_pool and bool(pool.graph_sizes)


def test_a_logged_estimate_replaces_the_default():
    cfg = from_name("llama3-8b")
    given = kv_pool(cfg, H100, engine_version="0.21.0", cuda_graph_memory=2 * GiB, **ARGS)
    eager = kv_pool(cfg, H100, engine_version="0.21.0", enforce_eager=True, **ARGS)
    assert eager.kv_cache - given.kv_cache == 2 * GiB


@pytest.mark.parametrize("gib, tp, max_bs", [
    (20 - 1 / 1024, 1, 8), (20, 1, 48), (20, 4, 160), (35 - 1 / 1024, 3, 48), (35, 3, 32),
    (35, 4, 160), (60 - 1 / 1024, 1, 32), (60, 1, 256), (60, 4, 512), (90, 3, 256),
    (160 - 1 / 1024, 4, 512), (160, 1, 512)])
def test_sglang_cuda_graph_max_bs_on_both_sides_of_each_bucket(gib, tp, max_bs):
    # SGLang 0.5.23's wheel, sglang/srt/arg_groups/memory_hook.py: below 20, 35, 60, 90 and
    # 160 GiB (in MiB), the larger figure at tp >= 4
    assert sglang_cuda_graph_max_bs(int(gib * GiB), tp, "0.5.23") == max_bs


@pytest.mark.parametrize("version, small, large", [
    # the bucket below 35 GiB, read from each release's wheel (sglang/srt/server_args.py,
    # `_handle_gpu_memory_settings`, then arg_groups/memory_hook.py): none set by the
    # bucket rule in 0.5.2 (pull 10975 came in 0.5.3)
    ("0.5.2", None, None), ("0.5.3", 16, 80), ("0.5.4", 16, 80), ("0.5.5", 24, 80),
    ("0.5.19", 24, 80), ("0.5.20", 48, 160)])
def test_sglang_small_gpu_max_bs_by_release(version, small, large):
    l4 = int(22.05 * GiB)
    assert sglang_cuda_graph_max_bs(l4, 1, version) == small
    assert sglang_cuda_graph_max_bs(l4, 4, version) == large
    # the H100 bucket is the same in every modelled release
    assert sglang_cuda_graph_max_bs(H100, 1, version) == (None if small is None else 256)


def test_sglang_capture_batch_sizes():
    # `_generate_cuda_graph_batch_sizes`, by hand: 1, 2, 4, 8, 12, then 16 to 256 by 8, 272
    # to 496 by 16, 512 on by 32
    assert sglang_capture_bs(24) == [1, 2, 4, 8, 12, 16, 24]
    assert len(sglang_capture_bs(256)) == 5 + 31
    assert sglang_capture_bs(512)[-3:] == [480, 496, 512]
    assert len(sglang_capture_bs(512)) == 5 + 31 + 15 + 1


def test_sglang_graphs_live_outside_the_pool():
    cfg = from_name("llama3-8b")
    # at one fraction: --disable-cuda-graph changes the default fraction itself from 0.5.14
    # (tests/test_serve.py, `test_sglang_reserve_by_release_and_setting`), never the pool
    with_graphs = kv_pool(cfg, H100, engine="sglang", gpu_name="h100-sxm", utilization=0.83)
    without = kv_pool(cfg, H100, engine="sglang", gpu_name="h100-sxm", enforce_eager=True,
                      utilization=0.83)
    assert with_graphs.kv_cache == without.kv_cache
    assert with_graphs.graph_sizes[-1] == 256 and without.graph_sizes == ()


def test_the_cli_names_the_graphs_and_refuses_sglang_estimates():
    out = serve_json("--preset", "llama3-8b", "--engine-version", "0.20.0")
    assert out["cuda_graphs"] == 860 * MiB and out["cuda_graphs_in_pool"]
    assert "CUDA graphs from the pool (51 sizes" in out["assumptions"]
    eager = serve_json("--preset", "llama3-8b", "--engine-version", "0.20.0", "--enforce-eager")
    assert eager["kv_cache"] - out["kv_cache"] == 860 * MiB
    assert "no CUDA graphs (--enforce-eager)" in eager["assumptions"]
    res = run("serve", "--preset", "llama3-8b", "--engine", "sglang", "--cuda-graph-memory", "1GiB")
    assert res.exit_code == 2
    assert res.output.strip().count("\n") == 0 and "--cuda-graph-memory" in res.output
