"""LoRA adapters and QLoRA's frozen 4-bit base: parameters and bytes, as pure functions.

LoRA (Hu et al. 2021) as PEFT implements it (`peft.tuners.lora.LoraLayer`): a target
Linear(in, out) gains lora_A = Linear(in, r) and lora_B = Linear(r, out), both without bias, so
r x (in + out) trainable parameters; the base weight is frozen. PEFT's default targets for Llama
are q_proj and v_proj ("q,v"); for GPT-2's fused c_attn, the whole "qkv" module.

QLoRA (Dettmers et al. 2023) keeps the frozen base's block Linears in 4-bit NormalFloat (NF4) as
bitsandbytes stores them: 4 bits per weight, one absmax per block of 64 weights, and with double
quantisation the absmax values themselves in 8 bits with one fp32 scale per 256 of them: 8/64 +
32/(64 x 256) = 0.127 bits of constants per parameter, against 32/64 = 0.5 without (QLoRA paper,
sec. 3, "Double Quantization"). Embeddings, the lm_head, norms and biases stay 16-bit (bitsandbytes
replaces only the block Linears; transformers skips the lm_head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config import GPTConfig
from .errors import ConfigError, positive_int
from .hf_families import LINEAR_NAMES, PEFT_DEFAULT_TARGETS, PEFT_MOE_CONVERSION
from .inventory import inventory
from .layers import moe_layers
from .linears import block_linears

LORA_TARGETS = ("q", "k", "v", "qkv", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b",
                "router", "lm_head")
NF4_BLOCK = 64  # weights per absmax (bitsandbytes blocksize for 4-bit)
ABSMAX_BLOCK = 256  # double quantisation: absmax values per fp32 second-level scale
NF4_CODE_BYTES = 16 * 4  # the NF4 code table, 16 fp32 values, one per tensor
DYNAMIC_CODE_BYTES = 256 * 4  # double quantisation: the 8-bit dynamic map, 256 fp32 values
# --lora-targets' help: what `all` means is PEFT 0.21's target_modules="all-linear"
TARGETS_HELP = ("Adapted Linears: the model's own module names for --hf-config (q_proj, qkv_proj, "
                "c_attn, query_key_value, gate_up_proj, ...), else q,k,v,o,gate,up,down (qkv when "
                "fused); all = PEFT's all-linear: every Linear but the output head, with the MoE "
                "router and fused experts where PEFT adapts them; lm_head = the output head, "
                "alone or beside others (all,lm_head); default PEFT's for the family, else q,v.")


@dataclass(frozen=True)
class Adapter:
    """`count` LoRA pairs lora_A = Linear(in, m r), lora_B = Linear(m r, out), no bias, with
    m = `rank_mult`: r (in + out) m parameters each. A routed-experts adapter (PEFT's
    ParamWrapper on a fused 3-D parameter) has m = experts (x 2 for gate_up_proj, PEFT's rank
    for the two v4 Linears it fuses). `param_target`: PEFT adapts the parameter itself
    (ParamWrapper: the MoE router's weight, the fused experts), so each forward computes the
    adapted weight W + B A, `matrices` in x out matrices, which the matmul saves for its input's
    gradient; a Linear's adapter (lora.Linear) instead runs lora_A and lora_B on the input."""

    name: str  # the target name that selects it
    covers: tuple[str, ...]  # the gptcalc.linears targets of the weights it adapts (the
    # routed experts' as experts.gate, experts.up, experts.down)
    in_features: int
    out_features: int
    count: int
    rank_mult: int = 1
    param_target: bool = False
    matrices: int = 1  # in x out matrices of one adapted parameter (experts of a fused one)

    def params(self, rank: int) -> int:
        return self.count * self.rank_mult * rank * (self.in_features + self.out_features)


def adapters(cfg: GPTConfig) -> list[Adapter]:
    """Every adapter LoRA can add to `cfg`, under the names --lora-targets uses.

    Without `hf_model_type`: one per block Linear kind, by gptcalc.linears' target names (each
    routed expert's Linears its own). With it, as transformers builds that family and PEFT
    adapts it: the family's module names (hf_families.LINEAR_NAMES), one adapter per fused
    Linear (Phi-3's gate_up_proj: r (E + 2 F)), OPT's project_in/out; routed experts are fused
    3-D parameters, adapted (with the router's weight) only in the families whose v4 Linear
    experts transformers converts (hf_families.PEFT_MOE_CONVERSION), as PEFT does."""
    lin = block_linears(cfg)
    if not cfg.hf_model_type:
        return [Adapter(m.target, (m.target,), m.in_features, m.out_features, m.count)
                for m in lin] + [head_adapter(cfg)]
    family = cfg.hf_model_type
    names, moe_params = LINEAR_NAMES[family], family in PEFT_MOE_CONVERSION
    out: dict[tuple[str, str], Adapter] = {}
    for m in lin:
        module = m.name.rsplit(".", 1)[0]
        if module == "moe.experts" or (m.target == "router" and not moe_params):
            continue  # fused 3-D parameters / a router module that is not an nn.Linear
        name = names.get(m.target, m.target)  # a --set layout the family lacks: gptcalc's name
        key = (module.split(".")[0] if m.target == "router" else module, name)
        if key in out:  # one fused Linear: the same input, the outputs side by side
            a = out[key]
            out[key] = replace(a, covers=a.covers + (m.target,),
                               out_features=a.out_features + m.out_features)
        else:  # the router is a parameter in a module of its own, adapted as such
            out[key] = Adapter(name, (m.target,), m.in_features, m.out_features, m.count,
                               param_target=m.target == "router")
    result = list(out.values())
    if moe_params and cfg.moe:  # PEFT's ParamWrapper on gate_up_proj (X, 2F, E), down_proj
        X, F, E, L = cfg.n_expert, cfg.expert_dim, cfg.n_embd, moe_layers(cfg)
        result += [Adapter("experts.gate_up_proj", ("experts.gate", "experts.up"), E, 2 * F, L,
                           2 * X, True, X),
                   Adapter("experts.down_proj", ("experts.down",), F, E, L, X, True, X)]
    for t in inventory(cfg):  # OPT's project_in / project_out are Linears outside the blocks
        if t.role == "matrix" and t.name.startswith(("proj_in", "proj_out")):
            name = {"proj_in": "project_in", "proj_out": "project_out"}[t.name.split(".")[0]]
            result.append(Adapter(name, (), t.shape[1], t.shape[0], t.count))
    return result + [head_adapter(cfg)]


def head_adapter(cfg: GPTConfig) -> Adapter:
    """The output head's adapter: PEFT adapts `lm_head` when target_modules names it (its
    all-linear never does, peft.tuners.tuners_utils._maybe_include_all_linear_layers drops the
    output embedding): lora_A = Linear(E, r), lora_B = Linear(r, V), r (E + V) parameters, E the
    head's input width (OPT's word_embed_proj_dim), tied to the embedding or not."""
    return Adapter("lm_head", ("lm_head",), cfg.embd_dim, cfg.vocab_size, 1)


def all_linear(cfg: GPTConfig) -> tuple[str, ...]:
    """The targets of `all`: PEFT 0.21's all-linear (every nn.Linear but the output head; the
    router and the fused experts of PEFT_MOE_CONVERSION families, whose conversion also drops
    the dense and shared MLPs' gate_proj/up_proj/down_proj names). gptcalc's own layout: every
    block Linear but the router."""
    names = [a.name for a in adapters(cfg) if a.name != "lm_head"]
    if not cfg.hf_model_type:
        return tuple(dict.fromkeys(n for n in names if n != "router"))
    if PEFT_MOE_CONVERSION.get(cfg.hf_model_type) == "qwen2_moe":
        names = [n for n in names if n not in ("gate_proj", "up_proj", "down_proj")]
    return tuple(dict.fromkeys(names))


def default_targets(cfg: GPTConfig) -> tuple[str, ...]:
    """PEFT's defaults for the family (hf_families.PEFT_DEFAULT_TARGETS); where PEFT has none,
    or for gptcalc's own layout: q and v, or the fused qkv module (GPT-2's c_attn)."""
    names = LINEAR_NAMES.get(cfg.hf_model_type, {})
    # the family's own layout (not one --set changed, such as a fused qkv in Llama)
    own_layout = all(m.target in names for m in block_linears(cfg))
    if cfg.hf_model_type in PEFT_DEFAULT_TARGETS and own_layout:
        return PEFT_DEFAULT_TARGETS[cfg.hf_model_type]
    fused = cfg.qkv_layout == "fused"
    if not cfg.hf_model_type:
        return ("qkv",) if fused else ("q", "v")
    if fused:
        return (names.get("qkv", "qkv"),)
    q = "q_b" if cfg.mla and cfg.q_lora_rank else "q"  # MLA: the per-head up-projections
    v = "kv_b" if cfg.mla else "v"
    return (names.get(q, q), names.get(v, v))


def parse_targets(text: str | None, cfg: GPTConfig) -> tuple[str, ...]:
    """'q,k,v,o' -> ('q', 'k', 'v', 'o'); 'all' -> all_linear; None -> the defaults. A model
    read from a Hugging Face config takes its own module names (q_proj, qkv_proj, c_attn,
    query_key_value, gate_up_proj, experts.gate_up_proj, ...), and gptcalc's names for them.
    Each target must exist in this model (ConfigError("lora_targets") otherwise)."""
    if text is None:
        return default_targets(cfg)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError("lora_targets", "give at least one target, e.g. q,v")
    if "all" in (n.lower() for n in names):  # all-linear, and the others beside it (lm_head)
        if cfg.hybrid:
            raise ConfigError("lora_targets", "all-linear on a hybrid model's Mamba / Gated "
                                              "DeltaNet layers is not modelled; name the "
                                              "attention and MLP targets (e.g. q,v)")
        rest = [n for n in names if n.lower() != "all"]
        return tuple(dict.fromkeys(all_linear(cfg) + (parse_targets(",".join(rest), cfg)
                                                      if rest else ())))
    available = tuple(dict.fromkeys(a.name for a in adapters(cfg)))
    if not cfg.hf_model_type:
        names = [n.lower() for n in names]
        for t in names:
            if t not in LORA_TARGETS:
                raise ConfigError("lora_targets", f"unknown target {t!r}; give a comma-separated "
                                                  f"list of {', '.join(LORA_TARGETS)}, or all "
                                                  "(every block Linear), e.g. all,lm_head")
            if t not in available:
                why = {"gate": "only a gated MLP (mlp=swiglu) has a gate projection",
                       "qkv": "this model has separate q, k and v projections",
                       }.get(t, "this model fuses q, k and v into one qkv module")
                raise ConfigError("lora_targets", f"{t}: {why}; this model's targets: "
                                                  f"{', '.join(available)}")
        return tuple(dict.fromkeys(names))
    own = LINEAR_NAMES[cfg.hf_model_type]
    out = []
    if PEFT_MOE_CONVERSION.get(cfg.hf_model_type) == "qwen2_moe" and cfg.moe:
        names = _converted_expert_names(names)
    for t in names:
        name = t if t in available else own.get(t.lower())  # gptcalc's name for the module
        if name not in available:
            raise ConfigError("lora_targets", f"{t}: no such Linear in {cfg.hf_model_type}; "
                                              f"give a comma-separated list of "
                                              f"{', '.join(available)}, or all (every Linear "
                                              "but lm_head), e.g. all,lm_head")
        fused = next(a.covers for a in adapters(cfg) if a.name == name)
        if name != t and len(fused) > 1:
            others = ", ".join(c for c in fused if c != t.lower())
            raise ConfigError("lora_targets", f"{t} is one fused Linear with {others} in this "
                                              f"model: target {name}")
        out.append(name)
    return tuple(dict.fromkeys(out))


def _converted_expert_names(names: list[str]) -> list[str]:
    """PEFT 0.21's conversion of a v4 Qwen2-MoE-style target list: gate_proj, up_proj and
    down_proj name the routed experts' Linears, now the fused experts.gate_up_proj and
    experts.down_proj parameters (the dense and shared MLPs' Linears of those names are not
    adapted); gate_proj and up_proj only together, as PEFT requires."""
    lower = [n.lower() for n in names]
    if ("gate_proj" in lower) != ("up_proj" in lower):
        one, other = ("gate_proj", "up_proj") if "gate_proj" in lower else ("up_proj", "gate_proj")
        raise ConfigError("lora_targets", f"{one}: PEFT cannot convert it without {other}: the "
                                          "routed experts fuse them into gate_up_proj")
    rename = {"gate_proj": "experts.gate_up_proj", "up_proj": "experts.gate_up_proj",
              "down_proj": "experts.down_proj"}
    return list(dict.fromkeys(rename.get(n.lower(), n) for n in names))


def selected(cfg: GPTConfig, targets: tuple[str, ...]) -> list[Adapter]:
    """The adapters `targets` select: adapter names, or any name `parse_targets` takes (a
    set-up written by hand may say q,v of a model that names them q_proj, v_proj; a name the
    model does not have raises ConfigError("lora_targets"))."""
    found = adapters(cfg)
    wanted = set(targets)
    if not wanted <= {a.name for a in found}:
        wanted = set(parse_targets(",".join(targets), cfg))
    return [a for a in found if a.name in wanted]


def covered(cfg: GPTConfig, targets: tuple[str, ...]) -> set[str]:
    """gptcalc.linears' targets of the weights the selected adapters adapt."""
    return {c for a in selected(cfg, targets) for c in a.covers}


def lora_params(cfg: GPTConfig, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """Trainable LoRA parameters by target, over every adapter it selects (all layers):
    Adapter.params, r x (in + out) per adapted Linear (PEFT's lora_A and lora_B, no bias). The
    values sum to the trainable total."""
    positive_int("lora_rank", rank)
    out: dict[str, int] = {}
    for a in selected(cfg, targets):
        out[a.name] = out.get(a.name, 0) + a.params(rank)
    return out


def qlora_weight_bytes(n_params: int, double_quant: bool = True) -> dict[str, int]:
    """Bytes of `n_params` weights in NF4 as bitsandbytes stores them, by part:

    nf4: 4 bits per weight; absmax: one per block of 64 weights, 8 bits with double quantisation
    (fp32 without); absmax_scales: with double quantisation one fp32 per 256 absmax values.
    The weights are taken as one run of blocks (per-tensor rounding and the per-tensor fp32
    offset and 256-entry code table, a few hundred bytes per tensor, are left out)."""
    blocks = math.ceil(n_params / NF4_BLOCK)
    return {
        "nf4": math.ceil(n_params / 2),
        "absmax": blocks if double_quant else 4 * blocks,
        "absmax_scales": 4 * math.ceil(blocks / ABSMAX_BLOCK) if double_quant else 0,
    }


def nf4_tensor_bytes(n: int, double_quant: bool = True) -> dict[str, int]:
    """Bytes of one weight tensor of `n` elements in NF4 as bitsandbytes 0.50 stores it
    (bitsandbytes/functional.py, quantize_4bit; Params4bit.quant_state), by part:

    nf4: the packed uint8 weights, ceil(n / 2); absmax: one per block of 64 weights,
    ceil(n / 64) of them, fp32 without double quantisation, uint8 with it; absmax_scales: with
    double quantisation the fp32 absmax of each block of 256 absmax values (state2.absmax);
    tables: the 16-value fp32 NF4 code of the tensor's quant_state, and with double
    quantisation the 256-value fp32 dynamic map (state2.code) and the fp32 offset (the mean of
    absmax subtracted before quantising it). Each tensor has its own copies."""
    blocks = math.ceil(n / NF4_BLOCK)
    return {
        "nf4": math.ceil(n / 2),
        "absmax": blocks if double_quant else 4 * blocks,
        "absmax_scales": 4 * math.ceil(blocks / ABSMAX_BLOCK) if double_quant else 0,
        "tables": NF4_CODE_BYTES + (DYNAMIC_CODE_BYTES + 4 if double_quant else 0),
    }


def qlora_base_bytes(cfg: GPTConfig, double_quant: bool = True) -> dict[str, int]:
    """Bytes of the block Linears' weights in NF4, by part (`nf4_tensor_bytes` of each weight
    tensor, summed over every block Linear): what bitsandbytes' Linear4bit holds for a model
    quantised with bnb_4bit_quant_type="nf4". Biases, norms, embeddings and the lm_head are
    not quantised and not counted here."""
    out = dict.fromkeys(("nf4", "absmax", "absmax_scales", "tables"), 0)
    for m in block_linears(cfg):
        for k, v in nf4_tensor_bytes(m.in_features * m.out_features, double_quant).items():
            out[k] += m.count * v
    return out
