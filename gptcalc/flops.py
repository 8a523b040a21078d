"""FLOPs of a decoder-only transformer, exact, by component.

Conventions: one multiply-accumulate = 2 FLOPs; the default counts matmul FLOPs with
attention over the full S x S score matrix (what kernels compute and what FlopCounterMode and the
PaLM/nanoGPT MFU formula count, in sliding-window blocks too, where a dense kernel computes the
full matrix and masks it); `causal=True` counts only the pairs the mask keeps: S(S+1)/2 in a
global block, query i seeing min(i + 1, window) keys in a sliding-window block. Linear
biases, normalisation, softmax, activations, residual adds and rotary are not matmuls: they are
itemised by `nonmatmul_flops` with the per-element costs in `NONMATMUL_COST`. The embedding
lookup is a gather and costs nothing. Counts are per sequence unless a name says otherwise.

Mixture of experts: a token runs the router and the n_expert_active routed experts it is sent
to, plus the shared experts; the routed experts it is not sent to cost nothing. Multi-head
latent attention is counted without weight absorption, k and v decompressed by kv_b_proj as
transformers' forward does; a decode step decompresses only the new token (a cache of
decompressed heads, as the reference model keeps). transformers 5 caches the latent instead and
decompresses all c cached tokens at every step: 2 * c * kv_lora_rank * H * (nope + v) more per
block and step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GATED_MLPS, GPTConfig
from .errors import ConfigError, one_of
from .workload import Workload, validate_workload
from .layers import dense_mlp_layers, global_layers, moe_layers, sliding_layers, window_pairs
from .params import count_params
from .recompute import op_recomputed_linears

RECOMPUTE = ("none", "selective", "op", "full")

# FLOPs per element for the work that is not a matmul. These are conventions, not measurements:
# LayerNorm's 5 is fvcore's (mean, variance, normalise, scale, shift); the rest count one FLOP
# per arithmetic operation of the textbook formula.
NONMATMUL_COST = {
    "layernorm": 5,  # per input element (fvcore's count for an affine LayerNorm)
    "layernorm_nobias": 5,  # fvcore counts 5 whenever a weight is present
    "rmsnorm": 4,  # square, accumulate, multiply by rsqrt, multiply by weight
    "softmax": 5,  # per score: max, subtract, exp, sum, divide
    "scale": 1,  # per score: divide by sqrt(head_dim)
    "relu": 1,
    "gelu": 8,  # erf or tanh form: about 8 operations per element
    "gelu_tanh": 8,
    "swiglu": 5,  # SiLU x*sigmoid(x) (4) and the gate product (1), per hidden element
    "geglu": 9,  # GELU (8) and the gate product (1), per hidden element
    "alibi": 1,  # per score: add the head's slope times the distance
    "residual": 1,  # one add per element of the residual stream
    "bias": 1,  # one add per output element of a biased Linear
    "rotary": 3,  # x*cos + rotate(x)*sin per element of q and k
    "position": 1,  # adding a learned or sinusoidal position vector
}


def attention_pairs(seq_len: int, causal: bool) -> int:
    """Query-key pairs one head of a global block scores: all S^2, or the S(S+1)/2 a causal mask
    keeps."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def local_attention_pairs(cfg: GPTConfig, seq_len: int, causal: bool) -> int:
    """Query-key pairs one head of a sliding-window block scores: the full S^2 a dense kernel
    computes before masking, or with `causal` the pairs the window keeps."""
    if not causal or cfg.sliding_window is None:
        return attention_pairs(seq_len, causal)
    return window_pairs(seq_len, cfg.sliding_window)


def _qkv_flops(cfg: GPTConfig, S: int) -> int:
    """The q/k/v projections of one block over S tokens (every qkv_layout has the same matmul
    count; MLA's low-rank projections are its own)."""
    E, H, dqk = cfg.n_embd, cfg.n_head, cfg.qk_head_dim
    if not cfg.mla:
        return 2 * S * E * (cfg.q_width + 2 * cfg.kv_width)  # x @ [W_q W_k W_v]: (S,E)x(E,Dq+2Dkv)
    r_q, r_kv, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_dim
    if r_q is None:
        q = 2 * S * E * H * dqk  # x @ W_q: (S,E)x(E,H*dqk)
    else:
        q = (2 * S * E * r_q  # x @ W_q_a: (S,E)x(E,r_q), the query latent
             + 2 * S * r_q * H * dqk)  # c_q @ W_q_b: (S,r_q)x(r_q,H*dqk)
    kv_a = 2 * S * E * (r_kv + rope)  # x @ W_kv_a: the kv latent and the shared rotary key
    kv_b = 2 * S * r_kv * H * (cfg.nope_dim + cfg.v_dim)  # c_kv @ W_kv_b: k_nope and v, all heads
    return q + kv_a + kv_b


