"""Hugging Face `config.json` -> `GPTConfig`, offline, without transformers.

Supported `model_type`s: gpt2, gpt_neox (Pythia), llama (Llama 1, 2, 3), mistral, qwen2. Every
field that changes a count is read; where a family hard-codes a choice instead of stating it (Qwen2's
q/k/v bias, GPT-NeoX's MLP bias) or leaves a field out (each family's transformers default), the
table below says what the modelling code does, from the transformers sources of each family:

| model_type | q/k/v, out bias | MLP bias | norm | MLP | lm_head tied by default |
|---|---|---|---|---|---|
| gpt2 | yes, yes (Conv1D) | yes | LayerNorm + bias | GELU (`activation_function`) | yes |
| gpt_neox | `attention_bias` (default true), same | yes | LayerNorm + bias | GELU (`hidden_act`) | no |
| llama | `attention_bias` (default false), same | `mlp_bias` (default false) | RMSNorm | SwiGLU | no |
| mistral | no, no (hard-coded) | no | RMSNorm | SwiGLU | no |
| qwen2 | yes, no (hard-coded) | no | RMSNorm | SwiGLU | no |

Spellings: newer (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
`max_position_embeddings`) and older (`n_embd`, `n_layer`, `n_head`, `n_positions`, `n_ctx`,
`max_sequence_length`) names of the same quantity are both accepted; the first present in the
order transformers itself prefers wins. The sizes that fix the count (width, depth, heads,
vocabulary, and the MLP width of the families that state it) are required: transformers would fill
a missing one with a default from an unrelated model, which for a calculator means a silently
wrong number, so a config.json without them is rejected as truncated.

Not modelled, because they change neither a parameter nor a matmul count: rotary base and
scaling, norm epsilons, sliding windows (FLOPs count the full S x S that dense kernels compute),
cache settings, dtypes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from .config import ConfigError, GPTConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2")

# One quantity, its spellings, in the order transformers prefers them (GPT2Config's attribute_map
# maps hidden_size -> n_embd, max_position_embeddings -> n_positions, ...).
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_head", "n_kv_heads")
_POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
# wpe is n_positions long; GPT2Config keeps n_ctx but never reads it (absent: 1024)
_GPT2_POSITIONS = ("n_positions", "max_position_embeddings")
_VOCAB = ("vocab_size", "n_vocab")
_INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim")
_ROTARY_PCT = ("rotary_pct", "partial_rotary_factor")

# Activation names of transformers' ACT2FN, mapped onto gptcalc's MLP kinds.
_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
         "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_GATED = {"silu": "swiglu", "swish": "swiglu"}  # gate_proj, up_proj, down_proj with SiLU


def read_hf_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config.json, or of the config.json inside a directory."""
    from .configfile import parse_document, read_text_file

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    raw = parse_document(read_text_file(p, "hf_config"), True, "hf_config", p)
    if not isinstance(raw, dict):
        raise ConfigError("hf_config", f"{p} must hold a JSON object, got {type(raw).__name__}")
    return raw


