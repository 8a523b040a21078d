"""QLoRA's frozen base against bitsandbytes itself: NF4 weights quantised on CPU
(`Params4bit._quantize("cpu")`, bitsandbytes 0.50) with and without double quantisation, the
bytes of the packed weight and of every tensor of its quant_state, against
`gptcalc.lora.nf4_tensor_bytes` and `qlora_base_bytes`."""

from __future__ import annotations

import pytest

from gptcalc import config_from_hf
from gptcalc.lora import nf4_tensor_bytes, qlora_base_bytes

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def measured(weight, double_quant: bool) -> dict[str, int]:
    """bitsandbytes' bytes of one NF4 weight, by the parts gptcalc names."""
    p = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                          compress_statistics=double_quant)._quantize("cpu")
    qs = p.quant_state
    out = {"nf4": p.nbytes, "absmax": qs.absmax.nbytes, "absmax_scales": 0,
           "tables": qs.code.nbytes}
    if qs.nested:
        out["absmax_scales"] = qs.state2.absmax.nbytes
        out["tables"] += qs.state2.code.nbytes + qs.offset.nbytes
    return out


# elements on both sides of a 64-weight block, of a 256-absmax second-level block (64 x 256 =
# 16,384 weights), odd counts (the packed bytes round up), and a Llama-7B MLP matrix
SHAPES = [(1, 63), (1, 64), (1, 65), (3, 21), (128, 128), (1, 16_383), (1, 16_384),
          (1, 16_385), (257, 64), (255, 64), (3, 16_377), (11_008, 4096)]


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_tensor_equals_bitsandbytes(shape, double_quant):
    w = torch.randn(*shape, dtype=torch.bfloat16)
    n = shape[0] * shape[1]
    assert nf4_tensor_bytes(n, double_quant) == measured(w, double_quant)


def test_by_hand():
    # bitsandbytes quantize_4bit: 16,385 weights are 257 blocks of 64, 8,193 packed bytes;
    # fp32 absmax 4 x 257 without double quantisation; with it uint8 absmax 257, two fp32
    # second-level scales (257 > 256), the 256-entry fp32 dynamic map and the fp32 offset
    assert nf4_tensor_bytes(16_385, False) == {"nf4": 8193, "absmax": 1028,
                                               "absmax_scales": 0, "tables": 64}
    assert nf4_tensor_bytes(16_385, True) == {"nf4": 8193, "absmax": 257, "absmax_scales": 8,
                                              "tables": 64 + 1024 + 4}


@pytest.mark.parametrize("double_quant", [False, True])
def test_model_base_equals_bitsandbytes(double_quant):
    # every block Linear of a small transformers Llama quantised as transformers' bitsandbytes
    # integration does (all nn.Linear but lm_head)
    transformers = pytest.importorskip("transformers")
    raw = {"model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 160,
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1000, "max_position_embeddings": 128}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**raw), dtype=torch.bfloat16)
    total = dict.fromkeys(("nf4", "absmax", "absmax_scales", "tables"), 0)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            for k, v in measured(m.weight.data, double_quant).items():
                total[k] += v
    assert qlora_base_bytes(config_from_hf(raw), double_quant) == total


def test_today_matmul4bit_keeps_no_input():
    # bitsandbytes >= 0.43.2: the 4-bit matmul's input, already in the compute dtype (so the
    # tensor itself, no cast copy), is freed once the caller drops it, though it needs a gradient
    import gc
    import weakref

    from gptcalc.training_setup import TrainingSetup, matmul4bit_keeps_input

    lin = bnb.nn.Linear4bit(64, 96, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(torch.randn(96, 64, dtype=torch.bfloat16),
                                   requires_grad=False, quant_type="nf4")._quantize("cpu")
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    h = x * 2  # needs a gradient, its own storage
    out = lin(h)
    assert out.requires_grad
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None
    setup = TrainingSetup(mode="amp", lora_rank=8, lora_targets=("q",), base_dtype="nf4")
    assert not matmul4bit_keeps_input(setup)  # the default release is today's


def test_old_matmul4bit_inputs_by_hand(tmp_path):
    # bitsandbytes 0.43.1, autograd/_functions.py MatMul4Bit.forward: ctx.tensors = (A, B)
    # when A needs a gradient; nn/modules.py Linear4bit.forward: A = x.to(compute_dtype).
    # Llama, E 64, 4 heads x 16, d_ff 160, 2 blocks, B 2 x 16 tokens = N 32, bf16 (2 B), LoRA
    # on q_proj,v_proj: the first block's q, k, v read a frozen input (no gradient); its o, up,
    # gate, down and every Linear of the second block keep their input:
    # q, k, v 1 x 32 x 64 x 2; o, up, gate 2 x 32 x 64 x 2; down 2 x 32 x 160 x 2
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli

    raw = {"model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 160,
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1000, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(raw))

    def run(*extra):
        r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", "2",
                                     "--seq-len", "16", "--mode", "amp", "--device", "cpu",
                                     "--impl", "transformers", "--lora-rank", "8",
                                     "--lora-targets", "q_proj,v_proj", "--weights-dtype",
                                     "nf4-dq", *extra])
        assert r.exit_code == 0, r.output
        return r.output

    old = json.loads(run("--bnb-version", "0.43.1", "--json"))["breakdown"]["activations"]
    new = json.loads(run("--bnb-version", "0.43.2", "--json"))["breakdown"]["activations"]
    kept = {k: v for k, v in old.items() if k not in new}
    assert kept == {"qlora/q/matmul4bit_input": 4096, "qlora/k/matmul4bit_input": 4096,
                    "qlora/v/matmul4bit_input": 4096, "qlora/o/matmul4bit_input": 8192,
                    "qlora/up/matmul4bit_input": 8192, "qlora/gate/matmul4bit_input": 8192,
                    "qlora/down/matmul4bit_input": 20480}
    assert {k: old[k] for k in new} == new
    assert "bitsandbytes 0.43.1: keeps each 4-bit Linear's input" in run(
        "--bnb-version", "0.43.1").splitlines()[0]
    assert "bitsandbytes 0.50.0" in run().splitlines()[0]
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "--lora-rank", "8",
                                 "--mode", "amp", "--weights-dtype", "nf4",
                                 "--bnb-version", "new"])
    assert r.exit_code == 2 and "such as 0.43.1" in r.output
