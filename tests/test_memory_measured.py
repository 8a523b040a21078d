"""Analytic memory against the reference model: saved activations exact on CPU, states exact,
step peak against PyTorch's MemTracker; CUDA paths skip without CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.memory import TrainingSetup, memory_report, saved_activations, state_bytes
from reference_model.replay import replay_peak as step_peak
from ._strategies import TINY_ATTENTION_BOUND, TINY_PARALLEL_BOUND, configs_and_workloads
from reference_model.memory import (build_for, make_batch, make_optimizer, measure_saved,
                                    measure_step_peak_cpu, measure_step_peak_cuda, train_step)

# exact allocator numbers (MemTracker's step peak) and saved-tensor sets of torch 2.13
pytestmark = pytest.mark.requires_torch_213

torch.set_num_threads(1)

variants = st.fixed_dictionaries({
    "arch": st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
    "qkv_layout": st.sampled_from(["fused", "separate", "per_head"]),
    "norm": st.sampled_from(["layernorm", "layernorm_nobias", "rmsnorm"]),
    "mlp": st.sampled_from(["relu", "gelu", "gelu_tanh", "swiglu"]),
    "pos": st.sampled_from(["learned", "sinusoidal", "rotary", "none"]),
    "final_norm": st.booleans(), "tie": st.booleans(), "embd_dropout": st.booleans(),
    "gqa": st.booleans(),
    "n_layer": st.integers(1, 2), "B": st.integers(2, 3), "S": st.integers(2, 8),
    "dropout": st.sampled_from([0.0, 0.1]), "mode": st.sampled_from(["fp32", "bf16"]),
    "attn": st.sampled_from(["manual", "sdpa"]),
    "recompute": st.sampled_from(["none", "selective", "full"])})


def _cfg(d):
    gqa = d["gqa"] and d["qkv_layout"] != "per_head"
    return from_name("debug", arch=d["arch"], qkv_layout=d["qkv_layout"], norm=d["norm"],
                     mlp=d["mlp"], pos_embedding=d["pos"], final_norm=d["final_norm"],
                     tie_embeddings=d["tie"], embd_dropout=d["embd_dropout"],
                     n_kv_head=1 if gqa else None, n_layer=d["n_layer"], n_head=2, n_embd=16,
                     block_size=8, vocab_size=32, dropout=d["dropout"])


@settings(max_examples=60, deadline=None)
@given(variants)
def test_saved_activation_bytes_exact_cpu(d):
    cfg = _cfg(d)
    wl = Workload(d["B"], d["S"])
    setup = TrainingSetup(mode=d["mode"], attn_impl=d["attn"], recompute=d["recompute"])
    model = build_for(cfg, setup)
    idx, targets = make_batch(cfg, wl)
    measured = measure_saved(model, idx, targets, setup)
    assert sum(t.nbytes for t in measured.tensors) == sum(
        saved_activations(cfg, wl, setup).values())


@pytest.mark.parametrize("mode, optimizer", [
    ("fp32", "adamw"), ("bf16", "adamw"), ("fp32", "sgd-momentum"), ("bf16", "sgd"),
    ("amp", "adamw"), ("amp", "sgd-momentum"),
    # mixed: 16-bit weights and gradients, fp32 masters and states in MasterWeights
    ("mixed", "adamw"), ("mixed", "sgd-momentum"), ("mixed", "sgd"),
    # bitsandbytes' 8-bit AdamW, transformers' Adafactor, lion-pytorch's Lion
    *((m, o) for m in ("fp32", "bf16", "mixed") for o in ("adamw8bit", "adafactor", "lion"))])
def test_state_bytes_exact(mode, optimizer):
    pytest.importorskip({"adamw8bit": "bitsandbytes", "lion": "lion_pytorch"}.get(
        optimizer, "torch"))
    # E = 64 for the new ones: the MLP's 64 x 256 matrices cross bitsandbytes' 4096 elements
    E = 16 if optimizer in ("adamw", "sgd", "sgd-momentum") else 64
    cfg = from_name("debug", arch="tutorial", n_layer=2, n_head=2, n_embd=E, block_size=8,
                    vocab_size=32)
    setup = TrainingSetup(mode=mode, optimizer=optimizer)
    model = build_for(cfg, setup)
    opt = make_optimizer(model, setup)
    idx, targets = make_batch(cfg, Workload(2, 8))
    train_step(model, opt, idx, targets, setup)
    train_step(model, opt, idx, targets, setup)  # grads stay after step
    weights = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters())
    # unique storages: bitsandbytes' quantization maps are one pair shared by every tensor
    states = sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                  for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)}.values())
    sb = state_bytes(cfg, setup)
    assert (sb.weights, sb.gradients, sb.optimizer) == (weights, grads, states)


# The step peak is exact on CPU: MemTracker sums live tensor storages after every op, and
# step_peak walks the backward node by node (gptcalc.memory.backward_walk) and takes the CPU
# AdamW's temporaries (adamw_cpu_temps). Before this model (a single "saved + logits + 2 N*V"
# estimate) the errors were up to -5.0% (tutorial fp32 SDPA B=8: measured 2,665,040 vs
# 2,532,684 predicted).
@pytest.mark.parametrize("B, arch, mode, attn, dropout, phase, measured_when_written", [
    (2, "gpt2", "fp32", "manual", 0.0, "optimizer step", 1883504),
    (8, "gpt2", "fp32", "manual", 0.1, "backward", 2909688),
    (8, "llama", "bf16", "sdpa", 0.0, "backward", 1977432),
    (8, "tutorial", "fp32", "sdpa", 0.0, "backward", 2665040),
])
def test_step_peak_cpu(B, arch, mode, attn, dropout, phase, measured_when_written):
    cfg = from_name("debug", arch=arch, dropout=dropout, n_layer=2, vocab_size=128, n_embd=64,
                    n_head=4, block_size=16)
    _check_step_peak(cfg, B, mode, attn, phase, measured_when_written)


# Autocast modes (gpt2, L=2, E=32, S=16, V=97): amp walks 16-bit Linear gradients cast back to
# fp32 and each Linear's weight copy freed with its node; mixed adds MasterWeights' fp32 master
# gradients in the step. Exact also over families x amp/mixed x manual/SDPA x dropout 0/0.1 x
# (B, S, L) in (2, 16, 1), (8, 5, 2), (3, 16, 3), V=32, E=32: 96 of 96. Before this walk
# (predicted - measured): amp B=2 +20,094, B=8 -24,834;
# mixed B=2 -95,162, B=8 +91,518 against a tracker that did not see the fp32 masters then
# (-95,546 and -24,834 against the tracker as it is now).
@pytest.mark.parametrize("B, mode, phase, measured_when_written", [
    (2, "amp", "backward", 536184), (8, "amp", "backward", 923064),
    (2, "mixed", "optimizer step", 616432), (8, "mixed", "backward", 881336)])
def test_step_peak_cpu_autocast(B, mode, phase, measured_when_written):
    cfg = from_name("debug", arch="gpt2", n_layer=2, n_embd=32, n_head=2, block_size=16)
    _check_step_peak(cfg, B, mode, "manual", phase, measured_when_written)


# Recomputation (reference_model.memory.apply_recompute, torch.utils.checkpoint): full remakes a
# plain block's saved tensors at the block's first saving node in backward, selective the
# attention core's at att @ v's backward. Families x selective/full x (fp32 manual dropout 0.1,
# bf16 SDPA, fp32 SDPA, bf16 manual), L=2, E=64, H=4, V=128, B=8, S=16: 30 of 32 exact (gpt2
# and notes full fp32 manual with dropout +256 bytes). Before it was walked: e.g. llama full
# bf16 SDPA predicted 1,301,336 against 1,680,216, tutorial full fp32 2,094,160 against
# 2,547,024 (selective was already exact for these four).
@pytest.mark.parametrize("arch, recompute, mode, attn, dropout, measured_when_written", [
    ("tutorial", "full", "fp32", "manual", 0.1, 2547024),
    ("llama", "full", "bf16", "sdpa", 0.0, 1680216),
    ("gpt2", "selective", "fp32", "manual", 0.1, 2761720),
    ("llama", "selective", "bf16", "manual", 0.0, 1973336),
])
def test_step_peak_cpu_recompute(arch, recompute, mode, attn, dropout, measured_when_written):
    cfg = from_name("debug", arch=arch, dropout=dropout, n_layer=2, vocab_size=128, n_embd=64,
                    n_head=4, block_size=16)
    _check_step_peak(cfg, 8, mode, attn, "backward", measured_when_written, recompute)


def _check_step_peak(cfg, B, mode, attn, phase, measured_when_written, recompute="none"):
    wl = Workload(B, 16)
    setup = TrainingSetup(mode=mode, attn_impl=attn, recompute=recompute)
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    predicted = step_peak(cfg, wl, setup)
    assert measured == measured_when_written  # the tracker itself has not moved
    assert predicted.phase == phase
    assert predicted.bytes == measured
    assert sum(predicted.lines.values()) == predicted.bytes


# The forward's end as a phase, and selective recomputation of SDPA's math path (taken with
# dropout): gpt2 L=3, E=32, H=2, V=32, B=6, S=11, dropout 0.1. MemTracker measured (the per-op
# trace peaks at nll_loss_forward for the first two, inside the recomputed core at the copy of v
# for att @ v for the last two); before these were walked the prediction was 867,135, 844,992,
# 844,992 and 499,572 bytes (-1,728, -1,728, -24,620, -27,148).
@pytest.mark.parametrize("mode, recompute, attn, phase, measured_when_written", [
    ("amp", "none", "manual", "forward end", 868863),
    ("amp", "selective", "manual", "forward end", 846720),
    ("amp", "selective", "sdpa", "backward", 869612),
    ("bf16", "selective", "sdpa", "backward", 526720)])
def test_step_peak_forward_end_and_sdpa_math_recompute(mode, recompute, attn, phase,
                                                       measured_when_written):
    cfg = from_name("debug", arch="gpt2", n_layer=3, n_embd=32, n_head=2, vocab_size=32,
                    block_size=16, dropout=0.1)
    wl, setup = Workload(6, 11), TrainingSetup(mode=mode, recompute=recompute, attn_impl=attn)
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    predicted = step_peak(cfg, wl, setup)
    assert measured == measured_when_written  # the tracker itself has not moved
    assert (predicted.phase, predicted.bytes) == (phase, measured)
    assert sum(predicted.lines.values()) == predicted.bytes


# Selective recomputation of SDPA's math path (dropout 0.1), families and GQA / H = 1 / rotary
# variants x fp32/bf16/amp/mixed x (B, S) in (1, 11), (6, 11), (6, 1): 120 of 120 exact when
# written (gptcalc.memory.peak.sdpa_math_transients); here a drawn sample of that grid.
@settings(max_examples=12, deadline=None)
@given(arch_kw=st.sampled_from([("gpt2", {}), ("llama", {}), ("gpt2", {"n_head": 1}),
                                ("tutorial", {}), ("llama", {"n_head": 4, "n_kv_head": 2}),
                                ("gpt2", {"n_head": 4, "n_kv_head": 1}),
                                ("gpt2", {"pos_embedding": "rotary"})]),
       mode=st.sampled_from(["fp32", "bf16", "amp", "mixed"]),
       BS=st.sampled_from([(1, 11), (6, 11), (6, 1)]))
def test_step_peak_selective_sdpa_math_exact(arch_kw, mode, BS):
    arch, kw = arch_kw
    cfg = from_name("debug", arch=arch, **{**dict(n_layer=2, n_embd=32, n_head=2, vocab_size=32,
                                                  block_size=16, dropout=0.1), **kw})
    wl, setup = Workload(*BS), TrainingSetup(mode=mode, recompute="selective", attn_impl="sdpa")
    assert step_peak(cfg, wl, setup).bytes == measure_step_peak_cpu(cfg, wl, setup).peak_bytes


@settings(max_examples=40, deadline=None)
@given(st.fixed_dictionaries({
    "arch": st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
    "attn": st.sampled_from(["manual", "sdpa"]), "dropout": st.sampled_from([0.0, 0.1]),
    # amp / mixed too since the forward's end is a phase (reference_model.replay.forward_end: a
    # small V the fp32 copy of the logits, amp's cached bias casts and fp32 x can hold the peak)
    "mode": st.sampled_from(["fp32", "bf16", "amp", "mixed"]), "B": st.integers(2, 8),
    "autocast_dtype": st.just("bf16"),
    "S": st.integers(2, 16), "n_layer": st.integers(1, 3), "V": st.sampled_from([32, 128]),
    "optimizer": st.just("adamw")}))
@pytest.mark.slow
def test_step_peak_exact_cpu(d):
    """Families x manual/SDPA x dropout x fp32/bf16 x B x S x L: the predicted peak equals
    MemTracker's to the byte (both phases). AdamW only: SGD with momentum measured 120-2,700 bytes
    above the prediction in its step (not yet modelled)."""
    cfg = from_name("debug", arch=d["arch"], dropout=d["dropout"], n_layer=d["n_layer"],
                    vocab_size=d["V"], n_embd=32, n_head=2, block_size=16)
    wl = Workload(d["B"], d["S"])
    setup = TrainingSetup(mode=d["mode"], attn_impl=d["attn"], optimizer=d["optimizer"],
                          autocast_dtype=d["autocast_dtype"])
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    assert step_peak(cfg, wl, setup).bytes == measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_peak_cuda_runs():
    cfg = from_name("debug")
    wl, setup = Workload(2, 16), TrainingSetup(device="cuda")
    rep = measure_step_peak_cuda(cfg, wl, setup)
    assert rep.peak_bytes >= rep.requested_peak_bytes > state_bytes(cfg, setup).weights


def test_verify_memory_checks_pass_on_cpu():
    from reference_model.memory import memory_checks

    cfg = from_name("debug", arch="tutorial", dropout=0.1)
    checks = memory_checks(cfg, Workload(2, 16))
    names = [c.name for c in checks]
    assert names == ["saved activation bytes", "weight bytes", "gradient bytes",
                     "optimizer state bytes", "step peak bytes (CPU trace replay)",
                     "step peak bytes"]
    assert all(c.ok for c in checks), [c.as_dict() for c in checks if not c.ok]
    assert all(c.tolerance == 0 for c in checks[:4])


# ---------------------------------------------------------------- FakeTensorMode (shape-only)
def _fake():
    from reference_model.measure import fake_mode

    return fake_mode()


def _saved_rows(report):
    return sorted((t.nbytes, t.dtype, t.shape, t.saved_by, t.module, t.category)
                  for t in report.tensors)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(variants, st.sampled_from(["fp32", "amp", "bf16", "mixed"]))
def test_saved_tensors_same_on_fake_tensors_and_by_data_ptr(d, mode):
    """storage_key (the StorageImpl address) groups real tensors exactly as data_ptr did, and
    gives the same tensors, sizes, saving nodes and categories (autocast weight copies included)
    on FakeTensorMode tensors, whose data_ptr is always 0."""
    import reference_model.memory as M

    cfg, wl = _cfg(d), Workload(d["B"], d["S"])
    setup = TrainingSetup(mode=mode, attn_impl=d["attn"], recompute=d["recompute"])
    real = M.saved_for(cfg, wl, setup)
    key = M.storage_key
    M.storage_key = lambda t: t.untyped_storage().data_ptr()
    try:
        by_ptr = M.saved_for(cfg, wl, setup)
    finally:
        M.storage_key = key
    with _fake():
        fake = M.saved_for(cfg, wl, setup)
    assert real.tensors and _saved_rows(real) == _saved_rows(by_ptr) == _saved_rows(fake)
    assert fake.weight_copy_bytes == real.weight_copy_bytes
    if mode == "amp" and d["recompute"] == "none":  # autocast saves 16-bit weight copies
        assert fake.weight_copy_bytes > 0


@pytest.mark.parametrize("mode, optimizer, recompute", [
    ("fp32", "adamw", "none"), ("amp", "adamw", "selective"), ("bf16", "sgd-momentum", "full"),
    ("mixed", "adamw", "none"), ("fp32", "sgd", "full")])
def test_step_peak_and_states_same_on_fake_tensors(mode, optimizer, recompute):
    """MemTracker over a fake step (how its documentation estimates memory) gives the real
    step's peak and categories; weights, gradients and optimizer states after two steps too."""
    import reference_model.memory as M

    cfg = from_name("debug", arch="gpt2", n_layer=2, n_head=2, n_embd=16, block_size=8,
                    vocab_size=32, dropout=0.1)
    wl = Workload(2, 8)
    setup = TrainingSetup(mode=mode, optimizer=optimizer, recompute=recompute)

    def run():
        peak, model, opt = M._tracked_steps(cfg, wl, setup, "cpu")
        return peak, (sum(p.nbytes for p in model.parameters()),
                      sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
                      sum(v.nbytes for s in opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor)))

    real = run()
    with _fake():
        fake = run()
    assert real == fake and real[0].peak_bytes > sum(real[1])


