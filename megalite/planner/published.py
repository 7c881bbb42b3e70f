"""The planner against published runs (planner/published_runs.py): each run's own layout
estimated with the run's software switches, its throughput in the source's convention next
to the published figure, the planner's own pick for the same setting, and where the
published layout ranks among the planner's candidates.  Shared by
benchmarks/planner_vs_published.py, the calibration (calibration.fit) and the tests."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional

from megalite.config import ModelConfig
from megalite.planner import calibration
from megalite.planner import flops as fl
from megalite.planner import model_spec as ms
from megalite.planner.estimate import Estimate, ModelOptions, estimate, memory_of
from megalite.planner.hardware import GiB, Cluster, Efficiency, make_cluster
from megalite.planner.layout import Layout
from megalite.planner.published_runs import BY_NAME, RUNS, PublishedRun
from megalite.planner.search import SearchResult, SearchSpace, divisors, search


@dataclass
class Comparison:
    run: PublishedRun
    model: ModelConfig
    cluster: Cluster
    opts: ModelOptions
    as_run: Estimate                     # the published layout (free fields: planner's best)
    predicted: float                     # in the run's metric and FLOP convention
    result: Optional[SearchResult] = None
    rank: Optional[int] = None           # the published parallel layout's best candidate
    same: Optional[Estimate] = None      # ... that candidate

    @property
    def error(self) -> float:
        return self.predicted / self.run.value - 1

    @property
    def pick(self) -> Optional[Estimate]:
        return self.result.ranked[0] if self.result and self.result.ranked else None

    @property
    def gap(self) -> Optional[float]:
        """The published parallel layout's best candidate over the pick, in step time."""
        return self.same.step / self.pick.step - 1 if self.same and self.pick else None

    @property
    def as_run_gap(self) -> Optional[float]:
        """The run exactly as published (its micro-batch, recomputation ...) over the pick."""
        return self.as_run.step / self.pick.step - 1 if self.pick else None

    @property
    def memory_gib(self) -> float:
        return self.as_run.memory["total"] / GiB


def constants(**over) -> Dict[str, float]:
    """The calibrated constants (calibration.py), with ``over`` replacing some (fitting)."""
    out = {k: getattr(calibration, k) for k in calibration.CONSTANTS}
    out.update(over)
    return out


def cluster_for(run: PublishedRun, const: Dict[str, float]) -> Cluster:
    base = make_cluster(run.num_gpus, None, run.gpu)
    gpu = base.gpu
    over = dict(run.gpu_overrides)
    if "memory_gib" in over:
        gpu = replace(gpu, memory_bytes=int(over.pop("memory_gib") * GiB))
    if "clock" in over:
        gpu = replace(gpu, clock=const[over.pop("clock")])
    gpu = replace(gpu, **over)
    return Cluster(base.num_gpus, base.gpus_per_node, gpu,
                   Efficiency(compute=const[calibration.sustained_key(gpu.family)]))


def options_for(run: PublishedRun, const: Dict[str, float]) -> ModelOptions:
    o = dict(run.options)
    if o.get("fp8") == "nvfp4":
        o["fp4_gemm"] = const["NVFP4_GEMM"]
    if o.pop("eager", False):
        o["elementwise_passes"] = const["EAGER_PASSES"]
    else:
        o.setdefault("elementwise_passes", const["FUSED_PASSES"])
    return ModelOptions(**o)


def model_for(run: PublishedRun) -> ModelConfig:
    return dataclasses.replace(ms.recipe(run.model), seq_length=run.seq_length,
                               **run.model_overrides)


def model_flops(m: ModelConfig, seq: int, batch: int, convention: str,
                recompute: str = "none") -> float:
    """FLOPs per step as the source counts them: ``full`` attention (PaLM's 6N + 12LHQT,
    Narayanan et al., Megatron before v0.12), ``causal`` (half the score work of every
    layer, the MTP layers' too: Megatron-Core from v0.12, NeMo / Megatron-Bridge); ``hw``
    adds recomputation (Narayanan et al.)."""
    got = fl.iteration_flops(m, seq, batch, recompute)
    if convention == "hw":
        return got["hardware"]
    if convention == "causal":
        return got["model"] - 1.5 * float(seq) * batch * fl.core_forward_flops(m, seq)
    return got["model"]


def metric_of(run: PublishedRun, m: ModelConfig, e: Estimate) -> float:
    L = e.layout
    if run.metric == "tokens_per_gpu":
        return L.global_batch * run.seq_length / e.step / L.world
    conv = "hw" if run.metric == "hw_tflops" else run.flops
    f = model_flops(m, run.seq_length, L.global_batch, conv, L.recompute)
    return f / e.step / L.world / 1e12


