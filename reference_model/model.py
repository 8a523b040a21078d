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
- GPT-NeoX's partial rotary (rotary_pct) and parallel residual (attention and MLP both read x).

Attention is `manual` (as the seeds write it: a `tril` buffer, masked_fill(-inf), softmax, dropout
on the probabilities, att @ v) or `sdpa` (F.scaled_dot_product_attention). Every dropout goes
through `torch.native_dropout` so CPU and CUDA both save a 1-byte mask for backward (DESIGN.md);
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
    def __init__(self, cfg: GPTConfig, attn_impl: str) -> None:
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        E, H, Hkv, hd = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size
        self.n_head, self.n_kv_head, self.head_dim = H, Hkv, hd
        self.layout, self.attn_impl, self.p = cfg.qkv_layout, attn_impl, cfg.dropout
        self.rotary = cfg.pos_embedding == "rotary"
        if cfg.qkv_layout == "fused":  # nanoGPT: one matrix, chunked into q, k, v
            self.c_attn = nn.Linear(E, H * hd + 2 * Hkv * hd, bias=cfg.qkv_bias)
        elif cfg.qkv_layout == "separate":  # Llama: three matrices (k, v narrower under GQA)
            self.q_proj = nn.Linear(E, H * hd, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(E, Hkv * hd, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(E, Hkv * hd, bias=cfg.qkv_bias)
        else:  # per_head: the tutorial's Head modules / the notes' Q, K, V ModuleLists
            self.query = nn.ModuleList(nn.Linear(E, hd, bias=cfg.qkv_bias) for _ in range(H))
            self.key = nn.ModuleList(nn.Linear(E, hd, bias=cfg.qkv_bias) for _ in range(H))
            self.value = nn.ModuleList(nn.Linear(E, hd, bias=cfg.qkv_bias) for _ in range(H))
        self.c_proj = nn.Linear(H * hd, E, bias=cfg.attn_out_bias)
        T = cfg.block_size
        # the seeds' causal mask: ones below the diagonal, compared with 0 at use
        self.register_buffer("tril", torch.tril(torch.ones(T, T)), persistent=False)
        if self.rotary:
            self.rotary_dims = cfg.rotary_dims  # GPT-NeoX rotates only the first rotary_pct
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

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """x (B, S, E). `cache`: None, or a list [k, v] of this block's cached keys/values (or
        [None, None] before the prefill); it is updated in place."""
        B, S, _ = x.shape
        H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x)
        q = q.view(B, S, H, hd).transpose(1, 2)  # (B, H, S, hd)
        k = k.view(B, S, Hkv, hd).transpose(1, 2)  # (B, Hkv, S, hd)
        v = v.view(B, S, Hkv, hd).transpose(1, 2)
        past = 0 if cache is None or cache[0] is None else cache[0].shape[2]
        if self.rotary:
            cos, sin = self.rope_cos[past:past + S], self.rope_sin[past:past + S]
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if cache is not None:
            if past:
                k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
            cache[0], cache[1] = k, v
        if Hkv != H:  # grouped-query attention: each k/v head serves H / Hkv query heads
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        if self.attn_impl == "manual":
            y = self.manual_attention(q, k, v, past)
        else:
            y = self.sdpa_attention(q, k, v, past)
        y = y.transpose(1, 2).contiguous().view(B, S, H * hd)
        return dropout(self.c_proj(y), self.p, self.training)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dims
        if r == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        # partial rotary (GPT-NeoX's rotary_pct): the remaining dims pass through unchanged
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def manual_attention(self, q, k, v, past: int) -> torch.Tensor:
        S, total = q.shape[2], k.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, S, total)
        att = att.masked_fill(self.tril[past:past + S, :total] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = dropout(att, self.p, self.training)
        return att @ v  # (B, H, S, hd)

    def sdpa_attention(self, q, k, v, past: int) -> torch.Tensor:
        p = self.p if self.training else 0.0
        S, total = q.shape[2], k.shape[2]
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        if S == 1:  # one new query sees every cached key and itself
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        # is_causal aligns the mask top-left; queries after a cache need an explicit mask
        mask = self.tril[past:past + S, :total] != 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        E, Dff = cfg.n_embd, cfg.ffn_dim
        self.kind, self.p = cfg.mlp, cfg.dropout
        self.c_fc = nn.Linear(E, Dff, bias=cfg.mlp_bias)
        if cfg.mlp == "swiglu":
            self.c_gate = nn.Linear(E, Dff, bias=cfg.mlp_bias)
        self.c_proj = nn.Linear(Dff, E, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        elif self.kind == "relu":
            h = F.relu(self.c_fc(x))
        elif self.kind == "gelu":
            h = F.gelu(self.c_fc(x))
        else:
            h = F.gelu(self.c_fc(x), approximate="tanh")
        return dropout(self.c_proj(h), self.p, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn_impl: str) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, attn_impl)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.parallel = cfg.parallel_residual

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX / GPT-J: both branches read the block's input
            return x + self.attn(self.ln_1(x), cache) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, attn_impl: str = "manual") -> None:
        super().__init__()
        cfg = self.config = config
        self.attn_impl = attn_impl
        modules = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
        if cfg.pos_embedding == "learned":
            modules["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        modules["h"] = nn.ModuleList(Block(cfg, attn_impl) for _ in range(cfg.n_layer))
        if cfg.final_norm:
            modules["ln_f"] = make_norm(cfg)
        self.transformer = nn.ModuleDict(modules)
        if cfg.pos_embedding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.block_size, cfg.n_embd),
                                 persistent=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_embeddings:  # Press & Wolf 2017; named_parameters() lists it once, as wte
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, S, V) for every position, and the cross-entropy loss when targets are given.

        kv_cache: a list from `new_kv_cache()`; positions continue after what it holds.
        """
        cfg = self.config
        B, S = idx.shape
        past = 0 if kv_cache is None or kv_cache[0][0] is None else kv_cache[0][0].shape[2]
        if past + S > cfg.block_size:
            raise ValueError(f"sequence of {past + S} exceeds block_size {cfg.block_size}")
        x = self.transformer.wte(idx)
        if cfg.pos_embedding == "learned":
            x = x + self.transformer.wpe(torch.arange(past, past + S, device=idx.device))
        elif cfg.pos_embedding == "sinusoidal":
            x = x + self.pos_table[past:past + S]
        if cfg.embd_dropout:
            x = dropout(x, cfg.dropout, self.training)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if kv_cache is None else kv_cache[i])
        if cfg.final_norm:
            x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def new_kv_cache(self) -> KVCache:
        return [[None, None] for _ in range(self.config.n_layer)]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, use_kv_cache: bool = True,
                 greedy: bool = False) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, S).

        Without a cache (the seeds' loop): every step runs forward over the context cropped to the
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
    (r"transformer\.h\.\d+\.attn\.(c_attn|[qkv]_proj|query\.\d+|key\.\d+|value\.\d+)\.(weight|bias)",
     "attention/qkv"),
    (r"transformer\.h\.\d+\.attn\.c_proj\.(weight|bias)", "attention/out"),
    (r"transformer\.h\.\d+\.mlp\.c_fc\.(weight|bias)", "mlp/fc"),
    (r"transformer\.h\.\d+\.mlp\.c_gate\.(weight|bias)", "mlp/gate"),
    (r"transformer\.h\.\d+\.mlp\.c_proj\.(weight|bias)", "mlp/proj"),
    (r"transformer\.h\.\d+\.ln_1\.(weight|bias)", "norm/attention"),
    (r"transformer\.h\.\d+\.ln_2\.(weight|bias)", "norm/mlp"),
    (r"transformer\.ln_f\.(weight|bias)", "norm/final"),
    (r"lm_head\.(weight|bias)", "lm_head"),
]


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
