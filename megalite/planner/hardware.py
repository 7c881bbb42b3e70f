"""GPU presets and the cluster the planner sizes a run for.

Numbers are per GPU and uni-directional: the planner's collectives move data one way per
ring step, so the 900 GB/s that NVIDIA quotes for H100 NVLink (both directions) is 450 here.
Memory is what ``nvidia-smi`` reports as total (not the marketing GB), in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megalite.config import ConfigError
from megalite.planner import calibration

MiB = 1 << 20
GiB = 1 << 30

# Tensor-core peaks per GPU, TFLOP/s, (dense, 2:4 sparse) per precision, from the vendor
# pages.  The planner prices dense GEMMs (training does not use 2:4 sparsity); the sparse
# figure is kept so a datasheet line can be checked against the table.
#   A100 SXM: NVIDIA A100 datasheet ("BF16 Tensor Core 312 | 624 TFLOPS").
#   H100 SXM, H200 SXM: NVIDIA H100 / H200 datasheets (BF16 989 | 1,979; FP8 1,979 | 3,958);
#     H200 the same GH100 die (pages corpus: lzwjava.github.io/nvidia-h200-gpu-specs-en).
#   B200 (HGX, 1,000 W), GB200 (NVL72, 1,200 W): NVIDIA's Blackwell datasheet as tabled in
#     glennklockwood.com/garden/processors/B200 ("HGX variant ... BF16 2250 | 4500, FP8
#     4500 | 9000, FP4 9000 | 18000"; "GB200 variant ... BF16 2500 | 5000, FP8 5000 |
#     10000, FP4 10000 | 20000").
#   B300 (HGX), GB300 (NVL72): Blackwell Ultra -- glennklockwood.com/garden/processors/B300
#     (HGX B300 "BF16 2250 | 4500, FP8 4500 | 9000, FP4 13125 | 18000"; dense FP4 is not
#     half the sparse figure on Blackwell Ultra); GB300 NVL72 rack 1,080 PF dense / 1,440 PF
#     sparse FP4 and 360 PF FP8 over 72 GPUs (vendordeep.com/report/nvidia-launches-
#     blackwell-ultra-gb300; verda.com/blog/gb300-nvl72-architecture: FP16/BF16 2.5 PF).
# Keys match inside CUDA device names in this order ("GB200" before "B200", "A100" before
# "A10").
DATASHEET_TFLOPS = {
    "H100": {"bf16": (989.0, 1979.0), "fp8": (1979.0, 3958.0)},
    "H200": {"bf16": (989.0, 1979.0), "fp8": (1979.0, 3958.0)},
    "H800": {"bf16": (989.0, 1979.0), "fp8": (1979.0, 3958.0)},
    "A100": {"bf16": (312.0, 624.0)},
    "A800": {"bf16": (312.0, 624.0)},
    "GB300": {"bf16": (2500.0, 5000.0), "fp8": (5000.0, 10000.0), "fp4": (15000.0, 20000.0)},
    "GB200": {"bf16": (2500.0, 5000.0), "fp8": (5000.0, 10000.0), "fp4": (10000.0, 20000.0)},
    "B300": {"bf16": (2250.0, 4500.0), "fp8": (4500.0, 9000.0), "fp4": (13125.0, 18000.0)},
    "B200": {"bf16": (2250.0, 4500.0), "fp8": (4500.0, 9000.0), "fp4": (9000.0, 18000.0)},
    "L40S": {"bf16": (362.0, 733.0)},
    "A10": {"bf16": (125.0, 250.0)},
}


def _dense(precision: str) -> dict:
    return {k: v[precision][0] for k, v in DATASHEET_TFLOPS.items() if precision in v}


# Dense bf16 tensor-core peak per device, TFLOP/s: the one table both the planner's presets
# and a run's MFU read.
DATASHEET_BF16_TFLOPS = _dense("bf16")
UNKNOWN_GPU = "H100"     # assumed for a device name the table does not know


def datasheet_peak_flops(device_name: str) -> tuple:
    """(bf16 peak FLOP/s, table key) for a CUDA device name such as 'NVIDIA H100 80GB HBM3';
    key None when the name is unknown and ``UNKNOWN_GPU``'s peak is assumed."""
    for key, tflops in DATASHEET_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12, key
    return DATASHEET_BF16_TFLOPS[UNKNOWN_GPU] * 1e12, None


# Dense FP8 (e4m3) and FP4 (NVFP4 / MXFP4) peaks; A100 has no FP8, Hopper no FP4.
DATASHEET_FP8_TFLOPS = _dense("fp8")
DATASHEET_FP4_TFLOPS = _dense("fp4")

# Measured ceilings of the kernels themselves, TFLOP/s -- not fitted to any training run.
# Matmul: Bekman's "maximum achievable matmul FLOPS" (MAMF), the best of a brute-force
# sweep of torch.matmul shapes (github.com/stas00/ml-engineering, compute/accelerator,
# "Maximum Achievable Matmul FLOPS comparison table": BF16 A100 SXM 271.2, H100 SXM 794.5
# ("H200 is the same"), B200 1745.0; FP8 e4m3 H100 SXM 1402.6, H200 1453.4, B200 3432.5).
MAMF_BF16_TFLOPS = {"A100": 271.2, "H100": 794.5, "H200": 794.5, "B200": 1745.0}
MAMF_FP8_TFLOPS = {"H100": 1402.6, "H200": 1453.4, "B200": 3432.5}
# Streaming multiprocessors (wave quantization of small GEMMs, planner/kernels.py).
# B200: 148 SMs; Blackwell Ultra (B300 / GB300): 160 (awesomeagents.ai/hardware/nvidia-
# gb300-nvl72: "160 streaming multiprocessors"); GB200's GPU is a B200.
SM_COUNT = {"A100": 108, "H100": 132, "H200": 132, "B200": 148, "GB200": 148, "B300": 160,
            "GB300": 160}
UNKNOWN_MAMF_FRACTION = 0.80   # a custom GPU's matmul ceiling / peak (H100's 794.5 / 989)
# A part without its own MAMF measurement keeps the measured ceiling / peak ratio of the
# part it shares tensor cores with (same SM design, other clock and power): Blackwell
# (Ultra) parts that of B200, FP4 GEMMs the FP8 ratio (no FP4 MAMF is published).
MAMF_SIBLING = {"GB200": "B200", "B300": "B200", "GB300": "B200"}


def _measured_fraction(table: dict, family: str, peaks: dict) -> Optional[float]:
    """Measured ceiling over datasheet peak of ``family`` (or of its sibling)."""
    key = family if family in table else MAMF_SIBLING.get(family)
    return table[key] / peaks[key] if key in table and key in peaks else None


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    peak_tflops: float          # dense bf16 tensor-core peak
    intra_node_gbps: float      # GB/s one way per GPU over NVLink / NVSwitch
    inter_node_gbps: float      # GB/s one way per GPU over the NIC (one NIC per GPU)
    hbm_gbps: float             # memory bandwidth, for the optimizer step
    family: str = ""            # key of the kernel tables above ("H100", ...); "" = custom
    fp8_peak_tflops: Optional[float] = None      # None: no FP8 tensor cores
    fp4_peak_tflops: Optional[float] = None      # None: no FP4 tensor cores (pre-Blackwell)
    # GPUs that share one NVLink switch fabric: 8 on an HGX board, 72 in an NVL72 rack
    # whose "nodes" (compute trays) hold 4.  A group inside the domain uses NVLink even
    # across nodes (comm_model.link_of); 0 = the node.
    nvlink_domain: int = 0
    # GB/s one way between the GPU and its host's memory, for CPU offloading: PCIe Gen4 x16
    # 32 (A100), Gen5 x16 64 (H100, H200, HGX B200), Gen6 x16 128 (B300: glennklockwood.com,
    # B300, "Upgrade to PCIe Gen6"); Grace's NVLink-C2C, 900 GB/s both ways per Grace and
    # its two GPUs (GB200 / GB300 superchips) = 225 one way per GPU.
    host_gbps: float = 64.0
    # The sustained clock relative to the one the kernel tables were measured at: < 1
    # for a power-capped part (torchtitan's 500 W H100s, planner/published_runs.py).
    clock: float = 1.0

    @property
    def matmul_tflops(self) -> float:
        """The measured bf16 matmul ceiling (MAMF), or the usual fraction of a custom peak."""
        got = MAMF_BF16_TFLOPS.get(self.family)
        if got:
            return self.clock * got
        frac = _measured_fraction(MAMF_BF16_TFLOPS, self.family, DATASHEET_BF16_TFLOPS)
        return self.clock * (frac or UNKNOWN_MAMF_FRACTION) * self.peak_tflops

    @property
    def fp8_matmul_tflops(self) -> Optional[float]:
        if not self.fp8_peak_tflops:
            return None
        got = MAMF_FP8_TFLOPS.get(self.family)
        if got:
            return self.clock * got
        frac = _measured_fraction(MAMF_FP8_TFLOPS, self.family, DATASHEET_FP8_TFLOPS)
        return self.clock * (frac or UNKNOWN_MAMF_FRACTION) * self.fp8_peak_tflops

    @property
    def fp4_matmul_tflops(self) -> Optional[float]:
        """FP4 GEMM ceiling: the FP8 measured fraction of the FP4 peak (no FP4 MAMF)."""
        if not self.fp4_peak_tflops:
            return None
        frac = _measured_fraction(MAMF_FP8_TFLOPS, self.family, DATASHEET_FP8_TFLOPS)
        return self.clock * (frac or UNKNOWN_MAMF_FRACTION) * self.fp4_peak_tflops

    @property
    def sms(self) -> int:
        return SM_COUNT.get(self.family, 132)


