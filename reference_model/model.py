"""The reference GPT: one readable PyTorch model built from a `gptcalc.GPTConfig`.

Shaped like nanoGPT's model.py (Karpathy): `transformer.wte / wpe / h.N / ln_f` and `lm_head`,
blocks of `ln_1 -> attn -> ln_2 -> mlp` with pre-norm residuals. Every switch of GPTConfig is a
real module choice here, so the analytic counts can be checked against this model:

- qkv_layout: `per_head` (the tutorial's and the notes' per-head key/query/value Linear modules in
  ModuleLists, their outputs concatenated), `fused` (nanoGPT's `c_attn`, Linear(E, Dq + 2 Dkv)),
  `separate` (Llama's q_proj / k_proj / v_proj);
- positions: `learned` (wpe, an Embedding T x E; the notes' Parameter(1, K, D) has the same
  count), `sinusoidal` (Vaswani et al. 2017, a buffer), `rotary` (Su et al. 2021, cos/sin
  buffers applied to q and k; half-split rotation as in GPT-NeoX / Llama), `none`;
- norm: LayerNorm with or without bias, RMSNorm (Zhang & Sennrich 2019, written out by hand);
- mlp: relu, gelu (exact erf), gelu_tanh, swiglu (Shazeer 2020: proj(silu(gate(x)) * fc(x)));
- grouped-query attention (Ainslie et al. 2023): k and v heads repeated to H before the matmuls;
- tied or untied lm_head with an optional bias; optional final norm; embedding dropout;
- GPT-NeoX's partial rotary (rotary_pct) and parallel residual (attention and MLP both read x),
  with one shared norm (Falcon-7B, Phi-2, Cohere) or two;
- GeGLU (Gemma: proj(gelu_tanh(gate(x)) * fc(x))); norms after each branch (Gemma 2/3, OLMo 2)
  with or without the pre-norms; q/k norms over each head (shared weight, or one per head) or
  over the whole projection; BLOOM's embedding LayerNorm; OPT's position offset and
  project_in/project_out;
- ALiBi (Press et al. 2022; BLOOM's slopes), sliding-window attention (a query sees itself and
  the window - 1 keys before it; its KV cache keeps window - 1 past tokens, as transformers'
  does), attention sinks (gpt-oss: one learned logit per head joins each softmax);
- multi-head latent attention (DeepSeek-V2/V3), run as transformers runs it: q through q_a /
  norm / q_b (or q_proj), the kv latent and a shared rotary key through kv_a, k_nope and v
  through kv_b; the cache holds the decompressed k and v;
- mixture of experts: a router, top-k softmax weights, a dense Python loop over the experts
  (each runs only on the tokens sent to it), shared experts (with Qwen2-MoE's sigmoid gate).

Attention is `manual` (as the tutorial writes it: a `tril` buffer, masked_fill(-inf), softmax, dropout
on the probabilities, att @ v) or `sdpa` (F.scaled_dot_product_attention). Every dropout goes
through `torch.native_dropout` so CPU and CUDA both save a 1-byte mask for backward;
the call is skipped when p == 0 or the model is not training.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptcalc import GPTConfig

ATTN_IMPLS = ("manual", "sdpa")

KVCache = list  # one (k, v) pair per block, k and v of shape (B, kv_heads, S_cached, head_dim)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout through torch.native_dropout (a bool mask on every device); a no-op when off."""
    if p == 0.0 or not training:
        return x
    return torch.native_dropout(x, p, True)[0]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019); weight only, no bias."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd)
    return nn.LayerNorm(cfg.n_embd, bias=cfg.norm == "layernorm")


