"""The transformers profile (gptcalc.memory.profile_transformers) against transformers' own models.

Expected values are measured on the models (saved_tensors_hooks, MemTracker, tensor nbytes);
the profile under test never computes them.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from gptcalc.config import GPTConfig  # noqa: E402
from gptcalc.errors import ConfigError  # noqa: E402
from gptcalc.families import ARCHS  # noqa: E402
from gptcalc.memory.profile_transformers import (  # noqa: E402
    transformers_family, transformers_loss_transients, transformers_saved)
from reference_model import transformers_twin as tw  # noqa: E402

FAMILIES = ("gpt2", "gpt_neox", "llama", "llama_mha", "qwen2")


def _cfg(family: str, E: int = 32, L: int = 2, H: int = 4, V: int = 100, dropout: float = 0.0
         ) -> GPTConfig:
    kw = dict(n_layer=L, n_head=H, n_embd=E, vocab_size=V, block_size=128, dropout=dropout)
    if family == "gpt2":
        return GPTConfig(**ARCHS["gpt2"], **kw)
    if family == "gpt_neox":  # Pythia's switches: partial rotary, parallel residual, exact GELU
        return GPTConfig(**{**ARCHS["gpt2"], "mlp": "gelu", "pos_embedding": "rotary",
                            "rotary_pct": 0.25, "parallel_residual": True,
                            "tie_embeddings": False}, **kw)
    gqa = None if family == "llama_mha" else max(1, H // 2)
    arch = {**{k: v for k, v in ARCHS["llama"].items() if k != "dropout"},
            "qkv_bias": family == "qwen2"}
    return GPTConfig(**arch, n_kv_head=gqa, d_ff=3 * E // 2, **kw)


def _setup(attn: str, mode: str = "fp32"):
    return SimpleNamespace(mode=mode, attn_impl=attn, device="cpu", recompute="none",
                           act_bytes=4 if mode == "fp32" else 2)


def _model(cfg: GPTConfig, attn: str, dtype=torch.float32):
    return tw.build(tw.hf_config_for(cfg), None if attn == "sdpa" else "eager", dtype=dtype)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(FAMILIES), attn=st.sampled_from(["sdpa", "manual"]),
       E=st.sampled_from([32, 64, 128]), L=st.integers(2, 4), H=st.sampled_from([1, 2, 4]),
       V=st.integers(100, 2000), S=st.integers(16, 128), B=st.integers(1, 4),
       dropout=st.sampled_from([0.0, 0.1]))
def test_saved_bytes_exact_fp32(family, attn, E, L, H, V, S, B, dropout):
    cfg = _cfg(family, E, L, H, V, dropout)
    idx, labels = tw.make_batch(V, B, S)
    measured = tw.measure_saved(_model(cfg, attn), idx, labels).activation_bytes
    assert sum(transformers_saved(cfg, B, S, _setup(attn)).values()) == measured


# Every family x attention x dropout once, at B = 2 and at B = 1 with one head (where matmul
# folds its operands as views), and at B = 1 with two heads sharing one KV head (repeat_kv's
# output is then a view of that head): the cases the hypothesis draw may miss.
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("B,H", [(2, 4), (1, 1), (1, 2)])
def test_saved_bytes_exact_grid(family, attn, dropout, B, H):
    cfg = _cfg(family, H=H, dropout=dropout)
    idx, labels = tw.make_batch(cfg.vocab_size, B, 16)
    measured = tw.measure_saved(_model(cfg, attn), idx, labels).activation_bytes
    assert sum(transformers_saved(cfg, B, 16, _setup(attn)).values()) == measured


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
@pytest.mark.parametrize("attn,dropout", [("sdpa", 0.0), ("manual", 0.1), ("sdpa", 0.1)])
def test_saved_bytes_exact_bf16(family, attn, dropout):
    cfg = _cfg(family, dropout=dropout)
    idx, labels = tw.make_batch(cfg.vocab_size, 2, 16)
    measured = tw.measure_saved(_model(cfg, attn, torch.bfloat16), idx, labels).activation_bytes
    assert sum(transformers_saved(cfg, 2, 16, _setup(attn, "bf16")).values()) == measured


def _moment(lines: dict[str, int], moment: str) -> int:
    return sum(v for k, v in lines.items() if k.startswith(moment + "/"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn,dropout", [("sdpa", 0.0), ("manual", 0.0), ("sdpa", 0.1)])
def test_step_moments_fp32(family, attn, dropout):
    """Live bytes at the end of forward, inside the cross entropy's backward and at the start of
    backward = weights + AdamW states + buffers + saved activations + the loss path's lines;
    the step's peak is inside the cross entropy's backward at this size."""
    B, S = 2, 32
    cfg = _cfg(family, V=500, dropout=dropout)
    model = _model(cfg, attn)
    idx, labels = tw.make_batch(cfg.vocab_size, B, S)
    # the set-up's loop (TrainingSetup's default) holds the output through backward
    moments = tw.measure_step_peak(model, idx, labels, keep_logits=True)
    params = list(model.parameters())
    weights = sum(p.nbytes for p in params)
    adamw = 2 * weights + 4 * len(params)  # exp_avg, exp_avg_sq, a 0-d fp32 step per tensor
    buffers = sum(b.nbytes for b in model.buffers())
    saved = transformers_saved(cfg, B, S, _setup(attn))
    # the batch exists before the tracker starts: MemTracker sees it only where an op views it
    # (GPT2Model's input_ids.view)
    unseen = 0 if family == "gpt2" else saved["input/idx"]
    base = weights + adamw + buffers + sum(saved.values()) - unseen
    lines = transformers_loss_transients(cfg, B, S, _setup(attn))
    assert moments.baseline == 2 * weights + adamw + buffers  # gradients of the warm-up step
    assert moments.forward_end == base + _moment(lines, "forward_end")
    assert moments.phase_peaks["loss_backward"] == base + _moment(lines, "loss_backward")
    assert moments.backward_start == base + _moment(lines, "backward_start")
    assert moments.peak_phase == "loss_backward"
    assert moments.peak_bytes == moments.phase_peaks["loss_backward"]


def test_hf_config_round_trips_through_hf_reader():
    from gptcalc.hf import config_from_hf

    for family in FAMILIES:
        cfg = _cfg(family)
        raw = tw.hf_config_for(cfg)
        back = config_from_hf(raw)
        # the architecture round-trips; the reader also records the family's module names
        assert back.replace(hf_model_type="") == cfg and back.hf_model_type == raw["model_type"]
    cfg = _cfg("llama")
    assert tw.hf_config_for(cfg, "mistral")["model_type"] == "mistral"
    assert transformers_family(_cfg("qwen2")) == "qwen2"


def test_configs_no_transformers_class_implements():
    with pytest.raises(ConfigError, match="no transformers class"):
        transformers_family(GPTConfig(**ARCHS["tutorial"]))
    with pytest.raises(ConfigError, match="every Conv1D has a bias"):
        tw.hf_config_for(GPTConfig(**{**ARCHS["gpt2"], "mlp_bias": False}))
    with pytest.raises(ConfigError, match="no biases"):
        tw.hf_config_for(_cfg("qwen2"), "mistral")
    with pytest.raises(ConfigError, match="whole decoder layers"):
        setup = _setup("sdpa")
        setup.recompute = "selective"
        transformers_saved(_cfg("llama"), 1, 8, setup)


def test_profile_imports_without_torch():
    code = ("import sys, gptcalc.memory.profile_transformers; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# Gemma 2 / 3 from config.json dicts (the twin builds them from the same fields): every switch
# the profile reads, against the model's saved tensors.
def _gemma_raw(family: str, H: int = 4, kv: int = 2, L: int = 3, dropout: float = 0.0,
               **extra) -> dict:
    raw = {"model_type": family, "hidden_size": 64, "num_hidden_layers": L,
           "num_attention_heads": H, "num_key_value_heads": kv, "head_dim": 16,
           "vocab_size": 300, "intermediate_size": 96, "max_position_embeddings": 128,
           "sliding_window": 16, "attention_dropout": dropout}
    if family == "gemma3_text":
        raw["sliding_window_pattern"] = 2
    return {**raw, **extra}


def _raw_saved(raw: dict, attn: str | None, mode: str, B: int, S: int) -> tuple[int, int]:
    from gptcalc.hf import config_from_hf

    cfg = config_from_hf(raw)
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    model = tw.build(raw, attn, dtype=dtype)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    measured = tw.measure_saved(model, idx, labels).activation_bytes
    setup = _setup("sdpa" if attn is None and raw["model_type"] != "gemma2" else "manual", mode)
    return sum(transformers_saved(cfg, B, S, setup).values()), measured


@pytest.mark.parametrize("family,attn", [("gemma2", None), ("gemma3_text", None),
                                         ("gemma3_text", "eager")])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("B,S,H,kv", [(2, 32, 4, 2), (1, 12, 1, 1), (3, 17, 2, 2)])
def test_saved_bytes_exact_gemma(family, attn, mode, dropout, B, S, H, kv):
    # S 32 and 17 reach the window (16): Gemma 3's SDPA sliding layers get a mask, and no
    # enable_gqa; S 12 stays inside it
    raw = _gemma_raw(family, H, kv, dropout=dropout)
    predicted, measured = _raw_saved(raw, attn, mode, B, S)
    assert predicted == measured


@pytest.mark.parametrize("raw", [
    _gemma_raw("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None),
    _gemma_raw("gemma2", L=2, sliding_window=64),
    _gemma_raw("gemma3_text", final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    _gemma_raw("gemma3_text", layer_types=["sliding_attention"] * 3)])
def test_saved_bytes_exact_gemma_switches(raw):
    # soft-capping off (Gemma 2) and on (Gemma 3: transformers applies only the final one),
    # a window longer than the sequence, only sliding layers (one rotary embedding)
    predicted, measured = _raw_saved(raw, None, "fp32", 2, 20)
    assert predicted == measured


def test_gemma_defaults_and_refusals():
    from gptcalc.training import training_defaults
    from gptcalc.hf import config_from_hf

    g2 = config_from_hf(_gemma_raw("gemma2"))
    assert transformers_family(g2) == "gemma2" and g2.attn_softcap and g2.logit_softcap
    assert training_defaults(g2, hf=True)["attn"] == "manual"  # Gemma2 has no SDPA path
    with pytest.raises(ConfigError, match="no SDPA path"):
        transformers_saved(g2, 1, 8, _setup("sdpa"))
    g3 = config_from_hf(_gemma_raw("gemma3_text", attn_logit_softcapping=50.0))
    assert transformers_family(g3) == "gemma3_text" and not g3.attn_softcap
    assert training_defaults(g3, hf=True) == {"mode": "amp", "attn": "sdpa", "device": "cuda",
                                              "impl": "transformers", "keep_logits": False}


def _moe_raw(family: str, X: int, k: int, H: int = 4, kv: int = 2, dropout: float = 0.0,
             **extra) -> dict:
    raw = {"model_type": family, "hidden_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": H, "num_key_value_heads": kv, "vocab_size": 300,
           "max_position_embeddings": 128, "num_experts_per_tok": k,
           "attention_dropout": dropout}
    if family == "mixtral":
        raw.update(intermediate_size=48, num_local_experts=X)
    else:
        raw.update(intermediate_size=96, moe_intermediate_size=32, num_experts=X, head_dim=16)
    return {**raw, **extra}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("attn,dropout", [(None, 0.0), ("eager", 0.1)])
@pytest.mark.parametrize("X,k,B,S,H,kv", [(4, 2, 2, 24, 4, 2), (16, 1, 1, 5, 1, 1),
                                          (8, 3, 3, 17, 2, 2)])
def test_saved_bytes_exact_moe(family, mode, attn, dropout, X, k, B, S, H, kv):
    # grouped_mm experts (transformers' default); (16, 1, 1, 5): most experts get no token,
    # and the saved bytes do not depend on the routing
    raw = _moe_raw(family, X, k, H, kv, dropout)
    predicted, measured = _raw_saved(raw, attn, mode, B, S)
    assert predicted == measured


@pytest.mark.parametrize("raw", [
    _moe_raw("qwen3_moe", 8, 2, norm_topk_prob=True, mlp_only_layers=[0, 2]),
    _moe_raw("qwen3_moe", 8, 2, decoder_sparse_step=2),
    _moe_raw("mixtral", 4, 2, sliding_window=8)])
def test_saved_bytes_exact_moe_switches(raw):
    predicted, measured = _raw_saved(raw, None, "fp32", 2, 20)
    assert predicted == measured


def _deepseek_raw(H: int = 4, dropout: float = 0.0, **extra) -> dict:
    raw = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": H, "num_key_value_heads": H, "vocab_size": 300,
           "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
           "n_group": 2, "topk_group": 1, "q_lora_rank": 48, "kv_lora_rank": 32,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
           "max_position_embeddings": 128, "attention_dropout": dropout}
    return {**raw, **extra}


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("attn,dropout", [(None, 0.0), ("eager", 0.0), (None, 0.1)])
@pytest.mark.parametrize("extra", [
    {},  # q LoRA; q/k heads 24 wide, values 16: SDPA's math path
    {"q_lora_rank": None, "v_head_dim": 24},  # one q_proj; equal widths: the fused kernel
    {"n_group": 4, "topk_group": 2, "norm_topk_prob": False, "n_shared_experts": 2}])
@pytest.mark.parametrize("B,S,H", [(2, 24, 4), (1, 7, 1)])
def test_saved_bytes_exact_deepseek_v3(mode, attn, dropout, extra, B, S, H):
    raw = _deepseek_raw(H, dropout, **extra)
    predicted, measured = _raw_saved(raw, attn, mode, B, S)
    assert predicted == measured