_PEAK, _FP8, _FP4 = DATASHEET_BF16_TFLOPS, DATASHEET_FP8_TFLOPS, DATASHEET_FP4_TFLOPS
# Memory, HBM and link figures (one way per GPU; NIC = one per GPU):
#   H100 SXM: 80 GB HBM3, 3.35 TB/s, NVLink 4 900 GB/s both ways, ConnectX-7 400 Gb/s.
#   H200 SXM: 141 GB HBM3e, 4.8 TB/s, NVLink 4 900 GB/s, ConnectX-7 400 Gb/s (pages:
#     lzwjava.github.io/nvidia-h200-gpu-specs-en; saulelectric.com/nvidia-h200.html).
#   B200 (HGX): 180 GB HBM3e, 8 TB/s (DGX B200: 64 TB/s over 8), NVLink 5 1.8 TB/s both ways, 8 per domain; network
#     0.8 TB/s per 8 GPUs = ConnectX-7 400 Gb/s each (fibermall.com/blog/?p=17161: HGX B200
#     "1.4 TB", "Networking Bandwidth 0.8 TB/s"; verda.com/blog/gb300-nvl72-architecture).
#   B300 (HGX): 270 GB usable of 288 GB HBM3e, 8 TB/s (glennklockwood.com, B300), NVLink 5, network 1.6 TB/s per 8
#     GPUs = ConnectX-8 800 Gb/s each (same two pages).
#   GB200 NVL72: 186 GB HBM3e (13.5 TB over 72 GPUs, awesomeagents.ai/hardware/nvidia-
#     gb200-nvl72), 8 TB/s, 72 GPUs on one NVLink 5 domain (130 TB/s), 4 GPUs per compute
#     tray, ConnectX-7 400 Gb/s per GPU.
#   GB300 NVL72: 279 GB usable of 288 GB HBM3e, 8 TB/s, 72-GPU NVLink 5 domain, ConnectX-8
#     800 Gb/s per GPU (verda.com/blog/gb300-nvl72-architecture; vendordeep.com/report/
#     nvidia-launches-blackwell-ultra-gb300: "each GPU has ConnectX-8 SuperNIC at 800 Gb/s").
GB = 10 ** 9
GPU_PRESETS = {
    "a100-40gb": GPU("a100-40gb", 40960 * MiB, _PEAK["A100"], 300.0, 25.0, 1555.0, "A100",
                     host_gbps=32.0),
    "a100-80gb": GPU("a100-80gb", 81920 * MiB, _PEAK["A100"], 300.0, 25.0, 2039.0, "A100",
                     host_gbps=32.0),
    "h100-80gb": GPU("h100-80gb", 81559 * MiB, _PEAK["H100"], 450.0, 50.0, 3350.0, "H100",
                     _FP8["H100"]),
    "h200-141gb": GPU("h200-141gb", 143771 * MiB, _PEAK["H200"], 450.0, 50.0, 4800.0, "H200",
                      _FP8["H200"]),
    "b200": GPU("b200", 183359 * MiB, _PEAK["B200"], 900.0, 50.0, 8000.0, "B200", _FP8["B200"],
                _FP4["B200"]),
    "b300": GPU("b300", 270 * GB, _PEAK["B300"], 900.0, 100.0, 8000.0, "B300", _FP8["B300"],
                _FP4["B300"], host_gbps=128.0),
    "gb200-nvl72": GPU("gb200-nvl72", 186 * GB, _PEAK["GB200"], 900.0, 50.0, 8000.0, "GB200",
                       _FP8["GB200"], _FP4["GB200"], nvlink_domain=72, host_gbps=225.0),
    "gb300-nvl72": GPU("gb300-nvl72", 279 * GB, _PEAK["GB300"], 900.0, 100.0, 8000.0,
                       "GB300", _FP8["GB300"], _FP4["GB300"], nvlink_domain=72, host_gbps=225.0),
}
# GPUs per node (compute tray) a preset implies when --gpus-per-node is not given.
PRESET_GPUS_PER_NODE = {"gb200-nvl72": 4, "gb300-nvl72": 4}


