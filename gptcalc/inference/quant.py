"""A checkpoint's `quantization_config` (config.json) as the bytes its quantised Linears hold.

A `Quantization` is one or more `Scheme`s (how one Linear(in, out) is stored: bits per weight,
the weights each scale covers, zero points, per-module extras) and the modules it leaves in 16
bit. The bytes are those of the tensors the engine allocates for the checkpoint (vLLM's
`create_weights` of each method in vllm/model_executor/layers/quantization/, the same shapes
and dtypes the checkpoint stores):

- fp8 (fp8.py): 1-byte weights; `weight_block_size` [bo, bi]: an fp32 `weight_scale_inv` per
  ceil(out/bo) x ceil(in/bi) block, else one fp32 per matrix; a static `activation_scheme` adds
  one fp32 input scale.
- compressed-tensors (compressed_tensors/schemes/): `num_bits` per weight (4-bit packed into
  int32); scales by `strategy` (tensor: 1, channel: out, group: out x ceil(in/`group_size`),
  block: by `block_structure`), fp32 for 8-bit weights, 16-bit for packed ones (then also an
  int64 shape [2]); asymmetric: int32-packed zero points per scale; static input activations:
  one fp32 input scale. NVFP4 (float, 4 bits): an fp8 scale per group and an fp32 global one.
- awq (awq.py): `bits` packed into int32, fp16 scales per ceil(in/`group_size`) x out, with
  `zero_point` int32-packed zeros per scale.
- gptq (gptq.py): as awq, zeros stored also when `sym`, and an int32 `g_idx` per input
  (`group_size` -1: one group per row).
- bitsandbytes: `load_in_4bit` 4 bits, one absmax per 64 weights of the flattened matrix,
  uint8 under `bnb_4bit_use_double_quant` (then an fp32 per 256 of them and a 256-entry fp32
  code) else fp32, and a 16-entry fp32 code; `load_in_8bit` int8 and an fp32 SCB per row.
- mxfp4 (mxfp4.py): the MoE experts only, 4-bit E2M1 with a uint8 E8M0 exponent per 32
  input weights.

Left in 16 bit by every method: embeddings, the lm_head, norms, biases and the MoE router (vLLM
builds routers unquantised: models/mixtral.py, deepseek_v2.py, gpt_oss.py), and the modules
the file lists (`ignore`, `modules_to_not_convert`, `ignored_layers`, `llm_int8_skip_modules`):
a pattern names a module as Hugging Face does (`model.layers.0.self_attn.q_proj`), `re:` a
regular expression (compressed-tensors), `*` a glob (gpt-oss), else a run of its dotted parts
(`self_attn`, `mlp.gate`). A list naming some layers only keeps that share of the kind.

Scope: the checkpoint's tensors; an engine's repacking (Marlin, padding for its kernels) and
its kernels' workspaces are not counted; the JSON state bitsandbytes stores per tensor (tens
of bytes) is left out.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

from ..config import GPTConfig
from ..errors import ConfigError
from ..linears import Linear

METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "bitsandbytes", "mxfp4")
FP32, FP16, INT32, INT64 = 4, 2, 4, 8
BNB_BLOCK, BNB_NESTED_BLOCK = 64, 256  # bitsandbytes' 4-bit blocksize; absmax per nested block
BNB_CODE, BNB_NESTED_CODE = 16, 256  # fp32 entries of its NF4/FP4 code and nested code tables
MX_BLOCK = 32  # OCP microscaling: one E8M0 exponent per 32 elements


@dataclass(frozen=True)
class Scheme:
    """How one Linear(in, out) is stored. A scale covers `block` = (rows, cols) of the weight
    (0: the whole dimension); `flat` instead: one per `flat` weights of the flattened matrix."""

    bits: Fraction  # per weight
    block: tuple[int, int] = (0, 0)
    scale_bytes: int = FP32
    zero_bits: int = 0  # per scale, packed into int32 along the output dimension
    flat: int = 0
    nested: bool = False  # bitsandbytes' double quantisation of the absmax
    per_module: int = 0  # bytes each module adds (input scale, shape, code tables)
    per_input: int = 0  # bytes per input feature (GPTQ's g_idx)

    def bytes(self, in_features: int, out_features: int) -> tuple[int, int]:
        """(weight bytes, scale and other bytes) of one module."""
        n = in_features * out_features
        weight = math.ceil(n * self.bits / 8)
        if self.flat:
            groups = math.ceil(n / self.flat)
            extra = 4 * math.ceil(groups / BNB_NESTED_BLOCK) if self.nested else 0
            return weight, groups * self.scale_bytes + extra + self.per_module
        rows = math.ceil(out_features / (self.block[0] or out_features))
        cols = math.ceil(in_features / (self.block[1] or in_features))
        zeros = cols * math.ceil(rows * self.zero_bits / 32) * INT32 if self.zero_bits else 0
        return weight, (rows * cols * self.scale_bytes + zeros + self.per_module
                        + self.per_input * in_features)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantisation: the schemes by target (the first whose patterns name a
    module applies; "Linear" names every one), and what it leaves in 16 bit."""

    method: str
    label: str  # what the first line shows, e.g. "fp8, 128x128 blocks"
    schemes: tuple[tuple[tuple[str, ...], Scheme], ...]
    keep: tuple[str, ...] = ()
    experts_only: bool = False

    @property
    def bits(self) -> Fraction:
        """Bits per weight of the widest scheme, scales aside (for comparing with dtypes)."""
        return max(s.bits for _, s in self.schemes)