def _variants(run: PublishedRun, m: ModelConfig) -> Iterator[Layout]:
    """The published layout; fields in ``run.free`` over every value the planner allows."""
    base = Layout(world=run.num_gpus, global_batch=run.global_batch, **run.layout)
    dp = base.dp
    mbs = [1 << i for i in range(4) if (run.global_batch // dp) % (1 << i) == 0] \
        if "micro_batch" in run.free else [base.micro_batch]
    vpps = [v for v in divisors(m.num_layers // base.pp) if v <= 8] \
        if "vpp" in run.free and m.num_layers % base.pp == 0 and base.pp > 1 else [base.vpp]
    for b in mbs:
        for v in vpps:
            yield replace(base, micro_batch=b, vpp=v,
                          schedule="interleaved" if v > 1 else base.schedule)


def as_run(run: PublishedRun, m: ModelConfig, cluster: Cluster, opts: ModelOptions) -> Estimate:
    """The published layout's estimate (free fields: the fastest that fits)."""
    best = None
    for L in _variants(run, m):
        e = estimate(m, L, run.seq_length, cluster, opts, memory_of(m, L, run.seq_length,
                                                                     cluster, opts))
        key = (not e.fits, e.step)
        if best is None or key < best[0]:
            best = (key, e)
    return best[1]


def search_space(run: PublishedRun) -> SearchSpace:
    """What the planner may choose for the run's setting: the 2021 rows keep their paper's
    techniques (full recomputation, no SP, no distributed optimizer); the others may also use the
    run's own sharding, and CP from the run's sequence length when the run used it."""
    if run.source.startswith("Narayanan"):          # 2021: no SP, no distributed optimizer
        return SearchSpace(recompute=("full",), zero=(0,), sequence_parallel=False)
    zero = tuple(sorted({0, 1, run.layout.get("zero", 0)}))
    cp_from = run.seq_length if run.layout.get("cp", 1) > 1 else SearchSpace().cp_min_seq
    return SearchSpace(zero=zero, cp_min_seq=min(cp_from, SearchSpace().cp_min_seq))


PARALLEL_KEYS = ("tp", "pp", "cp", "ep", "etp", "dp", "sp")


def same_parallel_layout(cand: Layout, run: PublishedRun, published: Layout) -> bool:
    """TP (+SP), PP, CP, EP (and expert-TP), DP as published, and VPP when the source gives
    it."""
    keys = PARALLEL_KEYS if published.ep > 1 or "etp" in run.layout else \
        tuple(k for k in PARALLEL_KEYS if k != "etp")      # dense: expert-TP means nothing
    if any(getattr(cand, k) != getattr(published, k) for k in keys):
        return False
    return "vpp" in run.free or "vpp" not in run.layout or cand.vpp == published.vpp


def compare_run(run: PublishedRun, with_search: bool = True,
                const: Optional[Dict[str, float]] = None) -> Comparison:
    const = const or constants()
    m, cluster, opts = model_for(run), cluster_for(run, const), options_for(run, const)
    e = as_run(run, m, cluster, opts)
    c = Comparison(run, m, cluster, opts, e, metric_of(run, m, e))
    if with_search:
        res = search(m, run.seq_length, run.global_batch, cluster, search_space(run), opts)
        c.result = res
        for i, cand in enumerate(res.ranked):
            if same_parallel_layout(cand.layout, run, e.layout):
                c.rank, c.same = i + 1, cand
                break
    return c


def compare(name: str, with_search: bool = True) -> Comparison:
    return compare_run(BY_NAME[name], with_search)


def compare_all(with_search: bool = True, const: Optional[Dict[str, float]] = None
                ) -> List[Comparison]:
    return [compare_run(r, with_search, const) for r in RUNS]


def _solve(err, lo: float, hi: float, tol: float = 1e-4) -> float:
    """Root of a monotone ``err`` on [lo, hi] by bisection."""
    e_lo = err(lo)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        e_mid = err(mid)
        if (e_mid > 0) == (e_lo > 0):
            lo, e_lo = mid, e_mid
        else:
            hi = mid
        if hi - lo < tol:
            break
    return 0.5 * (lo + hi)


def fit_constants(rounds: int = 4) -> dict:
    """Refit every calibrated constant on its rows (predicted = published there), in the
    order of calibration.CALIBRATION_ROWS, starting from the values written there."""
    const = constants()

    def err(name, **over):
        return compare_run(BY_NAME[name], False, dict(const, **over)).error

    ranges = {"SUSTAINED_A100": (0.3, 1.0), "SUSTAINED_H100": (0.3, 1.0),
              "FUSED_PASSES": (0.0, 40.0), "EAGER_PASSES": (0.0, 80.0),
              "H100_500W_CLOCK": (0.3, 1.0), "SUSTAINED_B200": (0.3, 1.0),
              "SUSTAINED_B300": (0.3, 1.0), "NVFP4_GEMM": (0.5, 4.0)}
    for _ in range(rounds):
        for keys, rows in calibration.CALIBRATION_ROWS.items():
            for key, row in zip(keys, rows):
                const[key] = _solve(lambda v: err(row, **{key: v}), *ranges[key])
    return const
