"""`gptcalc verify`: exit codes, JSON, loud notes, and every family passing on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fvcore")
from click.testing import CliRunner  # noqa: E402

from gptcalc import ConfigError, Workload, from_name  # noqa: E402
from gptcalc.cli import cli  # noqa: E402
from reference_model.verify import (available_bytes, plan,  # noqa: E402
                                    training_bytes_estimate)

ROOT = Path(__file__).resolve().parents[1]
TINY = ["-L", "2", "-E", "32", "-H", "4", "-T", "16", "-V", "64", "-B", "2"]


def invoke(*args: str):
    """In-process through click's CliRunner (fast: torch is imported once)."""
    result = CliRunner().invoke(cli, ["verify", *args])
    return result.exit_code, result.output


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptcalc", "verify", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("arch, extra", [
    ("tutorial", ["--dropout", "0.2"]),
    ("gpt2", ["--attn", "sdpa"]),
    ("notes", ["--dropout", "0.1", "--attn", "sdpa"]),
    ("llama", ["--n-kv-head", "2"]),
])
def test_every_family_verifies_on_cpu(arch, extra):
    code, output = invoke("--arch", arch, *TINY, *extra, "--device", "cpu", "--json")
    assert code == 0, output
    out = json.loads(output)
    assert out["ok"] is True and out["device"] == "cpu" and out["tensors"] == "real"
    assert out["torch"] == torch.__version__
    assert out["checks"] and all(c["ok"] for c in out["checks"])
    # every check without a stated tolerance (all but the measured step peak) is exact
    assert all(c["difference"] == 0 for c in out["checks"] if not c.get("tolerance"))
    names = {c["name"] for c in out["checks"]}
    assert {"params total", "params attention/qkv", "fvcore forward matmul FLOPs",
            "FlopCounterMode forward FLOPs", "FlopCounterMode training FLOPs",
            "FlopCounterMode decode FLOPs (KV cache)", "FlopCounterMode decode FLOPs (no cache)"
            } <= names
    assert ("fvcore layer_norm FLOPs" in names) == (arch != "llama")


@pytest.mark.slow  # shape-only verification of the 10.8M-parameter tutorial model
@pytest.mark.requires_torch_213  # "22/22 exact" includes MemTracker's step peak
def test_table_output_and_shape_only_note():
    code, output = invoke("--preset", "shakespeare-char", "--device", "cpu",
                          "--tensors", "shape-only")
    assert code == 0, output
    assert "params total" in output and "10,788,929" in output
    assert "SHAPE-ONLY" in output and "22/23 checks exact, 1 more within" in output
    # shape-only now measures memory too (on FakeTensorMode tensors)
    assert "saved activation bytes" in output and "step peak bytes" in output


def test_max_layers_reduces_loudly():
    result = CliRunner().invoke(cli, ["verify", "--preset", "debug", "-L", "3", "--max-layers",
                                      "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["reduced"] is True and out["verified_n_layer"] == 1
    assert out["requested"]["n_layer"] == 3
    # `config` means what it means in every command: the model asked for
    assert out["config"]["n_layer"] == 3 and out["verified_config"]["n_layer"] == 1
    assert any("REDUCED" in n and "1 of 3 blocks" in n for n in out["notes"])


def test_plan_reduces_depth_when_real_tensors_do_not_fit():
    cfg = from_name("debug", n_layer=6)
    setup = plan(cfg, Workload(2, 16), "cpu", tensors="real", memory_bytes=2 * 600_000)
    assert 1 <= setup.config.n_layer < 6 and setup.config.n_embd == cfg.n_embd
    assert any(n.startswith("REDUCED") for n in setup.notes)
    roomy = plan(cfg, Workload(2, 16), "cpu", tensors="real", memory_bytes=2**40)
    assert roomy.config == cfg and roomy.notes == []


def test_planning_a_very_deep_model_takes_no_time_and_keeps_what_fits():
    import time

    from gptcalc.memory import TrainingSetup, step_peak

    wl = Workload(2, 16)
    # the extrapolated estimate equals the memory model's own at a depth it can still compute
    cfg = from_name("debug", n_layer=40)
    assert training_bytes_estimate(cfg, wl) == step_peak(cfg, wl, TrainingSetup()).bytes
    start = time.perf_counter()
    setup = plan(from_name("debug", n_layer=10**9), wl, "cpu", tensors="real",
                 memory_bytes=2 * 10**8)
    assert time.perf_counter() - start < 5  # a block-by-block search never ended
    n = setup.config.n_layer
    assert training_bytes_estimate(setup.config, wl) <= 10**8
    assert training_bytes_estimate(setup.config.replace(n_layer=n + 1), wl) > 10**8


def test_real_tensors_refused_when_one_block_does_not_fit():
    with pytest.raises(ConfigError) as e:
        plan(from_name("gpt2"), Workload(8, 1024), "cpu", tensors="real", memory_bytes=2**20)
    assert e.value.field == "tensors" and "even one block" in e.value.message


def test_host_memory_is_the_least_of_meminfo_cgroup_and_rlimit(monkeypatch):
    import builtins
    import io

    real_open = builtins.open
    fake = {"/sys/fs/cgroup/memory.max": "3000000\n", "/sys/fs/cgroup/memory.current": "1000\n"}
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(fake[path])
                        if path in fake else real_open(path, *a, **k))
    assert available_bytes("cpu") == 3000000 - 1000
    # an address-space limit 256 MiB above what this process has mapped leaves at most that
    import resource

    with real_open("/proc/self/status") as f:
        mapped = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")][0]
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (mapped + 2**28, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS
        else (resource.RLIM_INFINITY, resource.RLIM_INFINITY)))
    assert available_bytes("cpu") <= 2**28


