"""What a GPU keeps in its host's memory: the activations of Megatron's ``--cpu-offloading``
and the Adam state of ``--optimizer-cpu-offload`` -- the GPU bytes each frees, the time each
costs, and the rules Megatron sets for their flags (checked before the search).

Activations: the first N layers of each model chunk send what they saved to the host in
forward and fetch it back in backward, on a stream of their own.  Megatron allows it only
with PP 1, without recomputation and without per-layer CUDA graphs
(megatron/core/transformer/transformer_config.py, ``__post_init__``, commit d98e8a64dd:
"Currently there is no support for Pipeline parallelism with CPU offloading", "CPU offloading
does not work when activation recomputation is enabled", "CUDA graphs not supported with CPU
offloading" unless ``cuda_graph_impl == "full_iteration"``), and N < the model's layers.

Optimizer: Megatron-Core's HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/
hybrid_optimizer.py) moves the first ``--optimizer-offload-fraction`` of a rank's optimizer
shard to the host: pinned fp32 copies of those parameters, their Adam moments (torch's Adam
on the CPU, fp32) and pinned fp32 gradient buffers.  Each step copies their gradients out
(4 bytes a parameter), runs Adam on the CPU and copies the parameters back (4: the copy is
non-blocking, so torch converts to bf16 on the GPU); ``--overlap-cpu-optimizer-d2h-h2d``
gives every parameter an optimizer of its own on separate copy streams, so transfers run
beside the CPU's arithmetic.  The rest stays on the GPU in torch's fused Adam with an fp32
copy (``param_update_in_fp32``), whatever ``--exp-avg-dtype`` / ``--main-params-dtype`` say
(megatron/core/optimizer/__init__.py passes them no dtypes).  Under
``--use-precision-aware-optimizer`` -- Megatron-LM's arguments.py requires it for the
offload -- the distributed optimizer makes no fp32 master of its own, so the offloaded share
leaves the GPU whole (12 bytes a parameter); without it (Megatron-Core's API as
Megatron-Bridge and NeMo-RL call it) the distributed optimizer's fp32 master stays on the
GPU and only the moments leave (8 bytes): the measured savings of both (benchmarks/
optimizer_offload_vs_published.py) are that.
"""
from __future__ import annotations

from typing import Sequence, Tuple

from megalite.config import ConfigError, ModelConfig
from megalite.planner import calibration
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner.hardware import Cluster
from megalite.planner.layout import Layout

# Bytes one offloaded parameter moves each step: its fp32 gradient to the host, its fp32
# parameter back.
D2H_BYTES, H2D_BYTES = 4, 4
# Host bytes per offloaded parameter: the fp32 copy, its two fp32 moments, the fp32 gradient.
HOST_BYTES_PER_PARAM = 4 + 8 + 4


# ---- activations (--cpu-offloading --cpu-offloading-num-layers N) ---------------------

def offloaded_share(m: ModelConfig, L: Layout, pp_rank: int, layers: int) -> float:
    """Share of a stage's layers whose activations CPU offloading moves to the host."""
    kinds = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    return min(1.0, layers * L.vpp / max(1, sum(kinds)))


def activation_offload_seconds(m: ModelConfig, L: Layout, seq: int, r: int, cluster: Cluster,
                               layers: int, act: mem.ActivationOptions, t_f: float,
                               t_b: float) -> float:
    """Exposed host-transfer time of one micro-batch: the offloaded layers' activations go
    out during forward and come back during backward, each hidden behind that pass's
    compute as far as it reaches."""
    if not layers:
        return 0.0
    kinds = ms.stage_layer_kinds(m, L.pp, r, L.vpp, *L.stage_split)
    per = sum(n * mem.layer_activation_bytes(m, L, moe, seq, act, L.recompute)
              for n, moe in zip(kinds, (False, True)) if n)
    moved = offloaded_share(m, L, r, layers) * per
    bw = cluster.gpu.host_gbps * 1e9 * cluster.eff.link
    return max(0.0, moved / bw - t_f) + max(0.0, moved / bw - t_b)


def activation_offload_layers(on: bool, layers: int) -> int:
    """Layers per chunk whose activations go to the host: ``layers`` > 0 turns the offload
    on, as Megatron's arguments.py does; ``--cpu-offloading`` alone names no layers."""
    if layers < 0:
        raise ConfigError(f"--cpu-offloading-num-layers must be >= 0, got {layers}")
    if on and not layers:
        raise ConfigError("--cpu-offloading: give --cpu-offloading-num-layers N (layers "
                          "per model chunk to offload)")
    return layers


