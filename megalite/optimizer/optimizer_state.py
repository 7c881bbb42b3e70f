"""The optimizer's part of the training state: a DCP ``Stateful`` over a data-parallel
strategy's optimizer (plain, distributed with sharded buffers, FSDP2 pieces).

Why a part of its own: how optimizer state lies on a rank (one tensor per parameter, flat
ranges of a buffer, DTensor pieces) is the optimizer's business
(``MasterWeightOptimizer.sharded_state`` / ``_stepped_state``); a checkpoint or a snapshot
only needs global shapes and chunks.  Keys: ``<state>.<canonical name>`` (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ``master``) and ``step`` (a number, JSON).

Loading is two-phase as in DCP: ``load_targets`` allocates the tensors a loader fills in
place (every held parameter's whole TP-local state), ``load_state_dict`` installs them.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from megalite.errors import CheckpointError
from megalite.optimizer.optimizer import STATE_KEYS
from megalite.state_format.sharded_state import fill_from


class OptimizerState:
    """``optimizer``'s state; ``index``: id(param) -> (canonical name, spec) of the model's
    parameters; ``before``: run before reading or writing (in-flight parameter gathers)."""

    def __init__(self, optimizer, index: dict, state, before: Optional[Callable] = None):
        self.optimizer, self.index, self.state = optimizer, index, state
        self.before = before or (lambda: None)
        self._pending: Optional[tuple] = None       # (targets, local) of load_targets

    def state_dict(self) -> Dict[str, object]:
        self.before()
        tensors, step = self.optimizer.sharded_state(self.index, self.state)
        return {**tensors, "step": step}

    def load_targets(self, saved, values=None) -> dict:
        """The tensors to fill: the state keys ``saved`` holds (and the fp32 masters under
        half precision), for every parameter this rank keeps state for."""
        keys = [k for k in STATE_KEYS if any(s.startswith(f"{k}.") for s in saved)]
        if self.optimizer.bf16:
            keys.append("master")
        targets, local = self.optimizer.sharded_load_targets(self.index, self.state, keys)
        missing = [k for k in targets if k not in saved]
        if missing:
            raise CheckpointError(f"--load: the checkpoint lacks optimizer tensors, e.g. "
                                  f"{missing[:3]}; add --no-load-optim to start the optimizer "
                                  f"fresh")
        self._pending = (targets, local)
        return targets

    def load_state_dict(self, sd: dict) -> None:
        """Install ``sd``: the targets of ``load_targets`` filled in place, or a state dict
        of the same layout (``state_dict()``), with its ``step``."""
        if sd.get("step") is None:
            raise CheckpointError("optimizer state without a step count: nothing to resume")
        self.before()
        if self._pending is None or any(sd.get(k) is not t for k, t in
                                        self._pending[0].items()):
            self.load_targets({k for k in sd if k != "step"})
            with torch.no_grad():
                fill_from(self._pending[0], sd)
        _, local = self._pending
        self._pending = None
        self.optimizer.load_sharded_state(local, float(sd["step"]))