def test_failed_check_exits_1(monkeypatch):
    import reference_model.measure as measure

    real = measure.params_by_key

    def off_by_one(model):
        counts = real(model)
        counts["lm_head"] = counts.get("lm_head", 0) + 1
        return counts

    monkeypatch.setattr(measure, "params_by_key", off_by_one)
    result = CliRunner().invoke(cli, ["verify", "--preset", "debug", "--device", "cpu"])
    assert result.exit_code == 1
    assert "FAIL" in result.output and "check(s) failed" in result.output


def test_bad_input_is_one_line_exit_2():
    r = CliRunner().invoke(cli, ["verify", "--preset", "debug", "--max-layers", "0"])
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0
    assert "--max-layers" in r.stderr and "Traceback" not in r.stderr
    if not torch.cuda.is_available():
        r = CliRunner().invoke(cli, ["verify", "--preset", "debug", "--device", "cuda"])
        assert r.exit_code == 2 and "--device" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn", ["manual", "sdpa"])
def test_verify_on_cuda(attn):
    proc = run("--arch", "gpt2", *TINY, "--attn", attn, "--device", "cuda", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["device"] == "cuda" and out["ok"] is True


def test_shape_only_on_cuda_says_memory_is_not_checked():
    # FakeTensorMode memory is compared with real runs on CPU only; on CUDA plan() says so
    cfg = from_name("shakespeare-char")
    cuda = plan(cfg, Workload(64, 256), "cuda", tensors="shape-only", memory_bytes=2**40)
    cpu = plan(cfg, Workload(64, 256), "cpu", tensors="shape-only", memory_bytes=2**40)
    assert any("memory NOT checked" in n for n in cuda.notes)
    assert not any("NOT checked" in n for n in cpu.notes)
    assert any("MemTracker's step peak" in n for n in cpu.notes)


@pytest.mark.parametrize("extra", [("--mode", "amp"), ("--mode", "mixed"), ("--mode", "bf16"),
                                   ("--recompute", "full", "--optimizer", "sgd-momentum"),
                                   ("--recompute", "selective", "--attn", "sdpa")])
def test_memory_checks_follow_the_training_setup(extra):
    code, output = invoke("--preset", "debug", "--device", "cpu", *extra, "--json")
    assert code == 0, output
    out = json.loads(output)
    given = dict(zip(extra[::2], extra[1::2]))
    assert out["training"]["mode"] == given.get("--mode", "fp32")
    assert out["training"]["recompute"] == given.get("--recompute", "none")
    names = {c["name"] for c in out["checks"]}
    assert {"saved activation bytes", "optimizer state bytes", "step peak bytes"} <= names
    assert all(c["ok"] for c in out["checks"])


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_fvcore_s_torch_jit_deprecation_is_silenced_around_fvcore_only(category):
    """torch 2.13 deprecates torch.jit with a DeprecationWarning, later releases with a
    FutureWarning (shown to every user); fvcore's use of it is not the user's to fix."""
    import warnings

    from reference_model.measure import _quiet_torch_jit

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _quiet_torch_jit():
            warnings.warn("`torch.jit.script` is deprecated. Please switch to torch.compile",
                          category, stacklevel=1)
        warnings.warn("`torch.jit.script` is deprecated. Please switch to torch.compile",
                      category, stacklevel=1)
    assert len(seen) == 1  # outside fvcore's calls it still shows


def test_the_reports_cost_sweep_runs_on_an_mla_moe_model():
    """The decode point's cache is the model's own prefill (MLA's keys and values differ in
    width; a window keeps fewer), and the conventions table explains MoE's 6N_active."""
    from reports.claims import measure_costs
    from reports.report import _flops_blocks

    cfg = from_name("debug-moe")
    points = measure_costs(cfg, [8, 16])
    assert [p.block_size for p in points] == [8, 16]
    for p in points:
        assert p.decode_flops > 0 and p.forward_flops > p.decode_flops
    text = repr(_flops_blocks(cfg, Workload(1, 16)))
    assert "6N_active" in text
