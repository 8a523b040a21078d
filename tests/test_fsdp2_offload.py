"""FSDP2's CPUOffloadPolicy (`--engine fsdp2 --offload-param cpu`): the states are the host's,
the device holds what is gathered, reduced and saved; measured shape-only with FSDPMemTracker
on a fake accelerator apart from the host (reference_model.distributed.fake_device)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gptcalc import from_name
from gptcalc.cli import cli
from gptcalc.memory import step_peak
from gptcalc.memory.engines import host, rank_states
from gptcalc.memory.ledger import Phase
from gptcalc.memory.peak import stage_ledger
from gptcalc.memory.engines.fsdp2 import (HOST_GRADIENTS, HOST_OPTIMIZER, HOST_PARAMETERS,
                                          fsdp2_sharded_states)
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload

from .test_recipes_shipped import memory

OFFLOAD = (("offload_param", "cpu"),)
DEBUG = from_name("debug")


def _setup(**kw) -> TrainingSetup:
    return TrainingSetup(engine="fsdp2", engine_settings=OFFLOAD, **kw)


@pytest.mark.parametrize("dp,zero", [(2, 3), (3, 2), (8, 3)])
def test_the_states_move_to_the_host_whole(dp, zero):
    setup = _setup(dp=dp, zero=zero, mode="mixed")
    plain = fsdp2_sharded_states(DEBUG, setup)
    st = rank_states(DEBUG, setup, 0)
    assert (st.weights, st.gradients, st.optimizer) == (0, 0, 0)
    assert host(DEBUG, setup) == {HOST_PARAMETERS: plain.weights,
                                  HOST_GRADIENTS: plain.gradients,
                                  HOST_OPTIMIZER: plain.optimizer}
    # the same shards FSDP2 keeps on the device without offload
    assert plain == rank_states(DEBUG, TrainingSetup(engine="fsdp2", dp=dp, zero=zero,
                                                     mode="mixed"), 0)
    assert host(DEBUG, TrainingSetup(engine="fsdp2", dp=dp, zero=zero)) == {}


def test_the_device_peak_loses_the_states_and_the_optimizer_step():
    setup = _setup(dp=2, zero=3, mode="fp32")
    p = step_peak(DEBUG, Workload(2, 16), setup)
    assert p.lines["weights"] == p.lines["optimizer states"] == 0
    # AdamW steps the host's shards: the optimizer step holds the batch's targets alone
    terms = {t.label: v for t, v in stage_ledger(DEBUG, Workload(2, 16), setup, "first").terms(
        Phase.OPTIMIZER_STEP).items() if v}
    assert terms == {"targets": 2 * 16 * 8}
    plain = step_peak(DEBUG, Workload(2, 16), TrainingSetup(engine="fsdp2", dp=2, zero=3,
                                                             mode="fp32"))
    assert p.bytes < plain.bytes


def test_llama_shaped_peak_is_the_measured_one():
    # FSDPMemTracker shape-only on the fake accelerator, torch 2.13, Llama-3-8B at L 2, dp 8,
    # ZeRO-3, fp32, 1 x 2048 tokens, the model's buffers left out: 13,300,244,492 B, the root's
    # re-all-gather for backward; the phase model is 8 B below (as without offload)
    cfg = from_name("llama3-8b").replace(n_layer=2)
    p = step_peak(cfg, Workload(1, 2048), _setup(dp=8, zero=3, mode="fp32"))
    assert p.phase == "backward start, root all-gather"
    assert p.bytes == 13_300_244_484


@pytest.mark.parametrize("args,option", [
    (["--offload-optimizer", "cpu"], "--offload-optimizer"),
    (["--offload-param", "nvme"], "--offload-param"),
    (["--offload-param", "cpu", "--offload-optimizer", "nvme"], "--offload-optimizer"),
    (["--offload-param", "cpu", "--pp", "2"], "--offload-param"),
    (["--offload-param", "cpu", "--dp", "1"], "--offload-param"),
])
def test_what_cpu_offload_policy_does_not_run_is_one_line(args, option):
    r = CliRunner().invoke(cli, ["memory", "--preset", "debug", "--engine", "fsdp2",
                                 "--dp", "2", "--zero", "3", *args])
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], r.stderr


def test_offload_param_cpu_keeps_the_fsdp2_engine_and_prints_the_host():
    r = CliRunner().invoke(cli, ["memory", "--preset", "debug", "--engine", "fsdp2", "--dp",
                                 "2", "--zero", "3", "--offload-param", "cpu"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Assuming engine fsdp2,") and "CPUOffloadPolicy" in r.output
    assert "host memory per rank (offloaded)" in r.output
    both = CliRunner().invoke(cli, ["memory", "--preset", "debug", "--engine", "fsdp2", "--dp",
                                    "2", "--zero", "3", "--offload-param", "cpu",
                                    "--offload-optimizer", "cpu"])
    assert both.exit_code == 0 and both.output == r.output


# --------------------------------------------------------------------------- the twin

LLAMA_L2 = from_name("llama3-8b").replace(n_layer=2)
# fp32 on the debug preset and a Llama-3-8B of 2 blocks; MixedPrecisionPolicy (bf16
# parameters, fp32 reduction) on the Llama-shaped model. The set-ups are those of the CPU
# twins (device cpu): the fake accelerator dispatches SDPA as the CPU does (the Llama's saved
# activations are exact). It does not run the CPU's reduce-scatter copy-in cast (REDUCE_CAST,
# the debug preset's mixed peak: +32%), and its meta kernels save 640 B more of the debug
# preset's GPT-2 ops in bf16 (88,580 of 87,940 B): mixed is checked on the Llama-shaped model,
# whose peak is elsewhere. Peaks measured (FSDPMemTracker, buffers left out) against the
# model: debug fp32 ZeRO-3 -2.7% (the last block's backward), ZeRO-2 dp 4 4 B below; Llama
# fp32 dp 8 ZeRO-3 8 B below, dp 4 ZeRO-2 -0.95%; Llama mixed 4 B below at both.
TWIN = [
    (DEBUG, Workload(2, 16), 2, 3, "fp32"),
    (DEBUG, Workload(2, 16), 3, 3, "fp32"),
    (DEBUG, Workload(2, 16), 4, 2, "fp32"),
    (DEBUG, Workload(2, 16), 8, 3, "fp32"),
    (LLAMA_L2, Workload(1, 2048), 8, 3, "fp32"),
    (LLAMA_L2, Workload(1, 2048), 4, 2, "fp32"),
    (LLAMA_L2, Workload(1, 2048), 8, 3, "mixed"),
    (LLAMA_L2, Workload(1, 2048), 2, 2, "mixed"),
]


# the llama-style case a property draw found outside the bound (test_twin_small_llama_...)
SMALL = (from_name("debug", arch="llama").replace(n_embd=32, n_head=2, n_layer=2,
                                                   vocab_size=97), Workload(1, 16), 2, 3, "fp32")


def _measure(cases) -> list[dict]:
    """Each case's rank-0 checks ({name: (analytic, measured, ok)}) and host lines, from the
    fake-accelerator twin (`reference_model.verify.distributed_checks`, shape-only)."""
    from reference_model.verify import distributed_checks

    out = []
    for cfg, workload, dp, zero, mode in cases:
        setup = _setup(dp=dp, zero=zero, mode=mode)
        checks, results = distributed_checks(cfg, workload, setup, tensors="shape-only",
                                             ranks=(0,))
        out.append({"checks": {c.name: (c.analytic, c.measured, c.ok) for c in checks},
                    "host": dict(results[0].host)})
    return out


@pytest.fixture(scope="module")
def twin():
    """The twin's figures for TWIN and SMALL, measured in a fresh interpreter: autograd sizes
    its per-device ready queues once, at a process's first backward, so the fake accelerator
    must be registered before any backward runs (in a test process, other tests' have)."""
    pytest.importorskip("torch")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "tests.test_fsdp2_offload"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(TWIN)), ids=[
    f"{'llama' if cfg is LLAMA_L2 else 'debug'}-dp{dp}-zero{zero}-{mode}"
    for cfg, _wl, dp, zero, mode in TWIN])
