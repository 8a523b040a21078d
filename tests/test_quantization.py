"""A checkpoint's quantization_config: its weight bytes against the published checkpoint's
total, the quantisation libraries' own tensors built on CPU, or the engine's packing
arithmetic written out tensor by tensor; and how serve and infer read it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.hf import config_from_hf, read_hf_json
from gptcalc.inference import kv_pool
from gptcalc.inference.quant import quantization_from_hf
from gptcalc.inference.weights import weight_bytes

HERE = Path(__file__).parent / "quantized"
# Each fixture is a quantized checkpoint's config.json in the form the checkpoint below ships
# it: gpt-oss-20b's is a copy of the published file; the other five were written with the
# fields and values of their checkpoints' quantization_config, not copied from the files.
FIXTURES = {
    "qwen3-8b-fp8": "Qwen/Qwen3-8B-FP8",
    "llama-3.1-8b-w8a8": "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8",
    "llama-3.1-8b-awq-int4": "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4",
    "llama-3.1-8b-gptq-int4": "hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4",
    "llama-3.1-8b-bnb-4bit": "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit",
    "gpt-oss-20b": "openai/gpt-oss-20b",
}


def fixture(name: str) -> tuple[dict, object, object]:
    raw = read_hf_json(HERE / f"{name}.json")
    return raw, config_from_hf(raw), quantization_from_hf(raw["quantization_config"])


def total(name: str) -> int:
    _, cfg, q = fixture(name)
    return sum(weight_bytes(cfg, q).values())


def test_gpt_oss_20b_equals_the_published_checkpoint():
    # openai/gpt-oss-20b model.safetensors.index.json, metadata.total_size: the bytes of every
    # tensor of the checkpoint (MXFP4 expert blocks and scales, bf16 attention, router,
    # embeddings, biases, sinks and norms)
    assert total("gpt-oss-20b") == 13_761_264_768


# Llama-3.1-8B's block Linears, (in, out) per layer, and the parameters left in 16 bit
L, E, F, KV, V = 32, 4096, 14336, 1024, 128256
LLAMA_LINEARS = [(E, E), (E, KV), (E, KV), (E, E), (E, F), (E, F), (F, E)]
LLAMA_16BIT = 2 * V * E + (2 * L + 1) * E  # embed_tokens, lm_head, norms


def engine_tensors(shapes) -> int:
    """Bytes of a module's tensors, each (element bytes, shape)."""
    return sum(b * math.prod(s) for b, s in shapes)


def llama_bytes(per_linear) -> int:
    return L * sum(engine_tensors(per_linear(i, o)) for i, o in LLAMA_LINEARS) + 2 * LLAMA_16BIT


