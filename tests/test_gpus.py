"""The accelerator catalogue: datasheet figures (dense only), the `cpu` entry, `gpus --json`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.gpus import GPUS, gpu, require_peak

REQUIRED = ("a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm",
            "h100-pcie", "h200", "b200", "l40s", "rtx-4090", "mi300x", "cpu",
            "rtx-3090", "a10g", "l4", "t4", "a6000", "h20")
KEYS = {"name", "memory_bytes", "usable_memory_bytes", "usable_source", "fp32_flops",
        "tf32_flops", "bf16_flops", "fp16_flops", "fp8_flops", "hbm_bytes_per_second", "source",
        "sms", "gpus_per_node", "nvswitch", "nvlink_sharp", "intra_node_busbw",
        "inter_node_busbw", "fabric_source", "matmul_efficiency", "attention_efficiency"}


def test_catalogue_has_the_required_lowercase_ids():
    assert set(REQUIRED) <= set(GPUS)
    assert all(name == name.lower() and GPUS[name].name == name for name in GPUS)


@pytest.mark.parametrize("name,field,value", [
    # NVIDIA A100 datasheet: BF16 312 TFLOPS (624 with sparsity), TF32 156, FP32 19.5;
    # 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s, 40GB 1,555 GB/s
    ("a100-sxm-80gb", "bf16_flops", 312e12), ("a100-sxm-80gb", "tf32_flops", 156e12),
    ("a100-sxm-80gb", "fp32_flops", 19.5e12), ("a100-sxm-80gb", "hbm_bytes_per_second", 2039e9),
    ("a100-pcie-80gb", "hbm_bytes_per_second", 1935e9),
    ("a100-sxm-40gb", "hbm_bytes_per_second", 1555e9),
    # NVIDIA H100 datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989.4 dense; FP8 3,958
    # with sparsity -> 1,978.9 dense; 3.35 TB/s
    ("h100-sxm", "bf16_flops", 989.4e12), ("h100-sxm", "fp8_flops", 1978.9e12),
    ("h100-sxm", "hbm_bytes_per_second", 3.35e12),
    # NVIDIA H200 datasheet: 141GB HBM3e at 4.8 TB/s
    ("h200", "hbm_bytes_per_second", 4.8e12), ("h200", "memory_bytes", 141 * 2**30),
    # NVIDIA L40S datasheet: FP8 733 TFLOPS (1,466 with sparsity), 864 GB/s
    ("l40s", "fp8_flops", 733e12), ("l40s", "hbm_bytes_per_second", 864e9),
    # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense, 192GB HBM3 at 5.3 TB/s
    ("mi300x", "bf16_flops", 1307.4e12), ("mi300x", "memory_bytes", 192 * 2**30),
    # GA102 whitepaper (RTX 3090): FP16/BF16 tensor 71 TFLOPS with FP32 accumulation, 936 GB/s
    ("rtx-3090", "bf16_flops", 71e12), ("rtx-3090", "hbm_bytes_per_second", 936e9),
    # NVIDIA A10 datasheet (A10G): BF16 125 TFLOPS (250 with sparsity), 24GB at 600 GB/s
    ("a10g", "bf16_flops", 125e12), ("a10g", "hbm_bytes_per_second", 600e9),
    # NVIDIA L4 datasheet: FP8 485 TFLOPS with sparsity -> 242.5 dense; 300 GB/s
    ("l4", "fp8_flops", 242.5e12), ("l4", "hbm_bytes_per_second", 300e9),
    # NVIDIA T4 datasheet: mixed precision 65 TFLOPS, 16GB at 320 GB/s
    ("t4", "fp16_flops", 65e12), ("t4", "memory_bytes", 16 * 2**30),
    # NVIDIA RTX A6000 datasheet: 48GB GDDR6 at 768 GB/s
    ("a6000", "memory_bytes", 48 * 2**30), ("a6000", "hbm_bytes_per_second", 768e9),
    # NVIDIA HGX H20: 96GB HBM3 at 4.0 TB/s, BF16 148 TFLOPS dense
    ("h20", "memory_bytes", 96 * 2**30), ("h20", "bf16_flops", 148e12),
])
def test_datasheet_figures(name, field, value):
    assert getattr(GPUS[name], field) == pytest.approx(value, rel=1e-12)


def test_no_sparsity_figure_and_no_fp8_on_ampere():
    assert GPUS["h100-sxm"].bf16_flops != pytest.approx(1979e12, rel=1e-3)  # the sparse figure
    assert all(GPUS[n].fp8_flops is None for n in REQUIRED if n.startswith("a100"))
    for g in GPUS.values():  # tensor-core 16-bit at least the FP32 rate, never 2x a dense peer
        if g.bf16_flops is not None:
            assert g.bf16_flops >= g.fp32_flops and g.fp16_flops == g.bf16_flops
            assert g.source
    # Turing has fp16 tensor cores and no bf16: infer and serve take fp16 weights there
    t4 = GPUS["t4"]
    assert t4.bf16_flops is None and require_peak(t4, "fp16") == 65e12


def test_cpu_has_no_figures_and_is_refused_by_name():
    cpu = gpu("cpu")
    assert cpu.memory_bytes is None and cpu.bf16_flops is None and cpu.hbm_bytes_per_second is None
    with pytest.raises(ConfigError) as e:
        require_peak(cpu, "bf16")
    assert e.value.field == "gpu"


def test_a_precision_the_gpu_lacks_names_precision():
    with pytest.raises(ConfigError) as e:
        require_peak(gpu("a100-sxm-80gb"), "fp8")
    assert e.value.field == "precision"


def test_gpus_json():
    r = CliRunner().invoke(cli, ["gpus", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) == {"schema", "gpus"}
    rows = out["gpus"]
    assert {row["name"] for row in rows} == set(GPUS)
    assert all(set(row) == KEYS for row in rows)
    a100 = next(row for row in rows if row["name"] == "a100-sxm-80gb")
    assert a100["fp8_flops"] is None and a100["bf16_flops"] == 312e12


def test_gpus_table_labels_units():
    r = CliRunner().invoke(cli, ["gpus"])
    assert r.exit_code == 0 and "TFLOP/s" in r.stdout and "GiB" in r.stdout and "GB/s" in r.stdout


def test_new_commands_run_in_a_real_process():
    """One smoke test for gpus, time, infer and params --lora-rank, in one shell process."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    py = shlex.quote(sys.executable)
    cmds = ["gpus --json", "time --preset gpt2 --tokens 1e9 --json",
            "infer --preset llama2-7b --gpu a100-sxm-80gb --json",
            "params --preset llama2-7b --lora-rank 8 --json"]
    # and, in-process there, none of them imports torch, fvcore or matplotlib
    check = ("import sys; from click.testing import CliRunner; from gptcalc.cli import cli; "
             f"[CliRunner().invoke(cli, c.split()) for c in {cmds!r}]; "
             "assert not {'torch', 'fvcore', 'matplotlib'} & set(sys.modules), 'heavy import'")
    script = (" && ".join(f"{py} -m gptcalc {c} > /dev/null" for c in cmds)
              + f" && {py} -c {shlex.quote(check)} && echo ok")
    r = subprocess.run(["sh", "-c", script], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


GiB = 2**30


@pytest.mark.parametrize("name,gib", [
    # vLLM's "Memory profiling results" on an H100: "total_gpu_memory 79.22GiB"
    # (github.com/vllm-project/vllm pull 10511)
    ("h100-sxm", "79.22"),
    # vLLM on an RTX 3090: "total_gpu_memory=23.58GiB" (github.com/vllm-project/vllm issue 10517)
    ("rtx-3090", "23.58"),
    # PyTorch's OOM message "GPU 0 has a total capacity of N GiB": A100 80GB
    # (lianqi1008/Control-GIC issue 6), A100 40GB (TianheWu/CoSeR issue 10), RTX 4090
    # (3DTopia/Phidias-Diffusion issue 8), A10 (OpenBMB/MiniCPM-V issue 640), Colab T4
    # (hpcaitech/Open-Sora issue 697)
    ("a100-sxm-80gb", "79.14"), ("a100-sxm-40gb", "39.50"), ("rtx-4090", "23.64"),
    ("a10g", "22.18"), ("t4", "14.75"),
])
def test_usable_memory_is_the_published_mem_get_info_total(name, gib):
    from gptcalc.units import parse_bytes

    # as `--gpu-memory 79.22GiB` reads the printed figure
    assert GPUS[name].usable_memory_bytes == parse_bytes(f"{gib}GiB", exact=False)


def test_every_card_has_a_usable_figure_below_its_datasheet_and_a_source():
    for g in GPUS.values():
        if g.memory_bytes is None:
            assert g.usable_memory_bytes is None
            continue
        # 24 GB cards 22-23.7 GiB, 80 GB cards about 79.2 GiB: never the datasheet's
        assert 0.9 * g.memory_bytes < g.usable_memory_bytes < g.memory_bytes, g.name
        assert g.usable_source, g.name


def test_serve_and_infer_size_against_the_usable_figure_and_say_so():
    r = CliRunner().invoke(cli, ["serve", "--preset", "llama3-8b", "--gpu", "h100-sxm",
                                 "--json"])
    out = json.loads(r.stdout)
    assert out["gpu_memory_bytes"] == GPUS["h100-sxm"].usable_memory_bytes
    assert "79.22 GiB (h100-sxm: torch.cuda.mem_get_info's total" in out["assumptions"]
    assert "datasheet 80.00 GiB" in out["assumptions"]
    r = CliRunner().invoke(cli, ["infer", "--preset", "llama3-8b", "--gpu", "l4", "--json"])
    assert json.loads(r.stdout)["memory_bytes"] == GPUS["l4"].usable_memory_bytes
    text = CliRunner().invoke(cli, ["infer", "--preset", "llama3-8b", "--gpu", "l4"]).stdout
    assert "22.19 GiB usable" in text.splitlines()[0]


@pytest.mark.parametrize("name,field,value", [
    # NVIDIA H100 whitepaper: 132 SMs (SXM5), 114 (PCIe); A100 whitepaper: 108; MI300X: 304 CUs
    ("h100-sxm", "sms", 132), ("h100-pcie", "sms", 114), ("a100-sxm-80gb", "sms", 108),
    ("mi300x", "sms", 304),
    # NCCL's maintainer: ring busbw ~370 GB/s on 8 H100 (github.com/NVIDIA/nccl-tests/issues/212)
    ("h100-sxm", "intra_node_busbw", 370e9),
    # nccl-tests issue 149: ~200 GB/s all-reduce busbw on 8 A100 80GB SXM
    ("a100-sxm-80gb", "intra_node_busbw", 200e9),
    # DGX H100: 8 x 400 Gb/s ConnectX-7; DGX A100: 8 x 200 Gb/s ConnectX-6 (one NIC per GPU)
    ("h100-sxm", "inter_node_busbw", 50e9), ("a100-sxm-80gb", "inter_node_busbw", 25e9),
    ("h100-sxm", "gpus_per_node", 8),
])
def test_fabric_figures(name, field, value):
    assert getattr(GPUS[name], field) == pytest.approx(value, rel=1e-12)


def test_fitted_efficiencies_are_shares_of_the_peak():
    # fitted on MPT's published runs (docs/time.md); a share of the dense peak, or None
    for g in GPUS.values():
        for share in (g.matmul_efficiency, g.attention_efficiency):
            assert share is None or 0 < share <= 1
    assert GPUS["a100-sxm-80gb"].matmul_efficiency == 0.66
    assert GPUS["h100-sxm"].attention_efficiency == 0.18


def test_every_accelerator_has_its_fabric_and_a_source():
    for g in GPUS.values():
        if g.name == "cpu":
            continue
        assert g.sms and g.gpus_per_node >= 1 and g.fabric_source
        assert 0 < g.inter_node_busbw < g.intra_node_busbw < g.hbm_bytes_per_second


def test_serving_reads_sms_and_nvlink_sharp_from_the_catalogue():
    from gptcalc.inference.pool import NVSWITCH_GPUS, default_non_torch
    from gptcalc.inference.sampler import SMS, sm_count
    assert SMS == {g.name: g.sms for g in GPUS.values() if g.sms}
    assert set(NVSWITCH_GPUS) == {"h100-sxm", "h200", "b200"}
    assert sm_count("h100-sxm") == 132 and sm_count("cpu") == 0
    assert default_non_torch("h100-sxm", 2) > default_non_torch("a100-sxm-80gb", 2)


@pytest.mark.parametrize("alias,name", [("h100", "h100-sxm"), ("H100", "h100-sxm"),
                                        ("a100", "a100-sxm-80gb"), ("4090", "rtx-4090")])
def test_aliases(alias, name):
    assert gpu(alias).name == name


def test_a_typo_gets_one_line_naming_gpu_and_the_nearest_names():
    r = CliRunner().invoke(cli, ["time", "--preset", "gpt2", "--gpu", "h100-sxn"])
    assert r.exit_code == 2
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "--gpu" in lines[0] and "did you mean h100-sxm" in lines[0]


def test_a_toy_gpu_added_through_the_catalogue_alone(monkeypatch):
    """One entry is all a card needs: `gpus` lists it, `time` and `serve` read its figures."""
    import dataclasses
    from gptcalc import gpus as catalogue
    toy = dataclasses.replace(GPUS["h100-sxm"], name="toy-gpu", bf16_flops=100e12, sms=7,
                              source="toy", nvlink_sharp=False)
    monkeypatch.setitem(catalogue.GPUS, "toy-gpu", toy)
    from gptcalc.inference.sampler import sm_count
    assert sm_count("toy-gpu") == 7
    r = CliRunner().invoke(cli, ["gpus", "--json"])
    assert "toy-gpu" in [g["name"] for g in json.loads(r.output)["gpus"]]
    r = CliRunner().invoke(cli, ["time", "--preset", "gpt2", "--gpu", "toy-gpu", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["peak_flops"] == 100e12
