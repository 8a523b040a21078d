"""CUDA graphs of the serving engines: which batch sizes they capture, and the memory vLLM
takes from its KV pool for them.

vLLM (V1, `vllm serve` without --enforce-eager). The capture sizes
(vllm/config/vllm.py, `VllmConfig._set_cudagraph_sizes`): m = min(2 x max_num_seqs, 512),
at most max_num_batched_tokens, then

    [1, 2, 4] + range(8, min(m + 1, 256), 8) + range(256, m + 1, 16)     (each <= m)

and, as each release's wheel shows: from 0.20.1 max_num_batched_tokens itself when it is at
most m; from 0.28.0 m = min(2 x max_num_seqs, 1,024) on compute capability 10.x (B200); from
0.31.0 max_num_seqs itself (the largest uniform decode batch) when it is at most m.

The default cudagraph_mode FULL_AND_PIECEWISE captures a PIECEWISE graph (prefill and mixed
batches) at every size and a FULL graph (uniform decode, one token a request) at every size
of at most max_num_seqs requests; the 0.19.0 log below shows both lists ("Capturing CUDA
graphs (mixed prefill-decode, PIECEWISE): 51/51", "(decode, FULL): 51/51").

Before sizing the pool vLLM estimates the graphs' memory (vllm-project/vllm pull 30515,
`GPUModelRunner.profile_cudagraph_memory`, vllm/v1/worker/gpu_model_runner.py): per mode it
captures two graphs into a throwaway pool, takes the first's memory as shared and the
second's as the cost of each further graph (at least 1 MiB), and sums

    estimate = max over modes of first-capture + sum over modes of per-graph x (graphs - 1)

From 0.20.0 the worker subtracts that estimate from the pool by default: vllm/envs.py reads
VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS with default "0" in the 0.19.0 and 0.19.1 wheels,
"1" in 0.20.0 and every later one (its log line says "default since v0.21.0"); before, the
graphs are captured after sizing the pool, in what gpu_memory_utilization leaves. From 0.22.0
some models run on Model Runner V2 by default (`VllmConfig.use_v2_model_runner`), whose
`profile_cudagraph_memory` returns 0 until 0.29.0 (vllm/v1/worker/gpu/model_runner.py: "It is
TBD whether we keep this API or not"; vllm-project/vllm#49224): those releases take
nothing from the pool for those models (`v2_runner_estimates_nothing`). From 0.29.0 the V2
runner estimates too (vllm/v1/worker/gpu/cudagraph_utils.py, PIECEWISE graphs captured in
full, FULL ones extrapolated from the largest two); `serve` gives it the same figures.

The first-capture and per-graph figures are measured by the engine on the device and cannot
be derived from the configuration: the defaults are one published log's (`LOGGED_SAMPLE`),
and `--cuda-graph-memory` takes a log's own total.

SGLang (python/sglang/srt/server_args.py, `ServerArgs._handle_gpu_memory_settings` and
`_generate_cuda_graph_batch_sizes`): decode graphs for the batch sizes up to
cuda_graph_max_bs, whose default depends on the GPU's memory and tp; their memory lives in
the reserve outside mem_fraction_static, never in the token pool.

The functions here take a release of the engine they are named for; the engines' registry
entries (`gptcalc.inference.vllm`, `gptcalc.inference.sglang`, `Server.cuda_graphs`) call
them.
"""

from __future__ import annotations

from .servers import Release, parse_version

