"""The reference GPT: parameters per component, the seeds' tutorial model, KV-cache generation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from gptcalc import count_params, from_name  # noqa: E402
from reference_model.measure import params_by_key  # noqa: E402
from reference_model.model import GPT, build_model, param_key  # noqa: E402

from ._strategies import configs  # noqa: E402

torch.set_num_threads(1)


# ---- the seeds' tutorial model, written the way seed 001 / Karpathy's video writes it --------
# (Head / MultiHeadAttention / FeedForward / Block / GPTLanguageModel, hyperparameters of seed 000)
n_embd, n_head, n_layer, block_size, vocab_size, dropout = 384, 6, 6, 256, 65, 0.2


class Head(nn.Module):
    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        return wei @ self.value(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(torch.cat([h(x) for h in self.heads], dim=-1)))


class FeedForward(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.sa = MultiHeadAttention(n_head, n_embd // n_head)
        self.ffwd = FeedForward(n_embd)
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPTLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head=n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)


def test_tutorial_model_matches_karpathy_count_and_ours():
    with torch.device("meta"):
        seeds_model = GPTLanguageModel()
        ours = GPT(from_name("shakespeare-char"))
    seeds_count = sum(p.numel() for p in seeds_model.parameters())
    # Karpathy's "Let's build GPT" prints "10.788929 M parameters" for this model
    assert seeds_count == 10_788_929
    assert count_params(from_name("shakespeare-char")).total == seeds_count
    assert sum(p.numel() for p in ours.parameters()) == seeds_count


@settings(max_examples=60, deadline=None)
@given(cfg=configs(), attn=st.sampled_from(["manual", "sdpa"]))
def test_params_exact_per_component(cfg, attn):
    with torch.device("meta"):
        model = GPT(cfg, attn)
    analytic = {k: v for k, v in count_params(cfg).components.items() if v}
    assert params_by_key(model) == analytic
    # named_parameters() lists a tied weight once; parameters() agrees
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total


def test_tied_head_shares_the_embedding():
    m = build_model(from_name("debug"))
    assert m.lm_head.weight is m.transformer.wte.weight
    untied = build_model(from_name("debug", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_param_key_names_every_layout_and_rejects_unknown():
    assert param_key("transformer.h.3.attn.c_attn.weight") == "attention/qkv"
    assert param_key("transformer.h.0.attn.k_proj.bias") == "attention/qkv"
    assert param_key("transformer.h.11.attn.value.5.weight") == "attention/qkv"
    assert param_key("transformer.h.0.mlp.c_gate.weight") == "mlp/gate"
    with pytest.raises(KeyError):
        param_key("transformer.h.0.attn.bogus.weight")


@settings(max_examples=25, deadline=None)
@given(cfg=configs(dropout=st.just(0.0)), attn=st.sampled_from(["manual", "sdpa"]),
       data=st.data())
def test_kv_cache_reproduces_the_full_forward(cfg, attn, data):
    model = build_model(cfg, attn).eval()
    T = cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (2, T))
    cut = data.draw(st.integers(1, T))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_kv_cache()
        parts = [model(idx[:, :cut], kv_cache=cache)[0]]
        parts += [model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(cut, T)]
    # fp32: the cached path multiplies in other shapes, so it sums in another order; logits of
    # order 1 then differ by a few 1e-5 on some draws
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=1e-4)


def test_generate_with_and_without_cache_agree_greedily():
    cfg = from_name("debug", arch="llama", n_kv_head=1)
    model = build_model(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (2, 5))
    a = model.generate(prompt, 8, use_kv_cache=True, greedy=True)
    b = model.generate(prompt, 8, use_kv_cache=False, greedy=True)
    assert a.shape == (2, 13) and torch.equal(a, b)


def test_generate_without_cache_crops_to_block_size():
    cfg = from_name("debug")
    out = build_model(cfg).generate(torch.zeros(1, cfg.block_size, dtype=torch.long), 3,
                                    use_kv_cache=False)
    assert out.shape == (1, cfg.block_size + 3)
    with pytest.raises(ValueError):
        build_model(cfg).generate(torch.zeros(1, cfg.block_size, dtype=torch.long), 3)


def test_forward_returns_logits_for_every_position_and_a_loss():
    cfg = from_name("debug")
    idx = torch.randint(0, cfg.vocab_size, (2, 7))
    logits, loss = build_model(cfg)(idx, idx)
    assert logits.shape == (2, 7, cfg.vocab_size) and loss.ndim == 0
    assert build_model(cfg)(idx)[1] is None


def test_dropout_is_native_dropout_and_off_in_eval():
    cfg = from_name("debug", dropout=0.5)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    ops = []

    class Log(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with Log():
        model.train()(idx)
    # embedding, attention probabilities, after attention, after the MLP: 1 + 3 per block
    assert ops.count(torch.ops.aten.native_dropout) == 1 + 3 * cfg.n_layer
    ops.clear()
    with Log():
        model.eval()(idx)
    assert torch.ops.aten.native_dropout not in ops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_matches_cpu():
    cfg = from_name("debug", arch="llama")
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    cpu = build_model(cfg).eval()
    gpu = build_model(cfg, device="cuda").eval()
    with torch.no_grad():
        torch.testing.assert_close(gpu(idx.cuda())[0].cpu(), cpu(idx)[0], atol=1e-4, rtol=1e-4)
