"""Recomputation as frameworks run it: torchtitan's op-level selective checkpointing (`op`),
Megatron-style attention-core checkpointing (`selective`) and whole-block checkpointing
(`full`, transformers' gradient_checkpointing_enable), each against its measured twin.

Expected values are measured: saved_tensors_hooks deduplicated by storage, plus the op outputs
the selective-checkpoint contexts cache (reference_model.recompute.OpCheckpoint.cached) and,
for transformers, the tensors bound into each layer's recomputation; FLOPs by FlopCounterMode.
The profiles under test never compute them.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gptcalc import GPTConfig, Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.flops import count_flops
from gptcalc.memory import TrainingSetup, saved_activations
from gptcalc.memory.profile_transformers import transformers_saved
from gptcalc.presets import PRESETS
from gptcalc.recompute import block_linears, op_kept_linears, op_recomputed_linears
from reference_model import measure
from reference_model.memory import build_for, make_batch, measure_saved

from ._strategies import configs_and_workloads
from .test_memory_modern import modern_configs

torch.set_num_threads(1)
MODES = ["fp32", "bf16", "amp", "mixed"]


def _measured(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> tuple[int, int]:
    model = build_for(cfg, setup)
    idx, targets = make_batch(cfg, wl)
    report = measure_saved(model, idx, targets, setup)
    return report.activation_bytes, report.weight_copy_bytes


def _predicted(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> tuple[int, int]:
    lines = saved_activations(cfg, wl, setup)
    copies = sum(v for k, v in lines.items() if k.startswith("weight_copy/"))
    return sum(lines.values()) - copies, copies


# --------------------------------------------------------------------------- reference model


@pytest.mark.parametrize("arch,kv", [("gpt2", None), ("llama", 2), ("llama", None),
                                     ("tutorial", None), ("notes", None)])
@pytest.mark.parametrize("attn", ["manual", "sdpa"])
@pytest.mark.parametrize("mode", MODES)
def test_op_saved_bytes_exact_by_family(arch, kv, attn, mode):
    """gpt2 (biased Linears: addmm, never kept), llama with grouped-query heads and without,
    the tutorial's per-head Linears, the notes' model, at B = 2 and S = 12."""
    cfg = from_name("debug", arch=arch, n_layer=2, n_head=4, n_kv_head=kv, n_embd=32,
                    block_size=16, vocab_size=50)
    setup = TrainingSetup(mode=mode, attn_impl=attn, recompute="op")
    wl = Workload(2, 12)
    assert _predicted(cfg, wl, setup) == _measured(cfg, wl, setup)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(configs_and_workloads(), st.sampled_from(MODES), st.sampled_from(["manual", "sdpa"]),
       st.sampled_from(["op", "selective"]))
def test_op_and_selective_saved_bytes_exact_over_configs(cw, mode, attn, recompute):
    cfg, wl = cw
    setup = TrainingSetup(mode=mode, attn_impl=attn, recompute=recompute)
    assert _predicted(cfg, wl, setup) == _measured(cfg, wl, setup)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(modern_configs(), st.integers(1, 2), st.integers(1, 8), st.sampled_from(MODES),
       st.sampled_from(["manual", "sdpa"]), st.sampled_from(["op", "selective"]))
def test_op_and_selective_saved_bytes_exact_modern(cfg, B, S, mode, attn, recompute):
    """q/k norms, post-norms, sliding windows, ALiBi, MLA, ...; MoE only with selective."""
    if recompute == "op" and cfg.moe:
        return
    if mode == "amp" and cfg.embd_proj_dim is not None and cfg.pos_embedding != "learned":
        return  # the reference profile's stated exception (its docstring)
    attn = "manual" if cfg.attn_sinks else attn
    wl, setup = Workload(B, S), TrainingSetup(mode=mode, attn_impl=attn, recompute=recompute)
    assert _predicted(cfg, wl, setup) == _measured(cfg, wl, setup)


def test_selective_keeps_grouped_query_kv_unexpanded():
    """The checkpointed core receives k and v of n_kv_head heads: with H = 8 and 2 kv heads the
    core's inputs are q (N*Dq) and k, v (N*Dq/4 each), not three N*Dq tensors."""
    cfg = from_name("debug", arch="llama", n_layer=1, n_head=8, n_kv_head=2, n_embd=64,
                    block_size=16, vocab_size=50)
    wl, setup = Workload(2, 16), TrainingSetup(attn_impl="sdpa", recompute="selective")
    N, a = 32, 4
    assert saved_activations(cfg, wl, setup)["layer/attn/core_inputs"] == N * 64 * a * 3 // 2
    assert _predicted(cfg, wl, setup) == _measured(cfg, wl, setup)