def activation_offload_space(layers: int, num_layers: int, pp: Sequence[int],
                             recompute: Sequence[str], recompute_given: bool,
                             cuda_graph_impl: str) -> Tuple[list, tuple]:
    """The PP sizes and recompute levels the search may try with ``layers`` offloaded
    (PP 1 and no recomputation only); a one-line ConfigError when the user's own choice
    leaves none.  ``pp``: the --pp list, empty when not given."""
    if not layers:
        return list(pp), tuple(recompute)
    if layers >= num_layers:
        raise ConfigError(f"--cpu-offloading-num-layers {layers}: Megatron offloads fewer "
                          f"layers than the model's {num_layers}; give at most {num_layers - 1}")
    if pp and 1 not in pp:
        raise ConfigError("--cpu-offloading needs --pp 1 (Megatron has no CPU offloading "
                          "with pipeline parallelism); drop --pp or use "
                          "--optimizer-cpu-offload")
    if recompute_given and "none" not in recompute:
        raise ConfigError("--cpu-offloading runs without recomputation (Megatron refuses "
                          "both); give --recompute none or drop --cpu-offloading")
    if cuda_graph_impl in ("local", "transformer_engine"):
        raise ConfigError(f"--cuda-graph-impl {cuda_graph_impl} with --cpu-offloading: "
                          f"Megatron captures no per-layer graphs with CPU offloading; use "
                          f"--cuda-graph-impl full_iteration or none")
    return [1], ("none",)


# ---- optimizer state (--optimizer-cpu-offload --optimizer-offload-fraction F) --------

def check_optimizer_offload(offload: bool, fraction, overlap: bool, precision_aware: bool,
                            fp8_param_gather: bool, fp8_recipe, zero_stages: Sequence[int],
                            dtypes: Sequence[Tuple[str, str]]) -> Tuple[float, list]:
    """Megatron's rules for the optimizer offload flags, each a one-line ConfigError naming
    the flag.  Returns the share offloaded (``fraction``: None = Megatron's default, 1.0)
    and the ZeRO stages the search may try: the distributed optimizer's, 1 and 2 (Megatron-
    Bridge's docs/training/cpu-offloading.md: "Distributed optimizer | Required"; Megatron-
    FSDP refuses the offload, megatron/core/optimizer/fully_sharded_optimizer.py).
    ``dtypes``: (flag, value) of the optimizer state's dtype flags."""
    if not offload:
        for flag, given in (("--optimizer-offload-fraction", fraction is not None),
                            ("--overlap-cpu-optimizer-d2h-h2d", overlap)):
            if given:
                raise ConfigError(f"{flag} needs --optimizer-cpu-offload; add it")
        return 0.0, list(zero_stages)
    fraction = 1.0 if fraction is None else fraction
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--optimizer-offload-fraction {fraction}: give a share in [0, 1]")
    if not precision_aware:
        # megatron/training/arguments.py: "The optimizer cpu offload must be used in
        # conjunction with `--use-precision-aware-optimizer`"
        raise ConfigError("--optimizer-cpu-offload needs --use-precision-aware-optimizer "
                          "(Megatron's hybrid optimizer runs on its code path); add it")
    if fp8_param_gather and fp8_recipe != "delayed":
        raise ConfigError("--optimizer-cpu-offload with --fp8-param-gather needs "
                          "--fp8-recipe delayed (Megatron's rule); change the recipe or drop "
                          "--fp8-param-gather")
    for flag, value in dtypes:
        if value != "fp32":
            raise ConfigError(f"{flag} {value} with --optimizer-cpu-offload: Megatron's hybrid "
                              f"optimizer keeps the state fp32 on both devices; drop {flag}")
    stages = [z for z in zero_stages if z in (1, 2)]
    if not stages:
        raise ConfigError("--optimizer-cpu-offload needs the distributed optimizer (not DDP "
                          "or Megatron-FSDP): give --zero-stages 1 or 2")
    return fraction, stages


def optimizer_offload_bytes(optimizer_bytes: int, moments: Sequence[int], master: int,
                            fraction: float, master_moves: bool) -> Tuple[int, int, int]:
    """(GPU optimizer bytes left, host bytes, offloaded parameters) of a rank whose
    optimizer shard holds ``optimizer_bytes`` at ``moments`` + ``master`` bytes a
    parameter.  The hybrid optimizer splits by element count, parameter by parameter
    (the boundary tensor moves whole; ignored)."""
    per = sum(moments) + master
    params = optimizer_bytes // max(1, per)
    moved = int(fraction * params)
    leave = sum(moments) + (master if master_moves else 0)
    return optimizer_bytes - moved * leave, moved * HOST_BYTES_PER_PARAM, moved


def optimizer_offload_seconds(params: int, cluster: Cluster, overlap: bool) -> float:
    """The step time the host's share of the optimizer adds: gradients out, Adam on the
    CPU (calibration.CPU_ADAM_SECONDS_PER_PARAM, per rank), parameters back -- one after
    the other, or side by side with ``--overlap-cpu-optimizer-d2h-h2d`` (the slowest of the
    three: per-parameter optimizers pipeline them)."""
    if params <= 0:
        return 0.0
    bw = cluster.gpu.host_gbps * 1e9 * cluster.eff.link
    d2h, h2d = params * D2H_BYTES / bw, params * H2D_BYTES / bw
    cpu = params * calibration.CPU_ADAM_SECONDS_PER_PARAM
    return max(d2h, cpu, h2d) if overlap else d2h + cpu + h2d
