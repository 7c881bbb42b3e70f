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

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, no sparsity): the
# one table both the planner's presets and a run's MFU read.  Keys match inside CUDA
# device names in this order ("A100" before "A10").
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0,
                         "A800": 312.0, "B200": 2250.0, "L40S": 362.0, "A10": 125.0}
UNKNOWN_GPU = "H100"     # assumed for a device name the table does not know


def datasheet_peak_flops(device_name: str) -> tuple:
    """(bf16 peak FLOP/s, table key) for a CUDA device name such as 'NVIDIA H100 80GB HBM3';
    key None when the name is unknown and ``UNKNOWN_GPU``'s peak is assumed."""
    for key, tflops in DATASHEET_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12, key
    return DATASHEET_BF16_TFLOPS[UNKNOWN_GPU] * 1e12, None


# Dense FP8 (e4m3) tensor-core peak, TFLOP/s (datasheets, no sparsity); A100 has none.
DATASHEET_FP8_TFLOPS = {"H100": 1979.0, "H200": 1979.0, "B200": 4500.0}

# Measured ceilings of the kernels themselves, TFLOP/s -- not fitted to any training run.
# Matmul: Bekman's "maximum achievable matmul FLOPS" (MAMF), the best of a brute-force
# sweep of torch.matmul shapes (github.com/stas00/ml-engineering, compute/accelerator,
# "Maximum Achievable Matmul FLOPS comparison table": BF16 A100 SXM 271.2, H100 SXM 794.5
# ("H200 is the same"), B200 1745.0; FP8 e4m3 H100 SXM 1402.6, H200 1453.4, B200 3432.5).
MAMF_BF16_TFLOPS = {"A100": 271.2, "H100": 794.5, "H200": 794.5, "B200": 1745.0}
MAMF_FP8_TFLOPS = {"H100": 1402.6, "H200": 1453.4, "B200": 3432.5}
# Streaming multiprocessors (wave quantization of small GEMMs, planner/kernels.py).
SM_COUNT = {"A100": 108, "H100": 132, "H200": 132, "B200": 148}
UNKNOWN_MAMF_FRACTION = 0.80   # a custom GPU's matmul ceiling / peak (H100's 794.5 / 989)


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
    # The sustained clock relative to the one the kernel tables were measured at: < 1
    # for a power-capped part (torchtitan's 500 W H100s, planner/published_runs.py).
    clock: float = 1.0

    @property
    def matmul_tflops(self) -> float:
        """The measured bf16 matmul ceiling (MAMF), or the usual fraction of a custom peak."""
        got = MAMF_BF16_TFLOPS.get(self.family)
        return self.clock * (got if got else UNKNOWN_MAMF_FRACTION * self.peak_tflops)

    @property
    def fp8_matmul_tflops(self) -> Optional[float]:
        if not self.fp8_peak_tflops:
            return None
        got = MAMF_FP8_TFLOPS.get(self.family)
        return self.clock * (got if got else UNKNOWN_MAMF_FRACTION * self.fp8_peak_tflops)

    @property
    def sms(self) -> int:
        return SM_COUNT.get(self.family, 132)


_PEAK, _FP8 = DATASHEET_BF16_TFLOPS, DATASHEET_FP8_TFLOPS
GPU_PRESETS = {
    "a100-40gb": GPU("a100-40gb", 40960 * MiB, _PEAK["A100"], 300.0, 25.0, 1555.0, "A100"),
    "a100-80gb": GPU("a100-80gb", 81920 * MiB, _PEAK["A100"], 300.0, 25.0, 2039.0, "A100"),
    "h100-80gb": GPU("h100-80gb", 81559 * MiB, _PEAK["H100"], 450.0, 50.0, 3350.0, "H100",
                     _FP8["H100"]),
    "h200-141gb": GPU("h200-141gb", 143771 * MiB, _PEAK["H200"], 450.0, 50.0, 4800.0, "H200",
                      _FP8["H200"]),
    "b200": GPU("b200", 183359 * MiB, _PEAK["B200"], 900.0, 50.0, 8000.0, "B200", _FP8["B200"]),
}


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

    def link(self, span: int) -> tuple:
        """(bytes/s, latency) of the link a group spanning ``span`` consecutive ranks uses."""
        if span <= self.gpus_per_node:
            return self.gpu.intra_node_gbps * 1e9 * self.eff.link, self.eff.intra_latency_s
        return self.gpu.inter_node_gbps * 1e9 * self.eff.link, self.eff.inter_latency_s


def make_cluster(num_gpus: int, gpus_per_node: int = 8, gpu: str | None = "h100-80gb", *,
                 memory_gb: float | None = None, peak_tflops: float | None = None,
                 intra_gbps: float | None = None, inter_gbps: float | None = None,
                 compute_efficiency: float | None = None) -> Cluster:
    """Build a cluster from a preset, overriding any figure given explicitly."""
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
