"""--impl megatron-core against Megatron-LM's own estimate and Korthikanti et al. 2022.

The oracle is Megatron-LM's megatron/training/theoretical_memory_usage.py at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22): `compute_activation_memory` (sequence
parallel with selective recomputation) and `compute_activation_memory_without_sp` (every other
set-up, as `report_theoretical_memory` picks them), transcribed below without their printing and
evaluated in exact fractions. Where the set-up is the one the formula assumes (GPT-3 style: a
biased GeLU MLP, LayerNorm, learned positions, no GQA, dropout), gptcalc's lines the formula
counts equal it exactly; the lines it leaves out are named in `NOT_IN_THE_FORMULA`.

    python -m tests.test_megatron_activations    # prints the comparison table
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import GPTConfig, Workload
from gptcalc.cli import cli
from gptcalc.memory import TrainingSetup, saved_activations
from gptcalc.memory.activations import device_activations

# --- the oracle: megatron/training/theoretical_memory_usage.py (commit d98e8a6), verbatim
# arithmetic, `verbose` printing dropped --------------------------------------------------------


def compute_activation_memory(args, num_microbatches):
    activation_memory = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size))
    )
    activation_memory *= args.num_layers
    activation_memory += (
        8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    )
    activation_memory += (
        args.seq_length
        * args.micro_batch_size
        * args.hidden_size
        * args.pipeline_model_parallel_size
    )
    if args.virtual_pipeline_model_parallel_size is not None:
        interleaved_schedule_memory_penalty = 1 + (
            (args.pipeline_model_parallel_size - 1)
            / (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size)
        )
        activation_memory *= interleaved_schedule_memory_penalty
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        activation_memory += (
            args.seq_length
            * args.micro_batch_size
            * args.hidden_size
            * 4
            * (1 + (args.padded_vocab_size / args.hidden_size))
        )
    return activation_memory / args.tensor_model_parallel_size


def compute_activation_memory_without_sp(args, num_microbatches):
    per_layer_memory = args.seq_length * args.micro_batch_size * args.hidden_size * (
        10 + (24 / args.tensor_model_parallel_size))
    total_activation_memory = per_layer_memory * args.num_layers
    total_activation_memory += (
        8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    )
    total_activation_memory += (
        args.seq_length
        * args.micro_batch_size
        * args.hidden_size
        * args.pipeline_model_parallel_size
    )
    if args.virtual_pipeline_model_parallel_size is not None:
        interleaved_schedule_memory_penalty = 1 + (
            (args.pipeline_model_parallel_size - 1)
            / (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size)
        )
        total_activation_memory *= interleaved_schedule_memory_penalty
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            total_activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        logits_size = args.seq_length * args.micro_batch_size * args.padded_vocab_size
        logits_size /= args.tensor_model_parallel_size
        final_ln_output = args.seq_length * args.micro_batch_size * args.hidden_size
        total_activation_memory += (logits_size + final_ln_output) * 2
    overhead_factor = Fraction(105, 100)  # the file's 1.05, exact here
    total_activation_memory *= overhead_factor
    return total_activation_memory


def theoretical_activations(args) -> Fraction:
    """`report_theoretical_memory`'s choice (in bytes, before its division into MB)."""
    if args.sequence_parallel and args.recompute_granularity == "selective":
        return compute_activation_memory(args, num_microbatches=None)
    return compute_activation_memory_without_sp(args, num_microbatches=None)


# the file's 5% "buffer for optimizer and miscellaneous temporaries" of the function without
# sequence parallelism: not an activation, divided out before comparing
OVERHEAD_FACTOR = Fraction(105, 100)


