"""Liger's kernels under LoRA (--liger with --lora-rank, --impl transformers) against
transformers' Llama with the stand-ins of Liger's autograd Functions patched in
(tests/test_liger.py) and wrapped by PEFT's get_peft_model.

Under a frozen base autograd records a Function only where an input needs a gradient; where
one does, Liger's Functions save what they save in full training: LigerRMSNorm its input X
and the fp32 RSTD whatever the frozen weight (LlamaRMSNorm would have saved its fp32 copy of
the input and dropped the normalized output), LigerSiLUMul the gate and up outputs whichever
of the two needs a gradient (in the first block, up or gate adapted alone keeps both), and the
RoPE the cos/sin it shares with every layer. Expected values are measured
(saved_tensors_hooks deduplicated by storage, MemTracker); the profile under test never
computes them.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from gptcalc import config_from_hf  # noqa: E402
from gptcalc.cli import cli  # noqa: E402
from gptcalc.errors import ConfigError  # noqa: E402
from gptcalc.lora import parse_targets  # noqa: E402
from gptcalc.training_setup import LIGER_KERNELS, TrainingSetup  # noqa: E402
from reference_model import transformers_twin as tw  # noqa: E402

from .test_liger import patch  # noqa: E402

pytestmark = [pytest.mark.requires_torch_213,
              pytest.mark.filterwarnings("ignore::UserWarning")]

# tests/test_lora_peak.py's PEAK_TOLERANCE (LoRA's step peak against MemTracker)
PEAK_TOLERANCE = 0.02
# weights, autocast dtype, PEFT's fp32 adapters (tests/test_lora_dropout.py)
MODES = {"fp32": (torch.float32, None, True), "amp": (torch.bfloat16, torch.bfloat16, True),
         "bf16": (torch.bfloat16, None, False)}
RAW = {"model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 160,
       "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 1000, "max_position_embeddings": 128}
# PEFT's Llama default, all-linear, and the first block's MLP adapted first (gate or up
# alone: LigerSiLUMul keeps both outputs), down alone, o first
TARGETS = ["q_proj,v_proj", "all", "up_proj", "gate_proj", "down_proj", "o_proj,gate_proj",
           "k_proj,down_proj"]


def predicted(targets, mode, recompute, kernels, rank, B, S, tmp_path, *extra) -> dict:
    (tmp_path / "config.json").write_text(json.dumps(RAW))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", mode, "--device", "cpu",
                                 "--impl", "transformers", "--lora-rank", str(rank),
                                 "--lora-targets", targets, "--recompute", recompute,
                                 "--liger", ",".join(kernels), "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def wrapped(targets, mode, recompute, kernels, rank, monkeypatch):
    dtype, _, fp32_adapters = MODES[mode]
    names = "all-linear" if targets == "all" else parse_targets(targets, config_from_hf(RAW))
    model = tw.build(RAW, dtype=dtype)
    patch(model, kernels, monkeypatch)
    return tw.peft_lora(tw.apply_recompute(model, recompute), rank, names,
                        fp32_adapters=fp32_adapters)


@settings(max_examples=14, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(targets=st.sampled_from(TARGETS), mode=st.sampled_from(list(MODES)),
       recompute=st.sampled_from(["none", "none", "full"]),
       kernels=st.sets(st.sampled_from(LIGER_KERNELS), min_size=1),
       rank=st.sampled_from([4, 8]), B=st.integers(1, 3), S=st.sampled_from([8, 16, 32]))
def test_saved_bytes_exact(targets, mode, recompute, kernels, rank, B, S, tmp_path_factory,
                           monkeypatch):
    kernels = [k for k in LIGER_KERNELS if k in kernels]
    out = predicted(targets, mode, recompute, kernels, rank, B, S,
                    tmp_path_factory.mktemp("cfg"))
    idx, labels = tw.make_batch(RAW["vocab_size"], B, S)
    saved = tw.measure_saved(wrapped(targets, mode, recompute, kernels, rank, monkeypatch),
                             idx, labels, amp_dtype=MODES[mode][1])
    assert sum(out["breakdown"]["activations"].values()) == sum(t.nbytes for t in saved.tensors)


# every target set in every mode, all three kernels, no recomputation (B = 2, S = 16)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("targets", TARGETS)
def test_saved_bytes_exact_per_target(targets, mode, tmp_path, monkeypatch):
    out = predicted(targets, mode, "none", LIGER_KERNELS, 8, 2, 16, tmp_path)
    idx, labels = tw.make_batch(RAW["vocab_size"], 2, 16)
    saved = tw.measure_saved(wrapped(targets, mode, "none", LIGER_KERNELS, 8, monkeypatch),
                             idx, labels, amp_dtype=MODES[mode][1])
    assert sum(out["breakdown"]["activations"].values()) == sum(t.nbytes for t in saved.tensors)


@pytest.mark.parametrize("targets,mode,recompute,B,S", [
    ("q_proj,v_proj", "fp32", "none", 4, 64), ("all", "bf16", "none", 4, 64),
    ("all", "amp", "full", 2, 32), ("up_proj", "fp32", "none", 1, 16)])
def test_step_peak_within_tolerance(targets, mode, recompute, B, S, tmp_path, monkeypatch):
    out = predicted(targets, mode, recompute, LIGER_KERNELS, 8, B, S, tmp_path)
    idx, labels = tw.make_batch(RAW["vocab_size"], B, S)
    model = wrapped(targets, mode, recompute, LIGER_KERNELS, 8, monkeypatch)
    peak = tw.measure_step_peak(model, idx, labels, amp_dtype=MODES[mode][1]).peak_bytes
    assert abs(out["peak"] - peak) <= PEAK_TOLERANCE * peak, (out["peak"], peak)


@pytest.mark.parametrize("targets,recompute", [("q_proj,v_proj,down_proj", "none"),
                                               ("all", "none"), ("up_proj", "none"),
                                               ("all", "full")])
def test_qlora_saved_bytes_exact(targets, recompute, tmp_path, monkeypatch):
    """QLoRA (--weights-dtype nf4-dq, amp): the block Linears as bitsandbytes' Linear4bit (NF4,
    quantised on CPU) under PEFT's 4-bit LoRA layer, as tests/test_lora_dropout.py builds it,
    with the stand-ins patched in: the kernels save what they save over a 16-bit base."""
    pytest.importorskip("bitsandbytes")
    base = tw.build(RAW, dtype=torch.bfloat16)
    patch(base, LIGER_KERNELS, monkeypatch)
    tw.quantize_block_linears(base)
    names = "all-linear" if targets == "all" else parse_targets(targets, config_from_hf(RAW))
    model = tw.peft_lora(tw.apply_recompute(base, recompute), 8, names)
    assert any(type(m).__module__ == "peft.tuners.lora.bnb" for m in model.modules())
    out = predicted(targets, "amp", recompute, LIGER_KERNELS, 8, 2, 16, tmp_path,
                    "--weights-dtype", "nf4-dq")
    idx, labels = tw.make_batch(RAW["vocab_size"], 2, 16)
    saved = tw.measure_saved(model, idx, labels, amp_dtype=torch.bfloat16)
    assert sum(out["breakdown"]["activations"].values()) == sum(t.nbytes for t in saved.tensors)


@pytest.mark.parametrize("target,plain_unsaved", [("up_proj", 2), ("gate_proj", 1)])
def test_first_block_mlp_keeps_both_outputs(target, plain_unsaved, tmp_path):
    """gate or up adapted alone (bf16, B 2, S 16: N = 32, d_ff 160, L 2), down frozen: LoRA
    alone saves 3 N x d_ff tensors a layer (silu's input and output, up's output) less what
    the first block's frozen branch leaves (2 with up adapted: gate's output and silu's; 1
    with gate: silu's output); LigerSiLUMul saves 2 a layer (gate's and up's outputs) in
    every block."""
    T, L = 32 * 160 * 2, 2
    liger = predicted(target, "bf16", "none", ("swiglu",), 8, 2, 16, tmp_path)
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", "2",
                                 "--seq-len", "16", "--mode", "bf16", "--device", "cpu",
                                 "--impl", "transformers", "--lora-rank", "8",
                                 "--lora-targets", target, "--json"])
    assert r.exit_code == 0, r.output
    plain = json.loads(r.output)["breakdown"]["activations"]
    assert plain["layer/mlp/hidden"] == (3 * L - plain_unsaved) * T
    assert liger["breakdown"]["activations"]["layer/mlp/hidden"] == 2 * L * T


@pytest.mark.parametrize("field,value,named", [
    ("dora", True, "--dora"), ("lora_dropout", 0.05, "--lora-dropout"),
    ("base_dtype", "nf4", None), ("kbit_prepare", True, "--kbit-prepare"),
    ("zero", 3, "--zero"), ("zero", 2, "--zero")])
def test_unmeasured_combinations_refused(field, value, named):
    kw = dict(impl="transformers", liger="all", lora_rank=8, lora_targets=("q", "v"))
    TrainingSetup(**kw)  # measured
    if named is None:  # QLoRA's NF4 base: measured (test_qlora_saved_bytes_exact)
        TrainingSetup(**kw, **{field: value})
        return
    if field == "kbit_prepare":
        kw["base_dtype"] = "nf4"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**kw, **{field: value})
    assert e.value.field == "liger" and named in str(e.value)


def test_refused_in_one_line_on_the_command_line():
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", "--impl", "transformers",
                                 "--liger", "all", "--lora-rank", "8", "--dora"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--liger" in lines[0] and "--dora" in lines[0], r.output


# --------------------------------------------------------------------------- recipes
# LoRA recipes with Liger's kernels, refused while --liger and --lora-rank were not measured
# together: LLaMA-Factory's enable_liger_kernel, axolotl's LigerPlugin, TRL's use_peft with
# use_liger_kernel (the Trainer's arguments), each equal to the options typed from its keys

LORA_RECIPES = [
    ("lf.yaml", "model_name_or_path: {model}\nstage: sft\nfinetuning_type: lora\n"
     "lora_rank: 8\nlora_target: all\ncutoff_len: 64\nper_device_train_batch_size: 1\n"
     "enable_liger_kernel: true\n",
     ["--lora-rank", "8", "--lora-targets", "all", "--recompute", "full", "--loss", "fused",
      "--no-keep-logits"]),
    ("axo.yml", "base_model: {model}\nsequence_len: 64\nadapter: lora\nlora_r: 8\n"
     "lora_target_linear: true\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
     "liger_rope: true\nliger_rms_norm: true\nliger_glu_activation: true\n",
     ["--lora-rank", "8", "--lora-targets", "all", "--no-keep-logits"]),
    ("trl.json", '{"model_name_or_path": "{model}", "per_device_train_batch_size": 1, '
     '"max_length": 64, "use_peft": true, "lora_r": 8, "lora_target_modules": '
     '["q_proj", "v_proj"], "use_liger_kernel": true}',
     ["--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--loss", "fused",
      "--no-keep-logits"]),
]


@pytest.mark.parametrize("name,text,typed", LORA_RECIPES, ids=[r[0] for r in LORA_RECIPES])
def test_lora_recipes_with_liger_answer(name, text, typed, tmp_path):
    from .test_liger import _recipe_run

    got, want = _recipe_run(tmp_path, name, text, "--hf-config", str(tmp_path), "--seq-len",
                            "64", "-B", "1", "--mode", "fp32", "--liger", "rms_norm,swiglu,rope",
                            *typed)
    assert got == want
    assert got["training"]["liger"] == "rms_norm,swiglu,rope"
    assert got["training"]["lora_rank"] == 8
