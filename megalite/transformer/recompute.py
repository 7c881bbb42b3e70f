"""Activation recomputation: trade a second forward for not storing activations.

Megatron's flags, Megatron's meaning:

* ``--recompute-granularity full --recompute-method uniform --recompute-num-layers k``:
  this chunk's layers are split into groups of k; only each group's input is stored and
  the whole group is re-run in backward.
* ``--recompute-granularity full --recompute-method block --recompute-num-layers k``: the
  first k layers of each pipeline chunk are checkpointed one by one, the rest are not
  (later stages hold fewer micro-batches, so they can afford to recompute less).
* ``--recompute-granularity selective --recompute-modules core_attn mlp layernorm``: only
  those submodules are re-run -- ``core_attn`` drops the s^2 attention terms, the largest
  activations per FLOP of recompute.

Everything uses ``torch.utils.checkpoint`` (``use_reentrant=False``).  Dropout masks are
reproduced: checkpoint restores the default generator, and ``_TrackerContexts`` puts the
tensor-parallel RNG tracker (and which of its states were forked in) back to where they
were during the original forward, so recomputed masks match under TP and SP too.
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable, List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from megalite.config import RECOMPUTE_MODULES

SELECTIVE_MODULES = RECOMPUTE_MODULES      # the flag's domain, declared beside the field


class _Saved:
    """Context that records the tracker (forward) or reinstates it (recompute).

    Re-enterable: a zero-bubble W pass may recompute a region a second time."""

    def __init__(self, tracker, saved: dict, restore: bool):
        self.tracker, self.saved, self.restore = tracker, saved, restore

    def __enter__(self):
        t = self.tracker
        if not self.restore:
            self.saved.update(states=t.get_states(), active=set(getattr(t, "_active", ())))
            return
        self.now = (t.get_states(), set(getattr(t, "_active", ())))
        t.set_states(self.saved["states"])
        t._active = set(self.saved["active"])

    def __exit__(self, *exc):
        if self.restore:
            self.tracker.set_states(self.now[0])
            self.tracker._active = self.now[1]
        return False


class _TrackerContexts:
    """``context_fn`` for checkpoint: remember the tracker at forward, reinstate it in
    recomputation, then restore whatever it had become by backward time."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __call__(self):
        saved: dict = {}
        return _Saved(self.tracker, saved, False), _Saved(self.tracker, saved, True)


# Callables told which tensors a checkpoint region keeps for its recomputation: outer
# saved-tensor hooks never see them (activation-memory accounting, see activation_memory).
_INPUT_PROBES: List[Callable] = []


@contextlib.contextmanager
def probe_checkpoint_inputs(callback: Callable):
    _INPUT_PROBES.append(callback)
    try:
        yield
    finally:
        _INPUT_PROBES.remove(callback)


def checkpointed(fn: Callable, tracker=None) -> Callable:
    """``fn`` run under non-reentrant checkpoint when grads are being recorded.

    With a ``tracker`` its states are put back for the recomputation (``context_fn``), which
    torch.compile cannot trace: the region then runs eagerly inside a compiled layer (a
    graph break under ``--compile``).  Without dropout no tracker is needed (none is
    passed) and compile traces the checkpoint like any other op."""
    ctx = _TrackerContexts(tracker) if tracker is not None else None

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        for probe in _INPUT_PROBES:
            probe([a for a in args if isinstance(a, torch.Tensor)])
        extra = {"context_fn": ctx} if ctx is not None else {}
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    return torch._dynamo.disable(run) if ctx is not None else run


class FullRecompute:
    """``TransformerBlock.recompute``: runs the block's layers, checkpointing per the
    method (``uniform`` groups of k, or the first k layers for ``block``)."""

    def __init__(self, method: str, num_layers: int, tracker=None):
        if method not in ("uniform", "block"):
            raise ValueError(f"--recompute-method must be uniform or block, got {method!r}")
        if num_layers < 1:
            raise ValueError("--recompute-num-layers must be >= 1")
        self.method, self.k, self.tracker = method, num_layers, tracker

    def __call__(self, layers: List[torch.nn.Module], hidden, rotary=None, document_ids=None):
        if self.method == "uniform":
            for start in range(0, len(layers), self.k):
                group = layers[start:start + self.k]

                def run_group(h, rot=rotary, docs=document_ids, group=group):
                    for layer in group:
                        h = layer(h, rot, docs)
                    return h
                hidden = checkpointed(run_group, self.tracker)(hidden)
            return hidden
        for i, layer in enumerate(layers):
            if i < self.k:
                hidden = checkpointed(layer, self.tracker)(hidden, rotary, document_ids)
            else:
                hidden = layer(hidden, rotary, document_ids)
        return hidden


def _checkpointed_forward(self, *args, **kwargs):
    inner = functools.partial(type(self).forward, self)
    return checkpointed(inner, self._recompute_tracker)(*args, **kwargs)


def wrap_module(module: torch.nn.Module, tracker=None) -> None:
    """Checkpoint ``module``'s forward in place (parameter names unchanged; a bound
    method, so ``copy.deepcopy`` of the model stays self-contained)."""
    if getattr(module, "_recompute_tracker", False) is not False:
        return
    module._recompute_tracker = tracker
    module.forward = types.MethodType(_checkpointed_forward, module)


def selective_targets(layer, modules) -> List[torch.nn.Module]:
    """The submodules of a TransformerLayer named by ``--recompute-modules``."""
    bad = set(modules) - set(SELECTIVE_MODULES)
    if bad:
        raise ValueError(f"--recompute-modules: unknown {sorted(bad)}; "
                         f"choose from {list(SELECTIVE_MODULES)}")
    out = []
    if "core_attn" in modules:
        out.append(layer.self_attention.core_attention)
    if "mlp" in modules:
        out.append(layer.mlp)
    if "layernorm" in modules:
        out += [layer.input_layernorm, layer.pre_mlp_layernorm]
    return out


def configure_layer_recompute(layers, training_cfg, tracker=None) -> None:
    """Recompute for layers outside a block (the MTP modules'): ``full`` checkpoints each
    layer whole (Megatron's MTP allows uniform with one layer per group), ``selective`` its
    named submodules."""
    t = training_cfg
    for layer in layers:
        if t.recompute_granularity == "full":
            wrap_module(layer, tracker)
        elif t.recompute_granularity == "selective":
            for module in selective_targets(layer, t.recompute_modules or ["core_attn"]):
                wrap_module(module, tracker)


def configure_recompute(block, training_cfg, tracker: Optional[object] = None) -> None:
    """Apply the ``--recompute-*`` flags of ``training_cfg`` to a TransformerBlock;
    ``tracker`` (the rank's RNG tracker; None when the model draws no dropout) is put back
    in place for each recomputation."""
    t = training_cfg
    if t.recompute_granularity is None:
        return
    if t.recompute_granularity == "full":
        block.recompute = FullRecompute(t.recompute_method or "uniform",
                                        t.recompute_num_layers, tracker)
    elif t.recompute_granularity == "selective":
        for layer in block.layers.values():
            for module in selective_targets(layer, t.recompute_modules or ["core_attn"]):
                wrap_module(module, tracker)
    else:
        raise ValueError(f"--recompute-granularity must be full or selective, "
                         f"got {t.recompute_granularity!r}")