def megatron_args(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> SimpleNamespace:
    """Megatron-LM's arguments for a gptcalc set-up, sizes as exact fractions."""
    F = Fraction
    return SimpleNamespace(
        seq_length=F(wl.seq_len), micro_batch_size=F(wl.batch_size), hidden_size=F(cfg.n_embd),
        ffn_hidden_size=F(cfg.ffn_dim), num_layers=F(cfg.n_layer),
        padded_vocab_size=F(cfg.vocab_size), tensor_model_parallel_size=F(setup.tp),
        pipeline_model_parallel_size=F(setup.pp), virtual_pipeline_model_parallel_size=None,
        sequence_parallel=setup.sp, recompute_granularity=setup.recompute)


# gptcalc's lines the formula leaves out: the norms' fp32 statistics (TE's mu and rsigma), the
# selective checkpoint's int32 mask type, the position ids and VocabParallelEmbedding's mask,
# the cross entropy's target mask, masked targets and pretrain_gpt.py's loss mask
NOT_IN_THE_FORMULA = ("/mean", "/rstd", "attn/checkpoint_mask_type", "input/idx_positions",
                      "input/idx_vocab_mask", "cross_entropy/target_mask",
                      "cross_entropy/masked_target", "cross_entropy/loss_mask")


def gpt3_style(h: int, a: int, L: int, ffn: int, V: int, S: int, dropout: float = 0.1
               ) -> GPTConfig:
    """The block the formula assumes: LayerNorm, a biased GeLU MLP, learned positions,
    multi-head attention, fused q/k/v, dropout everywhere."""
    return GPTConfig(block_size=S, vocab_size=V, n_layer=L, n_head=a, n_embd=h, d_ff=ffn,
                     dropout=dropout, mlp="gelu", pos_embedding="learned", norm="layernorm")


GPT3_175B = gpt3_style(12288, 96, 96, 4 * 12288, 51200, 2048)  # Brown et al. 2020, Table 2.1


def megatron_setup(tp: int, pp: int, sp: bool, recompute: str, te: bool = True
                   ) -> TrainingSetup:
    return TrainingSetup(mode="mixed", attn_impl="sdpa", device="cuda", impl="megatron-core",
                         engine="megatron", tp=tp, pp=pp, sp=sp, recompute=recompute,
                         megatron_te=te, keep_logits=False)


def counted(cfg: GPTConfig, wl: Workload, setup: TrainingSetup) -> tuple[int, int]:
    """(bytes of the lines the formula counts, bytes of those it leaves out) on the first
    pipeline stage, the one the formula sizes."""
    lines = device_activations(cfg, wl, setup, "first")
    left_out = sum(v for k, v in lines.items() if any(m in k for m in NOT_IN_THE_FORMULA))
    return sum(lines.values()) - left_out, left_out


@st.composite
def layouts(draw, ffn_mult: int | None = None):
    """A GPT-3 style model and a tp/pp layout: heads, d_ff, S and V divisible by tp (as
    Megatron requires for heads and sequence parallelism; V as its padding makes it)."""
    t = draw(st.sampled_from([1, 2, 4, 8]))
    p = draw(st.sampled_from([1, 2, 4]))
    a = t * draw(st.integers(1, 3))
    h = a * draw(st.sampled_from([2, 4, 8]))
    ffn = ffn_mult * h if ffn_mult else t * draw(st.integers(1, 24))
    S = t * draw(st.integers(1, 8))
    cfg = gpt3_style(h, a, p * draw(st.integers(1, 3)), ffn, t * draw(st.integers(1, 40)), S)
    return cfg, Workload(draw(st.integers(1, 3)), S), t, p


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_sequence_parallel_selective_equals_megatron_lms_formula(layout):
    # compute_activation_memory: sbh(18 + 4 ffn/h) per layer, the embedding's dropout mask
    # and token ids of pp micro-batches, and on one stage 4sbh(1 + V/h), all over t. gptcalc
    # keeps the token ids whole on every rank (8sbp): the formula's /t on them is its only
    # line not per rank.
    cfg, wl, t, p = layout
    setup = megatron_setup(t, p, True, "selective")
    ours, _ = counted(cfg, wl, setup)
    ids = 8 * wl.tokens * p
    assert ours - ids + Fraction(ids, t) == theoretical_activations(megatron_args(cfg, wl,
                                                                                  setup))


@settings(max_examples=100, deadline=None)
@given(layouts(ffn_mult=4), st.sampled_from(["selective", "none"]))
def test_without_sequence_parallel_equals_megatron_lms_formula_on_the_first_stage(layout,
                                                                                 recompute):
    # compute_activation_memory_without_sp: sbh(10 + 24/t) per layer (a 4h MLP), times its 5%
    # overhead. With Transformer Engine no recomputation keeps what selective keeps plus the
    # fused attention's fp32 softmax statistics, b a s 4 / t a layer, which it leaves out. On
    # one stage (pp = 1) it counts 16-bit logits and the final norm's output, 2sb(V/t + h),
    # where Megatron keeps an fp32 softmax and two sbh tensors: compared where pp > 1 (the
    # first stage holds no output layer).
    cfg, wl, t, p = layout
    if p == 1:
        p = 2
        cfg = cfg.replace(n_layer=2 * cfg.n_layer)
    setup = megatron_setup(t, p, False, recompute)
    ours, _ = counted(cfg, wl, setup)
    stats = device_activations(cfg, wl, setup, "first").get("layer/attn/softmax_stats", 0)
    oracle = theoretical_activations(megatron_args(cfg, wl, setup)) / OVERHEAD_FACTOR
    assert ours - stats == oracle
    assert (stats > 0) == (recompute == "none")


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str
                       ) -> Fraction:
    """Korthikanti et al. 2022 (arXiv 2205.05198), Table 2, one layer, F = 4."""
    core = Fraction(5 * a * s, h * t) if recompute == "none" else 0
    if recompute == "full":
        return Fraction(2 * s * b * h, t if sp else 1)
    return s * b * h * ((Fraction(34, t) if sp else 10 + Fraction(24, t)) + core)


