"""The serving-engine interface and its registry, and a release of an engine.

A serving engine is one module of `gptcalc.inference` that defines a subclass of `Server` and
registers one instance with `register`; the package imports it, so the pool
(`gptcalc.inference.pool.kv_pool`), `KVPool` and `gptcalc serve` ask the registry
(`server_named`, `names`) and never name an engine. `vllm` and `sglang` are the two modelled.

A serving engine answers a fixed set of questions; the defaults here are an engine that sizes
its pool from a share of the GPU's memory with no profile run (SGLang's rule):

- `release`: the engine generation a release runs (`Release`); `label`: its words;
- `scheduler_defaults`: (max_num_batched_tokens, max_num_seqs) when none are given;
- `fraction`, `fraction_option`, `default_block_size`: its share of the GPU's memory and its
  pages;
- `check_layout`, `check_hybrid`, `check_lora`: the layouts and models it is modelled for,
  else ConfigError naming the option;
- `profile_activation`, `sampler_backend`, `device_context`, `custom_all_reduce_bytes`: what
  its profile run and its process hold besides the weights (none by default);
- `chunked_admission`: a sliding-window layer admits a request with a chunk of
  max_num_batched_tokens beyond its window (vLLM), rather than the window alone;
- `separate_replicas`, `pipeline_stages`: how its data-parallel replicas and its pipeline
  stages share the GPUs' memory (by default as vLLM's: an MoE's experts cut across every
  replica, each stage sized by itself);
- `cuda_graphs`: the CUDA graphs it captures and the memory it takes from the pool for them
  (none modelled by default);
- `offload_words`, `cuda_graph_words`: what the line of assumptions says of its CPU offload
  and its CUDA graphs.

Every function here is pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..config import GPTConfig
from ..errors import ConfigError, one_of

_VERSION = re.compile(r"v?(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?:\.?post\d+|\.\d+)?")


@dataclass(frozen=True)
class Release:
    """A serving engine's release and the engine generation it runs by default."""

    server: str
    version: str
    engine: str  # the generation: "V0", "V1" (vLLM), else the server's own name

    @property
    def label(self) -> str:
        """"vllm 0.8.0 (V1 engine)"; the generation named where the server has several."""
        return f"{self.server} {self.version}" + (f" ({self.engine} engine)"
                                                  if self.engine != self.server else "")


