"""The loss over the logits (gptcalc.memory.losses): torchtune's chunked loss against the
reference model running it (saved bytes exact, step peak against MemTracker), Liger's fused
loss against its source's arithmetic, and the logits the training loop keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.memory import TrainingSetup, saved_activations, step_peak
from gptcalc.memory.losses import chunk_rows, liger_chunk_rows, logits_alive

# the step peak of the chunked loss against MemTracker, measured (torch 2.13 CPU) over the
# cases below and fp32/bf16/amp/mixed x (b, S, n) in (4, 16, 4), (3, 13, 5): the phase model
# stays 384 to 1,744 bytes under the tracker, the same residual as the standard loss's in the
# same models (the model's rotary buffers and the loss's scalars): 0.2% of the smallest peak
LOSS_PEAK_TOLERANCE = 0.002


def _vocab_heavy():
    # V >> E, L = 1: the loss's terms decide the peak
    return from_name("debug", arch="llama", n_layer=1, n_embd=16, n_head=2, block_size=16,
                     vocab_size=2048)


def test_chunk_rows_follow_tensor_split():
    torch = pytest.importorskip("torch")
    for b, S, n in ((3, 13, 5), (2, 3, 8), (4, 16, 4), (1, 7, 1)):
        sizes = [t.shape[1] * b for t in torch.empty(b, S).tensor_split(n, dim=1)]
        assert chunk_rows(Workload(b, S), n) == sizes


def test_liger_chunk_rows_from_its_source():
    # fused_linear_cross_entropy_forward's own comment: BT = 4096*4, V = 32000, H = 4096
    # -> inc_factor = 8, chunk_size = 2048
    cfg = from_name("llama2-7b")
    assert (cfg.vocab_size, cfg.embd_dim) == (32000, 4096)
    assert liger_chunk_rows(cfg, Workload(4, 4096)) == 2048
    # Llama 3: V = 128256 -> inc_factor ceil(128256 / 4096) = 32; BT = 16384 -> 512 rows
    assert liger_chunk_rows(from_name("llama3-8b"), Workload(2, 8192)) == 512
    # a chunk never exceeds BT (min(chunk_size, BT)): with V <= H inc_factor is 1, and 6
    # tokens round up to 8 > 6; 8 tokens are a power of 2 already
    small = from_name("debug", arch="llama", n_embd=64, n_head=2, vocab_size=32)
    assert liger_chunk_rows(small, Workload(1, 6)) == 6
    assert liger_chunk_rows(small, Workload(1, 8)) == 8
    assert liger_chunk_rows(cfg, Workload(1, 3)) == 1  # ceil(3 / 8) = 1


@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(["fp32", "bf16", "amp", "mixed"]), b=st.integers(1, 3),
       n=st.integers(1, 4), extra=st.integers(0, 5))
def test_chunked_saved_bytes_exact_cpu(mode, b, n, extra):
    from reference_model.memory import saved_for

    cfg = from_name("debug", arch="llama", n_layer=1, n_embd=16, n_head=2, block_size=16,
                    vocab_size=64)
    wl = Workload(b, min(16, 2 * n + extra))  # chunks of at least two positions
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", loss="chunked", loss_chunks=n)
    measured = sum(t.nbytes for t in saved_for(cfg, wl, setup).tensors)
    assert sum(saved_activations(cfg, wl, setup).values()) == measured


@pytest.mark.parametrize("mode, b, S, n, keep, phase", [
    # the loss's backward at the last chunk's log_softmax (chunks of 16 rows) ...
    ("fp32", 4, 16, 4, True, "backward start"),
    # ... or the head's weight-gradient sum over the chunks (chunks of 9 and 6 rows)
    ("fp32", 3, 13, 5, True, "backward start"),
    ("mixed", 4, 16, 4, True, "backward start"),
    # logits dropped before backward: the forward's end, at the last chunk's upcast
    ("amp", 4, 16, 4, False, "forward end"),
    ("bf16", 3, 13, 5, False, "forward end"),
    # one chunk (no weight-gradient sum) and b = 1 (the targets' chunks are views)
    ("mixed", 4, 16, 1, True, "backward start"),
    ("fp32", 1, 16, 4, True, "backward start"),
])
def test_chunked_step_peak_cpu(mode, b, S, n, keep, phase):
    from reference_model.memory import measure_step_peak_cpu

    cfg, wl = _vocab_heavy(), Workload(b, S)
    setup = TrainingSetup(mode=mode, attn_impl="sdpa", loss="chunked", loss_chunks=n,
                          keep_logits=keep)
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    predicted = step_peak(cfg, wl, setup)
    assert predicted.phase == phase
    assert abs(predicted.bytes - measured) <= LOSS_PEAK_TOLERANCE * measured


@pytest.mark.parametrize("keep", [True, False])
def test_standard_loss_keep_logits_step_peak_cpu(keep):
    from reference_model.memory import measure_step_peak_cpu

    cfg, wl = _vocab_heavy(), Workload(4, 16)
    setup = TrainingSetup(mode="amp", attn_impl="sdpa", keep_logits=keep)
    measured = measure_step_peak_cpu(cfg, wl, setup).peak_bytes
    assert abs(step_peak(cfg, wl, setup).bytes - measured) <= LOSS_PEAK_TOLERANCE * measured


def test_chunked_below_standard_and_no_keep_below_keep():
    cfg, wl = from_name("llama3-8b"), Workload(1, 8192)

    def peak(**kw):
        return step_peak(cfg, wl, TrainingSetup(mode="mixed", attn_impl="sdpa", device="cuda",
                                                recompute="op", engine="fsdp2", zero=3, dp=8,
                                                **kw)).bytes
    assert peak(loss="chunked") < peak()
    assert peak(keep_logits=False) < peak()
    assert peak(loss="fused") < peak(loss="chunked")


def test_fused_loss_has_no_logits_and_saves_the_head_gradients():
    cfg, wl = from_name("llama3-8b"), Workload(2, 8192)
    setup = TrainingSetup(mode="mixed", attn_impl="sdpa", device="cuda", loss="fused")
    lines = saved_activations(cfg, wl, setup)
    assert logits_alive(cfg, wl, setup) == {"forward": 0, "backward": 0}
    assert "cross_entropy/log_probs" not in lines and "final/lm_head_input" not in lines
    # Liger saves grad_input (BT x H) and grad_weight (V x H) in the parameters' dtype
    assert lines["final/head_input_gradient"] == 2 * 8192 * 4096 * 2
    assert lines["cross_entropy/head_weight_gradient"] == 128256 * 4096 * 2


def test_loss_options_are_checked():
    with pytest.raises(ConfigError) as e:
        TrainingSetup(loss="cce")
    assert e.value.field == "loss"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(loss_chunks=0)
    assert e.value.field == "loss_chunks"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(loss="chunked", impl="transformers")
    assert e.value.field == "loss"


def test_cli_loss_options_on_the_assumptions_line():
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli

    def run(*args):
        out = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", "-B", "1",
                                        "--seq-len", "8192", "--engine", "fsdp2", "--zero", "3",
                                        "--dp", "8", "--mode", "mixed", "--recompute", "op",
                                        "--json", *args])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)
    standard = run("--keep-logits")
    assert "standard loss, logits kept through backward" in standard["assumptions"]
    assert "standard loss, logits dropped before backward" in run()["assumptions"]
    chunked = run("--loss", "chunked", "--loss-chunks", "16")
    assert "chunked loss (16 chunks, torchtune), logits dropped" in chunked["assumptions"]
    assert chunked["peak"] < standard["peak"]
    bad = CliRunner().invoke(cli, ["memory", "--loss-chunks", "0"])
    assert bad.exit_code == 2 and "loss-chunks" in bad.output
