"""Parameter counts: golden values from released models and papers, and properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import ConfigError, GPTConfig, count_params, from_name
from gptcalc.config import MLPS, NORMS, POSITIONS, QKV_LAYOUTS
from gptcalc.params import EMBEDDING_KEYS

# Released checkpoints, counted by transformers' `model.num_parameters()` for GPT2LMHeadModel
# (tied lm_head counted once) — the figures on the Hugging Face model cards / nanoGPT's
# `from_pretrained` printout ("number of parameters: 124.44M" etc.).
GPT2_RELEASED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("name,expected", GPT2_RELEASED.items())
def test_gpt2_presets_match_released_checkpoints(name, expected):
    assert count_params(from_name(name)).total == expected


def test_shakespeare_char_matches_the_tutorial_printout():
    # Karpathy, "Let's build GPT" (seed 000's model): the script prints "10.788929 M parameters".
    assert count_params(from_name("shakespeare-char")).total == 10_788_929


def test_nanogpt_sizing_notebook_bias_free_gpt2():
    # nanoGPT transformer_sizing.ipynb: GPT-2 124M with bias=False -> "we see: 124337664",
    # with embedding/position 786432 and embedding/token 38597376 on its own lines.
    cfg = from_name("gpt2", qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    norm="layernorm_nobias")
    p = count_params(cfg)
    assert p.total == 124_337_664
    assert p.components["embedding/position"] == 786_432
    assert p.components["embedding/token"] == 38_597_376


# Brown et al. 2020. Table D.1 gives "Params (M)" to 3 or 4 significant figures; Table 2.1's
# n_params column is the models' nominal names ("13.0B" for 12.85B), within 2% of the count.
# name: (Table 2.1 label, Table D.1 millions, significant figures D.1 prints)
GPT3_TABLES = {
    "gpt3-small": (125e6, 125, 3),
    "gpt3-medium": (350e6, 356, 3),
    "gpt3-large": (760e6, 760, 3),
    "gpt3-xl": (1.3e9, 1320, 3),
    "gpt3-2.7b": (2.7e9, 2650, 3),
    "gpt3-6.7b": (6.7e9, 6660, 3),
    "gpt3-13b": (13.0e9, 12850, 4),
    "gpt3-175b": (175.0e9, 174600, 4),
}


@pytest.mark.parametrize("name,printed", GPT3_TABLES.items())
def test_gpt3_presets_reproduce_the_paper(name, printed):
    label, d1_millions, digits = printed
    total = count_params(from_name(name)).total
    assert float(f"{total / 1e6:.{digits}g}") == d1_millions
    assert abs(total - label) / label < 0.02


# Meta's releases, as transformers counts them: Llama-2-7b-hf 6,738,415,616 and
# Meta-Llama-3-8B 8,030,261,248 (model cards "7B" / "8B"; the exact counts are the sum of the
# safetensors index's tensor sizes).
@pytest.mark.parametrize("name,expected", [("llama2-7b", 6_738_415_616),
                                           ("llama3-8b", 8_030_261_248)])
def test_llama_presets_match_released_counts(name, expected):
    assert count_params(from_name(name)).total == expected


def test_tied_weight_counted_once_and_untied_adds_one_matrix():
    tied = count_params(from_name("gpt2"))
    untied = count_params(from_name("gpt2", tie_embeddings=False))
    assert untied.total - tied.total == 768 * 50257


# ---- properties over random architectures ----------------------------------------------

@st.composite
def configs(draw) -> GPTConfig:
    n_head = draw(st.integers(1, 8))
    head = draw(st.integers(1, 16)) * 2
    kv = draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0]))
    layout = draw(st.sampled_from(QKV_LAYOUTS))
    return GPTConfig(
        block_size=draw(st.integers(1, 4096)),
        vocab_size=draw(st.integers(1, 100_000)),
        n_layer=draw(st.integers(1, 48)),
        n_head=n_head,
        n_embd=n_head * head,
        n_kv_head=n_head if layout == "per_head" else kv,
        head_dim=draw(st.one_of(st.none(), st.integers(1, 16).map(lambda x: 2 * x))),
        ffn_mult=draw(st.integers(1, 8)),
        d_ff=draw(st.one_of(st.none(), st.integers(1, 512))),
        qkv_layout=layout,
        qkv_bias=draw(st.booleans()),
        attn_out_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        lm_head_bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        pos_embedding=draw(st.sampled_from(POSITIONS)),
        norm=draw(st.sampled_from(NORMS)),
        mlp=draw(st.sampled_from(MLPS)),
        final_norm=draw(st.booleans()),
    )


@settings(max_examples=300)
@given(configs())
def test_components_sum_to_total(cfg):
    p = count_params(cfg)
    assert sum(p.components.values()) == p.total
    assert p.non_embedding == p.total - sum(p.components[k] for k in EMBEDDING_KEYS)
    assert all(v >= 0 for v in p.components.values())


@settings(max_examples=200)
@given(configs(), st.integers(1, 8192))
def test_context_length_enters_only_through_a_learned_position_table(cfg, new_t):
    before = count_params(cfg).total
    after = count_params(dataclasses.replace(cfg, block_size=new_t)).total
    learned = cfg.pos_embedding == "learned"
    assert after - before == ((new_t - cfg.block_size) * cfg.n_embd if learned else 0)


@settings(max_examples=200)
@given(configs())
def test_every_family_keeps_its_count_consistent_with_the_switches(cfg):
    # the total is the sum of an independent, literal per-tensor count
    E, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    Dq, Dkv, Dff = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.ffn_dim
    norm = {"layernorm": 2 * E, "layernorm_nobias": E, "rmsnorm": E}[cfg.norm]
    per_layer = (E * Dq + E * Dkv * 2 + Dq * E + 2 * norm
                 + (Dq + 2 * Dkv) * cfg.qkv_bias + E * cfg.attn_out_bias
                 + (3 if cfg.mlp in ("swiglu", "geglu") else 2) * E * Dff
                 + ((2 if cfg.mlp in ("swiglu", "geglu") else 1) * Dff + E) * cfg.mlp_bias)
    expected = (V * E + (T * E if cfg.pos_embedding == "learned" else 0) + L * per_layer
                + (norm if cfg.final_norm else 0) + (0 if cfg.tie_embeddings else V * E)
                + V * cfg.lm_head_bias)
    assert count_params(cfg).total == expected


# GPT-2 small's sizes (L=12, E=768, V=50257, T=1024, d_ff=4E) under each family, by hand
_L, _E, _V, _T = 12, 768, 50257, 1024
FAMILY_TOTALS = {
    # the released GPT-2 small: wte, wpe, blocks of 12E^2 + 13E, ln_f; lm_head tied
    "gpt2": 124_439_808,
    # per-head k/q/v without bias 3E^2, proj E^2 + E, ReLU MLP 8E^2 + 5E, two LayerNorms 4E;
    # untied lm_head with bias V*E + V
    "tutorial": 2 * _V * _E + _V + _T * _E + _L * (12 * _E**2 + 10 * _E) + 2 * _E,
    # per-head q/k/v with bias, biased O and MLP, tied head without bias: GPT-2's count
    "notes": 124_439_808,
    # q, k, v, o 4E^2; SwiGLU 3 x E x 4E; two RMSNorms 2E; final RMSNorm E; untied head, no
    # position table
    "llama": 2 * _V * _E + _L * (16 * _E**2 + 2 * _E) + _E,
}


# the newer families are checked against transformers' own counts (test_architectures.py)
@pytest.mark.parametrize("arch", list(FAMILY_TOTALS))
def test_every_family_at_gpt2_sizes_matches_a_hand_count(arch):
    assert count_params(from_name("gpt2", arch=arch)).total == FAMILY_TOTALS[arch]


@pytest.mark.parametrize("changes,field", [
    (dict(n_head=7), "n_head"),
    (dict(n_kv_head=5), "n_kv_head"),
    (dict(n_embd=0), "n_embd"),
    (dict(n_layer=-1), "n_layer"),
    (dict(norm="batchnorm"), "norm"),
    (dict(dropout=1.5), "dropout"),
    (dict(vocab_size=3.5), "vocab_size"),
])
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError) as info:
        GPTConfig(**changes)
    assert info.value.field == field
