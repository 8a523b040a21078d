"""DoRA (PEFT's LoraConfig(use_dora=True)) against transformers models wrapped by PEFT: one fp32
AdamW step on CPU of `AutoModelForCausalLM.from_config` + `peft.get_peft_model`, its trainable
parameters, gradients and optimizer states, the tensors its forward leaves saved for backward,
and its step peak (MemTracker), against `gptcalc memory --impl transformers --lora-rank R
--dora`; and the set-ups DoRA is not modelled with, refused in one line naming --dora."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import TrainingSetup, config_from_hf
from gptcalc.cli import cli
from gptcalc.lora import parse_targets

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
tw = pytest.importorskip("reference_model.transformers_twin")

pytestmark = [pytest.mark.requires_torch_213,
              pytest.mark.filterwarnings("ignore::UserWarning")]

RANK = 8
_TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 1000, "max_position_embeddings": 128}
CASES = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 160, **_TINY},
    # fused qkv_proj and gate_up_proj: one DoRA magnitude per fused Linear
    "phi3": {"model_type": "phi3", "num_hidden_layers": 2, "intermediate_size": 96,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **_TINY},
}
# targets whose first-block Linears differ in what they save (an input with or without a
# gradient: o after q/k/v, the MLP after an attention adapter, down after up or gate)
TARGETS = {"llama": ["q_proj,v_proj", "all", "o_proj", "k_proj,down_proj", "up_proj",
                     "o_proj,gate_proj"],
           "phi3": ["qkv_proj", "all", "o_proj", "gate_up_proj"]}
# Measured with torch 2.13, transformers 5.24, PEFT 0.21.2 over the 30 cells of TARGETS x
# (B, S) in (4, 64), (1, 16), (2, 48), each step after a full collection
# (transformers_twin.measure_step_peak): down to -9.58% (llama k_proj,down_proj, B 1, S 16),
# up to +1.12%. The saved tensors and the states are exact; what is not modelled is DoRA's
# forward transients: each adapted Linear makes B A by running lora_A and lora_B over an
# in x in identity, and W + s B A twice (out x in), and the step's peak still holds the last
# adapter's identity (-102,400 B there is down_proj's 160 x 160 fp32 identity). PEFT's DoRA
# also leaves reference cycles, freed when Python's cyclic collector runs: with the collector
# off the same cells measure down to -20%, and without the collection first the figure moved
# with what the process ran before (-10.9% within the whole suite). Bound: the worst with a
# margin, 12%
DORA_PEAK_TOLERANCE = 0.12


def predicted(raw: dict, targets: str, B: int, S: int, tmp_path, *extra: str) -> dict:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", "fp32", "--device", "cpu",
                                 "--impl", "transformers", "--lora-rank", str(RANK),
                                 "--lora-targets", targets, "--dora", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def dora_model(raw: dict, targets: str):
    """PEFT's DoRA (lora_alpha = r, dropout 0) on `targets`: all-linear for `all`, else the
    module names gptcalc parses."""
    names = "all-linear" if targets == "all" else parse_targets(targets, config_from_hf(raw))
    config = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=names, use_dora=True)
    return peft.get_peft_model(tw.build(raw), config)


def saved_at_forward_end(model, idx, labels) -> int:
    """Bytes of the distinct storages autograd holds for backward when the forward has
    returned (every saved tensor, less those whose graph was freed inside the forward: DoRA's
    weight norm is computed on a graph it drops), parameters and buffers excluded."""
    excluded = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=idx, labels=labels)
    gc.collect()
    seen = {}
    for ref in refs:
        if (t := ref()) is not None and t.untyped_storage()._cdata not in excluded:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    del out
    return sum(seen.values())


@pytest.mark.parametrize("name, targets", [("llama", "q_proj,v_proj"), ("llama", "all"),
                                           ("phi3", "all"), ("phi3", "o_proj")])
def test_dora_states_exact(name, targets, tmp_path):
    raw = CASES[name]
    out = predicted(raw, targets, 2, 16, tmp_path)
    model = dora_model(raw, targets)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert any(p.ndim == 1 for p in trained)  # the magnitudes
    opt = tw.make_optimizer(model)
    idx, labels = tw.make_batch(raw["vocab_size"], 2, 16)
    tw.train_step(model, opt, idx, labels)
    states = {v.untyped_storage()._cdata: v.untyped_storage().nbytes()
              for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    state = out["breakdown"]["state"]
    assert state["adapter/weights"] == sum(p.nbytes for p in trained)
    assert state["adapter/gradients"] == sum(p.grad.nbytes for p in trained)
    assert state["adapter/optimizer"] == sum(states.values())


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(list(CASES)), data=st.data(), B=st.integers(1, 4),
       S=st.sampled_from([8, 16, 48]))
def test_dora_saved_bytes_exact(name, data, B, S, tmp_path_factory):
    raw = CASES[name]
    targets = data.draw(st.sampled_from(TARGETS[name]))
    out = predicted(raw, targets, B, S, tmp_path_factory.mktemp("cfg"))
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    measured = saved_at_forward_end(dora_model(raw, targets), idx, labels)
    assert sum(out["breakdown"]["activations"].values()) == measured


@pytest.mark.parametrize("name, targets, B, S", [
    ("llama", "q_proj,v_proj", 4, 64), ("llama", "all", 1, 16),
    ("llama", "k_proj,down_proj", 1, 16), ("llama", "o_proj,gate_proj", 4, 64),
    ("phi3", "all", 1, 16), ("phi3", "gate_up_proj", 4, 64)])
def test_dora_step_peak_within_tolerance(name, targets, B, S, tmp_path):
    raw = CASES[name]
    out = predicted(raw, targets, B, S, tmp_path)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    peak = tw.measure_step_peak(dora_model(raw, targets), idx, labels).peak_bytes
    assert abs(out["peak"] - peak) <= DORA_PEAK_TOLERANCE * peak, (out["peak"], peak)


def test_dora_step_order_is_peft_parameter_order():
    # CPU AdamW's temporaries follow the trained tensors' order: lora_A, lora_B, magnitude
    from gptcalc.memory.states import consecutive_pairs, step_order_pairs

    raw = CASES["llama"]
    cfg = config_from_hf(raw)
    setup = TrainingSetup(lora_rank=RANK, lora_targets=parse_targets("all", cfg), dora=True,
                          impl="transformers")
    sizes = [p.numel() for p in dora_model(raw, "all").parameters() if p.requires_grad]
    assert step_order_pairs(cfg, setup, "first") == consecutive_pairs(sizes)


@pytest.mark.parametrize("args, names", [
    (["--preset", "debug", "--arch", "llama", "--dora"], "--lora-rank"),
    (["--hf-config", "{cfg}", "--lora-rank", "8", "--dora"], "--mode amp"),
    (["--hf-config", "{cfg}", "--lora-rank", "8", "--dora", "--mode", "fp32", "--impl",
      "reference"], "--impl reference"),
    (["--hf-config", "{cfg}", "--lora-rank", "8", "--dora", "--mode", "fp32", "--dp", "2"],
     "--dp 2"),
    (["--hf-config", "{cfg}", "--lora-rank", "8", "--dora", "--mode", "fp32",
      "--recompute", "full"], "--recompute full"),
    (["--hf-config", "{cfg}", "--lora-rank", "8", "--dora", "--mode", "fp32",
      "--lora-targets", "q_proj,lm_head"], "lm_head"),
])
def test_dora_outside_its_twin_is_refused_naming_the_option(args, names, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CASES["llama"]))
    args = [a.replace("{cfg}", str(tmp_path)) for a in args]
    r = CliRunner().invoke(cli, ["memory", "--device", "cpu", *args])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("Error: --dora: ") and names in line, line


def test_dora_outside_the_measured_families_is_refused():
    # GPT-2's Conv1D blocks: PEFT transposes their weights for the norm, not measured
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "--impl", "transformers",
                                 "--mode", "fp32", "--device", "cpu", "--lora-rank", "4",
                                 "--lora-targets", "qkv", "--dora"])
    assert r.exit_code == 2 and r.stderr.strip().startswith("Error: --dora: "), r.output
    assert "gpt2" in r.stderr


def test_dora_on_experts_is_refused(tmp_path):
    raw = {"model_type": "mixtral", "num_hidden_layers": 2, "intermediate_size": 96,
           "num_local_experts": 4, "num_experts_per_tok": 2, **_TINY}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "--mode", "fp32",
                                 "--device", "cpu", "--lora-rank", "8", "--dora"])
    assert r.exit_code == 2 and r.stderr.strip().startswith("Error: --dora: "), r.output
