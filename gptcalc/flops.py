"""FLOPs of a decoder-only transformer, exact, by component.

Conventions (DESIGN.md): one multiply-accumulate = 2 FLOPs; the default counts matmul FLOPs with
attention over the full S x S score matrix (what kernels compute and what FlopCounterMode and the
PaLM/nanoGPT MFU formula count); `causal=True` counts only the S(S+1)/2 unmasked pairs. Linear
biases, normalisation, softmax, activations, residual adds and rotary are not matmuls: they are
itemised by `nonmatmul_flops` with the per-element costs in `NONMATMUL_COST`. The embedding
lookup is a gather and costs nothing. Counts are per sequence unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError, GPTConfig, Workload, validate_workload
from .params import count_params

RECOMPUTE = ("none", "selective", "full")

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
    "residual": 1,  # one add per element of the residual stream
    "bias": 1,  # one add per output element of a biased Linear
    "rotary": 3,  # x*cos + rotate(x)*sin per element of q and k
    "position": 1,  # adding a learned or sinusoidal position vector
}


def attention_pairs(seq_len: int, causal: bool) -> int:
    """Query-key pairs one head scores: all S^2, or the S(S+1)/2 a causal mask keeps."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def matmul_flops(cfg: GPTConfig, queries: int, pairs: int) -> dict[str, int]:
    """Matmul FLOPs of `queries` new positions that score `pairs` query-key pairs per head.

    A forward pass over S tokens is queries=S, pairs=S^2 (or the causal half); one decode step
    with a KV cache at context c is queries=1, pairs=c.
    """
    S, L, E, V = queries, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    Dq, Dkv, Dff, H, hd = cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.n_head, cfg.head_size
    return {
        "attention/qkv": L * 2 * S * E * (Dq + 2 * Dkv),  # x @ [W_q W_k W_v]: (S,E)x(E,Dq+2Dkv)
        "attention/scores": L * 2 * H * pairs * hd,  # q @ k^T, each head, every scored pair
        "attention/values": L * 2 * H * pairs * hd,  # att @ v, each head, every scored pair
        "attention/out": L * 2 * S * Dq * E,  # y @ W_o: (S,Dq)x(Dq,E)
        "mlp/fc": L * 2 * S * E * Dff,  # x @ W_fc: (S,E)x(E,Dff)
        "mlp/gate": L * 2 * S * E * Dff if cfg.mlp == "swiglu" else 0,  # SwiGLU's gate matrix
        "mlp/proj": L * 2 * S * Dff * E,  # h @ W_proj: (S,Dff)x(Dff,E)
        "lm_head": 2 * S * E * V,  # logits for every position: (S,E)x(E,V)
    }


def forward_flops(cfg: GPTConfig, seq_len: int, causal: bool = False) -> dict[str, int]:
    """Forward matmul FLOPs of one sequence of `seq_len` tokens, by component."""
    return matmul_flops(cfg, seq_len, attention_pairs(seq_len, causal))


def nonmatmul_flops(cfg: GPTConfig, seq_len: int, causal: bool = False) -> dict[str, int]:
    """Forward FLOPs of one sequence outside the matmuls, at the costs of `NONMATMUL_COST`."""
    S, L, E, V = seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    Dq, Dkv, Dff, H = cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.n_head
    c = NONMATMUL_COST
    scores = L * H * attention_pairs(S, causal)
    norms = 2 * L + (1 if cfg.final_norm else 0)
    biased_outputs = L * (
        ((Dq + 2 * Dkv) if cfg.qkv_bias else 0)
        + (E if cfg.attn_out_bias else 0)
        + ((Dff * (2 if cfg.mlp == "swiglu" else 1) + E) if cfg.mlp_bias else 0)
    ) + (V if cfg.lm_head_bias else 0)
    return {
        "norm": c[cfg.norm] * norms * S * E,
        "attention/scale": c["scale"] * scores,
        "attention/softmax": c["softmax"] * scores,
        # rotary turns the first rotary_dims of every query and key head (all of it unless
        # GPT-NeoX's rotary_pct < 1); rotary_dims is 0 without rotary positions
        "attention/rotary": c["rotary"] * L * S * (H + cfg.kv_heads) * cfg.rotary_dims,
        "mlp/activation": c[cfg.mlp] * L * S * Dff,
        "residual": c["residual"] * 2 * L * S * E,
        "bias": c["bias"] * S * biased_outputs,
        "embedding/position": (
            c["position"] * S * E if cfg.pos_embedding in ("learned", "sinusoidal") else 0
        ),
    }


def recompute_flops(
    cfg: GPTConfig, forward: dict[str, int], recompute: str = "none", flash_backward: bool = False
) -> dict[str, int]:
    """Forward matmul work done again during backward (hardware FLOPs beyond model FLOPs).

    selective: the attention core, scores and values (Korthikanti et al. 2022, sec. 5).
    full: every block's forward, not the lm_head (Megatron's full recomputation: each block's
    input is kept and the block is run again).
    flash_backward: a flash-type attention backward recomputes q @ k^T (Dao et al. 2022), which is
    why FlopCounterMode counts SDPA's backward at 2.5x its forward.
    """
    if recompute not in RECOMPUTE:
        raise ConfigError("recompute", f"recompute must be one of {', '.join(RECOMPUTE)}")
    extra = dict.fromkeys(forward, 0)
    if recompute == "full":
        extra.update({k: v for k, v in forward.items() if k != "lm_head"})
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
        recompute=recompute_flops(cfg, fwd, recompute, flash_backward),
        nonmatmul=nonmatmul_flops(cfg, workload.seq_len, causal),
    )


@dataclass(frozen=True)
class InferenceFlops:
    """Matmul FLOPs of generation, per sequence.

    prefill: one forward over the prompt, logits for every position (as forward() computes).
    decode_per_token: one new token at context c with a KV cache: the token's projections and
    MLP, its query against the c keys (cached ones and its own), and its logits.
    decode_per_token_no_cache: the seeds' generate, which runs the whole forward over the c
    tokens of the context again for every new token.
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
        decode_per_token=sum(matmul_flops(cfg, queries=1, pairs=context).values()),
        decode_per_token_no_cache=sum(forward_flops(cfg, context).values()),
    )


def published_estimates(cfg: GPTConfig, seq_len: int) -> dict[str, int]:
    """Training FLOPs per token by the published shorthands, for comparison with the exact count.

    6N: the dense rule of thumb, N = all parameters.
    kaplan: Kaplan et al. 2020, eq. 2.2 x 3: 6 N_non-embedding + 6 L n_ctx d_attn.
    palm: Chowdhery et al. 2022, appendix B, as nanoGPT's estimate_mfu computes it:
    6N' + 12 L H Q T, where N' = get_num_params(non_embedding=True) is N without the position
    table (nanoGPT subtracts wpe only; the token embedding stays, as the tied lm_head).
    """
    p = count_params(cfg)
    N, L, S = p.total, cfg.n_layer, seq_len
    H, Q = cfg.n_head, cfg.head_size
    n_palm = N - p.components.get("embedding/position", 0)
    return {
        "6N": 6 * N,
        "kaplan": 6 * p.non_embedding + 6 * L * S * cfg.q_width,
        "palm": 6 * n_palm + 12 * L * H * Q * S,
    }
