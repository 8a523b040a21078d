"""LoRA dropout (PEFT's LoraConfig(lora_dropout=p)) and LoRA under autocast against transformers
models wrapped by PEFT: one step on CPU of `AutoModelForCausalLM.from_config` +
`peft.get_peft_model`, its saved tensors (saved_tensors_hooks) and its step peak (MemTracker),
against `gptcalc memory --impl transformers --lora-rank R --lora-dropout P`; QLoRA's 4-bit base
(bitsandbytes' Linear4bit under PEFT's own 4-bit LoRA layer); the set-ups LoRA dropout is not
modelled with, refused in one line naming both options."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import TrainingSetup, Workload, config_from_hf
from gptcalc.cli import cli
from gptcalc.lora import parse_targets
from gptcalc.memory import saved_activations

from .test_lora_peak import CASES, EXTRA_TARGETS, PEAK_TOLERANCE, default

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
tw = pytest.importorskip("reference_model.transformers_twin")

pytestmark = [pytest.mark.requires_torch_213,
              pytest.mark.filterwarnings("ignore::UserWarning")]

DENSE = ("llama", "phi3")
MODES = {"fp32": (torch.float32, None, True), "amp": (torch.bfloat16, torch.bfloat16, True),
         "bf16": (torch.bfloat16, None, False)}  # weights, autocast dtype, fp32 adapters


def predicted(raw: dict, targets: str, B: int, S: int, tmp_path, mode: str, rank: int,
              p: float, *extra: str) -> dict:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", mode, "--device", "cpu",
                                 "--impl", "transformers", "--lora-rank", str(rank),
                                 "--lora-targets", targets, "--lora-dropout", str(p), "--json",
                                 *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def model(raw: dict, targets: str, mode: str, rank: int, p: float, recompute: str = "none"):
    """The PEFT-wrapped model of `mode`: its weights' dtype and PEFT's adapters (fp32 unless
    bf16, where they follow the model's dtype)."""
    dtype, _, fp32_adapters = MODES[mode]
    names = "all-linear" if targets == "all" else parse_targets(targets, config_from_hf(raw))
    built = tw.apply_recompute(tw.build(raw, dtype=dtype), recompute)
    return tw.peft_lora(built, rank, names, dropout=p, fp32_adapters=fp32_adapters)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(DENSE), data=st.data(), mode=st.sampled_from(list(MODES)),
       rank=st.sampled_from([4, 8]), p=st.sampled_from([0.0, 0.05, 0.1]),
       B=st.integers(1, 3), S=st.sampled_from([8, 16]),
       recompute=st.sampled_from(["none", "none", "full"]))
def test_lora_dropout_saved_bytes_exact(name, data, mode, rank, p, B, S, recompute,
                                        tmp_path_factory):
    raw = CASES[name]
    targets = data.draw(st.sampled_from([default(raw), "all"] + EXTRA_TARGETS[name]))
    out = predicted(raw, targets, B, S, tmp_path_factory.mktemp("cfg"), mode, rank, p,
                    "--recompute", recompute)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    saved = tw.measure_saved(model(raw, targets, mode, rank, p, recompute), idx, labels,
                             amp_dtype=MODES[mode][1])
    assert sum(out["breakdown"]["activations"].values()) == sum(t.nbytes for t in saved.tensors)


# without dropout under autocast: each adapter casts its input to its own 16-bit copy (PEFT's
# cast to the fp32 adapters, autocast's back) and keeps autocast's copies of its weights
@pytest.mark.parametrize("name, targets", [("llama", "q_proj,v_proj"), ("llama", "all"),
                                           ("phi3", "o_proj"), ("phi3", "all")])
def test_amp_without_dropout_saved_bytes_exact(name, targets, tmp_path):
    raw = CASES[name]
    out = predicted(raw, targets, 2, 16, tmp_path, "amp", 8, 0.0)
    idx, labels = tw.make_batch(raw["vocab_size"], 2, 16)
    saved = tw.measure_saved(model(raw, targets, "amp", 8, 0.0), idx, labels,
                             amp_dtype=torch.bfloat16)
    assert sum(out["breakdown"]["activations"].values()) == sum(t.nbytes for t in saved.tensors)


@pytest.mark.parametrize("name, targets, mode, p", [
    ("llama", "all", "fp32", 0.1), ("llama", "q_proj,v_proj", "amp", 0.05),
    ("phi3", "all", "bf16", 0.05), ("phi3", "qkv_proj", "fp32", 0.05)])
def test_lora_dropout_step_peak_within_tolerance(name, targets, mode, p, tmp_path):
    raw = CASES[name]
    out = predicted(raw, targets, 4, 64, tmp_path, mode, 8, p)
    idx, labels = tw.make_batch(raw["vocab_size"], 4, 64)
    peak = tw.measure_step_peak(model(raw, targets, mode, 8, p), idx, labels,
                                amp_dtype=MODES[mode][1]).peak_bytes
    assert abs(out["peak"] - peak) <= PEAK_TOLERANCE * peak, (out["peak"], peak)


