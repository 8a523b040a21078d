"""Serving-engine releases: which engine a release runs, and the scheduler defaults its profile
run is sized with.

vLLM: releases before 0.8.0 run the V0 engine by default, 0.8.0 and later the V1 engine (V1 became
the default in 0.8.0; the V0 engine's own defaults are `EngineArgs._set_default_args_v0` in
vllm/engine/arg_utils.py and `SchedulerConfig.__post_init__` in vllm/config.py, 0.7.3). Both
run the sampler over the profile run's last tokens: V0 inside its profile forward
(vllm/worker/model_runner.py, `profile_run`: top-p 0.99, top-k V - 1), V1 since 0.8.0 in
`_dummy_sampler_run` (vllm/v1/worker/gpu_model_runner.py, added by vllm-project/vllm pull 13594
before V1 became the default).

SGLang: no profile run; its mem_fraction_static default is the 2025 releases' (see
`pool.sglang_mem_fraction_static`). The version is recorded and printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

# the newest releases on PyPI (pip index versions vllm / sglang, November 2026)
DEFAULT_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
V1_DEFAULT_SINCE = (0, 8, 0)  # vLLM's first release with the V1 engine as the default
V0_CHUNKED_ABOVE = 32768  # V0 chunks prefills by default above this max_model_len
V0_MAX_NUM_SEQS = 256  # V0's default max_num_seqs
V1_SEQS_REVERTED_SINCE = (0, 8, 4)  # V1's max_num_seqs back to 256 below H100-class cards
MIN_BATCHED_TOKENS = 2048  # V0's max_num_batched_tokens floor, and its chunk when chunking
GiB = 2**30
MiB = 2**20
# vLLM's custom all-reduce (vllm/distributed/device_communicators/custom_all_reduce.py,
# `CustomAllreduce.__init__`), on by default since 0.4.1 (vllm-project/vllm pull 4040)
CUSTOM_AR_SINCE = (0, 4, 1)
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)  # its _SUPPORTED_WORLD_SIZES
CUSTOM_AR_MAX_SIZE = 8192 * 1024  # max_size: the largest tensor it reduces
CUSTOM_AR_RANK_DATA = 8 * 1024 * 1024  # rank_data: the registered pointers' table
_VERSION = re.compile(r"v?(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?:\.?post\d+|\.\d+)?")


@dataclass(frozen=True)
class Release:
    """A serving engine's release and the engine generation it runs by default."""

    server: str
    version: str
    engine: str  # "V0", "V1" (vLLM) or "sglang"

    @property
    def label(self) -> str:
        return f"{self.server} {self.version}" + (f" ({self.engine} engine)"
                                                  if self.server == "vllm" else "")


def parse_version(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of "X.Y.Z", "X.Y" or "X.Y.Z.postN" (the post release ignored)."""
    m = _VERSION.fullmatch(version.strip())
    if m is None:
        raise ConfigError("engine_version", "expected a release such as 0.8.5 or 0.6.4.post1, "
                                            f"got {version!r}")
    return tuple(int(x or 0) for x in m.groups())


def release(server: str, version: str | None = None) -> Release:
    """The release `version` of `server` (default its newest, DEFAULT_VERSIONS)."""
    v = DEFAULT_VERSIONS[server] if version is None else version
    parsed = parse_version(v)
    if server != "vllm":
        return Release(server, v, server)
    return Release(server, v, "V1" if parsed >= V1_DEFAULT_SINCE else "V0")


def scheduler_defaults(r: Release, gpu_memory_bytes: int, gpu_name: str, max_model_len: int,
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


# vLLM subtracts an estimate of its CUDA graphs' memory from the pool by default from 0.20.0:
# vllm/envs.py's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "0" in the 0.19.1 wheel,
# "1" in 0.20.0's (vllm/v1/worker/gpu_worker.py then logs "CUDA graph memory profiling is
# enabled (default since v0.21.0)", a release late)
CUDA_GRAPHS_PROFILED_SINCE = (0, 20, 0)


def cuda_graphs_profiled(r: Release) -> bool:
    """The release charges its CUDA graphs' estimated memory to the pool (vLLM 0.20.0 and
    later, `gptcalc.inference.cudagraph`)."""
    return r.server == "vllm" and parse_version(r.version) >= CUDA_GRAPHS_PROFILED_SINCE


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
    if r.server != "vllm" or parse_version(r.version) < CUSTOM_AR_SINCE:
        return 0
    if tp not in CUSTOM_AR_WORLD_SIZES:
        return 0
    return 2 * CUSTOM_AR_MAX_SIZE + CUSTOM_AR_RANK_DATA


__all__ = ["CUDA_GRAPHS_PROFILED_SINCE", "DEFAULT_VERSIONS", "Release", "cuda_graphs_profiled",
           "custom_all_reduce_bytes", "parse_version", "release",
           "scheduler_defaults"]
