"""The Transformer Engine layer spec (``--transformer-impl transformer_engine``).

Megatron-Core's TE wiring, written for megalite's slots (``transformer/spec.py``):

  * ``linear_qkv`` / ``linear_fc1``: ``te.pytorch.LayerNormLinear(parallel_mode="column")``,
    the norm fused into the GEMM's input (the layer's own norm slots hold ``IdentityNorm``);
  * ``linear_proj`` / ``linear_fc2``: ``te.pytorch.Linear(parallel_mode="row")``;
  * ``core_attention``: ``te.pytorch.DotProductAttention`` on ``sbhd`` q/k/v (fused/flash
    kernels), with TE's own context parallelism (``set_context_parallel_group``) when CP > 1;
  * the MLP activation, RoPE, the final norm, the ``--qk-layernorm`` norms, the embedding
    and the output layer stay megalite's (as in Megatron's TE spec, the output layer is a
    plain column-parallel linear; the norms are one elementwise kernel either way, and
    TE's attention has no q/k norm of its own); ``--add-qkv-bias`` is LayerNormLinear's bias.
  * MoE models: the pre-MLP norm stays in its slot (an expert layer has no linear to fuse it
    into) and fc1 is a plain ``te.pytorch.Linear``; the experts are megalite's.

Every TE module is built on megalite's TP group (``Group.handle``), ``sequence_parallel``
flag and RNG tracker (``get_rng_state_tracker``: a proxy that reads the tracker the
parallelize phase attaches later).  Each records megalite ``ParamSpec``s for its parameters,
so init, SP grad sums, the grad norm and checkpoints treat them like local ones; the
fused norm weights are renamed to their local names (``te_names.canonical_renames``).

``--fp8-format`` wraps each layer's forward in TE's autocast with a ``DelayedScaling``
recipe (amax reduced over the TP x DP x CP group).  TE is imported only inside the
functions here, never at megalite import time.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import inspect
from typing import Optional

import torch
from torch import nn

from megalite.config.attention_variants import te_attention_kwargs
from megalite.moe.shared_experts import shared_expert_spec
from megalite.param_spec import ParamSpec
from megalite.transformer.attention import SelfAttention
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.mlp import MLP
from megalite.transformer.norms import (SEQUENCE_PARALLEL_GROUP, IdentityNorm, build_norm,
                                       build_qk_norm)
from megalite.transformer.attention_masks import document_offsets
from megalite.transformer.softmax_denominator import learned_logits_spec
from megalite.transformer.spec import (AttnMaskType, LayerSpec, MLPSubmodules, ModuleSpec,
                                       SelfAttentionSubmodules, TransformerLayerSubmodules)
from megalite.tensor_parallel.random import AttachedTracker, DrawsFromTracker
from megalite.tensor_parallel.layers import ColumnParallelLinear
from megalite.backends.local import local_spec


def te_pytorch():
    """``transformer_engine.pytorch`` (imported on first use)."""
    return importlib.import_module("transformer_engine.pytorch")


def te_recipe_module():
    return importlib.import_module("transformer_engine.common.recipe")


def _skip_init(_tensor) -> None:
    """TE's init_method: megalite's name-seeded init fills every parameter afterwards."""


def _te_device(device):
    return "cuda" if device is None else device


def _tp_kwargs(tp_group, sequence_parallel: bool) -> dict:
    alone = tp_group.size == 1
    return dict(tp_group=None if alone else tp_group.handle, tp_size=tp_group.size,
                sequence_parallel=bool(sequence_parallel) and not alone)


def _record(module: nn.Module, specs: dict) -> nn.Module:
    """Attach megalite ``ParamSpec``s (``param_spec.module_specs`` reads ``param_specs``)."""
    module.param_specs = {k: v for k, v in specs.items() if isinstance(getattr(module, k, None),
                                                                     nn.Parameter)}
    return module


def _norm_specs(model_cfg, hidden: int, sequence_parallel: bool) -> dict:
    sp = SEQUENCE_PARALLEL_GROUP if sequence_parallel else None
    out = {"layer_norm_weight": ParamSpec((hidden,), init=("ones",), sequence_parallel=sp)}
    if model_cfg.normalization == "LayerNorm":
        out["layer_norm_bias"] = ParamSpec((hidden,), init=("zeros",), sequence_parallel=sp)
    return out


def _column_specs(tp_group, input_size, output_size, init_std, partition_blocks) -> dict:
    g = tp_group.name
    return {"weight": ParamSpec.split((output_size, input_size), 0, g, partition_blocks,
                                      init=("normal", init_std)),
            "bias": ParamSpec.split((output_size,), 0, g, partition_blocks, init=("zeros",))}


def te_column_linear(input_size: int, output_size: int, *, tp_group, bias: bool = True,
                     gather_output: bool = False, sequence_parallel: bool = False,
                     init_std: float = 0.02, partition_blocks: int = 1, model_cfg=None,
                     fuse_norm: bool = False, device=None, dtype=None, **unused):
    """Column-parallel ``te.pytorch.Linear``, or ``LayerNormLinear`` with ``fuse_norm``
    (the norm chosen by ``model_cfg``), holding the same [out/tp, in] shard as megalite's
    ``ColumnParallelLinear`` (``partition_blocks``: SwiGLU's [gate_r; up_r])."""
    if gather_output:
        raise ValueError("the TE column-parallel linear does not gather its output")
    if unused.get("skip_weight_param") or unused.get("pad_multiple"):
        raise ValueError("the TE column-parallel linear is not an output layer")
    te = te_pytorch()
    kw = dict(bias=bias, init_method=_skip_init, parallel_mode="column",
              params_dtype=dtype or torch.float32, device=_te_device(device),
              **_tp_kwargs(tp_group, sequence_parallel))
    specs = _column_specs(tp_group, input_size, output_size, init_std, partition_blocks)
    if fuse_norm:
        module = te.LayerNormLinear(input_size, output_size, eps=model_cfg.norm_epsilon,
                                    normalization=model_cfg.normalization, **kw)
        specs.update(_norm_specs(model_cfg, input_size, kw["sequence_parallel"]))
    else:
        module = te.Linear(input_size, output_size, **kw)
    return _record(module, specs)


def te_row_linear(input_size: int, output_size: int, *, tp_group, bias: bool = True,
                  input_is_parallel: bool = True, sequence_parallel: bool = False,
                  init_std: float = 0.02, device=None, dtype=None):
    """Row-parallel ``te.pytorch.Linear``: [out, in/tp] shard, output all-reduced (or
    reduce-scattered along the sequence with ``sequence_parallel``), bias added after."""
    if not input_is_parallel:
        raise ValueError("the TE row-parallel linear takes an input already split over TP")
    te = te_pytorch()
    tp = _tp_kwargs(tp_group, sequence_parallel)
    module = te.Linear(input_size, output_size, bias=bias, init_method=_skip_init,
                       parallel_mode="row", params_dtype=dtype or torch.float32,
                       device=_te_device(device), **tp)
    sp = tp_group.name if tp["sequence_parallel"] else None
    return _record(module, {
        "weight": ParamSpec.split((output_size, input_size), 1, tp_group.name,
                                  init=("normal", init_std)),
        "bias": ParamSpec((output_size,), init=("zeros",), sequence_parallel=sp)})


# --attention-backend for TE's DotProductAttention, as Megatron sets it: TE reads these
# switches when it picks a kernel ("auto" leaves TE's own choice).
TE_ATTENTION_ENV = {
    "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
}
TE_ATTENTION_ENV["local"] = TE_ATTENTION_ENV["unfused"]


class TECoreAttention(DrawsFromTracker, nn.Module):
    """``te.pytorch.DotProductAttention`` in megalite's core-attention slot (``sbhd``).

    Takes q [s, b, np, d], k/v [s, b, ng, d] (this rank's heads; TE is given the global head
    and group counts and the TP size).  With CP > 1, TE runs its own ring (``p2p``) or
    all-to-all (``a2a``) attention over megalite's CP group, on the load-balanced sequence
    chunks ``get_batch`` already made (rank r holds chunks r and 2CP-1-r, TE's layout)."""
    qkv_format = "sbhd"
    handles_context_parallel = True     # backends.context_parallel_spec leaves it in place

    def __init__(self, model_cfg, comm_groups, *, layer_number: int = 0,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        super().__init__()
        te = te_pytorch()
        # Multi-Latent Attention: k/v head dims differ and the softmax scale is its own
        extra = {} if softmax_scale is None else {"softmax_scale": softmax_scale}
        # the attention variants TE runs itself (its window, its softmax_offset)
        extra.update(te_attention_kwargs(model_cfg, layer_number))
        kv_channels = model_cfg.resolved_kv_channels() if k_channels is None else \
            (k_channels, v_channels or k_channels)
        os.environ.update(TE_ATTENTION_ENV.get(getattr(model_cfg, "attention_backend", "auto"),
                                               {}))
        tp, cp = comm_groups.tp, comm_groups.cp
        self.attention = te.DotProductAttention(
            num_attention_heads=model_cfg.num_attention_heads,
            kv_channels=kv_channels,
            num_gqa_groups=model_cfg.resolved_query_groups(),
            attention_dropout=model_cfg.attention_dropout, qkv_format="sbhd",
            attn_mask_type=attn_mask_type.value, sequence_parallel=False,
            tp_size=tp.size, tp_group=tp.handle if tp.size > 1 else None,
            get_rng_state_tracker=self.attached_tracker, layer_number=layer_number + 1,
            **extra)
        spec = learned_logits_spec(model_cfg, tp)   # TE holds them; megalite's init
        if spec is not None:                              # fills them
            _record(self.attention, {"softmax_offset": spec})
        if cp.size > 1:
            self.attention.set_context_parallel_group(cp.handle, list(cp.ranks),
                                                      cp_stream(), cp_comm_type)

    def attached_tracker(self) -> AttachedTracker:
        """TE's ``get_rng_state_tracker``: TE keeps what it returns from construction on,
        before the parallelize step attaches the rank's tracker -- so a forwarder."""
        return AttachedTracker(self)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if document_ids is not None:
            return self._packed(q, k, v, document_ids)
        # q/k/v are views into the grouped qkv output; TE's kernels want plain sbhd tensors
        return self.attention(q.contiguous(), k.contiguous(), v.contiguous())

    def _packed(self, q, k, v, document_ids: torch.Tensor) -> torch.Tensor:
        """``--reset-attention-mask`` in TE's own packed format: the micro-batch's documents
        back to back (THD), ``cu_seqlens`` their boundaries, mask ``padding_causal``.  Only
        without CP (TE's THD ring wants its own per-document split: refused in
        ``cli/features.py``)."""
        s, b = q.shape[:2]
        thd = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]).contiguous() for t in (q, k, v)]
        cu, longest = document_offsets(document_ids)
        out = self.attention(*thd, qkv_format="thd", attn_mask_type="padding_causal",
                             cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)                # [b*s, heads*d]
        return out.view(b, s, -1).transpose(0, 1)                 # [s, b, heads*d]


