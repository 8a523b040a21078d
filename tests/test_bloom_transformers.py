"""BLOOM (ALiBi, word_embeddings_layernorm) under the transformers profile, against transformers'
own BloomForCausalLM built from a BloomConfig (no download): its saved tensors
(saved_tensors_hooks, deduplicated by storage) equal to the byte, and the step peak (MemTracker)
within the tolerance of the other families; LoRA on it against PEFT's LoraModel.

Expected values are measured on the models; the profile under test never computes them.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from gptcalc import TrainingSetup, Workload, config_from_hf
from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.memory import saved_activations
from gptcalc.memory.profile_transformers import default_attention, transformers_family

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
tw = pytest.importorskip("reference_model.transformers_twin")

from .test_lora_peak import PEAK_TOLERANCE as LORA_PEAK_TOLERANCE  # noqa: E402
from .test_memory_transformers import PEAK_TOLERANCE  # noqa: E402
from .test_recipes_shipped import memory  # noqa: E402

# exact saved-tensor sets and allocator numbers of torch 2.13 (transformers 5.24)
pytestmark = [pytest.mark.requires_torch_213,
              pytest.mark.filterwarnings("ignore::UserWarning")]

# weights' dtype, autocast dtype per mode
MODES = {"fp32": (torch.float32, None), "amp": (torch.float32, torch.bfloat16),
         "bf16": (torch.bfloat16, None)}


def bloom_raw(E: int = 32, L: int = 2, H: int = 4, V: int = 128, p: float = 0.0) -> dict:
    """A BloomConfig's config.json fields; one dropout rate for both of BLOOM's."""
    return {"model_type": "bloom", "hidden_size": E, "n_layer": L, "n_head": H,
            "vocab_size": V, "hidden_dropout": p, "attention_dropout": p}


def _setup(mode: str, recompute: str = "none", **lora) -> TrainingSetup:
    return TrainingSetup(mode=mode, impl="transformers", attn_impl="manual", device="cpu",
                         recompute=recompute, **lora)


def _measured(raw: dict, mode: str, B: int, S: int, recompute: str = "none") -> int:
    dtype, amp = MODES[mode]
    model = tw.apply_recompute(tw.build(raw, dtype=dtype), recompute)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    # every storage, autocast's 16-bit weight copies included (gptcalc's weight_copy/ lines)
    return sum(t.nbytes for t in tw.measure_saved(model, idx, labels, amp_dtype=amp).tensors)


def _predicted(raw: dict, mode: str, B: int, S: int, recompute: str = "none") -> int:
    return sum(saved_activations(config_from_hf(raw), Workload(B, S),
                                 _setup(mode, recompute)).values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(list(MODES)), E=st.sampled_from([32, 64]),
       H=st.sampled_from([1, 2, 4, 8]), L=st.integers(1, 3), V=st.sampled_from([50, 128, 300]),
       B=st.integers(1, 3), S=st.integers(1, 24), p=st.sampled_from([0.0, 0.1]),
       recompute=st.sampled_from(["none", "none", "full"]))
def test_saved_bytes_exact(mode, E, H, L, V, B, S, p, recompute):
    raw = bloom_raw(E, L, H, V, p)
    assert _predicted(raw, mode, B, S, recompute) == _measured(raw, mode, B, S, recompute)


# the shapes where BLOOM's q is a view of query_key_value's whole output (b = 1, H = 1, S = 1:
# the reshape to (b * H, S, hd) folds without a copy), each mode, dropout on and off
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,S,H", [(2, 8, 4), (1, 8, 4), (2, 8, 1), (2, 1, 4), (1, 1, 1)])
def test_saved_bytes_exact_grid(mode, p, B, S, H):
    raw = bloom_raw(H=H, p=p)
    assert _predicted(raw, mode, B, S) == _measured(raw, mode, B, S)


def test_saved_lines_by_hand():
    # E 32, H 4, 2 layers, V 128, b 2 x S 8 (N 16), fp32 (bf16 weights: 2-byte activations and
    # LayerNorm statistics, fp32 softmax): what BloomForCausalLM's forward saves, per
    # modeling_bloom.py (transformers 5.24)
    cfg, wl = config_from_hf(bloom_raw()), Workload(2, 8)
    N, E, att = 16, 32, 2 * 4 * 8 * 8
    for mode, a in (("fp32", 4), ("bf16", 2)):
        lines = saved_activations(cfg, wl, _setup(mode))
        assert lines["embedding/ln_emb/input"] == N * E * a  # word_embeddings_layernorm
        assert lines["embedding/ln_emb/mean"] == N * a
        assert lines["layer/attn/q"] == 2 * N * E * a  # baddbmm's q, a copy (b, H > 1)
        assert lines["layer/attn/k_t"] == lines["layer/attn/v"] == 2 * N * E * a  # the cache's
        assert lines["layer/attn/softmax"] == 2 * att * 4  # softmax(dtype=float32)
        assert lines["layer/attn/probs"] == (0 if a == 4 else 2 * att * a)  # .to(bf16)
        assert lines["layer/mlp/hidden"] == 2 * 2 * N * 4 * E * a  # GeLU's input, its output
        assert not any(k.startswith("embedding/") and v for k, v in lines.items()
                       if not k.startswith("embedding/ln_emb/"))  # no positions, no dropout
    recomputed = saved_activations(cfg, wl, _setup("amp", "full"))
    assert recomputed["embedding/alibi"] == 2 * 4 * 8 * 4  # (b * H, 1, S), fp32 under amp
    assert recomputed["embedding/attention_mask"] == 2 * 8 * 8 * 4  # inputs_embeds' fp32
    assert recomputed["embedding/position_ids"] == 0


def test_eager_mask_under_autocast_is_fp32_in_llama_too():
    # the eager mask bound into every recomputed layer is in the embeddings' dtype: fp32 under
    # amp, as in BLOOM (transformers' Llama, eager, recompute full, bf16 autocast)
    raw = {"model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 96,
           "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 128, "max_position_embeddings": 64}
    model = tw.apply_recompute(tw.build(raw, "eager"), "full")
    idx, labels = tw.make_batch(128, 2, 16)
    measured = sum(t.nbytes for t in tw.measure_saved(model, idx, labels,
                                                      amp_dtype=torch.bfloat16).tensors)
    assert _predicted(raw, "amp", 2, 16, "full") == measured


@pytest.mark.parametrize("mode, B, S", [("fp32", 4, 64), ("fp32", 1, 32), ("bf16", 2, 32),
                                        ("amp", 2, 32)])
def test_step_peak_within_tolerance(mode, B, S, tmp_path):
    raw = bloom_raw(E=64, V=1000)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", mode, "--device", "cpu",
                                 "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["training"]["impl"] == "transformers"  # --hf-config's default profile now
    dtype, amp = MODES[mode]
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    peak = tw.measure_step_peak(tw.build(raw, dtype=dtype), idx, labels,
                                amp_dtype=amp).peak_bytes
    assert abs(out["peak"] - peak) <= PEAK_TOLERANCE * peak, (out["peak"], peak)


def test_family_defaults_and_refusals():
    cfg = config_from_hf(bloom_raw())
    assert transformers_family(cfg) == "bloom" and default_attention(cfg) == "manual"
    assert tw.build(bloom_raw()).config._attn_implementation == "eager"  # its only path
    with pytest.raises(ValueError, match="does not support"):  # should SDPA come, model it
        tw.build(bloom_raw(), "sdpa")
    with pytest.raises(ConfigError, match="no SDPA path"):
        saved_activations(cfg, Workload(1, 8), TrainingSetup(impl="transformers",
                                                             attn_impl="sdpa"))
    with pytest.raises(ConfigError, match="recompute op"):
        saved_activations(cfg, Workload(1, 8), _setup("fp32", "op"))
    # ALiBi or an embedding norm outside BLOOM's block stays refused, naming the switch
    for other in (cfg.replace(qkv_layout="separate"), cfg.replace(pos_embedding="learned")):
        with pytest.raises(ConfigError, match="ALiBi outside BLOOM|embedding norm outside"):
            transformers_family(other)
    # BLOOM fixes d_ff at 4E and biases everywhere: a GPTConfig with others is not BLOOM
    for other in (cfg.replace(d_ff=96), cfg.replace(mlp_bias=False)):
        with pytest.raises(ConfigError, match="ALiBi outside BLOOM"):
            transformers_family(other)
        with pytest.raises(ConfigError, match="d_ff 4E"):
            tw.hf_config_for(other, "bloom")


# --------------------------------------------------------------------------- LoRA (PEFT 0.21)

# BLOOM's Linears as PEFT names them (gptcalc: qkv, o, up, down); PEFT's default is
# query_key_value
TARGETS = ["query_key_value", "all", "dense", "dense_h_to_4h", "dense_4h_to_h",
           "query_key_value,dense_4h_to_h", "dense,dense_h_to_4h", "dense,dense_4h_to_h",
           "lm_head", "all,lm_head"]


def _lora_predicted(raw: dict, targets: str, B: int, S: int, tmp_path, mode: str = "fp32",
                    rank: int = 8, p: float = 0.0, recompute: str = "none") -> dict:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", mode, "--device", "cpu",
                                 "--impl", "transformers", "--lora-rank", str(rank),
                                 "--lora-targets", targets, "--lora-dropout", str(p),
                                 "--recompute", recompute, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _lora_model(raw: dict, targets: str, mode: str = "fp32", rank: int = 8, p: float = 0.0,
                recompute: str = "none"):
    """PEFT's LoraModel over BloomForCausalLM: adapters fp32 unless bf16 (PEFT's
    autocast_adapter_dtype; amp: a bf16 base under bf16 autocast, as in tests/
    test_lora_dropout.py)."""
    from gptcalc.lora import parse_targets

    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    names = "all-linear" if targets == "all" else parse_targets(targets, config_from_hf(raw))
    built = tw.apply_recompute(tw.build(raw, dtype=dtype), recompute)
    return tw.peft_lora(built, rank, names, dropout=p, fp32_adapters=mode != "bf16")


def _lora_measured(raw: dict, targets: str, B: int, S: int, mode: str, rank: int, p: float,
                   recompute: str) -> int:
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    model = _lora_model(raw, targets, mode, rank, p, recompute)
    saved = tw.measure_saved(model, idx, labels, amp_dtype=MODES[mode][1])
    return sum(t.nbytes for t in saved.tensors)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(targets=st.sampled_from(TARGETS), mode=st.sampled_from(list(MODES)),
       rank=st.sampled_from([4, 8]), p=st.sampled_from([0.0, 0.0, 0.05, 0.1]),
       E=st.sampled_from([32, 64]), H=st.sampled_from([1, 2, 4]), L=st.integers(1, 3),
       V=st.sampled_from([64, 128, 300]), B=st.integers(1, 3),
       S=st.sampled_from([1, 5, 8, 16]), recompute=st.sampled_from(["none", "none", "full"]))
def test_lora_saved_bytes_exact(targets, mode, rank, p, E, H, L, V, B, S, recompute,
                                tmp_path_factory):
    raw = bloom_raw(E, L, H, V)
    out = _lora_predicted(raw, targets, B, S, tmp_path_factory.mktemp("cfg"), mode, rank, p,
                          recompute)
    measured = _lora_measured(raw, targets, B, S, mode, rank, p, recompute)
    assert sum(out["breakdown"]["activations"].values()) == measured


# the frozen embedding LayerNorm saves nothing, unless the blocks are checkpointed: PEFT then
# makes the embeddings' output require a gradient (peft_model.py,
# prepare_model_for_gradient_checkpointing -> enable_input_require_grads), and the norm, the
# blocks' inputs and the final norm are saved even with the head alone adapted (Llama alike)
@pytest.mark.parametrize("family", ["bloom", "llama"])
@pytest.mark.parametrize("targets", ["lm_head", "dense"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_lora_frozen_embeddings_and_checkpointing(family, targets, recompute, tmp_path):
    raw = bloom_raw() if family == "bloom" else {
        "model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 96,
        "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128, "max_position_embeddings": 64}
    if family == "llama":
        targets = {"dense": "o_proj"}.get(targets, targets)
    out = _lora_predicted(raw, targets, 2, 8, tmp_path, "bf16", recompute=recompute)
    measured = _lora_measured(raw, targets, 2, 8, "bf16", 8, 0.0, recompute)
    assert sum(out["breakdown"]["activations"].values()) == measured


@pytest.mark.parametrize("targets, B, S, mode, p, recompute", [
    ("query_key_value", 4, 64, "fp32", 0.0, "none"), ("query_key_value", 1, 16, "fp32", 0.0,
                                                       "none"),
    ("all", 4, 64, "fp32", 0.0, "none"), ("all", 4, 64, "amp", 0.05, "none"),
    ("query_key_value", 4, 64, "bf16", 0.1, "none"), ("all", 4, 64, "fp32", 0.0, "full")])
def test_lora_step_peak_within_tolerance(targets, B, S, mode, p, recompute, tmp_path):
    raw = bloom_raw(E=64, V=1000)
    out = _lora_predicted(raw, targets, B, S, tmp_path, mode, 8, p, recompute)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    model = _lora_model(raw, targets, mode, 8, p, recompute)
    peak = tw.measure_step_peak(model, idx, labels, amp_dtype=MODES[mode][1]).peak_bytes
    assert abs(out["peak"] - peak) <= LORA_PEAK_TOLERANCE * peak, (out["peak"], peak)


def test_lora_on_bloom_is_modelled_under_transformers_only(tmp_path):
    # the reference profile has not measured LoRA with ALiBi and an embedding norm: refused
    (tmp_path / "config.json").write_text(json.dumps(bloom_raw()))
    base = ["memory", "--hf-config", str(tmp_path), "--lora-rank", "8"]
    assert CliRunner().invoke(cli, base + ["--impl", "transformers"]).exit_code == 0
    r = CliRunner().invoke(cli, base + ["--impl", "reference"])
    assert r.exit_code == 2 and "ALiBi" in r.stderr and "Traceback" not in r.output


# --------------------------------------------------------------------------- preset and recipes




def test_preset_is_the_published_config():
    from gptcalc import from_name
    from gptcalc.params import count_params

    from .hf_published import PUBLISHED

    published = config_from_hf(PUBLISHED["bloom-560m"])
    assert from_name("bloom-560m").replace(hf_model_type="") == published.replace(
        hf_model_type="")
    # bigscience/bloom-560m's model card: 559,214,592 parameters
    assert count_params(from_name("bloom-560m")).total == 559_214_592


def test_impl_transformers_takes_blooms_only_attention():
    # --impl transformers on the preset: BLOOM's eager attention unless --attn is typed
    typed = memory("--preset", "bloom-560m", "--impl", "transformers", "--attn", "manual",
                    "-B", "1", "--seq-len", "64")
    assert memory("--preset", "bloom-560m", "--impl", "transformers", "-B", "1",
                   "--seq-len", "64") == typed
    r = CliRunner().invoke(cli, ["memory", "--preset", "bloom-560m", "--impl", "transformers",
                                 "--attn", "sdpa"])
    assert r.exit_code == 2 and "no SDPA path" in r.stderr and "Traceback" not in r.output


def test_a_recipe_naming_bloomz_answers_as_the_preset(tmp_path):
    # PEFT's own examples fine-tune bigscience/bloomz-560m (BLOOM 560M's config.json): a TRL
    # recipe naming it answers as --preset bloom-560m under transformers' BLOOM
    from gptcalc.recipes.models import hub_preset

    assert hub_preset("bigscience/bloomz-560m") == hub_preset("bigscience/bloom-560m") == (
        "bloom-560m")
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("model_name_or_path: bigscience/bloomz-560m\nuse_peft: true\n"
                      "lora_target_modules: [query_key_value]\nlora_dropout: 0\n")
    # TRL's SFTConfig defaults (tests/test_recipes.py): max_length 1024, batch 8, bf16,
    # gradient checkpointing
    typed = ["--preset", "bloom-560m", "--impl", "transformers", "-B", "8", "--mode", "amp",
             "--recompute", "full", "--seq-len", "1024", "--no-keep-logits", "--lora-rank",
             "16", "--lora-targets", "query_key_value"]
    assert memory("--recipe", str(recipe)) == memory(*typed)
