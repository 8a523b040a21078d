"""Serving engines' KV-cache pools: how vLLM and SGLang size them, per GPU. The pool asks
the engine (`servers.server_named`: `vllm`, `sglang`, or any registered `servers.Server`) for
its release, defaults, checks and profile run, and names none.

vLLM (vllm/v1/worker/gpu_worker.py, `determine_available_memory`; vllm/utils/mem_utils.py,
`memory_profiling`): after loading the weights it runs one profile forward of
max_num_batched_tokens dummy tokens split over min(max_num_seqs, tokens) sequences, logits for
the last token of each only and no KV cache yet (vllm/v1/worker/gpu_model_runner.py,
`profile_run`, `_dummy_run`) and its sampler over those last tokens (`gptcalc.inference.
sampler`), then

    pool   = total memory x gpu_memory_utilization - weights - LoRA slots - activation peak
             - non-torch
    blocks = pool // (block_size x KV bytes per token over every layer)

the KV bytes per token counted by `gptcalc.inference.kv` (the device's key/value heads, one
replicated head per GPU when tp exceeds them; MLA's whole latent on every GPU).

the LoRA slots with --enable-lora (`gptcalc.inference.adapters`), non-torch being what the
process holds outside PyTorch's allocator beyond its CUDA context (NCCL and cuBLAS handles, the
custom all-reduce's buffers at tp > 1: `gptcalc.inference.vllm`). It logs "Available KV
cache memory", "GPU KV cache size: N tokens" (blocks x block_size) and "Maximum concurrency
for C tokens per request" (blocks over the blocks one request of C tokens needs).

SGLang (python/sglang/srt/model_executor/model_runner.py, `profile_max_num_token`): the pool
is what is left of total x mem_fraction_static after the weights and everything else the
process holds (GPU memory free after loading, less total x (1 - mem_fraction_static)): there
the non-torch term includes the CUDA context. Its activations live in the remaining
1 - mem_fraction_static. Pages of one token.

Scope: an MoE block's working set is vLLM's fused-MoE caches (shared experts and the
router's outputs left out); CUDA graphs as the engine captures them (`Server.cuda_graphs`,
`gptcalc.inference.cudagraph`: vLLM's estimate taken from the pool from 0.20.0, captured
after sizing it before); no multimodal encoder memory (`serve`'s line of assumptions says so
for such a checkpoint). The scheduler defaults are the release's
(`Server.scheduler_defaults`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from ..config import GPTConfig
from ..errors import ConfigError, fraction, one_of, positive_int
from ..gpus import GPU, GPUS, usable_memory
from ..layers import (attention_layers, dense_mlp_layers, global_layers, hybrid_layer_words,
                      moe_layers, sliding_layers)
from .adapters import lora_slot_bytes
from .kv import (SSM_CACHE_DTYPES, hybrid_block_size, hybrid_groups, kv_bytes_per_token_layer,
                 state_bytes_per_layer, state_layers)
from .sampler import flashinfer_sampler_bytes, sampler_bytes, sort_free_sampler_bytes
from .servers import DEFAULT as DEFAULT_SERVER
from .servers import Release, Server, server_named
from .weights import (device_weight_bytes, pp_partition, stage_weight_parts,
                      unquantised_bytes)

GiB = 2**30
# Non-torch memory the engine subtracts, beyond the CUDA context: vLLM logs 0.16 GiB for
# Llama-3.2-11B on one H100 (https://github.com/vllm-project/vllm/pull/12126) and 0.20 GiB per
# worker at tp > 1 on 24 GiB GPUs (https://github.com/vllm-project/vllm/pull/14447).
DEFAULT_NON_TORCH = GiB // 5
# At tp >= 2 on NVSwitch machines NCCL's buffers take far more: vLLM 0.19.0 logs 2.07 to 2.13
# GiB of non-torch memory per GPU at tp 2 and 4 on H100 SXM (llm-d-incubation/llm-d-planner,
# accuracy/results/v0.19.0 logs), vLLM 0.9.2 2.21 GiB at tp 4
# (https://github.com/vllm-project/vllm/issues/21348) and an SGLang rank 2.01 GB at tp 4
# (https://github.com/sgl-project/sglang/issues/11716). The smallest of them,
# less vLLM's custom all-reduce buffers (`vllm.custom_all_reduce_bytes`, counted apart).
TP_NVSWITCH_NON_TORCH = int(2.07 * GiB) - 24 * 2**20
# the catalogue's cards on NVSwitch baseboards (HGX) with NCCL's NVLink SHARP and channel
# buffers logged (`gptcalc.gpus`' nvlink_sharp)
NVSWITCH_GPUS = tuple(g.name for g in GPUS.values() if g.nvlink_sharp)


def default_non_torch(gpu_name: str, tp: int) -> int:
    """Non-torch memory per GPU beyond the CUDA context when none is given: the logged
    `TP_NVSWITCH_NON_TORCH` at tp >= 2 on an NVSwitch card, else `DEFAULT_NON_TORCH` (vLLM's
    logs on one GPU and at tp > 1 on PCIe cards)."""
    g = GPUS.get(gpu_name)
    return TP_NVSWITCH_NON_TORCH if tp >= 2 and g is not None and g.nvlink_sharp else \
        DEFAULT_NON_TORCH
POSITION_BYTES = 8  # the int64 position of every token of the profile batch
# E-wide tensors live at a block's peak, besides the branch's working set: transformers keeps
# the embedding output, the block's input, the residual and the normed input (measured,
# reference_model/serve_profile.py); vLLM's Llama (add-and-norm in place) the block's input,
# the residual, the normed attention output and the down projection's output, while its
# gate_up output (2F) and activation (F) are alive: four either way, with 3F.
KEPT_STREAMS = 4
# vLLM's fused MoE runs at most this many tokens at once (VLLM_FUSED_MOE_CHUNK_SIZE's default,
# vllm/envs.py; the chunk loop of `fused_experts_impl`, vllm/model_executor/layers/fused_moe/
# fused_moe.py)
FUSED_MOE_CHUNK = 32768


def layer_blocks_per_request(cfg: GPTConfig, context: int, block_size: int,
                             max_num_batched_tokens: int | None = None) -> int:
    """Per-layer pages one request of `context` tokens may hold: every global layer
    ceil(context / block_size); a sliding-window layer of window W, as vLLM admits a request
    (vllm/v1/kv_cache_interface.py, `SlidingWindowSpec.max_memory_usage_bytes`: the last W - 1
    tokens plus a chunk of max_num_batched_tokens, at most the context, and one page more since
    the window need not start on a page boundary)

        ceil(min(W - 1 + max_num_batched_tokens, context) / block_size) + 1

    With max_num_batched_tokens None (SGLang's token pages), min(W, context) tokens."""
    full = math.ceil(context / block_size)
    if cfg.sliding_window is None:
        return cfg.n_layer * full
    W = cfg.sliding_window
    if max_num_batched_tokens is None:
        windowed = math.ceil(min(context, W) / block_size)
    else:
        windowed = math.ceil(min(W - 1 + max_num_batched_tokens, context) / block_size) + 1
    return global_layers(cfg) * full + sliding_layers(cfg) * windowed


def fused_moe_workspace_bytes(cfg: GPTConfig, tokens: int, tp: int = 1,
                              act_bytes: int = 2, modular: bool = False) -> int:
    """The intermediate caches vLLM's fused MoE allocates for one MoE layer's routed experts,
    M = min(T, 32,768) tokens per chunk (VLLM_FUSED_MOE_CHUNK_SIZE), k experts per token,
    N = 2 I/tp the gate_up projection's rows per GPU (I one expert's width; I/tp for an ungated
    expert, whose activation keeps N), E the model width, a the activation bytes:

      `fused_experts_impl` (vllm/model_executor/layers/fused_moe/fused_moe.py, 0.7 and later),
      freed after each layer:
        cache13 = M x k x max(N, E) x a   the first GEMM's output and the second's, one buffer
        cache2  = M x k x N/2 x a         the activation's output, alive with cache1
      `modular`: `FusedMoEModularKernel` with `TritonExperts` (modular_kernel.py and
      `TritonExperts.workspace_shapes`), buffers shared by every layer and kept after the
      forward ("persistent buffers", `SharedBuffers`):
        workspace13 = M x k x max(N/2, E) x a
        workspace2  = M x k x max(N, E) x a

    Scope: the Triton path (unquantised weights; fp8 and int8 take the same shapes); the
    router's logits, the top-k ids and weights (T x (n_expert + 2k) elements) and
    moe_align_block_size's sorted ids are left out, under 2% of the caches for the models here."""
    M, k, E, a = min(tokens, FUSED_MOE_CHUNK), cfg.n_expert_active, cfg.n_embd, act_bytes
    gated = cfg.mlp in ("swiglu", "geglu")
    N = (2 if gated else 1) * cfg.expert_dim // tp
    if modular:
        return M * k * max(N // 2, E) * a + M * k * max(N, E) * a
    act_out = N // 2 if gated else N
    return M * k * max(N, E) * a + M * k * act_out * a


def mixer_width(cfg: GPTConfig) -> int:
    """A Mamba / Gated DeltaNet layer's widest moment in the profile run, per token: its input
    projection's output and the mixer's output before out_proj (Mamba2: 2 d_inner + 2 G N + h
    and d_inner; Mamba-1: 2 d_inner and d_inner; DeltaNet: 2 Hk dk + 2 Hv dv + 2 Hv and Hv dv).
    An estimate from the layer's shapes, not measured; the scan kernels' chunk buffers are left
    out."""
    if cfg.layer_mixers.upper().count("D"):
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return 2 * Hk * dk + 2 * Hv * dv + 2 * Hv + Hv * dv
    D = cfg.mamba_inner
    if cfg.mamba_version == 1:
        return 3 * D
    return 3 * D + 2 * cfg.mamba_n_groups * cfg.mamba_d_state + cfg.mamba_n_heads


def hybrid_stage_layers(cfg: GPTConfig, start: int, end: int) -> tuple[int, int]:
    """(attention layers, state layers) among blocks [start, end): every layer-kind rule counts
    from block 0, so a stage's are the difference of the cuts at end and start."""
    def upto(n: int) -> tuple[int, int]:
        if n == 0:
            return 0, 0
        cut = cfg.replace(n_layer=n)
        return attention_layers(cut), state_layers(cut)
    (a1, s1), (a0, s0) = upto(end), upto(start)
    return a1 - a0, s1 - s0


def profile_activation_bytes(cfg: GPTConfig, tokens: int, seqs: int, tp: int = 1,
                             act_bytes: int = 2, kept: int = KEPT_STREAMS,
                             engine: str = "V1", cuda: bool = True, sampler: bool = True,
                             sort_free: bool = False, sms: int = 0,
                             moe_kept: bool = False, last_stage: bool = True,
                             moe_tp: int | None = None, streamed: int = 0,
                             flashinfer: bool = False) -> dict[str, int]:
    """The activation peak of one inference forward of `tokens` tokens in `seqs` sequences,
    logits for the last token of each only, no KV cache, nothing kept for a backward: the
    moment with the most live bytes, by line (the lines sum to the peak).

    Inside a block:
        stream    = kept x T x E x a          E-wide tensors alive through a block
        positions = 8 x T                     int64 positions
        branch    = the wider of
          mlp       T x 3 F/tp x a            gated: gate (or gate_up) outputs and the product
                    T x (2 F/tp + E) x a      plain: fc output, activation, projection output
          attention T x ((q + 2 kv)/tp + q/tp) x a   q, k, v and the attention output; a
                                              flash-type kernel, no T x T scores
          moe       `fused_moe_workspace_bytes`  the routed experts' intermediate caches
        (mlp with dense blocks only, moe with MoE blocks only)
    After the blocks, the sampler pass over the last token of each of the N = seqs sequences:
        hidden       = T x E x a              the last block's output, still held
        last hidden  = N x E x a x c          the last tokens' states (c = 2 in V1, which
                                              replaces them by random ones; 1 in V0)
        logits, sampler/...                   `sampler.sampler_bytes`: the N x V logits (every
                                              GPU all of V) and the sampler's buffers, a + 36
                                              bytes per element on CUDA (`cuda`), a + 26 on CPU
    (`sampler` False: the forward alone, its hidden states and logits. `sort_free`: vLLM
    0.17.0 and later, `sampler.sort_free_sampler_bytes` with `sms` streaming multiprocessors.
    `moe_kept`: the MoE blocks' workspace is vLLM's modular kernel's, kept after the forward:
    the sampler's moment holds it too, as "moe workspace". `last_stage` False: a pipeline stage
    before the last, which has no head and no sampler: its block moment alone. `moe_tp`: the
    GPUs one expert is cut across (default tp; tp x dp without expert parallelism, 1 with it:
    `weights.stage_weight_bytes`). `streamed`: weights held in host memory that the forward
    copies onto the device for one layer at a time (vLLM's V0 --cpu-offload-gb), alive in the
    block.)

    a the activation bytes (the kernels' 16-bit dtype), T tokens, widths per GPU at tp (the
    residual stream E is replicated). Measured against transformers' forward on CPU
    (reference_model/serve_profile.py); the engines' fused kernels (activation-and-multiply,
    add-and-norm in place, rotary in place) hold the same widths at the same moments. The
    sampler as vLLM's PyTorch path runs it (FlashInfer's, opt-in, is not counted)."""
    positive_int("max_num_batched_tokens", tokens)
    positive_int("max_num_seqs", seqs)
    T, E, F, V, a = tokens, cfg.n_embd, cfg.ffn_dim, cfg.vocab_size, act_bytes
    S = min(seqs, T)
    gated = cfg.mlp in ("swiglu", "geglu")
    branches = {
        "branch/attention": T * ((cfg.q_width + 2 * cfg.kv_width) // tp + cfg.q_width // tp) * a,
    }
    if cfg.hybrid:
        branches["branch/mixer"] = T * mixer_width(cfg) // tp * a
    if dense_mlp_layers(cfg):
        branches["branch/mlp"] = T * (3 * F // tp if gated else 2 * F // tp + E) * a
    if moe_layers(cfg):
        branches["branch/moe"] = fused_moe_workspace_bytes(cfg, T, tp if moe_tp is None
                                                           else moe_tp, a, moe_kept)
    widest = max(branches, key=branches.__getitem__)
    block = {"stream": kept * T * E * a, "positions": POSITION_BYTES * T,
             widest: branches[widest]}
    if streamed:
        block["offloaded layer's weights"] = streamed
    if not last_stage:
        return block
    copies = 2 if engine == "V1" else 1
    if flashinfer and cuda:
        sampled = flashinfer_sampler_bytes(S, V, a)
    elif sort_free and cuda:
        sampled = sort_free_sampler_bytes(S, V, a, sms)
    else:
        sampled = sampler_bytes(S, V, a, cuda)
    after = ({"hidden": T * E * a, "last hidden": S * E * a * copies, **sampled} if sampler
             else {"hidden": T * E * a, "logits": S * V * a})
    if moe_kept and moe_layers(cfg):
        after["moe workspace"] = branches["branch/moe"]
    return max(block, after, key=lambda moment: sum(moment.values()))


@dataclass(frozen=True)
class KVPool:
    """How one GPU's memory is spent by a serving engine, and the KV pool that is left."""

    engine: str
    release: Release  # the engine's release, and the engine generation it runs
    gpu_memory_bytes: int
    utilization: float  # gpu_memory_utilization (vLLM) or mem_fraction_static (SGLang)
    weights: int
    activation: dict[str, int]  # the profile run's peak by line (empty for SGLang)
    non_torch: int  # custom_all_reduce included
    custom_all_reduce: int  # vLLM's custom all-reduce buffers at tp
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    bytes_per_block: int  # block_size tokens of every layer
    layer_block_bytes: int  # block_size tokens of one layer
    lora: dict[str, int] = field(default_factory=dict)  # LoRA slots by target (vLLM)
    lora_setting: tuple[int, int] | None = None  # (max_loras, max_lora_rank)
    layers: tuple[int, int] = (0, 0)  # the blocks this GPU's stage holds; (0, 0): all
    stages: tuple[dict[str, int], ...] = ()  # every pipeline stage's figures (pp > 1)
    layout: dict[str, int] = field(default_factory=dict)  # tp, pp, dp, expert_parallel
    cpu_offload: int = 0  # weight bytes of this GPU held in host memory (--cpu-offload-gb)
    device_context: int = 0  # the CUDA context, counted by early V1 (`early_v1_accounting`)
    sampler: str | None = None  # the profile run's sampler backend (vLLM)
    # hybrid models (`kv.hybrid_groups`): layers per group, attention and state groups, and
    # one layer's state of one sequence before its padding to the page (bytes)
    group_size: int = 0
    attention_groups: int = 0
    state_groups: int = 0
    state_page: int = 0
    # a pipeline stage sized by the heaviest stage's free memory (SGLang): that stage's GPU
    # weights beyond this stage's, which its pool also leaves out (`Server.pipeline_stages`)
    peer_weights: int = 0
    # CUDA graphs (`Server.cuda_graphs`): their memory as the engine estimates it (None: not
    # modelled for the release), whether the release takes it from the pool, and the batch
    # sizes captured (none with --enforce-eager / --disable-cuda-graph)
    cuda_graphs: int | None = None
    cuda_graphs_in_pool: bool = False
    graph_sizes: tuple[int, ...] = ()

    @property
    def host_memory(self) -> int:
        """Pinned host memory of every GPU's offloaded weights (--cpu-offload-gb): each
        stage's offload on its tp x dp GPUs."""
        lay = self.layout or {"tp": 1, "dp": 1}
        per_replica = (sum(s["cpu_offload"] for s in self.stages) if self.stages
                       else self.cpu_offload)
        return per_replica * lay["tp"] * lay["dp"]

    @property
    def activation_peak(self) -> int:
        return sum(self.activation.values())

    @property
    def lora_slots(self) -> int:
        """vLLM's LoRA slots (`adapters.lora_slot_bytes`), loaded with the weights."""
        return sum(self.lora.values())

    @property
    def held(self) -> int:
        """What the engine holds before its KV cache: weights, LoRA slots, activation peak and
        non-torch memory."""
        return (self.weights + self.lora_slots + self.activation_peak + self.non_torch
                + self.device_context + self.charged_graphs + self.peer_weights)

    @property
    def charged_graphs(self) -> int:
        """The CUDA graphs' estimate where the release takes it from the pool, else 0."""
        return (self.cuda_graphs or 0) if self.cuda_graphs_in_pool else 0

    @property
    def budget(self) -> int:
        """total x utilization, as the engine floors it to whole bytes."""
        return int(self.gpu_memory_bytes * self.utilization)

    @property
    def kv_cache(self) -> int:
        """The pool: the budget less weights, LoRA slots, activation peak and non-torch
        memory, never below 0 (the engine then refuses to start)."""
        return max(0, self.budget - self.held)

    @property
    def shortfall(self) -> int:
        """Bytes by which weights, LoRA slots, activation peak and non-torch memory exceed the
        budget (0 when they fit): budget + shortfall = what they hold + pool."""
        return max(0, self.held - self.budget)

    @property
    def kv_blocks(self) -> int:
        return self.kv_cache // self.bytes_per_block

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def max_concurrency(self, cfg: GPTConfig, context: int) -> float:
        """Requests of `context` tokens the pool holds at once, as vLLM logs it: the pool's
        per-layer pages over the per-layer pages of one request. A hybrid model's blocks are
        shared by its groups: a request takes ceil(context / block) blocks in each attention
        group and one block (its state) in each state group (vllm/v1/core/kv_cache_utils.py,
        `get_max_concurrency_for_kv_cache_config`, vllm-project/vllm@001cabc1)."""
        if self.state_groups:
            per_request = (self.attention_groups * math.ceil(context / self.block_size)
                           + self.state_groups)
            return self.kv_blocks / per_request
        layer_pages = self.kv_cache // self.layer_block_bytes
        chunk = (self.max_num_batched_tokens if server_named(self.engine).chunked_admission
                 else None)
        start, end = self.layers if self.layers != (0, 0) else (0, cfg.n_layer)
        pages = layer_blocks_per_request(cfg.replace(n_layer=end), context, self.block_size,
                                         chunk)
        if start:
            pages -= layer_blocks_per_request(cfg.replace(n_layer=start), context,
                                              self.block_size, chunk)
        return layer_pages / pages

    def fits(self, cfg: GPTConfig, max_model_len: int) -> bool:
        """The engine starts: its pool holds one request of max_model_len tokens."""
        return self.kv_cache > 0 and self.max_concurrency(cfg, max_model_len) >= 1


def _check_layout(cfg: GPTConfig, server: Server, tp: int, pp: int, dp: int,
                  expert_parallel: bool, cpu_offload: int) -> None:
    """The serving layout's options, each refused in one line naming it."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        positive_int(name, value)
    server.check_layout(cfg, pp, dp, cpu_offload)
    if expert_parallel and not cfg.moe:
        raise ConfigError("enable_expert_parallel", "the model has no experts")
    if not isinstance(cpu_offload, int) or cpu_offload < 0:
        raise ConfigError("cpu_offload_gb", f"must be at least 0, got {cpu_offload!r}")


def _check_sizes(cfg: GPTConfig, tp: int, non_torch: int, gpu_memory_bytes: int | None,
                 cuda_graph_memory: int | None) -> None:
    """kv_pool's sizes: tp divides the query heads; non-torch and a given CUDA graph figure
    are sizes of at least 0 bytes; the GPU has a positive memory figure."""
    if cfg.n_head % tp:
        raise ConfigError("tp", f"tp {tp} must divide the {cfg.n_head} query heads")
    if not isinstance(non_torch, int) or non_torch < 0:
        raise ConfigError("non_torch", f"must be a size of at least 0 bytes, got {non_torch!r}")
    if gpu_memory_bytes is None or gpu_memory_bytes <= 0:
        raise ConfigError("gpu_memory", "must be a positive size (this GPU has no memory figure)")
    if cuda_graph_memory is not None and (not isinstance(cuda_graph_memory, int)
                                          or cuda_graph_memory < 0):
        raise ConfigError("cuda_graph_memory", f"must be a size of at least 0 bytes, got "
                                               f"{cuda_graph_memory!r}")


def kv_pool(cfg: GPTConfig, gpu_memory_bytes: int, engine: str = DEFAULT_SERVER, tp: int = 1,
            weights_dtype: str = "bf16", kv_dtype: str = "bf16",
            utilization: float | None = None, max_num_batched_tokens: int | None = None,
            max_num_seqs: int | None = None, block_size: int | None = None,
            non_torch: int | None = None, gpu_name: str = "",
            engine_version: str | None = None, max_model_len: int | None = None,
            comm_buffers: bool = True, lora: tuple[int, int] | None = None, pp: int = 1,
            dp: int = 1, expert_parallel: bool = False, cpu_offload: int = 0,
            sampler: str | None = None, mamba_ssm_cache_dtype: str = "auto",
            enforce_eager: bool = False, cuda_graph_memory: int | None = None) -> KVPool:
    """The KV pool of `engine` (a registered `servers.Server`) on each of tp GPUs of
    `gpu_memory_bytes`; see the module docstring. None takes the engine's default (the
    release's `Server.scheduler_defaults`, `Server.fraction`; the newest release;
    max_model_len the model's context). `comm_buffers`: add the release's own all-reduce
    buffers at tp (`Server.custom_all_reduce_bytes`) to `non_torch`, the figure logged beyond
    them. `lora`: (max_loras, max_lora_rank) of vLLM's --enable-lora, whose slots it reserves
    (`adapters.lora_slot_bytes`); None: no LoRA. `non_torch` None: `default_non_torch` at
    the world size tp x pp x dp.

    pp, dp, expert_parallel (vLLM's --pipeline-parallel-size, --data-parallel-size,
    --enable-expert-parallel): each stage's GPUs hold its blocks (`weights.pp_partition`) and
    their KV cache, and the experts as `weights.stage_weight_bytes` places them; every worker
    takes the smallest worker's block count (vllm/v1/core/kv_cache_utils.py,
    `unify_kv_cache_configs`; V0's executor the minimum of its workers' blocks), so the
    returned pool is the stage with the fewest blocks, `stages` holding each. Only the last
    stage runs the head and the sampler. cpu_offload: bytes of weights per GPU held in host
    memory (`cpu_offload_bytes`). sampler: the sampler backend (`Server.sampler_backend`).
    mamba_ssm_cache_dtype: a hybrid model's recurrent state dtype (`kv.SSM_CACHE_DTYPES`).
    enforce_eager: vLLM's --enforce-eager, SGLang's --disable-cuda-graph (no CUDA graphs);
    cuda_graph_memory: vLLM's graph estimate as a log prints it, else the engine's default
    (`Server.cuda_graphs`). An engine whose data-parallel replicas are separate servers
    (`Server.separate_replicas`) holds the whole model in each replica, its world tp x pp;
    its pipeline stages may be sized together (`Server.pipeline_stages`)."""
    server = server_named(engine)
    _check_layout(cfg, server, tp, pp, dp, expert_parallel, cpu_offload)
    partition = pp_partition(cfg.n_layer, pp)
    # the GPUs holding one copy of the model's experts, and one world's GPUs
    wdp = 1 if server.separate_replicas else dp
    if non_torch is None:
        non_torch = default_non_torch(gpu_name, tp * pp * wdp)
    _check_sizes(cfg, tp, non_torch, gpu_memory_bytes, cuda_graph_memory)
    rel = server.release(engine_version)
    if cfg.hybrid:  # sized without LoRA slots, by the engines that model their state pages
        if lora is not None:
            raise ConfigError("enable_lora", f"LoRA slots for the model's "
                                             f"{hybrid_layer_words(cfg)} are not modelled")
        server.check_hybrid(hybrid_layer_words(cfg), rel)
    mml = cfg.block_size if max_model_len is None else max_model_len
    tokens_default, seqs_default = server.scheduler_defaults(
        rel, gpu_memory_bytes, gpu_name, mml, cfg.sliding_window is not None, cfg.mla)
    tokens = tokens_default if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = seqs_default if max_num_seqs is None else max_num_seqs
    frac = fraction(server.fraction_option,
                    server.fraction(utilization, gpu_memory_bytes, tp, pp=pp, r=rel, mla=cfg.mla,
                                    enforce_eager=enforce_eager, cpu_offload=cpu_offload))
    bs = server.default_block_size if block_size is None else block_size
    if block_size is not None:
        positive_int("kv_block_size", block_size)
    state_page = 0
    if cfg.hybrid:  # the attention page raised to hold one layer's state (`kv.hybrid_block_size`)
        state_bytes = unquantised_bytes(weights_dtype)
        ssm = SSM_CACHE_DTYPES[one_of("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype,
                                      tuple(SSM_CACHE_DTYPES))]
        bs = hybrid_block_size(cfg, block_size, tp, kv_dtype, state_bytes, ssm)
        state_page = state_bytes_per_layer(cfg, tp, state_bytes, ssm)
    positive_int("kv_block_size", bs)
    layer_block = bs * kv_bytes_per_token_layer(cfg, tp, kv_dtype)
    comm = server.custom_all_reduce_bytes(rel, tp) if comm_buffers else 0
    if lora is not None:
        server.check_lora()
    slots = {} if lora is None else lora_slot_bytes(
        cfg, *lora, tp=tp, dtype_bytes=unquantised_bytes(weights_dtype))
    context = server.device_context(rel)
    backend = server.sampler_backend(rel, sampler)
    graphs = server.cuda_graphs(rel, cfg, weights_dtype, gpu_memory_bytes, gpu_name, tp, seqs,
                                tokens, enforce_eager, cuda_graph_memory)
    stages = []
    for start in itertools.accumulate((0,) + partition[:-1]):
        end = start + partition[len(stages)]
        layers = (start, end)
        if pp == 1 and wdp == 1 and not expert_parallel:  # the figure pinned by the logs
            weights = device_weight_bytes(cfg, weights_dtype, tp)
            blocks = weights - stage_weight_parts(cfg, weights_dtype, tp)["outer"]
        else:
            parts = stage_weight_parts(cfg, weights_dtype, tp, layers, pp, wdp, expert_parallel)
            weights, blocks = sum(parts.values()), parts["blocks"]
        offloaded = min(cpu_offload, blocks)
        act = server.profile_activation(
            cfg, rel, tokens, min(seqs, tokens), tp, unquantised_bytes(weights_dtype), backend,
            gpu_name, last_stage=end == cfg.n_layer, moe_tp=1 if expert_parallel else tp * wdp,
            offloaded=offloaded, layer_weights=math.ceil(blocks / (end - start)))
        size, attn_groups, st_groups = hybrid_groups(*hybrid_stage_layers(cfg, start, end))
        per_block = size * layer_block if cfg.hybrid else (end - start) * layer_block
        stages.append(KVPool(
            engine=engine, release=rel, gpu_memory_bytes=gpu_memory_bytes, utilization=frac,
            weights=weights - offloaded, activation=act, non_torch=non_torch + comm,
            custom_all_reduce=comm, block_size=bs, max_num_batched_tokens=tokens,
            max_num_seqs=seqs, bytes_per_block=per_block,
            layer_block_bytes=layer_block, lora=slots, lora_setting=lora,
            layers=(0, 0) if pp == 1 else layers,
            layout={"tp": tp, "pp": pp, "dp": dp, "expert_parallel": int(expert_parallel)},
            cpu_offload=offloaded, device_context=context, sampler=backend, **graphs,
            **(dict(group_size=size, attention_groups=attn_groups, state_groups=st_groups,
                    state_page=state_page) if cfg.hybrid else {})))
    if pp > 1:
        stages = server.pipeline_stages(stages)
    binding = min(stages, key=lambda p: (p.kv_blocks, p.kv_cache))
    if pp == 1:
        return binding
    summary = tuple({"first_layer": p.layers[0], "layers": p.layers[1] - p.layers[0],
                     "weights": p.weights, "activation_peak": p.activation_peak,
                     "kv_cache": p.kv_cache, "kv_blocks": p.kv_blocks,
                     "cpu_offload": p.cpu_offload} for p in stages)
    return dataclasses.replace(binding, stages=summary)


def cpu_offload_bytes(gib: float) -> int:
    """vLLM's --cpu-offload-gb as bytes per GPU: int(gib x 1024^3)
    (vllm/worker/model_runner.py and vllm/v1/worker/gpu_model_runner.py,
    `set_cpu_offload_max_bytes(int(cpu_offload_gb * 1024**3))`): the decoder layers' parameters
    are moved to pinned host memory one after another from the stage's first layer until that
    many bytes are held (vllm/model_executor/models/utils.py, `maybe_offload_to_cpu`, called by
    `make_layers` for each layer); the embedding and the head stay on the GPU. The last
    parameter moved may overshoot the figure by less than its own size (not counted). V0
    copies an offloaded layer's weights onto the GPU for its forward (`functional_call` on
    `v.to(device)`), which the profile run's peak then holds; V1 reads them in place through
    unified virtual addressing ("V1 CPU offloading requires uva")."""
    if gib < 0 or not math.isfinite(gib):
        raise ConfigError("cpu_offload_gb", f"must be at least 0, got {gib!r}")
    return int(gib * 1024**3)


def gpu_memory(g: GPU) -> int:
    """The memory an engine sizes against on a catalogue GPU (`gpus.usable_memory`)."""
    return usable_memory(g)
