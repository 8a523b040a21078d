"""--offload-activations (gptcalc.memory.offload): torchtune's OffloadActivations rule against the
reference model run under the same rule (reference_model.offload): the bytes the device keeps
and the bytes the host receives, over sizes on both sides of torchtune's 1,024-byte minimum."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.memory import TrainingSetup, memory_report, saved_activations, step_peak
from gptcalc.memory.offload import MIN_OFFLOAD_BYTES, offload_split


def _split(cfg, wl, setup):
    device, host = offload_split(cfg, setup, saved_activations(cfg, wl, setup))
    return sum(device.values()), sum(host.values())


@settings(max_examples=20, deadline=None)
@given(arch=st.sampled_from(["llama", "gpt2"]),
       mode=st.sampled_from(["fp32", "bf16", "mixed", "amp"]),
       b=st.integers(1, 2), S=st.integers(2, 40), E=st.sampled_from([16, 32]),
       recompute=st.sampled_from(["none", "op", "full", "selective"]))
# autocast's three casts of a block's input to separate q, k and v projections: 384 B each,
# under the threshold (the line of 1,152 B a block was once taken as one tensor)
@example(arch="llama", mode="amp", b=1, S=6, E=32, recompute="none")
# and the two casts of the MLP's input to SwiGLU's gate and up projections: 512 B each
@example(arch="llama", mode="amp", b=1, S=8, E=32, recompute="none")
def test_offloaded_bytes_exact_cpu(arch, mode, b, S, E, recompute):
    from reference_model.offload import measure_offload

    cfg = from_name("debug", arch=arch, n_layer=2, n_embd=E, n_head=2, block_size=64,
                    vocab_size=64)
    wl = Workload(b, S)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", offload_activations=True,
                          recompute=recompute)
    m = measure_offload(cfg, wl, setup)
    assert _split(cfg, wl, setup) == (m.device, m.host)


@pytest.mark.parametrize("S, offloaded", [(31, False), (32, True)])
def test_threshold_both_sides(S, offloaded):
    # bf16, E = 16: a block input of 32 tokens is 32 x 16 x 2 = 1,024 bytes, torchtune's
    # min_offload_size (offloaded at >=); 31 tokens, 992 bytes, stay
    from reference_model.offload import measure_offload

    cfg = from_name("debug", arch="llama", n_layer=2, n_embd=16, n_head=2, block_size=64,
                    vocab_size=64)
    wl, setup = Workload(1, S), TrainingSetup(mode="bf16", attn_impl="sdpa",
                                              offload_activations=True)
    device, host = offload_split(cfg, setup, saved_activations(cfg, wl, setup))
    assert ("layer/ln_1/input" in host) == offloaded
    assert S * 16 * 2 >= MIN_OFFLOAD_BYTES or not offloaded
    m = measure_offload(cfg, wl, setup)
    assert (sum(device.values()), sum(host.values())) == (m.device, m.host)


@pytest.mark.parametrize("d_ff, offloaded", [(31, False), (32, True)])
def test_weight_copy_threshold_is_per_matrix(d_ff, offloaded):
    # amp: autocast's bf16 copy of mlp.c_fc's weight is d_ff x E x 2 bytes, one tensor per
    # block: 32 x 16 x 2 = 1,024 (offloaded), 31 x 16 x 2 = 992 (stays), though the line over
    # both blocks holds twice that; the lm_head's copy, made under NoOpManager, always stays
    from reference_model.offload import measure_offload

    cfg = from_name("debug", arch="llama", n_layer=2, n_embd=16, n_head=2, block_size=64,
                    vocab_size=64, d_ff=d_ff)
    wl, setup = Workload(1, 8), TrainingSetup(mode="amp", attn_impl="sdpa",
                                              offload_activations=True)
    device, host = offload_split(cfg, setup, saved_activations(cfg, wl, setup))
    assert ("weight_copy/mlp/fc" in host) == offloaded
    assert "weight_copy/lm_head" in device
    m = measure_offload(cfg, wl, setup)
    assert (sum(device.values()), sum(host.values())) == (m.device, m.host)


def test_offload_moves_saved_bytes_to_the_host_row():
    cfg, wl = from_name("llama2-7b"), Workload(1, 4096)
    on = TrainingSetup(mode="mixed", attn_impl="sdpa", device="cuda", offload_activations=True)
    rep = memory_report(cfg, wl, on)
    off = memory_report(cfg, wl, replace(on, offload_activations=False))
    moved = sum(v for k, v in rep.host.items() if k.startswith("saved activations: "))
    fwd = "forward end"
    assert moved > 0 and rep.peak.phases[fwd] < off.peak.phases[fwd]
    # the head's input, the loss's tensors and the targets stay on the device
    assert not any(k.split(": ")[1].startswith(("cross_entropy/", "final/lm_head_input",
                                                "input/targets")) for k in rep.host)


def test_offload_needs_an_accelerator():
    with pytest.raises(ConfigError) as e:
        step_peak(from_name("debug"), Workload(1, 8), TrainingSetup(offload_activations=True))
    assert e.value.field == "offload_activations"