MiB = 2**20
MAX_CAPTURE_SIZE = 512  # vLLM's largest default capture size (`_set_cudagraph_sizes`)
SM100_MAX_CAPTURE_SIZE = 1024  # on compute capability 10.x, from 0.28.0
SM100_SINCE = (0, 28, 0)
ADDS_BATCHED_TOKENS_SINCE = (0, 20, 1)  # "ensure max_num_tokens is captured"
ADDS_MAX_NUM_SEQS_SINCE = (0, 31, 0)  # uniform_decode_sizes = [max_num_seqs]
SM100_GPUS = ("b200",)  # the catalogue's compute capability 10.x cards
# vLLM subtracts the estimate from the pool by default from 0.20.0: vllm/envs.py's
# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "0" in the 0.19.1 wheel, "1" in 0.20.0's
# (vllm/v1/worker/gpu_worker.py then logs "CUDA graph memory profiling is enabled (default
# since v0.21.0)", a release late)
CHARGED_SINCE = (0, 20, 0)
# Model Runner V2's placeholder estimate (0) in the releases where some models default to it:
# 0.22.0 (`_is_default_v2_model_runner_model` first in vllm/config/vllm.py) to 0.28.x (0.29.0's
# runner calls `_profile_cudagraph_memory`), read from each release's wheel
V2_RUNNER_DEFAULT_SINCE = (0, 22, 0)
V2_RUNNER_ESTIMATES_SINCE = (0, 29, 0)
# DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES of each release (vllm/config/vllm.py), the entries that
# `serve`'s model types name, and the rule `_is_default_v2_model_runner_model` applies:
#   "dense-listed": listed, not MoE and not quantised; "listed": listed;
#   "listed-or-dense": listed or not MoE, a hybrid model only when listed (0.25 and 0.26 never)
V2_DEFAULT_RULES = (
    ((0, 22, 0), frozenset({"Qwen3ForCausalLM"}), "dense-listed"),
    ((0, 23, 0), frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}),
     "dense-listed"),
    ((0, 24, 0), frozenset({"Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                            "GraniteMoeForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}),
     "listed"),
    ((0, 25, 0), frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                            "GraniteMoeForCausalLM"}), "listed-or-dense"),
    ((0, 28, 0), frozenset({"DeepseekV2ForCausalLM", "DeepseekV4ForCausalLM",
                            "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"}), "listed-or-dense"),
)
# transformers model_type -> the architecture vLLM registers for it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "deepseek_v4": "DeepseekV4ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "granitemoe": "GraniteMoeForCausalLM"}
# The capture list and modes above are the ones a 0.19.0 log prints (`LOGGED_SAMPLE`); the
# estimate is modelled from that release on, where it is logged (vLLM 0.19.0 says "In v0.19,
# CUDA graph memory profiling will be enabled by default ... To try it now, set
# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1", which 0.21.0 then did)
MODELLED_SINCE = (0, 19, 0)
# One log's figures, per mode (first-capture, per-graph) in bytes: vLLM 0.19.0 serving
# Llama-3.1-8B-Instruct on one H100 (bf16, max_num_seqs 1024, max_num_batched_tokens 8192),
# llm-d-incubation/llm-d-planner@d3121e05, accuracy/results/v0.19.0/logs/
# meta-llama-llama-3-1-8b--h100-80gb--tp1pp1dp1--16384.log: "Estimated PIECEWISE CUDA graph
# memory: 138.00 MiB first-capture + (51-1) x 6.00 MiB per-graph", "Estimated FULL CUDA graph
# memory: 260.00 MiB first-capture + (51-1) x 6.00 MiB per-graph", "Estimated CUDA graph
# memory: 0.84 GiB total"; the capture itself then "took 0.91 GiB" ("CUDA graph pool memory:
# 0.91 GiB (actual), 0.84 GiB (estimated), difference: 0.07 GiB (7.7%)"). Other models hold
# other figures: the same deployment's logs estimate 0.5 to 1.9 GiB.
LOGGED_SAMPLE = {"PIECEWISE": (138 * MiB, 6 * MiB), "FULL": (260 * MiB, 6 * MiB)}
MIN_PER_GRAPH = MiB  # `profile_cudagraph_memory`: per_graph = max(second sample, 1 << 20)

# SGLang's default cuda_graph_max_bs by the GPU's memory in MiB, from sgl-project/sglang pull
# 10975 (first released in 0.5.3; 0.5.2 sets it only below 35 GiB): (below this many MiB,
# max_bs at tp < 4, at tp >= 4). Read from the released wheels' sglang/srt/server_args.py,
# `_handle_gpu_memory_settings` (0.5.3 to 0.5.19), and sglang/srt/arg_groups/memory_hook.py
# (0.5.20 on): the bucket below 35 GiB is (16, 80) in 0.5.3 and 0.5.4, (24, 80) from 0.5.5,
# (48, 160) from 0.5.20; the others are the same in every release from 0.5.3 to 0.5.23
SGLANG_MAX_BS = ((20 * 1024, 8, 8), (35 * 1024, 48, 160), (60 * 1024, 32, 160),
                 (90 * 1024, 256, 512), (160 * 1024, 256, 512))
SGLANG_SMALL_GPU_MAX_BS = (((0, 5, 3), (16, 80)), ((0, 5, 5), (24, 80)), ((0, 5, 20), (48, 160)))
SGLANG_MAX_BS_SINCE = (0, 5, 3)
SGLANG_MAX_BS_ABOVE = 512  # B200, MI300X
SGLANG_MAX_BS_TP = 4  # the larger max_bs from this tp on


def vllm_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int,
                       version: str = "0.33.0", sm100: bool = False) -> list[int]:
    """vLLM's default CUDA graph capture sizes without speculative decoding (module docstring);
    `sm100`: a compute capability 10.x GPU (`SM100_GPUS`)."""
    v = parse_version(version)
    ceiling = SM100_MAX_CAPTURE_SIZE if sm100 and v >= SM100_SINCE else MAX_CAPTURE_SIZE
    uncapped = min(max_num_seqs * 2, ceiling)
    m = min(uncapped, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= m]
    if m >= 8:
        sizes += list(range(8, min(m + 1, 256), 8))
    if m >= 256:
        sizes += list(range(256, m + 1, 16))
    if v >= ADDS_BATCHED_TOKENS_SINCE and max_num_batched_tokens <= m:
        sizes.append(max_num_batched_tokens)
    if v >= ADDS_MAX_NUM_SEQS_SINCE and max_num_seqs <= uncapped and \
            max_num_seqs <= max_num_batched_tokens:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def vllm_graph_counts(max_num_seqs: int, max_num_batched_tokens: int, version: str = "0.33.0",
                      sm100: bool = False) -> dict[str, int]:
    """Graphs of each mode under FULL_AND_PIECEWISE: a PIECEWISE graph at every capture size,
    a FULL decode graph at every size of at most max_num_seqs one-token requests
    (vllm/v1/cudagraph_dispatcher.py: `x <= uniform_decode_query_len * max_num_seqs`)."""
    sizes = vllm_capture_sizes(max_num_seqs, max_num_batched_tokens, version, sm100)
    return {"PIECEWISE": len(sizes), "FULL": sum(1 for s in sizes if s <= max_num_seqs)}