@pytest.mark.parametrize("p", [0.0, 0.05])
def test_qlora_dropout_saved_bytes_exact(p, tmp_path):
    # the block Linears as bitsandbytes' Linear4bit (NF4, quantised on CPU) and PEFT's 4-bit
    # LoRA layer (peft.tuners.lora.bnb.Linear4bit, chosen by the model's is_loaded_in_4bit),
    # under bf16 autocast: what the adapters keep is what they keep over a 16-bit base
    pytest.importorskip("bitsandbytes")
    raw = CASES["llama"]
    base = tw.build(raw, dtype=torch.bfloat16)
    tw.quantize_block_linears(base)
    wrapped = tw.peft_lora(base, 8, ["q_proj", "v_proj", "down_proj"], dropout=p)
    assert type(wrapped.base_model.model.model.layers[0].self_attn.q_proj).__module__ == (
        "peft.tuners.lora.bnb")
    out = predicted(raw, "q_proj,v_proj,down_proj", 2, 16, tmp_path, "amp", 8, p,
                    "--weights-dtype", "nf4-dq")
    idx, labels = tw.make_batch(raw["vocab_size"], 2, 16)
    saved = tw.measure_saved(wrapped, idx, labels, amp_dtype=torch.bfloat16)
    assert sum(out["breakdown"]["activations"].values()) == sum(t.nbytes for t in saved.tensors)


def test_dropout_lines_by_hand():
    # Llama E 64 (4 heads, 2 kv heads of 16), r 8, q and v adapted, N = 2 x 16 tokens, 2 blocks:
    # each adapter keeps its dropped input (N x 64) in every block, and its mask (N x 64) where
    # its input needs a gradient (the second block only): CUDA's native_dropout a bool mask,
    # CPU's F.dropout its scaled noise in the input's dtype
    cfg, wl = config_from_hf(CASES["llama"]), Workload(2, 16)
    for device, mask in (("cuda", 1), ("cpu", 2)):
        setup = TrainingSetup(mode="bf16", impl="transformers", device=device, lora_rank=8,
                              lora_targets=("q_proj", "v_proj"), lora_dropout=0.05)
        lines = saved_activations(cfg, wl, setup)
        assert lines["lora/q_proj/lora_A_input"] == 2 * 32 * 64 * 2
        assert lines["lora/q_proj/dropout_mask"] == 1 * 32 * 64 * mask
        assert "layer/attn/qkv_input" not in lines  # nothing keeps the shared input


def test_no_dropout_keeps_the_shared_input():
    # p 0 outside autocast: the adapters' lora_A keep the Linear's own input, once per block
    cfg, wl = config_from_hf(CASES["llama"]), Workload(2, 16)
    for mode in ("fp32", "bf16"):
        setup = TrainingSetup(mode=mode, impl="transformers", lora_rank=8,
                              lora_targets=("q_proj", "v_proj"))
        lines = saved_activations(cfg, wl, setup)
        assert not [k for k in lines if k.startswith("lora/") and not k.endswith("B_input")]
        assert lines["layer/attn/qkv_input"] == 2 * 32 * 64 * setup.act_bytes


@pytest.mark.parametrize("extra, named", [
    (["--impl", "reference"], "--impl reference"),
    (["--recompute", "op"], "--recompute op"),
    (["--compile", "blocks", "--impl", "reference"], "--impl reference"),
    (["--weights-dtype", "nf4", "--bnb-version", "0.43.1"], "--bnb-version 0.43.1"),
])
def test_dropout_outside_its_twin_is_refused_naming_both(extra, named, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CASES["llama"]))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "--device", "cpu",
                                 "--impl", "transformers", "--lora-rank", "8",
                                 "--lora-dropout", "0.05", *extra])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("Error: --lora-dropout: ") and named in line


def test_dropout_on_experts_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CASES["mixtral"]))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "--mode", "fp32",
                                 "--device", "cpu", "--lora-rank", "8", "--lora-dropout", "0.1"])
    assert r.exit_code == 2 and "mixture of experts" in r.stderr, r.output
    assert r.stderr.strip().startswith("Error: --lora-dropout: ")


@pytest.mark.parametrize("value", ["1", "-0.1", "nan"])
def test_dropout_out_of_range_is_refused(value):
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", "--lora-rank", "8",
                                 "--lora-dropout", value])
    assert r.exit_code == 2 and "--lora-dropout" in r.stderr and "Traceback" not in r.output


def test_dropout_saved_and_loaded_by_config(tmp_path):
    path = tmp_path / "run.toml"
    args = ["memory", "--preset", "llama3-8b", "--impl", "transformers", "--lora-rank", "8",
            "--lora-dropout", "0.05"]
    r = CliRunner().invoke(cli, [*args, "--save-config", str(path)])
    assert r.exit_code == 0, r.output
    assert "lora_dropout = 0.05" in path.read_text()
    typed = CliRunner().invoke(cli, [*args, "--json"])
    loaded = CliRunner().invoke(cli, ["memory", "--config", str(path), "--json"])
    assert typed.exit_code == 0 and loaded.output == typed.output