def test_twin_measures_the_device_and_the_host(twin, i):
    from reference_model.verify import DIST_PEAK_TOLERANCE

    cfg, _workload, dp, zero, mode = TWIN[i]
    checks = twin[i]["checks"]
    for what in ("weight", "gradient", "optimizer state"):
        _analytic, measured, ok = checks[f"rank 0 {what} bytes"]
        assert measured == 0 and ok  # nothing of them on the device
    assert twin[i]["host"] == host(cfg, _setup(dp=dp, zero=zero, mode=mode))  # exact
    analytic, measured, _ok = checks["rank 0 step peak bytes"]
    # the FSDP2 fake-mode bound of the other twins (verify.DIST_PEAK_TOLERANCE), unchanged
    assert abs(analytic - measured) <= DIST_PEAK_TOLERANCE["fsdp2"] * measured
    assert all(ok for _a, _m, ok in checks.values()), checks


def test_twin_runs_offload_shape_only():
    pytest.importorskip("torch")
    from gptcalc.errors import ConfigError
    from reference_model.distributed import check_layout

    with pytest.raises(ConfigError) as e:
        check_layout(DEBUG, Workload(2, 16), _setup(dp=2, zero=3), "reference", "real")
    assert e.value.field == "tensors"


# --------------------------------------------------------------------------- recipes

TRL_FSDP2 = "trl/trl/accelerate_configs/fsdp2.yaml"  # huggingface/trl f2cd577, fsdp_version 2




