"""One transformer layer: x + attn(norm(x)), then x + mlp(norm(x)) (pre-norm); with
``--norm-placement post`` x + norm(attn(x)), then x + norm(mlp(x)) (OLMo 2); with
``sandwich`` x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (Gemma 2/3).

Built from ``TransformerLayerSubmodules`` (``transformer/spec.py``): every slot is a spec
choice, and the MLP slot is picked per layer (dense or MoE, ``ModelConfig.is_moe_layer``).
Kept deliberately flat: ``input_layernorm``, ``self_attention`` (whose ``core_attention``
is a submodule), ``pre_mlp_layernorm`` and ``mlp`` are the units a recompute policy wraps.
A spec that fuses a norm into the following linear puts ``IdentityNorm`` in the norm slot.
Dropout after attention and MLP uses the default generator: replicated across TP without
sequence parallelism, and inside the block's model-parallel RNG fork with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.comm.flight_recorder import module_site
from megalite.transformer.norms import build_norm
from megalite.transformer.rotary import LayerRotaries, nope_tables
from megalite.transformer.spec import build_module


class TransformerLayer(nn.Module):
    def __init__(self, model_cfg, comm_groups, *, submodules, layer_number: int,
                 sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        h = model_cfg.hidden_size
        sp = sequence_parallel      # already resolved: ParallelConfig.sequence_parallel_active
        kw = dict(device=device, dtype=dtype)
        self.layer_number = layer_number
        self._sites = (module_site(f"layer {layer_number}", "attention"),   # flight recorder
                       module_site(f"layer {layer_number}", "mlp"))
        self.hidden_dropout = model_cfg.hidden_dropout
        self.rotates = model_cfg.layer_uses_rotary(layer_number)   # --no-rope-freq: NoPE layers
        self.local_rotary = model_cfg.layer_uses_local_rotary(layer_number)   # Gemma 3
        # --norm-placement post (OLMo 2): the two norm slots normalize the attention and MLP
        # outputs instead of their inputs (same modules and names, so checkpoints keep them)
        self.post_norm = model_cfg.norm_placement == "post"
        self.input_layernorm = build_module(submodules.input_layernorm, model_cfg, h, sp, **kw)
        self.self_attention = build_module(   # attention, or a linear-attention layer
            submodules.attention_for_layer(model_cfg, layer_number), model_cfg, comm_groups,
            sequence_parallel=sp,
            layer_number=layer_number, **kw)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, model_cfg, h, sp,
                                              **kw)
        self.mlp = build_module(submodules.mlp_for_layer(model_cfg, layer_number), model_cfg,
                                comm_groups, sequence_parallel=sp, layer_number=layer_number,
                                **kw)
        # --norm-placement sandwich (Gemma 2/3): the pre-norms above, and a norm on each
        # sublayer's output before the residual add (the block's norm builder)
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if model_cfg.norm_placement == "sandwich":
            self.post_self_attn_layernorm, self.post_mlp_layernorm = (
                build_norm(model_cfg, h, sp, **kw) for _ in range(2))

    def _dropout(self, x):
        if self.training and self.hidden_dropout > 0:
            return F.dropout(x, self.hidden_dropout, training=True)
        return x

    def forward(self, hidden: torch.Tensor, rotary=None, document_ids=None) -> torch.Tensor:
        """``document_ids``: the packed sequence's documents, for core attention's mask
        (``transformer/attention_masks.py``); None: plain causal."""
        attention, mlp = self._sites
        docs = {} if document_ids is None else {"document_ids": document_ids}
        if isinstance(rotary, LayerRotaries):        # Gemma 3: windowed layers' own base
            rotary = rotary.local if self.local_rotary else rotary.full
        rotary = rotary if self.rotates else nope_tables(rotary)   # NoPE: no rotation
        if self.post_norm:
            with attention:
                hidden = hidden + self._dropout(self.input_layernorm(self.self_attention(
                    hidden, rotary, **docs)))
            with mlp:
                return hidden + self._dropout(self.pre_mlp_layernorm(self.mlp(hidden)))
        sandwich = self.post_self_attn_layernorm is not None
        with attention:
            out = self.self_attention(self.input_layernorm(hidden), rotary, **docs)
            hidden = hidden + self._dropout(self.post_self_attn_layernorm(out) if sandwich
                                            else out)
        with mlp:
            out = self.mlp(self.pre_mlp_layernorm(hidden))
            return hidden + self._dropout(self.post_mlp_layernorm(out) if sandwich else out)
