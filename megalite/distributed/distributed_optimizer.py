"""A ZeRO-1/2-style distributed optimizer: Megatron-Core's ``--use-distributed-optimizer``.

Why: with plain data parallelism every DP rank keeps fp32 masters and both Adam moments of
its whole model replica -- 12 of the 18 bytes per parameter under bf16.  Here each of the d
DP ranks owns a contiguous 1/d slice of the flat parameter space and keeps optimizer state
for that slice only, while moving the same bytes as DDP:

* all of a rank's trainable parameters live back to back in one flat *param buffer* per
  (DP group, dtype), and their gradients (``main_grad`` under bf16, ``.grad`` in fp32) in a
  matching flat fp32 *grad buffer*; both are padded to a multiple of d so every shard has
  the same size;
* after backward, ``finalize_gradients`` reduce-scatters each grad buffer over its DP group
  (dp-cp; routed experts over expert-dp, in their own buffer): rank r receives the DP sum
  of its shard ``[r*S, (r+1)*S)`` only;
* the rank clips by the global norm, steps its shard's fp32 masters (in fp32 runs the
  master *is* the param buffer's shard, no copy) and all-gathers the updated parameters,
  in the parameters' dtype, back into every rank's param buffer.

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the volume equals
DDP's; the saving is 12(d-1)/d bytes per parameter in bf16 (8(d-1)/d in fp32).
``docs/distributed_optimizer.md`` has the layout, the counts and the measured bytes.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megalite import comm
from megalite.distributed.grad_sync import dp_group_name
from megalite.distributed.replicas import broadcast_tied_embeddings
from megalite.optimizer.optimizer import (clip_coefficient, _accumulate_main_grad, _uses_decay,
                                          counts_toward_norm, make_inner_optimizer, specs_of)
from megalite.param_spec import group_coords


class ShardedBuffer:
    """Flat, padded param and grad storage of one DP group and dtype.

    Parameter i occupies ``[offsets[i], offsets[i] + numel)`` of both buffers (the model's
    parameters become views of the param buffer); DP rank r owns ``[start, end)`` =
    ``[r * shard_size, (r + 1) * shard_size)``.  The padding (< d elements, at the end)
    belongs to no parameter and stays zero.
    """

    def __init__(self, params: List[torch.nn.Parameter], group, grad_dtype: torch.dtype):
        self.params, self.group = list(params), group
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_size = -(-total // group.size)
        self.padded = self.shard_size * group.size
        self.start = group.rank * self.shard_size
        self.end = self.start + self.shard_size
        first = self.params[0]
        self.param_data = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.grad_data = torch.zeros(self.padded, dtype=grad_dtype, device=first.device)
        self.grad_views = []
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                view = self.param_data[off:off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view                  # the model now reads its weights from here
                self.grad_views.append(self.grad_data[off:off + p.numel()].view_as(p))

    @property
    def param_shard(self) -> torch.Tensor:
        return self.param_data[self.start:self.end]

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.grad_data[self.start:self.end]

    def shard_ranges(self) -> List[Tuple[torch.nn.Parameter, int, int]]:
        """``(param, lo, hi)``: the part of each parameter inside this rank's shard, in
        shard coordinates (0 .. shard_size)."""
        out = []
        for p, off in zip(self.params, self.offsets):
            lo, hi = max(off, self.start), min(off + p.numel(), self.end)
            if lo < hi:
                out.append((p, lo - self.start, hi - self.start))
        return out

    def reduce_scatter_grads(self) -> None:
        """Sum the grad buffer over the DP group; this rank keeps its (summed) shard.  The
        rest of the buffer keeps this rank's local, unreduced values: nothing reads them."""
        if self.group.size == 1:
            return
        out = torch.empty_like(self.grad_shard)
        comm.reduce_scatter_tensor(out, self.grad_data, self.group)
        self.grad_shard.copy_(out)

    def all_gather_params(self) -> None:
        """Every rank's updated shard into every rank's param buffer (param dtype)."""
        if self.group.size == 1:
            return
        comm.all_gather_into_tensor(self.param_data, self.param_shard.clone(), self.group)


def _runs(ranges, size: int, key) -> List[Tuple[int, int, object]]:
    """Cover ``[0, size)`` with maximal runs of equal ``key(param)``; ranges are contiguous
    from 0 and the uncovered tail (padding) gets ``key(None)``."""
    runs: List[list] = []
    end = ranges[-1][2] if ranges else 0
    for p, lo, hi in [*ranges, (None, end, size)]:
        k = key(p)
        if lo == hi:
            continue
        if runs and runs[-1][2] == k:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, k])
    return [tuple(r) for r in runs]