def parse_version(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of "X.Y.Z", "X.Y" or "X.Y.Z.postN" (the post release ignored)."""
    m = _VERSION.fullmatch(version.strip())
    if m is None:
        raise ConfigError("engine_version", "expected a release such as 0.8.5 or 0.6.4.post1, "
                                            f"got {version!r}")
    return tuple(int(x or 0) for x in m.groups())


class Server:
    """A serving engine: how it sizes its KV pool on one GPU. Subclasses set the class
    attributes and override the methods whose default does not hold for them."""

    name: ClassVar[str]  # --engine's value
    title: ClassVar[str]  # its name in prose ("vLLM")
    default_version: ClassVar[str]  # its newest release, taken when none is given
    fraction_option: ClassVar[str] = "mem_fraction_static"  # its share's option
    default_block_size: ClassVar[int] = 1  # tokens per page
    profile_run: ClassVar[bool] = False  # its activations are inside its share of memory
    chunked_admission: ClassVar[bool] = False
    # its data-parallel replicas are separate servers, each holding the whole model on its own
    # tp x pp GPUs (SGLang without DP attention); False: one world of tp x pp x dp GPUs, an
    # MoE's experts cut across all tp x dp of them (vLLM)
    separate_replicas: ClassVar[bool] = False
    default_fraction: ClassVar[float]  # its share of the GPU's memory when none is given
    # (max_num_batched_tokens, max_num_seqs) of `scheduler_defaults`, where they are fixed
    batch_defaults: ClassVar[tuple[int, int]]

    def release(self, version: str | None = None) -> Release:
        """The release `version` (default `default_version`) and the generation it runs."""
        v = self.default_version if version is None else version
        parse_version(v)
        return Release(self.name, v, self.name)

    def scheduler_defaults(self, r: Release, gpu_memory_bytes: int, gpu_name: str,
                           max_model_len: int, sliding: bool = False,
                           mla: bool = False) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs) where none are given."""
        return self.batch_defaults

    def fraction(self, utilization: float | None, gpu_memory_bytes: int, tp: int,
                 pp: int = 1, r: Release | None = None, mla: bool = False,
                 enforce_eager: bool = False, cpu_offload: int = 0) -> float:
        """Its share of the GPU's memory: `utilization` where given (the pool checks it), else
        `default_fraction` (an engine whose default depends on the layout, the release, the
        model's attention, --enforce-eager or CPU offload reads them)."""
        return self.default_fraction if utilization is None else utilization

    def check_layout(self, cfg: GPTConfig, pp: int, dp: int, cpu_offload: int) -> None:
        """Raise ConfigError for a pipeline or data-parallel layout or a CPU offload that is
        not modelled; none is by default."""
        if pp > 1 or dp > 1 or cpu_offload:
            raise ConfigError("engine", f"{self.title}'s pipeline and data parallel layouts "
                                        "and CPU offload are not modelled")

    def check_hybrid(self, words: str, r: Release) -> None:
        """Raise ConfigError where the release's pools for a hybrid model's `words` (its
        Mamba / DeltaNet layers) are not modelled; they are not by default."""
        raise ConfigError("engine", f"{self.title}'s pools for the model's {words} are not "
                                    "modelled")

    def check_lora(self) -> None:
        """Raise ConfigError where its LoRA memory (--enable-lora) is not modelled."""
        raise ConfigError("enable_lora", f"{self.title}'s LoRA memory pool is not modelled")

    def sampler_backend(self, r: Release, sampler: str | None) -> str | None:
        """The sampler backend of its profile run (`sampler.SAMPLERS`); None: no profile run."""
        return None

    def profile_activation(self, cfg: GPTConfig, r: Release, tokens: int, seqs: int, tp: int,
                           act_bytes: int, backend: str | None, gpu_name: str,
                           last_stage: bool, moe_tp: int, offloaded: int,
                           layer_weights: int) -> dict[str, int]:
        """The activation peak its pool is sized after, by line; {} when it has no profile
        run. `offloaded`: weight bytes of the stage held in host memory, `layer_weights`
        one of its layers' on the GPU."""
        return {}

    def device_context(self, r: Release) -> int:
        """Bytes of its CUDA context it charges to the pool as non-torch memory (0: none)."""
        return 0

    def custom_all_reduce_bytes(self, r: Release, tp: int) -> int:
        """Its own communication buffers on each GPU of a tensor-parallel group of tp."""
        return 0

    def pipeline_stages(self, stages: list) -> list:
        """The pipeline's stages (`pool.KVPool`, one each) as the engine sizes them together,
        before every worker takes the fewest blocks; by default each sized by itself."""
        return stages

    def cuda_graphs(self, r: Release, cfg: GPTConfig, weights_dtype: str,
                    gpu_memory_bytes: int, gpu_name: str, tp: int, max_num_seqs: int,
                    max_num_batched_tokens: int, enforce_eager: bool,
                    given: int | None) -> dict:
        """`pool.KVPool`'s CUDA graph fields: `cuda_graphs` (their memory as the engine
        estimates it, None where not modelled), `cuda_graphs_in_pool` (the release takes it
        from the pool) and `graph_sizes` (the batch sizes captured; none with `enforce_eager`).
        `given`: an estimate a log printed (--cuda-graph-memory, at least 0), refused by an
        engine that takes nothing from its pool for its graphs. None modelled by default."""
        if given is not None:
            raise ConfigError("cuda_graph_memory", f"{self.title}'s CUDA graph memory is not "
                                                   "modelled")
        return dict(cuda_graphs=None, cuda_graphs_in_pool=False, graph_sizes=())

    def offload_words(self, r: Release) -> str:
        """How the release reads weights held in host memory (" (...)"), "" for nothing."""
        return ""

    def cuda_graphs_profiled(self, r: Release) -> bool:
        """The release subtracts its CUDA graphs' estimated memory from the pool."""
        return False

    def cuda_graph_words(self, p, given: bool, eager: bool) -> str:
        """What the line of assumptions says of the CUDA graphs of pool `p` (`pool.KVPool`,
        its `cuda_graphs`, `graph_sizes`), `given` whether --cuda-graph-memory was, `eager`
        whether graphs are off ("; ..."); "" for nothing."""
        return ""


_REGISTRY: dict[str, Server] = {}
DEFAULT = "vllm"  # the engine most deployments serve with: first among the names, --engine's


def register(server: Server) -> Server:
    """Make `server` known by its name; a name taken twice raises."""
    if server.name in _REGISTRY:
        raise ValueError(f"a serving engine named {server.name!r} is registered already")
    _REGISTRY[server.name] = server
    return server


def unregister(name: str) -> None:
    """Forget the serving engine `name` (tests that register one of their own)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered serving engine's name, the default first, then as registered."""
    return tuple(sorted(_REGISTRY, key=lambda n: n != DEFAULT))


def server_named(name: str) -> Server:
    """The serving engine `name`; an unknown name is ConfigError("engine")."""
    return _REGISTRY[one_of("engine", name, names())]


def release(server: str, version: str | None = None) -> Release:
    """The release `version` of `server` (default its newest, `Server.default_version`)."""
    return server_named(server).release(version)


def scheduler_defaults(r: Release, gpu_memory_bytes: int, gpu_name: str, max_model_len: int,
                       sliding: bool = False, mla: bool = False) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) as release `r` sets them
    (`Server.scheduler_defaults`)."""
    return server_named(r.server).scheduler_defaults(r, gpu_memory_bytes, gpu_name,
                                                     max_model_len, sliding, mla)


def cuda_graphs_profiled(r: Release) -> bool:
    """The release charges its CUDA graphs' estimated memory to the pool
    (`Server.cuda_graphs_profiled`, `gptcalc.inference.cudagraph`)."""
    return server_named(r.server).cuda_graphs_profiled(r)


def custom_all_reduce_bytes(r: Release, tp: int) -> int:
    """The release's own all-reduce buffers on each GPU of tp (`Server.custom_all_reduce_bytes`)."""
    return server_named(r.server).custom_all_reduce_bytes(r, tp)


__all__ = ["DEFAULT", "Release", "Server", "cuda_graphs_profiled", "custom_all_reduce_bytes",
           "names", "parse_version", "register", "release", "scheduler_defaults", "server_named",
           "unregister"]
