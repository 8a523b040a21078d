"""Saved activations of the newer switches against the reference model, exact on CPU.

Each example builds the reference model of a tiny config drawing GeGLU, q/k norms, post- and
shared norms, sliding windows, sinks, ALiBi, OPT/BLOOM embeddings, MLA and MoE, runs one
training forward under saved_tensors_hooks (deduplicated by storage) and compares the bytes
with `gptcalc.memory.saved_activations`. The expected value is always the measurement.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gptcalc import GPTConfig, Workload
from gptcalc.memory import TrainingSetup, saved_activations
from gptcalc.memory.profile_reference_modern import moe_lines
from reference_model.memory import build_for, make_batch, measure_saved

torch.set_num_threads(1)


@st.composite
def modern_configs(draw) -> GPTConfig:
    """A tiny config (E <= 24, L <= 3, T = 8) with the newer switches drawn independently."""
    H = draw(st.sampled_from([1, 2, 4]))
    hd = draw(st.sampled_from([2, 4]))
    layout = draw(st.sampled_from(["fused", "separate", "per_head"]))
    mla = draw(st.booleans())
    if mla:
        layout = draw(st.sampled_from(["fused", "separate"]))
    kv = H if layout == "per_head" or mla else draw(
        st.sampled_from([d for d in (1, 2, 4) if d <= H and H % d == 0]))
    parallel = draw(st.booleans())
    shared_norm = parallel and draw(st.booleans())
    pre_norm = shared_norm or draw(st.booleans())
    fields = dict(
        block_size=8, vocab_size=draw(st.integers(5, 30)), n_layer=draw(st.integers(1, 3)),
        n_head=H, n_embd=H * hd, n_kv_head=kv, d_ff=draw(st.sampled_from([None, 6])),
        dropout=draw(st.sampled_from([0.0, 0.1])), qkv_layout=layout,
        qkv_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        pos_embedding=draw(st.sampled_from(["learned", "rotary", "none", "alibi"])),
        norm=draw(st.sampled_from(["layernorm", "layernorm_nobias", "rmsnorm"])),
        mlp=draw(st.sampled_from(["gelu", "swiglu", "geglu"])),
        final_norm=draw(st.booleans()), parallel_residual=parallel, shared_norm=shared_norm,
        pre_norm=pre_norm, post_norm=draw(st.booleans()), embd_norm=draw(st.booleans()),
        qk_norm="none" if mla else draw(st.sampled_from(["none", "head", "per_head", "proj"])),
        attn_sinks=draw(st.booleans()))
    if draw(st.booleans()):
        fields.update(embd_proj_dim=draw(st.sampled_from([4, 6])),
                      pos_offset=draw(st.sampled_from([0, 2])))
    if draw(st.booleans()):
        fields.update(sliding_window=draw(st.integers(1, 5)),
                      attn_pattern=draw(st.sampled_from(["", "LG", "GL"])))
    if mla:
        fields.update(kv_lora_rank=draw(st.sampled_from([4, 6])),
                      q_lora_rank=draw(st.sampled_from([None, 5])),
                      qk_nope_head_dim=draw(st.sampled_from([2, 4])), qk_rope_head_dim=2,
                      v_head_dim=draw(st.sampled_from([2, 4])))
    if draw(st.booleans()):
        fields.update(n_expert=draw(st.sampled_from([2, 4])),
                      n_expert_active=draw(st.sampled_from([1, 2])),
                      n_shared_expert=draw(st.sampled_from([0, 1])),
                      moe_ffn_dim=draw(st.sampled_from([None, 5])),
                      shared_expert_gate=draw(st.booleans()),
                      moe_first_dense=draw(st.sampled_from([0, 1])))
    return GPTConfig(**fields)


def _measured(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> int:
    model = build_for(cfg, setup)
    idx, targets = make_batch(cfg, wl)
    return sum(t.nbytes for t in measure_saved(model, idx, targets, setup).tensors)


def _check(cfg: GPTConfig, B: int, S: int, mode: str, attn: str, recompute: str) -> None:
    if cfg.attn_sinks:
        attn = "manual"  # the reference model writes sinks out in the manual attention only
    wl, setup = Workload(B, S), TrainingSetup(mode=mode, attn_impl=attn, recompute=recompute)
    assert sum(saved_activations(cfg, wl, setup).values()) == _measured(cfg, wl, setup)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(modern_configs(), st.integers(1, 2), st.integers(1, 8),
       st.sampled_from(["fp32", "bf16"]), st.sampled_from(["manual", "sdpa"]))
def test_modern_saved_bytes_exact_cpu(cfg, B, S, mode, attn):
    _check(cfg, B, S, mode, attn, "none")


def test_mla_value_of_one_token_is_a_view_of_the_latent_projection():
    # a long hypothesis run drew this: at S = 1 the attention-times-v matmul folds MLA's v
    # into a view and saves the whole kv_b output (k's no-rope part beside v), not a copy
    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=2, n_embd=4, n_kv_head=2,
                    qkv_layout="fused", pos_embedding="learned", norm="layernorm", mlp="gelu",
                    pre_norm=False, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                    v_head_dim=2)
    for mode in ("fp32", "bf16"):
        _check(cfg, 2, 1, mode, "manual", "none")


@pytest.mark.slow
@settings(max_examples=100, deadline=None, derandomize=True)
@given(modern_configs(), st.integers(1, 2), st.integers(1, 8),
       st.sampled_from(["fp32", "bf16", "amp", "mixed"]), st.sampled_from(["manual", "sdpa"]),
       st.sampled_from(["none", "selective", "full"]))
def test_modern_saved_bytes_exact_cpu_every_mode(cfg, B, S, mode, attn, recompute):
    # amp with OPT's project_in and no additive positions: the first block reads a 16-bit
    # stream, which the profile does not follow (its docstring says so)
    if mode == "amp" and cfg.embd_proj_dim is not None and cfg.pos_embedding != "learned":
        return
    _check(cfg, B, S, mode, attn, recompute)


@pytest.mark.parametrize("switch", [
    dict(mlp="geglu"), dict(qk_norm="head"), dict(qk_norm="per_head"), dict(qk_norm="proj"),
    dict(post_norm=True), dict(post_norm=True, pre_norm=False),
    dict(parallel_residual=True, shared_norm=True), dict(sliding_window=3, attn_pattern="LG"),
    dict(attn_sinks=True), dict(pos_embedding="alibi"), dict(embd_norm=True),
    dict(embd_proj_dim=4, pos_offset=2, pos_embedding="learned"),
    dict(kv_lora_rank=4, q_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4),
    dict(n_expert=4, n_expert_active=2, n_shared_expert=1, moe_ffn_dim=6,
         shared_expert_gate=True)])
@pytest.mark.parametrize("mode, attn", [("fp32", "manual"), ("bf16", "sdpa"), ("amp", "manual")])
def test_each_switch_alone_exact(switch, mode, attn):
    switch = dict(switch)  # the parameter is shared by the modes
    cfg = GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=8, d_ff=12,
                    dropout=0.1, pos_embedding=switch.pop("pos_embedding", "rotary"),
                    norm="rmsnorm", mlp=switch.pop("mlp", "swiglu"), **switch)
    _check(cfg, 2, 7, mode, attn, "none")


def test_moe_bytes_do_not_depend_on_routing():
    # Two batches route differently through the same model (the realised expert loads differ)
    # and save the same bytes; the counts only move rows between experts.
    cfg = GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=8, d_ff=12,
                    pos_embedding="rotary", norm="rmsnorm", mlp="swiglu", n_expert=4,
                    n_expert_active=2, moe_ffn_dim=6)
    setup, wl = TrainingSetup(), Workload(2, 16)
    model = build_for(cfg, setup)
    loads, saved = [], []
    for seed in (0, 1):
        idx, targets = make_batch(cfg, wl, seed=seed)
        moe = model.transformer.h[0].mlp
        with torch.no_grad():
            h = model.transformer.wte(idx)
            block = model.transformer.h[0]
            x = h + block.attn(block.ln_1(h))
            chosen = torch.topk(moe.router(block.ln_2(x).reshape(-1, 8)), 2, dim=-1).indices
        loads.append(torch.bincount(chosen.flatten(), minlength=4).tolist())
        saved.append(sum(t.nbytes for t in measure_saved(model, idx, targets, setup).tensors))
    assert loads[0] != loads[1] and saved[0] == saved[1]
    assert sum(saved_activations(cfg, wl, setup).values()) == saved[0]
    # the formula given the realised counts is the same as the one for balanced routing
    assert moe_lines(cfg, 32, 4, False, False, tuple(loads[0])) == moe_lines(cfg, 32, 4, False,
                                                                                False)


# MLA (q/k heads 16 wide, v heads 8) on one block: on CUDA the flash kernel refuses q/k heads
# wider than v's and SDPA runs the memory-efficient kernel
MLA_CUDA = GPTConfig(block_size=64, vocab_size=11, n_layer=1, n_head=2, n_embd=16, n_kv_head=2,
                     qkv_layout="fused", pos_embedding="rotary", norm="rmsnorm", mlp="swiglu",
                     kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize("S", [32, 33])  # the kernel's logsumexp rounds S up to 32 rows
def test_mla_sdpa_on_cuda_saves_the_memory_efficient_kernels_tensors(S, monkeypatch):
    """The reference model's MLA block on FakeTensorMode, its SDPA call replaced by the op
    CUDA's dispatcher picks for these head sizes (aten._scaled_dot_product_efficient_attention,
    torch 2.13's meta kernel): the storages that op saves for backward (the two 0-d int64
    philox scalars, host tensors on CUDA, left out) equal the profile's attention-core lines
    under --device cuda, and its output is laid out (b, S, H, v) so c_proj reads it without a
    copy; no S x S tensor is saved."""
    import torch.nn.functional as F

    from gptcalc.memory.profile_reference import _attention_lines
    from reference_model.measure import fake_mode
    from reference_model.memory import storage_key

    calls = []

    def efficient(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        assert attn_mask is None and is_causal
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, dropout_p, True, scale=scale)[0]
        calls.append((saved, out))
        return out

    setup = TrainingSetup(mode="bf16", attn_impl="sdpa", device="cuda")
    monkeypatch.setattr(F, "scaled_dot_product_attention", efficient)
    with fake_mode():
        model = build_for(MLA_CUDA, setup)
        idx, _ = make_batch(MLA_CUDA, Workload(1, S))
        model(idx)
    (saved, out), = calls
    kept = {storage_key(t): t.untyped_storage().nbytes() for t in saved
            if not (t.dim() == 0 and t.dtype == torch.int64)}
    lines = _attention_lines(MLA_CUDA, 1, S, setup, sliding=False)
    core = lines["attn/qkv"] + lines["attn/logsumexp"]
    # the output's storage is c_proj's input (attn/out_input), not a line of its own
    assert sum(kept.values()) - out.untyped_storage().nbytes() == core
    assert out.transpose(1, 2).is_contiguous()
    assert not any(k.startswith(("attn/softmax", "attn/sdpa_out")) for k in lines)
    assert lines["attn/logsumexp"] == 2 * (32 if S == 32 else 64) * 4


def test_transformers_mla_under_sdpa_on_cuda_by_hand():
    # DeepseekV3Attention under sdpa on CUDA: the memory-efficient kernel (see above) saves
    # q (the rope cat), k (the expanded cat), v (a split view of kv_b_proj's output, whose
    # whole storage stays), its output (o_proj's input, no copy) and an fp32 logsumexp of
    # b x H x S rounded up to 32 rows; nothing S x S
    from gptcalc.memory.profile_transformers import _mla

    b, S, H, a = 1, 33, 2, 2
    N = b * S
    lines = _mla(MLA_CUDA, b, S, TrainingSetup(mode="bf16", attn_impl="sdpa", device="cuda"))
    assert lines["q"] == lines["k"] == N * H * 16 * a
    assert lines["v"] == N * H * (8 + 8) * a
    assert lines["logsumexp"] == b * H * 64 * 4
    assert lines["sdpa_out"] == N * H * 8 * a and lines["out_input"] == 0
    assert "softmax" not in lines and "probs" not in lines
    cpu = _mla(MLA_CUDA, b, S, TrainingSetup(mode="bf16", attn_impl="sdpa", device="cpu"))
    assert cpu["softmax"] == b * H * S * S * 4  # CPU: the math path, in fp32


@pytest.mark.parametrize("S, rows", [(32, 32), (33, 64)])
def test_op_level_checkpointing_keeps_the_memory_efficient_logsumexp(S, rows):
    # torchtitan's op-level save list keeps the fused kernel's outputs; MLA's on CUDA is the
    # memory-efficient kernel's, whose fp32 logsumexp has S rounded up to 32 rows
    from gptcalc.memory.profile_reference import _flash, op_block_lines

    setup = TrainingSetup(mode="bf16", attn_impl="sdpa", device="cuda", recompute="op")
    lines = op_block_lines(MLA_CUDA, 1, S, setup, _flash(MLA_CUDA, setup))
    assert lines["op/logsumexp"] == 2 * rows * 4
    assert lines["op/sdpa_out"] == S * 2 * 8 * 2
