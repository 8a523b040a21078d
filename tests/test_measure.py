"""Measurements against the analytic formulas: fvcore and FlopCounterMode, exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fvcore")
from hypothesis import example, given, settings, strategies as st  # noqa: E402

from gptcalc import Workload, count_flops, from_name, inference_flops  # noqa: E402
from reference_model import measure  # noqa: E402
from reference_model.model import build_model  # noqa: E402
from reference_model.verify import decode_plan, run_checks  # noqa: E402

from ._strategies import TINY_ATTENTION_BOUND, TINY_PARALLEL_BOUND, configs_and_workloads  # noqa: E402

torch.set_num_threads(1)
ATTN = st.sampled_from(["manual", "sdpa"])


def _inputs(cfg, wl, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (wl.batch_size, wl.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (wl.batch_size, wl.seq_len), generator=g))


@settings(max_examples=40, deadline=None)
@given(case=configs_and_workloads(), attn=ATTN)
def test_fvcore_forward_is_exact(case, attn):
    cfg, wl = case
    model = build_model(cfg, attn)
    idx, _ = _inputs(cfg, wl)
    by_op = measure.fvcore_forward_by_operator(model, idx)
    fc = count_flops(cfg, wl)
    assert 2 * measure.fvcore_matmul_macs(by_op) == wl.batch_size * fc.forward_total
    expected_norm = wl.batch_size * fc.nonmatmul["norm"] if cfg.norm != "rmsnorm" else 0
    assert by_op.get("layer_norm", 0) == expected_norm  # the hand-written RMSNorm is no layer_norm


@settings(max_examples=40, deadline=None)
@given(case=configs_and_workloads(), attn=ATTN)
def test_flopcounter_forward_and_training_are_exact(case, attn):
    cfg, wl = case
    model = build_model(cfg, attn)
    idx, targets = _inputs(cfg, wl)
    B = wl.batch_size
    assert measure.flopcounter_forward(model, idx).total == B * count_flops(cfg, wl).forward_total
    train = measure.flopcounter_training(model, idx, targets)
    # which SDPA kernel ran, measured on CPU: the fused one unless dropout is active in training
    assert train.fused_sdpa == (attn == "sdpa" and cfg.dropout == 0.0)
    fc = count_flops(cfg, wl, flash_backward=train.fused_sdpa)
    assert train.total == B * fc.hardware_total
    # per operator: a fused kernel counts its forward once and its backward at 2.5x (torch's
    # formula); manual attention and the math path leave attention to bmm/matmul instead
    attention = B * (fc.forward["attention/scores"] + fc.forward["attention/values"])
    sdpa_ops = sum(v for k, v in train.by_operator.items() if "scaled_dot_product" in k)
    assert sdpa_ops == (attention * 7 // 2 if train.fused_sdpa else 0)


@settings(max_examples=30, deadline=None)
@given(case=configs_and_workloads(dropout=st.just(0.0)), attn=ATTN, data=st.data())
def test_decode_flops_with_and_without_cache_are_exact(case, attn, data):
    cfg, wl = case
    model = build_model(cfg, attn)
    idx, _ = _inputs(cfg, wl)
    P = data.draw(st.integers(1, wl.seq_len))
    n = data.draw(st.integers(1, cfg.block_size - P + 1))
    B = wl.batch_size
    cached = measure.flopcounter_generate(model, idx[:, :P], n, use_kv_cache=True).total
    # prefill over the prompt, then one token at contexts P+1 .. P+n-1 (the last is not fed back)
    expected = inference_flops(cfg, P, P).prefill + sum(
        inference_flops(cfg, 1, c).decode_per_token for c in range(P + 1, P + n))
    assert cached == B * expected
    uncached = measure.flopcounter_generate(model, idx[:, :P], n, use_kv_cache=False).total
    # the seeds' loop: a whole forward over the (cropped) context for each new token
    expected = sum(inference_flops(cfg, 1, min(c, cfg.block_size)).decode_per_token_no_cache
                   for c in range(P, P + n))
    assert uncached == B * expected


@pytest.mark.slow  # 20 reference models built and run, every check
@settings(max_examples=20, deadline=None)
@given(case=configs_and_workloads(), attn=ATTN)
@example(case=TINY_ATTENTION_BOUND, attn="manual")
@example(case=TINY_PARALLEL_BOUND, attn="manual")
def test_run_checks_all_exact(case, attn):
    cfg, wl = case
    checks = run_checks(cfg, wl, "cpu", attn, tensors="real")
    assert checks and all(c.ok for c in checks), [c.as_dict() for c in checks if not c.ok]
    names = {c.name for c in checks}
    assert {"params total", "fvcore forward matmul FLOPs", "FlopCounterMode training FLOPs",
            "FlopCounterMode decode FLOPs (KV cache)"} <= names


@pytest.mark.slow  # every check twice, on real and on fake tensors
def test_shape_only_counts_equal_real_counts():
    cfg, wl = from_name("debug", dropout=0.1), Workload(2, 16)
    for attn in ("manual", "sdpa"):
        real = run_checks(cfg, wl, "cpu", attn, tensors="real")
        shapes = run_checks(cfg, wl, "cpu", attn, tensors="shape-only")
        # the same checks, memory included (measured on FakeTensorMode), with the same values
        assert [(c.name, c.analytic, c.measured) for c in shapes] == [
            (c.name, c.analytic, c.measured) for c in real]
        assert {"saved activation bytes", "weight bytes", "gradient bytes",
                "optimizer state bytes", "step peak bytes"} <= {c.name for c in shapes}


def test_fvcore_loses_sdpa_without_the_handle():
    # fvcore counts aten::scaled_dot_product_attention as 0 unless a handle is set
    from fvcore.nn import FlopCountAnalysis

    cfg, wl = from_name("debug"), Workload(1, 16)
    model = build_model(cfg, "sdpa").eval()
    idx, _ = _inputs(cfg, wl)
    plain = FlopCountAnalysis(model, (idx,)).unsupported_ops_warnings(False).by_operator()
    ours = measure.fvcore_forward_by_operator(model, idx)
    fwd = count_flops(cfg, wl).forward
    missing_macs = (fwd["attention/scores"] + fwd["attention/values"]) // 2
    assert "scaled_dot_product_attention" not in plain
    assert measure.fvcore_matmul_macs(ours) - measure.fvcore_matmul_macs(plain) == missing_macs


def test_flopcounter_misses_cpu_sdpa_without_the_mapping():
    cfg, wl = from_name("debug"), Workload(1, 16)
    model = build_model(cfg, "sdpa").eval()
    idx, _ = _inputs(cfg, wl)
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(idx)
    fwd = count_flops(cfg, wl).forward
    missing = fwd["attention/scores"] + fwd["attention/values"]
    assert fc.get_total_flops() == sum(fwd.values()) - missing
    assert measure.flopcounter_forward(model, idx).total == sum(fwd.values())


def test_decode_plan_ends_at_seq_len():
    assert decode_plan(16) == (13, 4)
    assert decode_plan(2) == (1, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn", ["manual", "sdpa"])
def test_cuda_checks_exact(attn):
    cfg, wl = from_name("debug", dropout=0.1), Workload(2, 16)
    checks = run_checks(cfg, wl, "cuda", attn, tensors="real")
    assert all(c.ok for c in checks), [c.as_dict() for c in checks if not c.ok]


@pytest.mark.parametrize("preset, attn", [("shakespeare-char", "manual"), ("debug", "sdpa"),
                                          ("debug-moe", "sdpa")])
def test_fvcore_counting_shows_the_user_no_warning(preset, attn, caplog, capfd):
    """fvcore logs "Unsupported operator aten::add encountered N time(s)" (and the uncalled
    modules, and torch.jit's deprecation) for every count; the model's adds, softmax, GELU and
    embeddings are not FLOPs it should count, so `verify` asks it to stay quiet, on real tensors
    and on the meta device alike."""
    import logging
    import warnings

    cfg = from_name(preset, n_layer=2)
    wl = Workload(2, min(cfg.block_size, 16))
    real = build_model(cfg, attn)
    meta = None if cfg.n_expert else measure.meta_model(cfg, attn)  # verify's shape-only path
    idx, _ = _inputs(cfg, wl)
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runs = [(real, idx)] + ([] if cfg.n_expert else  # MoE routing has no meta path
                                [(meta, torch.zeros_like(idx, device="meta"))])
        for model, x in runs:
            by_op = measure.fvcore_forward_by_operator(model, x)
            assert measure.fvcore_matmul_macs(by_op) > 0
    assert [str(w.message) for w in seen] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    out, err = capfd.readouterr()
    assert "nsupported operator" not in out + err and "Warning" not in err


def test_fvcore_would_warn_of_unsupported_operators_without_being_told_not_to(caplog):
    # the test above can fail: the same count with fvcore's defaults logs the operators
    import logging

    from fvcore.nn import FlopCountAnalysis

    cfg = from_name("debug", n_layer=2)
    model = build_model(cfg, "sdpa").eval()
    idx, _ = _inputs(cfg, Workload(2, 16))
    caplog.set_level(logging.WARNING)
    with measure._quiet_torch_jit():
        FlopCountAnalysis(model, (idx,)).total()
    assert any("nsupported operator" in r.getMessage() for r in caplog.records)


def test_verify_prints_no_warning_to_the_user():
    """The whole command as a user runs it (Python's default warning filters, fvcore's logger
    printing to stderr through logging's last-resort handler): nothing on stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": ""}
    r = subprocess.run([sys.executable, "-m", "gptcalc", "verify", "--preset", "debug",
                        "--device", "cpu"], capture_output=True, text=True, env=env, cwd=root,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "fvcore forward matmul FLOPs" in r.stdout
    assert r.stderr == ""