_CP_STREAMS = {}


def cp_stream():
    """One side stream per device for TE's CP ring, shared by every layer (as Megatron);
    None without CUDA (the CPU stand-in TE of the tests)."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    if device not in _CP_STREAMS:
        _CP_STREAMS[device] = torch.cuda.Stream()
    return _CP_STREAMS[device]


class TETransformerLayer(TransformerLayer):
    """megalite's layer; with FP8 its forward runs inside TE's autocast (``fp8``: the
    ``Fp8Settings``), so every TE GEMM of the layer runs in FP8 with delayed scaling."""

    def __init__(self, *args, fp8: Optional["Fp8Settings"] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8 = fp8

    def forward(self, hidden: torch.Tensor, rotary=None, document_ids=None) -> torch.Tensor:
        if self.fp8 is None:
            return super().forward(hidden, rotary, document_ids)
        with fp8_autocast(self.fp8):
            return super().forward(hidden, rotary, document_ids)


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
    fp8_format: str                  # "e4m3" | "hybrid"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    amax_group: object = None        # torch ProcessGroup over TP x DP x CP (None: one rank)

    @classmethod
    def from_model_config(cls, model_cfg, amax_group=None) -> Optional["Fp8Settings"]:
        if model_cfg.fp8_format is None:
            return None
        return cls(model_cfg.fp8_format, model_cfg.fp8_amax_history_len,
                   model_cfg.fp8_amax_compute_algo, amax_group)


@functools.lru_cache(maxsize=None)
def delayed_scaling_recipe(fp8_format: str, amax_history_len: int, amax_compute_algo: str,
                           reduce_amax: bool = True):
    """TE's ``DelayedScaling`` recipe for ``--fp8-format`` (one object per setting, so every
    layer shares the recipe and TE keeps one amax buffer per recipe)."""
    recipe = te_recipe_module()
    fmt = {"e4m3": recipe.Format.E4M3, "hybrid": recipe.Format.HYBRID}[fp8_format]
    return recipe.DelayedScaling(fp8_format=fmt, amax_history_len=amax_history_len,
                                 amax_compute_algo=amax_compute_algo, reduce_amax=reduce_amax)


def fp8_autocast(settings: Fp8Settings):
    """TE's FP8 autocast context for ``settings`` (``autocast`` in TE >= 2.x, else the
    older ``fp8_autocast``)."""
    te = te_pytorch()
    # no TP x DP x CP group (one rank in it): no amax reduction -- TE would otherwise reduce
    # over the whole world, pipeline stages included
    recipe = delayed_scaling_recipe(settings.fp8_format, settings.amax_history_len,
                                    settings.amax_compute_algo, settings.amax_group is not None)
    group_kw = autocast_group_keyword()
    if group_kw is None:
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=settings.amax_group)
    return te.autocast(enabled=True, recipe=recipe, **{group_kw: settings.amax_group})


@functools.lru_cache(maxsize=None)
def autocast_group_keyword() -> Optional[str]:
    """The group keyword of TE's ``autocast`` (``amax_reduction_group`` in the source, ``group``
    in some docs); None when this TE only has ``fp8_autocast``."""
    autocast = getattr(te_pytorch(), "autocast", None)
    if autocast is None:
        return None
    try:
        params = inspect.signature(autocast).parameters
    except (TypeError, ValueError):
        return "amax_reduction_group"
    return "group" if "group" in params and "amax_reduction_group" not in params \
        else "amax_reduction_group"


def te_spec(model_cfg, *, cp_comm_type: str = "p2p", amax_group=None) -> LayerSpec:
    """The TE ``LayerSpec`` for ``model_cfg`` (norm kind/eps, MoE or dense, FP8 settings)."""
    local = local_spec().layer.submodules
    moe = bool(model_cfg.num_experts)
    fused = functools.partial(te_column_linear, model_cfg=model_cfg, fuse_norm=True)
    attention = ModuleSpec(SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=fused,
                               core_attention=ModuleSpec(TECoreAttention,
                                                         params={"cp_comm_type": cp_comm_type}),
                               linear_proj=te_row_linear,
                               q_layernorm=build_qk_norm, k_layernorm=build_qk_norm))
    fc1 = te_column_linear if moe else fused
    mlp = ModuleSpec(MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=te_row_linear))
    moe_mlp = None
    if moe:
        moe_mlp = dataclasses.replace(local.moe_mlp, submodules=dataclasses.replace(
            local.moe_mlp.submodules, shared_experts=shared_expert_spec(mlp)))
    fp8 = Fp8Settings.from_model_config(model_cfg, amax_group)
    layer = ModuleSpec(TETransformerLayer, params={"fp8": fp8},
                       submodules=TransformerLayerSubmodules(
                           input_layernorm=IdentityNorm, self_attention=attention,
                           pre_mlp_layernorm=build_norm if moe else IdentityNorm, mlp=mlp,
                           moe_mlp=moe_mlp))
    return LayerSpec(layer=layer, norm=build_norm, column_parallel_linear=ColumnParallelLinear)
