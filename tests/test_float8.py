"""--float8 (gptcalc.memory.float8): what torchao's Float8Linear blocks save for backward, eager
and compiled, against the reference model converted with torchao's own
convert_to_float8_training (torch._scaled_mm on CPU), every byte."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.memory import TrainingSetup, saved_activations


def _measured(cfg, wl, setup) -> int:
    if setup.compile == "none":
        from reference_model.memory import saved_for

        return sum(t.nbytes for t in saved_for(cfg, wl, setup).tensors)
    from reference_model.compiled import measure_compiled_saved

    return sum(measure_compiled_saved(cfg, wl, setup).values())


# _scaled_mm needs every dimension a multiple of 16: E, the heads' widths, d_ff and the tokens
@pytest.mark.slow
@settings(max_examples=5, deadline=None)  # a few seconds each: Dynamo compiles the block
@given(recipe=st.sampled_from(["tensorwise", "rowwise"]), mode=st.sampled_from(["bf16", "mixed"]),
       compile=st.sampled_from(["none", "blocks", "model"]),
       recompute=st.sampled_from(["none", "op", "full"]), E=st.sampled_from([32, 64]),
       kv=st.sampled_from([1, 2]), b=st.sampled_from([1, 2]))
def test_float8_saved_bytes_exact_cpu(recipe, mode, compile, recompute, E, kv, b):
    pytest.importorskip("torchao")
    cfg = from_name("debug", arch="llama", n_layer=1, n_embd=E, n_head=2, n_kv_head=kv,
                    block_size=16, vocab_size=64)
    wl = Workload(b, 16)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", compile=compile, recompute=recompute,
                          float8=recipe)
    assert sum(saved_activations(cfg, wl, setup).values()) == _measured(cfg, wl, setup)


def test_eager_float8_saves_the_16_bit_inputs():
    # torchao's matmul_with_hp_or_float8_args saves input_hp and weight_hp_t: nothing changes
    cfg = from_name("llama3-8b")
    wl = Workload(2, 8192)
    bf16 = TrainingSetup(mode="mixed", attn_impl="sdpa", device="cuda")
    for recipe in ("tensorwise", "rowwise"):
        f8 = TrainingSetup(mode="mixed", attn_impl="sdpa", device="cuda", float8=recipe)
        assert saved_activations(cfg, wl, f8) == saved_activations(cfg, wl, bf16)


def test_float8_refuses_what_it_does_not_model():
    for cfg, setup in ((from_name("gpt2"), TrainingSetup(mode="mixed", float8="tensorwise")),
                       (from_name("llama3-8b"), TrainingSetup(mode="amp", float8="rowwise"))):
        with pytest.raises(ConfigError) as e:
            saved_activations(cfg, Workload(1, 16), setup)
        assert e.value.field == "float8"
