"""vLLM, a serving engine (`servers.Server`): its releases, its scheduler defaults, and its
pool sized after a profile run (`pool.profile_activation_bytes`, the sampler's pass over the
last tokens, its custom all-reduce and early V1's accounting of the CUDA context) and, from
0.20.0, after its CUDA graphs' estimate (`gptcalc.inference.cudagraph`).

Releases before 0.8.0 run the V0 engine by default, 0.8.0 and later the V1 engine (V1 became
the default in 0.8.0; the V0 engine's own defaults are `EngineArgs._set_default_args_v0` in
vllm/engine/arg_utils.py and `SchedulerConfig.__post_init__` in vllm/config.py, 0.7.3). Both
run the sampler over the profile run's last tokens: V0 inside its profile forward
(vllm/worker/model_runner.py, `profile_run`: top-p 0.99, top-k V - 1), V1 since 0.8.0 in
`_dummy_sampler_run` (vllm/v1/worker/gpu_model_runner.py, added by vllm-project/vllm pull 13594
before V1 became the default).
"""

from __future__ import annotations

from ..config import GPTConfig
from ..errors import ConfigError, one_of
from ..units import binary_bytes
from .cudagraph import (CHARGED_SINCE, SM100_GPUS, graphs_charged_to_pool,
                        v2_runner_estimates_nothing, vllm_capture_sizes, vllm_cuda_graph_bytes)
from .pool import profile_activation_bytes
from .sampler import SAMPLERS, TRITON_SAMPLER_SINCE, sm_count
from .servers import Release, Server, parse_version, register

NEWEST = "0.33.0"  # the newest release on PyPI (pip index versions vllm, November 2026)
V1_DEFAULT_SINCE = (0, 8, 0)  # vLLM's first release with the V1 engine as the default
V0_CHUNKED_ABOVE = 32768  # V0 chunks prefills by default above this max_model_len
V0_MAX_NUM_SEQS = 256  # V0's default max_num_seqs
V1_SEQS_REVERTED_SINCE = (0, 8, 4)  # V1's max_num_seqs back to 256 below H100-class cards
MIN_BATCHED_TOKENS = 2048  # V0's max_num_batched_tokens floor, and its chunk when chunking
GiB = 2**30
# vLLM's custom all-reduce (vllm/distributed/device_communicators/custom_all_reduce.py,
# `CustomAllreduce.__init__`), on by default since 0.4.1 (vllm-project/vllm pull 4040)
CUSTOM_AR_SINCE = (0, 4, 1)
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)  # its _SUPPORTED_WORLD_SIZES
CUSTOM_AR_MAX_SIZE = 8192 * 1024  # max_size: the largest tensor it reduces
CUSTOM_AR_RANK_DATA = 8 * 1024 * 1024  # rank_data: the registered pointers' table
# vLLM subtracts an estimate of its CUDA graphs' memory from the pool by default from 0.20.0
# (`cudagraph.CHARGED_SINCE`, read from the wheels)
CUDA_GRAPHS_PROFILED_SINCE = CHARGED_SINCE
MOE_WORKSPACE_KEPT_SINCE = (0, 19, 0)  # see `persistent_moe_workspace`
# V1 measures non-torch memory from start-up, as V0 does, from vllm-project/vllm pulls 18974
# and 19312 ("[V1] Reuse V0's memory_profiling util for gpu worker memory profiling", June 2025)
MEMORY_PROFILING_V1_SINCE = (0, 9, 2)
# The CUDA context of one process, which early V1 counts as non-torch memory: an estimate, not
# measured here, the figure the training model uses (gptcalc.memory.reserved, which this package
# may not import): with CUDA's lazy module loading PyTorch's maintainers put the bare context at
# about 300 MB, and the worker then loads its cuBLAS, attention and NCCL kernels. It moves the
# pool by its own size.
CUDA_CONTEXT = 500 * 2**20
# vLLM runs hybrid models (Mamba / Gated DeltaNet layers beside attention) in its V1 engine
# from vllm-project/vllm pull 20016 ("Enable V1 for Hybrid SSM/Attention Models", June 2025),
# first released in 0.10.0; earlier releases ran them in V0 with a separate Mamba cache of
# max_num_seqs state slots, which is not modelled
HYBRID_V1_SINCE = (0, 10, 0)


