"""Run training code on meta tensors where values do not matter, for real where they do.

The pre-launch trace runs one rank's real training step on meta tensors (shapes, no data,
no memory).  Three things in that code need values, and this mode supplies them:

* a scalar or list read back on the host (``.item()``, ``.tolist()``, ``float(t)``): the loss,
  the gradient norm, the fp16 overflow flag, gathered counts -- read as zeros (finite loss,
  no overflow: the common path);
* index-producing ops on meta inputs (``topk``, ``sort``, ``argmax`` ...): their indices are
  made real on the CPU, ``topk`` as a balanced round robin (token t's j-th choice is expert
  (t*k + j) mod E), so MoE routing yields real, even counts and every size derived from them
  (all-to-all splits, grouped GEMM sizes) is consistent on every rank;
* data-dependent ops (``bincount``, ``nonzero``, ``repeat_interleave`` by counts,
  ``masked_select`` ...) on meta inputs: the inputs are materialised on the CPU (booleans as
  True: no token dropped; numbers as 0) and the op runs for real.

Everything else with a meta input runs on meta (CPU operands are moved there); an in-place
op on a CPU tensor with meta operands runs on the CPU with those operands as zeros.

Speed: many meta kernels are Python (torch._refs), ~100 us an op, and a training step
repeats the same ops on the same shapes for every micro-batch and layer.  A meta kernel is
a function of its inputs' metadata alone, so each op is run once per (op, input shapes,
strides, dtypes, other arguments): later calls of an op that returns fresh tensors (no
view, no in-place) get new meta tensors of the remembered shapes; later calls of an op
that only writes meta arguments it returns (``out=``, ``add_``) -- cached only when the
first call left their shapes and strides as they were -- return those arguments.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

DATA_DEPENDENT = {aten.bincount.default, aten.nonzero.default, aten.masked_select.default,
                  aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor,
                  aten._unique2.default, aten.unique_consecutive.default,
                  aten.unique_dim.default, aten.nonzero_static.default,
                  aten.histc.default}
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
INDEX_OUTPUTS = {aten.topk.default: 1, aten.sort.default: 1, aten.sort.stable: 1,
                 aten.max.dim: 1, aten.min.dim: 1, aten.argmax.default: 0,
                 aten.argmin.default: 0, aten.argsort.default: 0, aten.argsort.stable: 0}


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def materialize(x):
    """A meta tensor as a real CPU one: True for booleans, 0 otherwise."""
    if not _is_meta(x):
        return x
    if x.dtype == torch.bool:
        return torch.ones(x.shape, dtype=torch.bool)
    return torch.zeros(x.shape, dtype=x.dtype)


def _map(fn, x):
    """``fn`` on every tensor of an op's arguments (lists, tuples, dicts: what aten passes;
    torch's pytree map does the same at ten times the cost)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    t = type(x)
    if t is list or t is tuple:
        return t(_map(fn, v) for v in x)
    if t is dict:
        return {k: _map(fn, v) for k, v in x.items()}
    return x


def _to_meta(x):
    if isinstance(x, torch.Tensor) and not x.is_meta and x.dim() > 0:
        return x.to("meta")
    return x


def _index_values(func, args, kwargs, out: torch.Tensor) -> torch.Tensor:
    """Real indices of the shape ``out`` has: topk round robin, else positions along dim."""
    at = 2 if func is aten.topk.default else 1          # topk(self, k, dim), sort(self, dim)
    dim = args[at] if len(args) > at and isinstance(args[at], int) else kwargs.get("dim", -1)
    if out.dim() == 0 or dim is None:
        return torch.zeros(out.shape, dtype=out.dtype)
    size = args[0].shape[dim] if args[0].dim() else 1
    dim = dim % out.dim()
    if func is aten.topk.default:
        k = out.shape[dim]
        moved = out.movedim(dim, -1)
        rows = torch.arange(moved.numel() // k).unsqueeze(-1)
        vals = (rows * k + torch.arange(k)) % size
        return vals.reshape(moved.shape).movedim(-1, dim).contiguous().to(out.dtype)
    if func in (aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default):
        return torch.zeros(out.shape, dtype=out.dtype)
    shape = [1] * out.dim()
    shape[dim] = out.shape[dim]
    return torch.arange(out.shape[dim]).view(shape).expand(out.shape).contiguous().to(
        out.dtype)


def _scan(args, kwargs):
    """(any meta tensor, any real tensor of dim > 0) among the arguments, one level deep."""
    meta = real = False
    for a in (*args, *kwargs.values()) if kwargs else args:
        for x in (a if type(a) in _SEQUENCES else (a,)):
            if isinstance(x, torch.Tensor):
                if x.is_meta:
                    meta = True
                elif x.dim() > 0:
                    real = True
    return meta, real


_SEQUENCES = (list, tuple)


_WRITES_SELF = {}


def _writes_self(func) -> bool:
    """An in-place op (its first argument is written)."""
    out = _WRITES_SELF.get(func)
    if out is None:
        args = func._schema.arguments
        out = _WRITES_SELF[func] = bool(args) and args[0].alias_info is not None and \
            args[0].alias_info.is_write
    return out


_FRESH = {}


def _returns_fresh(func) -> bool:
    """The op's outputs are new tensors: no return aliases an input, nothing is written."""
    out = _FRESH.get(func)
    if out is None:
        schema = func._schema
        out = _FRESH[func] = bool(schema.returns) and \
            all(r.alias_info is None for r in schema.returns) and \
            all(a.alias_info is None or not a.alias_info.is_write for a in schema.arguments) \
            and not schema.is_mutable and func not in INDEX_OUTPUTS and \
            func not in DATA_DEPENDENT and "rand" not in func._schema.name and \
            all(str(r.type) == "Tensor" for r in schema.returns)
    return out


_PLAIN = {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format}


def _key(x):
    t = type(x)
    if t in _PLAIN:
        return (t, x)
    if isinstance(x, torch.Tensor):
        return ("T", x.shape, x.stride(), x.dtype, x.device.type)
    if t is list or t is tuple:
        return tuple(_key(v) for v in x)
    if t is dict:
        return tuple((k, _key(v)) for k, v in sorted(x.items()))
    raise TypeError


_RANDOM = ("rand", "bernoulli", "normal", "uniform", "exponential", "geometric", "cauchy")
_ONLY_WRITES = {}


def _only_writes(func) -> bool:
    """Every output is a written argument (``out=`` variants, ``add_``): the op makes no
    tensor of its own."""
    out = _ONLY_WRITES.get(func)
    if out is None:
        schema = func._schema
        out = _ONLY_WRITES[func] = bool(schema.returns) and \
            all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns) \
            and all(str(r.type) == "Tensor" for r in schema.returns) and \
            func not in INDEX_OUTPUTS and func not in DATA_DEPENDENT and \
            not any(w in schema.name for w in _RANDOM)
    return out


