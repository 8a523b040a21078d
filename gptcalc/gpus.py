"""A catalogue of accelerators: memory, dense peak FLOP/s per precision, memory bandwidth.

Every figure is a datasheet's, and every FLOP/s figure is DENSE: NVIDIA and AMD print a second,
doubled figure "with sparsity" (2:4 structured sparsity), which no dense training or inference
run reaches. H100 SXM bf16 is 989.4 TFLOP/s dense, 1,979 with sparsity; only the first is here.

Units: FLOP/s and bytes/s in SI (a datasheet's "2,039 GB/s" is 2.039e12 bytes/s). Memory sizes
are binary: an "80GB" A100 or H100 holds 80 GiB (nvidia-smi reports 81,920 MiB), so a
datasheet's "N GB" of HBM or GDDR is stored as N GiB.

Usable memory: what `torch.cuda.mem_get_info()` reports as the total, the figure serving engines
size against (vLLM logs it as total_gpu_memory), below the datasheet's on every card (the driver
and ECC keep the rest): an "80GB" H100 reports 79.22 GiB. Each figure is a published log's
(vLLM's, or PyTorch's out-of-memory message "GPU 0 has a total capacity of ..."), printed to
0.01 GiB; where none was found, the comment says how it was derived.

`cpu` measures nothing: it has no peak figures (None), so `time` and `infer` refuse it with a
message rather than dividing by zero; it exists so that a CPU run can be named.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import ConfigError, one_of
from .units import parse_bytes

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")

T = 10**12  # TFLOP/s, TB/s
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator. FLOP/s are dense peaks; None where the datasheet gives no figure."""

    name: str  # lowercase id, e.g. "h100-sxm"
    memory_bytes: int | None
    fp32_flops: float | None  # non-tensor FP32 (CUDA cores / vector units)
    tf32_flops: float | None
    bf16_flops: float | None  # with FP32 accumulation, as PyTorch's matmuls run
    fp16_flops: float | None
    fp8_flops: float | None
    hbm_bytes_per_second: float | None  # memory bandwidth (HBM, or GDDR where so noted)
    source: str
    usable_memory_bytes: int | None = None  # torch.cuda.mem_get_info()'s total (USABLE)
    usable_source: str = ""  # the log it was read from, or how it was derived
    # streaming multiprocessors (NVIDIA's datasheets and architecture whitepapers; compute
    # units on AMD's datasheet)
    sms: int | None = None
    gpus_per_node: int = 1  # cards per server as sold (an 8-GPU HGX/DGX board)
    nvswitch: bool = False  # every card of a node reaches every other through NVSwitch
    nvlink_sharp: bool = False  # NCCL's NVLink SHARP (NVLS) buffers, logged at tp >= 2
    intra_node_busbw: float | None = None  # bytes/s: NCCL ring bus bandwidth within a node
    inter_node_busbw: float | None = None  # bytes/s per GPU across nodes: its NIC's share
    fabric_source: str = ""  # where the node size and bandwidths come from
    # shares of the dense peak that large GEMMs and a flash-type attention kernel reach in
    # training (gptcalc.time.compute); None: the time model's defaults
    matmul_efficiency: float | None = None
    attention_efficiency: float | None = None

    def peak_flops(self, precision: str) -> float | None:
        """Dense peak FLOP/s at `precision` (one of PRECISIONS), None when there is none."""
        one_of("precision", precision, PRECISIONS)
        return getattr(self, f"{precision}_flops")


_A100 = "NVIDIA A100 Tensor Core GPU datasheet"

GB = 10**9  # GB/s of a link or bus bandwidth, SI