def test_global_peak_tracker_equals_memtracker():
    """The global-peak-only subclass reports MemTracker's own peak and categories."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import reference_model.memory as M

    cfg, wl = from_name("debug", arch="llama", n_layer=2), Workload(2, 8)
    setup = TrainingSetup(mode="amp", recompute="selective")
    ours = M.measure_step_peak_cpu(cfg, wl, setup)
    tracker = M._global_peak_tracker
    M._global_peak_tracker = MemTracker
    try:
        stock = M.measure_step_peak_cpu(cfg, wl, setup)
    finally:
        M._global_peak_tracker = tracker
    assert ours == stock and ours.peak_bytes > 0


def test_verify_memory_checks_equal_on_fake_tensors():
    from reference_model.memory import memory_checks

    cfg = from_name("debug", arch="llama", dropout=0.1)
    real = memory_checks(cfg, Workload(2, 16))
    fake = memory_checks(cfg, Workload(2, 16), tensors="shape-only")
    assert [(c.name, c.analytic, c.measured) for c in fake] == [
        (c.name, c.analytic, c.measured) for c in real]
    assert all(c.tool.endswith("on FakeTensorMode") for c in fake)


# The calculator's phase model (gptcalc.memory.step_peak) against MemTracker on the reference
# model, within the stated constant (reference_model.memory.PHASE_MODEL_TOLERANCE): measured
# over 81 configurations of this grid with torch 2.13, the worst error was +12.9% (SDPA's CPU
# math path with dropout, whose fp32 score stacks the phase model overcounts) and within 7.5%
# elsewhere.
@settings(max_examples=16, deadline=None)
@given(arch=st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
       mode=st.sampled_from(["fp32", "bf16", "amp", "mixed"]),
       attn=st.sampled_from(["manual", "sdpa"]), dropout=st.sampled_from([0.0, 0.1]),
       BS=st.sampled_from([(2, 16), (8, 64)]), V=st.sampled_from([128, 2000]))
def test_phase_model_peak_within_its_tolerance_cpu(arch, mode, attn, dropout, BS, V):
    from gptcalc.memory import step_peak as phase_peak
    from reference_model.memory import PHASE_MODEL_TOLERANCE

    cfg = from_name("debug", arch=arch, dropout=dropout, n_layer=2, vocab_size=V, n_embd=64,
                    n_head=4, block_size=64)
    wl, setup = Workload(*BS), TrainingSetup(mode=mode, attn_impl=attn)
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    assert abs(phase_peak(cfg, wl, setup).bytes - measured) <= PHASE_MODEL_TOLERANCE * measured


# The same bound over the reference-model tests' whole strategy (tiny models, every switch, B and
# S down to 1); the model's buffers (a causal mask, rotary and sinusoidal tables: the test
# model's, not training's) are left out of the measurement, as `gptcalc verify` does.
@settings(max_examples=40, deadline=None)
@given(case=configs_and_workloads(), attn=st.sampled_from(["manual", "sdpa"]))
@example(case=TINY_ATTENTION_BOUND, attn="manual")
@example(case=TINY_PARALLEL_BOUND, attn="manual")
def test_phase_model_peak_within_its_tolerance_tiny_cpu(case, attn):
    from gptcalc.memory import step_peak as phase_peak
    from reference_model.memory import PHASE_MODEL_TOLERANCE

    cfg, wl = case
    setup = TrainingSetup(attn_impl=attn)
    buffers = sum(b.nbytes for b in build_for(cfg, setup).buffers())
    predicted = phase_peak(cfg, wl, setup).bytes
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes - buffers
    assert abs(predicted - measured) <= PHASE_MODEL_TOLERANCE * measured, (predicted, measured)


def test_phase_model_tiny_attention_bound_cpu():
    """The drawn case that once exceeded the tolerance: predicted 6,928 B against MemTracker's
    5,944 B; the head's and the MLP's saved tensors are gone at the score gradients' moment."""
    from gptcalc.memory import step_peak as phase_peak

    cfg, wl = TINY_ATTENTION_BOUND
    setup = TrainingSetup(attn_impl="manual")
    buffers = sum(b.nbytes for b in build_for(cfg, setup).buffers())
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    assert (measured, buffers) == (5944, 144)  # MemTracker, torch 2.13 CPU; the 6 x 6 mask
    measured -= buffers
    predicted = phase_peak(cfg, wl, setup).bytes
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