class WeightNorm(nn.Module):
    """A weight-only norm over the last dim written out by hand (so fvcore's layer_norm count
    keeps to the E-wide norms): RMSNorm, or LayerNorm without bias for the LayerNorm families.
    `shape` is the weight's: (d,) shared over leading dims, or (heads, d) one per head."""

    def __init__(self, shape: tuple[int, ...], rms: bool, eps: float = 1e-5) -> None:
        super().__init__()
        self.rms, self.eps = rms, eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rms:
            x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Press et al. 2022 (BLOOM's build_alibi_tensor): a geometric series per head, extended by
    interleaving when H is not a power of two."""
    closest = 2 ** math.floor(math.log2(n_head))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** i for i in range(1, closest + 1)]
    if closest != n_head:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** i for i in range(1, 2 * (n_head - closest) + 1, 2)]
    return torch.tensor(slopes)


def layer_is_sliding(cfg: GPTConfig, i: int) -> bool:
    from gptcalc.layers import attn_pattern

    pattern = attn_pattern(cfg)
    return pattern[i % len(pattern)] == "L"


def layer_is_moe(cfg: GPTConfig, i: int) -> bool:
    return (cfg.moe and i >= cfg.moe_first_dense and (i + 1) % cfg.moe_step == 0
            and i not in cfg.dense_layer_indices)


def sinusoidal_table(T: int, E: int) -> torch.Tensor:
    """Vaswani et al. 2017, sec. 3.5: PE[t, 2i] = sin(t / 10000^(2i/E)), PE[t, 2i+1] = cos(...)."""
    pos = torch.arange(T, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, E, 2, dtype=torch.float32) * (-math.log(10000.0) / E))
    pe = torch.zeros(T, E)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : E // 2]
    return pe


def rotary_tables(T: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta_i (Su et al. 2021), each (T, head_dim), halves repeated."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on (B, heads, S, head_dim); elementwise only, no matmul."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attn_impl: str, sliding: bool = False) -> None:
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        if cfg.attn_sinks and attn_impl == "sdpa":
            raise ValueError("attention sinks are written out in the manual attention only")
        E, H, Hkv, hd = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size
        self.n_head, self.n_kv_head, self.head_dim = H, Hkv, hd
        self.layout, self.attn_impl, self.p = cfg.qkv_layout, attn_impl, cfg.dropout
        self.rotary = cfg.pos_embedding == "rotary"
        self.window = cfg.sliding_window if sliding else None
        self.mla, self.qk_norm = cfg.mla, cfg.qk_norm
        self.qk_dim, self.v_dim = cfg.qk_head_dim, cfg.v_dim
        rms = cfg.norm == "rmsnorm"
        if cfg.mla:  # DeepSeek-V2/V3 (transformers' DeepseekV3Attention)
            self.n_kv_head, self.head_dim = H, cfg.qk_head_dim
            self.nope, self.rope, self.r_q = cfg.nope_dim, cfg.rope_dim, cfg.q_lora_rank
            if cfg.q_lora_rank is None:
                self.q_proj = nn.Linear(E, H * cfg.qk_head_dim, bias=False)
            else:
                self.q_a_proj = nn.Linear(E, cfg.q_lora_rank, bias=cfg.qkv_bias)
                self.q_a_norm = WeightNorm((cfg.q_lora_rank,), rms=True)
                self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
            self.kv_a_proj = nn.Linear(E, cfg.kv_lora_rank + cfg.rope_dim, bias=cfg.qkv_bias)
            self.kv_a_norm = WeightNorm((cfg.kv_lora_rank,), rms=True)
            self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.nope_dim + cfg.v_dim),
                                       bias=False)
        elif cfg.qkv_layout == "fused":  # nanoGPT: one matrix, chunked into q, k, v
            self.c_attn = nn.Linear(E, H * hd + 2 * Hkv * hd, bias=cfg.qkv_bias)
        elif cfg.qkv_layout == "separate":  # Llama: three matrices (k, v narrower under GQA)
            self.q_proj = nn.Linear(E, H * hd, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(E, Hkv * hd, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(E, Hkv * hd, bias=cfg.qkv_bias)
        else:  # per_head: the tutorial's Head modules / the notes' Q, K, V ModuleLists
            self.query = nn.ModuleList(nn.Linear(E, hd, bias=cfg.qkv_bias) for _ in range(H))
            self.key = nn.ModuleList(nn.Linear(E, hd, bias=cfg.qkv_bias) for _ in range(H))
            self.value = nn.ModuleList(nn.Linear(E, hd, bias=cfg.qkv_bias) for _ in range(H))
        if cfg.qk_norm == "head":  # Qwen3, Gemma 3: one weight of head_dim for every head
            self.q_norm, self.k_norm = WeightNorm((hd,), rms), WeightNorm((hd,), rms)
        elif cfg.qk_norm == "per_head":  # StableLM, Cohere: a weight per head
            self.q_norm, self.k_norm = WeightNorm((H, hd), rms), WeightNorm((Hkv, hd), rms)
        elif cfg.qk_norm == "proj":  # OLMo 2: over the whole q and k projections
            self.q_norm, self.k_norm = WeightNorm((H * hd,), rms), WeightNorm((Hkv * hd,), rms)
        if cfg.attn_sinks:  # gpt-oss
            self.sinks = nn.Parameter(torch.zeros(H))
        if cfg.pos_embedding == "alibi":
            self.register_buffer("alibi", alibi_slopes(H), persistent=False)
        self.alibi_on = cfg.pos_embedding == "alibi"
        self.c_proj = nn.Linear(cfg.attn_out_width, E, bias=cfg.attn_out_bias)
        T = cfg.block_size
        # the tutorial's causal mask: ones below the diagonal, compared with 0 at use
        self.register_buffer("tril", torch.tril(torch.ones(T, T)), persistent=False)
        if self.rotary:
            # GPT-NeoX rotates only the first rotary_pct; MLA only the qk_rope dims (last)
            self.rotary_dims = cfg.rotary_dims
            cos, sin = rotary_tables(T, cfg.rotary_dims)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project x (B, S, E) to q (B, S, H*hd), k and v (B, S, Hkv*hd)."""
        if self.layout == "fused":
            Dq, Dkv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
            return self.c_attn(x).split([Dq, Dkv, Dkv], dim=-1)
        if self.layout == "separate":
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        cat = lambda mods: torch.cat([m(x) for m in mods], dim=-1)  # noqa: E731
        return cat(self.query), cat(self.key), cat(self.value)

    def mla_qkv(self, x: torch.Tensor, cos, sin):
        """MLA: q (B, H, S, nope+rope), k (B, H, S, nope+rope), v (B, H, S, v_dim)."""
        B, S, _ = x.shape
        H, nope, rope = self.n_head, self.nope, self.rope
        q = self.q_proj(x) if self.r_q is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, S, H, nope + rope).transpose(1, 2)
        c_kv, k_rope = self.kv_a_proj(x).split([self.kv_a_norm.weight.shape[0], rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(B, S, H, nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        k_rope = k_rope.view(B, 1, S, rope)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        if self.rotary:
            q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, H, S, rope)), dim=-1)  # one rotary key, all heads
        return q, k, v

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """x (B, S, E). `cache`: None, or a list [k, v] of this block's cached keys/values (or
        [None, None] before the prefill); it is updated in place (a third item records the
        tokens seen, which a sliding window's truncated cache no longer shows)."""
        B, S, _ = x.shape
        H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
        past = 0 if cache is None or cache[0] is None else (
            cache[2] if len(cache) > 2 else cache[0].shape[2])
        cos = sin = None
        if self.rotary:
            cos, sin = self.rope_cos[past:past + S], self.rope_sin[past:past + S]
        if self.mla:
            q, k, v = self.mla_qkv(x, cos, sin)
        else:
            q, k, v = self.qkv(x)
            if self.qk_norm == "proj":
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.view(B, S, H, hd).transpose(1, 2)  # (B, H, S, hd)
            k = k.view(B, S, Hkv, hd).transpose(1, 2)  # (B, Hkv, S, hd)
            v = v.view(B, S, Hkv, hd).transpose(1, 2)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            elif self.qk_norm == "per_head":  # the (heads, hd) weight lines up with dims 1, 3
                q = self.q_norm(q.transpose(1, 2)).transpose(1, 2)
                k = self.k_norm(k.transpose(1, 2)).transpose(1, 2)
            if self.rotary:
                q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if cache is not None:
            if cache[0] is not None and cache[0].shape[2]:
                k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
            keep = k.shape[2] if self.window is None else self.window - 1  # transformers' rule
            cache[0], cache[1] = k[:, :, k.shape[2] - min(keep, k.shape[2]):], \
                v[:, :, v.shape[2] - min(keep, v.shape[2]):]
            cache[2:] = [past + S]
        if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
            # the core's kernels run in the autocast dtype: cast q, k, v before it, as SDPA and
            # matmul would inside it, so that a checkpointed core keeps 16-bit inputs
            dtype = torch.get_autocast_dtype(x.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        y = self.core(q, k, v, past)
        y = y.transpose(1, 2).contiguous().view(B, S, H * self.v_dim)
        return dropout(self.c_proj(y), self.p, self.training)

    def extra_mask(self, S: int, total: int, past: int, device) -> torch.Tensor | None:
        """The window's mask over (query, key) with keys at positions past+S-total .. past+S-1
        (True = kept), or None for a global block."""
        if self.window is None:
            return None
        qpos = torch.arange(past, past + S, device=device)[:, None]
        kpos = torch.arange(past + S - total, past + S, device=device)[None, :]
        return (kpos <= qpos) & (kpos > qpos - self.window)

    def alibi_bias(self, S: int, total: int, past: int, device) -> torch.Tensor:
        """slope_h * (key position - query position), (H, S, total)."""
        qpos = torch.arange(past, past + S, device=device)[:, None]
        kpos = torch.arange(past + S - total, past + S, device=device)[None, :]
        return self.alibi[:, None, None] * (kpos - qpos)[None].to(self.alibi.dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dims
        if r == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        # partial rotary (GPT-NeoX's rotary_pct): the remaining dims pass through unchanged
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def core(self, q, k, v, past: int) -> torch.Tensor:
        """The attention core, softmax(q k^T) v, on q (B, H, S, hd) and k, v of n_kv_head
        heads: grouped-query heads are repeated here, inside the core, so that a checkpointed
        core (selective recomputation) keeps k and v of n_kv_head heads, as Megatron-LM's
        DotProductAttention does."""
        if self.n_kv_head != self.n_head:  # each k/v head serves H / Hkv query heads
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        if self.attn_impl == "manual":
            return self.manual_attention(q, k, v, past)
        return self.sdpa_attention(q, k, v, past)

    def manual_attention(self, q, k, v, past: int) -> torch.Tensor:
        S, total = q.shape[2], k.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, S, total)
        if self.alibi_on:
            att = att + self.alibi_bias(S, total, past, att.device)
        window = self.extra_mask(S, total, past, att.device)
        if window is None:
            att = att.masked_fill(self.tril[past:past + S, :total] == 0, float("-inf"))
        else:
            att = att.masked_fill(~window, float("-inf"))
        if hasattr(self, "sinks"):  # a sink logit per head joins the softmax, then is dropped
            sink = self.sinks.view(1, -1, 1, 1).expand(att.shape[0], -1, S, 1)
            att = F.softmax(torch.cat((att, sink.to(att.dtype)), dim=-1), dim=-1)[..., :-1]
        else:
            att = F.softmax(att, dim=-1)
        att = dropout(att, self.p, self.training)
        return att @ v  # (B, H, S, hd)

    def sdpa_attention(self, q, k, v, past: int) -> torch.Tensor:
        p = self.p if self.training else 0.0
        S, total = q.shape[2], k.shape[2]
        scale = 1 / math.sqrt(self.head_dim)
        if self.window is not None or self.alibi_on:
            keep = self.extra_mask(S, total, past, q.device)
            if keep is None:
                keep = self.tril[past:past + S, :total] != 0
            if self.alibi_on:
                bias = self.alibi_bias(S, total, past, q.device).to(q.dtype)
                keep = bias.masked_fill(~keep, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p,
                                                  scale=scale)
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        if S == 1:  # one new query sees every cached key and itself
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        # is_causal aligns the mask top-left; queries after a cache need an explicit mask
        mask = self.tril[past:past + S, :total] != 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, width: int | None = None, bias: bool | None = None,
                 p: float | None = None) -> None:
        super().__init__()
        E, Dff = cfg.n_embd, cfg.ffn_dim if width is None else width
        bias = cfg.mlp_bias if bias is None else bias
        self.kind, self.p = cfg.mlp, cfg.dropout if p is None else p
        self.c_fc = nn.Linear(E, Dff, bias=bias)
        if cfg.mlp in ("swiglu", "geglu"):
            self.c_gate = nn.Linear(E, Dff, bias=bias)
        self.c_proj = nn.Linear(Dff, E, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        elif self.kind == "geglu":
            h = F.gelu(self.c_gate(x), approximate="tanh") * self.c_fc(x)
        elif self.kind == "relu":
            h = F.relu(self.c_fc(x))
        elif self.kind == "gelu":
            h = F.gelu(self.c_fc(x))
        else:
            h = F.gelu(self.c_fc(x), approximate="tanh")
        return dropout(self.c_proj(h), self.p, self.training)


class MoE(nn.Module):
    """Router, top-k routed experts (a loop: each expert runs on the tokens sent to it), shared
    experts. Weights: softmax over the router logits, the top k kept (Mixtral renormalises
    them, DeepSeek uses a sigmoid: neither changes a count)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.k, self.p = cfg.n_expert_active, cfg.dropout
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=cfg.router_bias)
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_dim, cfg.expert_bias, p=0.0)
                                     for _ in range(cfg.n_expert))
        if cfg.shared_dim:
            self.shared = MLP(cfg, cfg.shared_dim, cfg.mlp_bias, p=0.0)
            if cfg.shared_expert_gate:  # Qwen2-MoE: sigmoid(x @ W) scales the shared expert
                self.shared_gate = nn.Linear(cfg.n_embd, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, E = x.shape
        flat = x.reshape(B * S, E)
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # the tokens sent to expert e
            # cast back to the stream's dtype (fp32 under autocast), as transformers' MoE blocks
            # do before their index_add_
            y = expert(flat[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        if hasattr(self, "shared"):
            shared = self.shared(flat)
            if hasattr(self, "shared_gate"):
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return dropout(out.view(B, S, E), self.p, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn_impl: str, index: int = 0) -> None:
        super().__init__()
        self.pre, self.post = cfg.pre_norm, cfg.post_norm
        self.parallel, self.shared_norm = cfg.parallel_residual, cfg.shared_norm
        if cfg.pre_norm:
            self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, attn_impl, layer_is_sliding(cfg, index))
        if cfg.post_norm:  # Gemma 2/3 and OLMo 2: a norm on the branch output
            self.ln_attn_out = make_norm(cfg)
        if cfg.pre_norm and not cfg.shared_norm:
            self.ln_2 = make_norm(cfg)
        self.mlp = MoE(cfg) if layer_is_moe(cfg, index) else MLP(cfg)
        if cfg.post_norm:
            self.ln_mlp_out = make_norm(cfg)

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        h = self.ln_1(x) if self.pre else x
        a = self.attn(h, cache)
        if self.post:
            a = self.ln_attn_out(a)
        if self.parallel:  # GPT-NeoX / GPT-J / Falcon: both branches read the block's input
            m = self.mlp(h if self.shared_norm else (self.ln_2(x) if self.pre else x))
            return x + a + (self.ln_mlp_out(m) if self.post else m)
        x = x + a
        m = self.mlp(self.ln_2(x) if self.pre else x)
        return x + (self.ln_mlp_out(m) if self.post else m)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, attn_impl: str = "manual") -> None:
        super().__init__()
        cfg = self.config = config
        self.attn_impl = attn_impl
        # torchtune's chunked output (TransformerDecoder.set_num_output_chunks): 0 = one tensor
        self.num_output_chunks = 0
        # the loss over the logits, and over one chunk of them: compiled ones where the loss is
        # compiled (reference_model.compiled)
        self.loss_fn, self.chunk_loss_fn = cross_entropy, chunk_cross_entropy
        modules = dict(wte=nn.Embedding(cfg.vocab_size, cfg.embd_dim))
        if cfg.embd_dim != cfg.n_embd:  # OPT's word_embed_proj_dim
            modules["proj_in"] = nn.Linear(cfg.embd_dim, cfg.n_embd, bias=False)
            modules["proj_out"] = nn.Linear(cfg.n_embd, cfg.embd_dim, bias=False)
        if cfg.pos_embedding == "learned":  # OPT: pos_offset more rows, positions shifted
            modules["wpe"] = nn.Embedding(cfg.block_size + cfg.pos_offset, cfg.n_embd)
        if cfg.embd_norm:  # BLOOM's word_embeddings_layernorm
            modules["ln_emb"] = make_norm(cfg)
        modules["h"] = nn.ModuleList(Block(cfg, attn_impl, i) for i in range(cfg.n_layer))
        if cfg.final_norm:
            modules["ln_f"] = make_norm(cfg)
        self.transformer = nn.ModuleDict(modules)
        if cfg.pos_embedding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.block_size, cfg.n_embd),
                                 persistent=False)
        self.lm_head = nn.Linear(cfg.embd_dim, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_embeddings:  # Press & Wolf 2017; named_parameters() lists it once, as wte
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, S, V) for every position, and the cross-entropy loss when targets are given.

        kv_cache: a list from `new_kv_cache()`; positions continue after what it holds.
        """
        cfg = self.config
        B, S = idx.shape
        first = None if kv_cache is None else kv_cache[0]
        past = 0 if first is None or first[0] is None else (
            first[2] if len(first) > 2 else first[0].shape[2])
        if past + S > cfg.block_size:
            raise ValueError(f"sequence of {past + S} exceeds block_size {cfg.block_size}")
        x = self.transformer.wte(idx)
        if cfg.embd_dim != cfg.n_embd:
            x = self.transformer.proj_in(x)
        if cfg.pos_embedding == "learned":
            pos = torch.arange(past, past + S, device=idx.device) + cfg.pos_offset
            x = x + self.transformer.wpe(pos)
        elif cfg.pos_embedding == "sinusoidal":
            x = x + self.pos_table[past:past + S]
        if cfg.embd_norm:
            x = self.transformer.ln_emb(x)
        if cfg.embd_dropout:
            x = dropout(x, cfg.dropout, self.training)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if kv_cache is None else kv_cache[i])
        if cfg.final_norm:
            x = self.transformer.ln_f(x)
        if cfg.embd_dim != cfg.n_embd:
            x = self.transformer.proj_out(x)
        if self.num_output_chunks:  # torchtune: the head per chunk of tokens, a list out
            chunks = [self.lm_head(c) for c in x.tensor_split(self.num_output_chunks, dim=1)]
            del x  # torchtune's loss runs after the model has returned: its hidden state is gone
            return chunks, None if targets is None else chunked_cross_entropy(
                chunks, targets, chunk_loss=self.chunk_loss_fn)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = self.loss_fn(logits, targets)
        return logits, loss

    def new_kv_cache(self) -> KVCache:
        return [[None, None] for _ in range(self.config.n_layer)]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, use_kv_cache: bool = True,
                 greedy: bool = False) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, S).

        Without a cache (the tutorial's loop): every step runs forward over the context cropped to the
        last T tokens. With a cache: one forward over the prompt (the prefill, logits for every
        position), then one token at a time against the cached keys and values; prompt plus new
        tokens must fit in T. Either way the last sampled token is never fed back.
        """
        T = self.config.block_size
        cache = self.new_kv_cache() if use_kv_cache else None
        if use_kv_cache and idx.shape[1] + max_new_tokens - 1 > T:
            raise ValueError(f"prompt {idx.shape[1]} + {max_new_tokens} new tokens exceed the "
                             f"KV cache's block_size {T}")
        feed = idx
        for step in range(max_new_tokens):
            if use_kv_cache:
                logits, _ = self(feed, kv_cache=cache)
            else:
                logits, _ = self(idx[:, -T:])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            if greedy:
                nxt = probs.argmax(dim=-1, keepdim=True)
            else:
                nxt = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, nxt), dim=1)
            feed = nxt
        return idx


# parameter name -> analytic component key of gptcalc.params.param_components
_KEY_PATTERNS = [
    (r"transformer\.wte\.weight", "embedding/token"),
    (r"transformer\.wpe\.weight", "embedding/position"),
    (r"transformer\.proj_(in|out)\.weight", "embedding/proj"),
    (r"transformer\.ln_emb\.(weight|bias)", "norm/embedding"),
    (r"transformer\.h\.\d+\.attn\.(c_attn|[qkv]_proj|query\.\d+|key\.\d+|value\.\d+|q_a_proj"
     r"|q_b_proj|kv_a_proj|kv_b_proj)\.(weight|bias)", "attention/qkv"),
    (r"transformer\.h\.\d+\.attn\.(q_norm|k_norm|q_a_norm|kv_a_norm)\.weight", "attention/norm"),
    (r"transformer\.h\.\d+\.attn\.sinks", "attention/sinks"),
    (r"transformer\.h\.\d+\.mlp\.router\.(weight|bias)", "moe/router"),
    (r"transformer\.h\.\d+\.mlp\.experts\.\d+\.c_(fc|gate|proj)\.(weight|bias)", "moe/experts"),
    (r"transformer\.h\.\d+\.mlp\.(shared\.c_(fc|gate|proj)|shared_gate)\.(weight|bias)",
     "moe/shared"),
    (r"transformer\.h\.\d+\.ln_attn_out\.(weight|bias)", "norm/attention"),
    (r"transformer\.h\.\d+\.ln_mlp_out\.(weight|bias)", "norm/mlp"),
    (r"transformer\.h\.\d+\.attn\.c_proj\.(weight|bias)", "attention/out"),
    (r"transformer\.h\.\d+\.mlp\.c_fc\.(weight|bias)", "mlp/fc"),
    (r"transformer\.h\.\d+\.mlp\.c_gate\.(weight|bias)", "mlp/gate"),
    (r"transformer\.h\.\d+\.mlp\.c_proj\.(weight|bias)", "mlp/proj"),
    (r"transformer\.h\.\d+\.ln_1\.(weight|bias)", "norm/attention"),
    (r"transformer\.h\.\d+\.ln_2\.(weight|bias)", "norm/mlp"),
    (r"transformer\.ln_f\.(weight|bias)", "norm/final"),
    (r"lm_head\.(weight|bias)", "lm_head"),
]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy of logits (B, S, V) against targets (B, S)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                        ignore_index: int = -100) -> torch.Tensor:
    """One chunk's summed cross entropy, upcast to fp32: torchtune's
    CEWithChunkedOutputLoss.compute_cross_entropy (which its recipes compile)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels,
                           ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(chunks: list[torch.Tensor], targets: torch.Tensor,
                          ignore_index: int = -100, chunk_loss=None) -> torch.Tensor:
    """The mean cross entropy over logits given in chunks of tokens, as torchtune's
    CEWithChunkedOutputLoss computes it in eager mode (torchtune/modules/loss/
    ce_chunked_output_loss.py): the targets split as the logits were (`tensor_split` along the
    sequence), each chunk upcast to fp32 (`.float()`) and summed with reduction "sum", the sum
    divided by the count of targets that are not `ignore_index`. `chunk_loss(logits, labels,
    ignore_index)`: one chunk's loss (default `chunk_cross_entropy`; a compiled one)."""
    count = (targets != ignore_index).sum()
    labels = [t.reshape(-1) for t in targets.tensor_split(len(chunks), dim=1)]
    total = 0.0
    for logits, y in zip(chunks, labels):
        total += (chunk_loss or chunk_cross_entropy)(logits, y, ignore_index)
    return total / count


def param_key(name: str) -> str:
    """The analytic component key of a parameter name, e.g.
    `transformer.h.3.attn.c_attn.weight` -> `attention/qkv`. Raises KeyError for an unknown name."""
    for pattern, key in _KEY_PATTERNS:
        if re.fullmatch(pattern, name):
            return key
    raise KeyError(f"no analytic key for parameter {name!r}")


def build_model(cfg: GPTConfig, attn_impl: str = "manual", seed: int = 1337,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    """The reference model for `cfg`, initialised from a fixed seed (PyTorch's default inits)."""
    from torch._guards import active_fake_mode

    if active_fake_mode() is not None:  # FakeTensorMode: shapes only, no values to seed
        with torch.device(device):
            return _to_dtype_keeping_ties(GPT(cfg, attn_impl), dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg, attn_impl)
    return model.to(device=device, dtype=dtype)


def _to_dtype_keeping_ties(model: GPT, dtype: torch.dtype) -> GPT:
    """`model.to(dtype)` for a model of fake tensors: Module.to swaps fake parameters in place
    (torch.utils.swap_tensors), which fails for a tied weight; this replaces each floating
    parameter once (a tied one by the same new Parameter) and each floating buffer."""
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(p.detach().to(dtype), p.requires_grad)
                mod._parameters[name] = new[id(p)]
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)
    return model
