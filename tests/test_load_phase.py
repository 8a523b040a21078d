"""QLoRA's load phase (`gptcalc.memory.load`): transformers' from_pretrained quantising a 16-bit
checkpoint to NF4 as it loads, against the same call on CPU (reference_model/load_twin.py), and
how `gptcalc memory`, the reserved bytes and the verdict use it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc.cli import cli
from gptcalc.inventory import inventory
from gptcalc.lora import qlora_base_bytes
from gptcalc.memory.allocator import simulate
from gptcalc.memory.load import (applies, kept_bytes, load_events, load_phase, load_tensors,
                                 natural_key, warmup_bytes)
from gptcalc.memory.peak import step_peak
from gptcalc.memory.reserved import after_load, stage_reserved, step_events
from gptcalc.memory.verdict import verdict, verdict_floor
from gptcalc.presets import from_name
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload

QLORA = dict(lora_rank=16, lora_targets=("q", "v"), base_dtype="nf4", impl="transformers",
             mode="mixed", device="cuda")
# a small Llama: 2 blocks, E 64, d_ff 160, V 128
SMALL = dict(n_embd=64, n_head=4, n_kv_head=2, n_layer=2, d_ff=160, vocab_size=128,
             block_size=64)


def qlora(**kw) -> TrainingSetup:
    return TrainingSetup(**{**QLORA, **kw})


def test_keys_load_in_transformers_order():
    """The state-dict keys sorted as core_model_loading's dot_natural_key sorts them: lm_head
    first, layer 10 after layer 9, the final norm last."""
    cml = pytest.importorskip("transformers.core_model_loading")
    keys = [t.key for t in load_tensors(from_name("llama3-8b").replace(n_layer=12))]
    assert keys == sorted(keys, key=cml.dot_natural_key)
    assert keys[:3] == ["lm_head.weight", "model.embed_tokens.weight",
                        "model.layers.0.input_layernorm.weight"]
    assert keys.index("model.layers.10.mlp.down_proj.weight") > keys.index(
        "model.layers.9.self_attn.v_proj.weight")
    assert keys[-1] == "model.norm.weight"
    assert natural_key("shard_2") < natural_key("shard_11")  # a word's trailing digits


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("preset", ["llama3-8b", "qwen2.5-7b", "llama3.2-1b"])
def test_what_the_load_keeps_is_the_nf4_base_and_the_16_bit_rest(preset, double_quant):
    """The tensors alive after loading: every block Linear's NF4 parts (`qlora_base_bytes`,
    tested against bitsandbytes in tests/test_qlora_bnb.py), the other tensors in bf16 (a tied
    lm_head once), and bitsandbytes' one dynamic map (256 fp32) with double quantisation."""
    cfg = from_name(preset)
    n_all = sum(t.numel * t.copies * t.layers for t in inventory(cfg))
    n_nf4 = sum(t.numel * t.layers for t in inventory(cfg)
                if t.place == "block" and t.role == "matrix")
    base = sum(qlora_base_bytes(cfg, double_quant).values())
    events = load_events(cfg, qlora(double_quant=double_quant))
    assert kept_bytes(events) == base + 2 * (n_all - n_nf4) + (1024 if double_quant else 0)


