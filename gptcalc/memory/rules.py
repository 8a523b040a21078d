"""The rules a training set-up must obey before its memory is counted: parallel sizes that
divide what they shard, the engine and context parallel's own checks, and the combinations
whose memory is modelled (LoRA's measured blocks, muon's layouts, expert parallel)."""

from __future__ import annotations

from ..config import GPTConfig
from ..errors import ConfigError
from ..families import modern_switches
from ..schedules import check_pipeline
from ..training_setup import TrainingSetup, matmul4bit_keeps_input
from ..workload import Workload, validate_workload
from .finetune import ATTENTION_TARGETS, check_kbit_prepare, lora_on_transformers
from .activations import check_profile
from .context_parallel import check_context_parallel
from .engines import engine_for
from .states import optimizer_of


# switches beyond the classic blocks whose LoRA memory is measured: sliding windows (PEFT on
# transformers' Mistral, tests/test_lora_peak.py, and the reference model), a shared parallel
# norm (GPT-J's and Phi's block, which the transformers profile does not model: the reference
# model with PEFT-shaped adapters, tests/test_memory_finetune.py)
LORA_MEASURED_SWITCHES = ("sliding windows", "a shared parallel norm")


def validate_setup(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> None:
    """Parallel sizes must divide what they shard (Megatron-LM's rules; the pipeline
    schedules' in `schedules.check_pipeline`); data parallelism shards nothing of the
    micro-batch, so any dp is valid. The engine must run the set-up (`engines.engine_for`),
    context parallel torch's ring (`context_parallel.check_context_parallel`)."""
    engine = engine_for(setup)
    validate_workload(cfg, workload)
    check_context_parallel(cfg, workload, setup, engine.context_parallel)
    t, p = setup.tp, setup.pp
    for what, size in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads),
                       ("d_ff", cfg.ffn_dim), ("n_embd", cfg.n_embd)):
        if size % t:
            raise ConfigError("tp", f"tp {t} does not divide {what} {size}")
    local = workload.seq_len // setup.cp  # a context-parallel rank's tokens
    if setup.sp and t > 1 and (workload.seq_len % t or local % t):
        raise ConfigError("sp", f"sequence parallel needs tp {t} to divide seq_len "
                                f"{workload.seq_len}" + (f" / cp = {local}" if setup.cp > 1
                                                         else ""))
    check_pipeline(cfg, workload, setup)
    if setup.lora_rank and (t > 1 or p > 1):
        flag = f"--tp {t}" if t > 1 else f"--pp {p}"
        raise ConfigError("lora_rank", f"--lora-rank with {flag} is not modelled: LoRA memory is "
                                       "modelled with data parallelism (and ZeRO) only")
    unmeasured = [s for s in modern_switches(cfg) if s not in LORA_MEASURED_SWITCHES]
    if cfg.sliding_window is not None and "G" in cfg.attn_pattern.upper():
        unmeasured.append("a pattern of global and sliding layers")  # every layer sliding only
    if setup.lora_rank and unmeasured and not lora_on_transformers(cfg, setup):
        raise ConfigError("lora_rank", "LoRA memory is measured on the classic GPT-2 / Llama "
                                       f"blocks, not with {', '.join(unmeasured)}")
    if setup.lora_rank:
        from ..lora import covered, parse_targets

        parse_targets(",".join(setup.lora_targets), cfg)  # each target exists in this model
        if cfg.moe and matmul4bit_keeps_input(setup):
            raise ConfigError("bnb_version", "the 4-bit inputs bitsandbytes before 0.43.2 keeps "
                                             "are modelled for dense blocks; transformers' fused "
                                             "experts are not bitsandbytes Linears: give "
                                             "--bnb-version 0.43.2 or later")
        if cfg.moe and not covered(cfg, setup.lora_targets) & ATTENTION_TARGETS:
            raise ConfigError("lora_targets", "LoRA on a mixture of experts is modelled with an "
                                              "attention projection among the targets (the "
                                              "first block's experts ahead of the first adapter "
                                              "are not measured)")
    if not optimizer_of(setup).shardable and (
            setup.zero or setup.tp > 1 or setup.pp > 1 or setup.ep > 1 or setup.lora_rank
            or setup.optimizer_in_backward or not engine_for(setup).replicated(setup)):
        raise ConfigError("optimizer", f"{setup.optimizer} is modelled on one device or DDP "
                                       "(each rank steps whole matrices): not with ZeRO, a "
                                       "sharding engine, tp, pp, ep, LoRA or the optimizer in "
                                       "backward")
    if setup.ep > 1 and (not cfg.moe or cfg.n_expert % setup.ep):
        raise ConfigError("ep", f"ep {setup.ep} must divide the routed experts "
                                f"({cfg.n_expert if cfg.moe else 0})")
    check_dora(cfg, setup)
    check_kbit_prepare(setup)
    check_lora_dropout(cfg, setup)
    check_profile(cfg, setup)


