"""Which group reduces a gradient, which copy counts toward the norm, and the reductions
every gradient needs before the data-parallel one.

Each micro-batch loss is already divided by the number of tokens of the *global* batch,
so the data-parallel reduction is a plain sum over the policy's group of each parameter
class (``transformer/loss_reduction.py``: ``GRAD_SUM_GROUPS``): the
result equals the single-process gradient whatever the DP size.  Reductions are coalesced
(``comm.all_reduce_coalesced``).

The per-parameter lookups (``param_class``, ``dp_group_name``, ``counts_toward_norm``,
``is_tied_embedding``) are the only places here that read how a parameter is sharded; they
take its ``ParamSpec`` (``megalite.param_spec``, from the model chunks' tables), never
attributes of the parameter.  Functions over lists of parameters take their specs in the
same order.
"""
from __future__ import annotations

from typing import NamedTuple

from megalite import comm
from megalite.param_spec import ParamSpec, is_first_replica
from megalite.tensor_parallel import allreduce_sequence_parallel_grads
from megalite.transformer.loss_reduction import GRAD_SUM_GROUPS


class ClassGroups(NamedTuple):
    """The groups of one parameter class: gradients are summed over ``dp``; the grad norm
    sums over ``norm`` (every rank holding a distinct part of the class's parameters);
    copies replicated over ``tp`` count toward the norm on its rank 0 only."""
    dp: str
    norm: str
    tp: str


# dense: TP x PP hold the distinct parts ("mp"); experts: expert-TP x EP x PP ("expert-mp")
PARAM_CLASS_GROUPS = {
    "dense": ClassGroups(dp=GRAD_SUM_GROUPS["dense"], norm="mp", tp="tp"),
    "expert": ClassGroups(dp=GRAD_SUM_GROUPS["expert"], norm="expert-mp", tp="expert-tp"),
}


def param_class(spec: ParamSpec) -> str:
    """"expert" for routed-expert parameters (sharded over the expert grid), else "dense"."""
    return "expert" if spec.expert else "dense"


def dp_group_name(spec: ParamSpec) -> str:
    """The group a parameter's gradient is summed over: expert params over expert-DP,
    everything else over DP x CP (CP ranks saw other tokens of the same sequences)."""
    return PARAM_CLASS_GROUPS[param_class(spec)].dp


def is_tied_embedding(spec: ParamSpec) -> bool:
    """One of the first/last-stage copies of a tied word embedding."""
    return spec.tied is not None


def counts_toward_norm(spec: ParamSpec, coords) -> bool:
    """Count a parameter once across its class's TP group (one its spec does not split
    over it only on rank 0 of it) and once across the first/last stage copies of a tied
    embedding (the copy not at all).  ``coords``: ``param_spec.group_coords(state)``."""
    return is_first_replica(spec, coords, (PARAM_CLASS_GROUPS[param_class(spec)].tp,))


def reduce_model_parallel_grads(params, grad_of, state, specs) -> None:
    """The reductions before the data-parallel one, in order: sequence-parallel replicated
    params (norms, ...) summed over the group their spec names (TP), since each TP rank saw
    only its sequence shard; tied word embeddings summed over the first+last stage
    ("embedding" group)."""
    params, specs = list(params), list(specs)
    allreduce_sequence_parallel_grads(params, state, grad_of, specs)
    tied = [grad_of(p) for p, spec in zip(params, specs) if is_tied_embedding(spec)]
    if tied and state.pp.size > 1:
        comm.all_reduce_coalesced(tied, state["embedding"])


def allreduce_data_parallel_grads(params, grad_of, state, specs) -> None:
    """Sum every gradient over its data-parallel group (``dp_group_name``), coalesced."""
    pairs = list(zip(params, specs))
    for name in GRAD_SUM_GROUPS.values():
        comm.all_reduce_coalesced([grad_of(p) for p, spec in pairs
                                   if dp_group_name(spec) == name], state[name])


def finalize_gradients(params, grad_of, state, sharded_buffers=(), *, specs) -> None:
    """Every reduction a gradient needs after the last micro-batch's backward, for callers
    without a strategy object (tests, tools): ``reduce_model_parallel_grads``, then the
    data-parallel sum -- reduce-scatter for grads in ``sharded_buffers``, all-reduce for
    the rest.  Training goes through ``DataParallelStrategy.finish_grad_sync``.
    ``specs``: each parameter's ``ParamSpec``, in the order of ``params``."""
    params, specs = list(params), list(specs)
    reduce_model_parallel_grads(params, grad_of, state, specs)
    for buf in sharded_buffers:
        buf.reduce_scatter_grads()
    in_buffers = {id(p) for buf in sharded_buffers for p in buf.params}
    rest = [(p, spec) for p, spec in zip(params, specs) if id(p) not in in_buffers]
    allreduce_data_parallel_grads([p for p, _ in rest], grad_of, state, [s for _, s in rest])