def vllm_graph_estimate_bytes(counts: dict[str, int],
                              samples: dict[str, tuple[int, int]] = LOGGED_SAMPLE) -> int:
    """vLLM's estimate (`profile_cudagraph_memory`):

        max over modes of first-capture + sum over modes of max(per-graph, 1 MiB) x (n - 1)

    over the modes that capture at least one graph."""
    modes = [m for m, n in counts.items() if n > 0]
    if not modes:
        return 0
    shared = max(samples[m][0] for m in modes)
    return shared + sum(max(samples[m][1], MIN_PER_GRAPH) * (counts[m] - 1) for m in modes)


def graphs_charged_to_pool(r: Release) -> bool:
    """vLLM 0.20.0 and later subtract the graphs' estimate from the KV pool (`CHARGED_SINCE`)."""
    return parse_version(r.version) >= CHARGED_SINCE


def graphs_modelled(r: Release) -> bool:
    """vLLM releases whose graph estimate is modelled (`MODELLED_SINCE`)."""
    return parse_version(r.version) >= MODELLED_SINCE


def v2_runner_estimates_nothing(r: Release, model_type: str, moe: bool, quantised: bool,
                                hybrid: bool) -> bool:
    """The release runs the model on Model Runner V2 by default and that runner estimates its
    graphs as 0 (`V2_RUNNER_DEFAULT_SINCE` to `V2_RUNNER_ESTIMATES_SINCE`, `V2_DEFAULT_RULES`).
    The runner's fallbacks to V1 for features `serve` does not model (speculative decoding,
    sequence parallelism, dual batch overlap) are not followed."""
    v = parse_version(r.version)
    if not V2_RUNNER_DEFAULT_SINCE <= v < V2_RUNNER_ESTIMATES_SINCE:
        return False
    _, listed, rule = [x for x in V2_DEFAULT_RULES if v >= x[0]][-1]
    is_listed = ARCHITECTURES.get(model_type) in listed
    if rule == "dense-listed":
        return is_listed and not moe and not quantised
    if rule == "listed":
        return is_listed
    if hybrid and (v < (0, 27, 0) or not is_listed):
        return False
    return is_listed or not moe


def vllm_cuda_graph_bytes(r: Release, max_num_seqs: int, max_num_batched_tokens: int,
                          enforce_eager: bool = False, given: int | None = None,
                          v2_nothing: bool = False, sm100: bool = False) -> int | None:
    """The graphs' memory on one GPU as vLLM estimates it: `given` (a log's "Estimated CUDA
    graph memory") where given, else `vllm_graph_estimate_bytes` of the default capture list
    with `LOGGED_SAMPLE`'s figures; 0 with --enforce-eager (no graphs) or where Model Runner
    V2 estimates nothing (`v2_nothing`, `v2_runner_estimates_nothing`); None where the release
    is not modelled (before 0.19.0)."""
    if enforce_eager:
        return 0
    if given is not None:
        return given
    if not graphs_modelled(r):
        return None
    if v2_nothing:
        return 0
    return vllm_graph_estimate_bytes(vllm_graph_counts(max_num_seqs, max_num_batched_tokens,
                                                       r.version, sm100))


def sglang_cuda_graph_max_bs(gpu_memory_bytes: int, tp: int = 1,
                             version: str = "0.5.23") -> int | None:
    """SGLang's default cuda_graph_max_bs (`SGLANG_MAX_BS`): by the GPU's memory in MiB, the
    larger figure at tp >= 4, the bucket below 35 GiB by release (`SGLANG_SMALL_GPU_MAX_BS`);
    None before 0.5.3 (not modelled)."""
    v = parse_version(version)
    if v < SGLANG_MAX_BS_SINCE:
        return None
    mib = gpu_memory_bytes / MiB
    for below, small, large in SGLANG_MAX_BS:
        if mib < below:
            if below == 35 * 1024:
                small, large = [f for since, f in SGLANG_SMALL_GPU_MAX_BS if v >= since][-1]
            return large if tp >= SGLANG_MAX_BS_TP else small
    return SGLANG_MAX_BS_ABOVE


def sglang_capture_bs(max_bs: int) -> list[int]:
    """SGLang's decode graph batch sizes without speculative decoding
    (`_generate_cuda_graph_batch_sizes`), each at most max_bs:

        [1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max_bs + 1, 32)
    """
    sizes = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
             + list(range(512, max_bs + 1, 32)))
    return [s for s in sizes if s <= max_bs]
