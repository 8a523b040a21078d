"""LoRA trainable parameters against PEFT's own count: get_peft_model on a transformers model of
a small config of every family, built on the meta device, with PEFT's default targets, q,v and
all (PEFT's all-linear)."""

from __future__ import annotations

import pytest

from gptcalc import ConfigError, config_from_hf
from gptcalc.hf_families import PEFT_DEFAULT_TARGETS, PEFT_MOE_CONVERSION
from gptcalc.lora import lora_params, parse_targets

from .test_architectures import hf_model
from .test_hf_transformers import CASES

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT on GPT-2's Conv1D

RANK = 8
# (gptcalc's --lora-targets, PEFT's target_modules)
TARGETS = {"default": (None, None), "q,v": ("q,v", ["q_proj", "v_proj"]),
           "all": ("all", "all-linear"), "lm_head": ("lm_head", ["lm_head"])}


def peft_trainable(raw: dict, target_modules) -> int | None:
    """PEFT's trainable parameters, or None where PEFT refuses the targets."""
    model = hf_model(raw)
    try:
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=target_modules))
    except ValueError:  # NoMatchingPeftModuleError is one: no such module, or no default
        return None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("name", CASES)
def test_trainable_equals_peft(name, targets):
    raw = CASES[name]
    ours_text, theirs_targets = TARGETS[targets]
    theirs = peft_trainable(raw, theirs_targets)
    cfg = config_from_hf(raw)
    try:
        ours = sum(lora_params(cfg, RANK, parse_targets(ours_text, cfg)).values())
    except ConfigError:
        ours = None
    if theirs is None and targets == "default":
        # PEFT has no default for the family (or, converting a v4 MoE config, loses the one
        # it has): gptcalc takes q and v, or the fused qkv module, and says so
        assert raw["model_type"] not in PEFT_DEFAULT_TARGETS or (
            raw["model_type"] in PEFT_MOE_CONVERSION)
        assert ours is not None
        return
    if ours is None and theirs is not None and targets == "q,v":
        # PEFT adapts the targets the model has (DeepSeek-V2-Lite's q_proj, no v_proj), gptcalc
        # refuses a missing one: the targets it has count what PEFT counts
        kept = [t for t in ours_text.split(",") if _parses(t, cfg)]
        assert kept and kept != ours_text.split(",")
        ours = sum(lora_params(cfg, RANK, parse_targets(",".join(kept), cfg)).values())
    if cfg.hybrid and targets == "all":
        assert ours is None  # all-linear over Mamba / DeltaNet mixers: refused, not modelled
        return
    assert ours == theirs  # None for both: q_proj/v_proj in a fused-qkv model


@pytest.mark.parametrize("name", CASES)
def test_all_and_head_equals_peft(name):
    # PEFT's all-linear never adapts the output head and takes no other names beside it: its
    # count of all-linear plus its count of the head alone (distinct modules)
    raw = CASES[name]
    theirs = [peft_trainable(raw, t) for t in ("all-linear", ["lm_head"])]
    cfg = config_from_hf(raw)
    if cfg.hybrid:  # all-linear over Mamba / DeltaNet mixers: refused, not modelled
        with pytest.raises(ConfigError, match="hybrid"):
            parse_targets("all,lm_head", cfg)
        return
    assert sum(lora_params(cfg, RANK, parse_targets("all,lm_head", cfg)).values()) == sum(
        theirs)


def test_head_by_hand():
    # qwen3-8b case: E 64, V 128, r 8: lora_A 8 x 64 and lora_B 128 x 8 (PEFT's lora.Linear)
    cfg = config_from_hf(CASES["qwen3-8b"])
    assert (cfg.n_embd, cfg.vocab_size) == (64, 128)
    assert lora_params(cfg, 8, parse_targets("lm_head", cfg)) == {"lm_head": 8 * (64 + 128)}
    with pytest.raises(ConfigError, match="e.g. all,lm_head"):
        parse_targets("head", cfg)


def _parses(target: str, cfg) -> bool:
    try:
        parse_targets(target, cfg)
    except ConfigError:
        return False
    return True


def test_issue_cases_by_hand():
    # phi3 (E 64, 4 heads x 16, 2 kv heads, F 96, 2 blocks), r=8, all: qkv_proj 64 -> 128,
    # o_proj 64 -> 64, gate_up_proj 64 -> 192, down_proj 96 -> 64, each r (in + out):
    # 8 x (192 + 128 + 256 + 160) x 2 blocks
    cfg = config_from_hf(CASES["phi-3-mini"])
    assert sum(lora_params(cfg, 8, parse_targets("all", cfg)).values()) == 8 * 736 * 2
    assert parse_targets("all", cfg) == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # the model's own names, and gptcalc's for the same modules
    assert parse_targets("qkv_proj,gate_up_proj", cfg) == parse_targets("qkv,gate_up_proj", cfg)
    with pytest.raises(ConfigError, match="one fused Linear with up .*: target gate_up_proj"):
        parse_targets("gate", cfg)
    # Mixtral (4 experts of F 96, 2 blocks), all: attention 3584 per block as Llama's, the
    # router's weight 8 x (64 + 4), experts gate_up_proj (4, 192, 64) at rank 2r per expert
    # 2 x 8 x 4 x (64 + 192) and down_proj 8 x 4 x (96 + 64)
    mix = config_from_hf(CASES["mixtral-8x7b"])
    per_block = 3584 + 8 * 68 + 2 * 8 * 4 * 256 + 8 * 4 * 160
    assert sum(lora_params(mix, 8, parse_targets("all", mix)).values()) == 2 * per_block
