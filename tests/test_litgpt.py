"""--impl litgpt against litgpt's own GPT and full fine-tune loop (litgpt 0.5.13, CPU).

Where litgpt can be imported (an installed package, or LITGPT_PATH naming the directory that
holds it; CI installs neither), the saved bytes are compared with a saved_tensors_hooks capture
of litgpt's GPT and loss over shapes drawn by hypothesis (exact), and the step peak with
MemTracker over full.py's loop (`reference_model.litgpt_twin`). Without litgpt the figures
pinned below, measured the same way, are compared with gptcalc.

    LITGPT_PATH=/tmp/litgpt python -m tests.test_litgpt    # measures and prints the pins
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc.cli import cli
from gptcalc.config import GPTConfig
from gptcalc.families import ARCHS
from gptcalc.memory.activations import saved_activations
from gptcalc.memory.peak import step_peak
from gptcalc.memory.profile_litgpt import CHUNK_SIZE, litgpt_loss_transients, loss_chunks
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload

# The step peak against MemTracker: gptcalc counts the batch's int64 input ids (N x 8 bytes,
# which the embedding saves), made before MemTracker starts and so not in its total, and leaves
# out a few scalars and per-row tensors of the loss (the chunks' reduction="none" losses, their
# cat, the sum, the division, loss / accum): together up to 0.8% of the tiniest steps drawn
# (E 8, V 42, S 56: 57,634 bytes), under 0.2% of the pinned ones.
PEAK_TOLERANCE = 0.01


def config(H: int, G: int, E: int, V: int, L: int = 2, hd: int = 16, d_ff: int = 48
           ) -> GPTConfig:
    """A Llama-family block as litgpt builds it (fused qkv, RMSNorm, LLaMAMLP), untied."""
    return GPTConfig(**ARCHS["llama"], n_layer=L, n_embd=E, n_head=H, n_kv_head=G,
                     head_dim=hd, d_ff=d_ff, vocab_size=V, block_size=512)


def setup(mode: str) -> TrainingSetup:
    """litgpt's bf16-true (or 32-true), on one CPU device, its loop holding the logits."""
    return TrainingSetup(mode=mode, attn_impl="sdpa", impl="litgpt", device="cpu",
                         keep_logits=True)


# Pinned: litgpt 0.5.13's GPT and full.py's loop measured on CPU with torch 2.13 by the command
# in the module docstring (saved_tensors_hooks deduplicated by storage; MemTracker's peak of
# one steady-state iteration after a warm-up). (H, G, E, V), (b, S), mode: saved bytes, peak.
PINNED = {
    # grouped-query, one chunk of rows, the backward's start the peak
    ((4, 2, 32, 200), (2, 40), "bf16"): (329114, 634858),
    # multi-head: v a view of the whole qkv output; b = 1, the shifted logits a view
    ((4, 4, 64, 1000), (1, 64), "bf16"): (500282, 1965146),
    # multi-query in fp32 (32-true): the norms' input is the stream itself
    ((4, 1, 32, 200), (3, 33), "fp32"): (679104, 1304420),
    # five chunks of 128 rows; the loss's forward (the shifted logits' copy) the peak
    ((4, 2, 32, 500), (2, 300), "bf16"): (2828242, 4389088),
}


@pytest.mark.parametrize("key", list(PINNED))
def test_pinned_litgpt_measurements(key):
    (H, G, E, V), (b, S), mode = key
    saved, peak = PINNED[key]
    cfg, wl = config(H, G, E, V), Workload(batch_size=b, seq_len=S)
    assert sum(saved_activations(cfg, wl, setup(mode)).values()) == saved
    predicted = step_peak(cfg, wl, setup(mode)).bytes
    assert abs(predicted - peak) <= PEAK_TOLERANCE * peak, (predicted, peak)


# TinyLlama 1.1B's full fine-tune, litgpt's config_hub/finetune/tiny-llama/full.yaml
# (Lightning-AI/litgpt@089fc5c6): bf16-true, micro-batch 4, max_seq_length 512, global batch
# 32 (8 micro-batches accumulated), one device; published peak 14.10 GB
# (config_hub/finetune/README.md, Lightning-AI/litgpt@03ffc551; litgpt prints
# torch.cuda.max_memory_allocated() / 1e9). The model: TinyLlama/TinyLlama-1.1B-intermediate-
# step-1431k-3T's config.json (litgpt's tiny-llama-1.1b).
TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
TINYLLAMA_PUBLISHED_GB = 14.10
# what the published figure holds beyond the step modelled: the cuBLAS workspace, allocator
# rounding, and the longest Alpaca2k batch (taken as padded to max_seq_length 512)
PUBLISHED_TOLERANCE = 0.01


