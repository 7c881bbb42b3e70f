"""ZeRO-3 with torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``), ``--use-torch-fsdp2``.

Why torch's: FSDP2 shards each parameter as a DTensor along dim 0 over the DP mesh, gathers
a unit's parameters just before its forward (and again before its backward), and
reduce-scatters its gradients as soon as the unit's backward is done -- the overlap comes
from its own streams / background work.  We only decide the units and the policy, as
torchtitan's ``apply_fsdp`` does:

* one unit per transformer layer, one for the embedding, one for the output layer (with a
  tied embedding at PP = 1 both use the same parameter, so both stay in the root unit);
  the root unit takes what is left (final norm, ...);
* TP inside, FSDP across: the mesh is the DP dimension of ``ParallelState.device_mesh()``;
  TP-split parameters are plain local tensors there, each TP rank shards its own piece;
* explicit prefetch: layer i's forward prefetches layer i+1's all-gather, its backward
  layer i-1's;
* ``--bf16``: fp32 sharded parameters (they are the optimizer's masters), bf16 compute copies
  and fp32 gradient reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``);
* megalite's loss is already divided by the global token count, so the DP reduction is a
  SUM: gradient divide factor 1, and ``set_force_sum_reduction_for_comms`` (gloo has no
  PREMUL_SUM, which a divide factor alone would pick).

FSDP2 reduce-scatters after every micro-batch's backward (it keeps no full gradient, which
is the point of ZeRO-3), so its communication is per micro-batch: all-gather 2 Psi (forward
and backward) plus reduce-scatter Psi, Psi = this rank's (TP-local) parameter count.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List

import torch

from megalite.optimizer.optimizer import model_dtype


def fsdp_units(chunk) -> List[torch.nn.Module]:
    """The modules that get their own ``fully_shard``, in forward order (root excluded)."""
    units = []
    tied = chunk.shared_embedding_weight() is not None
    if getattr(chunk, "embedding", None) is not None and not tied:
        units.append(chunk.embedding)
    units += list(chunk.decoder.layers.values())
    if getattr(chunk, "output_layer", None) is not None and not tied:
        units.append(chunk.output_layer)
    return units


def apply_fsdp2(chunk, state, cfg, device: str = "cpu") -> list:
    """Fully shard ``chunk`` in place over the DP mesh dimension; returns its FSDP modules
    (units, then the root).  The chunk's parameters become DTensors with the same names,
    so the ``ParamTable`` still finds their specs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = state.device_mesh(device, "dense")["dp"]
    if cfg.optimizer.bf16 or cfg.optimizer.fp16:   # fp32 shards = masters; half compute,
        chunk.float()                                # fp32 reduction (fp16: loss-scaled)
        mp = MixedPrecisionPolicy(param_dtype=model_dtype(cfg.optimizer),
                                  reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    units = fsdp_units(chunk)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(chunk, mesh=mesh, mp_policy=mp)
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
    modules = [*units, chunk]
    for m in modules:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return modules


@contextmanager
def counting_fsdp_collectives(counter, group_name: str = "fsdp"):
    """Count FSDP2's collectives in ``counter`` (a ``comm.CommCounter``) under
    ``group_name``: FSDP2 calls ``torch.distributed`` itself, not ``comm.py``, so its
    all-gathers (output size) and reduce-scatters (input size) are hooked here by wrapping
    the two functions it calls, with the same convention as comm.py."""
    import torch.distributed as dist

    saved = {"all_gather_single": dist.all_gather_single,
             "reduce_scatter_single": dist.reduce_scatter_single}

    def all_gather_single(output_tensor, input_tensor, *args, **kwargs):
        counter.add(group_name, "all_gather", output_tensor)
        return saved["all_gather_single"](output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):
        counter.add(group_name, "reduce_scatter", input)
        return saved["reduce_scatter_single"](output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        yield counter
    finally:
        dist.all_gather_single = saved["all_gather_single"]
        dist.reduce_scatter_single = saved["reduce_scatter_single"]
