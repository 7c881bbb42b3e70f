"""A stack of transformer layers (the slice one pipeline chunk holds) plus the final norm.

Layers are kept in a ``ModuleDict`` keyed by their *global* layer number, so parameter
names (``layers.7.mlp.linear_fc1.weight``) do not depend on how the model is split over
pipeline stages -- init seeds and checkpoints rely on that.

``recompute``: a hook for activation recomputation.  When set, it is called as
``recompute(layers, hidden, rotary, document_ids) -> hidden`` with this block's layers in order, so a
policy can checkpoint groups of layers (``transformer/recompute.py``, full recompute).

``spec`` is a backend's ``LayerSpec``: ``spec.layer`` builds each layer, ``spec.norm`` the
final norm; ``comm_groups`` is the ``ModelCommGroups`` bundle every layer receives.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from megalite.tensor_parallel.random import DrawsFromTracker
from megalite.transformer.spec import build_module


class TransformerBlock(DrawsFromTracker, nn.Module):
    def __init__(self, model_cfg, comm_groups, spec, *, layer_numbers: Sequence[int],
                 sequence_parallel: bool, post_layer_norm: bool, device=None, dtype=None):
        super().__init__()
        self.sequence_parallel = sequence_parallel   # resolved: sequence_parallel_active
        self.layers = nn.ModuleDict({
            str(n): build_module(spec.layer, model_cfg, comm_groups, layer_number=n,
                                 sequence_parallel=self.sequence_parallel,
                                 device=device, dtype=dtype)
            for n in layer_numbers})
        self.final_layernorm = spec.norm(model_cfg, model_cfg.hidden_size, self.sequence_parallel,
                                         device=device, dtype=dtype) if post_layer_norm else None
        self.recompute: Optional[Callable] = None

    def forward(self, hidden: torch.Tensor, rotary=None, document_ids=None) -> torch.Tensor:
        # Sequence shards differ per TP rank, so their dropout must too.
        fork = self.rng_tracker.fork() if (self.sequence_parallel and self.training) \
            else contextlib.nullcontext()
        with fork:
            if self.recompute is not None:  # [pipeline/recompute wiring] whole list: groups
                hidden = self.recompute(list(self.layers.values()), hidden, rotary,
                                        document_ids)
            else:
                for layer in self.layers.values():
                    hidden = layer(hidden, rotary, document_ids)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden
