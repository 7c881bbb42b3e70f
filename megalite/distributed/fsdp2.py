"""ZeRO-3 with torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``), ``--use-torch-fsdp2``.

Why torch's: FSDP2 shards each parameter as a DTensor along dim 0 over a mesh, gathers a
unit's parameters just before its forward (and again before its backward), and
reduce-scatters its gradients when the unit's backward is done -- the overlap comes from its
own streams / background work.  We only decide the units, the meshes and the policy, as
torchtitan's ``apply_fsdp_to_decoder`` does:

* units: the parallelize step's (``models.parallelize.fsdp_units``: one per transformer layer,
  one for the embedding, one for the output layer, a tied embedding in the root); the root
  takes what is left.  The parallelize step (``models/parallelize.py``) calls
  ``shard_chunk`` on a chunk built on the meta device, before any value exists, then
  allocates and initialises only this rank's shards; the strategy owns the step, not the
  sharding;
* meshes (``fsdp_meshes``), built from ``ParallelState``'s own groups: dense parameters are
  sharded over DP x CP ("dp-cp": CP ranks saw other tokens of the same sequences, so their
  gradients are summed there anyway); routed experts over expert-DP -- a unit of their own
  inside their layer, as torchtitan's EP path.  With ``--num-distributed-optimizer-instances``
  R > 1 each mesh is 2-D, replicate x shard (HSDP): shards inside an instance of
  neighbouring ranks ("dp-cp-shard", so the all-gathers stay inside a node), the reduced
  shards all-reduced across instances ("dp-cp-replicate").  TP inside, FSDP across:
  TP-split parameters are plain local tensors there, each TP rank shards its own piece;
* reshard after forward: yes without PP, no with PP (torchtitan's rule: a pipeline runs
  several micro-batches' forwards before their backwards; resharding would all-gather every
  unit again per micro-batch).  With PP the schedule defers the gradient reduction to the
  last backward of each chunk (``pipeline_parallel.fsdp_sync``): one all-gather and one
  reduce-scatter per unit per step;
* explicit prefetch: unit i's forward prefetches unit i+1's all-gather, its backward i-1's;
* ``--bf16``: fp32 sharded parameters (they are the optimizer's masters), bf16 compute copies
  and fp32 gradient reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``);
* megalite's loss is already divided by the global token count, so the DP reduction is a
  SUM (``transformer/loss_reduction.py``): the policy's gradient divide factor (1), and
  ``set_force_sum_reduction_for_comms`` (gloo has no PREMUL_SUM, which a divide factor
  alone would pick).

FSDP2 calls ``torch.distributed`` itself, not ``megalite.comm``; ``comm.count_external_group``
registers its groups under our names so the counters see its collectives.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megalite import comm
from megalite.optimizer.optimizer import model_dtype
from megalite.param_spec import param_table
from megalite.parallel_state import dedicated_group, shard_group_names
from megalite.transformer.loss_reduction import GRAD_DIVIDE_FACTOR


def reshard_after_forward(cfg) -> bool:
    """torchtitan's default: free the gathered parameters after forward unless pipelining
    (PP keeps them until the chunk's last backward instead of re-gathering per micro-batch)."""
    return cfg.parallel.pp == 1


@dataclass
class FSDPMeshes:
    dense: object                  # DeviceMesh: 1-D shard, or 2-D (replicate, shard)
    expert: Optional[object]       # routed experts' mesh; None when it is the dense one


def _mesh(state, grid: str, device: str):
    """The grid's FSDP mesh on dedicated communicators (``parallel_state.dedicated_group``),
    registered with megalite.comm under the groups' names."""
    shard, replicate = shard_group_names(grid, state.grid.dp_instances)
    key = ("fsdp", grid, device, tuple(state[shard].ranks),
           tuple(state[replicate].ranks) if replicate else ())
    if key in state.meshes:
        return state.meshes[key]
    names = [shard] if replicate is None else [replicate, shard]
    groups = [dedicated_group(state, name) for name in names]
    for g in groups:
        comm.count_external_group(g.handle, g.name, g.size)
    if replicate is None:
        mesh = DeviceMesh.from_group(groups[0].handle, device, mesh_dim_names=("shard",))
    else:
        rows = [state.grid.group_of(shard, r) for r in state[replicate].ranks]
        mesh = DeviceMesh.from_group([g.handle for g in groups], device, torch.tensor(rows),
                                     mesh_dim_names=("replicate", "shard"))
    state.meshes[key] = mesh
    return mesh


def fsdp_meshes(state, device: str = "cpu", experts: bool = False) -> FSDPMeshes:
    """The dense mesh, and the experts' when they have any and it spans other ranks."""
    dense = _mesh(state, "dense", device)
    if not experts:
        return FSDPMeshes(dense, None)
    shard, replicate = shard_group_names("expert", state.grid.dp_instances)
    d_shard, d_rep = shard_group_names("dense", state.grid.dp_instances)
    same = state[shard].ranks == state[d_shard].ranks and \
        (replicate is None or state[replicate].ranks == state[d_rep].ranks)
    return FSDPMeshes(dense, None if same else _mesh(state, "expert", device))


def expert_submodules(unit: torch.nn.Module, expert_ids: set) -> List[torch.nn.Module]:
    """The largest submodules of ``unit`` whose parameters are all routed experts (by the
    parameter table, not by class): each becomes an FSDP unit on the experts' mesh."""
    out, taken = [], set()
    for _, m in unit.named_modules():
        params = list(m.parameters())
        if m is unit or not params or any(id(p) in taken for p in params):
            continue
        if all(id(p) in expert_ids for p in params):
            out.append(m)
            taken |= {id(p) for p in params}
    return out


def shard_chunk(chunk, cfg, state, units, device: Optional[str] = None) -> list:
    """Fully shard ``chunk`` in place, each of ``units`` (the model family's
    ``fsdp_units``, in forward order) its own FSDP unit and the chunk the root; returns its
    FSDP modules (expert units, units, then the root).  The parameters become DTensors with
    the same names, so the ``ParamTable`` still finds their specs.  ``device``: the meshes'
    (default: where the chunk's parameters are)."""
    units = list(units)
    device = device or next(chunk.parameters()).device.type
    expert_ids = {id(p) for _, p, spec in param_table(chunk).named(chunk) if spec.expert}
    meshes = fsdp_meshes(state, device, experts=bool(expert_ids))
    if cfg.optimizer.bf16 or cfg.optimizer.fp16:   # fp32 shards = masters; half compute,
        chunk.float()                                # fp32 reduction (fp16: loss-scaled)
        mp = MixedPrecisionPolicy(param_dtype=model_dtype(cfg.optimizer),
                                  reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    after_forward = reshard_after_forward(cfg)
    modules = []
    for unit in units:
        if meshes.expert is not None:
            for sub in expert_submodules(unit, expert_ids):
                fully_shard(sub, mesh=meshes.expert, mp_policy=mp,
                            reshard_after_forward=after_forward)
                modules.append(sub)
        fully_shard(unit, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=after_forward)
        modules.append(unit)
    fully_shard(chunk, mesh=meshes.dense, mp_policy=mp)
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
    modules.append(chunk)
    for m in modules:
        m.set_gradient_divide_factor(GRAD_DIVIDE_FACTOR)
        m.set_force_sum_reduction_for_comms(True)
    # the last chunk returns its per-token loss transposed (a view); only the loss function
    # reads it, never in place, so FSDP2's warning about views is a false alarm here
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPTModel\) "
                            r"returned a view tensor")
    return modules


