"""What the project's reference model (reference_model/model.py) saves for backward.

One line per saved tensor kind of one micro-batch on one device, before tensor/sequence
parallel sharding (`gptcalc.memory.activations` shards the lines). Exact against
`saved_tensors_hooks` on CPU for every mode; CUDA lines follow the kernels' documented dtypes.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig, TrainingSetup, Workload
from .states import autocast_weight_copies


def _qkv_storages(cfg: GPTConfig, N: int, a: int, rot: int | None = None) -> int:
    """Bytes of the storages behind the q, k, v handed to the attention core.

    Each is a view of the projection that made it unless something copied it: rotary (a new
    tensor for q and k, `rot` bytes per element: fp32 under amp, where the fp32 cos/sin tables
    promote the 16-bit q and k), grouped-query repeat_interleave (new k and v of H heads).
    Views of the fused c_attn output keep all of it, N(Dq + 2Dkv), alive once.
    """
    Dq, Dkv = cfg.q_width, cfg.kv_width
    rot = a if rot is None else rot
    gqa, rotary = cfg.kv_heads != cfg.n_head, cfg.pos_embedding == "rotary"
    own = {"q": Dq * rot if rotary else 0,
           "k": Dq * (rot if rotary else a) if gqa else (Dkv * rot if rotary else 0),
           "v": Dq * a if gqa else 0}
    total = sum(own.values())
    views = [r for r in own if not own[r]]
    if cfg.qkv_layout == "fused":
        total += (Dq + 2 * Dkv) * a if views else 0
    else:  # separate projections (per_head: concatenated per role) are storages of their own
        total += sum(Dq if r == "q" else Dkv for r in views) * a
    return N * total


def _matmul_operands(cfg: GPTConfig, b: int, N: int, a: int, m: int, math_path: bool
                     ) -> dict[str, int]:
    """Storages behind the q, k^T and v that the attention matmuls save, m bytes per element.

    matmul folds (b, H, S, hd) operands to (b*H, S, hd). When b == 1 or H == 1 that reshape is
    a view, so what is saved is the tensor q, k or v is a view of: the fused c_attn output
    (N(Dq + 2Dkv), kept once however many roles share it), a separate projection's output, the
    rotary or repeat_interleave result (N*Dq). Otherwise matmul saves a contiguous copy, N*Dq
    each. (S == 1 can also fold as a view, but only where the source holds exactly N*Dq.)
    SDPA's math path scales q and k first (fresh tensors either way) and, in 16-bit, upcasts v
    to fp32, so only an fp32 v can be a view of its source.
    """
    Dq, Dkv, H = cfg.q_width, cfg.kv_width, cfg.n_head
    gqa, rotary = cfg.kv_heads != H, cfg.pos_embedding == "rotary"
    views = b == 1 or H == 1

    def source(role: str) -> tuple[str, int]:
        if (role == "q" and rotary) or (role == "k" and rotary and not gqa) or (
                role in "kv" and gqa):
            return role + "/own", N * Dq * a  # rotary / repeat_interleave made a new tensor
        if cfg.qkv_layout == "fused":
            return "c_attn", N * (Dq + 2 * Dkv) * a
        return role + "/proj", N * (Dq if role == "q" else Dkv) * a

    lines, seen = {}, set()
    for role, key in (("q", "attn/q"), ("k", "attn/k_t"), ("v", "attn/v")):
        if not views or (math_path and (role != "v" or a != 4)):
            lines[key] = N * Dq * m  # a fresh contiguous copy
            continue
        name, nbytes = source(role)
        lines[key] = 0 if name in seen else nbytes
        seen.add(name)
    return lines


def _norm_lines(cfg: GPTConfig, N: int, a: int, stats: int) -> dict[str, int]:
    E = cfg.n_embd
    if cfg.norm == "rmsnorm":
        # x * rsqrt(mean(x^2) + eps) * w: pow saves x, rsqrt its result, the last mul x * r
        return {"input": N * E * a, "rsqrt": N * a, "normalized": N * E * a}
    # native_layer_norm saves its input, mean and rstd
    return {"input": N * E * a, "mean": N * stats, "rstd": N * stats}


def reference_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                    ) -> dict[str, int]:
    """Bytes PyTorch saves for backward in one forward of the reference model, one line each.

    Exact (measured with saved_tensors_hooks, deduplicated by storage) on CPU for every mode
    (fp32, bf16, and under torch.autocast amp and mixed, bf16 or fp16), for every size (with b
    or H equal to 1, matmul saves views instead of copies: `_matmul_operands`). One micro-batch
    of b = B sequences on one device, before tensor/sequence-parallel sharding. Keys: `embedding/...`, `layer/...` (summed over L layers),
    `final/...`, `cross_entropy/...`, `input/...` (the batch's own index tensors, saved by the
    embedding and the loss), `weight_copy/...` (amp: `autocast_weight_copies`).

    CPU autocast (measured, torch 2.13): Linear and matmul / bmm / SDPA run in the 16-bit dtype;
    layer_norm, softmax, GELU, SiLU, ReLU and the RMSNorm's pow / mean / rsqrt are not autocast
    (they run in their input's dtype; softmax stays 16-bit, unlike CUDA autocast); cross
    entropy runs in fp32. Under amp the weights, embeddings and buffers are fp32, so the
    residual stream, every norm (input, statistics; RMSNorm's rsqrt and x * rsqrt) and rotary's
    q and k (16-bit q, k times fp32 cos / sin) are fp32, while the Linear inputs are 16-bit
    casts, one per Linear (autocast caches casts of parameters only). Under mixed the model is
    16-bit throughout, as in bf16, except the cross entropy's fp32 log-probabilities and total
    weight.

    What each line is (N = bS tokens, a activation bytes, H heads, S sequence):
      norm input, mean and rstd (LayerNorm; 4-byte stats for fp32, `a` bytes for bf16 on CPU,
      fp32 on CUDA); RMSNorm written out saves x, rsqrt (N) and x*rsqrt;
      the q/k/v projections' shared input; manual attention: contiguous copies of q, k^T and v
      made by matmul (N*Dq each), the bool S x S causal mask masked_fill saves, the softmax
      output (bHS^2), with dropout its 1-byte mask and the dropped probabilities; SDPA (CPU flash
      kernel) without dropout: q, k, v storages, the output (shared with c_proj's input) and an
      fp32 logsumexp of bHS; SDPA with dropout (CPU falls back to the math path): copies of q,
      k^T, v, the softmax output, a float dropout mask, the dropped probabilities, all fp32
      (the math path upcasts 16-bit inputs on CPU);
      c_proj's input; the 1-byte masks of the residual dropouts; the MLP up projection's input,
      ReLU's output or GELU's input and output or SwiGLU's gate, SiLU output, up output and
      product; the lm_head input; the log-probabilities of the cross entropy (V per token).
    recompute full: each block's input only (torch.utils.checkpoint); selective: the attention
    core (scores, softmax, dropout) is recomputed and only its q, k, v inputs are kept.
    """
    b, S = workload.batch_size, workload.seq_len
    N, a = b * S, setup.act_bytes
    E, H, V, L = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    Dq, Dff = cfg.q_width, cfg.ffn_dim
    amp = setup.mode == "amp"
    # r: the residual stream's bytes, the weights' dtype: fp32 weights and embeddings keep it
    # fp32 under amp (a 16-bit branch output added to it promotes to fp32)
    r = 4 if setup.mode in ("fp32", "amp") else a
    stats = 4 if (r == 4 or setup.device == "cuda") else a
    # under amp every Linear reading the fp32 stream casts its own 16-bit copy of the input
    # (autocast caches casts of parameters only): separate q/k/v projections make 3 copies,
    # per-head ones 3H, SwiGLU's gate and up projections 2
    qkv_linears = {"fused": 1, "separate": 3, "per_head": 3 * H}[cfg.qkv_layout] if amp else 1
    up_linears = 2 if amp and cfg.mlp in GATED_MLPS else 1
    drop = cfg.dropout > 0
    att = b * H * S * S  # elements of one score matrix stack
    out: dict[str, int] = {
        "embedding/positions": 8 * S if cfg.pos_embedding == "learned" else 0,  # int64 arange
        "embedding/dropout_mask": N * E if drop and cfg.embd_dropout else 0,
    }
    layer: dict[str, int] = {}
    if setup.recompute == "full":
        layer["block_input"] = N * E * r
    else:
        layer.update({f"ln_1/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
        layer["attn/qkv_input"] = qkv_linears * N * E * a
        # CUDA's flash kernel handles dropout itself; CPU's falls back to the math path
        sdpa_flash = setup.attn_impl == "sdpa" and (not drop or setup.device == "cuda")
        if setup.recompute == "selective":
            layer["attn/core_inputs"] = _qkv_storages(cfg, N, a, r)
        elif sdpa_flash:
            layer["attn/qkv"] = _qkv_storages(cfg, N, a)
            layer["attn/logsumexp"] = b * H * S * 4
            # the kernel lays its output out like q. Partial rotary (rotary_dims < head_dim)
            # builds q with a cat in (b, H, S, hd) order, so the output is not already in
            # (b, S, H, hd) order and y.transpose(1, 2).contiguous() copies it for c_proj: the
            # output kept for backward is then a storage of its own.
            partial = 0 < cfg.rotary_dims < cfg.head_size
            layer["attn/sdpa_out"] = N * Dq * a if partial and H > 1 and S > 1 else 0
        else:
            # SDPA's CPU math path (taken with dropout) computes 16-bit inputs in fp32
            m = a if setup.attn_impl == "manual" else 4
            layer.update(_matmul_operands(cfg, b, N, a, m, math_path=setup.attn_impl == "sdpa"))
            if setup.attn_impl == "manual":
                layer["attn/causal_mask"] = S * S  # bool tril == 0, one per layer
            # CUDA autocast runs softmax in fp32 and att @ v casts the probabilities back to 16
            # bit (kernel documentation; not measured here): both are saved
            fp32_softmax = setup.device == "cuda" and setup.mode in ("amp", "mixed") and m == a
            layer["attn/softmax"] = att * (4 if fp32_softmax else m)
            if drop:
                # native_dropout's bool mask; SDPA's math path multiplies by a float mask
                layer["attn/dropout_mask"] = att * (1 if setup.attn_impl == "manual" else m)
            if drop or fp32_softmax:
                layer["attn/dropped"] = att * m  # what att @ v saves
        layer["attn/out_input"] = N * Dq * a  # c_proj's input (SDPA flash: its output)
        layer["attn/dropout_mask"] = layer.get("attn/dropout_mask", 0)
        layer["attn/resid_dropout_mask"] = N * E if drop else 0
        ln_2 = _norm_lines(cfg, N, r, stats)
        if cfg.parallel_residual:
            # GPT-NeoX: ln_2 reads the block input, the very tensor ln_1 saved already
            ln_2["input"] = 0
        layer.update({f"ln_2/{k}": v for k, v in ln_2.items()})
        layer["mlp/fc_input"] = up_linears * N * E * a
        hidden = {"relu": 1, "gelu": 2, "gelu_tanh": 2, "swiglu": 4, "geglu": 4}[cfg.mlp]
        layer["mlp/hidden"] = hidden * N * Dff * a  # incl. c_proj's input
        layer["mlp/dropout_mask"] = N * E if drop else 0
    out.update({f"layer/{k}": L * v for k, v in layer.items()})
    if cfg.final_norm:
        out.update({f"final/ln_f/{k}": v for k, v in _norm_lines(cfg, N, r, stats).items()})
    out["final/lm_head_input"] = N * E * a
    # cross entropy autocasts to fp32: its log-probabilities and total weight are fp32
    autocast = setup.mode in ("amp", "mixed")
    out["cross_entropy/log_probs"] = N * V * (4 if autocast else a)
    out["cross_entropy/total_weight"] = 4 if autocast or setup.mode == "fp32" else a
    out["input/idx"] = 8 * N
    out["input/targets"] = 8 * N
    out.update(autocast_weight_copies(cfg, setup))
    return out
