"""Split a backward pass into B (input gradients) now and W (weight gradients) later.

Zero-bubble schedules need B on the critical path (the previous stage waits for its
gradient) and W in the bubbles, and B + W must cost what one backward costs -- otherwise
the split spends more than the bubble it fills.  So W replays no graph: each parameter
is sorted, by where it enters the stage's graph, into one of three kinds:

* **Deferred** -- it is only the weight (or bias) of linears whose ``autograd.Function``
  defers (``tensor_parallel.deferred_wgrad``: every linear of ``tensor_parallel.layers``).
  B leaves it out of ``torch.autograd.grad``'s inputs; each such linear then computes dX
  and stores (input, dY); W runs only the dW GEMMs.  Nothing is replayed, so nothing
  checkpointed is recomputed a second time (a replay re-runs a checkpointed region per
  engine call) and no input-gradient edge is walked twice.
* **Below the input** -- on the first stage the "input" is the embedding output
  (captured by the executor with a forward hook); the embedding table sits below it.  B
  never runs those nodes, so W replays them from B's own input gradient.
* **In B** -- every other parameter (norms' weights, a router, experts' grouped GEMMs,
  one a deferring linear shares with another op) is one more input of B's
  ``torch.autograd.grad``: its gradient is formed by the backward B runs anyway, held,
  and accumulated in W.

D below is every graph node from which a stage input is reachable (the activation
path); a parameter's *entries* are the first D nodes met walking from it towards the
outputs, which is what sorts it.  W accumulates into ``param.grad`` through the usual
``AccumulateGrad`` nodes (held gradients as ``backward`` roots, deferred dW through the
edge the weight came in on), so post-accumulate hooks (bf16 ``main_grad``) fire exactly
as in a normal backward.  B runs with ``retain_graph=False``: what W needs it holds
itself, so a stage's activations are freed after B as the zero-bubble memory model
assumes.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge

from megalite.tensor_parallel.deferred_wgrad import WgradStash, collecting


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


def _closure(starts, rev):
    """Nodes reached from ``starts`` towards the outputs."""
    out = set(starts)
    queue = collections.deque(starts)
    while queue:
        for parent in rev.get(queue.popleft(), ()):
            if parent not in out:
                out.add(parent)
                queue.append(parent)
    return out


def _subgraph(starts):
    """Nodes reachable from ``starts`` towards the leaves (what backward from them runs)."""
    out, queue = set(starts), collections.deque(starts)
    while queue:
        for child, _ in queue.popleft().next_functions:
            if child is not None and child not in out:
                out.add(child)
                queue.append(child)
    return out


def _entries(start, rev, d_nodes):
    """(D node, the child it was entered from) for each first D node met from ``start``."""
    seen, hit = {start}, set()
    queue = collections.deque([start])
    while queue:
        child = queue.popleft()
        for parent in rev.get(child, ()):
            if parent in d_nodes:
                hit.add((parent, child))
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return hit


def _deferred_entry(node, child) -> bool:
    """Does ``child`` feed ``node`` only at slots whose gradient the node's Function
    defers to W (``defers_wgrad``: its weight and bias)?"""
    slots = getattr(getattr(node, "_forward_cls", None), "defers_wgrad", ())
    used = [i for i, (c, _) in enumerate(node.next_functions) if c is child]
    return bool(slots) and all(i in slots for i in used)


class PendingWeightGrad:
    """What B leaves for W: the deferred dW GEMMs, the gradients B formed for the
    parameters it took, and the nodes below the stage input with their gradients."""

    def __init__(self, stash: Optional[WgradStash], held, below, fallback, outputs,
                 grad_outputs):
        self.stash = stash              # deferred linears' dW/db
        self.held = held                # [(param, grad)] formed in B
        self.below = below              # {"params": [...], "roots": [(node, nr)], "grads": [...]}
        self.fallback = fallback        # nothing was split (no input): the whole backward
        self.outputs, self.grad_outputs = outputs, grad_outputs

    def run(self) -> None:
        """W: accumulate every weight gradient of this micro-batch, then drop it all."""
        if self.stash is not None:
            self.stash.run()
        held = [(p, g) for p, g in self.held if g is not None]
        if held:
            torch.autograd.backward([p for p, _ in held], [g for _, g in held])
        if self.below and self.below["roots"]:
            torch.autograd.backward([GradientEdge(n, i) for n, i in self.below["roots"]],
                                    self.below["grads"], inputs=self.below["params"])
        if self.fallback:
            torch.autograd.backward(self.outputs, self.grad_outputs, inputs=self.fallback)
        self.stash = self.held = self.below = self.fallback = None
        self.outputs = self.grad_outputs = None


def backward_input(outputs: Sequence, grad_outputs: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[Optional[torch.Tensor]], params: Sequence[torch.nn.Parameter]):
    """B: gradients w.r.t. ``inputs`` (tensors, leaf or not; None entries are skipped)
    from ``outputs`` (tensors or GradientEdges); returns (grads, pending W)."""
    outputs, grad_outputs = list(outputs), list(grad_outputs)
    params = [p for p in params if p.requires_grad]
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    if not inputs:   # nothing to send and nothing to split on: all of it is W
        return [], PendingWeightGrad(None, [], None, params, outputs, grad_outputs)
    roots = [o.node if isinstance(o, GradientEdge) else o.grad_fn for o in outputs]
    roots = [r for r in roots if r is not None]
    rev = _reverse_edges(roots)
    input_nodes = {_node_of(t): t for t in inputs}
    d_nodes = _closure(list(input_nodes), rev)

    in_b, below = [], []
    for p in params:
        node = _node_of(p)
        if node not in rev:
            continue  # not used by this graph: no gradient, as in a normal backward
        hits = _entries(node, rev, d_nodes) if node not in d_nodes else ()
        if hits and all(n in input_nodes or _deferred_entry(n, c) for n, c in hits):
            if any(n in input_nodes for n, _ in hits):
                below.append(p)
        else:   # formed by B's own backward (or reaching no D node at all)
            in_b.append(p)
    # B frees the nodes it runs; if it must run a node below the input for a parameter it
    # takes, the below-input replay could not: then B takes those parameters too.
    if below and in_b:
        under = _subgraph([t.grad_fn for t in inputs if t.grad_fn is not None])
        if under & _closure([_node_of(p) for p in in_b], rev):
            in_b, below = in_b + below, []

    with collecting(roots) as stash:
        grads = torch.autograd.grad(outputs, inputs + in_b, grad_outputs, allow_unused=True)
    grads = list(grads)
    input_grads, held = grads[:len(inputs)], list(zip(in_b, grads[len(inputs):]))
    below_w = None
    if below:
        pairs = [(t.grad_fn, t.output_nr, g) for t, g in zip(inputs, input_grads)
                 if t.grad_fn is not None and g is not None]
        below_w = {"params": below, "roots": [(n, i) for n, i, _ in pairs],
                   "grads": [g for _, _, g in pairs]}
    return input_grads, PendingWeightGrad(stash, held, below_w, [], outputs, grad_outputs)
