"""--compile model under --impl transformers (gptcalc.memory.compiled): the Hugging Face Trainer's
`torch_compile` (accelerate's torch.compile of the whole model, the loss inside its forward)
against transformers' own Llama and Qwen2 compiled on CPU (reference_model.compiled): every
saved byte, and the step peak under Inductor."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.memory import TrainingSetup, saved_activations
from gptcalc.memory.compiled import compiled_transformers_loss_transients

# the step peak against Inductor's compiled step: the CPU allocator's running total, as
# test_memory_transformers.PEAK_TOLERANCE bounds the eager twin's (2%): the phase model's
# moments are the eager ones, and under recompute full the backward's block gradients
# (measured -1.1% at bf16, 1 x 32 tokens) are counted as for the eager model
PEAK_TOLERANCE = 0.02


def _cfg(family: str = "llama", L: int = 2, H: int = 4, kv: int = 2, hd: int = 8,
         V: int = 64):
    extra = {"qkv_bias": True} if family == "qwen2" else {}
    return from_name("debug", arch="llama", n_layer=L, n_embd=H * hd, n_head=H, n_kv_head=kv,
                     block_size=16, vocab_size=V, **extra)


def _setup(**kw) -> TrainingSetup:
    return TrainingSetup(**{"impl": "transformers", "attn_impl": "sdpa", "compile": "model",
                            **kw})


@pytest.mark.slow
@settings(max_examples=4, deadline=None)  # 5-15 s of CPU each: Dynamo traces the whole model
@example(family="llama", mode="bf16", recompute="none", L=2, heads=(4, 2), hd=8, b=1, S=8)
@example(family="qwen2", mode="fp32", recompute="full", L=2, heads=(4, 1), hd=8, b=2, S=5)
@example(family="llama", mode="mixed", recompute="full", L=2, heads=(2, 2), hd=16, b=1, S=12)
@example(family="llama", mode="bf16", recompute="none", L=1, heads=(2, 2), hd=8, b=1, S=6)
@example(family="llama", mode="fp32", recompute="none", L=1, heads=(4, 2), hd=8, b=1, S=3)
@example(family="llama", mode="amp", recompute="none", L=2, heads=(4, 1), hd=8, b=1, S=5)
@example(family="qwen2", mode="amp", recompute="none", L=1, heads=(2, 2), hd=16, b=2, S=7)
@example(family="llama", mode="amp", recompute="full", L=2, heads=(4, 2), hd=8, b=2, S=6)
@given(family=st.sampled_from(["llama", "qwen2"]),
       mode=st.sampled_from(["fp32", "bf16", "mixed", "amp"]),
       recompute=st.sampled_from(["none", "full"]), L=st.integers(1, 2),
       heads=st.sampled_from([(4, 2), (2, 2), (4, 1)]), hd=st.sampled_from([8, 16]),
       b=st.integers(1, 2), S=st.integers(2, 12))
def test_compiled_transformers_saved_bytes_exact_cpu(family, mode, recompute, L, heads, hd, b,
                                                     S):
    pytest.importorskip("transformers")
    from reference_model.compiled import measure_compiled_transformers_saved

    H, kv = heads
    if recompute == "full":
        L += 1  # 2 or 3 layers (test_recompute_full_is_modelled_from_two_layers)
    cfg, wl = _cfg(family, L, H, kv, hd), Workload(b, S)
    setup = _setup(mode=mode, recompute=recompute)
    measured = sum(measure_compiled_transformers_saved(cfg, wl, setup).values())
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


@pytest.mark.slow
@settings(max_examples=4, deadline=None)  # 5-15 s of CPU each, as above
@example(mode="amp", recompute="none", targets=("q", "k", "v", "o", "gate", "up", "down"),
         b=2, S=6)
@example(mode="amp", recompute="none", targets=("k", "v", "down"), b=1, S=5)
@example(mode="bf16", recompute="full", targets=("q", "v", "lm_head"), b=1, S=6)
@example(mode="amp", recompute="full", targets=("lm_head",), b=1, S=5)
@example(mode="fp32", recompute="none", targets=("gate", "up"), b=1, S=3)
@given(mode=st.sampled_from(["fp32", "bf16", "amp"]), recompute=st.sampled_from(["none", "full"]),
       targets=st.sampled_from([("q", "v"), ("q", "k", "v", "o"), ("gate", "up", "down"),
                                ("o", "down"), ("v", "gate", "lm_head")]),
       b=st.integers(1, 2), S=st.integers(2, 9))
def test_compiled_transformers_lora_saved_bytes_exact_cpu(mode, recompute, targets, b, S):
    # PEFT's LoRA (rank 4) on transformers' Llama, then the whole model compiled (the
    # Trainer's order); amp: a 16-bit frozen base, fp32 adapters, the forward under autocast
    pytest.importorskip("peft")
    from reference_model.compiled import measure_compiled_transformers_saved

    cfg, wl = _cfg(L=2), Workload(b, S)
    setup = _setup(mode=mode, recompute=recompute, lora_rank=4, lora_targets=targets)
    measured = sum(measure_compiled_transformers_saved(cfg, wl, setup).values())
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


def test_compiled_lora_under_amp_shares_one_input_copy_per_layer_input():
    # eager PEFT under autocast casts each adapter's input (fp32 and back): q, k, v keep three
    # 16-bit copies of ln_1's output, gate and up two of ln_2's; compiled they share one each,
    # by gptcalc's target names and by the model's own (q_proj, ...)
    from gptcalc.hf import config_from_hf

    wl, N, E, L, a = Workload(2, 8), 16, 32, 2, 2
    hf = config_from_hf({**LLAMA_HF, "hidden_size": E, "vocab_size": 64})
    kw = dict(mode="amp", lora_rank=4, attn_impl="sdpa", impl="transformers")
    for cfg, names in ((_cfg(), ("q", "k", "v", "gate", "up")),
                       (hf, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))):
        eager = saved_activations(cfg, wl, TrainingSetup(lora_targets=names, **kw))
        comp = saved_activations(cfg, wl, TrainingSetup(lora_targets=names, compile="model",
                                                        **kw))
        inputs = {k: v for k, v in comp.items() if k.endswith("lora_A_input")}
        assert sum(inputs.values()) == 2 * L * N * E * a
        assert sum(v for k, v in eager.items() if k.endswith("lora_A_input")) == \
            5 * L * N * E * a


@pytest.mark.parametrize("family, mode, recompute, b, S, measured", [
    # measured with reference_model.compiled.measure_compiled_transformers_saved (transformers
    # 5.24, torch 2.13, CPU; L 2, E 32, H 4, 2 KV heads, V 64); eager: 114,244, 10,884 B
    ("llama", "fp32", "none", 2, 8, 87_252),
    ("llama", "bf16", "none", 1, 8, 22_124),
    ("llama", "bf16", "full", 2, 8, 15_956),
    ("llama", "fp32", "full", 1, 5, 13_561),
    ("qwen2", "mixed", "none", 2, 6, 33_184),
    ("qwen2", "bf16", "full", 1, 7, 12_657),
    # amp (fp32 weights, the forward under bf16 autocast), measured the same way
    ("llama", "amp", "none", 2, 8, 113_876),
    ("llama", "amp", "none", 1, 8, 89_708),
    ("qwen2", "amp", "full", 1, 7, 17_649),
])
def test_compiled_transformers_saved_bytes_as_measured(family, mode, recompute, b, S, measured):
    setup = _setup(mode=mode, recompute=recompute)
    assert sum(saved_activations(_cfg(family), Workload(b, S), setup).values()) == measured


def test_recompute_full_is_modelled_from_two_layers():
    # one checkpointed layer: measured, the partitioner keeps the causal mask's bool form
    # (b 2, S 5: 50 B) or the position ids (b 1, S 6: 48 B) instead of the 16-bit mask
    setup = _setup(mode="bf16", recompute="full")
    assert sum(saved_activations(_cfg(L=2), Workload(1, 6), setup).values()) > 0
    with pytest.raises(ConfigError) as e:
        saved_activations(_cfg(L=1), Workload(1, 6), setup)
    assert e.value.field == "compile" and "2 or more layers" in e.value.message


def test_compiled_transformers_under_amp_keeps_every_weight_copy_and_fp32_residuals():
    # against the eager amp profile: the 16-bit weight copies all stay (the partitioner
    # recomputes no cast of a weight); one 16-bit copy of each norm's output feeds q, k, v
    # (gate, up) instead of a cast per Linear; the fp32 residuals stay at 2L of the 2L + 1
    # norms (the first layer's ln_2 input recomputed from its o_proj output, kept in 16 bits)
    cfg, wl = _cfg(), Workload(2, 8)
    eager = saved_activations(cfg, wl, TrainingSetup(impl="transformers", mode="amp",
                                                     attn_impl="sdpa"))
    comp = saved_activations(cfg, wl, _setup(mode="amp"))
    weights = {k: v for k, v in comp.items() if k.startswith("weight_copy/")}
    assert weights == {k: v for k, v in eager.items() if k.startswith("weight_copy/")}
    # measured (the twin, 1 KV head: 63,488 B): q, o, k, v, gate, up, down per layer, lm_head
    assert sum(weights.values()) == 2 * (2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * cfg.ffn_dim)
                                         + 64 * 32)
    N, E, L = 16, 32, 2
    residuals = comp["layer/ln_1/input"] + comp["layer/ln_2/input"] + comp["final/ln_f/input"]
    assert residuals == 2 * L * N * E * 4
    assert comp["layer/attn/qkv_input"] == eager["layer/attn/qkv_input"] // 3 == L * N * E * 2
    assert comp["layer/mlp/fc_input"] == eager["layer/mlp/fc_input"] // 2
    assert comp["layer/attn/o_proj_output"] == N * E * 2


def test_compiled_transformers_drops_what_the_partitioner_recomputes():
    # against the eager transformers profile: RMSNorm's fp32 input copy becomes the 16-bit
    # residual, x * rsqrt goes, silu(gate) goes, the rotary tables go, and the loss keeps
    # the 16-bit logits and two fp32 statistics per row instead of fp32 log-probabilities
    cfg, wl = _cfg(), Workload(2, 8)
    eager = saved_activations(cfg, wl, TrainingSetup(impl="transformers", mode="bf16",
                                                     attn_impl="sdpa"))
    comp = saved_activations(cfg, wl, _setup(mode="bf16"))
    N, E, L, V, F, a = 16, 32, 2, 64, cfg.ffn_dim, 2
    norms = 2 * L + 1
    gone = (eager["embedding/rotary_cos_sin"] + norms * N * E * (4 - a) + norms * N * E * a
            + L * N * F * a + N * V * 4)
    added = N * V * a + 2 * 4 * N + N  # logits, row max and log-sum-exp, the ignore mask
    assert sum(eager.values()) - sum(comp.values()) == gone - added
    assert "layer/ln_1/normalized" not in comp and "cross_entropy/log_probs" not in comp


def test_compiled_loss_backward_as_inductors_code():
    # Inductor's generated backward of the compiled Llama (L 2, E 64, 2 KV heads of 16, V 1000,
    # fp32, 4 x 64 tokens, torch 2.13 CPU): zero-filled tangents for the logits (4, 64, 1000)
    # and the four cache tensors (4, 2, 64, 16), then buf0 (256, 1) and buf1 (4, 64, 1000) fp32
    cfg = _cfg(L=2, H=4, kv=2, hd=16, V=1000)
    setup = _setup(mode="fp32", device="cpu")
    want = 1_024_000 + 4 * 32_768 + 1_024 + 1_024_000
    assert compiled_transformers_loss_transients(cfg, Workload(4, 64), setup) == {
        "forward": 0, "backward": want}
    # the cache is off under checkpointing: no tangents for it
    full = _setup(mode="fp32", device="cpu", recompute="full")
    assert compiled_transformers_loss_transients(cfg, Workload(4, 64), full)["backward"] == \
        want - 4 * 32_768


LLAMA_HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
            "intermediate_size": 160, "max_position_embeddings": 128}


def _inductor_step_peak(raw: dict, B: int, S: int, mode: str, recompute: str,
                        lora: tuple[str, ...] = ()) -> int:
    """The peak of one steady-state training step of transformers' model compiled whole by
    Inductor (CPU): the live bytes at the step's start (weights, AdamW states, the batch;
    zero_grad already run) plus the running maximum of the allocator's events
    (torch.profiler), which sees the compiled kernels' buffers that MemTracker cannot."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    from reference_model import transformers_twin as tw

    # LoRA under amp: a 16-bit frozen base, fp32 adapters
    model = tw.build(raw, dtype={"fp32": torch.float32, "amp": torch.float32,
                                 "bf16": torch.bfloat16}[mode]
                     if not (lora and mode == "amp") else torch.bfloat16)
    if recompute == "full":
        model.activation_checkpointing_enable()
        model.config.use_cache = False
    if lora:
        model = tw.peft_lora(model, LORA_RANK, list(lora), fp32_adapters=mode != "bf16")
    torch._dynamo.reset()
    cm = torch.compile(model)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    opt = tw.make_optimizer(cm)
    for _ in range(2):  # compiles, then makes the optimizer states
        tw.train_step(cm, opt, idx, labels,
                      amp_dtype=torch.bfloat16 if mode == "amp" else None)
    opt.zero_grad(set_to_none=True)
    live = [idx, labels, *cm.parameters()]
    live += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    base = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in live}.values())
    # amp: the forward under bf16 autocast over the fp32 weights, as accelerate runs it
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "amp" else \
        contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with amp:
            out = cm(input_ids=idx, labels=labels)
        loss, out = out.loss, None  # the Trainer's compute_loss returns the loss alone
        loss.backward()
        del loss
        opt.step()
    run = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in
                            prof.profiler.kineto_results.events() if e.name() == "[memory]"):
        run += nbytes
        peak = max(peak, run)
    return base + peak


