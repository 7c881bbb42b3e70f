"""Multi-Token Prediction (DeepSeek-V3 section 2.2; Megatron-Core's ``MultiTokenPrediction``).

``--mtp-num-layers D`` adds D sequential modules after the model's last layer, on the last
pipeline stage.  Module k (1-based) predicts the token k + 1 positions ahead of each
position i, keeping the causal chain: with h^0 the model's output (after its final norm),

    h^k_i = final_norm_k(layer_k(eh_proj_k([enorm_k(Emb(t_{i+k})) ; hnorm_k(h^{k-1}_i)])))

and its logits come from the model's own output layer.  The embedding and the output layer
are the model's (shared, as Megatron and DeepSeek do; with pipeline parallelism the last
stage holds a tied copy of the word embedding, ``models/gpt.py``).  The transformer layer
is built from the model's layer spec with global layer number ``num_layers + k - 1``, so it
is dense or MoE like the model's last layer (``ModelConfig.is_moe_layer``) and its router's
statistics and expert bias are those of one more MoE layer.

Each depth's loss -- the mean cross entropy over the micro-batch's tokens whose target is
k + 1 ahead (the last k positions have none) -- goes through the extra-loss channel as
``mtp_{k}_loss`` with weight ``--mtp-loss-scaling-factor / D``
(``transformer/loss_reduction.mtp_depth_weight``): logged as the cross entropy,
entering the objective scaled (Megatron's ``MTPLossAutoScaler``).  Parameter names follow
Megatron: ``mtp.layers.{k-1}.{enorm, hnorm, eh_proj, transformer_layer, final_layernorm}``.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from torch import nn

from megalite.tensor_parallel.layers import ColumnParallelLinear
from megalite.tensor_parallel.mappings import gather_from_tp_region, scatter_to_sp_region
from megalite.tensor_parallel.random import DrawsFromTracker
from megalite.transformer.spec import build_module


def mtp_loss_name(depth: int) -> str:
    """The extra-loss (and log) name of depth ``depth`` (1-based)."""
    return f"mtp_{depth}_loss"


def mtp_loss_names(model_cfg) -> tuple:
    return tuple(mtp_loss_name(k) for k in range(1, (model_cfg.mtp_num_layers or 0) + 1))


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """t shifted one position left along the sequence (last dim); the freed last position
    is 0 (Megatron's ``roll_tensor`` without CP)."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


class MultiTokenPredictionLayer(nn.Module):
    def __init__(self, model_cfg, comm_groups, layer_spec, norm, *, depth: int,
                 sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        m, h = model_cfg, model_cfg.hidden_size
        tp = comm_groups.tp
        self.tp_group, self.sequence_parallel = tp, sequence_parallel and tp.size > 1
        kw = dict(device=device, dtype=dtype)
        sp = self.sequence_parallel
        self.enorm = norm(m, h, sp, **kw)
        self.hnorm = norm(m, h, sp, **kw)
        # [embedding; hidden] -> hidden, column-parallel then gathered (Megatron's eh_proj)
        self.eh_proj = ColumnParallelLinear(2 * h, h, tp_group=tp, bias=False,
                                            sequence_parallel=sp, init_std=m.init_method_std,
                                            **kw)
        self.transformer_layer = build_module(
            layer_spec, m, comm_groups, layer_number=m.num_layers + depth - 1,
            sequence_parallel=sp, **kw)
        self.final_layernorm = norm(m, h, sp, **kw)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary=None,
                document_ids=None):
        """``hidden`` h^{k-1} and ``embedded`` Emb(t_{i+k}), both [s(/tp), b, h]."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x = gather_from_tp_region(x, self.tp_group)                  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sp_region(x, self.tp_group)               # [s/tp, b, h]
        return self.final_layernorm(self.transformer_layer(x, rotary, document_ids))


class MultiTokenPrediction(DrawsFromTracker, nn.Module):
    """The D modules; ``forward`` returns h^1 .. h^D (each [s(/tp), b, h])."""

    def __init__(self, model_cfg, comm_groups, spec, *, sequence_parallel: bool,
                 device=None, dtype=None):
        super().__init__()
        self.sequence_parallel = sequence_parallel and comm_groups.tp.size > 1
        self.layers = nn.ModuleList([
            MultiTokenPredictionLayer(model_cfg, comm_groups, spec.layer, spec.norm, depth=k,
                                      sequence_parallel=sequence_parallel,
                                      device=device, dtype=dtype)
            for k in range(1, model_cfg.mtp_num_layers + 1)])

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor], embedding, rotary=None,
                document_ids=None) -> List[torch.Tensor]:
        ids = input_ids
        pos = position_ids if position_ids is not None else \
            torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        # sequence shards differ per TP rank, so their dropout must too (as the block's)
        fork = self.rng_tracker.fork() if (self.sequence_parallel and self.training) \
            else contextlib.nullcontext()
        out = []
        with fork:
            for layer in self.layers:
                ids, pos = roll_left(ids), roll_left(pos)
                hidden = layer(hidden, embedding(ids, pos), rotary, document_ids)
                out.append(hidden)
        return out
