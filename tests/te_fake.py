"""A stand-in ``transformer_engine`` package for CPU tests of the TE backend's wiring.

Its classes take TE's constructor arguments (``transformer_engine.pytorch.Linear``,
``LayerNormLinear``, ``DotProductAttention``, ``autocast``, ``common.recipe``), create
parameters under TE's names and shapes (``weight``, ``bias``, ``layer_norm_weight``,
``layer_norm_bias``; an empty tensor for a missing bias), call ``init_method`` and
``get_rng_state_tracker`` as TE does, and compute with plain torch ops (TP = 1 only).  They
record what they were given, so tests check the wiring; numerics are torch's, which is what
makes "TE spec forward == local forward" a test of the wiring rather than of TE's kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

BUILT = []          # every fake module constructed: (class name, kwargs)
AUTOCASTS = []      # every autocast entered: (recipe, group)


class _Base(nn.Module):
    def __init__(self, kwargs):
        super().__init__()
        BUILT.append((type(self).__name__, dict(kwargs)))
        self.kwargs = kwargs


def megalite_group(handle, size: int):
    """The megalite ``Group`` for TE's ``tp_group`` argument (None: this rank alone)."""
    import torch.distributed as dist

    from megalite.parallel_state import Group

    if handle is None or size == 1:
        return Group("tp", [0], None, 0)
    return Group("tp", dist.get_process_group_ranks(handle), handle, dist.get_rank())


class Linear(_Base):
    def __init__(self, in_features, out_features, sequence_parallel=False, tp_group=None,
                 tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 params_dtype=None, parallel_mode=None, device="cuda", **extra):
        super().__init__(dict(in_features=in_features, out_features=out_features,
                              sequence_parallel=sequence_parallel, tp_group=tp_group,
                              tp_size=tp_size, bias=bias, params_dtype=params_dtype,
                              parallel_mode=parallel_mode, device=device, **extra))
        self.group = megalite_group(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":
            out_features //= tp_size
        elif parallel_mode == "row":
            in_features //= tp_size
        kw = dict(device=device, dtype=params_dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.use_bias = bias
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **kw))
        else:
            self.bias = torch.Tensor().to(**kw)
        if init_method is not None:
            init_method(self.weight)
        self.sequence_parallel = sequence_parallel and tp_size > 1

    def _linear(self, x):
        """TE's column/row-parallel GEMM and its TP communication, with megalite's own
        collectives (the communication pattern TE documents for each mode)."""
        from megalite.tensor_parallel.layers import linear_with_sp_gather
        from megalite.tensor_parallel.mappings import (copy_to_tp_region, reduce_from_tp_region,
                                                       reduce_scatter_to_sp_region)

        bias = self.bias if self.use_bias else None
        g = self.group
        if g.size == 1:
            return F.linear(x, self.weight, bias)
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                return linear_with_sp_gather(x, self.weight, bias, g)
            return F.linear(copy_to_tp_region(x, g), self.weight, bias)
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp_region(y, g) if self.sequence_parallel else \
            reduce_from_tp_region(y, g)
        return y if bias is None else y + bias

    def forward(self, inp, is_first_microbatch=None):
        return self._linear(inp)