def materialize_shards(chunk, device) -> None:
    """Allocate a chunk fully sharded on the meta device on ``device``: only this rank's
    shards (uninitialised; the parallelize step fills them next).  Buffers start at zero:
    the only ones a model holds (the MoE router's expert bias) do.

    ``Module.to_empty`` would do the allocation, but it swaps DTensor parameters in place,
    which fails while anything holds a weak reference to them (torch's profiler under the
    tensor-memory meter does): new parameter objects are set instead, and FSDP2 adopts them
    the way its own ``_apply`` does (``reset_sharded_param``)."""
    for module in chunk.modules():
        for name, p in module._parameters.items():
            if p is None or not p.is_meta:
                continue
            if isinstance(p, DTensor):
                local = torch.empty_like(p.to_local(), device=device)
                new = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                         shape=p.shape, stride=p.stride())
            else:
                new = torch.empty_like(p, device=device)
            module._parameters[name] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros_like(b, device=device)
    with torch.no_grad():
        for module in chunk.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.reset_sharded_param()


def expected_collectives(chunks, num_micro_batches: int, pipelined: bool) -> dict:
    """``{"group/op": elements}`` FSDP2 should issue on this rank in one step, from its real
    units (the theory the counters are held to): every unit's parameters, dim 0 padded to
    the shard count, gathered for forward and again for backward per micro-batch (the root
    once: it stays gathered) and reduce-scattered per micro-batch -- with PP one gather and
    one reduction per step; HSDP all-reduces each reduced shard across instances."""
    out: dict = {}

    def add(key, n):
        out[key] = out.get(key, 0) + int(n)
    for chunk in chunks:
        fsdp = [m for m in chunk.modules() if isinstance(m, FSDPModule)]
        nested = {id(m): {id(p) for sub in m.modules() if sub is not m and sub in fsdp
                          for p in sub.parameters()} for m in fsdp}
        for m in fsdp:
            gathers = 1 if pipelined else num_micro_batches * (1 if m is chunk else 2)
            reduces = 1 if pipelined else num_micro_batches
            for p in m.parameters():
                if id(p) in nested[id(m)]:
                    continue
                names = [comm.external_group_name(p.device_mesh.get_group(d))
                         for d in p.device_mesh.mesh_dim_names]
                sizes = list(p.device_mesh.mesh.shape)
                shard, size = names[-1], sizes[-1]
                rows = -(-p.shape[0] // size) * size
                padded = rows * (p.numel() // p.shape[0])
                if size > 1:
                    add(f"{shard}/all_gather", gathers * padded)
                    add(f"{shard}/reduce_scatter", reduces * padded)
                if len(names) == 2 and sizes[0] > 1:
                    add(f"{names[0]}/all_reduce", reduces * padded // size)
    return out
