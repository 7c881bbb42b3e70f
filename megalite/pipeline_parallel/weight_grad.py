"""Split a backward pass into B (input gradients) now and W (weight gradients) later.

Zero-bubble schedules need B on the critical path (the previous stage waits for its
gradient) and W in the bubbles.  This works on any autograd graph, so the model needs no
special layers:

* ``D`` is every graph node from which the stage input is reachable -- the activation
  path that B must run anyway.
* For each parameter, the first ``D`` nodes met walking from the parameter towards the
  output are its *intermediates* (for ``y = x @ w.t()`` the ``MmBackward`` node).
* B runs ``torch.autograd.grad`` w.r.t. the stage input only: autograd then skips every
  edge into a weight branch, and pre-hooks on the intermediates record the gradient
  arriving at them.
* W replays each intermediate with its recorded gradient, asking only for its parameters
  (``torch.autograd.backward(..., inputs=params)``): autograd computes just the weight
  edges and accumulates into ``param.grad`` through the usual AccumulateGrad nodes, so
  post-accumulate hooks (bf16 ``main_grad``) fire exactly as for a normal backward.

Parameters that no intermediate reaches (none in a well-formed stage) fall back to one
more backward from the outputs in W.  On the first stage the "input" is the embedding
output, captured by the executor with a forward hook.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge


def _node_of(t: torch.Tensor):
    """grad_fn, or the AccumulateGrad node of a leaf (created on demand via a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_edges(roots) -> Dict[object, List[object]]:
    rev: Dict[object, List[object]] = collections.defaultdict(list)
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            rev[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return rev


def _closure(starts, rev, stop=frozenset()):
    """Nodes reached from ``starts`` towards the outputs; ``stop`` nodes end a walk."""
    out, hit = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in rev.get(queue.popleft(), ()):
            if parent in out:
                continue
            if parent in stop:
                hit.add(parent)
                continue
            out.add(parent)
            queue.append(parent)
    return out, hit


class PendingWeightGrad:
    """What B leaves for W: per parameter group, the intermediates and their gradients."""

    def __init__(self, groups, fallback, outputs, grad_outputs):
        self.groups = groups          # list of {"params": [...], "nodes": [...], "grads": {}}
        self.fallback = fallback      # params no intermediate reaches
        self.outputs, self.grad_outputs = outputs, grad_outputs

    def run(self) -> None:
        """W: accumulate every weight gradient of this micro-batch, then drop the graph."""
        for group in self.groups:
            roots, grads = [], []
            for node in group["nodes"]:
                for i, g in enumerate(group["grads"].get(node, ())):
                    if g is not None:
                        roots.append(GradientEdge(node, i))
                        grads.append(g)
            if not roots:
                continue
            handles = []
            if len(group["nodes"]) > 1:  # one intermediate may feed another: pin recorded grads
                for node in group["nodes"]:
                    saved = group["grads"].get(node)
                    if saved is not None:
                        handles.append(node.register_prehook(lambda _g, s=saved: s))
            try:
                torch.autograd.backward(roots, grads, retain_graph=True, inputs=group["params"])
            finally:
                for h in handles:
                    h.remove()
        if self.fallback:
            torch.autograd.backward(self.outputs, self.grad_outputs, inputs=self.fallback)
        self.groups = self.fallback = self.outputs = self.grad_outputs = None


def backward_input(outputs: Sequence, grad_outputs: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[Optional[torch.Tensor]], params: Sequence[torch.nn.Parameter]):
    """B: gradients w.r.t. ``inputs`` (tensors, leaf or not; None entries are skipped)
    from ``outputs`` (tensors or GradientEdges); returns (grads, pending W)."""
    outputs, grad_outputs = list(outputs), list(grad_outputs)
    params = [p for p in params if p.requires_grad]
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    roots = [o.node if isinstance(o, GradientEdge) else o.grad_fn for o in outputs]
    roots = [r for r in roots if r is not None]
    rev = _reverse_edges(roots)
    input_nodes = [_node_of(t) for t in inputs]
    d_nodes, _ = _closure(input_nodes, rev)
    param_node = {_node_of(p): p for p in params}

    # Group parameters that share an intermediate (union of overlapping sets).
    groups: List[dict] = []
    owner: Dict[object, dict] = {}
    fallback = []
    for node, p in param_node.items():
        if node not in rev:
            continue  # not used by this graph: no gradient, as in a normal backward
        _, hit = _closure([node], rev, stop=d_nodes)
        if node in d_nodes or not hit:
            fallback.append(p)
            continue
        merged = {"params": [p], "nodes": set(hit), "grads": {}}
        for other in {id(owner[h]): owner[h] for h in hit if h in owner}.values():
            merged["params"] += other["params"]
            merged["nodes"] |= other["nodes"]
            groups = [g for g in groups if g is not other]
        groups.append(merged)
        for h in merged["nodes"]:
            owner[h] = merged
    for g in groups:
        g["nodes"] = list(g["nodes"])

    # Non-leaf inputs are captured, not executed: their gradient is B's result itself.
    input_edges = {t.grad_fn: t.output_nr for t in inputs if t.grad_fn is not None}
    handles = []
    for node, group in owner.items():
        if node in input_edges:
            continue

        def hook(grad_outputs_, node=node, group=group):
            group["grads"][node] = tuple(grad_outputs_)
        handles.append(node.register_prehook(hook))
    try:
        if inputs:
            grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True,
                                        allow_unused=True)
        else:  # nothing to send and nothing to split on: all of it is W
            grads = ()
            fallback = params
            groups = []
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(inputs, grads):
        node = t.grad_fn
        if node in input_edges and node in owner:
            slots = [None] * (input_edges[node] + 1)
            slots[input_edges[node]] = g
            owner[node]["grads"][node] = tuple(slots)
    return list(grads), PendingWeightGrad(groups, fallback, outputs, grad_outputs)