def _tensors(args, kwargs) -> list:
    """The tensor arguments, one level deep, in order (what a cached write returns from)."""
    out = []
    for a in (*args, *kwargs.values()):
        for x in (a if type(a) in _SEQUENCES else (a,)):
            if isinstance(x, torch.Tensor):
                out.append(x)
    return out


def _layout(x):
    return (x.shape, x.stride(), x.storage_offset())


_OUTPUTS_OF = {}     # (op, argument key) -> [(shape, stride, dtype)]: shared by all traces


class MetaValues(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.cache = _OUTPUTS_OF

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling frame per call
        # (a tenth of the trace's time); nothing here is compiled (the check turns
        # --compile off)
        return False

    def _cached(self, func, args, kwargs):
        try:
            key = (func, _key(args), _key(kwargs))
        except TypeError:
            return func(*args, **kwargs)
        hit = self.cache.get(key)
        if hit is not None:
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                    for shape, stride, dtype in hit]
            return outs[0] if len(outs) == 1 else tuple(outs)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        if all(isinstance(o, torch.Tensor) and o.is_meta for o in outs):
            self.cache[key] = [(tuple(o.shape), o.stride(), o.dtype) for o in outs]
        return out

    def _cached_write(self, func, args, kwargs):
        """An op whose outputs are meta arguments it writes: run once per argument key;
        later calls return the same argument positions (its meta kernel only checks)."""
        try:
            key = (func, _key(args), _key(kwargs))
        except TypeError:
            return func(*args, **kwargs)
        hit = self.cache.get(key)
        tensors = _tensors(args, kwargs)
        if hit is not None:
            outs = [tensors[i] for i in hit]
            return outs[0] if len(outs) == 1 else tuple(outs)
        before = [_layout(t) for t in tensors]
        out = func(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        at = [next((i for i, t in enumerate(tensors) if t is o), None) for o in outs]
        if None not in at and all(t.is_meta for t in tensors) and \
                [_layout(t) for t in tensors] == before:
            self.cache[key] = at
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta, real = _scan(args, kwargs)
        if not meta:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta" and \
                    func in ARANGES:             # its meta kernel is slow: shape from the CPU
                cpu = func(*args, **{**kwargs, "device": "cpu"})
                return torch.empty(cpu.shape, dtype=cpu.dtype, device="meta")
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        if func in DATA_DEPENDENT or (func is aten._to_copy.default and
                                      kwargs.get("device") is not None and
                                      torch.device(kwargs["device"]).type != "meta") or \
                (_writes_self(func) and isinstance(args[0], torch.Tensor) and
                 not args[0].is_meta):
            return func(*_map(materialize, args), **_map(materialize, kwargs))
        if real:
            args, kwargs = _map(_to_meta, args), _map(_to_meta, kwargs)
        if _returns_fresh(func):
            return self._cached(func, args, kwargs)
        if _only_writes(func):
            return self._cached_write(func, args, kwargs)
        out = func(*args, **kwargs)
        which = INDEX_OUTPUTS.get(func)
        if which is None:
            return out
        if isinstance(out, tuple):
            real_out = _index_values(func, args, kwargs, out[which])
            return tuple(real_out if i == which else o for i, o in enumerate(out))
        return _index_values(func, args, kwargs, out)
