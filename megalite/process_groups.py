"""The process groups a model's layers communicate over, as one bundle.

Layers receive this bundle instead of a bare TP group so that context-parallel attention
(``cp``), experts (``ep``, ``expert_tp``) and TE's attention can pick the group they need
without new constructor arguments (Megatron-Core's ``ProcessGroupCollection``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.parallel_state import Group, ParallelState


@dataclass(frozen=True)
class ModelCommGroups:
    tp: Group          # attention / dense-MLP tensor parallelism (and sequence parallelism)
    cp: Group          # context parallelism: splits the sequence inside core attention
    ep: Group          # expert parallelism: which experts this rank holds
    expert_tp: Group   # tensor parallelism inside an expert (may differ from ``tp``)
    tp_ep: Optional[Group] = None   # expert-TP x EP (the allgather token dispatcher)

    @classmethod
    def from_parallel_state(cls, state: ParallelState) -> "ModelCommGroups":
        return cls(tp=state["tp"], cp=state["cp"], ep=state["ep"],
                   expert_tp=state["expert-tp"], tp_ep=state.groups.get("tp-ep"))