# The optimizer step's peak under torch.optim.AdamW on CPU, exact, from the phase model
# (gptcalc.memory.step_peak, not the replay): its single-tensor loop holds the previous tensor's
# `denom` beside this tensor's two temporaries (gptcalc.optimizers.adamw; the consecutive
# tensors from gptcalc.memory.states.step_order_pairs). MemTracker's "Buffer" category (the
# causal mask, rotary tables) is the test model's, left out of the phase model. Before the
# previous tensor's temporary was counted, every draw read low (by the model's largest
# tensor whose predecessor is as large: the MLP's up matrix after the gate's, a per-head
# module after its sibling). One token row of four and E >= 48 keep the step the peak.
@settings(max_examples=16, deadline=None)
@given(arch=st.sampled_from(["tutorial", "gpt2", "notes", "llama"]),
       qkv=st.sampled_from(["fused", "separate", "per_head"]), tie=st.booleans(),
       mode=st.sampled_from(["fp32", "bf16", "amp", "mixed"]), E=st.sampled_from([48, 64]),
       V=st.sampled_from([64, 128]), L=st.integers(1, 3))
def test_adamw_step_peak_exact_cpu(arch, qkv, tie, mode, E, V, L):
    cfg = from_name("debug", arch=arch, qkv_layout=qkv, tie_embeddings=tie, n_layer=L,
                    n_embd=E, n_head=2, vocab_size=V, block_size=8, dropout=0.0)
    wl, setup = Workload(1, 4), TrainingSetup(mode=mode, attn_impl="manual", device="cpu")
    measured = measure_step_peak_cpu(cfg, wl, setup)
    predicted = memory_report(cfg, wl, setup).peak
    assert predicted.phase == "optimizer step"
    assert predicted.bytes + measured.by_category["Buffer"] == measured.peak_bytes


