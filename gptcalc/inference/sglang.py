"""SGLang, a serving engine (`servers.Server`): no profile run; its token pool is what is
left of total x mem_fraction_static after the weights and everything else the process holds
(python/sglang/srt/model_executor/model_runner.py, `profile_max_num_token`), pages of one
token. Its mem_fraction_static default is the release's (`sglang_mem_fraction_static`).
Its pipeline stages are sized together (`sglang_layout`), its data-parallel replicas are
separate servers, and its CUDA graphs live in the reserve outside mem_fraction_static
(`gptcalc.inference.cudagraph`). The version is recorded and printed.
"""

from __future__ import annotations

import dataclasses

from ..config import GPTConfig
from ..errors import ConfigError
from .cudagraph import sglang_capture_bs, sglang_cuda_graph_max_bs
from .servers import Release, Server, parse_version, register
from .vllm import vllm_defaults

NEWEST = "0.5.23"  # the newest release on PyPI (pip index versions sglang, November 2026)


# the reserve's rule by release (`sglang_reserve_mib`): from 0.5.3 the activation and graph
# terms (sgl-project/sglang pull 10975); from 0.5.10 the prefill graphs on by default (0.5.9
# has them opt-in, `enable_piecewise_cuda_graph: bool = False`), torch.compile piecewise
# graphs until 0.5.14, off at pp > 1 and with --cpu-offload-gb; from 0.5.15 breakable graphs
# on CUDA (sglang/srt/model_executor/cuda_graph_config.py, `default_prefill_backend`), which
# neither turns off (`_disable_breakable_cudagraph_if_incompatible`) but which MLA turns off
# until 0.5.17; from 0.5.19 pp > 1 turns them off again (arg_groups/cuda_graph_hook.py: "PP
# prefill graph replay is opt-in"). From 0.5.14 --disable-cuda-graph turns the prefill graphs'
# reserve off, from 0.5.15 the decode graphs'
RESERVE_RULE_SINCE = (0, 5, 3)
PREFILL_GRAPHS_SINCE = (0, 5, 10)
BREAKABLE_SINCE = (0, 5, 15)
BREAKABLE_MLA_SINCE = (0, 5, 18)
BREAKABLE_PP_OFF_SINCE = (0, 5, 19)
EAGER_DROPS_PREFILL_SINCE = (0, 5, 14)
EAGER_DROPS_DECODE_SINCE = (0, 5, 15)


def sglang_prefill_graphs(version: str, pp: int = 1, mla: bool = False, eager: bool = False,
                          cpu_offload: bool = False) -> bool:
    """Whether SGLang captures prefill graphs by default, and reserves memory for them, on a
    CUDA GPU (the release rules above)."""
    v = parse_version(version)
    if v < PREFILL_GRAPHS_SINCE or (eager and v >= EAGER_DROPS_PREFILL_SINCE):
        return False
    if v < BREAKABLE_SINCE:
        return pp == 1 and not cpu_offload
    if mla and v < BREAKABLE_MLA_SINCE:
        return False
    return pp == 1 or v < BREAKABLE_PP_OFF_SINCE


# chunked_prefill_size by the GPU's memory in MiB (`_handle_gpu_memory_settings`): (below
# this many MiB, tokens); the bucket below 35 GiB is 4,096 from 0.5.20 (arg_groups/memory_hook.py)
SGLANG_CHUNKED_PREFILL = ((20 * 1024, 2048), (35 * 1024, 2048), (60 * 1024, 4096),
                          (90 * 1024, 8192), (160 * 1024, 8192))
SGLANG_CHUNKED_PREFILL_ABOVE = 16384
SGLANG_SMALL_GPU_CHUNKED_SINCE = ((0, 5, 20), 4096)


def sglang_chunked_prefill_size(gpu_memory_bytes: int, version: str = NEWEST) -> int:
    """SGLang's default chunked_prefill_size by the GPU's memory in MiB
    (`SGLANG_CHUNKED_PREFILL`, sglang/srt/server_args.py `_handle_gpu_memory_settings`, 0.5.3
    to 0.5.19; sglang/srt/arg_groups/memory_hook.py `handle_gpu_memory_settings`, 0.5.20 on)."""
    mib = gpu_memory_bytes / 2**20
    for below, tokens in SGLANG_CHUNKED_PREFILL:
        if mib < below:
            since, small = SGLANG_SMALL_GPU_CHUNKED_SINCE
            if below == 35 * 1024 and parse_version(version) >= since:
                return small
            return tokens
    return SGLANG_CHUNKED_PREFILL_ABOVE


