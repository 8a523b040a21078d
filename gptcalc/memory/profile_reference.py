"""What the project's reference model (reference_model/model.py) saves for backward.

One line per saved tensor kind of one micro-batch on one device, before tensor/sequence
parallel sharding (`gptcalc.memory.activations` shards the lines). Exact against
`saved_tensors_hooks` on CPU for every mode; CUDA lines follow the kernels' documented dtypes.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload
from ..recompute import op_kept_linears
from ..layers import dense_mlp_layers, global_layers, moe_layers, sliding_layers
from .profile_reference_modern import (SavedLines, mla_projections, mlp_lines, moe_lines,
                                       weight_norm_lines)
from .states import autocast_weight_copies


def _norm_lines(cfg: GPTConfig, N: int, a: int, stats: int) -> dict[str, int]:
    E = cfg.n_embd
    if cfg.norm == "rmsnorm":
        # x * rsqrt(mean(x^2) + eps) * w: pow saves x, rsqrt its result, the last mul x * r
        return {"input": N * E * a, "rsqrt": N * a, "normalized": N * E * a}
    # native_layer_norm saves its input, mean and rstd
    return {"input": N * E * a, "mean": N * stats, "rstd": N * stats}



def _qk_sources(cfg: GPTConfig, N: int, a: int, amp: bool, out: SavedLines
                ) -> dict[str, tuple[str, int, int, int]]:
    """q, k, v as the attention core receives them: role -> (storage, storage bytes, elements
    per token, bytes per element); adds the q/k norms' lines to `out`.

    Each starts as a view of the projection that made it: the fused c_attn output
    (N(Dq + 2Dkv), one storage for all three roles), or a separate projection's output
    (per_head: the concatenation of the heads' outputs). A q/k norm (`weight_norm_lines`;
    rows per token: H or n_kv_head over each head, 1 over the whole projection) makes new q
    and k, fp32 under amp (the fp32 weight promotes them); rotary too (fp32 cos/sin under amp).
    Grouped-query heads are repeated inside the core (`_expanded`).
    """
    if cfg.mla:
        return mla_projections(cfg, N, a, amp, out)
    Dq, Dkv, H, Hkv = cfg.q_width, cfg.kv_width, cfg.n_head, cfg.kv_heads
    qkv_casts = {"fused": 1, "separate": 3, "per_head": 3 * H}[cfg.qkv_layout] if amp else 1
    out.add("attn/qkv_input", qkv_casts * N * cfg.n_embd * a)
    width = {"q": Dq, "k": Dkv, "v": Dkv}
    if cfg.qkv_layout == "fused":
        src = {r: ("c_attn", N * (Dq + 2 * Dkv) * a, width[r], a) for r in "qkv"}
    else:
        src = {r: (r + "/proj", N * width[r] * a, width[r], a) for r in "qkv"}
    promoted = 4 if amp else a  # times an fp32 weight or table under amp
    for role, heads in (("q", H), ("k", Hkv)):
        if cfg.qk_norm != "none":
            rows = N * (1 if cfg.qk_norm == "proj" else heads)
            weight_norm_lines(out, f"attn/{role}_norm", rows, width[role] * N // rows, a,
                              cfg.norm == "rmsnorm", src[role][:2])
        if cfg.qk_norm != "none" or cfg.pos_embedding == "rotary":
            src[role] = (role + "/own", N * width[role] * promoted, width[role], promoted)
    return src


def _expanded(cfg: GPTConfig, N: int, src: dict[str, tuple[str, int, int, int]]
              ) -> dict[str, tuple[str, int, int, int]]:
    """q, k, v inside the attention core: grouped-query repeat_interleave makes new k and v of
    H heads (N*Dq each)."""
    if cfg.kv_heads == cfg.n_head or cfg.mla:
        return src
    out = dict(src)
    for role in "kv":
        nbytes = src[role][3]
        out[role] = (role + "/own", N * cfg.q_width * nbytes, cfg.q_width, nbytes)
    return out


def _flash(cfg: GPTConfig, setup: TrainingSetup) -> bool:
    """Whether SDPA runs a fused kernel (on CPU: not with dropout, which takes the math
    path), i.e. not ALiBi's float mask. With q/k heads wider than v heads (MLA) the flash
    kernels refuse (`check_head_dim_size_flash`, CPU and CUDA; measured on CPU: the math path)
    and on CUDA the memory-efficient kernel runs (`_mem_efficient`)."""
    if setup.attn_impl != "sdpa" or cfg.pos_embedding == "alibi":
        return False
    if cfg.qk_head_dim != cfg.v_dim:
        return setup.device == "cuda"
    return cfg.dropout == 0 or setup.device == "cuda"


def _mem_efficient(cfg: GPTConfig, setup: TrainingSetup) -> bool:
    """Whether SDPA runs CUDA's memory-efficient kernel: MLA's q/k heads wider than its v
    heads, which that kernel's head-size check allows (`check_head_dim_size_mem_efficient`,
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) and the flash kernel's does not.
    It saves q, k and v as given, its output, allocated (b, S, H, v_dim) so that
    `y.transpose(1, 2)` is contiguous and c_proj reads that storage, and an fp32 logsumexp
    of b x H x S rounded up to 32 rows (torch 2.13's meta kernel of
    `_scaled_dot_product_efficient_attention`; its two int64 philox scalars are host
    tensors). cuDNN's kernel, which recent torch may prefer on SM90, is not modelled."""
    return _flash(cfg, setup) and cfg.qk_head_dim != cfg.v_dim


