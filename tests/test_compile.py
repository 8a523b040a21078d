"""--compile (gptcalc.memory.compiled): what the min-cut partitioner saves for backward, against
the reference model's blocks (and loss) compiled with it on CPU (reference_model.compiled):
every saved byte, over sizes, modes, recomputation and losses."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.memory import TrainingSetup, saved_activations, step_peak


@pytest.mark.slow
@settings(max_examples=5, deadline=None)  # ~3 s of CPU each: Dynamo compiles every one
@given(arch=st.sampled_from(["llama", "gpt2"]), mode=st.sampled_from(["fp32", "bf16", "mixed"]),
       recompute=st.sampled_from(["none", "op", "full"]),
       compile=st.sampled_from(["blocks", "model"]),
       loss=st.sampled_from(["standard", "chunked"]), heads=st.sampled_from([(4, 2), (2, 2)]),
       b=st.integers(1, 2), S=st.integers(4, 12))
def test_compiled_saved_bytes_exact_cpu(arch, mode, recompute, compile, loss, heads, b, S):
    pytest.importorskip("torch")
    from reference_model.compiled import measure_compiled_saved

    H, kv = heads
    extra = {"n_kv_head": kv} if arch == "llama" else {}
    cfg = from_name("debug", arch=arch, n_layer=1, n_embd=8 * H, n_head=H, block_size=16,
                    vocab_size=48, **extra)
    wl = Workload(b, S)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", recompute=recompute, compile=compile,
                          loss=loss, loss_chunks=2)
    measured = sum(measure_compiled_saved(cfg, wl, setup).values())
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


def _llama():
    return from_name("debug", arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                     block_size=16, vocab_size=64)


def test_compiled_blocks_drop_what_pointwise_backward_recomputes():
    # the partitioner's rules on an RMSNorm / SwiGLU block: x * rsqrt and silu(gate) go
    cfg, wl = _llama(), Workload(2, 16)
    eager = saved_activations(cfg, wl, TrainingSetup(mode="bf16", attn_impl="sdpa"))
    comp = saved_activations(cfg, wl, TrainingSetup(mode="bf16", attn_impl="sdpa",
                                                    compile="blocks"))
    N, a = wl.tokens, 2
    gone = 2 * cfg.n_layer * N * cfg.n_embd * a + cfg.n_layer * N * cfg.ffn_dim * a
    assert sum(eager.values()) - sum(comp.values()) == gone
    assert "layer/ln_1/normalized" not in comp


def test_compiled_loss_keeps_logits_not_log_probs():
    cfg, wl = _llama(), Workload(2, 16)
    setup = TrainingSetup(mode="mixed", attn_impl="sdpa", compile="model", keep_logits=False)
    lines = saved_activations(cfg, wl, setup)
    assert "cross_entropy/log_probs" not in lines
    assert lines["cross_entropy/logits"] == wl.tokens * cfg.vocab_size * 2
    # the logits are a saved line: the logits term does not count them a second time
    peak = step_peak(cfg, wl, setup)
    assert peak.lines.get("logits", 0) == 0


@pytest.mark.parametrize("change, why", [
    (dict(mode="amp"), "autocast"), (dict(recompute="selective"), "recompute"),
    (dict(impl="transformers"), "impl"), (dict(attn_impl="manual"), "attn"),
    (dict(loss="fused"), "fused"),
])
def test_compile_refuses_what_it_does_not_model(change, why):
    setup = TrainingSetup(**{"mode": "mixed", "attn_impl": "sdpa", "compile": "blocks",
                             **change})
    with pytest.raises(ConfigError) as e:
        saved_activations(_llama(), Workload(1, 8), setup)
    assert e.value.field == "compile" and why in e.value.message


def test_compile_refuses_dropout_and_moe():
    for cfg in (from_name("debug", dropout=0.1), from_name("debug-moe")):
        with pytest.raises(ConfigError):
            saved_activations(cfg, Workload(1, 8), TrainingSetup(
                mode="mixed", attn_impl="sdpa", compile="blocks"))


@pytest.mark.slow
def test_compiled_loss_buffers_from_inductors_code():
    # Inductor's own generated code for the loss (a C++ compiler builds its CPU kernels): the
    # forward allocates no N x V buffer, the backward one, the logits' gradient in their dtype
    torch = pytest.importorskip("torch")
    import re
    import shutil

    import torch.nn.functional as F
    from torch._inductor.utils import run_and_get_code

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("Inductor's CPU kernels need a C++ compiler")
    N, V = 32, 256
    cfg = from_name("debug", arch="llama", n_layer=1, n_embd=16, n_head=2, block_size=16,
                    vocab_size=V)
    setup = TrainingSetup(mode="mixed", attn_impl="sdpa", compile="model")
    from gptcalc.memory.compiled import compiled_loss_transients

    want = compiled_loss_transients(cfg, Workload(2, N // 2), setup)
    torch._dynamo.reset()
    loss_fn = torch.compile(lambda x, t: F.cross_entropy(x.float(), t))
    x = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (N,))

    def step():
        loss_fn(x, t).backward()
    _, (forward, backward) = run_and_get_code(step)
    elem = {"torch.float32": 4, "torch.bfloat16": 2, "torch.int64": 8}
    for name, code in (("forward", forward), ("backward", backward)):
        bufs = re.findall(r"empty_strided_cpu\(\((\d+), (\d+)\), \([^)]*\), (torch\.\w+)\)",
                          code)
        vocab_wide = sum(int(n) * int(v) * elem[d] for n, v, d in bufs if int(v) == V)
        assert vocab_wide == want[name], (name, bufs)


LLAMA_TARGETS = ["q", "k", "v", "o", "up", "gate", "down", "lm_head"]


@pytest.mark.slow
@settings(max_examples=8, deadline=None)  # ~3 s of CPU each: Dynamo compiles every one
@example(targets=(["up"], []), mode="fp32", recompute="none", compile="blocks",
         loss="standard", rank=1, b=1, S=4)  # the first adapter in the first block's MLP
@example(targets=(["gate"], []), mode="bf16", recompute="none", compile="blocks",
         loss="standard", rank=1, b=1, S=4)
@example(targets=(["down"], []), mode="bf16", recompute="none", compile="blocks",
         loss="standard", rank=1, b=1, S=4)
@given(targets=st.tuples(st.lists(st.sampled_from(LLAMA_TARGETS), min_size=1, max_size=1),
                         st.lists(st.sampled_from(LLAMA_TARGETS), unique=True)),
       mode=st.sampled_from(["fp32", "bf16", "mixed"]), recompute=st.sampled_from(["none", "full"]),
       compile=st.sampled_from(["blocks", "model"]), loss=st.sampled_from(["standard", "chunked"]),
       rank=st.sampled_from([1, 4]), b=st.integers(1, 2), S=st.integers(4, 12))
def test_compiled_lora_saved_bytes_exact_cpu(targets, mode, recompute, compile, loss, rank, b, S):
    # torchtune's LoRA recipes with compile on: PEFT-shaped adapters on a frozen model, then
    # each block compiled; the min-cut partitioner's saved set, every byte
    pytest.importorskip("torch")
    from reference_model.compiled import measure_compiled_saved

    cfg = from_name("debug", arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                    block_size=16, vocab_size=48)
    wl = Workload(b, S)
    if recompute == "full" and set(targets[0] + targets[1]) == {"lm_head"}:
        return  # refused: no block input needs a gradient (test_compile_with_lora_refuses...)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", recompute=recompute, compile=compile,
                          loss=loss, loss_chunks=2, lora_rank=rank,
                          lora_targets=tuple(sorted({*targets[0], *targets[1]})))
    measured = sum(measure_compiled_saved(cfg, wl, setup).values())
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


@pytest.mark.parametrize("cfg_kw, change, why", [
    (dict(arch="gpt2"), {}, "RMSNorm"),
    (dict(arch="llama"), dict(recompute="op"), "recompute"),
    (dict(arch="llama"), dict(base_dtype="nf4"), "nf4"),
    (dict(arch="llama"), dict(recompute="full", lora_targets=("lm_head",)), "block Linear"),
])
def test_compile_with_lora_refuses_in_one_line_naming_both(cfg_kw, change, why):
    cfg = from_name("debug", n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=48,
                    **cfg_kw)
    setup = TrainingSetup(**{"mode": "bf16", "attn_impl": "sdpa", "compile": "blocks",
                             "lora_rank": 4, "lora_targets": ("q", "v"), **change})
    with pytest.raises(ConfigError) as e:
        saved_activations(cfg, Workload(1, 8), setup)
    assert e.value.field == "lora_rank" and why in e.value.message
    assert "--compile" in e.value.message and "--lora-rank" in e.value.message