def sglang_prefill_graph_tokens(max_tokens: int) -> list[int]:
    """The token counts of SGLang's prefill (piecewise) CUDA graphs, each at most max_tokens
    (`_generate_piecewise_cuda_graph_tokens`, 0.5.10; `generate_prefill_cuda_graph_batch_sizes`,
    0.5.23's arg_groups/cuda_graph_hook.py):

        range(4, 33, 4) + range(48, 257, 16) + range(288, 513, 32) + range(576, 1025, 64)
        + range(1280, 4097, 256) + range(4608, max_tokens + 1, 512)
    """
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
             + list(range(4608, max_tokens + 1, 512)))
    return [s for s in sizes if s <= max_tokens]


def sglang_reserve_mib(gpu_memory_bytes: int, tp: int = 1, pp: int = 1,
                       version: str = NEWEST, mla: bool = False, eager: bool = False,
                       cpu_offload: bool = False) -> float:
    """SGLang's reserve outside mem_fraction_static in MiB, by release.

    Before 0.5.3 (sglang/srt/server_args.py at v0.5.2, `ServerArgs.__post_init__`), with
    p = tp x pp: 2.8 + p/10 GiB under 35 GiB (T4, A10, L4, RTX 4090), 9.5 + p/2 GiB under
    90 GiB (A100, H100), 12 + p/2 GiB under 160 GiB (H20, H200), 32 GiB above (B200, MI300X).

    From 0.5.3 (sgl-project/sglang pull 10975; the released wheels' sglang/srt/server_args.py,
    `_handle_gpu_memory_settings`, 0.5.3 to 0.5.19, and sglang/srt/arg_groups/memory_hook.py,
    `handle_gpu_memory_settings` and `reserve_for_graph_mb`, 0.5.20 to 0.5.23):

        512 + 1.5 x max(chunked_prefill_size, 2048) + 2 x cuda_graph_max_bs
            + tp x pp / 8 x 1024 [+ prefill graphs]          at least 10,240 above 60 GiB

    chunked_prefill_size by memory (`sglang_chunked_prefill_size`), cuda_graph_max_bs by
    memory and tp (`cudagraph.sglang_cuda_graph_max_bs`). From 0.5.10 the prefill graphs,
    where captured (`sglang_prefill_graphs`: 0.5.10's `_handle_piecewise_cuda_graph`, later
    the prefill backend's incompatibility rules), add 8 MiB a captured token count
    (`sglang_prefill_graph_tokens` up to chunked_prefill_size), 1.5 GiB flat with MLA, before
    the 10 GiB floor. `eager` (--disable-cuda-graph) drops the prefill graphs' term from
    0.5.14 and the decode graphs' from 0.5.15; earlier releases reserve both anyway.
    Not followed: the architectures SGLang keeps off prefill graphs
    (`is_piecewise_cuda_graph_disabled_model`; from 0.5.15 DeepSeek-V4, from 0.5.17 NemotronH;
    0.5.17 keeps DSA models' graphs under MLA), multimodal checkpoints, a "llama-2" model path
    (prefill graphs capped at 4,096 tokens), AMD GPUs (no prefill graphs under ROCm),
    speculative decoding, DP attention and
    SGLANG_ENABLE_POST_CAPTURE_KV_SIZING (off by default)."""
    mib = gpu_memory_bytes / 2**20
    v = parse_version(version)
    if v < RESERVE_RULE_SINCE:
        p = tp * pp
        if mib < 35 * 1024:
            return (2.8 + p / 10) * 1024
        if mib < 90 * 1024:
            return (9.5 + p / 2) * 1024
        if mib < 160 * 1024:
            return (12 + p / 2) * 1024
        return 32 * 1024
    chunk = sglang_chunked_prefill_size(gpu_memory_bytes, version)
    reserve = 512 + max(chunk, 2048) * 1.5 + tp * pp / 8 * 1024
    if not (eager and v >= EAGER_DROPS_DECODE_SINCE):
        reserve += sglang_cuda_graph_max_bs(gpu_memory_bytes, tp, version) * 2
    if sglang_prefill_graphs(version, pp, mla, eager, cpu_offload):
        reserve += 1.5 * 1024 if mla else len(sglang_prefill_graph_tokens(chunk)) * 8
    if mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return reserve