def test_op_kept_matmuls_follow_torchtitans_rule():
    """Every other aten.mm of a Llama block kept (q, v, gate, down); a biased Linear (addmm)
    neither kept nor counted (Qwen2's q/k/v: o_proj is the first mm)."""
    llama = from_name("llama3-8b")
    assert [lin.name for lin in op_kept_linears(llama)] == ["q_proj", "v_proj", "mlp_gate",
                                                            "mlp_proj"]
    assert [lin.name for lin in block_linears(llama)] == [
        "q_proj", "k_proj", "v_proj", "c_proj", "mlp_gate", "mlp_fc", "mlp_proj"]
    # down is kept, so nothing trails: k, o and up run again
    assert [lin.name for lin in op_recomputed_linears(llama)] == ["k_proj", "c_proj", "mlp_fc"]
    qwen = from_name("debug", arch="llama", qkv_bias=True)
    assert [lin.name for lin in op_kept_linears(qwen)] == ["c_proj", "mlp_fc"]


def test_op_refuses_moe():
    cfg = from_name("debug", arch="llama", n_expert=4, n_expert_active=2)
    with pytest.raises(ConfigError, match="routing"):
        saved_activations(cfg, Workload(1, 8), TrainingSetup(recompute="op"))
    with pytest.raises(ConfigError, match="routing"):
        count_flops(cfg, Workload(1, 8), recompute="op")


# --------------------------------------------------------------------------- FLOPs


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(configs_and_workloads(), st.sampled_from(["manual", "sdpa"]))
def test_op_recompute_flops_equal_flopcounter(cw, attn):
    """Forward + backward + what op recomputes, against FlopCounterMode over a training step
    (SDPA's CPU kernels registered as the verify command registers them)."""
    cfg, wl = cw
    model = build_for(cfg, TrainingSetup(attn_impl=attn, recompute="op"))
    idx, targets = make_batch(cfg, wl)
    got = measure.flopcounter_training(model, idx, targets)
    fc = count_flops(cfg, wl, recompute="op", flash_backward=got.fused_sdpa)
    assert wl.batch_size * fc.hardware_total == got.total


# --------------------------------------------------------------------------- transformers

TW_FAMILIES = ("gpt2", "gpt_neox", "llama", "llama_mha", "qwen2")


def _tw():
    pytest.importorskip("transformers")
    from reference_model import transformers_twin as tw

    from .test_transformers_twin import _cfg
    return tw, _cfg


