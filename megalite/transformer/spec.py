"""Submodule specs: which class fills each slot of a transformer layer (Megatron's ModuleSpec).

A layer is built from a tree of slots instead of hard-coded classes, so Transformer Engine,
context-parallel attention and MoE become spec choices rather than constructor edits:

    TransformerLayer
      input_layernorm      norm builder            (model_cfg, hidden, sequence_parallel, ...)
      self_attention       ModuleSpec(SelfAttention, submodules=SelfAttentionSubmodules)
        linear_qkv         column-parallel linear  (in, out, *, tp_group, bias, ...)
        q_layernorm        norm builder over the head dim (--qk-layernorm)
        k_layernorm        norm builder over the head dim (--qk-layernorm)
        core_attention     (model_cfg, comm_groups, *, layer_number, attn_mask_type)
        linear_proj        row-parallel linear
                           or ModuleSpec(MLASelfAttention, MLASelfAttentionSubmodules):
                           q/kv down and up projections, latent norms, core attention, proj
      pre_mlp_layernorm    norm builder
      mlp / moe_mlp        chosen per layer by ``ModelConfig.is_moe_layer`` (``mlp_for_layer``)
        router, experts, shared_experts   (MoESubmodules)
      linear_attention     ModuleSpec(GatedDeltaNet, GatedDeltaNetSubmodules) in the layers
                           ``ModelConfig.is_linear_attention_layer`` marks, built into the
                           ``self_attention`` attribute (--experimental-attention-variant)

A slot holds either a plain callable (a class or factory) or a ``ModuleSpec`` that adds fixed
keyword arguments (``params``) and, for composite modules, their own ``submodules``.
Nothing here imports torch: specs are data.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union


class AttnMaskType(enum.Enum):
    """The mask core attention applies (Megatron's names); the local core attention
    implements ``causal`` and ``no_mask``."""
    causal = "causal"
    no_mask = "no_mask"


@dataclass(frozen=True, eq=False)
class ModuleSpec:
    """``module`` built with ``params`` (fixed by the spec) and ``submodules`` (its own slots)."""
    module: Callable
    params: Mapping[str, Any] = field(default_factory=dict)
    submodules: Any = None


Spec = Union[ModuleSpec, Callable]


def build_module(spec: Spec, *args, **kwargs):
    """Instantiate a slot: call it, adding the spec's ``params`` and ``submodules``."""
    if not isinstance(spec, ModuleSpec):
        return spec(*args, **kwargs)
    if spec.submodules is not None:
        kwargs["submodules"] = spec.submodules
    return spec.module(*args, **dict(spec.params), **kwargs)


@dataclass(frozen=True, eq=False)
class SelfAttentionSubmodules:
    linear_qkv: Spec       # column-parallel; may apply the input norm itself (fused slot)
    core_attention: Spec   # owns the q/k/v layout: see ``DotProductAttention``
    linear_proj: Spec      # row-parallel
    # --qk-layernorm: norm builders (model_cfg, head_dim, tp_split, ...) applied to each
    # head's q and k before RoPE; used only when the model config asks for them
    q_layernorm: Optional[Spec] = None
    k_layernorm: Optional[Spec] = None


@dataclass(frozen=True, eq=False)
class MLASelfAttentionSubmodules:
    """Multi-Latent Attention's slots (``transformer/mla.py``; Megatron's names)."""
    linear_q_proj: Spec        # column-parallel, hidden -> heads x q head (no --q-lora-rank)
    linear_q_down_proj: Spec   # duplicated over TP, hidden -> q_lora_rank
    linear_q_up_proj: Spec     # column-parallel, q_lora_rank -> heads x q head
    linear_kv_down_proj: Spec  # duplicated over TP, hidden -> kv_lora_rank + rope dim
    linear_kv_up_proj: Spec    # column-parallel, kv_lora_rank -> heads x (k nope + v)
    core_attention: Spec       # as SelfAttention's, with k/v head dims and softmax scale
    linear_proj: Spec          # row-parallel, heads x v -> hidden
    q_layernorm: Spec          # norm builders for the latents (with --qk-layernorm)
    kv_layernorm: Spec


@dataclass(frozen=True, eq=False)
class MLPSubmodules:
    linear_fc1: Spec       # column-parallel; may apply the pre-MLP norm itself (fused slot)
    linear_fc2: Spec       # row-parallel


@dataclass(frozen=True, eq=False)
class MoESubmodules:
    router: Spec                            # (model_cfg, comm_groups, *, sequence_parallel, ...)
    experts: Spec                           # routed experts: (model_cfg, comm_groups, ...)
    shared_experts: Optional[Spec] = None   # a dense MLP spec (--moe-shared-expert-...)


@dataclass(frozen=True, eq=False)
class TransformerLayerSubmodules:
    """The slots of one layer.  ``mlp`` is the dense MLP; ``moe_mlp`` (``MoELayer``)
    fills the layers that ``ModelConfig.is_moe_layer`` marks as expert layers."""
    input_layernorm: Spec
    self_attention: Spec
    pre_mlp_layernorm: Spec
    mlp: Spec
    moe_mlp: Optional[Spec] = None
    # --experimental-attention-variant: the token mixer of the layers
    # ``ModelConfig.is_linear_attention_layer`` marks (built into ``self_attention``)
    linear_attention: Optional[Spec] = None

    def attention_for_layer(self, model_cfg, layer_number: int) -> Spec:
        """The token mixer of global layer ``layer_number``: attention or linear attention."""
        if not model_cfg.is_linear_attention_layer(layer_number):
            return self.self_attention
        if self.linear_attention is None:
            raise NotImplementedError(
                f"layer {layer_number} is a linear-attention layer (--experimental-attention-"
                f"variant {model_cfg.experimental_attention_variant}) but this layer spec has "
                "no linear_attention module")
        return self.linear_attention

    def mlp_for_layer(self, model_cfg, layer_number: int) -> Spec:
        """The MLP slot of global layer ``layer_number`` (0-based): dense or MoE."""
        if not model_cfg.is_moe_layer(layer_number):
            return self.mlp
        if self.moe_mlp is None:
            raise NotImplementedError(
                f"layer {layer_number} is an MoE layer (--num-experts {model_cfg.num_experts}, "
                f"--moe-layer-freq {model_cfg.moe_layer_freq}) but this layer spec has no MoE "
                "module (moe_mlp)")
        return self.moe_mlp


@dataclass(frozen=True, eq=False)
class LayerSpec:
    """What a backend provides: the layer's submodule tree plus the two modules around the
    layers (``megalite.backends.get_layer_spec`` picks one)."""
    layer: ModuleSpec                 # TransformerLayer with its TransformerLayerSubmodules
    norm: Callable                    # the block's final norm: (model_cfg, hidden, sp, ...)
    column_parallel_linear: Callable  # the output layer: (in, out, *, tp_group, bias, ...)


@dataclass(frozen=True, eq=False)
class GatedDeltaNetSubmodules:
    """Gated DeltaNet's slots (``transformer/gated_delta_net.py``; Qwen3-Next's names)."""
    linear_qkvz: Spec    # column-parallel, hidden -> per q/k head group [q, k, v, z]
    linear_ba: Spec      # column-parallel, hidden -> per group [beta, a] logits
    linear_out: Spec     # row-parallel, value heads -> hidden
