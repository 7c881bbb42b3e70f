"""ParallelDims: the layout of a run -- the size of every parallel dimension -- described once.

Why: the rank grid (``parallel_state.RankGrid``), the planner's candidate layouts
(``planner/layout.py``), a checkpoint's ``layout`` metadata and the elastic re-layout
(``cli/elastic_fit.py``) all read this one frozen, torch-free object, so a new dimension is
added here and in the places that genuinely use it.  Every derived size (DP, expert-DP, the
ZeRO shard counts, the world step both grids tile) is computed here only.

Two grids share the ranks (docs: ``python -m megalite.parallel_state``): the dense grid
world = TP x CP x DP x PP and the expert grid world = expert-TP x EP x expert-DP x PP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Dict, Optional

# metadata.json key -> ParallelDims field, for the dimension sizes a checkpoint records
# (``layout`` and ``extra.layout``); checkpoints written before expert-TP was recorded lack
# "expert_tp", which then means "the same as tp" (the flag's default).
METADATA_KEYS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "expert_tp": "etp",
                 "world_size": "world", "vpp": "vpp"}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions of ``world`` ranks; ``etp`` None = ``tp``.
    ``dp_instances``: hybrid sharding's instances per data-parallel group (1 = none)."""
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    vpp: int = 1
    dp_instances: int = 1

    def __post_init__(self):
        if self.etp is None:                 # resolved once, so every reader sees a size
            object.__setattr__(self, "etp", self.tp)

    @classmethod
    def names(cls) -> tuple:
        """The field names (what ``Layout`` and the kwargs forms of ``RankGrid`` accept)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_config(cls, cfg) -> "ParallelDims":
        """The layout a run config (``MegaliteConfig``) describes; the mapping from the
        flags is ``ParallelConfig.dims``."""
        return cfg.parallel.dims(cfg.world_size, cfg.model.num_layers)

    # ---- derived sizes (written here only) -------------------------------------------
    @property
    def dense_model_ranks(self) -> int:
        """Ranks of one dense model replica: TP x CP x PP."""
        return self.tp * self.cp * self.pp

    @property
    def expert_model_ranks(self) -> int:
        """Ranks of one expert-grid replica: expert-TP x EP x PP."""
        return self.etp * self.ep * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (TP x CP x PP)."""
        return self.world // self.dense_model_ranks

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (expert-TP x EP x PP)."""
        return self.world // self.expert_model_ranks

    @property
    def dense_shards(self) -> int:
        """Ranks one dense parameter is sharded over with ZeRO >= 1: DP x CP, or one
        hybrid-sharding instance of it."""
        return self.dp * self.cp // self.dp_instances

    @property
    def expert_shards(self) -> int:
        return self.edp // self.dp_instances

    @property
    def world_step(self) -> int:
        """The smallest world change both grids tile (elastic re-layout steps by it)."""
        return math.lcm(self.dense_model_ranks, self.expert_model_ranks)

    def pp_rank_of(self, rank: int) -> int:
        """The pipeline stage of global ``rank`` (PP has the largest stride in the grid)."""
        return rank // (self.world // self.pp)

    def grid_sizes(self, grid: str) -> Dict[str, int]:
        """Sizes per token of the order string ``tp-cp-ep-dp-pp`` for the ``dense`` grid
        (EP = 1) or the ``expert`` grid (CP = 1, TP = expert-TP)."""
        if grid == "dense":
            return dict(tp=self.tp, cp=self.cp, ep=1, dp=self.dp, pp=self.pp)
        return dict(tp=self.etp, cp=1, ep=self.ep, dp=self.edp, pp=self.pp)

    def problem(self) -> Optional[str]:
        """Why these sizes do not tile the world, or None."""
        if self.world % self.dense_model_ranks or self.world % self.expert_model_ranks:
            return (f"world size {self.world} does not fit tp={self.tp} cp={self.cp} "
                    f"pp={self.pp} (expert: etp={self.etp} ep={self.ep})")
        for grid in ("dense", "expert"):
            d = self.grid_sizes(grid)
            if self.dp_instances > 1 and (d["dp"] * d["cp"]) % self.dp_instances:
                return (f"{self.dp_instances} instances do not divide the {grid} "
                        f"data-parallel size {d['dp'] * d['cp']}")
        return None

    def with_world(self, world: int) -> "ParallelDims":
        return replace(self, world=world)

    def describe(self) -> str:
        """``TP2 CP1 PP2 DP2`` (+ `` EP4`` with expert parallelism)."""
        return (f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}" +
                (f" EP{self.ep}" if self.ep > 1 else ""))

    # ---- checkpoint metadata ------------------------------------------------------------
    def to_metadata(self) -> dict:
        """The sizes a checkpoint's ``layout`` records (``METADATA_KEYS``)."""
        return {key: getattr(self, name) for key, name in METADATA_KEYS.items()}

    @staticmethod
    def normalize_metadata(layout: Optional[dict]) -> Optional[dict]:
        """A checkpoint's ``layout`` entry with what older writers left out filled in
        (``expert_tp`` = ``tp``), so layouts written before and after compare equal."""
        if not isinstance(layout, dict):
            return layout
        out = dict(layout)
        if "tp" in out:
            out.setdefault("expert_tp", out["tp"])
        return out