def test_awq_equals_vllm_awq_tensors():
    # vllm/model_executor/layers/quantization/awq.py, AWQLinearMethod.create_weights: qweight
    # int32 [in, out / 8], qzeros int32 [in / group, out / 8], scales fp16 [in / group, out]
    def awq(i, o):
        return [(4, (i, o // 8)), (4, (i // 128, o // 8)), (2, (i // 128, o))]
    assert total("llama-3.1-8b-awq-int4") == llama_bytes(awq)


def test_gptq_equals_vllm_gptq_tensors():
    # vllm/model_executor/layers/quantization/gptq.py, GPTQLinearMethod.create_weights: qweight
    # int32 [in / 8, out], g_idx int32 [in], qzeros int32 [in / group, out / 8], scales fp16
    # [in / group, out]
    def gptq(i, o):
        return [(4, (i // 8, o)), (4, (i,)), (4, (i // 128, o // 8)), (2, (i // 128, o))]
    assert total("llama-3.1-8b-gptq-int4") == llama_bytes(gptq)


def test_w8a8_equals_vllm_compressed_tensors_tensors():
    # vllm/model_executor/layers/quantization/compressed_tensors/schemes/
    # compressed_tensors_w8a8_int8.py, create_weights: weight int8 [out, in], per-channel
    # weight_scale fp32 [out, 1]; dynamic per-token activations add no input_scale
    def w8a8(i, o):
        return [(1, (o, i)), (4, (o, 1))]
    assert total("llama-3.1-8b-w8a8") == llama_bytes(w8a8)


def _fp8_model(raw: dict, dims: dict | None = None):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    fields = {k: v for k, v in {**raw, **(dims or {})}.items()
              if k not in ("quantization_config", "architectures", "torch_dtype")}
    conf = transformers.Qwen3Config(**fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    qc = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    model = replace_with_fp8_linear(model, ["lm_head"], qc, pre_quantized=True)
    return conf, sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("dims", [None, dict(hidden_size=200, intermediate_size=300,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=48,
                                             vocab_size=1000)])
def test_fp8_blocks_equal_transformers_fp8_linear(dims):
    # transformers' FP8Linear (integrations/finegrained_fp8.py) builds the checkpoint's tensors:
    # weight float8_e4m3fn [out, in], weight_scale_inv fp32 [ceil(out/128), ceil(in/128)];
    # the second case has no dimension a multiple of 128
    raw, _, q = fixture("qwen3-8b-fp8")
    conf, built = _fp8_model(raw, dims)
    cfg = config_from_hf({**raw, **(dims or {})})
    assert sum(weight_bytes(cfg, q).values()) == built


@pytest.mark.parametrize("shape", [(1024, 4096), (384, 200)])
@pytest.mark.parametrize("double_quant", [True, False])
def test_bnb_4bit_equals_bitsandbytes_quant_state(shape, double_quant):
    # bitsandbytes quantises NF4 on CPU; the tensors it saves per matrix are the packed weight
    # and QuantState.as_dict(packed=True); its JSON state (tens of bytes) is not counted
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    w = torch.randn(*shape, dtype=torch.bfloat16)
    p = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=double_quant,
                          quant_type="nf4", blocksize=64)._quantize("cpu")
    saved = p.data.numel() * p.data.element_size() + sum(
        t.numel() * t.element_size() for k, t in p.quant_state.as_dict(packed=True).items()
        if not k.startswith("quant_state."))
    q = quantization_from_hf({"quant_method": "bitsandbytes", "load_in_4bit": True,
                              "bnb_4bit_quant_type": "nf4",
                              "bnb_4bit_use_double_quant": double_quant})
    (_, scheme), = q.schemes
    assert sum(scheme.bytes(shape[1], shape[0])) == saved


def test_ignoring_every_linear_is_the_16_bit_model():
    raw, cfg, _ = fixture("llama-3.1-8b-w8a8")
    qc = dict(raw["quantization_config"], ignore=["re:.*_proj$"])
    assert sum(weight_bytes(cfg, quantization_from_hf(qc)).values()) == \
        sum(weight_bytes(cfg, "bf16").values())


def test_ignoring_one_block_keeps_that_share():
    # compressed-tensors' ignore lists name modules one by one, here layer 0's down_proj
    raw, cfg, q = fixture("llama-3.1-8b-w8a8")
    qc = dict(raw["quantization_config"], ignore=["lm_head", "model.layers.0.mlp.down_proj"])
    moved = sum(weight_bytes(cfg, quantization_from_hf(qc)).values()) - total("llama-3.1-8b-w8a8")
    assert moved == F * E * (2 - 1) - 4 * E  # one down_proj: bf16, not int8 and fp32 scales


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("name", FIXTURES)
def test_serve_reads_the_file_and_says_so(name):
    r = run("serve", "--hf-config", str(HERE / f"{name}.json"), "--gpu", "h100-sxm", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    _, cfg, q = fixture(name)
    assert f"weights {q.label} (--hf-config's quantization_config)" in out["assumptions"]
    assert out["weights"] == kv_pool(cfg, out["gpu_memory_bytes"], weights_dtype=q).weights
    assert out["weights"] < kv_pool(cfg, out["gpu_memory_bytes"]).weights


def test_weights_dtype_overrides_the_file():
    path = str(HERE / "qwen3-8b-fp8.json")
    out = json.loads(run("serve", "--hf-config", path, "--weights-dtype", "bf16", "--json").stdout)
    assert "weights bf16 (--weights-dtype, over --hf-config's fp8, 128x128 blocks)" \
        in out["assumptions"]
    assert out["weights"] == kv_pool(config_from_hf(read_hf_json(path)),
                                     out["gpu_memory_bytes"]).weights
    r = run("infer", "--hf-config", path)
    assert "weights fp8, 128x128 blocks (--hf-config's quantization_config)" in r.output


def test_unknown_quant_method_is_one_line_naming_hf_config(tmp_path):
    raw = read_hf_json(HERE / "qwen3-8b-fp8.json")
    raw["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    for args in ([], ["--weights-dtype", "bf16"]):
        r = run("serve", "--hf-config", str(path), *args)
        assert r.exit_code == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--hf-config" in lines[0] and "'hqq'" in lines[0]


@pytest.mark.parametrize("qc", [
    {"quant_method": "awq", "bits": 3}, {"quant_method": "fp8", "weight_block_size": [128]},
    {"quant_method": "bitsandbytes"}, {"quant_method": "compressed-tensors"}, [1],
])
def test_bad_quantization_config_is_refused(qc):
    with pytest.raises(ConfigError) as e:
        quantization_from_hf(qc)
    assert e.value.field == "hf_config"
