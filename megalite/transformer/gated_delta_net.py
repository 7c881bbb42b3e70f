"""Gated DeltaNet: the linear-attention layer of Qwen3-Next's hybrid (``--experimental-
attention-variant gated_delta_net`` in the layers ``--linear-attention-freq`` marks).

    in_proj_qkvz   column-parallel, hidden -> per q/k head group g: [q_g (dk), k_g (dk),
                   v_g (r*dv), z_g (r*dv)], r = value heads per q/k head
    in_proj_ba     column-parallel, hidden -> per group g: [b_g (r), a_g (r)]
    conv_weight    [channels, K]: the causal depthwise convolution over [q_g, k_g, v_g] of
                   every group (channels grouped as in_proj_qkvz, so one contiguous split)
    A_log, dt_bias [value heads]: the decay g = -exp(A_log) softplus(a + dt_bias)
    norm           RMSNorm over each value head's output, times silu(z) (Qwen3-Next's
                   RMSNormGated: a plain weight, not zero-centred)
    out_proj       row-parallel, value heads x dv -> hidden

Both projections lay rows out per q/k head group, as Qwen3-Next's checkpoints do, so TP
rank r owns a contiguous block of groups -- their q/k heads, value heads, conv channels,
A_log and dt_bias entries -- and needs no communication between the two linears (the
column-parallel input and the row-parallel output are the only collectives, as in
attention; with sequence parallelism they gather and reduce-scatter the sequence).  The
gated norm's weight is shared by every head, so its gradient is partial on each TP rank
and is summed over TP (its ``ParamSpec`` names the group, as the --qk-layernorm weights').

The recurrence runs in fp32 (``transformer/delta_rule.py``); on CUDA with the ``fla``
package present its fused chunk kernel runs instead (never required).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite.param_spec import ParamSpec, make_param
from megalite.transformer.delta_rule import (causal_conv1d, chunk_gated_delta_rule,
                                             document_resets, l2norm)
from megalite.transformer.spec import build_module

CHUNK_SIZE = 64     # tokens per chunk of the delta rule (the FLA kernels' and Qwen3-Next's)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * w * silu(z) over the last dim, in fp32 (Qwen3-Next's RMSNormGated).
    ``heads_split``: the weight sees only this TP rank's heads (grad summed over TP)."""

    def __init__(self, size: int, eps: float, heads_split: bool, device=None, dtype=None):
        super().__init__()
        self.eps, self.shape = eps, (size,)
        make_param(self, "weight", ParamSpec((size,), init=("ones",),
                                             sequence_parallel="tp" if heads_split else None),
                   {}, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), self.shape, None, self.eps)
        y = self.weight * y.to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