# Muon (torch.optim.Muon on the blocks' 2-D matrices, torch.optim.AdamW on the rest, as
# reference_model.memory.MuonWithAdamW runs them): the states exact in every mode
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["fp32", "amp", "bf16", "mixed"])
def test_muon_state_bytes_exact(arch, mode):
    cfg = from_name("debug", arch=arch, n_layer=2, n_head=2, n_embd=16, block_size=8,
                    vocab_size=32)
    setup = TrainingSetup(mode=mode, optimizer="muon")
    model = build_for(cfg, setup)
    opt = make_optimizer(model, setup)
    idx, targets = make_batch(cfg, Workload(2, 8))
    train_step(model, opt, idx, targets, setup)
    train_step(model, opt, idx, targets, setup)
    states = sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                  for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)}.values())
    sb = state_bytes(cfg, setup)
    assert (sb.weights, sb.optimizer) == (sum(p.nbytes for p in model.parameters()), states)


# The optimizer step's peak under Muon, exact: MemTracker counts the Newton-Schulz temporaries
# (gptcalc.memory.peak.muon_update_temporaries, read from torch/optim/_muon.py) among the
# optimizer's states, and beside them the model's registered buffers (the causal mask, the
# rotary tables: its "Buffer" category), which the optimizer phase leaves out for every optimizer
@pytest.mark.parametrize("arch, mode", [("gpt2", "fp32"), ("llama", "bf16"), ("gpt2", "mixed"),
                                        ("llama", "amp")])
def test_muon_step_peak_exact_cpu(arch, mode):
    cfg = from_name("debug", arch=arch, n_layer=2, n_head=4, n_embd=64, block_size=16,
                    vocab_size=32)
    wl = Workload(1, 16)
    setup = TrainingSetup(mode=mode, optimizer="muon", attn_impl="manual")
    measured = measure_step_peak_cpu(cfg, wl, setup)
    predicted = memory_report(cfg, wl, setup).peak
    assert predicted.phase == "optimizer step"
    assert predicted.bytes + measured.by_category["Buffer"] == measured.peak_bytes