def sglang_mem_fraction_static(gpu_memory_bytes: int, tp: int = 1, pp: int = 1,
                               version: str = NEWEST, mla: bool = False, eager: bool = False,
                               cpu_offload: bool = False) -> float:
    """SGLang's default mem_fraction_static: the GPU's memory in MiB less the release's
    reserve for activations and CUDA graphs (`sglang_reserve_mib`), as a share rounded to 3
    decimals: round((memory - reserve) / memory, 3)."""
    mib = gpu_memory_bytes / 2**20
    reserve = sglang_reserve_mib(gpu_memory_bytes, tp, pp, version, mla, eager, cpu_offload)
    return round((mib - reserve) / mib, 3)


def sglang_layout(stages: list) -> list:
    """SGLang's pipeline stages (python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py,
    `profile_max_num_token`; sglang/srt/utils `get_available_gpu_memory(distributed=True)`,
    an all-reduce MIN over the world group): every GPU of the tp x pp world sizes its pool from
    the least free memory of any GPU after loading, that of the stage with the most weights on
    the GPU, over its own layers' KV bytes per token (`num_effective_layers`, its stage's):

        tokens of a stage = (total x mem_fraction_static - heaviest stage's weights - non-torch)
                            // its own layers' KV bytes per token

    and the stages hold the same count, the smallest (sgl-project/sglang pull 10214, "KV-cache
    size mismatch across PP ranks", September 2025; in the 0.5.23 wheel
    sglang/srt/mem_cache/kv_cache_configurator.py, `_profile_available_bytes` takes the free
    memory with `distributed=launch_world_size > 1` and `_apply_token_constraints` all-reduces
    the token count with ReduceOp.MIN "across PP ranks"). `stages`: one `pool.KVPool` a stage;
    each is returned with `peer_weights`, the heaviest stage's weights beyond its own.
    The layer split is vLLM's (`weights.pp_partition`; SGLang's test_pp_single_node.py holds
    the same table). Data-parallel replicas without DP attention are separate servers of
    tp x pp GPUs each holding the whole model (sglang/srt/managers/data_parallel_controller.py,
    `launch_dp_schedulers`: per replica its own NCCL port and tp x pp GPUs),
    so their GPUs hold what one replica's do, experts cut over tp only
    (`Server.separate_replicas`). --cpu-offload-gb
    moves the same bytes as vLLM's (the 0.5.23 wheel's sglang/srt/utils/offloader.py,
    `OffloaderV1(cpu_offload_max_bytes=int(cpu_offload_gb * 1024**3))`, parameter by
    parameter from the stage's first layer; earlier releases `set_cpu_offload_max_bytes` and
    `maybe_offload_to_cpu` in sglang/srt/utils; MLA's kv_b_proj, which 0.5.23 keeps resident,
    is not followed); the copy each forward makes of an offloaded layer (`functional_call`)
    is activation memory, which SGLang keeps outside mem_fraction_static."""
    heaviest = max(s.weights for s in stages)
    return [dataclasses.replace(s, peer_weights=heaviest - s.weights) for s in stages]