def _mlp_flops(cfg: GPTConfig, S: int, width: int) -> tuple[int, int, int]:
    """(up, gate, down) matmul FLOPs of one MLP of hidden `width` over S tokens."""
    E = cfg.n_embd
    up = 2 * S * E * width  # x @ W_fc: (S,E)x(E,width)
    gate = up if cfg.mlp in GATED_MLPS else 0  # x @ W_gate of SwiGLU / GeGLU
    down = 2 * S * width * E  # h @ W_proj: (S,width)x(width,E)
    return up, gate, down


def matmul_flops(cfg: GPTConfig, queries: int, pairs: int, local_pairs: int | None = None
                 ) -> dict[str, int]:
    """Matmul FLOPs of `queries` new positions that score `pairs` query-key pairs per head in a
    global block and `local_pairs` (default `pairs`) in a sliding-window block.

    A forward pass over S tokens is queries=S, pairs=S^2 (or the causal half); one decode step
    with a KV cache at context c is queries=1, pairs=c, local_pairs=min(c, window).
    """
    S, L, E, V = queries, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    H, dqk, dv = cfg.n_head, cfg.qk_head_dim, cfg.v_dim
    # pairs one head scores, summed over the blocks: global ones, then sliding-window ones
    P = global_layers(cfg) * pairs + sliding_layers(cfg) * (
        pairs if local_pairs is None else local_pairs)
    Ld, Lm, k = dense_mlp_layers(cfg), moe_layers(cfg), cfg.n_expert_active
    fc, gate, proj = _mlp_flops(cfg, S, cfg.ffn_dim)  # a dense block's MLP
    efc, egate, eproj = _mlp_flops(cfg, S, cfg.expert_dim)  # one routed expert, every token
    sfc, sgate, sproj = _mlp_flops(cfg, S, cfg.shared_dim)  # the shared experts' MLP
    P_emb = cfg.embd_dim
    return {
        "attention/qkv": L * _qkv_flops(cfg, S),  # q, k, v projections (MLA: its latents)
        "attention/scores": 2 * H * P * dqk,  # q @ k^T, each head, every scored pair
        "attention/values": 2 * H * P * dv,  # att @ v, each head, every scored pair
        "attention/out": L * 2 * S * cfg.attn_out_width * E,  # y @ W_o: (S,H*dv)x(H*dv,E)
        "mlp/fc": Ld * fc,  # dense blocks: x @ W_fc
        "mlp/gate": Ld * gate,  # dense blocks: SwiGLU / GeGLU gate
        "mlp/proj": Ld * proj,  # dense blocks: h @ W_proj
        "moe/router": Lm * 2 * S * E * cfg.n_expert,  # x @ W_router: (S,E)x(E,n_expert)
        # each token through the k routed experts it is sent to: up, gate, down
        "moe/experts": Lm * k * (efc + egate + eproj),
        "moe/shared": Lm * (sfc + sgate + sproj  # every token through the shared experts
                            # Qwen2-MoE: x @ W_shared_gate, (S,E)x(E,1)
                            + (2 * S * E if cfg.shared_dim and cfg.shared_expert_gate else 0)),
        # OPT: project_in (S,P)x(P,E) and project_out (S,E)x(E,P)
        "embedding/proj": 2 * (2 * S * P_emb * E) if P_emb != E else 0,
        "lm_head": 2 * S * P_emb * V,  # logits for every position: (S,P)x(P,V), P = E but OPT's
    }


def forward_flops(cfg: GPTConfig, seq_len: int, causal: bool = False) -> dict[str, int]:
    """Forward matmul FLOPs of one sequence of `seq_len` tokens, by component."""
    return matmul_flops(cfg, seq_len, attention_pairs(seq_len, causal),
                        local_attention_pairs(cfg, seq_len, causal))