def _recipe(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_torchtune_fsdp_cpu_offload_is_offload_param_cpu(tmp_path):
    text = ("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\n"
            "dtype: bf16\nfsdp_cpu_offload: {}\n")
    typed = ["--preset", "llama3.2-1b", "-B", "2", "--grad-accum", "1", "--mode", "bf16",
             "--optimizer", "adamw", "--loss", "chunked", "--recompute", "none", "--device",
             "cuda", "--engine", "fsdp2", "--zero", "3", "--dp", "4", "--no-keep-logits"]
    on = _recipe(tmp_path, "on.yaml", text.format("True"))
    assert memory("--recipe", on, "--gpus", "4") == memory(*typed, "--offload-param", "cpu",
                                                             "--gpus", "4")
    off = _recipe(tmp_path, "off.yaml", text.format("False"))
    assert memory("--recipe", off, "--gpus", "4") == memory(*typed, "--gpus", "4")


def test_torchtitan_enable_cpu_offload_is_offload_param_cpu_under_fsdp(tmp_path):
    base = ('[model]\nname = "llama3"\nflavor = "debugmodel"\n[activation_checkpoint]\n'
            'mode = "none"\n[parallelism]\ndata_parallel_shard_degree = {}\n'
            '[training]\nenable_cpu_offload = true\n')
    job = _recipe(tmp_path, "job.toml", base.format(2))
    plain = _recipe(tmp_path, "plain.toml", base.format(2).replace("true", "false"))
    with_offload = memory("--recipe", job)
    # the same file without the key, and --offload-param cpu typed
    assert with_offload == memory("--recipe", plain, "--offload-param", "cpu")
    assert with_offload != memory("--recipe", plain)
    one = _recipe(tmp_path, "one.toml", base.format(1))
    r = CliRunner().invoke(cli, ["memory", "--recipe", one])
    assert r.exit_code == 2 and "training.enable_cpu_offload" in r.stderr
    assert r.stderr.count("\n") == 1


def test_accelerate_fsdp_offload_params_is_offload_param_cpu_under_fsdp2(tmp_path):
    from pathlib import Path

    shipped = Path(__file__).resolve().parent / "recipes" / "shipped" / TRL_FSDP2
    text = shipped.read_text()
    assert "fsdp_offload_params: false" in text and "fsdp_version: 2" in text
    on = _recipe(tmp_path, "fsdp2.yaml", text.replace("fsdp_offload_params: false",
                                                      "fsdp_offload_params: true"))
    args = ("--preset", "llama3.2-1b")
    typed = ["--engine", "fsdp2", "--zero", "3", "--mode", "mixed", "--dp", "8", *args]
    assert memory("--recipe", on, *args) == memory(*typed, "--offload-param", "cpu")
    v1 = _recipe(tmp_path, "fsdp1.yaml", text.replace("fsdp_offload_params: false",
                                                      "fsdp_offload_params: true").replace(
        "fsdp_version: 2", "fsdp_version: 1\n  fsdp_backward_prefetch: BACKWARD_PRE"))
    r = CliRunner().invoke(cli, ["memory", "--recipe", v1, *args])
    assert r.exit_code == 2 and "fsdp_config.fsdp_offload_params" in r.stderr
    assert "FSDP1's CPU offload is not modelled" in r.stderr


def test_a_saved_config_reads_back_as_fsdp2_offload(tmp_path):
    saved = tmp_path / "run.toml"
    args = ["--preset", "debug", "--engine", "fsdp2", "--dp", "2", "--zero", "3",
            "--offload-param", "cpu"]
    r = CliRunner().invoke(cli, ["memory", *args, "--save-config", str(saved)])
    assert r.exit_code == 0, r.output
    assert memory("--config", str(saved)) == memory(*args)



@pytest.mark.xfail(strict=True, reason="the fake accelerator's artefact, not offload's: its "
                   "SwiGLU backward holds six more B x T x d_ff fp32 gradients than the CPU's")
def test_twin_small_llama_backward_under_offload(twin):
    # Found by a property draw over small models. FSDPMemTracker shape-only, torch 2.13,
    # llama-style debug model E 32, H 2, L 2, V 97 (d_ff 128), 1 x 16 tokens, dp 2, ZeRO-3,
    # fp32: 356,808 B measured against 309,504 B modelled (-13%), at the last block's c_fc
    # backward. The live storages there, with offload on the fake accelerator and without it
    # on the CPU, differ in the activations' gradients alone: seven 8,192 B (1 x 16 x 128
    # fp32) temporaries against one, 49,152 B; the parameters, all-gather output and weight
    # gradients are the same. FSDP2 without offload on the fake accelerator holds the same
    # seven there (598,152 B, the states beside them): the twin's device runs the MLP's
    # backward differently, so a small model whose MLP backward is its peak is outside what
    # this twin can check.
    from reference_model.verify import DIST_PEAK_TOLERANCE

    analytic, measured, _ok = twin[len(TWIN)]["checks"]["rank 0 step peak bytes"]
    assert abs(analytic - measured) <= DIST_PEAK_TOLERANCE["fsdp2"] * measured


if __name__ == "__main__":  # the `twin` fixture's fresh interpreter
    import json

    print(json.dumps(_measure([*TWIN, SMALL])))