LORA_RANK = 8


@pytest.mark.slow
@pytest.mark.parametrize("B, S, mode, recompute, lora", [
    (4, 64, "bf16", "none", ()), (2, 48, "fp32", "full", ()), (4, 64, "amp", "none", ()),
    (4, 64, "amp", "none", ("q_proj", "v_proj", "gate_proj"))])
def test_compiled_transformers_step_peak_against_inductor(B, S, mode, recompute, lora,
                                                          tmp_path):
    # ~60-130 s each on 2 cores: Inductor generates and builds the C++ kernels of the model
    import shutil

    pytest.importorskip("transformers")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("Inductor's CPU kernels need a C++ compiler")
    from click.testing import CliRunner

    from gptcalc.cli import cli

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_HF))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", mode, "--device", "cpu",
                                 "--recompute", recompute, "--compile", "model", "--json",
                                 *(["--lora-rank", str(LORA_RANK), "--lora-targets",
                                    ",".join(lora)] if lora else [])])
    assert r.exit_code == 0, r.output
    predicted = json.loads(r.output)["peak"]
    measured = _inductor_step_peak(LLAMA_HF, B, S, mode, recompute, lora)
    assert abs(predicted - measured) <= PEAK_TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("cfg_kw, change, why", [
    (dict(), dict(compile="blocks"), "--compile model"),
    (dict(arch="gpt2"), dict(), "Llama, Mistral and Qwen2"),
    (dict(arch="llama", dropout=0.1), dict(), "without dropout"),
    (dict(arch="llama"), dict(recompute="op"), "--recompute none or full"),
    (dict(arch="llama"), dict(attn_impl="manual"), "--attn sdpa"),
    (dict(arch="llama"), dict(lora_rank=8, lora_targets=("q", "v"), lora_dropout=0.05),
     "--lora-dropout"),
    (dict(arch="llama"), dict(lora_rank=8, lora_targets=("q", "v"), dora=True), "DoRA"),
])
def test_compile_under_transformers_refuses_in_one_line_naming_both(cfg_kw, change, why):
    cfg = from_name("debug", n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=48,
                    **cfg_kw)
    with pytest.raises(ConfigError) as e:
        saved_activations(cfg, Workload(1, 8), _setup(**{"mode": "bf16", **change}))
    assert e.value.field == "compile" and why in e.value.message
    assert "--compile" in e.value.message and "--impl transformers" in e.value.message
    assert "\n" not in e.value.message


def test_a_sliding_window_is_modelled_only_below_the_sequence():
    # transformers builds a window mask once S >= window; below it SDPA runs causal
    cfg = from_name("debug", arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                    block_size=16, vocab_size=48, sliding_window=8)
    setup = _setup(mode="bf16")
    assert sum(saved_activations(cfg, Workload(1, 7), setup).values()) > 0
    with pytest.raises(ConfigError) as e:
        saved_activations(cfg, Workload(1, 8), setup)
    assert e.value.field == "compile" and "sliding window" in e.value.message


def test_cli_answers_the_trainers_torch_compile_and_refuses_blocks():
    from click.testing import CliRunner

    from gptcalc.cli import cli

    args = ["memory", "--preset", "debug", "--arch", "llama", "--impl", "transformers",
            "--mode", "bf16", "--seq-len", "16"]
    r = CliRunner().invoke(cli, [*args, "--compile", "model", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["setup"]["compile"] == "model"
    r = CliRunner().invoke(cli, [*args, "--compile", "blocks"])
    assert r.exit_code == 2
    err = [line for line in r.output.splitlines() if line.strip()]
    assert len(err) == 1 and "--compile blocks with --impl transformers" in err[0]