def nonmatmul_flops(cfg: GPTConfig, seq_len: int, causal: bool = False) -> dict[str, int]:
    """Forward FLOPs of one sequence outside the matmuls, at the costs of `NONMATMUL_COST`.

    "norm" counts the E-wide block, embedding and final norms (what fvcore's layer_norm counts
    for a LayerNorm model); q/k norms and MLA's latent norms are "attention/qk_norm". Biases are
    the inventory's bias vectors, one add per element per token (k of the n routed experts'
    biases)."""
    from .inventory import inventory

    S, L, E = seq_len, cfg.n_layer, cfg.n_embd
    H, k, c = cfg.n_head, cfg.n_expert_active, NONMATMUL_COST
    Lg, Ll, Ld, Lm = global_layers(cfg), sliding_layers(cfg), dense_mlp_layers(cfg), moe_layers(cfg)
    scores = H * (Lg * attention_pairs(S, causal) + Ll * local_attention_pairs(cfg, S, causal))
    if cfg.attn_sinks:  # the sink joins each query's softmax as one more logit
        scores += L * H * S
    per_block = ((1 if cfg.shared_norm else 2) if cfg.pre_norm else 0) + (2 if cfg.post_norm else 0)
    norms = L * per_block + int(cfg.final_norm) + int(cfg.embd_norm)
    if cfg.mla:  # RMSNorms of the query latent (if any) and of the kv latent
        qk_norm_width = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    elif cfg.qk_norm == "none":
        qk_norm_width = 0
    else:  # every query and key head is normalised, whatever the weight's sharing
        qk_norm_width = (H + cfg.kv_heads) * cfg.head_size
    rotary_heads = H + (1 if cfg.mla else cfg.kv_heads)  # MLA rotates one shared key head
    bias = sum(t.active_elements(k) for t in inventory(cfg) if t.role == "bias")
    return {
        "norm": c[cfg.norm] * norms * S * E,
        "attention/qk_norm": c["rmsnorm" if cfg.norm == "rmsnorm" else "layernorm"] * L * S
        * qk_norm_width,
        "attention/scale": c["scale"] * scores,
        "attention/softmax": c["softmax"] * scores,
        "attention/alibi": c["alibi"] * scores if cfg.pos_embedding == "alibi" else 0,
        # rotary turns the first rotary_dims of every query and key head (all of it unless
        # GPT-NeoX's rotary_pct < 1); rotary_dims is 0 without rotary positions
        "attention/rotary": c["rotary"] * L * S * rotary_heads * cfg.rotary_dims,
        "moe/routing": c["softmax"] * Lm * S * cfg.n_expert,  # softmax over the router logits
        "mlp/activation": c[cfg.mlp] * S * (Ld * cfg.ffn_dim
                                            + Lm * (k * cfg.expert_dim + cfg.shared_dim)),
        "residual": c["residual"] * 2 * L * S * E,
        "bias": c["bias"] * S * bias,
        "embedding/position": (
            c["position"] * S * E if cfg.pos_embedding in ("learned", "sinusoidal") else 0
        ),
    }


def recompute_flops(
    cfg: GPTConfig, forward: dict[str, int], recompute: str = "none", flash_backward: bool = False,
    seq_len: int = 0,
) -> dict[str, int]:
    """Forward matmul work done again during backward (hardware FLOPs beyond model FLOPs).

    selective: the attention core, scores and values (Korthikanti et al. 2022, sec. 5).
    op: torchtitan's op-level selective checkpointing (torchtitan/distributed/
    activation_checkpoint.py): L x 2S x in x out for each Linear of
    `gptcalc.recompute.op_recomputed_linears` (S = `seq_len`, the tokens of `forward`), and the
    attention core unless a flash-type kernel ran (`flash_backward`), whose outputs are kept;
    dense blocks only.
    full: every block's forward, not the lm_head nor OPT's projections (Megatron's full
    recomputation: each block's input is kept and the block is run again).
    flash_backward: a flash-type attention backward recomputes q @ k^T (Dao et al. 2022), which is
    why FlopCounterMode counts SDPA's backward at 2.5x its forward.
    """
    one_of("recompute", recompute, RECOMPUTE)
    extra = dict.fromkeys(forward, 0)
    if recompute == "full":
        extra.update({k: v for k, v in forward.items() if k not in ("lm_head", "embedding/proj")})
    elif recompute == "op":
        if cfg.moe:
            raise ConfigError("recompute", "recompute op keeps every second matmul of a block, "
                                           "which in an MoE block depends on the routing")
        for lin in op_recomputed_linears(cfg):  # L x (S,in)x(in,out)
            extra[lin.component] += cfg.n_layer * 2 * seq_len * lin.n_in * lin.n_out
        if not flash_backward:  # a flash-type kernel's output is kept; bmm's are not
            extra["attention/scores"] = forward["attention/scores"]
            extra["attention/values"] = forward["attention/values"]
    elif recompute == "selective":
        extra["attention/scores"] = forward["attention/scores"]
        extra["attention/values"] = forward["attention/values"]
    if flash_backward and recompute != "full":
        # selective already recomputes the scores; the kernel does not do it twice
        extra["attention/scores"] = forward["attention/scores"]
    return extra


