"""QK-clip (MuonClip, Kimi K2; Megatron-Core's ``clip_qk``): after each update, the Q and K
rows of every query group whose largest attention logit of the step exceeded tau are scaled
by eta = tau / max (Q by eta^alpha, K by eta^(1-alpha), ``--qk-clip-alpha``), so that logit
would have been tau.  Per query group, as Megatron: under GQA the group's heads share K, so
the group's maximum decides (one head per group without GQA: per head).

Layouts: heads (and so groups) are split over TP, so each rank clips its own groups'
rows of its linear_qkv shard; the maximum is taken over the data-parallel ranks (dp-cp:
other samples of the same heads); each stage clips its own layers.  Context parallelism is
refused for now (cli/features.py): its ring and all-to-all kernels do not record the
logits; the dp-cp maximum is already the one they would need.  The optimizer scales every copy of the rows it keeps (the model's
weight, fp32 masters, a distributed optimizer's flat range, an FSDP2 row piece:
``scale_rows``)."""
from __future__ import annotations

from typing import List

import torch

from megalite import comm
from megalite.transformer.attention import SelfAttention


def qk_row_scale(attn: SelfAttention, group_max: torch.Tensor, tau: float,
                 alpha: float) -> torch.Tensor:
    """The factor of each row of this rank's linear_qkv weight: per local query group
    [q rows of its heads, k rows, v rows] -> [eta^alpha, eta^(1-alpha), 1]."""
    eta = torch.clamp(tau / group_max, max=1.0)
    r, d = attn.heads_per_group, attn.head_dim
    per = torch.cat([eta[:, None].pow(alpha).expand(-1, r * d),
                     eta[:, None].pow(1 - alpha).expand(-1, d),
                     torch.ones(eta.numel(), d, dtype=eta.dtype, device=eta.device)], dim=1)
    return per.reshape(-1)


def layers_recording(model_chunks) -> List[SelfAttention]:
    return [m for c in model_chunks for m in c.modules() if isinstance(m, SelfAttention)
            and getattr(m.core_attention, "record_max_logits", False)]


@torch.no_grad()
def clip_qk(model_chunks, strategy, state, model_cfg, clip: bool = True) -> float:
    """Clip every recording layer of this rank (``clip`` False, a skipped update: only
    forget the step's maxima); returns the step's largest logit over the whole model (every
    head and stage), Megatron's "max attention logit"."""
    strategy.wait_param_gathers()
    tau, alpha, largest = model_cfg.qk_clip_threshold, model_cfg.qk_clip_alpha, 0.0
    for attn in layers_recording(model_chunks):
        core = attn.core_attention
        if core.max_logits is None:
            continue
        heads = core.max_logits.float().clone()
        comm.all_reduce(heads, state["dp-cp"], op="max")
        core.max_logits = None
        largest = max(largest, float(heads.max()))
        group_max = heads.view(attn.local_groups, attn.heads_per_group).amax(dim=1)
        if clip and bool((group_max > tau).any()):
            strategy.optimizer.scale_rows(attn.linear_qkv.weight,
                                          qk_row_scale(attn, group_max, tau, alpha))
    out = torch.tensor([largest], dtype=torch.float32)
    comm.all_reduce(out, state["mp"], op="max")      # other heads (TP), other layers (PP)
    return float(out)
