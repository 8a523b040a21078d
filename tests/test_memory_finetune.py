"""LoRA fine-tuning memory against the reference model with PEFT-shaped adapters, on CPU."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.memory import saved_activations, state_bytes

torch = pytest.importorskip("torch")

from reference_model.lora import apply_lora  # noqa: E402
from reference_model.memory import build_for, make_batch, measure_saved  # noqa: E402

TARGETS = {"gpt2": ["qkv", "o", "up", "down"], "llama": ["q", "k", "v", "o", "up", "gate", "down"],
           "tutorial": ["q", "k", "v", "o", "up", "down"]}


@st.composite
def cases(draw):
    arch = draw(st.sampled_from(sorted(TARGETS)))
    targets = tuple(draw(st.lists(st.sampled_from(TARGETS[arch]), min_size=1, unique=True)))
    cfg = from_name("debug", arch=arch, n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                    block_size=16, dropout=0.0)
    setup = TrainingSetup(mode=draw(st.sampled_from(["fp32", "bf16", "amp"])),
                          attn_impl=draw(st.sampled_from(["manual", "sdpa"])),
                          lora_rank=draw(st.sampled_from([1, 4])), lora_targets=targets)
    return cfg, Workload(draw(st.integers(1, 2)), draw(st.sampled_from([8, 16]))), setup


def build(cfg, setup):
    """The reference model with PEFT-shaped adapters; under amp, as gptcalc's amp LoRA is run:
    a 16-bit frozen base, fp32 adapters, bf16 autocast (`measure_saved` enters it)."""
    if setup.mode != "amp":
        return apply_lora(build_for(cfg, setup), setup.lora_rank, setup.lora_targets)
    base = build_for(cfg, dataclasses.replace(setup, mode="bf16"))
    return apply_lora(base, setup.lora_rank, setup.lora_targets, adapter_dtype=torch.float32)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=cases())
def test_lora_saved_activations_exact_cpu(case):
    cfg, wl, setup = case
    model = build(cfg, setup)
    measured = sum(t.nbytes for t in measure_saved(model, *make_batch(cfg, wl), setup).tensors)
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


@settings(max_examples=15, deadline=None, derandomize=True)
@given(case=cases(), head=st.booleans())
def test_lora_full_recompute_saved_exact_cpu(case, head):
    # each checkpointed block keeps only its input (the first block's too, though nothing
    # ahead of it needs a gradient); an adapted head still saves lora_B's input
    cfg, wl, setup = case
    setup = dataclasses.replace(setup, recompute="full",
                    lora_targets=setup.lora_targets + ("lm_head",) * head)
    model = build(cfg, setup)
    measured = sum(t.nbytes for t in measure_saved(model, *make_batch(cfg, wl), setup).tensors)
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


@settings(max_examples=10, deadline=None, derandomize=True)
@given(case=cases())
def test_lora_states_exact_cpu(case):
    cfg, wl, setup = case
    model = build(cfg, setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    idx, targets = make_batch(cfg, wl)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=setup.mode == "amp"):
            loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
    st_ = state_bytes(cfg, setup)
    assert st_.weights == sum(p.nbytes for p in model.parameters())
    assert st_.gradients == sum(p.grad.nbytes for p in trainable)
    assert st_.optimizer == sum(v.nbytes for s in opt.state.values() for v in s.values())


def test_peft_trainable_count_and_qlora_base():
    # PEFT reports 4,194,304 trainable parameters for r=8 on q_proj and v_proj of LLaMA-7B
    cfg = from_name("llama2-7b")
    setup = TrainingSetup(mode="amp", lora_rank=8, lora_targets=("q", "v"))
    st_ = state_bytes(cfg, setup)
    assert st_.gradients == 4 * 4_194_304  # fp32 adapters
    # QLoRA: the block Linears in NF4 (4 bits) with 0.127 bits of constants per weight
    # (Dettmers et al. 2023, sec. 3), the rest bf16; 6,738,415,616 parameters (transformers)
    q = state_bytes(cfg, dataclasses.replace(setup, base_dtype="nf4"))
    n_matrix = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    base = q.breakdown["base/weights"]
    assert n_matrix // 2 + 2 * (6_738_415_616 - n_matrix) < base
    assert base < n_matrix // 2 + n_matrix * 0.128 / 8 + 2 * (6_738_415_616 - n_matrix)


# Parallel blocks (GPT-NeoX's two norms, GPT-J's and Phi's one shared norm) and sliding windows
# on the reference model: the first block's MLP of a parallel block reads the block's input, so
# it saves nothing ahead of the MLP's own first adapter; a shared norm's output is the input of
# q, k, v and of the MLP at once. A window of 8 on sequences of 8 (nothing cut off) and 16.
SWITCHES = {"parallel": dict(arch="gpt2", parallel_residual=True),
            "shared norm": dict(arch="gpt2", parallel_residual=True, shared_norm=True),
            "window": dict(arch="llama", sliding_window=8)}


@pytest.mark.parametrize("attn", ["manual", "sdpa"])
@pytest.mark.parametrize("switch, targets, S", [
    ("parallel", ("qkv",), 16), ("parallel", ("o",), 16), ("parallel", ("up",), 16),
    ("shared norm", ("qkv",), 16), ("shared norm", ("up",), 16),
    ("shared norm", ("o", "down"), 16), ("window", ("q", "v"), 8), ("window", ("q", "v"), 16),
    ("window", ("o",), 16), ("window", ("gate", "down"), 8), ("window", ("gate", "down"), 16)])
def test_lora_parallel_blocks_and_windows_exact_cpu(switch, targets, attn, S):
    cfg = from_name("debug", n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16,
                    dropout=0.0, **SWITCHES[switch])
    setup = TrainingSetup(mode="fp32", attn_impl=attn, lora_rank=4, lora_targets=targets)
    wl = Workload(2, S)
    model = build(cfg, setup)
    measured = sum(t.nbytes for t in measure_saved(model, *make_batch(cfg, wl), setup).tensors)
    assert sum(saved_activations(cfg, wl, setup).values()) == measured