def _tw_measured(cfg: GPTConfig, attn: str, recompute: str, B: int, S: int,
                 dtype=torch.float32) -> int:
    tw, _ = _tw()
    model = tw.build(tw.hf_config_for(cfg), None if attn == "sdpa" else "eager", dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tw.apply_recompute(model, recompute)
        idx, labels = tw.make_batch(cfg.vocab_size, B, S)
        return tw.measure_saved(model, idx, labels).activation_bytes


def _tw_setup(attn: str, recompute: str, mode: str = "fp32"):
    return SimpleNamespace(mode=mode, attn_impl=attn, device="cpu", recompute=recompute,
                           act_bytes=4 if mode == "fp32" else 2)


@pytest.mark.parametrize("family", TW_FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("recompute", ["op", "full"])
@pytest.mark.parametrize("B,H", [(2, 4), (1, 1)])
def test_transformers_recompute_saved_bytes_exact(family, attn, dropout, recompute, B, H):
    """`full`: gradient_checkpointing_enable() as transformers 5.23 runs it; `op`: the same
    layer wrapping with torchtitan's policy as context_fn."""
    _, make_cfg = _tw()
    cfg = make_cfg(family, H=H, dropout=dropout)
    predicted = sum(transformers_saved(cfg, B, 16, _tw_setup(attn, recompute)).values())
    assert predicted == _tw_measured(cfg, attn, recompute, B, 16)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("recompute", ["op", "full"])
def test_transformers_recompute_saved_bytes_exact_bf16(family, attn, recompute):
    _, make_cfg = _tw()
    cfg = make_cfg(family)
    predicted = sum(transformers_saved(cfg, 2, 16, _tw_setup(attn, recompute, "bf16")).values())
    assert predicted == _tw_measured(cfg, attn, recompute, 2, 16, torch.bfloat16)


def _raw_cases():
    from .test_transformers_twin import _deepseek_raw, _gemma_raw, _moe_raw
    return [("gemma2", _gemma_raw("gemma2"), None), ("gemma3", _gemma_raw("gemma3_text"), None),
            ("gemma3 eager", _gemma_raw("gemma3_text"), "eager"),
            ("mixtral", _moe_raw("mixtral", 4, 2), None),
            ("mixtral window", _moe_raw("mixtral", 4, 2, sliding_window=8), None),
            ("deepseek_v3", _deepseek_raw(), None)]


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("recompute", ["op", "full"])
@pytest.mark.parametrize("S", [12, 32])
def test_transformers_recompute_exact_other_families(case, recompute, S):
    """Gemma 2/3 (two layer types: one mask each under eager, a sliding window's under SDPA
    once S reaches the window, 16), Mixtral with and without its window (8), DeepSeek-V3; op
    refuses MoE layers."""
    tw, _ = _tw()
    from gptcalc.hf import config_from_hf

    _, raw, attn = _raw_cases()[case]
    cfg = config_from_hf(raw)
    eager = attn == "eager" or raw["model_type"] == "gemma2"
    setup = _tw_setup("manual" if eager else "sdpa", recompute)
    if recompute == "op" and cfg.moe:
        with pytest.raises(ConfigError, match="routing"):
            transformers_saved(cfg, 2, S, setup)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tw.apply_recompute(tw.build(raw, attn), recompute)
        measured = tw.measure_saved(model, *tw.make_batch(raw["vocab_size"], 2, S))
    assert sum(transformers_saved(cfg, 2, S, setup).values()) == measured.activation_bytes


def test_transformers_full_keeps_the_layer_inputs_and_bound_arguments():
    """What gradient checkpointing keeps of a 2-layer Llama (fp32, eager, B = 2, S = 16, E = 32,
    head_dim 8): each layer's hidden states 2*16*32*4 = 4096 bytes, and once for all layers
    the rotary cos and sin (1, 16, 8) fp32, the position ids (1, 16) int64 and the eager mask
    (2, 1, 16, 16) fp32: shapes read off transformers' LlamaDecoderLayer call."""
    _, make_cfg = _tw()
    cfg = make_cfg("llama")
    lines = transformers_saved(cfg, 2, 16, _tw_setup("manual", "full"))
    assert lines["layer/block_input"] == 2 * 4096
    assert lines["embedding/rotary_cos_sin"] == 2 * 16 * 8 * 4
    assert lines["embedding/position_ids"] == 16 * 8
    assert lines["embedding/attention_mask"] == 2 * 16 * 16 * 4


# --------------------------------------------------------------------------- ordering


def _saved_total(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> int:
    return sum(saved_activations(cfg, wl, setup).values())


DENSE_PRESETS = sorted(name for name in PRESETS if not from_name(name).moe)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(configs_and_workloads(),
                 st.tuples(st.sampled_from(DENSE_PRESETS).map(from_name),
                           st.builds(Workload, st.integers(1, 4),
                                     st.sampled_from([1, 7, 128, 1024])))),
       st.sampled_from(MODES), st.sampled_from(["manual", "sdpa"]),
       st.sampled_from(["cpu", "cuda"]), st.sampled_from(["reference", "transformers",
                                                           "paper"]))
def test_recomputation_never_saves_more(cw, mode, attn, device, impl):
    """selective and op keep at most what no recomputation keeps, full at most what either
    keeps, for every profile that runs the mode (transformers: none, op, full; paper: none,
    selective, full)."""
    cfg, wl = cw
    if wl.seq_len > cfg.block_size:
        wl = Workload(wl.batch_size, cfg.block_size)
    saved = {}
    for recompute in ("none", "selective", "op", "full"):
        setup = TrainingSetup(mode=mode, attn_impl=attn, device=device, impl=impl,
                              recompute=recompute)
        try:
            saved[recompute] = _saved_total(cfg, wl, setup)
        except ConfigError:  # a profile that does not run this mode or config
            continue
    for lighter in ("selective", "op"):
        if lighter in saved and "none" in saved:
            assert saved[lighter] <= saved["none"], lighter
        if lighter in saved and "full" in saved:
            assert saved["full"] <= saved[lighter], lighter


# --------------------------------------------------------------------------- CLI


def _cli(*args: str):
    from click.testing import CliRunner

    from gptcalc.cli import cli
    return CliRunner().invoke(cli, list(args))


def test_cli_takes_recompute_op():
    for command in (["memory"], ["flops"], ["time", "--tokens", "1e9"]):
        result = _cli(*command, "--preset", "llama3-8b", "--recompute", "op")
        assert result.exit_code == 0, result.output


def test_cli_refuses_op_where_undefined_in_one_line():
    for extra in (["--impl", "paper"], ["--preset", "mixtral-8x7b"]):
        result = _cli("memory", "--preset", "llama3-8b", *extra, "--recompute", "op")
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
        assert "--recompute" in result.stderr, result.stderr
