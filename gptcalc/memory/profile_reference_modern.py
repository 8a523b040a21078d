"""What the reference model saves for backward in its newer parts: q/k norms, multi-head latent
attention's projections, and mixture-of-experts MLPs.

Helpers of `profile_reference.reference_saved`, one micro-batch of N = bS tokens on one device,
before tensor/sequence-parallel sharding, `a` bytes per activation element. Exact on CPU
(saved_tensors_hooks, deduplicated by storage; tests/test_memory_modern.py). Torch-free.

Routing. How many tokens each expert processes depends on the token values, but the saved
bytes do not: every token visits exactly k distinct experts (top-k), so the experts process
N*k token rows in all, and every tensor an expert saves is linear in its row count (an expert
that receives no token saves nothing). The routed experts' lines are therefore exact for any
routing, balanced or not; `moe_lines` takes the counts as an optional argument only to say so.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig

# elements an MLP of kind `mlp` saves per token per hidden unit beyond its input: ReLU its
# output; GELU its input and output; gated (SwiGLU, GeGLU): gate output, activation output, up
# output and their product (the down projection's input)
HIDDEN_SAVED = {"relu": 1, "gelu": 2, "gelu_tanh": 2, "swiglu": 4, "geglu": 4}


class SavedLines:
    """Saved bytes by line, where a storage two ops save is counted once, at its first line
    (autograd keeps a storage once however many nodes hold views of it)."""

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}
        self._seen: set[str] = set()

    def add(self, line: str, nbytes: int, storage: str | None = None) -> None:
        if storage is not None:
            if storage in self._seen:
                nbytes = 0
            self._seen.add(storage)
        self.lines[line] = self.lines.get(line, 0) + nbytes


def weight_norm_lines(out: SavedLines, line: str, rows: int, width: int, a: int, rms: bool,
                      source: tuple[str, int]) -> None:
    """A weight-only norm written out, x * rsqrt(mean(x^2) + eps) * w (RMSNorm; the LayerNorm
    families first centre x, x - mean(x)), over `rows` rows of `width`, input `a` bytes:

      input          source storage   pow's input, a view of the tensor it normalises (RMS)
      centered       rows*width       (LayerNorm kind) x - mean(x), which pow saves instead
      rsqrt          rows             rsqrt's output
      normalized     rows*width       x * rsqrt, saved by the product with the weight
    """
    if rms:
        out.add(f"{line}/input", source[1], source[0])
    else:
        out.add(f"{line}/centered", rows * width * a)
    out.add(f"{line}/rsqrt", rows * a)
    out.add(f"{line}/normalized", rows * width * a)


def mla_projections(cfg: GPTConfig, N: int, a: int, amp: bool, out: SavedLines
                    ) -> dict[str, tuple[str, int, int, int]]:
    """Multi-head latent attention's projections (DeepSeek-V2 sec. 2.1, as transformers'
    DeepseekV3Attention and the reference model run them); adds their saved lines to `out` and
    returns q, k, v as role -> (storage, storage bytes, elements per token, bytes per element).

      q_a_proj / q_proj input   N*E         the block's normalised input (one storage; under
                                            amp each Linear saves its own 16-bit cast)
      kv_a_proj input           N*E         the same tensor (amp: its own cast)
      q_a_norm                  N*r_q (+N)  RMSNorm of the query latent: `weight_norm_lines`
      q_b_proj input            N*r_q       the normalised latent (amp: its 16-bit cast)
      kv_a_norm input           N*(r_kv + rope)  the kv_a output, of which c_kv is a view
      kv_a_norm rsqrt, x*rsqrt  N, N*r_kv
      kv_b_proj input           N*r_kv
    q and k are concatenations of their nope and rotary parts, new tensors of H*(nope + rope)
    (fp32 under amp with rotary: fp32 cos/sin promote the 16-bit rotary part); v is a view of
    the kv_b output, N*H*(nope + v) of storage.
    """
    E, H, r_kv, rope = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim
    qk, vd = cfg.qk_head_dim, cfg.v_dim
    casts = 2 if amp else 1
    out.add("attn/qkv_input", casts * N * E * a)
    if cfg.q_lora_rank is not None:
        rq = cfg.q_lora_rank
        weight_norm_lines(out, "attn/q_a_norm", N, rq, a, True, ("q_a", N * rq * a))
        out.add("attn/q_b_input", N * rq * a)
    weight_norm_lines(out, "attn/kv_a_norm", N, r_kv, a, True, ("kv_a", N * (r_kv + rope) * a))
    out.add("attn/kv_b_input", N * r_kv * a)
    qk_bytes = 4 if amp and cfg.pos_embedding == "rotary" else a
    return {"q": ("q/own", N * H * qk * qk_bytes, H * qk, qk_bytes),
            "k": ("k/own", N * H * qk * qk_bytes, H * qk, qk_bytes),
            "v": ("kv_b", N * H * (cfg.nope_dim + vd) * a, H * vd, a)}


def mlp_lines(cfg: GPTConfig, tokens: int, width: int, a: int, up_casts: int,
              input_saved: bool) -> dict[str, int]:
    """An MLP of kind `cfg.mlp` and hidden `width` on `tokens` rows:

      fc_input    tokens*E*up_casts   the up projection's input (amp: one 16-bit cast per
                                      up Linear, gate and up; 0 when another op saved it)
      hidden      tokens*width*k      `HIDDEN_SAVED` per kind, incl. the down projection's input
    """
    return {"fc_input": 0 if input_saved else up_casts * tokens * cfg.n_embd * a,
            "hidden": HIDDEN_SAVED[cfg.mlp] * tokens * width * a}


def moe_lines(cfg: GPTConfig, N: int, a: int, amp: bool, input_saved: bool,
              expert_tokens: tuple[int, ...] | None = None) -> dict[str, int]:
    """One MoE block's saved bytes (the reference model's router, top-k, expert loop, shared
    experts), N tokens, R = sum of the experts' token counts = N*k for any routing:

      router_input        N*E         the router's input (0 when already saved; amp: a cast)
      router_softmax      N*n_expert  the routing probabilities, softmax's output
      topk_indices        N*k int64   the chosen experts, saved by topk
      routed/indices      2R int64    each expert's token and slot indices (torch.where),
                                      saved by the gathers and the index_add
      routed/fc_input     R*E         each expert's gathered input (amp: a cast per up Linear)
      routed/hidden       R*d_e*k     the experts' hidden tensors (`HIDDEN_SAVED`)
      routed/output       R*E         each expert's output, saved by the weighting product
      routed/weight       R           each token's routing weight, saved by the same product
      routed/weighted     R*E         the weighted output, which index_add saves (cast to the
                                      stream's fp32 under amp)
      shared/...          N*d_s       the shared experts: one MLP of width d_s on every token
      shared/gate         N*(E + 1)   Qwen2-MoE's sigmoid gate: its output and the shared output
                                      it scales (its input is the router's)
    `expert_tokens`: the realised token count of each expert, to check the rule R = N*k.
    """
    E, k, De = cfg.n_embd, cfg.n_expert_active, cfg.expert_dim
    R = N * k if expert_tokens is None else sum(expert_tokens)
    up_casts = 2 if amp and cfg.mlp in GATED_MLPS else 1
    out = {"moe/router_input": N * E * a if amp or not input_saved else 0,
           "moe/router_softmax": N * cfg.n_expert * a,
           "moe/topk_indices": 8 * N * k,
           "moe/routed/indices": 2 * 8 * R}
    out.update({f"moe/routed/{key}": v for key, v in
                mlp_lines(cfg, R, De, a, up_casts, False).items()})
    out["moe/routed/output"] = R * E * a
    out["moe/routed/weight"] = R * a
    out["moe/routed/weighted"] = R * E * (4 if amp else a)
    if cfg.shared_dim:
        shared = mlp_lines(cfg, N, cfg.shared_dim, a, up_casts, not amp)
        out.update({f"moe/shared/{key}": v for key, v in shared.items()})
        if cfg.shared_expert_gate:
            out["moe/shared/gate_input"] = N * E * a if amp else 0
            out["moe/shared/gate"] = N * a + N * E * a  # sigmoid output, shared output
    return out


__all__ = ["HIDDEN_SAVED", "SavedLines", "mla_projections", "mlp_lines", "moe_lines",
           "weight_norm_lines"]