class LayerNormLinear(Linear):
    def __init__(self, in_features, out_features, eps=1e-5, normalization="LayerNorm", **kw):
        super().__init__(in_features, out_features, normalization=normalization, eps=eps, **kw)
        dev = dict(device=kw.get("device", "cuda"), dtype=kw.get("params_dtype"))
        self.normalization, self.eps = normalization, eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, **dev))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, **dev))
                                if normalization == "LayerNorm" else None)

    def forward(self, inp, is_first_microbatch=None):
        shape = (inp.shape[-1],)
        if self.normalization == "RMSNorm":
            if inp.dtype == torch.float32:
                y = F.rms_norm(inp, shape, self.layer_norm_weight, self.eps)
            else:
                y = self.layer_norm_weight * F.rms_norm(inp.float(), shape, None,
                                                        self.eps).to(inp.dtype)
        else:
            y = F.layer_norm(inp, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return self._linear(y)


class DotProductAttention(_Base):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                 sequence_parallel=False, tp_size=1, get_rng_state_tracker=None,
                 tp_group=None, layer_number=None, **extra):
        super().__init__(dict(num_attention_heads=num_attention_heads, kv_channels=kv_channels,
                              num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
                              qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                              sequence_parallel=sequence_parallel, tp_size=tp_size,
                              tp_group=tp_group, layer_number=layer_number, **extra))
        assert qkv_format == "sbhd"
        self.dropout, self.causal = attention_dropout, attn_mask_type == "causal"
        self.cp = None
        # TE calls the tracker getter once, at construction, and keeps the object
        self.rng_states_tracker = None
        if get_rng_state_tracker is not None and not sequence_parallel:
            self.rng_states_tracker = get_rng_state_tracker()
            self.rng_states_tracker.get_states()
        self.forks = 0
        # TE's sinks (softmax_type off-by-one / learnable): its softmax_offset [heads / TP]
        self.softmax_type = extra.get("softmax_type", "vanilla")
        if self.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.zeros(num_attention_heads // tp_size))

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type="p2p"):
        self.cp = (cp_group, list(cp_global_ranks), cp_stream, cp_comm_type)

    def _context_parallel(self):
        """TE's CP attention over the group it was given, on the load-balanced chunks TE
        expects -- computed by megalite's own ring / all-to-all attention (local math)."""
        import types

        from megalite.context_parallel import core_attention_class
        from megalite.parallel_state import Group
        from megalite.transformer.spec import AttnMaskType

        handle, ranks, _, comm_type = self.cp
        import torch.distributed as dist

        group = Group("cp", ranks, handle, dist.get_rank())
        k = self.kwargs
        heads, groups, d = k["num_attention_heads"], k["num_gqa_groups"], k["kv_channels"]
        model_cfg = types.SimpleNamespace(
            num_attention_heads=heads, attention_dropout=self.dropout,
            resolved_query_groups=lambda: groups or heads, resolved_kv_channels=lambda: d,
            layer_window=lambda layer: None,   # TE's own window and chunks are refused with CP
            layer_chunk=lambda layer: None)
        comm_groups = types.SimpleNamespace(cp=group, tp=types.SimpleNamespace(size=k["tp_size"]))
        mask = AttnMaskType.causal if self.causal else AttnMaskType.no_mask
        return core_attention_class(comm_type)(model_cfg, comm_groups, attn_mask_type=mask)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, **packed):
        for t in (query_layer, key_layer, value_layer):
            assert t.is_contiguous()
        if packed.get("qkv_format") == "thd":
            return self._thd(query_layer, key_layer, value_layer, **packed)
        s, b, h, d = query_layer.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        if self.cp is not None and len(self.cp[1]) > 1:
            if not hasattr(self, "cp_attention"):
                self.cp_attention = self._context_parallel()
            return self.cp_attention(q, k, v).permute(2, 0, 1, 3).reshape(s, b, h * d)
        p = self.dropout if self.training else 0.0
        ctx = contextlib.nullcontext()
        if p > 0 and self.rng_states_tracker is not None:
            ctx = self.rng_states_tracker.fork()
            self.forks += 1
        if self.softmax_type != "vanilla":   # TE's unfused path with the sink term
            from megalite.transformer.attention_kernels import unfused_attention
            sinks = self.softmax_offset if self.softmax_type == "learnable" else \
                torch.zeros(h, dtype=q.dtype)
            with ctx:
                out = unfused_attention(q, k, v, causal=self.causal, dropout_p=p,
                                        scale=self.kwargs.get("softmax_scale"),
                                        denominator_logits=sinks)
            return out.permute(2, 0, 1, 3).reshape(s, b, h * v.shape[-1])
        with ctx:     # TE's softmax_scale (MLA's) and a v narrower than q/k (kv_channels (k, v))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal,
                                                 enable_gqa=k.shape[1] != h,
                                                 scale=self.kwargs.get("softmax_scale"))
        return out.permute(2, 0, 1, 3).reshape(s, b, h * v.shape[-1])


    def _thd(self, q, k, v, *, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
             max_seqlen_q, max_seqlen_kv):
        """TE's packed format: tokens [t, heads, d] back to back, each segment of
        ``cu_seqlens`` attended causally on its own (``padding_causal``)."""
        assert attn_mask_type == "padding_causal" and torch.equal(cu_seqlens_q, cu_seqlens_kv)
        bounds = cu_seqlens_q.tolist()
        assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_seqlen_q == max_seqlen_kv
        out = []
        for a, b in zip(bounds, bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))   # [1, h, n, d]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                               enable_gqa=ks.shape[1] != qs.shape[1],
                                               scale=self.kwargs.get("softmax_scale"))
            out.append(o[0].transpose(0, 1).reshape(b - a, -1))
        return torch.cat(out)


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None,
             _graph=False):
    AUTOCASTS.append((recipe, amax_reduction_group))
    yield


def is_fp8_available(return_reason=False):
    return (True, "") if return_reason else True


class Format(enum.Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclasses.dataclass
class DelayedScaling:
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True


def install(monkeypatch) -> types.ModuleType:
    """Put the fake package into ``sys.modules`` (undone by ``monkeypatch``)."""
    root = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in ("Linear", "LayerNormLinear", "DotProductAttention", "autocast",
                 "is_fp8_available"):
        setattr(pt, name, globals()[name])
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    root.pytorch, root.common, common.recipe = pt, common, recipe
    for name, mod in (("transformer_engine", root), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    BUILT.clear()
    AUTOCASTS.clear()
    return pt


FAKE_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
                "transformer_engine.common.recipe")


class installed:
    """``with installed():`` the fake package in ``sys.modules`` (worker processes)."""

    def __enter__(self):
        class Patch:
            def setitem(self, d, k, v):
                d[k] = v
        install(Patch())

    def __exit__(self, *exc):
        for name in FAKE_MODULES:
            sys.modules.pop(name, None)


def uninstall_for_import_error(monkeypatch) -> None:
    """Make ``import transformer_engine.pytorch`` fail (None in sys.modules: ImportError)."""
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
