"""Muon: momentum, then each weight matrix's update orthogonalised by Newton-Schulz
(Keller Jordan's quintic iteration, as Megatron-Core's ``--optimizer muon`` uses it); AdamW
for everything that is not a hidden weight matrix.

Which parameters are Muon's (``is_muon_param``): every parameter of two or more dimensions
except the word embedding, the output layer and position embeddings (Megatron's
``is_embedding_or_output_parameter`` plus learned positions); a 3-D grouped expert weight
``[E, rows, cols]`` is E matrices.  Norms, biases and the embeddings step with AdamW
(``--muon-scalar-optimizer adam``).

What "one matrix" is, at every layout (docs/training.md, "Muon"): the whole logical weight
of one linear layer (fc1's fused ``[gate; up]`` is one matrix, as in Megatron-Core), except
``linear_qkv``, whose per-query-group rows ``[q_1..q_r, k, v]`` are split into a Q, a K and
a V matrix (``--muon-split-qkv``, Megatron's default).  The single process orthogonalises
exactly those; under TP, the distributed optimizer and FSDP2 the layout first reassembles
them whole (``muon_layout.WholeMatrices``), so the update is the single process's.

The update of one matrix (decoupled weight decay, as Megatron's ``TensorParallelMuon``)::

    m <- mu m + (1 - mu) g            (momentum_buffer; Nesterov: u = (1-mu) g + mu m)
    W <- W (1 - lr wd) - lr * scale(rows, cols) * extra * NS(u)

The momentum is per element, so it lies on a rank exactly as AdamW's moments do (whole,
flat ranges, FSDP2 pieces) and checkpoints reshard it through DCP alike
(``momentum_buffer.<name>``).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from megalite.torch_classes import is_dtensor

# Keller Jordan's quintic coefficients (github.com/KellerJordan/Muon), Megatron's "quintic"
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_STATE_KEYS = ("momentum_buffer",)
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def is_muon_param(name: str, ndim: int) -> bool:
    """A hidden weight matrix (or a stack of them): Muon's; everything else AdamW's (the
    experts' biases [E, F] of --moe-expert-bias are vectors per expert, AdamW's too)."""
    return ndim >= 2 and not (name.endswith("word_embeddings.weight")
                              or name.endswith("output_layer.weight")
                              or name.endswith("position_embeddings.weight")
                              or name.endswith(".bias"))


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The orthogonal polar factor of each matrix in ``g`` ([..., rows, cols]), approximately:
    ``steps`` quintic iterations from g / ||g||_F, in fp32, on the wider side transposed."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    return x.mT if tall else x


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """Megatron-Core's ``get_muon_scale_factor`` (--muon-scale-mode)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


def orthogonalized(full: torch.Tensor, o, qkv_split: Optional[List[int]]) -> torch.Tensor:
    """The scaled Newton-Schulz update of one whole logical weight ``full`` ([rows, cols] or
    [E, rows, cols]); ``qkv_split``: the per-query-group row counts [r*d, d, d] of a
    linear_qkv weight, orthogonalised as Q, K and V (None: one matrix)."""
    extra = o.muon_extra_scale_factor

    def one(m: torch.Tensor) -> torch.Tensor:
        rows, cols = m.shape[-2:]
        return newton_schulz(m, o.muon_num_ns_steps) * (
            scale_factor(rows, cols, o.muon_scale_mode) * extra)
    if not qkv_split:
        return one(full)
    per_group = sum(qkv_split)
    groups = full.size(-2) // per_group
    cols = full.size(-1)
    parts = torch.split(full.reshape(*full.shape[:-2], groups, per_group, cols), qkv_split,
                        dim=-2)
    done = [one(p.reshape(*full.shape[:-2], groups * n, cols)).reshape(p.shape)
            for p, n in zip(parts, qkv_split)]
    return torch.cat(done, dim=-2).reshape(full.shape)


def qkv_split_rows(model_cfg) -> List[int]:
    """[r*d, d, d]: the rows of Q, K and V in one query group of linear_qkv
    (``transformer.attention``: rows grouped per query group)."""
    d = model_cfg.resolved_kv_channels()
    groups = model_cfg.resolved_query_groups()
    return [model_cfg.num_attention_heads // groups * d, d, d]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


# (stepped tensors, their momentum-updated inputs) -> the orthogonalised, scaled updates
Orthogonalize = Callable[[List[torch.Tensor], List[torch.Tensor]], List[torch.Tensor]]


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the groups marked ``"muon": True``, torch's AdamW (fused where it can) over
    the others, sharing one ``state`` and ``param_groups`` (one torch optimizer to the
    master-weight layouts and to checkpoints).

    ``orthogonalize`` belongs to the layout (the stepped tensors are its local pieces):
    ``muon_layout.WholeMatrices`` reassembles each matrix, orthogonalises it and hands
    every rank its piece back.  Stepping without one is a bug."""

    def __init__(self, groups: list, o):
        self.o = o
        adam_groups = [g for g in groups if not g.get("muon")]
        muon_groups = [g for g in groups if g.get("muon")]
        kwargs = dict(lr=o.lr or 0.0, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
        self._adam = None
        if adam_groups:
            try:
                self._adam = torch.optim.AdamW(adam_groups, fused=True, **kwargs)
            except (RuntimeError, TypeError):
                self._adam = torch.optim.AdamW(adam_groups, foreach=True, **kwargs)
            adam_groups = self._adam.param_groups
        for g in muon_groups:
            g.setdefault("lr", o.lr or 0.0)
        super().__init__(adam_groups + muon_groups, {})
        self._link()
        self.orthogonalize: Optional[Orthogonalize] = None

    def _link(self) -> None:
        """The inner AdamW steps our non-Muon groups and keeps its state in ours."""
        if self._adam is not None:
            self._adam.param_groups = [g for g in self.param_groups if not g.get("muon")]
            self._adam.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @staticmethod
    def state_keys(muon: bool, keys) -> List[str]:
        """The per-element state keys a tensor of this kind keeps, among ``keys``."""
        mine = MUON_STATE_KEYS if muon else ADAM_STATE_KEYS
        return [k for k in keys if k in mine or k not in MUON_STATE_KEYS + ADAM_STATE_KEYS]

    def is_muon_tensor(self, t: torch.Tensor) -> bool:
        return any(g.get("muon") and any(p is t for p in g["params"])
                   for g in self.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        if self._adam is not None:
            self._adam.step()
        mu, nesterov = self.o.muon_momentum, self.o.muon_nesterov
        for group in self.param_groups:
            if not group.get("muon"):
                continue
            params = [p for p in group["params"] if p.grad is not None]
            inputs = []
            for p in params:
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["momentum_buffer"] = torch.zeros_like(p)
                st["step"] += 1
                g, buf = _local(p.grad), _local(st["momentum_buffer"])
                buf.lerp_(g, 1 - mu)
                inputs.append(g.lerp(buf, mu) if nesterov else buf.clone())
            if self.orthogonalize is None:
                raise RuntimeError("Muon: the optimizer's layout set no orthogonalize")
            updates = self.orthogonalize(params, inputs)
            lr, wd = group["lr"], group.get("weight_decay", 0.0)
            for p, u in zip(params, updates):
                w = _local(p)
                if wd:
                    w.mul_(1 - lr * wd)
                w.add_(u.to(w.dtype), alpha=-lr)
        return None