@dataclass(frozen=True)
class FlopCount:
    """Matmul FLOPs of one training step's forward, backward and recomputation, by component.

    Dicts are per sequence; multiply by `batch_size` for the step, divide by `seq_len` for a token.
    """

    batch_size: int
    seq_len: int
    forward: dict[str, int]
    backward: dict[str, int]  # 2x forward: the gradient w.r.t. the input and w.r.t. the weight
    recompute: dict[str, int]
    nonmatmul: dict[str, int]  # forward only

    @property
    def forward_total(self) -> int:
        return sum(self.forward.values())

    @property
    def backward_total(self) -> int:
        return sum(self.backward.values())

    @property
    def training_total(self) -> int:
        """Model FLOPs of one sequence: forward + backward."""
        return self.forward_total + self.backward_total

    @property
    def hardware_total(self) -> int:
        """FLOPs actually executed: training plus recomputed forward work."""
        return self.training_total + sum(self.recompute.values())

    def per_token(self, per_sequence: int) -> int | float:
        """Per-sequence FLOPs divided by S: an exact int for matmul terms, which are all
        multiples of S (2 * S(S+1)/2 included); non-matmul causal terms may leave a fraction."""
        q, r = divmod(per_sequence, self.seq_len)
        return q if r == 0 else per_sequence / self.seq_len


def count_flops(
    cfg: GPTConfig,
    workload: Workload,
    causal: bool = False,
    recompute: str = "none",
    flash_backward: bool = False,
) -> FlopCount:
    validate_workload(cfg, workload)
    fwd = forward_flops(cfg, workload.seq_len, causal)
    return FlopCount(
        batch_size=workload.batch_size,
        seq_len=workload.seq_len,
        forward=fwd,
        backward={k: 2 * v for k, v in fwd.items()},
        recompute=recompute_flops(cfg, fwd, recompute, flash_backward, workload.seq_len),
        nonmatmul=nonmatmul_flops(cfg, workload.seq_len, causal),
    )


@dataclass(frozen=True)
class InferenceFlops:
    """Matmul FLOPs of generation, per sequence.

    prefill: one forward over the prompt, logits for every position (as forward() computes).
    decode_per_token: one new token at context c with a KV cache: the token's projections and
    MLP, its query against the c keys (cached ones and its own; min(c, window) in a
    sliding-window block, whose cache keeps only the window), and its logits.
    decode_per_token_no_cache: a generate loop without a cache, which runs the whole forward over
    the c tokens of the context again for every new token.
    """

    prompt_len: int
    context: int
    prefill: int
    decode_per_token: int
    decode_per_token_no_cache: int


def inference_flops(cfg: GPTConfig, prompt_len: int, context: int) -> InferenceFlops:
    for name, value in (("prompt_len", prompt_len), ("context", context)):
        if value <= 0:
            raise ConfigError(name, f"{name} must be positive, got {value}")
        if value > cfg.block_size:
            raise ConfigError(name, f"{name} {value} exceeds block_size {cfg.block_size}")
    return InferenceFlops(
        prompt_len=prompt_len,
        context=context,
        prefill=sum(forward_flops(cfg, prompt_len).values()),
        # a sliding-window block's cache holds at most the window: min(c, window) keys
        decode_per_token=sum(matmul_flops(cfg, queries=1, pairs=context, local_pairs=min(
            context, cfg.sliding_window or context)).values()),
        decode_per_token_no_cache=sum(forward_flops(cfg, context).values()),
    )


def published_estimates(cfg: GPTConfig, seq_len: int) -> dict[str, int]:
    """Training FLOPs per token by the published shorthands, for comparison with the exact count.

    6N: the dense rule of thumb, N = all parameters.
    kaplan: Kaplan et al. 2020, eq. 2.2 x 3: 6 N_non-embedding + 6 L n_ctx d_attn.
    palm: Chowdhery et al. 2022, appendix B, as nanoGPT's estimate_mfu computes it:
    6N' + 12 L H Q T, where N' = get_num_params(non_embedding=True) is N without the position
    table (nanoGPT subtracts wpe only; the token embedding stays, as the tied lm_head).
    6N_active (mixture of experts only): 6N with N the parameters one token uses.
    """
    p = count_params(cfg)
    N, L, S = p.total, cfg.n_layer, seq_len
    H, Q = cfg.n_head, cfg.head_size
    n_palm = N - p.components.get("embedding/position", 0)
    out = {
        "6N": 6 * N,
        "kaplan": 6 * p.non_embedding + 6 * L * S * cfg.q_width,
        "palm": 6 * n_palm + 12 * L * H * Q * S,
    }
    if cfg.moe:
        out["6N_active"] = 6 * p.active
    return out
