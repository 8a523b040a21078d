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
