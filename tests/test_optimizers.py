"""The optimizers' state bytes against the optimizers themselves: each is stepped on CPU over
tensors of drawn shapes, and the unique storages of its `optimizer.state` are summed (every
tensor it keeps, shared ones once). The formulas are gptcalc.memory.states'."""

from __future__ import annotations

import math
import warnings

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc.memory.states import (BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, adafactor_state_bytes,
                                   bnb_8bit_state_bytes, optimizer_fixed_bytes,
                                   step_counter_bytes, tensor_optimizer_bytes)
from gptcalc.training_setup import TrainingSetup

torch = pytest.importorskip("torch")

# sizes on both sides of min_8bit_size and of a block boundary: n = k * 256 + {-1, 0, 1}
EDGES = [BNB_MIN_8BIT_SIZE - 1, BNB_MIN_8BIT_SIZE, BNB_MIN_8BIT_SIZE + 1,
         3 * BNB_BLOCKSIZE * 7 - 1, 3 * BNB_BLOCKSIZE * 7, 3 * BNB_BLOCKSIZE * 7 + 1, 1, 255,
         256, 257]


def measured_state_bytes(opt) -> int:
    """Bytes of every unique storage the optimizer's state holds (0-d tensors included)."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                s = v.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def stepped(make, shapes, dtype=torch.float32):
    """An optimizer made by `make` over parameters of `shapes`, after one step."""
    params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def predicted(optimizer: str, shapes, mode: str = "fp32") -> int:
    setup = TrainingSetup(optimizer=optimizer, mode=mode)
    return (sum(tensor_optimizer_bytes(setup, tuple(s)) for s in shapes)
            + step_counter_bytes(setup) * len(shapes)
            + optimizer_fixed_bytes(setup, [math.prod(s) for s in shapes]))


shape = st.one_of(
    st.sampled_from(EDGES).map(lambda n: (n,)),
    st.tuples(st.integers(1, 90), st.integers(1, 90)),
    st.tuples(st.integers(1, 5), st.integers(1, 40), st.integers(1, 40)),
    st.sampled_from(EDGES).map(lambda n: (1, n)))
shapes = st.lists(shape, min_size=1, max_size=4)


def test_bnb_8bit_formula_on_its_own_thresholds():
    # bitsandbytes 0.50, Optimizer2State.init_state: 32-bit below 4096 elements; above it
    # 2 uint8 bytes per element and one fp32 absmax per 256 elements for each state
    assert bnb_8bit_state_bytes(4095) == 8 * 4095
    assert bnb_8bit_state_bytes(4096) == 2 * 4096 + 8 * 16
    assert bnb_8bit_state_bytes(4097) == 2 * 4097 + 8 * 17


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=25)
@given(shapes=shapes)
def test_bnb_adamw8bit_states_equal_bitsandbytes(name, dtype, shapes):
    bnb = pytest.importorskip("bitsandbytes")
    make = getattr(bnb.optim, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PagedAdamW8bit on CPU falls back to unpaged, warning
        opt = stepped(lambda ps: make(ps, lr=1e-3), shapes, getattr(torch, dtype))
    assert measured_state_bytes(opt) == predicted("adamw8bit", shapes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=40)
@given(shapes=shapes)
def test_adafactor_states_equal_transformers(dtype, shapes):
    from transformers.optimization import Adafactor

    opt = stepped(lambda ps: Adafactor(ps, lr=1e-3, relative_step=False,
                                       scale_parameter=False, warmup_init=False),
                  shapes, getattr(torch, dtype))
    assert measured_state_bytes(opt) == predicted("adafactor", shapes)


def test_adafactor_factors_the_last_two_dims():
    # transformers' Adafactor: exp_avg_sq_row of shape[:-1], exp_avg_sq_col of
    # shape[:-2] + shape[-1:], fp32
    assert adafactor_state_bytes((3, 5, 7)) == 4 * (3 * 5 + 3 * 7)
    assert adafactor_state_bytes((11,)) == 4 * 11


@pytest.mark.parametrize("mode,dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
@settings(max_examples=25)
@given(shapes=shapes)
def test_lion_states_equal_lion_pytorch(mode, dtype, shapes):
    lion = pytest.importorskip("lion_pytorch")
    opt = stepped(lambda ps: lion.Lion(ps, lr=1e-4), shapes, getattr(torch, dtype))
    assert measured_state_bytes(opt) == predicted("lion", shapes, mode)


def allocator_peak(opt) -> int:
    """The peak of the CPU allocator's running total over one `opt.step()`, above its start:
    torch.profiler's memory events, which see the allocations inside a custom op's kernel too
    (bitsandbytes' CPU update is one op to MemTracker)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    run = peak = 0
    for _, nbytes in events:
        run += nbytes
        peak = max(peak, run)
    return peak


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adafactor", "lion"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [63, 64, 1024])  # 4032 elements: bitsandbytes' 32-bit path
def test_update_temporaries_equal_the_allocator(optimizer, dtype, rows):
    from gptcalc.memory.peak import (adafactor_update_temporaries,
                                     bnb_8bit_update_temporaries, lion_update_temporaries)
    from reference_model.memory import _torch_optimizer

    if optimizer == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    if optimizer == "lion":
        pytest.importorskip("lion_pytorch")
    shape, n = (rows, 64), rows * 64
    pb = 2 if dtype == "bfloat16" else 4
    opt = stepped(lambda ps: _torch_optimizer(ps, TrainingSetup(optimizer=optimizer)), [shape],
                  getattr(torch, dtype))
    measured = allocator_peak(opt)
    if optimizer == "lion":
        assert measured == lion_update_temporaries(n, pb)
    elif optimizer == "adamw8bit":
        # beside the formula: the re-quantization's own outputs, made after the peak
        assert measured - bnb_8bit_update_temporaries(n, "cpu", pb) in range(0, 16)
    else:
        # beside the formula: the factored update's row and column vectors, 4 (R + C), and its
        # 0-d RMS scalar (4 B), which a full suite run once found served without a new
        # allocation (measured 4 (R + C) there, 4 (R + C + 1) alone)
        extra = measured - adafactor_update_temporaries(n, pb)
        assert extra in (4 * (rows + 64), 4 * (rows + 64 + 1))


# CPU AdamW steps one tensor at a time and holds the previous tensor's `denom` beside this
# one's two temporaries: the consecutive pairs of the model's parameter order decide its peak.
# gptcalc's pairs (from the inventory, O(1) in L) against the reference model's own
# `model.parameters()` (and its LoRA adapters'), over families and switches.
@settings(max_examples=30, deadline=None)
@given(arch=st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
       qkv=st.sampled_from(["fused", "separate", "per_head"]), tie=st.booleans(),
       final_norm=st.booleans(), n_layer=st.integers(1, 3), lora=st.sampled_from([0, 2]))
def test_step_order_pairs_equal_the_models_parameter_order(arch, qkv, tie, final_norm, n_layer,
                                                           lora):
    from gptcalc import from_name
    from gptcalc.lora import covered
    from gptcalc.memory.states import consecutive_pairs, step_order_pairs
    from reference_model.lora import apply_lora
    from reference_model.memory import build_for

    cfg = from_name("debug", arch=arch, qkv_layout=qkv, tie_embeddings=tie,
                    final_norm=final_norm, n_layer=n_layer, n_head=2, n_embd=16,
                    vocab_size=40, block_size=8)
    # o and down: every qkv layout has them (q and v are one fused module in some)
    setup = TrainingSetup(lora_rank=lora, lora_targets=("o", "down") if lora else ())
    model = build_for(cfg, setup)
    if lora:
        apply_lora(model, lora, tuple(covered(cfg, setup.lora_targets)))
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    assert step_order_pairs(cfg, setup, "first") == consecutive_pairs(sizes)
