"""The random generators' part of the training state: a DCP ``Stateful``.

Why keyed by rank and restored by coordinates: a rank's streams depend on where it sits
(the tracker is seeded by TP rank; dropout draws differ by pipeline stage and virtual
chunk), so a rank of a new layout can only continue the streams of a saved rank at the
same TP / PP / CP / VPP coordinates (and the same device kind) -- the same DP rank when that
exists, else the first DP rank there.  Where no saved rank matches, the generators keep
their seeded state (the loader says so).

Keys: ``rank<r>.cpu``, ``rank<r>.cuda``, ``rank<r>.tracker<c>.<name>.<device>`` (uint8
tensors, each rank writes its own) and ``ranks``: every rank's coordinates (JSON).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from megalite.state_format.dcp_format import ChunkedTensor

MATCHED = ("tp", "pp", "cp", "vpp", "cuda")       # coordinates that must be equal


class RNGState:
    """This rank's generators: torch's CPU (and CUDA) generator and each model chunk's
    tracker.  ``gather(obj)``: every rank's ``obj`` (collective over the world)."""

    def __init__(self, model_chunks, state, device: str, gather: Callable[[object], list]):
        self.model_chunks, self.state, self.device, self.gather = (model_chunks, state,
                                                                   device, gather)

    def coords(self) -> dict:
        """Where this rank's generators belong: equal coordinates draw the same streams."""
        s = self.state
        return {"tp": [s.tp.rank, s.tp.size], "pp": [s.pp.rank, s.pp.size],
                "cp": [s["cp"].rank, s["cp"].size], "dp": [s["dp"].rank, s["dp"].size],
                "vpp": s.vpp_size, "cuda": self.device == "cuda"}

    def _tensors(self) -> Dict[str, torch.Tensor]:
        out = {"cpu": torch.get_rng_state()}
        if self.device == "cuda":
            out["cuda"] = torch.cuda.get_rng_state()
        for c, chunk in enumerate(self.model_chunks):
            for name, st in chunk.rng_tracker.get_states().items():
                for dev, t in st.items():
                    out[f"tracker{c}.{name}.{dev}"] = t
        return out

    def state_dict(self) -> dict:
        """Collective over the world (every rank's coordinates are gathered)."""
        out: dict = {f"rank{self.state.rank}.{k}": ChunkedTensor(t.shape, [((0,), t)])
                     for k, t in self._tensors().items()}
        out["ranks"] = self.gather(self.coords())
        return out

    def source_rank(self, ranks: Optional[List[dict]]) -> Optional[int]:
        """The saved rank whose streams this rank continues, or None (module docstring)."""
        mine = self.coords()
        same = [r for r, c in enumerate(ranks or [])
                if all(c.get(k) == mine[k] for k in MATCHED)]
        if not same:
            return None
        return next((r for r in same if ranks[r]["dp"][0] == mine["dp"][0]), same[0])

    def load_targets(self, saved, values: Optional[dict] = None) -> Dict[str, ChunkedTensor]:
        """Buffers for the source rank's tensors (``saved``: {key: DCP tensor metadata});
        none when no saved rank has this rank's coordinates."""
        src = self.source_rank((values or {}).get("ranks"))
        if src is None:
            return {}
        prefix = f"rank{src}."
        return {k: ChunkedTensor(tuple(v.size), [((0,), torch.empty(
                    tuple(v.size), dtype=v.properties.dtype))])
                for k, v in saved.items() if k.startswith(prefix)}

    def load_state_dict(self, sd: dict) -> None:
        """Continue the source rank's streams (of ``sd["ranks"]``); nothing when none."""
        src = self.source_rank(sd.get("ranks"))
        if src is None:
            return
        prefix = f"rank{src}."
        bufs = {k[len(prefix):]: (v.chunks[0][1] if isinstance(v, ChunkedTensor) else v)
                for k, v in sd.items() if k.startswith(prefix)}
        if not bufs:
            return
        torch.set_rng_state(bufs["cpu"])
        if "cuda" in bufs and self.device == "cuda":
            torch.cuda.set_rng_state(bufs["cuda"])
        for c, chunk in enumerate(self.model_chunks):
            states: Dict[str, dict] = {}
            for k, t in bufs.items():
                parts = k.split(".")
                if parts[0] == f"tracker{c}":
                    states.setdefault(".".join(parts[1:-1]), {})[parts[-1]] = t
            if states:
                chunk.rng_tracker.set_states(states)