def test_the_warm_up_counts_half_a_byte_per_quantised_element():
    """caching_allocator_warmup: torch.empty(int(count // 2), float16), count = 0.5 per
    quantised element + 2 per other (the small Llama: 32,768 + 32,768 + 5 x 64 x 2 16-bit
    elements, 2 x (2 x 4,096 + 2 x 2,048 + 3 x 10,240) quantised)."""
    tensors = load_tensors(from_name("llama3-8b").replace(**SMALL))
    other = 2 * 128 * 64 + 5 * 64
    quantised = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 160)
    assert warmup_bytes(tensors) == 2 * other + quantised // 2
    events = load_events(from_name("llama3-8b").replace(**SMALL), qlora())
    assert events[:2] == [("alloc", "warm-up", 2 * other + quantised // 2), ("free", "warm-up")]


@pytest.mark.parametrize("n,scales", [(64 * 256, 4), (64 * 256 + 1, 8), (64 * 257, 8)])
def test_a_weights_quantisation_events_by_hand(n, scales):
    """One double-quantised weight of n elements, B = ceil(n / 64) blocks: bf16 copy 2n, fp32
    absmax 4B, packed (n + 1) // 2, the NF4 code 64 (and its two temporaries), the offset 4,
    the centred absmax 4B, fp32 scales of 256 absmax each (one fp32 up to 256 blocks, two
    from 257), the uint8 absmax B, the map's copy 1,024; then the frees."""
    from gptcalc.memory.load import LoadTensor, quantize_events
    B = -(-n // 64)
    ev = quantize_events(LoadTensor("w", n, True), double_quant=True, first=False)
    assert [e[2] for e in ev if e[0] == "alloc"] == [2 * n, 4 * B, (n + 1) // 2, 64, 64, 4, 4,
                                                     4 * B, scales, B, 1024]
    assert [e[1][1] for e in ev if e[0] == "free"] == ["code abs", "code max", "absmax centred",
                                                       "absmax fp32", "16-bit"]
    plain = quantize_events(LoadTensor("w", n, True), double_quant=False, first=False)
    assert kept_bytes(plain) == (n + 1) // 2 + 4 * B + 64  # the fp32 absmax kept


def test_the_load_phase_is_qlora_on_cuda_with_transformers_under_a_whole_model_engine():
    cfg = from_name("llama3-8b")
    assert applies(cfg, qlora())
    assert applies(cfg, qlora(dp=2, zero=1, engine="zero-redundancy"))
    assert not applies(cfg, qlora(device="cpu"))
    assert not applies(cfg, qlora(impl="reference"))
    assert not applies(cfg, qlora(base_dtype="same"))
    assert not applies(cfg, qlora(dp=2, zero=3, engine="fsdp2"))
    assert load_phase(from_name("qwen3-8b"), qlora()) is None  # q_norm, k_norm: no Llama key


def test_the_largest_moment_is_the_last_mlp_matrix_being_quantised():
    """Llama 3 8B: the largest moment of the load is the last block's up_proj (14,336 x 4,096,
    the largest block matrix, loaded after down_proj and gate_proj) as double quantisation
    copies the dynamic map: its bf16 copy, fp32 absmax and the centred absmax are all alive
    beside everything loaded before it; the attention matrices after it are smaller."""
    cfg = from_name("llama3-8b")
    lp = load_phase(cfg, qlora())
    events = load_events(cfg, qlora())
    key = ("model.layers.31.mlp.up_proj.weight", "dynamic map copy")
    moment = next(i for i, e in enumerate(events) if e[:2] == ("alloc", key))
    assert lp.peak_tensor == key[0]
    assert lp.peak == simulate(events[:moment + 1]).allocated
    assert lp.allocated <= lp.peak <= lp.reserved


def test_the_step_continues_from_the_load():
    """The step's replay after the load: the load's tensors stand for the step's weights, and
    at every moment of the step the live bytes are the step's own (the ledger's totals)."""
    cfg, wl, setup = from_name("llama3-8b").replace(n_layer=4), Workload(1, 256), qlora()
    load, step = load_events(cfg, setup), step_events(cfg, wl, setup)
    joined = after_load(load, step)

    def at_marks(events):
        live, out = {}, []
        for e in events:
            if e[0] == "alloc":
                live[e[1]] = e[2]
            elif e[0] == "free":
                live.pop(e[1])
            else:
                out.append(sum(live.values()))
        return out
    assert at_marks(joined) == at_marks(step)
    assert stage_reserved(cfg, wl, setup) == simulate(joined).reserved
    assert stage_reserved(cfg, wl, setup) >= load_phase(cfg, setup).reserved
    # the same steps without a load phase start from an empty allocator
    assert stage_reserved(cfg, wl, qlora(impl="reference")) == simulate(
        step_events(cfg, wl, qlora(impl="reference"))).reserved


def test_the_verdicts_allocated_peak_is_the_larger_of_load_and_step():
    cfg, setup = from_name("llama3-8b"), qlora(lora_rank=1, recompute="full")
    small, big = Workload(1, 16), Workload(4, 4096)
    lp = load_phase(cfg, setup)
    assert step_peak(cfg, small, setup).bytes < lp.peak  # the load is the larger
    assert verdict(cfg, small, setup, 80 << 30).allocated == lp.peak
    assert verdict_floor(cfg, small, setup, 80 << 30).allocated == lp.peak
    assert step_peak(cfg, big, setup).bytes > lp.peak  # the step is the larger
    assert verdict(cfg, big, setup, 80 << 30).allocated == step_peak(cfg, big, setup).bytes


ARGS = ["memory", "--preset", "llama3.2-1b", "--lora-rank", "16", "--lora-targets", "q,v",
        "--impl", "transformers", "--seq-len", "512"]


def test_memory_prints_the_load_line_and_json_under_qlora():
    r = CliRunner().invoke(cli, ARGS + ["--weights-dtype", "nf4-dq"])
    assert r.exit_code == 0, r.output
    assert "load (from_pretrained quantising" in r.output
    out = json.loads(CliRunner().invoke(cli, ARGS + ["--weights-dtype", "nf4-dq", "--json"])
                     .output)
    setup = qlora(lora_targets=("q", "v"))
    lp = load_phase(from_name("llama3.2-1b"), setup)
    assert out["load"] == lp.as_dict()
    assert out["reserved"] >= out["load"]["reserved"]
    plain = json.loads(CliRunner().invoke(cli, ARGS + ["--json"]).output)
    assert plain["load"] is None
    assert "load (" not in CliRunner().invoke(cli, ARGS).output


# ---- the twin: from_pretrained on CPU, every allocation and free ------------------------------

def _small(preset: str, head_dim: int, heads: int, kv: int, layers: int, d_ff: int,
           vocab: int):
    return from_name(preset).replace(n_embd=head_dim * heads, n_head=heads, n_kv_head=kv,
                                     n_layer=layers, d_ff=d_ff, vocab_size=vocab,
                                     block_size=64, head_dim=None)


def _twin(cfg, double_quant: bool) -> None:
    twin = pytest.importorskip("reference_model.load_twin")
    pytest.importorskip("bitsandbytes")
    measured = twin.canonical(twin.measure_load_events(cfg, double_quant))
    model = load_events(cfg, qlora(double_quant=double_quant))
    assert model[0][1] == "warm-up"  # skipped on a CPU device map: not measured
    assert twin.canonical(model[2:]) == measured


# blocks of 64 weights and second-level blocks of 256 absmax: up_proj of E 64 x d_ff 256 is
# 256 blocks (one fp32 scale), d_ff 257 is 257 (two); E 40 x d_ff 101 = 4,040 weights is not a
# whole number of blocks (64 of them, the last partial)
@pytest.mark.slow
@pytest.mark.parametrize("preset,shape,double_quant", [
    ("llama3-8b", (16, 4, 2, 2, 256, 128), True),
    ("llama3-8b", (16, 4, 2, 2, 257, 128), True),
    ("qwen2.5-7b", (10, 4, 2, 2, 101, 96), False),
    ("llama3.2-1b", (10, 4, 1, 11, 101, 96), True),  # tied head; layer 10 sorts after 9
])
def test_the_load_events_are_transformers_and_bitsandbytes(preset, shape, double_quant):
    _twin(_small(preset, *shape), double_quant)


@pytest.mark.slow
@settings(max_examples=15)
@given(preset=st.sampled_from(["llama3-8b", "qwen2.5-7b", "llama3.2-1b"]),
       head_dim=st.sampled_from([8, 10, 16]), heads=st.sampled_from([2, 4]),
       kv=st.sampled_from([1, 2]), layers=st.integers(1, 3), d_ff=st.integers(16, 300),
       vocab=st.integers(32, 300), double_quant=st.booleans())
def test_the_load_events_over_shapes(preset, head_dim, heads, kv, layers, d_ff, vocab,
                                     double_quant):
    _twin(_small(preset, head_dim, heads, kv, layers, d_ff, vocab), double_quant)