class _Reader:
    """Typed access to a config.json's fields; every error names the field and the file."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.model_type = raw.get("model_type")

    def _fail(self, message: str) -> ConfigError:
        return ConfigError("hf_config", f"{self.model_type}: {message}")

    def _first(self, names: tuple[str, ...]) -> tuple[str, Any] | None:
        for name in names:
            if self.raw.get(name) is not None:  # JSON null = absent, as transformers reads it
                return name, self.raw[name]
        return None

    def int(self, names: tuple[str, ...], default: int | None = None, required: bool = False
            ) -> int | None:
        found = self._first(names)
        if found is None:
            if required:
                raise self._fail(f"missing {' / '.join(names)}")
            return default
        name, value = found
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(f"{name} must be an integer, got {value!r}")
        if value <= 0:
            raise self._fail(f"{name} must be positive, got {value}")
        return value

    def float(self, names: tuple[str, ...], default: float) -> float:
        found = self._first(names)
        if found is None:
            return default
        name, value = found
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._fail(f"{name} must be a finite number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(f"{name} must be true or false, got {value!r}")
        return value

    def choice(self, name: str, default: str, table: dict[str, str]) -> str:
        value = self.raw.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, str):
            raise self._fail(f"{name} must be a name, got {value!r}")
        if value not in table:
            raise self._fail(f"{name} {value!r} is not supported; supported: {', '.join(table)}")
        return table[value]

    def dropout(self, names: tuple[str, ...], default: float) -> float:
        """GPTConfig has one dropout probability for every site: the largest the family sets."""
        return max(self.float((name,), default) for name in names)


def hf_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """GPTConfig fields (all of them that change a count, and every switch) for a config.json."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        shown = "missing" if model_type is None else repr(model_type)
        raise ConfigError("hf_config", f"model_type {shown} is not supported; supported: "
                                       f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    r = _Reader(raw)
    E = r.int(_HIDDEN, required=True)
    fields: dict[str, Any] = dict(
        n_embd=E,
        n_layer=r.int(_LAYERS, required=True),
        n_head=r.int(_HEADS, required=True),
        vocab_size=r.int(_VOCAB, required=True),
        final_norm=True,
        lm_head_bias=False,
        ffn_mult=4,
    )
    if model_type == "gpt2":
        if r.bool("add_cross_attention", False):
            raise r._fail("add_cross_attention is true: an encoder-decoder block, not a decoder-only GPT")
        fields.update(
            # GPT2Config defaults: n_positions 1024, n_inner None (= 4 * n_embd), gelu_new, 0.1
            block_size=r.int(_GPT2_POSITIONS, default=1024),
            d_ff=r.int(("n_inner",), default=None),
            mlp=r.choice("activation_function", "gelu_new", _GELU),
            dropout=r.dropout(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.1),
            qkv_layout="fused", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
            norm="layernorm", pos_embedding="learned", embd_dropout=True,
            tie_embeddings=r.bool("tie_word_embeddings", True),
        )
    elif model_type == "gpt_neox":
        attention_bias = r.bool("attention_bias", True)  # GPTNeoXConfig default; older: always
        fields.update(
            block_size=r.int(_POSITIONS, default=2048),
            d_ff=r.int(_INTERMEDIATE, required=True),
            mlp=r.choice("hidden_act", "gelu", _GELU),
            dropout=r.dropout(("hidden_dropout", "attention_dropout"), 0.0),
            rotary_pct=r.float(_ROTARY_PCT, 0.25),
            parallel_residual=r.bool("use_parallel_residual", True),
            # fused query_key_value and dense share attention_bias; the MLP is always biased
            qkv_layout="fused", qkv_bias=attention_bias, attn_out_bias=attention_bias,
            mlp_bias=True, norm="layernorm", pos_embedding="rotary",
            embd_dropout=True,  # GPTNeoXModel.emb_dropout
            tie_embeddings=r.bool("tie_word_embeddings", False),  # embed_out, no bias
        )
    else:  # llama, mistral, qwen2: q_proj, k_proj, v_proj, o_proj; gate, up, down; RMSNorm
        H = fields["n_head"]
        if model_type == "llama":
            attention_bias = r.bool("attention_bias", False)
            qkv_bias, out_bias = attention_bias, attention_bias  # o_proj uses it too
            mlp_bias = r.bool("mlp_bias", False)
        elif model_type == "qwen2":
            qkv_bias, out_bias, mlp_bias = True, False, False  # hard-coded in Qwen2Attention
        else:  # mistral: hard-coded bias=False everywhere
            qkv_bias, out_bias, mlp_bias = False, False, False
        head_dim = r.int(("head_dim",), default=None)
        fields.update(
            block_size=r.int(_POSITIONS, default=2048),
            d_ff=r.int(_INTERMEDIATE, required=True),
            n_kv_head=r.int(_KV_HEADS, default=None),  # absent: H (multi-head)
            # transformers: head_dim or hidden_size // num_attention_heads; kept None when equal
            head_dim=None if head_dim is None or head_dim * H == E else head_dim,
            mlp=r.choice("hidden_act", "silu", _GATED),
            dropout=r.dropout(("attention_dropout",), 0.0),
            qkv_layout="separate", qkv_bias=qkv_bias, attn_out_bias=out_bias, mlp_bias=mlp_bias,
            norm="rmsnorm", pos_embedding="rotary", embd_dropout=False,
            tie_embeddings=r.bool("tie_word_embeddings", False),
        )
        if fields["n_kv_head"] == H:
            fields["n_kv_head"] = None
    if fields.get("d_ff") == 4 * E:
        fields["d_ff"] = None  # the same model; keeps d_ff = F * E the way presets spell it
    if model_type != "gpt_neox":
        fields.setdefault("rotary_pct", 1.0)
        fields.setdefault("parallel_residual", False)
    return fields


def config_from_hf(path_or_dict: str | Path | Mapping[str, Any]) -> GPTConfig:
    """A `GPTConfig` from a Hugging Face config.json (a path, a directory holding one, or the
    parsed dict). Raises ConfigError(field="hf_config") naming the offending field."""
    raw = path_or_dict if isinstance(path_or_dict, Mapping) else read_hf_json(path_or_dict)
    fields = hf_fields(raw)
    try:
        return GPTConfig(**fields)
    except ConfigError as e:  # e.g. heads that do not divide the width: the file's fault
        raise ConfigError("hf_config", f"{raw.get('model_type')}: {e.message}") from None


__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "hf_fields", "read_hf_json"]
