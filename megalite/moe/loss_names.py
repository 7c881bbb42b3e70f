"""The extra losses MoE routers add (``router.py``, through ``transformer/extra_losses.py``),
by name, and which of them a configuration turns on.  torch-free, so the planner's
communication model counts the loss sums the training loop all-reduces.
"""
from __future__ import annotations

from typing import Tuple

AUX_LOSS, Z_LOSS = "moe_aux_loss", "moe_z_loss"


def extra_loss_names(model_cfg) -> Tuple[str, ...]:
    """The extra-loss names MoE layers register under this configuration."""
    m = model_cfg
    if not m.num_experts:
        return ()
    names = []
    if m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff:
        names.append(AUX_LOSS)
    if m.moe_z_loss_coeff:
        names.append(Z_LOSS)
    return tuple(names)