# Fabrics. Intra-node figures are NCCL bus bandwidths (nccl-tests' busbw: all-reduce busbw =
# algbw x 2(n-1)/n, all-gather and reduce-scatter busbw = algbw x (n-1)/n) of the ring
# algorithm at large sizes; inter-node figures are the line rate of the NICs a node has per GPU.
# HGX H100/H200: 450 GB/s NVLink line rate per direction; "with the protocol overhead (~20%)
# NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when
# running non-allreduce operations, or when running with NCCL_ALGO=RING" (NCCL's maintainer,
# github.com/NVIDIA/nccl-tests/issues/212); NVLink SHARP all-reduce reaches ~480 (ibid.) and
# 475 GB/s on 8 H200 (github.com/NVIDIA/nccl-tests/issues/272). DGX H100 datasheet: 8 single-port
# ConnectX-7 at 400 Gb/s, one per GPU = 50 GB/s.
# Efficiencies FITTED (benchmarks/fit_time.py) on the fit subset of MPT's published runs
# (llm-foundry scripts/train/benchmarking/README.md, A100 80GB and H100 80GB BF16 tables, rows
# at even positions); docs/time.md gives the error on the rest. MPT ran Triton flash attention
# in 2023, below FlashAttention-2's 50-73% of the A100's peak (Dao 2023) and far below
# FlashAttention-3's 75% of the H100's (Shah et al. 2024).
_A100_FIT = dict(matmul_efficiency=0.66, attention_efficiency=0.32)
_H100_FIT = dict(matmul_efficiency=0.50, attention_efficiency=0.18)
_HGX_HOPPER = dict(gpus_per_node=8, nvswitch=True, intra_node_busbw=370 * GB,
                   inter_node_busbw=50 * GB,
                   fabric_source="NVLink ring busbw 370 GB/s (github.com/NVIDIA/nccl-tests/issues/"
                                 "212); 8 x 400 Gb/s ConnectX-7, one per GPU (DGX H100 datasheet)")
# HGX A100: 8 x A100 80GB SXM on NVLink give all-reduce busbw ~200 GB/s
# (github.com/NVIDIA/nccl-tests/issues/149) and 208 GB/s (.../issues/178); DGX A100 datasheet:
# 8 single-port ConnectX-6 at 200 Gb/s HDR, one per GPU = 25 GB/s.
_HGX_A100 = dict(gpus_per_node=8, nvswitch=True, intra_node_busbw=200 * GB,
                 inter_node_busbw=25 * GB,
                 fabric_source="NVLink all-reduce busbw ~200 GB/s on 8 A100 (github.com/NVIDIA/"
                               "nccl-tests/issues/149); 8 x 200 Gb/s ConnectX-6, one per GPU (DGX "
                               "A100 datasheet)")
# PCIe servers of 8 cards without NVLink: collectives cross PCIe and the host bridges; all-reduce
# busbw drops to ~20 GB/s on A100s so placed (github.com/NVIDIA/nccl-tests/issues/178), taken
# for every PCIe Gen4 card; Gen5 cards (H100 PCIe) twice it (derived: twice the link rate).
# Across nodes: one 200 Gb/s NIC per 8 cards is ASSUMED (no datasheet fixes a PCIe server's
# network): 25 GB/s / 8 per GPU.
_PCIE_GEN4 = dict(gpus_per_node=8, intra_node_busbw=20 * GB, inter_node_busbw=25 * GB / 8,
                  fabric_source="PCIe all-reduce busbw ~20 GB/s (github.com/NVIDIA/nccl-tests/"
                                "issues/178); assumed one 200 Gb/s NIC per 8-card server")
_PCIE_GEN5 = {**_PCIE_GEN4, "intra_node_busbw": 40 * GB,
              "fabric_source": "derived: twice the PCIe Gen4 busbw (Gen5 doubles the link); "
                               "assumed one 200 Gb/s NIC per 8-card server"}
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (dense: half the sparsity figure)"


def _a100(name: str, memory_gib: int, bandwidth: float, form: str) -> GPU:
    # A100 datasheet: FP32 19.5 TFLOPS; TF32 156 (312 with sparsity); BF16 and FP16 312 (624
    # with sparsity); no FP8. The same peaks for the SXM and PCIe cards; memory and bandwidth
    # differ by model.
    # 108 SMs (NVIDIA A100 Tensor Core GPU architecture whitepaper)
    fabric = _HGX_A100 if form == "SXM" else _PCIE_GEN4
    return GPU(name, memory_gib * GiB, 19.5 * T, 156 * T, 312 * T, 312 * T, None, bandwidth,
               f"{_A100}: A100 {memory_gib}GB {form}", sms=108, **fabric, **_A100_FIT)