class SGLang(Server):
    """SGLang's `sglang.launch_server`: a share of the GPU's memory by its size, token pages;
    tensor parallelism and expert parallelism at --ep-size equal to --tp-size only."""

    name = "sglang"
    title = "SGLang"
    default_version = NEWEST
    separate_replicas = True  # `sglang_layout`

    def scheduler_defaults(self, r: Release, gpu_memory_bytes: int, gpu_name: str,
                           max_model_len: int, sliding: bool = False,
                           mla: bool = False) -> tuple[int, int]:
        """The newest vLLM release's (`vllm.vllm_defaults`): SGLang's pool reads neither, and
        its own chunked_prefill_size and max_running_requests are not modelled; the figures
        are printed and cap the requests of the throughput estimate."""
        return vllm_defaults(gpu_memory_bytes, gpu_name)

    def fraction(self, utilization: float | None, gpu_memory_bytes: int, tp: int,
                 pp: int = 1, r: Release | None = None, mla: bool = False,
                 enforce_eager: bool = False, cpu_offload: int = 0) -> float:
        """mem_fraction_static as given, else the release's `sglang_mem_fraction_static` of
        the GPU's memory at tp and pp, refused where the reserve leaves nothing."""
        if utilization is not None:
            return utilization
        frac = sglang_mem_fraction_static(gpu_memory_bytes, tp, pp,
                                          NEWEST if r is None else r.version, mla,
                                          enforce_eager, cpu_offload > 0)
        if not 0 < frac <= 1:
            raise ConfigError("gpu_memory", f"SGLang's default mem_fraction_static for "
                                            f"{gpu_memory_bytes / 2**30:.2f} GiB is {frac:.3g}: "
                                            "too little memory for SGLang's reserve")
        return frac

    def check_layout(self, cfg: GPTConfig, pp: int, dp: int, cpu_offload: int) -> None:
        """Every layout and CPU offload is modelled (`sglang_layout`). SGLang's expert
        parallelism: --ep-size equal to --tp-size (sglang/srt/server_args.py,
        `ServerArgs.__post_init__`: "if self.enable_ep_moe: self.ep_size = self.tp_size"),
        whole experts over the tp GPUs, as vLLM's rule at dp 1."""

    def pipeline_stages(self, stages: list) -> list:
        return sglang_layout(stages)

    def cuda_graphs(self, r: Release, cfg: GPTConfig, weights_dtype: str,
                    gpu_memory_bytes: int, gpu_name: str, tp: int, max_num_seqs: int,
                    max_num_batched_tokens: int, enforce_eager: bool,
                    given: int | None) -> dict:
        """Decode graphs for `cudagraph.sglang_capture_bs` up to the default cuda_graph_max_bs
        (`cudagraph.sglang_cuda_graph_max_bs`, from 0.5.3); their memory is in the reserve
        outside mem_fraction_static, never in the pool, so no estimate is taken (`given`
        refused)."""
        if given is not None:
            raise ConfigError("cuda_graph_memory", "SGLang keeps its CUDA graphs outside "
                                                   "mem_fraction_static; the option is vLLM's")
        max_bs = sglang_cuda_graph_max_bs(gpu_memory_bytes, tp, r.version)
        sizes = () if enforce_eager or max_bs is None else tuple(sglang_capture_bs(max_bs))
        return dict(cuda_graphs=None, cuda_graphs_in_pool=False, graph_sizes=sizes)

    def cuda_graph_words(self, p, given: bool, eager: bool) -> str:
        if not p.graph_sizes:
            return ("; no CUDA graphs (--disable-cuda-graph)" if eager else
                    "; CUDA graphs in the reserve outside mem_fraction_static (their batch "
                    "sizes modelled from SGLang 0.5.3)")
        return (f"; CUDA graphs for {len(p.graph_sizes)} batch sizes up to cuda_graph_max_bs "
                f"{p.graph_sizes[-1]:,} (default), in the reserve outside mem_fraction_static")

    def offload_words(self, r: Release) -> str:
        return " (copied in for each layer's forward, outside the fraction)"

    def check_hybrid(self, words: str, r: Release) -> None:
        raise ConfigError("engine", f"SGLang's pools for the model's {words} "
                                    "are not modelled (vLLM's are: --engine vllm)")

    def check_lora(self) -> None:
        raise ConfigError("enable_lora", "SGLang's LoRA memory pool is not modelled (vLLM's "
                                         "slots are: --engine vllm)")


register(SGLang())

__all__ = ["NEWEST", "SGLang", "sglang_chunked_prefill_size", "sglang_layout",
           "sglang_mem_fraction_static", "sglang_prefill_graph_tokens", "sglang_prefill_graphs",
           "sglang_reserve_mib"]