def test_tinyllama_full_finetune_against_litgpts_published_peak(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINYLLAMA))
    base = ["memory", "--hf-config", str(tmp_path), "-B", "4", "--seq-len", "512",
            "--grad-accum", "8", "--json"]
    r = CliRunner().invoke(cli, base + ["--impl", "litgpt"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    # litgpt's own defaults under --impl litgpt: bf16-true, the logits held by the loop
    assert out["training"]["mode"] == "bf16" and out["training"]["keep_logits"] is True
    published = TINYLLAMA_PUBLISHED_GB * 1e9
    assert abs(out["peak"] - published) <= PUBLISHED_TOLERANCE * published
    # the reference profile under the same loop reads more than 5% low
    r = CliRunner().invoke(cli, base + ["--impl", "reference", "--mode", "bf16",
                                        "--keep-logits"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["peak"] < 0.95 * published


@pytest.mark.parametrize("args, option", [
    (["--preset", "gpt2"], "--impl"),  # LayerNorm, GELU, learned positions
    (["--preset", "llama3.2-1b"], "--impl"),  # tied: litgpt's converter unties the head
    (["--preset", "phi-3-mini"], "--impl"),  # its sliding window: an explicit mask per layer
    (["--preset", "llama3-8b", "--mode", "amp"], "--mode"),
    (["--preset", "llama3-8b", "--recompute", "full"], "--recompute"),
    (["--preset", "llama3-8b", "--loss", "chunked"], "--impl"),
    (["--preset", "llama3-8b", "--no-keep-logits"], "--keep-logits"),
    (["--preset", "llama3-8b", "--tp", "2"], "--tp"),
    (["--preset", "llama3-8b", "--optimizer-in-backward"], "--optimizer-in-backward"),
    (["--preset", "llama3-8b", "--offload-activations"], "--offload-activations"),
])
def test_unmodelled_set_ups_are_refused_naming_the_option(args, option):
    r = CliRunner().invoke(cli, ["memory", *args, "--impl", "litgpt"])
    assert r.exit_code == 2, r.output
    assert option in r.output and "Traceback" not in r.output


def test_shifted_rows_are_copied_only_when_they_are_not_one_stride_apart():
    # labels: targets[..., 1:].reshape(-1), b = 3: S = 2 a view of the (3, 2) batch targets
    # (one position per row; a copy would be 3 x 1), S = 3 a copy of the 3 x 2 shifted
    # positions (a view would keep the 3 x 3 batch)
    cfg = config(4, 2, 32, 100)
    labels = {S: saved_activations(cfg, Workload(batch_size=3, seq_len=S), setup("bf16"))[
        "input/labels"] for S in (2, 3)}
    assert labels == {2: 3 * 2 * 8, 3: 3 * 2 * 8}
    one = saved_activations(cfg, Workload(batch_size=1, seq_len=3), setup("bf16"))
    assert one["input/labels"] == 3 * 8  # b = 1: a view of the (1, 3) batch targets


def test_loss_chunks_on_both_sides_of_the_chunk_size():
    # N' = b (S - 1) rows in chunks of 128: 128 rows one chunk, 129 two
    assert loss_chunks(Workload(batch_size=1, seq_len=CHUNK_SIZE + 1)) == 1
    assert loss_chunks(Workload(batch_size=1, seq_len=CHUNK_SIZE + 2)) == 2
    assert loss_chunks(Workload(batch_size=1, seq_len=1)) == 1  # split of no rows: one chunk


def test_loss_backward_chunk_or_logits_gradient():
    # the backward's start holds 2 c V a for the largest chunk c = min(128, N') rows, or the
    # logits' zero-filled gradient b S V a, whichever is larger
    cfg = config(4, 2, 32, 100)
    short = Workload(batch_size=1, seq_len=40)  # 2 x 39 rows > 40: the chunk's
    long = Workload(batch_size=1, seq_len=400)  # 2 x 128 < 400: the logits' gradient
    assert litgpt_loss_transients(cfg, short, setup("bf16"))["backward"] == 2 * 39 * 100 * 2
    assert litgpt_loss_transients(cfg, long, setup("bf16"))["backward"] == 400 * 100 * 2


# --------------------------------------------------------------------------- litgpt itself

@st.composite
def shapes(draw, proportioned: bool = False):
    """Tiny litgpt models; S up to 150 puts b (S - 1) on both sides of the 128-row chunk.
    `proportioned`: E = H hd of 32 or 64, d_ff 2E or 3E and V >= 7E, as in every
    Llama-family model (d_ff / E 2.7 to 3.5; V / E from 7.8, Llama 2, to 31, Llama 3), where
    the loss and the optimizer make the step's peak: litgpt's block backward (fp32 RMSNorm,
    repeat_interleave) is counted with the reference model's block backward transients, which
    read up to 1.4% high where the last block's backward is the peak (V 4E: E 8, d_ff 48,
    V 32; E 32, d_ff 96, V 128 in fp32)."""
    if proportioned:
        H, hd = draw(st.sampled_from([(1, 32), (2, 16), (4, 8), (4, 16)]))
        E = H * hd
        d_ff, V = draw(st.sampled_from([2 * E, 3 * E])), draw(st.integers(7 * E, 600))
    else:
        H, hd = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([8, 16]))
        E, d_ff = draw(st.sampled_from([32, 64])), draw(st.sampled_from([16, 48]))
        V = draw(st.integers(16, 300))
    G = draw(st.sampled_from([g for g in (1, 2, 4) if H % g == 0]))
    return dict(H=H, G=G, E=E, V=V, L=draw(st.integers(1, 2)), hd=hd, d_ff=d_ff,
                b=draw(st.integers(1, 3)), S=draw(st.integers(1, 150)),
                mode=draw(st.sampled_from(["bf16", "fp32"])))


def _twin():
    pytest.importorskip("torch")
    from reference_model import litgpt_twin

    try:
        litgpt_twin.import_litgpt()
    except ImportError as e:
        pytest.skip(str(e))
    return litgpt_twin


def _measure(lt, s: dict, peak: bool):
    cfg = config(s["H"], s["G"], s["E"], s["V"], s["L"], s["hd"], s["d_ff"])
    model = lt.build(cfg, s["mode"])
    idx, targets = lt.make_batch(s["V"], s["b"], s["S"])
    if peak:
        return cfg, lt.measure_step_peak(model, idx, targets).peak_bytes
    return cfg, sum(t.nbytes for t in lt.measure_saved(model, idx, targets).tensors)


@pytest.mark.requires_torch_213
@settings(max_examples=20)
@given(shapes())
def test_saved_bytes_equal_litgpts_saved_tensors(s):
    lt = _twin()
    cfg, measured = _measure(lt, s, peak=False)
    wl = Workload(batch_size=s["b"], seq_len=s["S"])
    assert sum(saved_activations(cfg, wl, setup(s["mode"])).values()) == measured


@pytest.mark.slow  # about 25 s with litgpt installed (two steps per draw); skipped without it
@pytest.mark.requires_torch_213
@settings(max_examples=8)
@given(shapes(proportioned=True))
def test_step_peak_within_tolerance_of_litgpts_loop(s):
    lt = _twin()
    cfg, measured = _measure(lt, s, peak=True)
    wl = Workload(batch_size=s["b"], seq_len=s["S"])
    predicted = step_peak(cfg, wl, setup(s["mode"])).bytes
    assert abs(predicted - measured) <= PEAK_TOLERANCE * measured, (predicted, measured)


@pytest.mark.slow  # about 16 s with litgpt installed; skipped without it
@pytest.mark.requires_torch_213
@pytest.mark.parametrize("key", list(PINNED))
def test_pins_are_what_litgpt_measures(key):
    lt = _twin()
    (H, G, E, V), (b, S), mode = key
    s = dict(H=H, G=G, E=E, V=V, L=2, hd=16, d_ff=48, b=b, S=S, mode=mode)
    assert (_measure(lt, s, False)[1], _measure(lt, s, True)[1]) == PINNED[key]


if __name__ == "__main__":
    from reference_model import litgpt_twin

    print(f"litgpt {litgpt_twin.import_litgpt().version}")
    for (H, G, E, V), (b, S), mode in PINNED:
        s = dict(H=H, G=G, E=E, V=V, L=2, hd=16, d_ff=48, b=b, S=S, mode=mode)
        saved, peak = _measure(litgpt_twin, s, False)[1], _measure(litgpt_twin, s, True)[1]
        print(f"    (({H}, {G}, {E}, {V}), ({b}, {S}), {mode!r}): ({saved}, {peak}),")