@settings(max_examples=100, deadline=None)
@given(layouts(ffn_mult=4), st.booleans(), st.sampled_from(["none", "selective", "full"]))
def test_local_modules_keep_korthikanti_table2(layout, sp, recompute):
    # Without Transformer Engine the core attention is Megatron's unfused one: softmax, its
    # dropout mask and the dropped probabilities, 5as^2b / t, the paper's row without
    # recomputation; full recomputation keeps each layer's input (sp: its local shard)
    cfg, wl, t, p = layout
    setup = megatron_setup(t, p, sp, recompute, te=False)
    lines = device_activations(cfg, wl, setup, "first")
    layer = sum(v for k, v in lines.items()  # the paper counts no statistics, no mask type
                if k.startswith("layer/")
                and not k.endswith(("/mean", "/rstd", "/checkpoint_mask_type")))
    s, b, h, a = wl.seq_len, wl.batch_size, cfg.n_embd, cfg.n_head
    assert layer == cfg.n_layer * korthikanti_table2(s, b, h, a, t, sp, recompute)


def test_the_lines_the_formula_leaves_out_are_small():
    # GPT-3 175B, tp 8, sp, pp 8: the norms' statistics and the index tensors beside the
    # formula's figure
    cfg = GPT3_175B
    wl, setup = Workload(1, 2048), megatron_setup(8, 8, True, "selective")
    ours, left_out = counted(cfg, wl, setup)
    assert 0 < left_out < ours / 1000


def test_swiglu_keeps_the_activations_2_dff_input_and_gqa_its_narrower_kv():
    # bias_swiglu_impl saves its input (fc1's 2 d_ff output) and linear_fc2 the d_ff output;
    # grouped-query attention's linear_qkv output is N (Dq + 2 Dkv); rotary makes new q and k
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    d_ff=48, mlp="swiglu", pos_embedding="rotary", norm="rmsnorm")
    wl, setup = Workload(2, 16), megatron_setup(2, 1, True, "none")
    lines = device_activations(cfg, wl, setup, "first")
    N, L, t = 32, 2, 2
    assert lines["layer/mlp/act_input"] == L * N * 2 * 48 * 2 // t
    assert lines["layer/mlp/hidden"] == L * N * 48 * 2 // t
    assert lines["layer/attn/qkv"] == L * N * (32 + 2 * 16) * 2 // t
    assert lines["layer/attn/q_rotary"] + lines["layer/attn/k_rotary"] == L * N * 48 * 2 // t
    assert "layer/ln_1/mean" not in lines  # RMSNorm keeps rsigma only


@pytest.mark.slow
def test_the_local_modules_equal_megatron_core_measured_on_cpu():
    # benchmarks/megatron_twin.py: megatron-core's GPTModel (local spec) on one gloo rank, every
    # storage autograd keeps against --impl megatron-core --no-megatron-te --device cpu; runs
    # where megatron-core is installed (`pip install --no-deps megatron-core==0.16.1`)
    pytest.importorskip("megatron.core")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "megatron_twin.py")],
                       capture_output=True, text=True, cwd=root, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(root), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


# Megatron's qk_layernorm (a norm of head_dim on q and k), measured by benchmarks/megatron_twin.py
# on megatron-core 0.16.1's GPTModel, local spec, CPU, b 2 x S 24, E 64, H 4, L 2, V 96, dropout
# 0, --mode mixed (bf16): the bytes autograd keeps for backward, attention mask excluded
_QK_MODELS = {
    "gpt": dict(mlp="gelu"),
    "llama-like": dict(n_kv_head=2, d_ff=96, mlp="swiglu", pos_embedding="rotary",
                       mlp_bias=False, qkv_bias=False, attn_out_bias=False,
                       tie_embeddings=False),
    "rotary MHA": dict(mlp="gelu", pos_embedding="rotary"),
    "GQA 4/1": dict(n_kv_head=1, mlp="gelu"),
    "GQA 4/2 ReLU": dict(n_kv_head=2, mlp="relu"),
}
_QK_MEASURED = {  # (model, recompute): bytes measured by megatron-core with qk_layernorm=True
    ("gpt", "none"): 275_760, ("gpt", "selective"): 257_336,
    ("llama-like", "none"): 250_032, ("llama-like", "selective"): 213_176,
    ("rotary MHA", "none"): 281_520, ("rotary MHA", "selective"): 263_096,
    ("GQA 4/1", "none"): 268_464, ("GQA 4/1", "selective"): 228_536,
    ("GQA 4/2 ReLU", "none"): 238_128, ("GQA 4/2 ReLU", "selective"): 201_272,
    ("gpt", "full"): 44_592, ("llama-like", "full"): 45_744,
}


@pytest.mark.parametrize("model, recompute", sorted(_QK_MEASURED))
def test_qk_layernorm_equals_megatron_core_measured(model, recompute):
    cfg = GPTConfig(block_size=24, vocab_size=96, n_layer=2, n_head=4, n_embd=64,
                    qk_norm="head", **_QK_MODELS[model])
    setup = TrainingSetup(mode="mixed", device="cpu", impl="megatron-core",
                          megatron_te=False, recompute=recompute)
    lines = saved_activations(cfg, Workload(2, 24), setup)
    assert sum(lines.values()) == _QK_MEASURED[model, recompute]


@pytest.mark.parametrize("kind", ["per_head", "proj"])
def test_q_k_norms_megatron_does_not_build_are_refused_naming_impl(kind):
    r = _memory("--impl", "megatron-core", "--set", f"qk_norm={kind}")
    assert r.exit_code == 2 and "--impl" in r.output and "q/k norms" in r.output


def _memory(*args: str):
    return CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "-B", "1", "--seq-len",
                                     "64", *args])