def _attention_lines(cfg: GPTConfig, b: int, S: int, setup: TrainingSetup, sliding: bool
                     ) -> dict[str, int]:
    """One attention block's saved bytes (its input norm excluded), global or sliding-window.

      qkv_input, q/k norms, MLA's latents   `_qk_sources`
      manual attention (and SDPA's CPU math path: dropout, ALiBi's float mask, MLA with
      v_head_dim != q/k head width):
        q, k_t, v        N*Dq each   contiguous copies matmul makes (b or H of 1, and MLA's v
                                     at S of 1: the source storages instead; the math path
                                     scales q, k and upcasts
                                     16-bit inputs to fp32)
        causal_mask      S*S bool    masked_fill's mask (the window's mask on sliding blocks)
        softmax          bHS(S+1)    its output; S + 1 columns with attention sinks; fp32 under
                                     amp with ALiBi (fp32 slopes promote the scores)
        dropout_mask     bHS^2       1 byte (SDPA's math path: a float mask)
        dropped          bHS^2       what att @ v saves, when dropout or a cast made it new
      SDPA flash kernel: q, k, v storages, an fp32 logsumexp bHS, a window's mask S*S (in the
      compute dtype), its output when q was not laid out (b, S, H, hd) (partial rotary, MLA)
      out_input        N*H*v_dim    c_proj's input
      resid_dropout_mask N*E
    """
    N, a, H = b * S, setup.act_bytes, cfg.n_head
    amp, drop = setup.mode == "amp", cfg.dropout > 0
    out = SavedLines()
    inputs = _qk_sources(cfg, N, a, amp, out)  # what the core receives
    src = _expanded(cfg, N, inputs)  # what its kernels read
    alibi = cfg.pos_embedding == "alibi"
    window = sliding and cfg.sliding_window is not None
    flash = _flash(cfg, setup)

    def kernel_copy(role: str) -> tuple[str, int]:
        """The tensor a kernel saves for `role` when it keeps the input itself: the source, or
        autocast's 16-bit cast of an fp32 one."""
        name, nbytes, width, elem = src[role]
        return (role + "/cast", N * width * a) if elem != a else (name, nbytes)

    if setup.recompute == "selective":  # the checkpoint keeps the core's inputs: under amp
        for role in "qkv":  # the 16-bit casts of fp32 q and k the model makes before the core;
            name, nbytes, width, elem = inputs[role]  # a view into a larger storage: a copy
            if elem != a:
                name, nbytes = role + "/cast", N * width * a
            elif nbytes != N * width * elem:
                name, nbytes = role + "/compact", N * width * elem
            out.add("attn/core_inputs", nbytes, name)
    elif flash:
        for role in "qkv":
            name, nbytes = kernel_copy(role)
            out.add("attn/qkv", nbytes, name)
        mem_efficient = _mem_efficient(cfg, setup)
        out.add("attn/logsumexp", b * H * (-(-S // 32) * 32 if mem_efficient else S) * 4)
        if window:
            out.add("attn/window_mask", S * S * a)
        # the flash kernel lays its output out like q: a q made by a cat in (b, H, S, hd)
        # order (partial rotary, MLA) gives an output that y.transpose(1, 2).contiguous()
        # copies; the memory-efficient kernel's is c_proj's input already
        partial = 0 < cfg.rotary_dims < cfg.head_size and not cfg.mla
        if (partial or cfg.mla) and H > 1 and S > 1 and not mem_efficient:
            out.add("attn/sdpa_out", N * H * cfg.v_dim * a)
    else:
        math_path = setup.attn_impl == "sdpa"
        m = 4 if math_path else a  # the math path computes 16-bit inputs in fp32 on CPU
        views = b == 1 or H == 1  # matmul's (b, H) fold is then a view
        for role, key in (("q", "attn/q"), ("k", "attn/k_t"), ("v", "attn/v")):
            # MLA's v, a (b, S, H, .) slice of the kv_b output moved to (b, H, S, .), folds
            # into a view too when S is 1 (the batch stride is then H rows of that output)
            view = views or (cfg.mla and role == "v" and S == 1)
            if not view or (math_path and (role != "v" or a != 4)):
                out.add(key, N * src[role][2] * m)
            else:
                name, nbytes = kernel_copy(role)
                out.add(key, nbytes, name)
        cols = S + 1 if cfg.attn_sinks else S
        att = b * H * S * S
        if not math_path:
            out.add("attn/causal_mask", S * S)
        # CUDA autocast runs softmax in fp32 and att @ v casts the probabilities back to 16
        # bit (kernel documentation; not measured here); on CPU under amp ALiBi's fp32 slopes
        # promote the scores to fp32 and att @ v casts them
        fp32_softmax = (setup.device == "cuda" and setup.mode in ("amp", "mixed") and m == a
                        or amp and alibi and not math_path)
        out.add("attn/softmax", b * H * S * cols * (4 if fp32_softmax else m))
        if drop:
            out.add("attn/dropout_mask", att * (1 if not math_path else m))
        if drop or fp32_softmax:
            out.add("attn/dropped", att * m)
    out.add("attn/out_input", N * cfg.attn_out_width * a)
    out.add("attn/resid_dropout_mask", N * cfg.n_embd if drop else 0)
    return out.lines


def op_block_lines(cfg: GPTConfig, b: int, S: int, setup: TrainingSetup, flash: bool
                   ) -> dict[str, int]:
    """What torchtitan's op-level selective checkpointing keeps of one dense block beyond its
    input (torchtitan/distributed/activation_checkpoint.py, `_apply_op_sac`; the save list of
    torchtitan/models/llama3/infra/parallelize.py): the outputs of the block's `aten.mm`s
    (Linear layers without a bias) but every second one, counted in forward order
    (`gptcalc.recompute.op_kept_linears`), and the flash-type SDPA kernel's outputs. A biased
    Linear runs `aten.addmm`, which the list does not hold: it is recomputed and not counted.

      op/<linear>      N*width      each kept mm output, in the compute dtype
      op/sdpa_out      N*H*v_dim    the kernel's output (flash kernel: SDPA without dropout
      op/logsumexp     b*H*S*4      on CPU, no ALiBi, q/k and v heads alike; on CUDA also
                                    MLA's memory-efficient kernel, whose logsumexp rounds S up
                                    to 32 rows), its fp32 logsumexp
    """
    N, a, H = b * S, setup.act_bytes, cfg.n_head
    out: dict[str, int] = {}
    for lin in op_kept_linears(cfg):
        key = f"op/{lin.name}"
        out[key] = out.get(key, 0) + N * lin.n_out * a
    if flash:
        out["op/sdpa_out"] = N * H * cfg.v_dim * a
        out["op/logsumexp"] = b * H * (-(-S // 32) * 32 if _mem_efficient(cfg, setup) else S) * 4
    return out


def _block_lines(cfg: GPTConfig, N: int, setup: TrainingSetup
                 ) -> tuple[dict[str, int], bool]:
    """The norms of one block and whether its MLP's input is a tensor the attention's
    projections saved already (a parallel block whose branches read one tensor, outside amp).

      ln_1, ln_2        pre-norms of the residual stream (`_norm_lines`; a parallel block's
                        ln_2 reads the block input ln_1 saved already)
      ln_attn_out,      post-norms of each branch's output (Gemma 2/3, OLMo 2), in the
      ln_mlp_out        branch's dtype (16-bit under amp; an MoE block's output is the stream's)
    """
    a, r = setup.act_bytes, 4 if setup.mode in ("fp32", "amp") else setup.act_bytes
    amp = setup.mode == "amp"
    stats = 4 if (r == 4 or setup.device == "cuda") else a
    lines: dict[str, int] = {}
    if cfg.pre_norm:
        lines.update({f"ln_1/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
        if not cfg.shared_norm:
            ln_2 = _norm_lines(cfg, N, r, stats)
            if cfg.parallel_residual:  # ln_2 reads the block input ln_1 saved
                ln_2["input"] = 0
            lines.update({f"ln_2/{k}": v for k, v in ln_2.items()})
    if cfg.post_norm:
        lines.update({f"ln_attn_out/{k}": v for k, v in _norm_lines(cfg, N, a, stats).items()})
    shared_input = cfg.parallel_residual and (cfg.shared_norm or not cfg.pre_norm) and not amp
    return lines, shared_input


def reference_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                    ) -> dict[str, int]:
    """Bytes PyTorch saves for backward in one forward of the reference model, one line each.

    Exact (measured with saved_tensors_hooks, deduplicated by storage) on CPU for every mode
    (fp32, bf16, and under torch.autocast amp and mixed, bf16 or fp16), for every size (with b
    or H equal to 1, matmul saves views instead of copies), and every switch: q/k norms, post-
    norms, shared parallel norms, sliding windows, sinks, ALiBi, GeGLU, MLA, MoE (any routing:
    `moe_lines`), BLOOM's embedding norm, OPT's projections. One micro-batch of b = B
    sequences on one device, before tensor/sequence-parallel sharding. Keys: `embedding/...`,
    `layer/...` (summed over the blocks of each kind: global or sliding attention, dense or MoE
    MLP, counted by `gptcalc.layers`), `final/...`, `cross_entropy/...`, `input/...` (the
    batch's index tensors), `weight_copy/...` (amp: `autocast_weight_copies`).

    CPU autocast (measured, torch 2.13): Linear and matmul / bmm / SDPA run in the 16-bit dtype;
    layer_norm, softmax, GELU, SiLU, ReLU and the RMSNorm's pow / mean / rsqrt are not autocast
    (they run in their input's dtype); cross entropy runs in fp32. Under amp the weights,
    embeddings and buffers are fp32, so the residual stream, its norms and rotary's q and k are
    fp32, while every Linear saves its own 16-bit cast of its input (autocast caches casts of
    parameters only). Under mixed the model is 16-bit throughout, as in bf16, except the cross
    entropy's fp32 log-probabilities and total weight. Not exact: amp with OPT's project_in
    and no learned or sinusoidal positions (the first block then reads a 16-bit stream).

    Per token (N = bS, a activation bytes, r the stream's bytes):
      embedding/positions   8S int64      the learned table's indices
      embedding/proj_in     N*P           OPT's project_in input (the token embedding)
      embedding/ln_emb      `_norm_lines` BLOOM's embedding norm
      embedding/dropout     N bool*E
      layer/ln_*            `_block_lines`
      layer/attn/...        `_attention_lines` (global and sliding blocks)
      layer/mlp/...         N*E, N*d_ff*k  `mlp_lines` (dense blocks), + N*E dropout mask
      layer/moe/...         `moe_lines` (MoE blocks)
      final/ln_f            `_norm_lines`; final/proj_out N*E (OPT's project_out input)
      final/lm_head_input   N*P
      cross_entropy         N*V log-probabilities, fp32 under autocast; the total weight
    recompute full: each block's input only (torch.utils.checkpoint); selective: the attention
    core (grouped-query expansion, scores, softmax, dropout) is recomputed and only its q, k, v
    inputs are kept; op: each block's input and the outputs torchtitan's op-level policy keeps
    (`op_block_lines`; not for MoE blocks, where what it keeps depends on the routing).
    """
    b, S = workload.batch_size, workload.seq_len
    N, a = b * S, setup.act_bytes
    E, V, P = cfg.n_embd, cfg.vocab_size, cfg.embd_dim
    amp = setup.mode == "amp"
    # r: the residual stream's bytes, the weights' dtype: fp32 weights and embeddings keep it
    # fp32 under amp (a 16-bit branch output added to it promotes to fp32)
    r = 4 if setup.mode in ("fp32", "amp") else a
    stats = 4 if (r == 4 or setup.device == "cuda") else a
    drop = cfg.dropout > 0
    out: dict[str, int] = {
        "embedding/positions": 8 * S if cfg.pos_embedding == "learned" else 0,  # int64 arange
        "embedding/proj_in": N * P * a if P != E else 0,
        "embedding/dropout_mask": N * E if drop and cfg.embd_dropout else 0,
    }
    if cfg.embd_norm:
        out.update({f"embedding/ln_emb/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
    layer: dict[str, int] = {}

    def add(lines: dict[str, int], count: int, prefix: str = "") -> None:
        for k, v in lines.items():
            layer[prefix + k] = layer.get(prefix + k, 0) + count * v

    if setup.recompute in ("full", "op"):
        layer["block_input"] = cfg.n_layer * N * E * r
        if setup.recompute == "op":
            if cfg.moe:
                raise ConfigError("recompute", "recompute op keeps every second matmul of a "
                                  "block, which in an MoE block depends on the routing; use "
                                  "--recompute none, selective or full")
            add(op_block_lines(cfg, b, S, setup, _flash(cfg, setup)), cfg.n_layer)
    else:
        norms, shared_input = _block_lines(cfg, N, setup)
        add(norms, cfg.n_layer)
        for sliding, count in ((False, global_layers(cfg)), (True, sliding_layers(cfg))):
            if count:
                add(_attention_lines(cfg, b, S, setup, sliding), count)
        up_casts = 2 if amp and cfg.mlp in GATED_MLPS else 1
        dense, moe = dense_mlp_layers(cfg), moe_layers(cfg)
        add(mlp_lines(cfg, N, cfg.ffn_dim, a, up_casts, shared_input), dense, "mlp/")
        if moe:
            add(moe_lines(cfg, N, a, amp, shared_input), moe)
        add({"mlp/dropout_mask": N * E if drop else 0}, cfg.n_layer)
        if cfg.post_norm:  # the MLP's output: 16 bit under amp, an MoE block's the stream's
            add({f"ln_mlp_out/{k}": v for k, v in _norm_lines(cfg, N, a, stats).items()}, dense)
            add({f"ln_mlp_out/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()}, moe)
    out.update({f"layer/{k}": v for k, v in layer.items()})
    if cfg.final_norm:
        out.update({f"final/ln_f/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
    out["final/proj_out_input"] = N * E * a if P != E else 0
    out["final/lm_head_input"] = N * P * a
    # cross entropy autocasts to fp32: its log-probabilities and total weight are fp32
    autocast = setup.mode in ("amp", "mixed")
    out["cross_entropy/log_probs"] = N * V * (4 if autocast else a)
    out["cross_entropy/total_weight"] = 4 if autocast or setup.mode == "fp32" else a
    out["input/idx"] = 8 * N
    out["input/targets"] = 8 * N
    out.update(autocast_weight_copies(cfg, setup))
    return out