GPUS: dict[str, GPU] = {g.name: g for g in (
    # A100 datasheet: 40GB HBM2 at 1,555 GB/s (SXM and PCIe), 80GB HBM2e at 2,039 GB/s (SXM)
    # and 1,935 GB/s (PCIe).
    _a100("a100-sxm-40gb", 40, 1555e9, "SXM"),
    _a100("a100-sxm-80gb", 80, 2039e9, "SXM"),
    _a100("a100-pcie-40gb", 40, 1555e9, "PCIe"),
    _a100("a100-pcie-80gb", 80, 1935e9, "PCIe"),
    # H100 datasheet, SXM: FP32 67 TFLOPS; TF32 989 / BF16 1,979 / FP16 1,979 / FP8 3,958
    # TFLOPS "with sparsity"; dense = half: 494.7, 989.4, 989.4, 1,978.9 (Hopper whitepaper).
    # 80GB HBM3, 3.35 TB/s.
    GPU("h100-sxm", 80 * GiB, 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T, 3.35 * T,
        f"{_H100}: H100 SXM", sms=132, nvlink_sharp=True, **_HGX_HOPPER, **_H100_FIT),
    # H100 datasheet, PCIe: FP32 51 TFLOPS; TF32 756 / BF16 1,513 / FP16 1,513 / FP8 3,026
    # "with sparsity", dense = half. 80GB HBM2e, 2 TB/s.
    GPU("h100-pcie", 80 * GiB, 51 * T, 378 * T, 756 * T, 756 * T, 1513 * T, 2.0 * T,
        f"{_H100}: H100 PCIe", sms=114, **_PCIE_GEN5),
    # H200 datasheet (SXM): the H100's compute (BF16 1,979 and FP8 3,958 TFLOPS with sparsity)
    # with 141GB HBM3e at 4.8 TB/s.
    GPU("h200", 141 * GiB, 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T, 4.8 * T,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)", sms=132, nvlink_sharp=True,
        **_HGX_HOPPER),
    # HGX B200 datasheet, per GPU (8 per board): FP32 80 TFLOPS; TF32 2.2, FP16/BF16 4.5 and
    # FP8 9 PFLOPS with sparsity, dense = half; 1,440GB HBM3e per board = 180GB per GPU,
    # 8 TB/s per GPU.
    GPU("b200", 180 * GiB, 80 * T, 1100 * T, 2250 * T, 2250 * T, 4500 * T, 8.0 * T,
        "NVIDIA HGX B200 datasheet (per GPU of an 8-GPU board, 1,000 W)", sms=148,
        nvlink_sharp=True, gpus_per_node=8, nvswitch=True,
        # NVLink 5: 900 GB/s per direction; busbw derived at the H100's ring share 370 / 450;
        # DGX B200 datasheet: 8 x 400 Gb/s ConnectX-7 = 50 GB/s per GPU
        intra_node_busbw=900 * GB * 370 / 450, inter_node_busbw=50 * GB,
        fabric_source="derived: NVLink 5's 900 GB/s per direction at the H100's ring share "
                      "370/450; 8 x 400 Gb/s ConnectX-7 (DGX B200 datasheet)"),
    # L40S datasheet: FP32 91.6 TFLOPS; TF32 183 (366 with sparsity), BF16 and FP16 362.05
    # (733 with sparsity), FP8 733 (1,466 with sparsity); 48GB GDDR6 at 864 GB/s.
    GPU("l40s", 48 * GiB, 91.6 * T, 183 * T, 362.05 * T, 362.05 * T, 733 * T, 864e9,
        "NVIDIA L40S datasheet (48GB GDDR6, not HBM)", sms=142, **_PCIE_GEN4),
    # NVIDIA Ada GPU architecture whitepaper, appendix (GeForce RTX 4090): FP32 82.6 TFLOPS;
    # TF32 82.6, BF16 165.2, FP16 165.2 (330.3 with FP16 accumulation), FP8 330.3 (660.6
    # with FP16 accumulation) TFLOPS dense with FP32 accumulation; 24GB GDDR6X at 1,008 GB/s.
    GPU("rtx-4090", 24 * GiB, 82.6 * T, 82.6 * T, 165.2 * T, 165.2 * T, 330.3 * T, 1008e9,
        "NVIDIA Ada GPU architecture whitepaper (RTX 4090; FP32 accumulation; GDDR6X)", sms=128,
        **_PCIE_GEN4),
    # AMD Instinct MI300X datasheet: peak FP32 matrix 163.4 TFLOPS, TF32 653.7, FP16 and BF16
    # 1,307.4, FP8 2,614.9 TFLOPS dense (double with structured sparsity); 192GB HBM3, 5.3 TB/s.
    GPU("mi300x", 192 * GiB, 163.4 * T, 653.7 * T, 1307.4 * T, 1307.4 * T, 2614.9 * T, 5.3 * T,
        "AMD Instinct MI300X accelerator datasheet", sms=304, gpus_per_node=8,
        # Infinity Fabric: 7 links of 64 GB/s per direction to the other 7 cards (datasheet:
        # 896 GB/s aggregate bidirectional); busbw derived at the H100's ring share 370 / 450;
        # 8 x 400 Gb/s NICs per platform, one per GPU (AMD Instinct MI300X platform brief)
        intra_node_busbw=448 * GB * 370 / 450, inter_node_busbw=50 * GB,
        fabric_source="derived: 7 x 64 GB/s Infinity Fabric per direction at the H100's ring "
                      "share 370/450; 400 Gb/s NIC per GPU (MI300X platform)"),
    # NVIDIA Ampere GA102 whitepaper, appendix (GeForce RTX 3090): FP32 35.6 TFLOPS; TF32 35.6,
    # BF16 and FP16 71 TFLOPS dense with FP32 accumulation (142 with FP16 accumulation or with
    # sparsity); no FP8; 24GB GDDR6X at 936 GB/s.
    GPU("rtx-3090", 24 * GiB, 35.6 * T, 35.6 * T, 71 * T, 71 * T, None, 936e9,
        "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090; FP32 accumulation; GDDR6X)",
        sms=82, **_PCIE_GEN4),
    # NVIDIA A10 datasheet: FP32 31.2 TFLOPS; TF32 62.5 (125 with sparsity), BF16 and FP16 125
    # (250 with sparsity); 24GB GDDR6 at 600 GB/s. The A10G (AWS G5 instances) is the same
    # GA102 part with the same 24GB at 600 GB/s; AWS publishes no other peaks for it.
    GPU("a10g", 24 * GiB, 31.2 * T, 62.5 * T, 125 * T, 125 * T, None, 600e9,
        "NVIDIA A10 Tensor Core GPU datasheet (A10G: AWS's A10; GDDR6)", sms=80, **_PCIE_GEN4),
    # NVIDIA L4 datasheet: FP32 30.3 TFLOPS; TF32 120, BF16 and FP16 242, FP8 485 TFLOPS with
    # sparsity, dense = half; 24GB GDDR6 at 300 GB/s.
    GPU("l4", 24 * GiB, 30.3 * T, 60 * T, 121 * T, 121 * T, 242.5 * T, 300e9,
        "NVIDIA L4 Tensor Core GPU datasheet (dense: half the sparsity figure; GDDR6)", sms=58,
        **_PCIE_GEN4),
    # NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed precision (FP16/FP32) 65 TFLOPS; no TF32, BF16
    # or FP8 (Turing); 16GB GDDR6 at 320 GB/s.
    GPU("t4", 16 * GiB, 8.1 * T, None, None, 65 * T, None, 320e9,
        "NVIDIA T4 Tensor Core GPU datasheet (Turing: fp16, no bf16; GDDR6)", sms=40,
        **_PCIE_GEN4),
    # NVIDIA RTX A6000 datasheet: FP32 38.7 TFLOPS; tensor TF32 77.4, BF16 and FP16 154.8
    # TFLOPS dense (309.7 with sparsity); 48GB GDDR6 at 768 GB/s.
    GPU("a6000", 48 * GiB, 38.7 * T, 77.4 * T, 154.8 * T, 154.8 * T, None, 768e9,
        "NVIDIA RTX A6000 datasheet (GDDR6 with ECC)", sms=84, **_PCIE_GEN4),
    # NVIDIA H20 (HGX H20) product brief: FP32 44 TFLOPS; TF32 74, BF16 and FP16 148, FP8 296
    # TFLOPS dense; 96GB HBM3 at 4.0 TB/s.
    GPU("h20", 96 * GiB, 44 * T, 74 * T, 148 * T, 148 * T, 296 * T, 4.0 * T,
        "NVIDIA HGX H20 product brief (dense figures)", sms=78,
        # the H100's NVLink 4 and network; no log of NCCL's NVLS buffers on it, so not marked
        **_HGX_HOPPER),
    # No figures: a CPU's throughput depends on the part, its cores and its BLAS.
    GPU("cpu", None, None, None, None, None, None, None,
        "none: no peak figures for a CPU; time and infer need an accelerator"),
)}

# The H100 SXM's published share of its datasheet memory, for cards with no published figure
_H100_SHARE = 79.22 / 80
# The RTX 3090's (GA102, GDDR6X), for the RTX A6000 (GA102, GDDR6)
_GA102_SHARE = 23.58 / 24



def _gib(amount: float) -> int:
    """Bytes of `amount` GiB printed to 2 decimals, floored as `--gpu-memory 79.22GiB` reads it."""
    return parse_bytes(f"{amount:.2f}GiB", exact=False)


# torch.cuda.mem_get_info()'s total by card in bytes, and its source.
USABLE: dict[str, tuple[int, str]] = {
    "a100-sxm-40gb": (_gib(39.50), "PyTorch OOM message on an A100 40GB, 'GPU 0 has a total "
                                   "capacity of 39.50 GiB' (github.com/TianheWu/CoSeR/issues/10)"),
    "a100-pcie-40gb": (_gib(39.50), "taken equal to the A100 SXM 40GB's (the same 40 GiB)"),
    "a100-sxm-80gb": (_gib(79.14), "PyTorch OOM message on an A100 80GB, 'GPU 0 has a total "
                                   "capacity of 79.14 GiB' "
                                   "(github.com/lianqi1008/Control-GIC/issues/6)"),
    "a100-pcie-80gb": (_gib(79.14), "taken equal to the A100 SXM 80GB's (the same 80 GiB; "
                                    "nvidia-smi reports 81,920 MiB on both)"),
    "h100-sxm": (_gib(79.22), "vLLM log on an H100, 'total_gpu_memory 79.22GiB' "
                              "(github.com/vllm-project/vllm/pull/10511)"),
    "h100-pcie": (_gib(79.22), "taken equal to the H100 SXM's (no published figure found; the "
                               "same 80 GiB)"),
    "h200": (_gib(141 * _H100_SHARE), "derived, no published figure found: 141 GiB x the H100 "
                                      "SXM's share 79.22 / 80"),
    "b200": (_gib(180 * _H100_SHARE), "derived, no published figure found: 180 GiB x the H100 "
                                      "SXM's share 79.22 / 80"),
    "l40s": (_gib(44.40), "the L40's (the same 48GB GDDR6 with ECC; no L40S figure found): "
                          "PyTorch OOM message 'GPU 0 has a total capacity of 44.40 GiB' "
                          "(github.com/NVlabs/Eagle/issues/68)"),
    "rtx-4090": (_gib(23.64), "PyTorch OOM message on an RTX 4090, 'GPU 0 has a total capacity "
                              "of 23.64 GiB' (github.com/3DTopia/Phidias-Diffusion/issues/8)"),
    "mi300x": (_gib(192 * _H100_SHARE), "derived, no published figure found: 192 GiB x the "
                                        "H100 SXM's share 79.22 / 80"),
    "rtx-3090": (_gib(23.58), "vLLM log on an RTX 3090, 'total_gpu_memory=23.58GiB' "
                              "(github.com/vllm-project/vllm/issues/10517)"),
    "a10g": (_gib(22.18), "PyTorch OOM message on an A10 (the A10G is the same 24GB GDDR6 "
                          "board), 'GPU 0 has a total capacity of 22.18 GiB' "
                          "(github.com/OpenBMB/MiniCPM-V/issues/640)"),
    "l4": (_gib(22.18) + 6 * 2**20, "derived, no published figure found: the A10's 22.18 GiB + "
                                    "6 MiB, the difference of their nvidia-smi totals (23,034 "
                                    "and 23,028 MiB, github.com/modal-labs/modal-client pull "
                                    "2797)"),
    "t4": (_gib(14.75), "PyTorch OOM message on a Colab T4, 'GPU 0 has a total capacity of "
                        "14.75 GiB' (github.com/hpcaitech/Open-Sora/issues/697)"),
    "a6000": (_gib(48 * _GA102_SHARE), "derived, no published figure found: 48 GiB x the RTX "
                                       "3090's share 23.58 / 24 (both GA102)"),
    "h20": (_gib(96 * _H100_SHARE), "derived, no published figure found: 96 GiB x the H100 "
                                    "SXM's share 79.22 / 80"),
}
GPUS = {name: replace(g, usable_memory_bytes=USABLE[name][0],
                      usable_source=USABLE[name][1]) if name in USABLE else g
        for name, g in GPUS.items()}

