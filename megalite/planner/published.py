"""Published runs as planner scenarios, shared by benchmarks/planner_vs_published.py and the
tests: the same model, cluster and batch, searched with the techniques the run used."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config import ModelConfig
from megalite.planner import model_spec as ms
from megalite.planner.estimate import Estimate, ModelOptions
from megalite.planner.hardware import Cluster, make_cluster
from megalite.planner.search import SearchResult, SearchSpace, search

# Narayanan et al. 2021: activation recomputation on every layer, no distributed optimizer
# (it came later), no FlashAttention (2022).
NARAYANAN_SPACE = SearchSpace(recompute=("full",), zero=(0,))
NARAYANAN_OPTS = ModelOptions(flash_attention=False)


@dataclass
class Comparison:
    name: str
    published: dict
    model: ModelConfig
    cluster: Cluster
    result: SearchResult
    pick: Estimate
    best_published: Optional[Estimate]     # best layout with the published TP/CP/PP (any SP)
    as_run: Optional[Estimate]             # ... without SP when the run predates it

    @property
    def published_rank(self) -> Optional[int]:
        return self.result.ranked.index(self.best_published) + 1 if self.best_published else None

    @property
    def gap(self) -> Optional[float]:
        """Predicted step time of the published layout over the pick's, minus one."""
        return self.best_published.step / self.pick.step - 1 if self.best_published else None


def matches(e: Estimate, pub: dict) -> bool:
    L = e.layout
    return (L.tp, L.pp, L.cp) == (pub["tp"], pub["pp"], pub.get("cp", 1)) and \
        ("dp" not in pub or L.dp == pub["dp"])


def compare(name: str, space: Optional[SearchSpace] = None,
            opts: Optional[ModelOptions] = None) -> Comparison:
    pub = ms.published(name)
    m = ms.recipe(name)
    cluster = make_cluster(pub["num_gpus"], 8, pub["gpu"])
    gbs = pub.get("global_batch_size") or pub["global_batch_tokens"] // pub["seq_length"]
    is_2021 = pub["source"].startswith("Narayanan")
    space = space or (NARAYANAN_SPACE if is_2021 else SearchSpace())
    opts = opts or (NARAYANAN_OPTS if is_2021 else ModelOptions())
    res = search(m, pub["seq_length"], gbs, cluster, space, opts)
    same = [e for e in res.ranked if matches(e, pub)]
    best = same[0] if same else None
    as_run = next((e for e in same if not e.layout.sp), best) if is_2021 else best
    return Comparison(name, pub, m, cluster, res, res.ranked[0] if res.ranked else None,
                      best, as_run)
