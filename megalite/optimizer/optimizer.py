"""AdamW with fp32 master weights and a global gradient norm over model-parallel ranks.

Under ``--bf16`` the model holds bf16 parameters; each gets an fp32 ``main_grad`` that a
post-accumulate hook fills (so accumulation over micro-batches happens in fp32) and the
optimizer steps fp32 master copies, then writes them back -- apex-free mixed precision.
In fp32 the optimizer steps the parameters themselves.
"""
from __future__ import annotations

from typing import Iterable, List

import torch

from megalite import comm
from megalite.distributed.replicas import broadcast_tied_embeddings
from megalite.param_spec import ParamSpec, group_coords, is_first_replica, named_specs

# The grad norm is summed over model parallel (tp x pp); its data dimension is TP for
# dense parameters and expert-TP for experts.
NORM_REPLICA_GROUPS = ("tp", "expert-tp")


def _uses_decay(name: str, param: torch.nn.Parameter) -> bool:
    """No weight decay on norms and biases (all 1-D parameters), as Megatron does."""
    return param.ndim > 1 and not name.endswith(".bias")


def clip_coefficient(norm: float, clip_grad: float) -> float:
    """Scale for gradients so their global norm is at most ``clip_grad`` (0 disables)."""
    if clip_grad and clip_grad > 0 and norm > clip_grad:
        return clip_grad / (norm + 1e-6)
    return 1.0


def counts_toward_norm(spec: ParamSpec, coords) -> bool:
    """Count a parameter's elements once over model parallel: a parameter its spec does not
    split over TP (or expert-TP) only on rank 0 of that group, and the tied embedding's
    last-stage copy not at all.  ``coords``: ``param_spec.group_coords(state)``."""
    return is_first_replica(spec, coords, NORM_REPLICA_GROUPS)


def specs_of(named_params: list, specs) -> List[ParamSpec]:
    """The spec of each ``(name, param)``: looked up in ``specs`` (name -> ParamSpec, from
    the model chunks' tables); a parameter it lacks is a plain replicated one."""
    specs = specs or {}
    return [specs.get(n) or ParamSpec(tuple(p.shape)) for n, p in named_params]


def make_inner_optimizer(groups: list, o) -> torch.optim.Optimizer:
    """The torch optimizer over ``groups`` (empty groups dropped): fused AdamW, or SGD."""
    groups = [g for g in groups if g["params"]]
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr or 0.0, momentum=0.9)
    kwargs = dict(lr=o.lr or 0.0, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


class MixedPrecisionOptimizer:
    # Grad buffers whose DP reduction is a reduce-scatter (finalize_gradients); none here:
    # every gradient is all-reduced.  The distributed optimizer lists its buffers.
    sharded_buffers = ()

    def __init__(self, named_params: Iterable, cfg, state, specs=None):
        o = cfg.optimizer
        self.state = state
        self.bf16 = o.bf16
        self.clip_grad = o.clip_grad
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params: List[torch.nn.Parameter] = [p for _, p in named]
        names = [n for n, _ in named]
        self.specs = specs_of(named, specs)        # aligned with self.params
        self.masters = []
        for p in self.params:
            if self.bf16:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                master = p.detach().float().clone().requires_grad_(True)
            else:
                master = p
            self.masters.append(master)
        decay = [m for n, p, m in zip(names, self.params, self.masters) if _uses_decay(n, p)]
        no_decay = [m for n, p, m in zip(names, self.params, self.masters)
                    if not _uses_decay(n, p)]
        groups = [{"params": decay, "weight_decay": o.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.inner = make_inner_optimizer(groups, o)

    # -- gradients ---------------------------------------------------------------------
    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The tensor holding ``p``'s accumulated gradient (created as zeros if absent)."""
        if self.bf16:
            return p.main_grad
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def grads(self) -> List[torch.Tensor]:
        return [self.grad(p) for p in self.params]

    def zero_grad(self):
        for p in self.params:
            if self.bf16:
                p.main_grad.zero_()
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def grad_norm(self) -> float:
        """L2 norm of the full model's gradient, reduced over the model-parallel group."""
        coords = group_coords(self.state)
        sq = torch.zeros(1, dtype=torch.float32)
        for p, spec in zip(self.params, self.specs):
            if counts_toward_norm(spec, coords):
                sq += self.grad(p).float().pow(2).sum()
        comm.all_reduce(sq, self.state["mp"])
        return sq.sqrt().item()

    # -- update ------------------------------------------------------------------------
    def step(self, lr: float) -> float:
        """Clip by the global norm, update, and return the norm before clipping."""
        norm = self.grad_norm()
        coef = clip_coefficient(norm, self.clip_grad)
        for group in self.inner.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.masters):
            g = self.grad(p)
            if coef != 1.0:
                g.mul_(coef)
            if self.bf16:
                m.grad = g
        self.inner.step()
        if self.bf16:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        broadcast_tied_embeddings(self.params, self.state, self.specs)
        return norm

    def state_dict(self) -> dict:
        sd = {"optimizer": self.inner.state_dict()}
        if self.bf16:
            sd["masters"] = [m.detach().clone() for m in self.masters]
        return sd

    def reload_model_params(self):
        """Refresh the fp32 masters from the model after weights were loaded into it, so the
        next step does not write the initial weights back (finetune / --no-load-optim)."""
        if self.bf16:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    m.copy_(p)

    def load_state_dict(self, sd: dict):
        self.inner.load_state_dict(sd["optimizer"])
        if self.bf16 and "masters" in sd:
            with torch.no_grad():
                for m, saved, p in zip(self.masters, sd["masters"], self.params):
                    m.copy_(saved)
                    p.copy_(saved)


def _accumulate_main_grad(param):
    param.main_grad.add_(param.grad.float())
    param.grad = None


def build_optimizer(model_chunks, cfg, state):
    """MixedPrecisionOptimizer, or the sharded DistributedOptimizer with
    --use-distributed-optimizer (same interface)."""
    triples = named_specs(model_chunks)      # FQNs are unique over a rank's chunks
    named = [(n, p) for n, p, _ in triples]
    specs = {n: spec for n, _, spec in triples}
    if len(specs) != len(triples):
        raise ValueError("parameter names repeat across this rank's model chunks")
    if cfg.parallel.use_distributed_optimizer:
        from megalite.distributed.distributed_optimizer import DistributedOptimizer

        return DistributedOptimizer(named, cfg, state, specs)
    return MixedPrecisionOptimizer(named, cfg, state, specs)