@dataclass(frozen=True)
class Efficiency:
    """What fraction of a ceiling real runs reach.

    ``compute``: the fraction of the *measured* kernel ceilings (MAMF matmul, the attention
    kernels' rates in kernels.py) a whole training step sustains -- calibrated
    (planner/calibration.py, SUSTAINED_<family>).  ``link`` is NCCL's achieved bus bandwidth over
    the link's peak (nccl-tests reach ~80% on NVLink and InfiniBand).  Latencies are per
    algorithm step.
    """
    compute: float = calibration.SUSTAINED_H100
    link: float = 0.80
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 10e-6
    hbm: float = 0.80


@dataclass(frozen=True)
class Cluster:
    num_gpus: int
    gpus_per_node: int
    gpu: GPU
    eff: Efficiency = Efficiency()

    def effective_flops(self) -> float:
        return self.gpu.peak_tflops * 1e12 * self.eff.compute

    @property
    def nvlink_domain(self) -> int:
        """Consecutive ranks that reach each other over NVLink: the node, or the GPU's
        larger switch domain (NVL72: 72 GPUs over 18 trays of 4)."""
        return min(self.num_gpus, max(self.gpus_per_node, self.gpu.nvlink_domain))

    def link(self, span: int) -> tuple:
        """(bytes/s, latency) of the link a group spanning ``span`` consecutive ranks uses."""
        if span <= self.nvlink_domain:
            return self.gpu.intra_node_gbps * 1e9 * self.eff.link, self.eff.intra_latency_s
        return self.gpu.inter_node_gbps * 1e9 * self.eff.link, self.eff.inter_latency_s


def make_cluster(num_gpus: int, gpus_per_node: int | None = 8, gpu: str | None = "h100-80gb", *,
                 memory_gb: float | None = None, peak_tflops: float | None = None,
                 intra_gbps: float | None = None, inter_gbps: float | None = None,
                 compute_efficiency: float | None = None) -> Cluster:
    """Build a cluster from a preset, overriding any figure given explicitly;
    ``gpus_per_node`` None: the preset's node (PRESET_GPUS_PER_NODE, else 8)."""
    if gpus_per_node is None:
        gpus_per_node = PRESET_GPUS_PER_NODE.get((gpu or "").lower(), 8)
    if num_gpus is None or num_gpus <= 0:
        raise ConfigError(f"--num-gpus must be a positive integer, got {num_gpus}")
    if gpus_per_node <= 0:
        raise ConfigError(f"--gpus-per-node must be a positive integer, got {gpus_per_node}")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise ConfigError(f"--num-gpus ({num_gpus}) is not divisible by --gpus-per-node "
                          f"({gpus_per_node}); use whole nodes")
    gpus_per_node = min(gpus_per_node, num_gpus)
    if gpu is None:
        missing = [f for f, v in (("--gpu-memory-gb", memory_gb), ("--peak-tflops", peak_tflops),
                                  ("--intra-node-bandwidth-gbps", intra_gbps),
                                  ("--inter-node-bandwidth-gbps", inter_gbps)) if v is None]
        if missing:
            raise ConfigError(f"without --gpu give {', '.join(missing)} (or pick a --gpu preset: "
                              f"{', '.join(GPU_PRESETS)})")
        base = GPU("custom", 0, 0.0, 0.0, 0.0, 2000.0)
    else:
        key = gpu.lower()
        if key not in GPU_PRESETS:
            raise ConfigError(f"--gpu: unknown preset '{gpu}'; choose from "
                              f"{', '.join(GPU_PRESETS)}")
        base = GPU_PRESETS[key]
    over = {}
    if memory_gb is not None:
        over["memory_bytes"] = int(memory_gb * GiB)
    if peak_tflops is not None:
        over["peak_tflops"] = float(peak_tflops)
    if intra_gbps is not None:
        over["intra_node_gbps"] = float(intra_gbps)
    if inter_gbps is not None:
        over["inter_node_gbps"] = float(inter_gbps)
    for k, v in over.items():
        if v <= 0:
            raise ConfigError(f"cluster figure {k} must be positive, got {v}")
    eff = Efficiency(compute=calibration.sustained(base.family) if compute_efficiency is None
                     else compute_efficiency)
    if not 0 < eff.compute <= 1:
        raise ConfigError("--compute-efficiency must be in (0, 1]")
    return Cluster(num_gpus, gpus_per_node, replace(base, **over), eff)
