"""SGLang, a serving engine (`servers.Server`): no profile run; its token pool is what is
left of total x mem_fraction_static after the weights and everything else the process holds
(python/sglang/srt/model_executor/model_runner.py, `profile_max_num_token`), pages of one
token. Its mem_fraction_static default is the 2025 releases' (`sglang_mem_fraction_static`).
The version is recorded and printed.
"""

from __future__ import annotations

from ..config import GPTConfig
from ..errors import ConfigError
from .servers import Release, Server, register
from .vllm import vllm_defaults

NEWEST = "0.5.23"  # the newest release on PyPI (pip index versions sglang, November 2026)


def sglang_mem_fraction_static(gpu_memory_bytes: int, tp: int = 1) -> float:
    """SGLang's default mem_fraction_static: the GPU's memory less a reserve for activations
    and CUDA graphs, as a share rounded to 3 decimals (sglang/srt/server_args.py,
    `ServerArgs.__post_init__`, 2025 releases). Reserve, with p = tp: 2.8 + p/10 GiB under
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


class SGLang(Server):
    """SGLang's `sglang.launch_server`: a share of the GPU's memory by its size, token pages;
    tensor parallelism and expert parallelism at --ep-size equal to --tp-size only."""

    name = "sglang"
    title = "SGLang"
    default_version = NEWEST

    def scheduler_defaults(self, r: Release, gpu_memory_bytes: int, gpu_name: str,
                           max_model_len: int, sliding: bool = False,
                           mla: bool = False) -> tuple[int, int]:
        """The newest vLLM release's (`vllm.vllm_defaults`): SGLang's pool reads neither, and
        its own chunked_prefill_size and max_running_requests are not modelled; the figures
        are printed and cap the requests of the throughput estimate."""
        return vllm_defaults(gpu_memory_bytes, gpu_name)

    def fraction(self, utilization: float | None, gpu_memory_bytes: int, tp: int) -> float:
        """mem_fraction_static as given, else `sglang_mem_fraction_static` of the GPU's
        memory, refused where the reserve leaves nothing."""
        if utilization is not None:
            return utilization
        frac = sglang_mem_fraction_static(gpu_memory_bytes, tp)
        if not 0 < frac <= 1:
            raise ConfigError("gpu_memory", f"SGLang's default mem_fraction_static for "
                                            f"{gpu_memory_bytes / 2**30:.2f} GiB is {frac:.3g}: "
                                            "too little memory for SGLang's reserve")
        return frac

    def check_layout(self, cfg: GPTConfig, pp: int, dp: int, cpu_offload: int) -> None:
        # SGLang's expert parallelism: --ep-size equal to --tp-size (sglang/srt/server_args.py,
        # `ServerArgs.__post_init__`: "if self.enable_ep_moe: self.ep_size = self.tp_size"),
        # whole experts over the tp GPUs, as vLLM's rule at dp 1
        if pp > 1 or dp > 1 or cpu_offload:
            raise ConfigError("engine", "SGLang's pipeline and data parallel layouts and CPU "
                                        "offload are not modelled (vLLM's are: --engine vllm)")

    def check_hybrid(self, words: str, r: Release) -> None:
        raise ConfigError("engine", f"SGLang's pools for the model's {words} "
                                    "are not modelled (vLLM's are: --engine vllm)")

    def check_lora(self) -> None:
        raise ConfigError("enable_lora", "SGLang's LoRA memory pool is not modelled (vLLM's "
                                         "slots are: --engine vllm)")


register(SGLang())

__all__ = ["NEWEST", "SGLang", "sglang_mem_fraction_static"]