def _fla_chunk_rule():
    """The ``fla`` package's fused chunk kernel, or None (an optional dependency, imported
    on first use so that importing megalite never needs it)."""
    try:
        # optional dependency: flash-linear-attention's kernels, never required
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fused
    except ImportError:
        return None
    return fused


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer on [s, b, h] (``self_attention``'s slot contract:
    ``forward(hidden, rotary=None, document_ids=None)``; rotary is not used)."""

    def __init__(self, model_cfg, comm_groups, *, submodules, sequence_parallel: bool,
                 layer_number: int, device=None, dtype=None):
        super().__init__()
        m = model_cfg
        tp = comm_groups.tp.size
        self.layer_number = layer_number
        self.key_heads, self.value_heads = m.linear_num_key_heads, m.linear_num_value_heads
        # rule "Gated DeltaNet heads split over TP" (cli/features.py)
        assert self.key_heads % tp == 0 and self.value_heads % self.key_heads == 0, \
            f"rule 'Gated DeltaNet heads split over TP': {self.key_heads} q/k heads, " \
            f"{self.value_heads} value heads, TP {tp}"
        self.r = self.value_heads // self.key_heads
        self.dk, self.dv = m.linear_key_head_dim, m.linear_value_head_dim
        self.kernel = m.linear_conv_kernel_dim
        self.local_groups = self.key_heads // tp
        self.group_qkv = 2 * self.dk + self.r * self.dv     # conv channels per group
        std = m.init_method_std
        kw = dict(tp_group=comm_groups.tp, bias=False, sequence_parallel=sequence_parallel,
                  device=device, dtype=dtype)
        self.in_proj_qkvz = build_module(
            submodules.linear_qkvz, m.hidden_size,
            self.key_heads * (self.group_qkv + self.r * self.dv), init_std=std, **kw)
        self.in_proj_ba = build_module(submodules.linear_ba, m.hidden_size,
                                       self.key_heads * 2 * self.r, init_std=std, **kw)
        sizes = {"tp": tp}
        pk = dict(device=device, dtype=dtype)
        make_param(self, "conv_weight", ParamSpec.split(
            (self.key_heads * self.group_qkv, self.kernel), 0, "tp",
            init=("normal", std)), sizes, **pk)
        make_param(self, "A_log", ParamSpec.split((self.value_heads,), 0, "tp",
                                                  init=("log_uniform", 1.0, 16.0)), sizes, **pk)
        make_param(self, "dt_bias", ParamSpec.split((self.value_heads,), 0, "tp",
                                                    init=("ones",)), sizes, **pk)
        self.norm = GatedRMSNorm(self.dv, m.norm_epsilon, tp > 1, **pk)
        self.out_proj = build_module(
            submodules.linear_out, self.value_heads * self.dv, m.hidden_size,
            input_is_parallel=True, init_std=std / (2.0 * m.num_layers) ** 0.5, **kw)

    def forward(self, hidden: torch.Tensor, rotary=None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` [b, s]: the state and the convolution restart at each document."""
        qkvz = self.in_proj_qkvz(hidden)                       # [s, b, g * (qkv + r dv)]
        ba = self.in_proj_ba(hidden)                           # [s, b, g * 2r]
        s, b = qkvz.shape[:2]
        g, r, dk, dv = self.local_groups, self.r, self.dk, self.dv
        qkv, z = qkvz.view(s, b, g, -1).split([self.group_qkv, r * dv], dim=-1)
        mixed = qkv.reshape(s, b, g * self.group_qkv).permute(1, 2, 0)    # [b, ch, s]
        mixed = F.silu(self._conv(mixed, document_ids))
        mixed = mixed.permute(0, 2, 1).reshape(b, s, g, self.group_qkv)
        q, k, v = mixed.split([dk, dk, r * dv], dim=-1)
        v = v.reshape(b, s, g * r, dv)
        beta_in, a = ba.view(s, b, g, 2 * r).split([r, r], dim=-1)
        beta = beta_in.reshape(s, b, g * r).transpose(0, 1).sigmoid()     # [b, s, heads]
        a = a.reshape(s, b, g * r).transpose(0, 1)
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        q, k = (l2norm(x.float()) for x in (q, k))
        if r > 1:            # each q/k head serves r consecutive value heads
            q, k = (x.repeat_interleave(r, dim=2) for x in (q, k))
        out = self._recurrence(q, k, v, decay, beta, document_ids)   # [b, s, heads, dv]
        z = z.reshape(s, b, g * r, dv).transpose(0, 1)
        out = self.norm(out, z).reshape(b, s, g * r * dv).transpose(0, 1)
        return self.out_proj(out)

    # -- the two parts that see along the sequence (context parallelism overrides them:
    # -- context_parallel/delta_state.py) ------------------------------------------------
    def _conv(self, mixed: torch.Tensor, document_ids) -> torch.Tensor:
        """The causal convolution of [b, channels, s] (this rank holds the whole sequence)."""
        return causal_conv1d(mixed, self.conv_weight, documents=document_ids)

    def _recurrence(self, q, k, v, decay, beta, document_ids) -> torch.Tensor:
        """The delta rule over the whole sequence, from a zero state."""
        resets = None if document_ids is None else document_resets(document_ids)
        fused = _fla_chunk_rule() if q.is_cuda and resets is None else None
        if fused is not None:   # fla's kernel: same layout, q/k already normalized
            out, _ = fused(q.to(v.dtype), k.to(v.dtype), v, g=decay, beta=beta.to(v.dtype),
                           scale=q.shape[-1] ** -0.5, output_final_state=False)
            return out
        out, _ = chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=CHUNK_SIZE,
                                        resets=resets)
        return out
