"""Hugging Face `config.json` -> `GPTConfig`, offline, without transformers.

Every field that changes a count is read; where a family hard-codes a choice instead of stating
it, or a config.json leaves a field out, gptcalc does what transformers does (its configuration
classes' defaults, `gptcalc.hf_families.DEFAULTS`, and its modelling code):

| model_type | attention | MLP | norms | other |
|---|---|---|---|---|
| gpt2 | fused c_attn, biased | GELU (`activation_function`), biased | LayerNorm | learned positions, tied |
| gpt_bigcode | fused c_attn E -> E + 2 hd under `multi_query` (default true), biased | GELU tanh, biased | LayerNorm | learned positions, tied |
| gpt_neox | fused, `attention_bias` (true) | GELU, biased | LayerNorm | partial rotary (0.25), parallel, untied |
| llama, granite | q/k/v/o, `attention_bias` (false) | SwiGLU, `mlp_bias` (false) | RMSNorm | untied (granite's multipliers change no count) |
| mistral | q/k/v/o, no bias | SwiGLU | RMSNorm | `sliding_window` (default 4096; null: none) on every block |
| mixtral | as mistral (window default none) | `num_local_experts` (8) SwiGLU experts, top `num_experts_per_tok` (2), router without bias | RMSNorm | |
| qwen2 | q/k/v biased, o not | SwiGLU | RMSNorm | window only with `use_sliding_window`, from `max_window_layers` |
| qwen3 | q/k/v/o `attention_bias` (false), RMSNorm(head_dim) on q and k | SwiGLU | RMSNorm | head_dim default 128 |
| qwen3_moe | as qwen3 | experts (128 x 768, top 8), `decoder_sparse_step`, `mlp_only_layers` | RMSNorm | |
| qwen2_moe | `qkv_bias` (true) | experts (60 x 1408, top 4) + one shared expert (5632) with a sigmoid gate | RMSNorm | |
| deepseek_v3 | MLA (`q_lora_rank` 1536 or null, `kv_lora_rank` 512, rope 64, nope 128, v 128) | `first_k_dense_replace` (3) dense blocks, then 256 routed experts of 2048 (top 8) + `n_shared_experts` (1) | RMSNorm | no multi-token-prediction layers (transformers builds none) |
| deepseek_v2 | as deepseek_v3 (`q_lora_rank` null: one q_proj, DeepSeek-V2-Lite) | as deepseek_v3 (defaults 0 dense, 64 x 1407, 2 shared), `mlp_bias` on the dense and shared MLPs; softmax router, `topk_method` greedy or group_limited_greedy (`n_group`, `topk_group`) | RMSNorm | `moe_layer_freq` must be 1 (transformers reads none) |
| gemma | q/k/v/o, head_dim 256 | GeGLU | RMSNorm | tied |
| gemma2 | as gemma | GeGLU | pre- and post-norms | `layer_types` or sliding/global alternating, window 4096 |
| gemma3_text (and gemma3's `text_config`) | + RMSNorm(head_dim) on q and k | GeGLU | pre- and post-norms | `layer_types` or 5 sliding : 1 global (`sliding_window_pattern` 6), vocabulary default 262208 |
| gpt_oss | q/k/v/o biased, one sink per head | 128 experts (top 4) with biases, biased router | RMSNorm | `layer_types` or sliding(128)/global alternating |
| phi | q/k/v/dense biased | GELU fc1/fc2, biased | one LayerNorm, parallel block | partial rotary (0.5), lm_head bias |
| phi3 | fused qkv_proj | fused gate_up_proj SwiGLU | RMSNorm | `sliding_window` (none) on every block |
| olmo2 | q/k/v/o, RMSNorm over the q and k projections | SwiGLU | post-norms only | |
| starcoder2 | q/k/v/o `use_bias` (true) | GELU tanh c_fc/c_proj, `use_bias` | LayerNorm | `sliding_window` on every block, tied |
| stablelm | q/k/v `use_qkv_bias` (false), o no bias, `qk_layernorm` per head | SwiGLU | LayerNorm; one when `use_parallel_residual` | partial rotary (0.25) |
| cohere | q/k/v/o `attention_bias` (false), `use_qk_norm` per head | SwiGLU | one bias-free LayerNorm, parallel | tied; logit_scale changes no count |
| falcon | fused query_key_value: `new_decoder_architecture` (`num_kv_heads`), `multi_query` (true: 1 kv head) | GELU 4E (`ffn_hidden_size`) | LayerNorm: one (parallel_attn), ln_attn + ln_mlp (new architecture), two (sequential) | `bias` (false) on every Linear, `alibi` (false: rotary), tied |
| opt | q/k/v/out_proj, `enable_bias` (true) | ReLU fc1/fc2 (`ffn_dim`) | LayerNorm; no final norm when `do_layer_norm_before` is false | positions max_position_embeddings + 2, `word_embed_proj_dim` project_in/out, tied |
| bloom | fused query_key_value, biased | GELU 4E, biased | LayerNorm, + word_embeddings_layernorm | ALiBi, tied |
| qwen3_next | gated q_proj (2 x H x head_dim: query and sigmoid gate), RMSNorm(head_dim) on q and k, in the `layer_types` full_attention blocks (default every `full_attention_interval` (4)th) | experts as qwen2_moe (512 x 512, top 10) with a gated shared expert | RMSNorm | the other blocks Gated DeltaNet (`linear_*` heads and conv), partial rotary (0.25) |
| jamba | q/k/v/o without bias in blocks i % `attn_layer_period` (8) == `attn_layer_offset` (4) | SwiGLU; `num_experts` (16, top 2) in the last block of each `expert_layer_period` (2) | RMSNorm | the other blocks Mamba-1 (`mamba_d_state` 16, `mamba_d_conv` 4, `mamba_expand` 2, `mamba_dt_rank` auto); no positions |
| falcon_h1 | q/k/v/o (`attention_bias`) in every block, beside a Mamba2 layer | SwiGLU (`mlp_bias`) | RMSNorm | Mamba2 of `mamba_d_ssm` (null: expand x E), `mamba_n_heads`, `mamba_n_groups`, its norm with `mamba_rms_norm` |
| granitemoehybrid | q/k/v/o (`attention_bias`) in `layer_types` attention blocks | a gated shared_mlp (`shared_intermediate_size`) in every block, + `num_local_experts` experts of intermediate_size | RMSNorm | `layer_types` mamba blocks Mamba2 (expand 2); rotary with `position_embedding_type` rope |

Spellings: newer (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
`max_position_embeddings`) and older (`n_embd`, `n_layer`, `n_head`, `n_positions`, `n_ctx`,
`max_sequence_length`) names of the same quantity are both accepted; the first present in the
order transformers itself prefers wins. A family's `attribute_map` aliases (Qwen3-MoE's
`num_experts` for `num_local_experts`, DeepSeek-V3's `num_local_experts` for `n_routed_experts`,
`hf_families.ATTRIBUTE_MAPS`) are one field: either spelling is read, and both must agree;
a config.json that the installed transformers' `save_pretrained` writes is read as it wrote it. The sizes that fix the count (width, depth, heads,
vocabulary, and the MLP width of the families that state it) are required: transformers would fill
a missing one with a default from an unrelated model, which for a calculator means a silently
wrong number, so a config.json without them is rejected as truncated. Multimodal configs are read
through their `text_config` (the language model only).

The four hybrid families (Mamba / Gated DeltaNet blocks beside attention) read into
`layer_mixers` and the `mamba_*` / `linear_*` sizes; `params` and `serve` read them, every
other command refuses them (`gptcalc.layers.hybrid_refusal`).

Errors: an unknown model_type, an unsupported value (an activation, a norm without weights) or
a field that means structure the family does not have (experts in a llama config, latent
attention in a mistral one) is a ConfigError naming it; never a silent default.

Not modelled, because they change neither a parameter nor a matmul count: rotary base and
scaling, norm epsilons, multipliers and scales, cache settings, dtypes. Soft-capping is read as
a switch only (`attn_softcap`, `logit_softcap`: its tanh saves a tensor for backward).
A `quantization_config` changes no count either: `serve` and `infer` read it for the weights'
bytes (`gptcalc.inference.quant`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

from .config import GPTConfig
from .documents import parse_document, read_text_file
from .errors import ConfigError
from .hf_families import (ATTRIBUTE_MAPS, DEFAULTS, FAMILIES, HEADS, HIDDEN, LAYERS,
                          STRUCTURE_FIELDS, TEXT_CONFIG_TYPES, VOCAB, spellings)

SUPPORTED_MODEL_TYPES = tuple(FAMILIES) + tuple(TEXT_CONFIG_TYPES)
_AS_QWEN2 = ("its language model is a Qwen2 decoder (M-RoPE changes no count): pass the same "
             "config.json with model_type \"qwen2\" (with transformers 5's text_config, its "
             "fields at the top level); the vision tower and vLLM's encoder profile run are "
             "then named as not counted")
# multimodal model types whose language model is refused, and what to pass instead
MULTIMODAL_INSTEAD = {
    "qwen2_vl": _AS_QWEN2, "qwen2_5_vl": _AS_QWEN2,
    # transformers' MllamaForConditionalGeneration: cross-attention decoder layers at
    # text_config.cross_attention_layers, among the self-attention ones
    "mllama": ("its language model interleaves cross-attention layers "
               "(text_config.cross_attention_layers), which are not modelled: pass text_config "
               "with model_type \"llama\" and num_hidden_layers less those layers to count the "
               "self-attention ones; the cross-attention layers, the vision tower and vLLM's "
               "encoder profile run are not counted"),
}
_MISSING = object()


# a Hugging Face Hub repository id, optionally pinned: org/name or org/name@revision
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<rev>[^@\s]+))?$")


def hub_id(ref: str | Path) -> tuple[str, str | None] | None:
    """(repo_id, revision) when `ref` names a Hub repository (`org/name` or `org/name@rev`) and
    no local file or directory of that name exists (a local path always wins); else None."""
    text = str(ref)
    m = HUB_ID.match(text)
    if m is None or _exists(Path(text)):
        return None
    return m["repo"], m["rev"]


def _exists(path: Path) -> bool:
    """Whether `path` exists; a name the file system refuses (a component over 255 bytes) is
    none."""
    try:
        return path.exists()
    except OSError:
        return False


def hub_config_path(repo_id: str, revision: str | None = None) -> Path:
    """The config.json of a Hub repository, through huggingface_hub's cache: downloaded when
    the Hub is reachable, read from the cache under HF_HUB_OFFLINE=1 (or without a network);
    HF_HUB_CACHE / HF_HOME and the stored or HF_TOKEN token are huggingface_hub's own.
    Each failure is one ConfigError("hf_config") line."""
    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ConfigError("hf_config", f"{where} is not a local path, and reading a Hub id "
                                       "needs huggingface_hub: pip install 'gptcalc[hf]'") from None
    # HF_HUB_OFFLINE as the environment says now (huggingface_hub reads it once, on import);
    # its retry warnings are silenced so that a failure stays one line
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub.utils import logging as hub_logging

    log = hub_logging.get_logger()  # configures the library's logger first, once
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, "config.json", revision=revision,
                                                    local_files_only=offline))
    except errors.HFValidationError as e:  # passes HUB_ID, not huggingface_hub's own rules
        detail = " ".join(str(e).split())
        raise ConfigError("hf_config", f"{where}: no such local path, nor a valid Hub id "
                                       f"({detail})") from None
    except errors.LocalEntryNotFoundError:  # offline, or the Hub unreachable, and not cached
        offline = offline or huggingface_hub.constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise ConfigError("hf_config", f"{where}: no such local path; as a Hub id: {why} and "
                                       "its config.json is not in the cache "
                                       f"({huggingface_hub.constants.HF_HUB_CACHE})") from None
    except errors.GatedRepoError:
        raise ConfigError("hf_config", f"{where} is gated: accept its licence on "
                                       f"https://huggingface.co/{repo_id} and log in (hf auth "
                                       "login, or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError("hf_config", f"{where}: no such local path, nor repository on the "
                                       "Hub (or it is private and no token with access is set)") from None
    except errors.RevisionNotFoundError:
        raise ConfigError("hf_config", f"{where}: no revision {revision!r} in {repo_id}") from None
    except errors.EntryNotFoundError:  # RemoteEntryNotFoundError, where it exists
        raise ConfigError("hf_config", f"{where} has no config.json") from None
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise ConfigError("hf_config", f"{where}: the Hub answered "
                                       f"{status or 'with an error'}") from None
    except OSError as e:  # a network error huggingface_hub did not wrap
        raise ConfigError("hf_config", f"{where}: {type(e).__name__}: {e}".splitlines()[0]) from None
    finally:
        log.setLevel(level)


def read_hf_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config.json, of the config.json inside a directory, or of a Hub
    repository's config.json (`org/name[@revision]`, see `hub_config_path`)."""
    hub = hub_id(path)
    p = hub_config_path(*hub) if hub else Path(path)
    try:
        if p.is_dir():
            p = p / "config.json"
    except OSError as e:  # a name too long for the file system
        raise ConfigError("hf_config", f"cannot read {p}: {e.strerror}") from None
    raw = parse_document(read_text_file(p, "hf_config"), True, "hf_config", p)
    if not isinstance(raw, dict):
        raise ConfigError("hf_config", f"{p} must hold a JSON object, got {type(raw).__name__}")
    return raw


class _Reader:
    """Typed access to a config.json's fields with the family's transformers defaults; every
    error names the field and the family. Records which fields it read."""

    def __init__(self, raw: Mapping[str, Any], model_type: str) -> None:
        self.raw = dict(raw)
        for alias, attr in ATTRIBUTE_MAPS.get(model_type, {}).items():  # one field, two names
            a, b = raw.get(alias), raw.get(attr)
            if a is not None and b is not None and a != b:
                raise ConfigError("hf_config", f"{model_type}: {alias} ({a!r}) and {attr} "
                                               f"({b!r}) name the same field and disagree")
            if a is not None or b is not None:
                self.raw[alias] = self.raw[attr] = b if a is None else a
        self.model_type = model_type
        self.defaults = DEFAULTS.get(model_type, {})
        self.read: set[str] = set()

    def fail(self, message: str) -> ConfigError:
        return ConfigError("hf_config", f"{self.model_type}: {message}")

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def _first(self, names: tuple[str, ...]) -> tuple[str, Any] | None:
        self.read.update(names)
        for name in names:
            if self.raw.get(name) is not None:  # JSON null = absent, as transformers reads it
                return name, self.raw[name]
        for name in names:
            if name in self.raw and name in ("sliding_window", "q_lora_rank", "head_dim"):
                return name, None  # an explicit null means "none" for these (no window, ...)
        for name in names:
            if name in self.defaults:
                return name, self.defaults[name]
        return None

    def int(self, names: tuple[str, ...], default: int | None = None, required: bool = False,
            allow_zero: bool = False) -> int | None:
        found = self._first(names)
        if found is None or found[1] is None:
            if required and found is None:
                raise self.fail(f"missing {' / '.join(names)}")
            return default if found is None else None
        name, value = found
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{name} must be an integer, got {value!r}")
        if value < 0 or (value == 0 and not allow_zero):
            raise self.fail(f"{name} must be positive, got {value}")
        return value

    def size(self, names: tuple[str, ...]) -> int:
        return self.int(names, required=True)

    def float(self, names: tuple[str, ...]) -> float:
        found = self._first(names)
        if found is None:
            rope = self.raw.get("rope_parameters") or {}  # transformers 5 keeps it there
            found = next(((n, rope[n]) for n in names if isinstance(rope, dict) and n in rope),
                         None)
        if found is None:
            return 1.0
        name, value = found
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(f"{name} must be a finite number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: Any = _MISSING) -> bool:
        self.read.add(name)
        value = self.raw.get(name)
        if value is None:
            return self.defaults[name] if default is _MISSING else default
        if not isinstance(value, bool):
            raise self.fail(f"{name} must be true or false, got {value!r}")
        return value

    def choice(self, name: str, table: dict[str, str]) -> str:
        self.read.add(name)
        value = self.raw.get(name)
        if value is None:
            value = self.defaults[name]
        if not isinstance(value, str):
            raise self.fail(f"{name} must be a name, got {value!r}")
        if value not in table:
            raise self.fail(f"{name} {value!r} is not supported; supported: {', '.join(table)}")
        return table[value]

    def dropout(self, names: tuple[str, ...], default: float) -> float:
        """GPTConfig has one dropout probability for every site: the largest the family sets
        (`default` for a site the file leaves out)."""
        values = []
        for name in names:
            value = self.raw.get(name)
            if value is None:
                values.append(default)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise self.fail(f"{name} must be a finite number, got {value!r}")
            else:
                values.append(float(value))
        return max(values)

    def layer_types(self) -> str | None:
        """`layer_types` as a G/L pattern, shortened to its period (LG, LLLLLG, ...)."""
        self.read.add("layer_types")
        types = self.raw.get("layer_types")
        if types is None:
            return None
        kinds = {"full_attention": "G", "sliding_attention": "L"}
        if not isinstance(types, list) or any(t not in kinds for t in types):
            raise self.fail(f"layer_types must list {' / '.join(kinds)}, got {types!r}")
        if len(types) != self.size(LAYERS):
            raise self.fail(f"layer_types lists {len(types)} blocks, num_hidden_layers is "
                            f"{self.size(LAYERS)}")
        text = "".join(kinds[t] for t in types)
        for period in range(1, len(text) + 1):  # reading a file's list, not a formula
            if (text[:period] * (len(text) // period + 1))[:len(text)] == text:
                return text[:period]
        return text

    def layer_list(self, name: str) -> str:
        """A list of block indices (Qwen's mlp_only_layers) as text, '1,3'."""
        self.read.add(name)
        value = self.raw.get(name) or []
        if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                              or i < 0 for i in value):
            raise self.fail(f"{name} must be a list of block indices, got {value!r}")
        return ",".join(str(i) for i in sorted(set(value)))


def _language_model(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The config and model_type of the language model: a multimodal config's `text_config`."""
    model_type = raw.get("model_type")
    if model_type in TEXT_CONFIG_TYPES:
        text = raw.get("text_config") or {}
        if not isinstance(text, dict):
            raise ConfigError("hf_config", f"{model_type}: text_config must be an object")
        inner = text.get("model_type", TEXT_CONFIG_TYPES[model_type])
        if inner != TEXT_CONFIG_TYPES[model_type]:
            raise ConfigError("hf_config", f"{model_type}: text_config model_type {inner!r} is "
                                           f"not {TEXT_CONFIG_TYPES[model_type]!r}")
        merged = dict(text)
        if "tie_word_embeddings" not in merged and "tie_word_embeddings" in raw:
            merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
        return merged, inner
    return raw, model_type


def hf_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """GPTConfig fields (all of them that change a count, and every switch) for a config.json."""
    raw, model_type = _language_model(raw)
    if model_type in MULTIMODAL_INSTEAD:
        raise ConfigError("hf_config", f"model_type {model_type!r} is not supported: "
                                       f"{MULTIMODAL_INSTEAD[model_type]}")
    if model_type not in FAMILIES:
        shown = "missing" if model_type is None else repr(model_type)
        raise ConfigError("hf_config", f"model_type {shown} is not supported; supported: "
                                       f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    r = _Reader(raw, model_type)
    fields: dict[str, Any] = dict(
        n_embd=r.size(HIDDEN), n_layer=r.size(LAYERS), n_head=r.size(HEADS),
        vocab_size=r.size(VOCAB), final_norm=True, lm_head_bias=False, ffn_mult=4,
    )
    fields.update(FAMILIES[model_type](r))
    unread = [name for name in STRUCTURE_FIELDS
              if not r.read.intersection(spellings(model_type, name))
              and r.raw.get(name) not in (None, False, 0, [])]
    if unread:
        raise r.fail(f"{unread[0]} is set but {model_type} has no such structure (is the "
                     f"model_type right?)")
    if fields.get("n_kv_head") == fields["n_head"]:
        fields["n_kv_head"] = None
    if fields.get("d_ff") == 4 * fields["n_embd"]:
        fields["d_ff"] = None  # the same model; keeps d_ff = F * E the way presets spell it
    if fields.get("block_size") is None:
        fields["block_size"] = 2048
    fields["hf_model_type"] = model_type  # its module names, for LoRA targets
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


__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "hf_fields", "hub_config_path", "hub_id",
           "read_hf_json"]
