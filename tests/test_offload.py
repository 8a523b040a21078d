"""DeepSpeed's ZeRO-Offload and ZeRO-Infinity (offload_optimizer, offload_param): what leaves
the device and what the host holds per rank (gptcalc.memory.engines.deepspeed.deepspeed_host),
against DeepSpeed's own structures on its CPU accelerator (2 gloo ranks, a torch AdamW client
with zero_force_ds_cpu_optimizer false), and the ds_config and command-line readers."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.cli import cli
from gptcalc.dsconfig import ds_config_dict, ds_settings
from gptcalc.errors import ConfigError
from gptcalc.memory import step_peak
from gptcalc.memory.engines import resident
from gptcalc.memory.engines import deepspeed as ds
from gptcalc.memory.ledger import OPTIMIZER_TEMPORARIES, Phase
from gptcalc.memory.peak import stage_ledger

LLAMA = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                  vocab_size=1601, block_size=32)
SMALL = {"reduce_bucket_size": 4096, "allgather_bucket_size": 4096,
         "stage3_prefetch_bucket_size": 4096, "stage3_param_persistence_threshold": 512,
         "stage3_max_live_parameters": 65536}


def _setup(zero: int, **offload: str) -> TrainingSetup:
    return TrainingSetup(mode="mixed", dp=2, zero=zero, engine="deepspeed",
                         engine_settings=tuple(SMALL.items()) + tuple(offload.items()))


def test_offload_sections_are_read_and_written_back_nested():
    raw = {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/nvme", "pin_memory": True, "buffer_count": 6},
        "offload_param": {"device": "cpu", "max_in_cpu": 10}}}
    pairs = ds_settings(raw, LLAMA)["deepspeed_zero"]
    assert pairs == (("offload_optimizer", "nvme"), ("offload_optimizer_buffer_count", 6),
                     ("offload_param", "cpu"), ("offload_param_max_in_cpu", 10))
    setup = TrainingSetup(mode="mixed", dp=2, zero=3, engine="deepspeed", engine_settings=pairs)
    zero = ds_config_dict(setup, Workload(1, 8))["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "buffer_count": 6}
    assert zero["offload_param"] == {"device": "cpu", "max_in_cpu": 10}
    # a device of none reads as no offload
    none = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    assert ds_settings(none, LLAMA)["deepspeed_zero"] == ()


@pytest.mark.parametrize("zero, words", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs zero_optimization.stage 3"),
    ({"stage": 3, "offload_param": {"device": "disk"}}, "none, cpu or nvme"),
    ({"stage": 3, "offload_param": {"device": "cpu", "bufer_size": 1}}, "unknown keys bufer_size"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 2}}, "ratio must be in"),
])
def test_bad_offload_sections_name_the_key(zero, words):
    with pytest.raises(ConfigError, match=words):
        ds_settings({"zero_optimization": zero}, LLAMA)


def test_stage2_moves_the_optimizer_to_the_host_and_keeps_a_staging_buffer():
    base, off = _setup(2), _setup(2, offload_optimizer="cpu")
    kept, moved = resident(LLAMA, base, "first", 0), resident(LLAMA, off, "first", 0)
    host = ds.deepspeed_host(LLAMA, off, 0)
    # the states that left the device are the host's, byte for byte
    assert host[ds.HOST_STATES] == kept["optimizer states"] > 0
    assert moved["optimizer states"] == 0 and moved["weights"] == kept["weights"]
    # largest parameter: the 1601 x 64 embedding, bf16 (temp_grad_buffer_for_gpu_offload)
    assert moved[ds.OFFLOAD_STAGING.label] == 2 * 1601 * 64 == host[ds.HOST_STAGING]
    assert ds.deepspeed_host(LLAMA, base, 0) == {}


def test_the_optimizer_step_runs_on_the_host():
    wl = Workload(2, 32)
    for zero in (1, 2, 3):
        ledger = stage_ledger(LLAMA, wl, _setup(zero, offload_optimizer="cpu"), "first")
        assert ledger.get(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES) == 0
        assert stage_ledger(LLAMA, wl, _setup(zero), "first").get(
            Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES) > 0
        assert step_peak(LLAMA, wl, _setup(zero, offload_optimizer="cpu")).bytes < step_peak(
            LLAMA, wl, _setup(zero)).bytes


def test_stage3_param_offload_keeps_only_the_persistent_parameters_on_the_device():
    off = _setup(3, offload_optimizer="cpu", offload_param="cpu")
    sizes = ds._sizes(LLAMA, off, 0)
    st = ds.deepspeed_rank_states(LLAMA, off, 0)
    # norms of 64 elements persist (threshold 512): 2 per block x 2 blocks + the final norm
    assert st.weights == 2 * ds.stage3_persistent_elements(sizes, off) == 2 * 64 * 5
    assert st.gradients == 0 and st.optimizer == 0
    host = ds.deepspeed_host(LLAMA, off, 0)
    part = ds.stage3_partition_elements(sizes, 2)
    assert host[ds.HOST_PARAMS] == host[ds.HOST_GRAD16] == 2 * part
    assert host[ds.HOST_FP32_GRADS] == 4 * part


def test_nvme_host_buffers_follow_the_swappers_arithmetic():
    # DeepSpeed cannot swap to NVMe here (the async_io op is not built): the swappers'
    # arithmetic instead. partitioned_param_swapper.py, AsyncPartitionedParameterSwapper:
    # `self.buffers` = buffer_count x _io_aligned_numel(buffer_size) elements of the 16-bit
    # dtype, aligned to AIO_ALIGNED_BYTES (1024) / 2 = 512 elements: 1e8 rounds up to
    # 195,313 x 512 = 100,000,256; 5 of them x 2 B. optimizer_utils.py, OptimizerSwapper:
    # SwapBufferManager(num_elems=_io_aligned_numel(largest_numel), count=buffer_count) in
    # fp32, 256-element alignment.
    off = _setup(3, offload_optimizer="nvme", offload_param="nvme")
    host = ds.deepspeed_host(LLAMA, off, 0)
    assert host[ds.HOST_PARAM_SWAP] == 5 * 100_000_256 * 2
    largest = max(ds.stage3_sub_group_elements(ds._sizes(LLAMA, off, 0), off))
    assert host[ds.HOST_OPT_SWAP] == 4 * 4 * (-(-largest // 256) * 256)
    assert ds.HOST_STATES not in host
    # at most max_in_cpu partition elements stay in host memory
    capped = _setup(3, offload_param="nvme", offload_param_max_in_cpu=1000)
    assert ds.deepspeed_host(LLAMA, capped, 0)[ds.HOST_PARAMS] == 2 * 1000


@pytest.mark.parametrize("args, field", [
    (["--zero", "2", "--offload-param", "cpu"], "offload-param"),
    (["--zero", "0", "--offload-optimizer", "cpu"], "offload-optimizer"),
    (["--zero", "3", "--engine", "fsdp2", "--offload-optimizer", "cpu"], "offload-optimizer"),
])
def test_cli_refuses_offloads_deepspeed_does_not_run(args, field):
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "-B", "1", "--dp", "2", *args])
    assert r.exit_code != 0 and field in r.output, r.output


def test_cli_host_json_lines_sum_and_scale_per_node():
    args = ["memory", "--preset", "gpt2", "-B", "1", "--dp", "4", "--zero", "3", "--json",
            "--offload-optimizer", "cpu", "--offload-param", "cpu", "--gpus-per-node", "4"]
    out = json.loads(CliRunner().invoke(cli, args).stdout)
    assert out["training"]["engine"] == "deepspeed"
    assert sum(out["host"].values()) == out["host_total"] > 0
    assert out["host_per_node"] == 4 * out["host_total"]
    assert out["optimizer"] == 0 and out["gradients"] == 0
    plain = json.loads(CliRunner().invoke(cli, args[:10]).stdout)
    assert plain["host"] == {} and plain["host_total"] == 0
    # what left the device is on the host: the optimizer, gradients and 16-bit partitions
    assert out["host"][ds.HOST_STATES] == plain["optimizer"]


TWIN_CASES = [(2, {"offload_optimizer": "cpu"}), (3, {"offload_optimizer": "cpu"}),
              (3, {"offload_optimizer": "cpu", "offload_param": "cpu"})]


@pytest.mark.slow
@pytest.mark.parametrize("zero, offload", TWIN_CASES, ids=lambda c: str(c))
def test_deepspeed_twin_host_lines_are_deepspeeds_structures(zero, offload):
    pytest.importorskip("deepspeed")
    from reference_model.distributed import run_layout

    setup = _setup(zero, **offload)
    for r in run_layout(LLAMA, Workload(2, 32), setup):
        assert ds.deepspeed_host(LLAMA, setup, r.rank) == r.host, r.rank
        assert r.optimizer == r.host[ds.HOST_STATES]
        # on the CPU accelerator the device is the host: what the rank keeps is both, less
        # DeepSpeed's own 0-d fp32 scalars gptcalc does not model (measured: 4 B here, of
        # about 3 MB; tests/test_deepspeed.py: 4 B at stages 1-2, 8 B at stage 3)
        both = sum(resident(LLAMA, setup, "first", r.rank).values()) + sum(r.host.values())
        assert 0 <= r.resident - both <= 8, (both, r.resident)
