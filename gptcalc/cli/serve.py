"""`gptcalc serve`: the KV pool a serving engine allocates, and how many requests it holds."""

from __future__ import annotations

from typing import Any

import click

from ..config import GPTConfig
from ..errors import ConfigError, positive_int
from ..workload import Workload
from ..gpus import gpu as find_gpu
from ..inference.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from ..inference.kv import SSM_CACHE_DTYPES
from ..layers import hybrid_layer_words
from ..inference.fit import to_fit
from ..inference import servers
from ..inference.pool import (DEFAULT_NON_TORCH, NVSWITCH_GPUS, TP_NVSWITCH_NON_TORCH, KVPool,
                              cpu_offload_bytes, gpu_memory, kv_pool)
from ..inference.roofline import (DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_FLOPS_EFFICIENCY,
                                  compute_precision, serving)
from ..inference.sampler import SAMPLERS
from ..inference.weights import weights_label
from ..units import binary_bytes
from .infer import _ms, serving_json, weights_used
from ..schema import OPTIONS
from .options import (ByteSize, click_option, context_option, current_setup, describe,
                      detail_option, float_range, gen_len_option, gpu_option, json_option,
                      kv_dtype_option, model_options, serving_tp_option,
                      serving_weights_option)
from .render import emit_json, envelope, print_table, print_wrapped


# vLLM's CacheConfig.mamba_cache_mode (vllm/config/cache.py): "none" (prefix caching off: one
# state per request), "all" (the state at every block boundary), "align" (the state at block
# boundaries a scheduler step ends on)
MAMBA_CACHE_MODES = ("none", "all", "align")


def check_mamba_cache_mode(mode: str) -> None:
    """Prefix caching of Mamba / Gated DeltaNet states is refused: vLLM's --mamba-cache-mode
    all or align keeps a state block per cached block of a request, SGLang's mamba radix
    cache (MambaRadixCache, sglang/srt/mem_cache) a state per cached prefix node; neither is
    modelled."""
    if mode != "none":
        raise ConfigError("mamba_cache_mode", f"prefix caching of Mamba / DeltaNet states "
                                              f"(vLLM's --mamba-cache-mode {mode}, SGLang's mamba "
                                              "radix cache) is not modelled; none is")