def check_lora_dropout(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """LoRA dropout is modelled where its twin runs (PEFT's lora_dropout on transformers'
    models, modes fp32, amp and bf16, eager, recompute none or full, tests/
    test_lora_dropout.py); anything else is refused in one line naming both options."""
    if not setup.lora_dropout:
        return
    beside = [(setup.dora, "--dora"),
              (setup.impl != "transformers", f"--impl {setup.impl}"),
              (setup.recompute not in ("none", "full"), f"--recompute {setup.recompute}"),
              (setup.compile != "none", f"--compile {setup.compile}"),
              (setup.float8 != "none", f"--float8 {setup.float8}"),
              (setup.offload_activations, "--offload-activations"),
              (matmul4bit_keeps_input(setup), f"--bnb-version {setup.bnb_version}"),
              (cfg.moe, "a mixture of experts")]
    for refused, what in beside:
        if refused:
            raise ConfigError("lora_dropout", f"--lora-dropout with {what} is not modelled: "
                                              "LoRA dropout is measured on transformers' dense "
                                              "models wrapped by PEFT, eager, recompute none "
                                              "or full")


def check_dora(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """DoRA is modelled where its twin runs: PEFT's use_dora on a transformers model of dense
    blocks (no experts, latent attention or hybrid mixers), fp32, on one device, without
    recomputation, compile, float8, offload or another loss; anything else is refused naming
    the option."""
    if not setup.dora:
        return
    beside = [(setup.impl != "transformers", f"--impl {setup.impl}"),
              (setup.mode != "fp32", f"--mode {setup.mode}"),
              (setup.base_dtype == "nf4", "--weights-dtype nf4"),
              (setup.dp > 1, f"--dp {setup.dp}"), (setup.tp > 1, f"--tp {setup.tp}"),
              (setup.pp > 1, f"--pp {setup.pp}"), (setup.cp > 1, f"--cp {setup.cp}"),
              (setup.recompute != "none", f"--recompute {setup.recompute}"),
              (setup.compile != "none", f"--compile {setup.compile}"),
              (setup.float8 != "none", f"--float8 {setup.float8}"),
              (setup.offload_activations, "--offload-activations"),
              (setup.optimizer_in_backward, "--optimizer-in-backward"),
              (setup.loss != "standard", f"--loss {setup.loss}")]
    model = cfg.moe or cfg.mla or cfg.hybrid
    for refused, what in beside:
        if refused:
            raise ConfigError("dora", f"--dora with {what} is not modelled: DoRA is measured "
                                      "on transformers' models wrapped by PEFT, --mode fp32, "
                                      "one device, no recompute, compile, float8 or offload")
    if "lm_head" in setup.lora_targets:
        raise ConfigError("dora", "--dora with --lora-targets lm_head is not modelled: DoRA on "
                                  "the head keeps two more logits-sized tensors and its "
                                  "backward's, which are not measured")
    if model:
        raise ConfigError("dora", "--dora is modelled on dense blocks, not with experts, "
                                  "latent attention or hybrid mixers")
    from .profile_transformers import transformers_family

    family = transformers_family(cfg)
    if family not in DORA_FAMILIES:
        raise ConfigError("dora", f"--dora is measured on transformers' "
                                  f"{' and '.join(DORA_FAMILIES)} blocks, not {family}'s")


# the transformers model types DoRA's twin runs (tests/test_dora.py): Llama's block (separate
# projections) and Phi-3's (fused qkv_proj and gate_up_proj)
DORA_FAMILIES = ("llama", "phi3")
