"""The MoE block that fills a layer's ``moe_mlp`` slot: router -> dispatch -> local experts
-> combine (+ the shared expert), with per-step load statistics.

Parameter names follow Megatron-Core: ``mlp.router.weight``, ``mlp.experts.linear_fc1
.weight`` / ``linear_fc2.weight`` (all experts, expert dimension first) and
``mlp.shared_experts.linear_fc1/linear_fc2`` (+ ``gate_weight`` with
``--moe-shared-expert-gate``).

``--moe-apply-probs-on-input`` (Llama 4): the router's score scales the token going into
its expert, and the expert's output is summed unweighted.  With top-1 routing (the rule
that allows it, ``cli/features.py``) a token is one (token, expert) pair, so the tokens are
scaled before any dispatcher and every pair's weight is 1.

Statistics: each training forward (inside the family's extra-loss collection, so never a
recomputation) adds the router's expert counts and terms to ``step_stats``;
``moe_step_metrics`` (called by the loop after the optimizer step) reduces them over the
global batch, nudges the expert bias, logs and clears them.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.moe.token_dispatcher import build_dispatcher
from megalite.transformer.extra_losses import is_collecting
from megalite.transformer.spec import build_module
from megalite import comm


class MoELayer(nn.Module):
    def __init__(self, model_cfg, comm_groups, *, submodules, sequence_parallel: bool,
                 layer_number: int = 0, device=None, dtype=None):
        super().__init__()
        m = model_cfg
        kw = dict(device=device, dtype=dtype)
        self.layer_number = layer_number
        self.router = build_module(submodules.router, m, comm_groups,
                                   sequence_parallel=sequence_parallel,
                                   layer_number=layer_number, **kw)
        self.experts = build_module(submodules.experts, m, comm_groups, **kw)
        self.shared_experts = None
        if m.moe_shared_expert_intermediate_size and submodules.shared_experts is not None:
            self.shared_experts = build_module(submodules.shared_experts, m, comm_groups,
                                               sequence_parallel=sequence_parallel,
                                               layer_number=layer_number, **kw)
        self.token_dispatcher = build_dispatcher(m, comm_groups)
        self.probs_on_input = bool(m.moe_apply_probs_on_input)
        self.step_stats = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        tokens = hidden.reshape(-1, h)
        probs, indices, keep = self.router(tokens, b)
        if self.probs_on_input:         # top-1: one pair per token (module docstring)
            tokens, probs = tokens * probs, torch.ones_like(probs)
        # read before dispatching: an overlapped F&B pair's other half may recompute this
        # layer (and set the router's stats) while the dispatch all-to-all is in flight
        stats = self.router.last_stats
        out = self.token_dispatcher(tokens, probs, indices, keep, self.experts).view(s, b, h)
        if self.training and torch.is_grad_enabled() and is_collecting():
            self._record(stats)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out

    def _record(self, stats) -> None:
        if self.step_stats is None:
            self.step_stats = {"counts": torch.zeros_like(stats["counts"], dtype=torch.float64),
                               "aux_loss": 0.0, "z_loss": 0.0, "micro_batches": 0}
        acc = self.step_stats
        acc["counts"] += stats["counts"].double()
        acc["aux_loss"] += stats["aux_loss"]
        acc["z_loss"] += stats["z_loss"]
        acc["micro_batches"] += 1

    @torch.no_grad()
    def update_expert_bias(self, global_counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3: raise the bias of experts below the mean load, lower the others."""
        bias = self.router.expert_bias
        if bias is not None:
            bias += rate * torch.sign(global_counts.mean() - global_counts).to(bias.dtype)


def moe_layers(chunks):
    """{global layer number: MoELayer} of this rank's model chunks."""
    out = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                out[module.layer_number] = module
    return out


EXPERT_BIAS_SUFFIX = "mlp.router.expert_bias"


def expert_bias_key(layer: int, num_layers: int) -> str:
    """The name of layer ``layer``'s expert bias in a full state dict (a router buffer, not
    a parameter: checkpoints keep it in their JSON metadata, keyed by layer number; the HF
    converters carry it under this name).  Layers from ``num_layers`` on are MTP layers."""
    if layer < num_layers:
        return f"decoder.layers.{layer}.{EXPERT_BIAS_SUFFIX}"
    return f"mtp.layers.{layer - num_layers}.transformer_layer.{EXPERT_BIAS_SUFFIX}"


def split_expert_bias(full_sd: dict, num_layers: int, num_all_layers: int) -> tuple:
    """(full_sd without expert-bias entries, {layer number (str): bias list})."""
    keys = {expert_bias_key(n, num_layers): n for n in range(num_all_layers)}
    rest = {k: v for k, v in full_sd.items() if k not in keys}
    bias = {str(keys[k]): v.float().tolist() for k, v in full_sd.items() if k in keys}
    return rest, bias


def expert_bias_entries(saved: dict, num_layers: int) -> dict:
    """{full state-dict name: bias tensor} of a checkpoint's ``moe_expert_bias`` metadata."""
    return {expert_bias_key(int(n), num_layers): torch.tensor(v, dtype=torch.float32)
            for n, v in (saved or {}).items()}


def expert_bias_state(chunks, state) -> dict:
    """{layer number (str): bias list} of every MoE layer of the model, on every rank
    (gathered over pp), for a checkpoint's JSON metadata.  Collective over pp."""
    mine = {str(n): layer.router.expert_bias.tolist() for n, layer in moe_layers(chunks).items()
            if layer.router.expert_bias is not None}
    out = {}
    for part in comm.all_gather_object(mine, state.pp):
        out.update(part)
    return out


@torch.no_grad()
def load_expert_bias_state(chunks, saved: dict) -> None:
    for n, layer in moe_layers(chunks).items():
        if layer.router.expert_bias is not None and str(n) in saved:
            layer.router.expert_bias.copy_(torch.tensor(saved[str(n)]))


class ExpertBiasState:
    """DCP ``Stateful``: the routers' expert biases (DeepSeek-V3's aux-loss-free balancing),
    ``<layer number>`` -> bias list.  A router buffer, not a parameter: small, replicated on
    every rank of a stage, so it travels as JSON (``extra.moe_expert_bias``), gathered over
    PP so any rank of a new layout finds its layers."""

    def __init__(self, chunks, state):
        self.chunks, self.state = chunks, state

    def state_dict(self) -> dict:
        """Collective over pp."""
        return expert_bias_state(self.chunks, self.state)

    def load_state_dict(self, sd: dict) -> None:
        load_expert_bias_state(self.chunks, sd or {})