class ServerChoice(click.Choice):
    """One of the registered serving engines (`gptcalc.inference.servers`), read when the
    option is parsed (an engine registered after import is a choice too)."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return servers.names()

    @choices.setter
    def choices(self, _value) -> None:  # click.Choice.__init__ assigns it; the registry decides
        pass


@click.command("serve")
@model_options
@click.option("--engine", type=ServerChoice(), default=servers.DEFAULT, show_default=True,
              help="Serving engine whose KV pool is sized.")
@gpu_option("Accelerator (see `gptcalc gpus`): its memory, and its peaks for throughput.")
@click_option(OPTIONS["gpu_memory"], type=ByteSize(exact=False),
              help="Total memory of one GPU as the engine reads it, torch.cuda.mem_get_info's "
                   "total (e.g. 79.22GiB); default the --gpu's usable figure (`gptcalc gpus`). "
                   "\"80GB\" is 80 x 10^9 bytes, \"80GiB\" 80 x 2^30; vLLM's logs print GiB, "
                   "SGLang's print \"GB\" meaning GiB.")
@serving_tp_option()
@click.option("--pp", "--pipeline-parallel-size", "pp", type=int, default=1, show_default=True,
              help="Pipeline stages (the layers split evenly, the remainder on the stages "
                   "before the last, in vLLM and SGLang); each stage's tp GPUs hold its "
                   "layers' weights and KV cache.")
@click.option("--dp", "--data-parallel-size", "dp", type=int, default=1, show_default=True,
              help="Data-parallel replicas of tp x pp GPUs: vLLM cuts an MoE's experts across "
                   "all tp x dp GPUs; SGLang's replicas are separate servers, each the whole "
                   "model.")
@click.option("--enable-expert-parallel", "expert_parallel", is_flag=True,
              help="Expert parallelism: whole experts spread over the tp x dp GPUs instead "
                   "of each expert cut across them (vLLM; SGLang's --ep-size equal to --tp).")
@click.option("--enable-dp-attention", "dp_attention", is_flag=True,
              help="SGLang's data-parallel attention within the tp GPUs: not modelled, "
                   "refused.")
@click.option("--cpu-offload-gb", type=float, default=0.0, show_default=True, metavar="GIB",
              help="GiB of each GPU's weights the engine holds in host memory (pinned), layer "
                   "by layer from the first (vLLM and SGLang).")
@serving_weights_option("Weights (default: as the --hf-config's quantization_config stores "
                        "them, else bf16).")
@kv_dtype_option()
@click.option("--gpu-memory-utilization", "--mem-fraction-static", "utilization", type=float,
              default=None, help="Share of the GPU's memory the engine may use (vLLM default "
                                 "0.9; SGLang: its memory less a reserve by GPU size).")
@click.option("--max-model-len", type=int, default=None,
              help="Longest request in tokens (default: the model's context T).")
@click.option("--allow-long-max-model-len", is_flag=True,
              help="Accept a --max-model-len beyond the model's context T (vLLM refuses it "
                   "unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1).")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Tokens per forward, the profile run's size (vLLM's default: 8192 on GPUs "
                   "of 70 GiB or more other than A100, else 2048).")
@click.option("--max-num-seqs", type=int, default=None,
              help="Sequences per forward (vLLM's default: 1024 with 8192 tokens, else 256).")
@click.option("--kv-block-size", type=int, default=None,
              help="Tokens per KV block (vLLM's --block-size, default 16; SGLang pages of 1).")
@context_option("Tokens of one request for the concurrency question (default "
                "--max-model-len).")
@gen_len_option("Of the --context tokens, how many are generated (throughput).", default=128)
@click.option("--non-torch", type=ByteSize(exact=False, zero_ok=True), default=None,
              metavar="SIZE",
              help=f"Memory outside PyTorch beyond the CUDA context (NCCL, cuBLAS) "
                   f"(default {binary_bytes(DEFAULT_NON_TORCH)} as vLLM logs it on one GPU, "
                   f"{binary_bytes(TP_NVSWITCH_NON_TORCH)} at --tp 2 or more on "
                   f"{', '.join(NVSWITCH_GPUS)}: NCCL's buffers there).")
@click_option(OPTIONS["engine_version"])
@click_option(OPTIONS["enable_lora"])
@click_option(OPTIONS["max_loras"])
@click_option(OPTIONS["max_lora_rank"])
@click.option("--sampler", type=click.Choice(SAMPLERS), default=None,
              help="vLLM's sampler backend in the profile run: sort (PyTorch), triton "
                   "(sort-free, 0.17.0 on) or flashinfer (when installed and not disabled by "
                   "VLLM_USE_FLASHINFER_SAMPLER=0); default the release's PyTorch path.")
@click.option("--mamba-ssm-cache-dtype", type=click.Choice(list(SSM_CACHE_DTYPES)),
              default="auto", show_default=True,
              help="Hybrid models: the Mamba / DeltaNet recurrent state's dtype (vLLM's option; "
                   "auto: the model's dtype).")
@click.option("--mamba-cache-mode", type=click.Choice(MAMBA_CACHE_MODES), default="none",
              show_default=True,
              help="Hybrid models: vLLM's caching of Mamba / DeltaNet states for prefix caching "
                   "(vllm/config/cache.py); only none (one state per request) is modelled.")
@click.option("--enforce-eager", "--disable-cuda-graph", "eager", is_flag=True,
              help="No CUDA graphs (vLLM's --enforce-eager, SGLang's --disable-cuda-graph): "
                   "vLLM takes no graph estimate from the pool.")
@click.option("--cuda-graph-memory", type=ByteSize(exact=False, zero_ok=True), default=None,
              metavar="SIZE",
              help="vLLM's CUDA graph estimate from a log (\"Estimated CUDA graph memory: X GiB "
                   "total\"), taken from the pool from 0.20.0; default: the capture list's "
                   "graphs at one Llama-3.1-8B log's per-graph figures.")
@detail_option("Every line: the activation peak by tensor, each pipeline stage, the "
               "throughput table.")
@json_option()
@float_range
@click.pass_context
def command(command_ctx: click.Context, model: tuple[GPTConfig, Workload], engine: str,
            gpu_name: str, gpu_memory: int | None, tp: int, pp: int, dp: int, expert_parallel: bool,
            dp_attention: bool,
            cpu_offload_gb: float, weights_dtype: str | None, kv_dtype: str,
            utilization: float | None, max_model_len: int | None,
            allow_long_max_model_len: bool, max_num_batched_tokens: int | None,
            max_num_seqs: int | None,
            kv_block_size: int | None, context: int | None, gen_len: int, non_torch: int | None,
            engine_version: str | None, enable_lora: bool | None, max_loras: int | None,
            max_lora_rank: int | None, sampler: str | None, mamba_ssm_cache_dtype: str,
            mamba_cache_mode: str, eager: bool, cuda_graph_memory: int | None, detail: bool,
            as_json: bool) -> None:
    """The engine's memory per GPU (weights, profile-run activation peak, non-torch, KV pool),
    its blocks and tokens, the requests of --max-model-len and --context tokens it holds at
    once, and prefill/decode throughput at that concurrency (infer's roofline)."""
    cfg, wl = model
    if dp_attention:  # attention split tp/dp ways, dense layers tp ways: not modelled
        raise ConfigError("enable_dp_attention", "SGLang's DP attention (attention data-parallel "
                                                 "within the tp GPUs) is not modelled; --dp "
                                                 "without it is")
    check_mamba_cache_mode(mamba_cache_mode)
    setup = current_setup(command_ctx)
    weights, source = weights_used(weights_dtype, setup)
    g = find_gpu(gpu_name)
    total = gpu_memory or gpu_memory_for(g)
    # the scheduler's options are checked as given, also under an engine that does not read them
    for field, value in (("max_model_len", max_model_len), ("context", context),
                         ("gen_len", gen_len), ("max_num_batched_tokens", max_num_batched_tokens),
                         ("max_num_seqs", max_num_seqs)):
        if value is not None:
            positive_int(field, value)
    mml = cfg.block_size if max_model_len is None else max_model_len
    if mml > cfg.block_size:
        if not allow_long_max_model_len:
            raise ConfigError("max_model_len", too_long(mml, cfg.block_size))
        cfg = cfg.replace(block_size=mml)
    ctx = mml if context is None else context
    if ctx > mml:
        raise ConfigError("context", f"{ctx:,} exceeds --max-model-len {mml:,}")
    if gen_len >= ctx:
        raise ConfigError("gen_len", f"{gen_len:,} leaves no prompt in --context {ctx:,}")
    nt = non_torch
    lora = lora_setting(enable_lora, max_loras, max_lora_rank)
    args = dict(engine=engine, tp=tp, weights_dtype=weights, kv_dtype=kv_dtype,
                utilization=utilization, max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs, block_size=kv_block_size,
                non_torch=nt, gpu_name=g.name,
                engine_version=engine_version, max_model_len=mml, comm_buffers=nt is None,
                lora=lora, pp=pp, dp=dp, expert_parallel=expert_parallel,
                cpu_offload=cpu_offload_bytes(cpu_offload_gb), sampler=sampler,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, enforce_eager=eager,
                cuda_graph_memory=cuda_graph_memory)
    pool = kv_pool(cfg, total, **args)
    advice = to_fit(cfg, pool, mml, total, args)
    conc = {str(mml): pool.max_concurrency(cfg, mml), str(ctx): pool.max_concurrency(cfg, ctx)}
    batch = min(int(conc[str(ctx)]), pool.max_num_seqs)  # the scheduler's cap
    s = None
    precision = compute_precision(weights)
    if (batch >= 1 and g.peak_flops(precision) is not None and g.hbm_bytes_per_second
            and not cfg.hybrid):  # the roofline counts no Mamba / DeltaNet FLOPs
        s = serving(cfg, g, batch, ctx - gen_len, gen_len, tp, weights, kv_dtype,
                    DEFAULT_FLOPS_EFFICIENCY, DEFAULT_BANDWIDTH_EFFICIENCY)
    given = {"utilization": utilization, "max_model_len": max_model_len,
             "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
             "block_size": kv_block_size, "context": context, "non_torch": nt,
             "engine_version": engine_version, "max_loras": max_loras,
             "max_lora_rank": max_lora_rank}
    line = _assumptions(pool, g.name, total, tp * pp * dp, (weights, source), kv_dtype, mml,
                        ctx, gen_len, gpu_memory is None,
                        {k for k, v in given.items() if v is None})
    line += _layout_words(cfg, pool) + _hybrid_words(cfg, pool)
    if s is not None and (pp > 1 or dp > 1 or expert_parallel or pool.cpu_offload):
        line += "; throughput: one replica's roofline at tp (layout and offload not in it)"
    if pool.sampler:
        line += f"; sampler {SAMPLER_WORDS[pool.sampler]}{'' if sampler else ' (default)'}"
    if pool.device_context:
        line += (f"; this release counts everything in use on the device as non-torch memory: "
                 f"its CUDA context {binary_bytes(pool.device_context)} (estimated) counted, "
                 "other processes on the GPU not")
    line += servers.server_named(pool.engine).cuda_graph_words(
        pool, cuda_graph_memory is not None, eager)
    if cfg.moe and pool.activation:
        line += ("; MoE layers' activations as vLLM's fused-MoE caches (Triton path"
                 + ("; each GPU's own experts, all-to-all buffers not counted)"
                    if expert_parallel else ", no expert parallelism)"))
    if setup is not None and setup.encoders:
        line += (f"; the language model only: the checkpoint's {' and '.join(setup.encoders)} "
                 "(its encoder's weights and the engine's encoder profile run) not counted")
    if as_json:
        out = _json(cfg, wl, pool, conc, mml, ctx, s, line, advice)
        out.update(sampler=pool.sampler, pp=pp, dp=dp, expert_parallel=expert_parallel,
                   cpu_offload=pool.cpu_offload,
                   host_memory=pool.host_memory,
                   device_context=pool.device_context, stages=list(pool.stages),
                   cuda_graphs=pool.cuda_graphs, cuda_graphs_in_pool=pool.cuda_graphs_in_pool,
                   cuda_graphs_charged=pool.charged_graphs,
                   cuda_graph_sizes=list(pool.graph_sizes),
                   verdict=_verdict(cfg, pool, conc, mml, g.name))
        out.update(weights_dtype=weights_label(weights), weights_source=source)
        if pool.state_groups:  # hybrid: the state pages and the block groups
            out.update(state_page=pool.state_page, group_size=pool.group_size,
                       attention_groups=pool.attention_groups, state_groups=pool.state_groups)
        emit_json(out)
        return
    _render(cfg, pool, conc, mml, ctx, s, line, advice, g.name, detail)


COMPACT_LABEL, COMPACT_VALUE = 50, 11  # the compact memory lines: label and value widths
SAMPLER_WORDS = {"sort": "PyTorch's (sorts the logits)",
                 "triton": "the sort-free Triton top-k/top-p kernel",
                 "flashinfer": "FlashInfer's rejection sampling"}


def lora_setting(enable: bool | None, max_loras: int | None, max_lora_rank: int | None
                 ) -> tuple[int, int] | None:
    """(max_loras, max_lora_rank) with --enable-lora (vLLM's defaults where not given), else
    None; the sizes without --enable-lora are refused, as vLLM ignores nothing silently."""
    if not enable:
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if value is not None:
                raise ConfigError(name, "needs --enable-lora")
        return None
    return (DEFAULT_MAX_LORAS if max_loras is None else positive_int("max_loras", max_loras),
            DEFAULT_MAX_LORA_RANK if max_lora_rank is None
            else positive_int("max_lora_rank", max_lora_rank))


def too_long(max_model_len: int, context: int) -> str:
    """vLLM's refusal of a max_model_len beyond the model's (vllm/config/model.py,
    `_get_and_verify_max_len`: "User-specified max_model_len ... is greater than the derived
    max_model_len ... set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")."""
    return (f"{max_model_len:,} is greater than the model's context of {context:,} tokens "
            "(max_position_embeddings); add --allow-long-max-model-len to size it anyway, as "
            "vLLM does with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")


def gpu_memory_for(g) -> int:
    return gpu_memory(g)


def _assumptions(p: KVPool, gpu: str, total: int, tp: int, weights: tuple[Any, str], kd: str,
                 mml: int, ctx: int, gen: int, datasheet: bool, defaults: set[str]) -> str:
    def d(name: str) -> str:
        return " (default)" if name in defaults else ""

    wd, source = weights
    server = servers.server_named(p.engine)
    knob = server.fraction_option
    comm = (f" + custom all-reduce {binary_bytes(p.custom_all_reduce)} (NVLink assumed)"
            if p.custom_all_reduce else "")
    seqs = min(p.max_num_seqs, p.max_num_batched_tokens)
    profile = ("no profile run (activations live outside the fraction)" if not server.profile_run
               else f"profile run of {p.max_num_batched_tokens:,} tokens"
                    f"{d('max_num_batched_tokens')} in {seqs:,} sequences (max_num_seqs "
                    f"{p.max_num_seqs:,}{d('max_num_seqs')})")
    memory = (f"{gpu}: torch.cuda.mem_get_info's total, datasheet "
              f"{binary_bytes(find_gpu(gpu).memory_bytes)}" if datasheet else "given")
    return (f"Assuming {p.release.label}{d('engine_version')} on {tp} x {binary_bytes(total)} "
            f"({memory}; its peaks for throughput), "
            f"weights {weights_label(wd)} ({source}), KV cache {kd}, "
            f"{knob} {p.utilization:g}{d('utilization')}, "
            f"max_model_len {mml:,}{d('max_model_len')}, {profile}, blocks of {p.block_size} "
            f"tokens{d('block_size')}, non-torch {binary_bytes(p.non_torch - p.custom_all_reduce)}"
            f"{d('non_torch')}{comm}, "
            f"requests of {ctx:,} tokens{d('context')} ({gen:,} generated), "
            f"{'32' if wd == 'fp32' else '16'}-bit activations{_lora_words(p, d)}")


def _lora_words(p: KVPool, d) -> str:
    if not p.lora:
        return ""
    return (f", LoRA slots: max_loras {p.lora_setting[0]:,}{d('max_loras')} of rank "
            f"{p.lora_setting[1]:,}{d('max_lora_rank')} on every block Linear")


def _json(cfg, wl, p: KVPool, conc, mml, ctx, s, line, advice) -> dict[str, Any]:
    out: dict[str, Any] = serving_json(s)  # null figures when no throughput is computed
    out.update({
        **envelope(cfg, wl), "assumptions": line, "engine": p.engine,
        "engine_version": p.release.version, "engine_generation": p.release.engine,
        "gpu_memory_bytes": p.gpu_memory_bytes, "utilization": p.utilization,
        "max_model_len": mml, "context": ctx, "max_num_batched_tokens": p.max_num_batched_tokens,
        "max_num_seqs": p.max_num_seqs, "block_size": p.block_size,
        "weights": p.weights, "activation_peak": p.activation_peak,
        "activation": p.activation, "non_torch": p.non_torch,
        "custom_all_reduce": p.custom_all_reduce, "lora_slots": p.lora_slots,
        "lora": p.lora, "kv_cache": p.kv_cache,
        "shortfall": p.shortfall, "kv_blocks": p.kv_blocks, "kv_tokens": p.kv_tokens,
        "max_concurrency": conc, "fits": p.fits(cfg, mml), "to_fit": advice,
    })
    return out


def _does_not_fit(p: KVPool, mml: int, advice: dict[str, Any]) -> str:
    """Why the engine refuses to start, and each single option that would let it."""
    if p.shortfall:
        held = ("weights, activation peak, non-torch memory and CUDA graphs" if p.charged_graphs
                else "weights, activation peak and non-torch memory")
        why = (f"does NOT fit: {held} exceed the budget "
               f"by {binary_bytes(p.shortfall)}, leaving no KV cache pool")
    else:
        why = (f"does NOT fit: the pool of {binary_bytes(p.kv_cache)} does not hold one request "
               f"of max_model_len {mml:,} tokens")
    spelled = {"tp": "--tp {:,}", "weights_dtype": "--weights-dtype {}", "gpu": "--gpu {}",
               "max_model_len": "--max-model-len {:,}"}
    options = [spelled[k].format(v) for k, v in advice.items() if v is not None]
    return (f"{why}; the engine refuses to start. "
            + (f"It fits with any one of: {'; '.join(options)}" if options else
               "No single change of --tp, --weights-dtype, --gpu or --max-model-len fits it"))


def _layout_words(cfg: GPTConfig, p: KVPool) -> str:
    """The pipeline, data and expert parallel layout and the CPU offload, when any."""
    lay = p.layout
    words = []
    if lay.get("pp", 1) > 1:
        words.append(f"{lay['pp']} pipeline stages of "
                     f"{'/'.join(str(s['layers']) for s in p.stages)} layers (this GPU: "
                     f"layers {p.layers[0]}-{p.layers[1] - 1}, the stage with the fewest "
                     "blocks, which every stage takes)")
    server = servers.server_named(p.engine)
    separate = server.separate_replicas  # each replica the whole model
    if lay.get("dp", 1) > 1:
        words.append(f"{lay['dp']} data-parallel replicas (" + (
            "separate servers, each the whole model)" if separate
            else "attention tensor-parallel within each)"))
    if p.peer_weights:
        words.append(f"every stage sized by the least free memory, the heaviest stage's "
                     f"{binary_bytes(p.weights + p.peer_weights)} of weights")
    if cfg.moe and ((lay.get("dp", 1) > 1 and not separate) or lay.get("expert_parallel")):
        n = lay["tp"] * (1 if separate else lay["dp"])
        words.append(f"whole experts over {n} GPUs, at most {-(-cfg.n_expert // n)} of "
                     f"{cfg.n_expert} a GPU" if lay.get("expert_parallel")
                     else f"every expert cut over {n} GPUs")
    if p.cpu_offload:
        words.append(f"{binary_bytes(p.cpu_offload)} of weights per GPU in host memory"
                     + server.offload_words(p.release))
    return "".join(f"; {w}" for w in words)


def _hybrid_words(cfg: GPTConfig, p: KVPool) -> str:
    """A hybrid model's state pages and block groups, and what is not counted."""
    if not p.state_groups:
        return ""
    return (f"; hybrid: {hybrid_layer_words(cfg)} keep one state per request "
            f"({binary_bytes(p.state_page)} a layer on this GPU), the attention block raised "
            f"to {p.block_size} tokens so that one attention page holds it (vLLM's rule), "
            f"blocks shared by {p.attention_groups} attention and {p.state_groups} state groups "
            f"of {p.group_size} layers; one state block per request (no prefix caching of "
            "states: --mamba-cache-mode align keeps more); the mixers' activations estimated "
            "from their shapes; throughput not computed (the roofline has no Mamba / DeltaNet "
            "FLOPs)")


def _verdict(cfg: GPTConfig, p: KVPool, conc: dict[str, float], mml: int, gpu: str) -> str:
    """The answer in one line: does the engine start, and what its pool holds."""
    if not p.fits(cfg, mml):
        return (f"Does NOT fit: the engine refuses to start on {gpu} (no request of {mml:,} "
                "tokens fits; what would follows).")
    if p.state_groups:  # the blocks hold attention pages and requests' states alike
        return (f"Fits: {p.kv_blocks:,} blocks of {p.block_size:,} tokens a GPU (attention KV "
                f"and per-request state), {conc[str(mml)]:,.2f} requests of {mml:,} tokens at "
                "once.")
    return (f"Fits: {p.kv_tokens:,} KV-cache tokens a GPU, {conc[str(mml)]:,.2f} requests "
            f"of {mml:,} tokens at once.")


def _render(cfg, p: KVPool, conc, mml, ctx, s, line, advice, gpu: str, detail: bool) -> None:
    print_wrapped(_verdict(cfg, p, conc, mml, gpu))
    print_wrapped(line)
    print_wrapped(describe(cfg))
    rows = [[f"budget: {binary_bytes(p.gpu_memory_bytes)} x {p.utilization:g}",
             binary_bytes(p.budget)],
            ["weights", binary_bytes(p.weights)]]
    if detail:
        rows += [[f"activation peak: {k}", binary_bytes(v)] for k, v in p.activation.items()]
    elif p.activation:
        rows += [["activation peak (profile run)", binary_bytes(p.activation_peak)]]
    rows += [[f"LoRA slots: {k[len('lora/'):]}", binary_bytes(v)] for k, v in p.lora.items()]
    if p.custom_all_reduce and not detail:  # one line: the screen's worth
        rows += [[f"non-torch (NCCL, cuBLAS, all-reduce "
                  f"{binary_bytes(p.custom_all_reduce)})", binary_bytes(p.non_torch)]]
    else:
        rows += [["non-torch (NCCL, cuBLAS; beyond the CUDA context)",
                  binary_bytes(p.non_torch - p.custom_all_reduce)]]
    if p.custom_all_reduce and detail:
        rows += [["non-torch: custom all-reduce buffers", binary_bytes(p.custom_all_reduce)]]
    if p.device_context:
        rows += [["CUDA context (counted by this release)", binary_bytes(p.device_context)]]
    if p.charged_graphs:
        rows += [[f"CUDA graphs ({servers.server_named(p.engine).title}'s estimate)",
                  binary_bytes(p.charged_graphs)]]
    caption = (f"{p.kv_blocks:,} blocks of {p.block_size} tokens = {p.kv_tokens:,} tokens "
               f"({binary_bytes(p.bytes_per_block)} per block)")
    if p.state_groups:
        caption = (f"{p.kv_blocks:,} blocks of {p.block_size} tokens "
                   f"({binary_bytes(p.bytes_per_block)} per block: a page of each of "
                   f"{p.group_size} layers), shared by {p.attention_groups} attention and "
                   f"{p.state_groups} state groups")
    if detail:
        print_table("", ["memory per GPU", "bytes"], rows,
                    total_row=["KV cache pool", binary_bytes(p.kv_cache)], caption=caption)
    else:  # one line a term, the screen's worth of it
        rows[0][0] = "per GPU, " + rows[0][0]
        for label, value in rows + [["KV cache pool", binary_bytes(p.kv_cache)]]:
            print_wrapped(f"  {label:<{COMPACT_LABEL}} {value:>{COMPACT_VALUE}}")
        print_wrapped(f"  = {caption}")
    if p.cpu_offload:
        n = p.layout["tp"] * p.layout["pp"] * p.layout["dp"]
        print_wrapped(f"Host memory: {binary_bytes(p.cpu_offload)} of weights per GPU, "
                   f"{binary_bytes(p.host_memory)} pinned for the {n} GPUs.")
    if detail and p.stages:
        print_table("Pipeline stages (per GPU)", ["layers", "weights", "activation peak",
                                                  "KV cache pool", "blocks"],
                    [[f"{st['first_layer']}-{st['first_layer'] + st['layers'] - 1}",
                      binary_bytes(st["weights"]), binary_bytes(st["activation_peak"]),
                      binary_bytes(st["kv_cache"]), f"{st['kv_blocks']:,}"] for st in p.stages])
    if ctx != mml or detail:
        conc_words = ", ".join(f"{v:,.2f}x at {int(k):,} tokens" for k, v in conc.items())
        print_wrapped(f"Maximum concurrency: {conc_words}.")
    if not p.fits(cfg, mml):
        print_wrapped(_does_not_fit(p, mml, advice))
        if not detail:
            return
    if s is None:
        if conc[str(ctx)] >= 1 and not cfg.hybrid:  # a hybrid's line of assumptions says why
            print_wrapped("no throughput: the GPU has no peak figure for these weights (a T4 "
                       "runs fp16)")
        return
    if not detail:
        print_wrapped(f"Expected at {s.batch_size:,} requests of {ctx:,} tokens: prefill "
                   f"{_ms(s.expected_prefill_seconds)}, decode step "
                   f"{_ms(s.expected_decode_seconds_per_token)}, "
                   f"{s.batch_size / s.expected_decode_seconds_per_token:,.1f} tokens/s "
                   "(--detail: every line)")
        return
    rate = [["prefill of the batch", _ms(s.prefill.seconds), _ms(s.expected_prefill_seconds)],
            ["decode step", _ms(s.decode_seconds_per_token),
             _ms(s.expected_decode_seconds_per_token)],
            [f"decode tokens/s for {s.batch_size:,} requests",
             f"{s.batch_size / s.decode_seconds_per_token:,.1f}",
             f"{s.batch_size / s.expected_decode_seconds_per_token:,.1f}"]]
    print_table(f"Throughput at {s.batch_size:,} requests of {ctx:,} tokens",
                ["quantity", "roofline", "expected"], rate,
                caption=f"infer's roofline at {s.flops_efficiency:g} of peak FLOP/s and "
                        f"{s.bandwidth_efficiency:g} of bandwidth")
