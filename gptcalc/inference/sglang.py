"""SGLang, a serving engine (`servers.Server`): no profile run; its token pool is what is
left of total x mem_fraction_static after the weights and everything else the process holds
(python/sglang/srt/model_executor/model_runner.py, `profile_max_num_token`), pages of one
token. Its mem_fraction_static default is the 2025 releases' (`sglang_mem_fraction_static`).
Its pipeline stages are sized together (`sglang_layout`), its data-parallel replicas are
separate servers, and its CUDA graphs live in the reserve outside mem_fraction_static
(`gptcalc.inference.cudagraph`). The version is recorded and printed.
"""

from __future__ import annotations

import dataclasses

from ..config import GPTConfig
from ..errors import ConfigError
from .cudagraph import sglang_capture_bs, sglang_cuda_graph_max_bs
from .servers import Release, Server, register
from .vllm import vllm_defaults

NEWEST = "0.5.23"  # the newest release on PyPI (pip index versions sglang, November 2026)


def sglang_mem_fraction_static(gpu_memory_bytes: int, tp: int = 1) -> float:
    """SGLang's default mem_fraction_static: the GPU's memory less a reserve for activations
    and CUDA graphs, as a share rounded to 3 decimals (sglang/srt/server_args.py,
    `ServerArgs.__post_init__`, 2025 releases). Reserve, with p = tp x pp: 2.8 + p/10 GiB under
    35 GiB (T4, A10, L4, RTX 4090), 9.5 + p/2 GiB under 90 GiB (A100, H100), 12 + p/2 GiB
    under 160 GiB (H20, H200), 32 GiB above (B200, MI300X)."""
    mib = gpu_memory_bytes / 2**20
    if mib < 35 * 1024:
        reserve = (2.8 + tp / 10) * 1024
    elif mib < 90 * 1024:
        reserve = (9.5 + tp / 2) * 1024
    elif mib < 160 * 1024:
        reserve = (12 + tp / 2) * 1024
    else:
        reserve = 32 * 1024
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
                 pp: int = 1) -> float:
        """mem_fraction_static as given, else `sglang_mem_fraction_static` of the GPU's
        memory at parallel_size = tp x pp (sglang/srt/server_args.py,
        `_handle_mem_fraction_static`), refused where the reserve leaves nothing."""
        if utilization is not None:
            return utilization
        frac = sglang_mem_fraction_static(gpu_memory_bytes, tp * pp)
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

__all__ = ["NEWEST", "SGLang", "sglang_layout", "sglang_mem_fraction_static"]