def vllm_scheduler_defaults(r: Release, gpu_memory_bytes: int, gpu_name: str, max_model_len: int,
                            sliding: bool = False, mla: bool = False) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of `vllm serve` as the release sets them.

    V1: chunked prefill always; 8,192 tokens and 1,024 sequences on a GPU of at least 70 GiB
    that is not an A100, else 2,048 and 256 (vllm/engine/arg_utils.py,
    `EngineArgs.get_batch_defaults`, earlier `_set_default_args_v1`, usage context
    OPENAI_API_SERVER), as the current release sets them for every V1 release.
    V1 before 0.8.4: 1,024 sequences on every GPU (V1 raised V0's 256 to 1,024; vllm-project/
    vllm pull 16158, "Revert the default `max_num_seqs` to V0 values for most hardware", April
    2025, after 0.8.3, brought 256 back below H100-class cards).
    V0: 256 sequences; max(max_model_len, 2,048) tokens, or 2,048 when it chunks prefills,
    which it does by default above a max_model_len of 32,768 unless the model has a sliding
    window or MLA (`_set_default_args_v0`, `SchedulerConfig.__post_init__`)."""
    if r.engine == "V0":
        chunked = max_model_len > V0_CHUNKED_ABOVE and not sliding and not mla
        tokens = MIN_BATCHED_TOKENS if chunked else max(max_model_len, MIN_BATCHED_TOKENS)
        return tokens, V0_MAX_NUM_SEQS
    if gpu_memory_bytes >= 70 * GiB and "a100" not in gpu_name.lower():
        return 8192, 1024
    if parse_version(r.version) < V1_SEQS_REVERTED_SINCE:
        return 2048, 1024
    return 2048, 256


def cuda_graphs_profiled(r: Release) -> bool:
    """The release charges its CUDA graphs' estimated memory to the pool (vLLM 0.20.0 and
    later, `cudagraph.graphs_charged_to_pool`)."""
    return graphs_charged_to_pool(r)


def custom_all_reduce_bytes(r: Release, tp: int) -> int:
    """What vLLM's custom all-reduce holds on each GPU of a tensor-parallel group of tp:

        2 x max_size + rank data = 2 x 8 MiB + 8 MiB = 24 MiB

    two buffers it cudaMallocs and shares with its peers (the intermediate results beside its
    synchronisation flags, and the buffer inputs are copied into) and a tensor of 8 MiB for
    the peers' pointers, at tp 2, 4, 6 or 8 within one node, with NVLink between every pair
    beyond two GPUs (`CustomAllreduce.__init__`); 0 otherwise, under SGLang (whose pool
    formula counts whatever the process holds) and before vLLM 0.4.1. The flags themselves
    (`meta_size()`, a few KiB) are not counted; nor are NCCL's buffers, which grow with the
    channels NCCL opens for the topology (the logged non-torch figure holds them)."""
    if parse_version(r.version) < CUSTOM_AR_SINCE:
        return 0
    if tp not in CUSTOM_AR_WORLD_SIZES:
        return 0
    return 2 * CUSTOM_AR_MAX_SIZE + CUSTOM_AR_RANK_DATA


def sort_free_sampler(r: Release) -> bool:
    """vLLM masks top-k/top-p without sorting from 0.17.0 (`sampler` module docstring)."""
    return parse_version(r.version) >= TRITON_SAMPLER_SINCE


def sampler_backend(r: Release, sampler: str | None = None) -> str:
    """The sampler backend of vLLM's profile run (`sampler.SAMPLERS`): `sampler` as given, else
    the release's PyTorch-native path, which sorts before 0.17.0 and runs the Triton kernel from
    0.17.0 (`sort_free_sampler`). FlashInfer's is taken only when asked for: whether it runs
    depends on the install (FlashInfer present, more than 16 SMs, a supported compute
    capability) and on VLLM_USE_FLASHINFER_SAMPLER (vllm/v1/sample/ops/topk_topp_sampler.py,
    `flashinfer_sampler_supported`), which no option of the calculator can see."""
    if sampler is None:
        return "triton" if sort_free_sampler(r) else "sort"
    one_of("sampler", sampler, SAMPLERS)
    if sampler == "triton" and not sort_free_sampler(r):
        raise ConfigError("sampler", f"the Triton top-k/top-p kernel first shipped in vLLM "
                                     f"0.17.0; {r.label} sorts (--sampler sort or flashinfer)")
    return sampler


def persistent_moe_workspace(r: Release) -> bool:
    """vLLM keeps the fused MoE's workspace after the forward (`fused_moe_workspace_bytes`,
    `modular`) in the releases measured holding it: 0.19.0 and later (the activation peaks
    llm-d-incubation/llm-d-planner logs for Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, DeepSeek-V2-Lite
    and Mixtral-8x7B on an H100, accuracy/results/v0.19.0). Earlier releases are modelled
    freeing it after each layer."""
    return parse_version(r.version) >= MOE_WORKSPACE_KEPT_SINCE


def early_v1_accounting(r: Release) -> bool:
    """vLLM's V1 worker before vllm-project/vllm pull 19312 (first in 0.9.2) counted as
    non-torch memory everything in use on the device less torch's allocations
    (vllm/v1/worker/gpu_worker.py, `determine_available_memory`: `total_allocated_bytes =
    mem_get_info()[1] - mem_get_info()[0]`, `non_torch_allocations = total_allocated_bytes -
    torch_allocated_bytes`): the CUDA context too, and any other process on the GPU (the pull
    request's words: "V1's memory profiling incorrectly counts memory used by other processes
    as non_torch_allocations"; vllm-project/vllm pull 18974, "[V1] Fix memory profiling bug",
    traces it to V1's first worker, pull 10528). Pull 18974 measured from the free memory at
    start-up and pull 19312 then moved V1 onto `memory_profiling` (vllm/utils.py), as V0 has
    used since pull 10511; both merged in June 2025, and 0.9.2 is the first release holding
    both (0.9.1 may already hold the first)."""
    return r.engine == "V1" and parse_version(r.version) < MEMORY_PROFILING_V1_SINCE


class VLLM(Server):
    """vLLM's `vllm serve`: gpu_memory_utilization 0.9, blocks of 16 tokens
    (vllm/config/cache.py), the pool what the profile run leaves (`gptcalc.inference.pool`)."""

    name = "vllm"
    title = "vLLM"
    default_version = NEWEST
    fraction_option = "gpu_memory_utilization"
    default_fraction = 0.9
    default_block_size = 16
    profile_run = True
    chunked_admission = True

    def release(self, version: str | None = None) -> Release:
        v = self.default_version if version is None else version
        return Release(self.name, v, "V1" if parse_version(v) >= V1_DEFAULT_SINCE else "V0")

    def scheduler_defaults(self, r: Release, gpu_memory_bytes: int, gpu_name: str,
                           max_model_len: int, sliding: bool = False,
                           mla: bool = False) -> tuple[int, int]:
        return vllm_scheduler_defaults(r, gpu_memory_bytes, gpu_name, max_model_len, sliding,
                                       mla)

    def check_layout(self, cfg: GPTConfig, pp: int, dp: int, cpu_offload: int) -> None:
        """Every layout and CPU offload is modelled."""

    def check_hybrid(self, words: str, r: Release) -> None:
        """Hybrid models are sized for the V1 engine from 0.10.0 (`HYBRID_V1_SINCE`) only."""
        if parse_version(r.version) < HYBRID_V1_SINCE:
            raise ConfigError("engine_version", f"vLLM {r.version} runs the model's "
                                                f"{words} in its V0 engine, whose "
                                                "Mamba cache is not modelled; hybrid models are "
                                                "sized from vLLM 0.10.0 (V1)")

    def check_lora(self) -> None:
        """Its LoRA slots are modelled (`gptcalc.inference.adapters`)."""

    def sampler_backend(self, r: Release, sampler: str | None) -> str | None:
        return sampler_backend(r, sampler)

    def profile_activation(self, cfg: GPTConfig, r: Release, tokens: int, seqs: int, tp: int,
                           act_bytes: int, backend: str | None, gpu_name: str,
                           last_stage: bool, moe_tp: int, offloaded: int,
                           layer_weights: int) -> dict[str, int]:
        """`pool.profile_activation_bytes` as the release runs it; V0 copies one offloaded
        layer back for its forward: a whole layer (the stage's mean), or all that is
        offloaded when that is less."""
        streamed = min(offloaded, layer_weights) if offloaded and r.engine == "V0" else 0
        return profile_activation_bytes(
            cfg, tokens, seqs, tp, act_bytes, engine=r.engine, sort_free=backend == "triton",
            sms=sm_count(gpu_name), moe_kept=persistent_moe_workspace(r),
            last_stage=last_stage, moe_tp=moe_tp, streamed=streamed,
            flashinfer=backend == "flashinfer")

    def device_context(self, r: Release) -> int:
        return CUDA_CONTEXT if early_v1_accounting(r) else 0

    def custom_all_reduce_bytes(self, r: Release, tp: int) -> int:
        return custom_all_reduce_bytes(r, tp)

    def offload_words(self, r: Release) -> str:
        return (" (V0: one layer's copied in for its forward)" if r.engine == "V0"
                else " (V1: read in place over PCIe)")

    def cuda_graphs_profiled(self, r: Release) -> bool:
        return cuda_graphs_profiled(r)

    def cuda_graphs(self, r: Release, cfg: GPTConfig, weights_dtype: str,
                    gpu_memory_bytes: int, gpu_name: str, tp: int, max_num_seqs: int,
                    max_num_batched_tokens: int, enforce_eager: bool,
                    given: int | None) -> dict:
        """vLLM's estimate (`cudagraph.vllm_cuda_graph_bytes`: `given`, else the default
        capture list at one log's per-graph figures; 0 where the release's default Model
        Runner V2 estimates nothing, `cudagraph.v2_runner_estimates_nothing`), taken from the
        pool from 0.20.0 (`cudagraph.graphs_charged_to_pool`), and its capture sizes
        (`cudagraph.vllm_capture_sizes`, the 1,024 ceiling on `cudagraph.SM100_GPUS`). Every
        stage of a pipeline captures its own graphs: each is given the same estimate."""
        sm100 = gpu_name in SM100_GPUS
        v2_nothing = v2_runner_estimates_nothing(
            r, cfg.hf_model_type, cfg.moe, weights_dtype not in ("bf16", "fp16", "fp32"),
            cfg.hybrid)
        estimate = vllm_cuda_graph_bytes(r, max_num_seqs, max_num_batched_tokens,
                                         enforce_eager, given, v2_nothing, sm100)
        sizes = () if enforce_eager or estimate is None else tuple(
            vllm_capture_sizes(max_num_seqs, max_num_batched_tokens, r.version, sm100))
        return dict(cuda_graphs=estimate, cuda_graphs_in_pool=graphs_charged_to_pool(r),
                    graph_sizes=sizes)

    def cuda_graph_words(self, p, given: bool, eager: bool) -> str:
        """How many capture sizes, the estimate's source and whether the pool pays it."""
        if not p.graph_sizes and p.cuda_graphs == 0:
            return "; no CUDA graphs (--enforce-eager)"
        if p.cuda_graphs == 0 and p.graph_sizes:  # captured, estimated as nothing
            return ("; CUDA graphs estimated as 0 by this release's Model Runner V2 (none taken "
                    "from the pool; vllm-project/vllm#49224)")
        if p.cuda_graphs is None:
            return ("; CUDA graphs not counted: this release captures them after sizing the "
                    "pool, in the memory gpu_memory_utilization leaves (modelled from vLLM "
                    "0.19.0)")
        source = ("--cuda-graph-memory" if given else
                  f"{len(p.graph_sizes)} sizes, a Llama-3.1-8B log's figures")
        if p.cuda_graphs_in_pool:  # the amount is a line of the memory table
            return f"; CUDA graphs from the pool ({source})"
        return (f"; CUDA graphs {binary_bytes(p.cuda_graphs)} ({source}) captured after the "
                f"pool, in the {binary_bytes(p.gpu_memory_bytes - p.budget)} left")


register(VLLM())


def vllm_defaults(gpu_memory_bytes: int, gpu_name: str = "") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of the newest vLLM release's `vllm serve`
    (`vllm_scheduler_defaults`): 8192 and 1024 on a GPU of at least 70 GiB that is not an
    A100, else 2048 and 256."""
    return vllm_scheduler_defaults(VLLM().release(), gpu_memory_bytes, gpu_name, 0)


__all__ = ["CUDA_CONTEXT", "CUDA_GRAPHS_PROFILED_SINCE", "HYBRID_V1_SINCE", "NEWEST", "VLLM",
           "cuda_graphs_profiled", "custom_all_reduce_bytes", "early_v1_accounting",
           "persistent_moe_workspace", "sampler_backend", "sort_free_sampler",
           "vllm_defaults", "vllm_scheduler_defaults"]
