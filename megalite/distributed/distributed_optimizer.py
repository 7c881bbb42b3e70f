"""A ZeRO-1/2-style distributed optimizer: Megatron-Core's ``--use-distributed-optimizer``.

Why: with plain data parallelism every DP rank keeps fp32 masters and both Adam moments of
its whole model replica -- 12 of the 18 bytes per parameter under bf16.  Here each of the d
DP ranks owns a contiguous 1/d slice of the flat parameter space and keeps optimizer state
for that slice only, while moving the same bytes as DDP:

* all of a rank's trainable parameters live back to back in one flat *param buffer* per
  (DP group, dtype), and their gradients (``main_grad`` under bf16, ``.grad`` in fp32) in a
  matching flat fp32 *grad buffer* (``ShardedBuffer``); both are padded to a multiple of d
  so every shard has the same size;
* after backward, the strategy's ``finish_grad_sync`` reduce-scatters each grad buffer over
  its DP group (dp-cp; routed experts over expert-dp, in their own buffer): rank r receives
  the DP sum of its shard ``[r*S, (r+1)*S)`` only;
* this optimizer clips by the global norm and steps its shard's fp32 masters (in fp32 runs
  the master *is* the param buffer's shard, no copy); the strategy then all-gathers the
  updated parameters, in the parameters' dtype, back into every rank's param buffer.

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the volume equals
DDP's; the saving is 12(d-1)/d bytes per parameter in bf16 (8(d-1)/d in fp32).
``docs/distributed_optimizer.md`` has the layout, the counts and the measured bytes.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megalite.state_format.dcp_format import ChunkedTensor
from megalite.state_format.sharded_state import buffer_writer, flat_chunks
from megalite.distributed.sharded_buffer import ShardedBuffer, contiguous_runs
from megalite.optimizer.muon import is_muon_param
from megalite.optimizer.muon_layout import MatrixSlot
from megalite.optimizer.optimizer import (MasterWeightOptimizer, make_inner_optimizer,
                                          param_groups, uses_decoupled_lr,
                                          uses_weight_decay)
from megalite.param_spec import group_coords


class DistributedOptimizer(MasterWeightOptimizer):
    """Optimizer state for this rank's shard of each buffer only.

    ``masters`` holds one flat fp32 shard per buffer; the torch optimizer steps views of
    it, one per run of parameters with the same weight-decay rule (1-D params: none), so
    AdamW sees exactly the elements -- and per-element math -- of the unsharded run.
    """

    def __init__(self, buffers: List[ShardedBuffer], names: Dict[int, str], optim_config):
        super().__init__(optim_config)
        o = optim_config
        self.sharded_buffers = list(buffers)
        self.params = [p for buf in self.sharded_buffers for p in buf.params]
        self._grad_of = {id(p): view for buf in self.sharded_buffers
                         for p, view in zip(buf.params, buf.grad_views)}
        self.masters = [buf.param_shard.detach().float().clone() if self.bf16
                        else buf.param_shard for buf in self.sharded_buffers]
        split = o.decoupled_lr is not None
        self.names = names
        self._muon = o.optimizer == "muon"
        pieces = {(True, False): [], (False, False): [], (True, True): [], (False, True): []}
        muon = []

        def key(p):   # (weight decay?, --decoupled-lr group?); a Muon matrix: itself
            if p is None:
                return (False, False)
            if self._muon and is_muon_param(names[id(p)], p.dim()):
                return id(p)
            return (uses_weight_decay(names[id(p)], p),
                    split and uses_decoupled_lr(names[id(p)]))
        for buf, master in zip(self.sharded_buffers, self.masters):
            for lo, hi, k in contiguous_runs(buf.shard_ranges(), buf.shard_size, key):
                piece = master[lo:hi]
                piece.grad = buf.grad_shard[lo:hi]
                (muon if isinstance(k, int) else pieces[k]).append(piece)
        self.inner = make_inner_optimizer(param_groups(
            pieces[(True, False)], pieces[(False, False)], o, pieces[(True, True)],
            pieces[(False, True)], muon=muon), o)

    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s gradient: its view of the grad buffer (after the reduce-scatter only
        this rank's shard holds DP-summed values)."""
        return self._grad_of[id(p)]

    def _prepare_grads(self, coef: float) -> None:
        if coef != 1.0:
            for buf in self.sharded_buffers:
                buf.grad_shard.mul_(coef)

    def _write_back(self) -> None:
        """Round the updated masters into this rank's shard of the param buffer (bf16);
        the strategy's all-gather spreads the shards."""
        if self.bf16:
            for buf, master in zip(self.sharded_buffers, self.masters):
                buf.param_shard.copy_(master)

    def _model_views(self) -> List[torch.Tensor]:
        return [buf.param_shard for buf in self.sharded_buffers]

    # -- checkpoints (per rank, same layout only) ----------------------------------------
    def _layout(self) -> list:
        return [[b.group.name, str(b.param_data.dtype), b.numel, b.group.size, b.group.rank]
                for b in self.sharded_buffers]

    def _check_layout(self, sd: dict) -> None:
        if sd.get("shards") != self._layout():
            raise ValueError(f"distributed optimizer state for shards {sd.get('shards')} "
                             f"does not fit this rank's {self._layout()}")

    def state_dict(self) -> dict:
        sd = super().state_dict()
        return {"optimizer": sd["optimizer"], "shards": self._layout(),
                **({"masters": sd["masters"]} if self.bf16 else {})}

    # -- sharded state (checkpoints and snapshots at any layout) --------------------------
    def held_params(self) -> List[torch.nn.Parameter]:
        """Only the parameters with a range in this rank's shard of some buffer."""
        return [p for buf in self.sharded_buffers for p, _, _ in buf.shard_ranges()]

    def master_pieces(self) -> List[List[Tuple[int, torch.Tensor]]]:
        """Per buffer, ``(offset in the master shard, piece)`` of every tensor the torch
        optimizer steps (found by storage: they are views of ``masters[b]``)."""
        out = []
        for master in self.masters:
            base, ptr = master.storage_offset(), master.untyped_storage().data_ptr()
            out.append(sorted(((t.storage_offset() - base, t) for g in self.inner.param_groups
                               for t in g["params"] if t.untyped_storage().data_ptr() == ptr),
                              key=lambda x: x[0]))
        return out

    def _ranges(self):
        """``(buffer index, param, lo, hi, piece offset, piece, lo in the param's flat
        local tensor)`` of every parameter range of this rank's shards."""
        pieces = self.master_pieces()
        for b, buf in enumerate(self.sharded_buffers):
            index = {id(p): i for i, p in enumerate(buf.params)}
            for p, lo, hi in buf.shard_ranges():
                piece_lo, piece = next((a, t) for a, t in pieces[b]
                                       if a <= lo and hi <= a + t.numel())
                yield b, p, lo, hi, piece_lo, piece, buf.start + lo - buf.offsets[index[id(p)]]

    def muon_slots(self, state, spec_of) -> List[MatrixSlot]:
        """Each Muon parameter of every buffer: this rank's flat range of it (its own piece
        of the master shard; none outside the shard), the buffer's DP group holding the
        rest."""
        held = {(b, id(p)): (p_lo, hi - lo, piece)
                for b, p, lo, hi, _, piece, p_lo in self._ranges()}
        slots = []
        for b, buf in enumerate(self.sharded_buffers):
            if buf.replicate is not None:
                raise ValueError("Muon with distributed-optimizer instances (rule 'muon "
                                 "excludes hsdp')")
            for p in buf.params:
                name = self.names[id(p)]
                if is_muon_param(name, p.dim()):
                    lo, n, piece = held.get((b, id(p)), (0, 0, None))
                    slots.append(MatrixSlot(name, spec_of[id(p)], tuple(p.shape), lo, n, piece,
                                            buf.group, name.endswith("linear_qkv.weight")
                                            and self.inner.o.muon_split_qkv))
        return slots

    def scale_rows(self, p, row_scale):
        """Every rank's param buffer holds all of ``p`` (after the gather); under half
        precision this rank's fp32 master range of it too (fp32: the master is the buffer)."""
        cols = p.numel() // p.shape[0]
        p.data.mul_(row_scale.to(p.dtype).view(-1, *([1] * (p.dim() - 1))))
        if self.bf16:
            for b, q, lo, hi, _, _, p_lo in self._ranges():
                if q is p:
                    rows = torch.arange(p_lo, p_lo + hi - lo, device=row_scale.device) // cols
                    self.masters[b][lo:hi].mul_(row_scale[rows])

    def sharded_state(self, index, state):
        """One flat range per parameter and buffer, cut into rectangles of the global
        tensor; written by the first instance of the buffer's shard group."""
        coords, out, steps = group_coords(state), {}, []
        for b, p, lo, hi, piece_lo, piece, p_lo in self._ranges():
            st = self.inner.state.get(piece, {})
            flat = {k: v[lo - piece_lo:hi - piece_lo] for k, v in self._tensor_state(st, piece)}
            if self.bf16:
                flat["master"] = self.masters[b][lo:hi]
            if st.get("step") is not None:
                steps.append(float(st["step"]))
            name, spec = index[id(p)]
            writer = buffer_writer(spec, coords, self.sharded_buffers[b].group.name)
            for key, t in flat.items():
                entry = out.setdefault(f"{key}.{name}", ChunkedTensor(spec.full_shape, [], writer))
                entry.chunks += [(torch.Size(o), c) for o, c in
                                 flat_chunks(spec, coords, tuple(p.shape), p_lo, t)]
        return out, self._one_step(steps)

    def _stepped_state(self, local, keys):
        """Each parameter's whole local state, cut to its range of this rank's shard."""
        out = {id(piece): {k: torch.zeros_like(piece) for k in self._state_keys(piece, keys)}
               for pieces in self.master_pieces() for _, piece in pieces}
        for b, p, lo, hi, piece_lo, piece, p_lo in self._ranges():
            flat = {k: v.reshape(-1)[p_lo:p_lo + hi - lo] for k, v in local[id(p)].items()}
            for k in out[id(piece)]:
                out[id(piece)][k][lo - piece_lo:hi - piece_lo] = flat[k]
            if self.bf16:
                self.masters[b][lo:hi] = flat["master"]
        return out