# gptcalc.linears' targets -> the module's name in a Hugging Face (Llama-style) checkpoint
_HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "qkv": "qkv_proj",
             "q_a": "q_a_proj", "q_b": "q_b_proj", "kv_a": "kv_a_proj_with_mqa",
             "kv_b": "kv_b_proj", "up": "up_proj", "gate": "gate_proj", "down": "down_proj"}


def hf_module_name(m: Linear, layer: int = 0) -> str:
    """The Hugging Face name of one module of `m`'s kind in block `layer`
    (model.layers.0.self_attn.q_proj, model.layers.0.mlp.experts.0.up_proj, ...)."""
    base = f"model.layers.{layer}"
    if m.target == "router":
        return f"{base}.mlp.gate"
    leaf = _HF_NAMES.get(m.target, m.target)
    if m.name.startswith("attn."):
        return f"{base}.self_attn.{leaf}"
    if ".experts." in m.name:
        return f"{base}.mlp.experts.0.{leaf}"
    if ".shared." in m.name:
        return f"{base}.mlp.shared_experts.{leaf}"
    return f"{base}.mlp.{leaf}"


def names(pattern: str, module: str) -> bool:
    """Whether an ignore-list pattern names `module` (see the module docstring)."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if "*" in pattern:
        return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
    want, parts = pattern.split("."), module.split(".")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def kept_share(q: Quantization, m: Linear, n_layer: int) -> Fraction:
    """The share of `m`'s modules left in 16 bit: the router always; with experts_only every
    non-expert; else the share of blocks whose module the keep list names."""
    if m.target == "router" or (q.experts_only and ".experts." not in m.name):
        return Fraction(1)
    if not q.keep:
        return Fraction(0)
    hits = sum(any(names(p, hf_module_name(m, i)) for p in q.keep) for i in range(n_layer))
    return Fraction(hits, n_layer)


def scheme_for(q: Quantization, m: Linear) -> Scheme | None:
    """The scheme that stores `m` (None: none of the file's targets names it, 16 bit)."""
    name = hf_module_name(m)
    return next((s for targets, s in q.schemes if any(names(t, name) for t in targets)), None)


def quantized_linear_bytes(q: Quantization, cfg: GPTConfig, m: Linear) -> tuple[int, int, int]:
    """(quantised weight bytes, scale bytes, weights left in 16 bit) of the `m.count` modules of
    one kind: the kept share's weights in 16 bit, the rest by its scheme's `Scheme.bytes`."""
    scheme = scheme_for(q, m)
    kept = m.count if scheme is None else round(m.count * kept_share(q, m, cfg.n_layer))
    if scheme is None or kept == m.count:
        return 0, 0, m.weights
    weight, scales = scheme.bytes(m.in_features, m.out_features)
    n = m.count - kept
    return n * weight, n * scales, kept * m.in_features * m.out_features


def _fail(message: str) -> ConfigError:
    return ConfigError("hf_config", f"quantization_config: {message}")


def _int(qc: Mapping[str, Any], key: str, default: Any = None, allowed: tuple = ()) -> Any:
    value = qc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (allowed and value not in allowed):
        want = f"one of {', '.join(map(str, allowed))}" if allowed else "an integer"
        raise _fail(f"{key} must be {want}, got {value!r}")
    return value


def _patterns(qc: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        value = qc.get(key) or []
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise _fail(f"{key} must be a list of module names, got {value!r}")
        out += value
    return tuple(out)


def _fp8(qc: Mapping[str, Any]) -> Quantization:
    """vLLM's Fp8Config (fp8.py): 1-byte weights, fp32 block scales `weight_scale_inv` of
    `weight_block_size` or one per matrix; a static activation scheme adds an input scale."""
    static = qc.get("activation_scheme", "dynamic") == "static"
    block = qc.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2
                              or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _fail(f"weight_block_size must be two positive integers, got {block!r}")
    scheme = Scheme(Fraction(8), tuple(block) if block else (0, 0), FP32,
                    per_module=FP32 if static else 0)
    label = f"fp8, {block[0]}x{block[1]} blocks" if block else "fp8 per tensor"
    return Quantization("fp8", label, ((("Linear",), scheme),),
                        _patterns(qc, "ignored_layers", "modules_to_not_convert"))


def _ct_scheme(group: Mapping[str, Any], fmt: str) -> Scheme:
    """One compressed-tensors config group's weights (compressed_tensors/schemes/: W8A8Int8,
    W8A8Fp8 with fp32 scales; WNA16 int4/int8 packed into int32 with 16-bit scales)."""
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise _fail("a config group has no weights")
    bits = _int(w, "num_bits", allowed=(4, 8))
    kind = w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    if strategy == "group" or strategy == "tensor_group":
        block = (1, _int(w, "group_size"))
    elif strategy == "channel":
        block = (1, 0)
    elif strategy == "block":
        bs = w.get("block_structure")
        if not isinstance(bs, list) or len(bs) != 2:
            raise _fail(f"block strategy needs block_structure [rows, cols], got {bs!r}")
        block = (int(bs[0]), int(bs[1]))
    elif strategy == "tensor":
        block = (0, 0)
    else:
        raise _fail(f"weights strategy {strategy!r} is not supported")
    packed = fmt.startswith("pack") or bits == 4
    static_input = isinstance(group.get("input_activations"), Mapping) and \
        group["input_activations"].get("dynamic") is False
    zero = 0 if w.get("symmetric", True) else bits
    if kind == "float" and bits == 4:  # NVFP4: fp8 scale per group and an fp32 global scale
        return Scheme(Fraction(4), block, 1, per_module=FP32 * (2 if static_input else 1))
    return Scheme(Fraction(bits), block, FP16 if packed else FP32, zero_bits=zero,
                  per_module=(INT64 * 2 if packed else 0) + (FP32 if static_input else 0))


def _compressed_tensors(qc: Mapping[str, Any]) -> Quantization:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _fail("compressed-tensors needs config_groups")
    fmt = str(qc.get("format", ""))
    schemes = []
    for name, g in groups.items():
        if not isinstance(g, Mapping) or not isinstance(g.get("targets"), list):
            raise _fail(f"config group {name!r} needs a targets list")
        schemes.append((tuple(g["targets"]), _ct_scheme(g, str(g.get("format") or fmt))))
    labels = sorted({f"{'w' + str(s.bits)}" for _, s in schemes})
    return Quantization("compressed-tensors", f"compressed-tensors {fmt or 'quantized'} "
                        f"({', '.join(labels)})", tuple(schemes), _patterns(qc, "ignore"))


def _group(qc: Mapping[str, Any]) -> int:
    g = _int(qc, "group_size", 128)
    if g != -1 and g <= 0:
        raise _fail(f"group_size must be positive or -1, got {g}")
    return 0 if g == -1 else g


def _awq(qc: Mapping[str, Any]) -> Quantization:
    """vLLM's AWQ (awq.py): qweight int32 [in, out x bits/32], scales fp16 [in/g, out], with
    `zero_point` qzeros int32 [in/g, out x bits/32]."""
    bits, g = _int(qc, "bits", 4, (4,)), _group(qc)
    zero = bits if qc.get("zero_point", True) else 0
    scheme = Scheme(Fraction(bits), (1, g), FP16, zero_bits=zero)
    return Quantization("awq", f"awq int{bits}, groups of {g or 'a row'}",
                        ((("Linear",), scheme),), _patterns(qc, "modules_to_not_convert"))


def _gptq(qc: Mapping[str, Any]) -> Quantization:
    """vLLM's GPTQ (gptq.py): qweight int32 [in x bits/32, out], g_idx int32 [in], qzeros int32
    [in/g, out x bits/32] (stored also when symmetric), scales fp16 [in/g, out]."""
    bits, g = _int(qc, "bits", 4, (2, 3, 4, 8)), _group(qc)
    scheme = Scheme(Fraction(bits), (1, g), FP16, zero_bits=bits, per_input=INT32)
    return Quantization("gptq", f"gptq int{bits}, groups of {g or 'a row'}",
                        ((("Linear",), scheme),), _patterns(qc, "modules_to_not_convert"))


def _bitsandbytes(qc: Mapping[str, Any]) -> Quantization:
    """bitsandbytes' Params4bit (nf4/fp4: packed uint8, absmax per 64 flattened weights, nested
    under double quantisation; `QuantState.as_dict(packed=True)`) or Int8Params (int8 and an
    fp32 SCB per output row)."""
    keep = _patterns(qc, "llm_int8_skip_modules")
    if qc.get("load_in_4bit"):
        dq = bool(qc.get("bnb_4bit_use_double_quant", False))
        code = FP32 * (BNB_CODE + (BNB_NESTED_CODE if dq else 0))
        scheme = Scheme(Fraction(4), scale_bytes=1 if dq else FP32, flat=BNB_BLOCK,
                        nested=dq, per_module=code)
        kind = qc.get("bnb_4bit_quant_type", "fp4")
        return Quantization("bitsandbytes", f"bitsandbytes {kind}"
                            f"{', double quantisation' if dq else ''}",
                            ((("Linear",), scheme),), keep)
    if qc.get("load_in_8bit"):
        return Quantization("bitsandbytes", "bitsandbytes int8",
                            ((("Linear",), Scheme(Fraction(8), (1, 0), FP32)),), keep)
    raise _fail("bitsandbytes needs load_in_4bit or load_in_8bit")


def _mxfp4(qc: Mapping[str, Any]) -> Quantization:
    """vLLM's Mxfp4Config (mxfp4.py): the MoE experts' weights as E2M1 (4 bits) with a uint8
    E8M0 exponent per 32 input weights (`*_blocks`, `*_scales`); other Linears unquantised."""
    scheme = Scheme(Fraction(4), (1, MX_BLOCK), 1)
    return Quantization("mxfp4", "mxfp4 experts", ((("Linear",), scheme),),
                        _patterns(qc, "modules_to_not_convert"), experts_only=True)


_READERS = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "awq": _awq,
            "gptq": _gptq, "bitsandbytes": _bitsandbytes, "mxfp4": _mxfp4}


def quantization_from_hf(qc: Any) -> Quantization | None:
    """A config.json's `quantization_config` (None when it has none); an unknown quant_method
    or a bad field is a ConfigError naming --hf-config."""
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise _fail(f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in _READERS:
        raise _fail(f"quant_method {method!r} is not supported; supported: {', '.join(METHODS)}")
    return _READERS[method](qc)