class DistributedOptimizer:
    """Same interface as ``MixedPrecisionOptimizer`` (params, grad, zero_grad, grad_norm,
    step, state_dict, load_state_dict), with state for this rank's shard only.

    ``masters`` holds one flat fp32 shard per buffer; the torch optimizer steps views of
    it, one per run of parameters with the same weight-decay rule (1-D params: none), so
    AdamW sees exactly the elements -- and per-element math -- of the unsharded run.
    """

    def __init__(self, named_params, cfg, state, specs=None):
        o = cfg.optimizer
        self.state, self.bf16, self.clip_grad = state, o.bf16, o.clip_grad
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params: List[torch.nn.Parameter] = [p for _, p in named]
        self.specs = specs_of(named, specs)        # aligned with self.params
        names: Dict[int, str] = {id(p): n for n, p in named}
        spec_of = {id(p): spec for p, spec in zip(self.params, self.specs)}
        by_key: Dict[tuple, list] = {}
        for p in self.params:
            by_key.setdefault((dp_group_name(spec_of[id(p)]), p.dtype), []).append(p)
        grad_dtype = torch.float32 if self.bf16 else None
        self.sharded_buffers = [ShardedBuffer(ps, state[g], grad_dtype or dt)
                                for (g, dt), ps in by_key.items()]
        self._grad_of: Dict[int, torch.Tensor] = {}
        for buf in self.sharded_buffers:
            for p, view in zip(buf.params, buf.grad_views):
                self._grad_of[id(p)] = view
                if self.bf16:
                    p.main_grad = view
                    p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                else:
                    p.grad = view
                    p.register_post_accumulate_grad_hook(_keep_in_buffer(view))
        self.masters = [buf.param_shard.detach().float().clone() if self.bf16
                        else buf.param_shard for buf in self.sharded_buffers]
        decay, no_decay = [], []
        coords = group_coords(state)
        self._norm_spans = []           # (buffer, [(lo, hi)] counted toward the grad norm)
        for buf, master in zip(self.sharded_buffers, self.masters):
            ranges = buf.shard_ranges()
            for lo, hi, wd in _runs(ranges, buf.shard_size,
                                    lambda p: p is not None and _uses_decay(names[id(p)], p)):
                piece = master[lo:hi]
                piece.grad = buf.grad_shard[lo:hi]
                (decay if wd else no_decay).append(piece)
            spans = [(lo, hi) for lo, hi, c in _runs(
                ranges, buf.shard_size,
                lambda p: p is not None and counts_toward_norm(spec_of[id(p)], coords)) if c]
            self._norm_spans.append((buf, spans))
        self.inner = make_inner_optimizer([{"params": decay, "weight_decay": o.weight_decay},
                                           {"params": no_decay, "weight_decay": 0.0}], o)
        self._norm_groups = sorted({b.group.name for b in self.sharded_buffers} | {"dp-cp"})

    # -- gradients ---------------------------------------------------------------------
    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s gradient: its view of the grad buffer (after finalize_gradients only
        this rank's shard holds DP-summed values)."""
        return self._grad_of[id(p)]

    def grads(self) -> List[torch.Tensor]:
        return [self.grad(p) for p in self.params]

    def zero_grad(self):
        for buf in self.sharded_buffers:
            buf.grad_data.zero_()
        for p in self.params:
            if self.bf16:
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != self.grad(p).data_ptr():
                p.grad = self.grad(p)           # someone reset it: point it back

    def grad_norm(self) -> float:
        """Global L2 norm, every element counted once: squares over this rank's shard
        (TP-replicated params only on TP rank 0, tied-embedding copies not at all), summed
        over the DP group(s) that own the shards, then over model parallel."""
        device = self.params[0].device
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        for name in self._norm_groups:
            part = torch.zeros(1, dtype=torch.float32, device=device)
            for buf, spans in self._norm_spans:
                if buf.group.name == name:
                    g = buf.grad_shard
                    for lo, hi in spans:
                        part += g[lo:hi].float().pow(2).sum()
            comm.all_reduce(part, self.state[name])
            sq += part
        comm.all_reduce(sq, self.state["mp"])
        return sq.sqrt().item()

    # -- update ------------------------------------------------------------------------
    def step(self, lr: float) -> float:
        """Clip by the global norm, step this rank's shard, all-gather the parameters;
        returns the norm before clipping."""
        norm = self.grad_norm()
        coef = clip_coefficient(norm, self.clip_grad)
        for group in self.inner.param_groups:
            group["lr"] = lr
        if coef != 1.0:
            for buf in self.sharded_buffers:
                buf.grad_shard.mul_(coef)
        self.inner.step()
        with torch.no_grad():
            for buf, master in zip(self.sharded_buffers, self.masters):
                if self.bf16:
                    buf.param_shard.copy_(master)
                buf.all_gather_params()
        broadcast_tied_embeddings(self.params, self.state, self.specs)
        return norm

    # -- checkpoints (per rank, same layout only) ----------------------------------------
    def _layout(self) -> list:
        return [[b.group.name, str(b.param_data.dtype), b.numel, b.group.size, b.group.rank]
                for b in self.sharded_buffers]

    def state_dict(self) -> dict:
        sd = {"optimizer": self.inner.state_dict(), "shards": self._layout()}
        if self.bf16:
            sd["masters"] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, sd: dict):
        if sd.get("shards") != self._layout():
            raise ValueError(f"distributed optimizer state for shards {sd.get('shards')} "
                             f"does not fit this rank's {self._layout()}")
        self.inner.load_state_dict(sd["optimizer"])
        if self.bf16 and "masters" in sd:
            with torch.no_grad():
                for buf, m, saved in zip(self.sharded_buffers, self.masters, sd["masters"]):
                    m.copy_(saved)
                    buf.param_shard.copy_(saved)

    def reload_model_params(self):
        """Refresh the fp32 master shards from the model after weights were loaded."""
        if self.bf16:
            with torch.no_grad():
                for buf, m in zip(self.sharded_buffers, self.masters):
                    m.copy_(buf.param_shard)


def _keep_in_buffer(view: torch.Tensor):
    """fp32 runs: autograd accumulates into ``.grad`` in place, i.e. into the buffer view.
    Should something have reset ``.grad`` (e.g. ``module.zero_grad()``), move the new
    gradient into the buffer instead of losing it."""
    def hook(p):
        if p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
            p.grad = view
    return hook