def test_the_megatron_engine_counts_megatron_core_by_default_and_says_so():
    r = _memory("--engine", "megatron")
    first = r.output.splitlines()[0]
    assert r.exit_code == 0
    assert "megatron-core implementation with Transformer Engine" in first
    assert "logits dropped before backward" in first
    r = _memory("--engine", "megatron", "--no-megatron-te")
    assert "megatron-core implementation without Transformer Engine" in r.output.splitlines()[0]
    r = _memory("--engine", "megatron", "--impl", "reference", "--keep-logits")
    assert "reference implementation" in r.output.splitlines()[0]
    assert "logits kept through backward" in r.output.splitlines()[0]


def test_what_the_profile_does_not_model_is_one_line_naming_the_option():
    for args, option in ((["--recompute", "op"], "--recompute"),
                         (["--loss", "chunked"], "--loss"),
                         (["--impl", "megatron-core", "--set", "n_expert=4"], "--impl"),
                         (["--tp", "5"], "--tp")):
        r = _memory("--engine", "megatron", *args)
        assert r.exit_code == 2, (args, r.output)
        assert option in r.output and len(r.output.strip().splitlines()) == 1, r.output
    # where the profile does not model the model's switches the family's profile stays, named
    r = _memory("--engine", "megatron", "--set", "n_expert=4")
    assert r.exit_code == 0 and "reference implementation" in r.output.splitlines()[0]


# --- the comparison table ---------------------------------------------------------------------

TABLE = (  # (name, cfg, B, tp, pp, sp, recompute, te, why they differ)
    ("GPT-3 175B", GPT3_175B, 1, 8, 8, True, "selective", True,
     "norm statistics, index tensors"),
    ("GPT-3 175B, no dropout", GPT3_175B.replace(dropout=0.0), 1, 8, 8, True, "selective",
     True, "no dropout masks: 2sbh/t a layer"),
    ("GPT-3 175B", GPT3_175B, 1, 8, 8, False, "selective", True,
     "the file's 5% overhead"),
    ("GPT-3 175B", GPT3_175B, 1, 8, 8, True, "none", True,
     "the file ignores sp here (10sbh whole); TE keeps no S x S tensor"),
    ("GPT-3 175B", GPT3_175B, 1, 8, 8, True, "none", False,
     "the unfused core's 5as^2b/t, which the file leaves out"),
    ("GPT-3 175B", GPT3_175B, 1, 8, 8, True, "full", True,
     "the file counts sbh(10 + 24/t) whatever the recomputation"),
    ("GPT-3 22B", gpt3_style(6144, 64, 48, 4 * 6144, 51200, 2048), 4, 8, 1, True,
     "selective", True, "pp 1: the cross entropy's index tensors too"),
    ("Llama-style 8B (SwiGLU, GQA 8, RoPE)", GPTConfig(
        block_size=8192, vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
        d_ff=14336, mlp="swiglu", pos_embedding="rotary", norm="rmsnorm",
        tie_embeddings=False), 1, 4, 1, True, "selective", True,
     "SwiGLU's 2 d_ff input, RoPE's new q and k, GQA's narrower k and v, no dropout"),
)


def comparison_rows() -> list[tuple[str, ...]]:
    rows = []
    for name, cfg, B, tp, pp, sp, recompute, te, why in TABLE:
        wl = Workload(B, cfg.block_size)
        setup = megatron_setup(tp, pp, sp, recompute, te)
        ours = sum(device_activations(cfg, wl, setup, "first").values())
        oracle = theoretical_activations(megatron_args(cfg, wl, setup))
        layout = (f"B={B} S={cfg.block_size} tp={tp} pp={pp} sp={'on' if sp else 'off'} "
                  f"{recompute} {'TE' if te else 'local'}")
        rows.append((name, layout, f"{math.floor(oracle):,}", f"{ours:,}",
                     f"{float(ours / oracle - 1):+.2%}", why))
    return rows


if __name__ == "__main__":
    head = ("model", "layout", "theoretical_memory_usage.py (B)", "gptcalc megatron-core (B)",
            "gptcalc / it - 1", "why")
    for row in (head, *comparison_rows()):
        print(" | ".join(row))