DEFAULT_GPU = "h100-sxm"


# other names people type for a catalogue card
ALIASES = {"h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm",
           "h200-sxm": "h200", "b200-sxm": "b200", "a100": "a100-sxm-80gb",
           "a100-80gb": "a100-sxm-80gb", "a100-40gb": "a100-sxm-40gb", "4090": "rtx-4090",
           "3090": "rtx-3090", "a10": "a10g", "mi300": "mi300x", "rtx-a6000": "a6000"}


def gpu(name: str) -> GPU:
    """The catalogue entry `name` or its alias (case-insensitive); ConfigError("gpu") when
    unknown, with the nearest names."""
    import difflib

    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        near = difflib.get_close_matches(key, [*GPUS, *ALIASES], n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise ConfigError("gpu", f"unknown GPU {name!r}; {hint}(`gptcalc gpus` lists them)")
    return GPUS[key]


def usable_memory(g: GPU) -> int:
    """The memory a training or serving engine can use on `g`: torch.cuda.mem_get_info()'s
    total (`USABLE`, below the datasheet's: the driver and ECC keep the rest); ConfigError
    naming --gpu where the catalogue has no memory figure."""
    if g.usable_memory_bytes is None:
        raise ConfigError("gpu", f"{g.name} has no memory figure; pick an accelerator or give "
                                 "--gpu-memory")
    return g.usable_memory_bytes


def require_peak(g: GPU, precision: str) -> float:
    """Dense peak FLOP/s of `g` at `precision`, or ConfigError naming the option that picked it."""
    if all(g.peak_flops(p) is None for p in PRECISIONS):
        raise ConfigError("gpu", f"{g.name} has no published peak FLOP/s; pick an accelerator "
                                 "(see `gptcalc gpus`)")
    peak = g.peak_flops(precision)
    if peak is None:
        have = [p for p in PRECISIONS if g.peak_flops(p) is not None]
        raise ConfigError("precision", f"{g.name} has no {precision} figure; it has "
                                       f"{', '.join(have)}")
    return peak


def require_bandwidth(g: GPU) -> float:
    if g.hbm_bytes_per_second is None:
        raise ConfigError("gpu", f"{g.name} has no published memory bandwidth; pick an "
                                 "accelerator (see `gptcalc gpus`)")
    return g.hbm_bytes_per_second
