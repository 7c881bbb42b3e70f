"""Sum gradients over the data-parallel group, coalesced into a few flat buffers.

Each micro-batch loss is already divided by the number of tokens of the *global* batch,
so the data-parallel reduction is a plain sum: the result equals the single-process
gradient whatever the DP size.  Reductions are coalesced (``comm.all_reduce_coalesced``).
"""
from __future__ import annotations

from megalite import comm
from megalite.tensor_parallel import allreduce_sequence_parallel_grads


def dp_group_name(spec) -> str:
    """The group a parameter's gradient is summed over, from its ``ParamSpec``: expert
    params over expert-DP, everything else over DP x CP (CP ranks saw other tokens of the
    same sequences)."""
    return "expert-dp" if spec.expert else "dp-cp"


def finalize_gradients(params, grad_of, state, sharded_buffers=(), *, specs) -> None:
    """Every reduction a gradient needs after the last micro-batch's backward, in order:

    1. sequence-parallel replicated params (norms, ...) summed over TP, since each TP rank
       saw only its sequence shard;
    2. tied word embeddings summed over the first+last stage ("embedding" group);
    3. everything summed over data parallel (``dp_group_name``): grads that live in a
       distributed optimizer's ``sharded_buffers`` are reduce-scattered (each DP rank keeps
       the sum of its own shard), the rest all-reduced.

    ``specs``: each parameter's ``ParamSpec`` in the order of ``params`` (the optimizer's
    ``specs``): which params are sequence-parallel, tied or experts is read there.
    """
    params, specs = list(params), list(specs)
    spec_of = {id(p): spec for p, spec in zip(params, specs)}
    allreduce_sequence_parallel_grads(params, state, grad_of, specs)
    tied = [grad_of(p) for p, spec in zip(params, specs) if spec.tied]
    if tied and state.pp.size > 1:
        comm.all_reduce_coalesced(tied, state["embedding"])
    for buf in sharded_buffers:
        buf.reduce_scatter_grads()
    in_buffers = {id(p) for buf in sharded_buffers for p in buf.params}
    rest = [p for p in params if id(p) not in in_buffers]
    for name in ("dp-cp", "expert-dp"):
        comm.all_reduce_coalesced([grad_of(p) for p in rest
                                   if dp_group_name(spec_of[id(p)]) == name], state[name])
