"""Published measurements of Megatron's optimizer CPU offload against the planner: for each
offloaded run, the step time the offload adds and the GPU memory it frees, predicted
(planner/host_offload.py through estimate.py) next to measured, both as differences from
the same source's run without offload -- so what the model gets wrong about the rest of the
step (the sources' small batches) does not hide or fake the offload's own error.

calibration.CPU_ADAM_SECONDS_PER_PARAM is fitted on one row (``FIT_ROW``, ``fit_cpu_adam``);
every other row is held out (benchmarks/optimizer_offload_vs_published.py prints them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megalite.planner import calibration
from megalite.planner import model_spec as ms
from megalite.planner.estimate import Estimate, ModelOptions, estimate
from megalite.planner.hardware import GiB, make_cluster
from megalite.planner.layout import Layout
from megalite.planner.published_runs import QWEN3_30B

BRIDGE_OFFLOAD = ("Megatron-Bridge skills/perf-techniques/cpu-offloading/card.yaml, commit "
                  "a59fb46ad (#3062; now skills/nemo-mbridge-perf-cpu-offloading)")
NEMO_RL_OFFLOAD = "NeMo-RL pull request #3628 (2026-08-13), its microbenchmark table"
# Qwen3-0.6B (its Hugging Face config): 28 layers, tied embeddings
QWEN3_06B = dict(num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                 kv_channels=128, ffn_hidden_size=3072, untie_embeddings_and_output_weights=False,
                 vocab_size=151936, qk_layernorm=True)


@dataclass(frozen=True)
class OffloadSeries:
    """One source's run without offload and its offloaded variants: (name, fraction,
    overlap, step seconds, GPU memory saved in ``memory_unit`` bytes or None)."""
    name: str
    source: str
    model: str                         # model_spec recipe, with ``overrides``
    overrides: Dict
    gpu: str
    num_gpus: int
    seq_length: int
    global_batch: int
    layout: Dict
    options: Dict
    baseline_s: float
    runs: Tuple[Tuple[str, float, bool, float, Optional[float]], ...]
    memory_unit: float = 1e9
    baseline_memory: Optional[float] = None
    assumed: str = ""


SERIES = (
    OffloadSeries(
        "bridge-qwen3-30b", BRIDGE_OFFLOAD, "qwen3-235b-a22b", QWEN3_30B, "h100-80gb", 16, 4096,
        8, dict(tp=2, pp=2, ep=4, etp=1, micro_batch=1, recompute="full", zero=1, sp=True),
        dict(attention_kernel="cudnn", moe_dispatcher="deepep", moe_output_kept=False,
             optimizer_offload_master=False),
        0.996,
        (("25%", 0.25, False, 1.871, 3.8), ("50%", 0.50, False, 2.484, 7.6),
         ("75%", 0.75, False, 3.187, 11.6), ("100%", 1.0, False, 4.189, 15.3),
         ("100% overlap", 1.0, True, 3.877, 15.2)),
        baseline_memory=47.2,
        assumed="2 H100 nodes, TP2 PP2 EP4 as the card says; the rest is the recipe "
        "qwen3_30b_a3b_pretrain_config at the commit (seq 4096, full recomputation of every "
        "layer, Megatron's distributed optimizer (ZeRO-1: a whole gradient buffer), DeepEP on H100, no precision-"
        "aware optimizer: the fp32 master stays on the GPU) and the card's command (global "
        "batch 8, micro-batch 1); memory in 1e9 bytes (Bridge's report_memory); the overlap "
        "row's saving from its 32.0 GB"),
    OffloadSeries(
        "nemo-rl-qwen3-0.6b", NEMO_RL_OFFLOAD, "llama3-8b", QWEN3_06B, "h100-80gb", 1, 4096, 1,
        dict(tp=1, pp=1, micro_batch=1, recompute="none", zero=1),
        dict(attention_kernel="cudnn", optimizer_offload_master=False),
        0.752,
        (("50%", 0.5, False, 1.187, 15.24 - 14.13), ("50% overlap", 0.5, True, 1.216,
                                                     15.24 - 14.65),
         ("100% overlap", 1.0, True, 1.678, 15.24 - 10.53)),
        memory_unit=GiB,
        assumed="one H100, Megatron backend with the distributed optimizer (the PR's "
        "requirement) and no precision-aware optimizer; the RL step's own content (sequence, "
        "batch) is not stated, so only the differences are compared; memory: the maximum "
        "sampled, GiB (15.24 without offload)"),
)
BY_NAME = {s.name: s for s in SERIES}
FIT_ROW = ("bridge-qwen3-30b", "100%")


@dataclass
class OffloadComparison:
    series: OffloadSeries
    label: str
    fraction: float
    overlap: bool
    measured_s: float
    measured_saved: Optional[float]      # in the series' memory unit
    base: Estimate
    run: Estimate

    @property
    def added_measured(self) -> float:
        return self.measured_s - self.series.baseline_s

    @property
    def added_predicted(self) -> float:
        return self.run.step - self.base.step

    @property
    def added_error(self) -> float:
        return self.added_predicted / self.added_measured - 1

    @property
    def saved_predicted(self) -> float:
        return (self.base.memory["total"] - self.run.memory["total"]) / self.series.memory_unit

    @property
    def host_gib(self) -> float:
        return self.run.memory.get("host", 0) / GiB


def _setting(s: OffloadSeries):
    m = dataclasses.replace(ms.recipe(s.model), seq_length=s.seq_length, **s.overrides)
    cluster = make_cluster(s.num_gpus, None, s.gpu)
    L = Layout(world=s.num_gpus, global_batch=s.global_batch, **s.layout)
    return m, cluster, L


def compare_series(s: OffloadSeries) -> List[OffloadComparison]:
    m, cluster, L = _setting(s)
    base_opts = ModelOptions(**s.options)
    base = estimate(m, L, s.seq_length, cluster, base_opts)
    out = []
    for label, fraction, overlap, step, saved in s.runs:
        opts = dataclasses.replace(base_opts, optimizer_offload=fraction,
                                   optimizer_offload_overlap=overlap)
        out.append(OffloadComparison(s, label, fraction, overlap, step, saved, base,
                                     estimate(m, L, s.seq_length, cluster, opts)))
    return out


def compare_all() -> List[OffloadComparison]:
    return [c for s in SERIES for c in compare_series(s)]


def fit_cpu_adam() -> float:
    """CPU_ADAM_SECONDS_PER_PARAM that makes the fit row's predicted addition the measured
    one: the addition is linear in it (offloaded parameters x the constant + transfers)."""
    series, label = BY_NAME[FIT_ROW[0]], FIT_ROW[1]
    c = next(c for c in compare_series(series) if c.label == label)
    params = c.run.memory["offloaded_params"]
    rest = c.added_predicted - params * calibration.CPU_ADAM_SECONDS_PER_PARAM
    return (c.added_measured - rest) / params
