"""How each parameter's full (logical) tensor is split over process groups -- kept OFF the
``nn.Parameter``.

Why off the parameter: FSDP2's ``fully_shard`` (and Transformer Engine) replace parameters
with fresh objects that carry none of our attributes, but keep the module's parameter names
(FQNs).  So the split rules live in a table keyed by name, built at model construction and
kept on the module as a plain attribute; init, gradient sync, the grad norm, checkpoints and
the converters all read it.

* ``Split(dim, group, blocks, pad_multiple)``: ``dim`` is split over the ranks of process
  group ``group`` ("tp", "expert-tp", "ep", ... as named in ``parallel_state``).  The full
  tensor is ``blocks`` equal blocks along ``dim`` and rank r takes the r-th piece of every
  block (fused SwiGLU ``[gate; up]``: 2 blocks, so each rank holds ``[gate_r; up_r]``).
  With ``pad_multiple`` (vocabulary-sized tensors) the dim is padded with zero rows to a
  multiple of ``pad_multiple * group size`` (Megatron's rule); the padding is never part of
  the logical tensor, so one checkpoint loads at any group size.
* ``ParamSpec``: full shape, its splits, the init rule and flags: ``sequence_parallel``
  (the group whose ranks saw other sequence shards -- or other heads, the --qk-layernorm
  weights: the replicated grad is summed over it),
  ``tied`` ("owner" / "copy" of the tied word embedding) and ``expert``.
* ``ParamSpec.chunks(coords)``: this rank's piece(s) as global offsets, given
  ``coords = {group: (rank, size)}``; fused blocks give several chunks, padding is clipped.
* ``ParamTable``: canonical name -> spec for one model chunk, plus local FQN -> canonical
  name (the last stage's tied copy ``output_layer.weight`` is ``embedding.word_embeddings
  .weight``).  Modules record the specs of the parameters they create in a plain dict
  ``module.param_specs`` (``make_param``); ``ParamTable.from_module`` collects them.

Imports torch and the standard library only: every layer may use it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

Coords = Mapping[str, Tuple[int, int]]      # group name -> (this rank's index, group size)

# Per grid, the group of each dimension a parameter can be split or replicated over
# (``parallel_state``: the dense grid has EP = 1, the expert grid CP = 1).
DENSE_GROUPS = ("tp", "cp", "dp")
EXPERT_GROUPS = ("expert-tp", "ep", "expert-dp")
# Groups that span several of those dimensions.
GROUP_SPANS = {"dp-cp": ("dp", "cp"), "tp-cp": ("tp", "cp"), "tp-dp-cp": ("tp", "dp", "cp"),
               "tp-ep": ("expert-tp", "ep")}
TIED_OWNER, TIED_COPY = "owner", "copy"


@dataclass(frozen=True)
class Split:
    dim: int
    group: str = "tp"
    blocks: int = 1
    pad_multiple: Optional[int] = None

    def padded_size(self, size: int, group_size: int) -> int:
        """Length along ``dim`` of the padded full tensor for a group size."""
        if self.pad_multiple:
            multiple = self.pad_multiple * group_size
            size = int(math.ceil(size / multiple) * multiple)
        return size

    def pieces(self, size: int, rank: int, group_size: int) -> List[Tuple[int, int, int]]:
        """``(global_start, length, local_start)`` of each piece rank ``rank`` holds along
        ``dim`` (one per block), clipped to the logical ``size`` (padding dropped)."""
        padded = self.padded_size(size, group_size)
        if padded % (group_size * self.blocks):
            raise ValueError(f"dimension {padded} does not split into {self.blocks} blocks x "
                             f"{group_size} ranks")
        block = padded // self.blocks
        per = block // group_size
        out = []
        for b in range(self.blocks):
            start = b * block + rank * per
            length = min(per, size - start)
            if length > 0:
                out.append((start, length, b * per))
        return out


@dataclass(frozen=True)
class Chunk:
    """One rectangular piece of a full tensor held by this rank: ``offsets``/``sizes`` in
    the full (logical) tensor, ``local_offsets`` in this rank's local tensor."""
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    local_offsets: Tuple[int, ...]

    def global_slices(self) -> Tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def local_slices(self) -> Tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.local_offsets, self.sizes))


@dataclass(frozen=True)
class ParamSpec:
    full_shape: Tuple[int, ...]
    splits: Tuple[Split, ...] = ()
    init: Optional[tuple] = None          # ("normal", std) | ("zeros",) | ("ones",)
    sequence_parallel: Optional[str] = None
    tied: Optional[str] = None            # TIED_OWNER | TIED_COPY
    expert: bool = False

    def __post_init__(self):
        object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        object.__setattr__(self, "splits", tuple(self.splits))
        dims = [s.dim for s in self.splits]
        if len(set(dims)) != len(dims):
            raise ValueError(f"several splits of one dimension: {self.splits}")

    @classmethod
    def split(cls, full_shape, dim: int, group: str = "tp", blocks: int = 1,
              pad_multiple: Optional[int] = None, **kw) -> "ParamSpec":
        return cls(tuple(full_shape), (Split(dim, group, blocks, pad_multiple),), **kw)

    def replace(self, **changes) -> "ParamSpec":
        return dataclasses.replace(self, **changes)

    # -- which groups ---------------------------------------------------------------------
    @property
    def split_groups(self) -> Tuple[str, ...]:
        return tuple(s.group for s in self.splits)

    def split_over(self, group: str) -> Optional[Split]:
        return next((s for s in self.splits if s.group == group), None)

    def replica_groups(self) -> Tuple[str, ...]:
        """Groups whose ranks hold identical copies of this rank's chunk(s): every data
        dimension of the parameter's grid that does not split it."""
        grid = EXPERT_GROUPS if self.expert else DENSE_GROUPS
        return tuple(g for g in grid if g not in self.split_groups)

    # -- shapes and chunks ----------------------------------------------------------------
    def local_shape(self, sizes: Mapping[str, int]) -> Tuple[int, ...]:
        """Shape of a rank's local tensor (padding included) for the given group sizes."""
        shape = list(self.full_shape)
        for s in self.splits:
            n = sizes[s.group]
            padded = s.padded_size(shape[s.dim], n)
            if padded % (n * s.blocks):
                raise ValueError(f"dimension {padded} does not split into {s.blocks} blocks x "
                                 f"{n} ranks")
            shape[s.dim] = padded // n
        return tuple(shape)

    def chunks(self, coords: Coords) -> List[Chunk]:
        """This rank's pieces of the full tensor as global offsets (one per combination of
        blocks; a rank whose share is all padding has none)."""
        per_dim = []
        for d, size in enumerate(self.full_shape):
            s = next((s for s in self.splits if s.dim == d), None)
            if s is None:
                per_dim.append([(0, size, 0)])
            else:
                rank, n = coords[s.group]
                per_dim.append(s.pieces(size, rank, n))
        return [Chunk(tuple(p[0] for p in combo), tuple(p[1] for p in combo),
                      tuple(p[2] for p in combo)) for combo in itertools.product(*per_dim)]

    def shard(self, full: torch.Tensor, coords: Coords) -> torch.Tensor:
        """This rank's local tensor (a new tensor; padding rows are zero)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"full tensor has shape {tuple(full.shape)}, expected "
                             f"{self.full_shape}")
        if not self.splits:
            return full.clone()
        local = full.new_zeros(self.local_shape({g: n for g, (_, n) in coords.items()}))
        for c in self.chunks(coords):
            local[c.local_slices()] = full[c.global_slices()]
        return local

    def unshard(self, locals_by_coords: Sequence[Tuple[Coords, torch.Tensor]]) -> torch.Tensor:
        """The full tensor from ``(coords, local tensor)`` of ranks that together hold it."""
        first = locals_by_coords[0][1]
        full = first.new_empty(self.full_shape)
        for coords, local in locals_by_coords:
            for c in self.chunks(coords):
                full[c.global_slices()] = local[c.local_slices()]
        return full

    # -- checkpoint metadata (the file format predates ParamSpec) --------------------------
    def to_meta_dict(self) -> dict:
        """The split rule as stored in checkpoint files: the TP split in the original
        ``ParamMeta`` keys, splits over other groups under ``splits``."""
        tp = self.split_over("tp")
        d = {"full_shape": list(self.full_shape), "tensor_model_parallel": tp is not None,
             "partition_dim": tp.dim if tp else 0, "partition_blocks": tp.blocks if tp else 1,
             "pad_multiple": tp.pad_multiple if tp else None}
        others = [dataclasses.asdict(s) for s in self.splits if s.group != "tp"]
        if others:
            d["splits"] = others
        return d

    @classmethod
    def from_meta_dict(cls, d) -> "ParamSpec":
        """Inverse of ``to_meta_dict`` (split rule only: no init or flags)."""
        if isinstance(d, ParamSpec):
            return d
        splits = [Split(**s) for s in d.get("splits", [])]
        if d.get("tensor_model_parallel"):
            splits.append(Split(d.get("partition_dim", 0), "tp", d.get("partition_blocks", 1),
                                d.get("pad_multiple")))
        return cls(tuple(d["full_shape"]), tuple(sorted(splits, key=lambda s: s.dim)))

    def same_split(self, other: "ParamSpec") -> bool:
        return self.full_shape == other.full_shape and \
            sorted(self.splits, key=lambda s: s.dim) == sorted(other.splits, key=lambda s: s.dim)


def group_coords(state) -> Dict[str, Tuple[int, int]]:
    """``{group: (rank, size)}`` of every group of a ``ParallelState``."""
    return {name: (g.rank, g.size) for name, g in state.groups.items()}


def is_first_replica(spec: ParamSpec, coords: Coords, groups: Sequence[str]) -> bool:
    """True on exactly one of the ranks that hold identical copies of this chunk, where the
    ranks considered differ only in ``groups`` (compound names such as "dp-cp" expand to
    their dimensions): the one at index 0 of every such group that replicates it.  The
    tied copy is never first (its owner on the first stage is)."""
    if spec.tied == TIED_COPY:
        return False
    dims = {d for g in groups for d in GROUP_SPANS.get(g, (g,))}
    return all(coords[g][0] == 0 for g in spec.replica_groups() if g in dims and g in coords)


def writes_chunk(spec: ParamSpec, coords: Coords, sharded_over: Sequence[str] = ()) -> bool:
    """The owner rule for checkpoints: this rank writes its chunk iff it is the first of
    the ranks holding an identical copy (over every replica group of the parameter's grid,
    except groups in ``sharded_over`` whose ranks hold different pieces, e.g. the DP group
    of a distributed optimizer's buffer).  Expert chunks on DP rank != 0 are written by
    their own expert-DP rank 0, so nothing is lost and nothing is written twice."""
    skip = {d for g in sharded_over for d in GROUP_SPANS.get(g, (g,))}
    return is_first_replica(spec, coords, [g for g in spec.replica_groups() if g not in skip])


# -- creating parameters and collecting the table -------------------------------------------

def make_param(module: nn.Module, name: str, spec: ParamSpec, sizes: Mapping[str, int], *,
               device=None, dtype=None) -> nn.Parameter:
    """An uninitialized local parameter of ``spec`` (group sizes ``sizes``), set as
    ``module.<name>`` and recorded in ``module.param_specs[name]`` (a plain dict, never an
    attribute of the parameter)."""
    p = nn.Parameter(torch.empty(spec.local_shape(sizes), device=device,
                                 dtype=dtype or torch.float32))
    setattr(module, name, p)
    if "param_specs" not in module.__dict__:
        module.param_specs = {}
    module.param_specs[name] = spec
    return p


def module_specs(module: nn.Module) -> Dict[str, ParamSpec]:
    """FQN -> spec of every parameter of ``module`` created by ``make_param``; other
    parameters get a replicated spec of their shape."""
    out = {}
    for prefix, mod in module.named_modules():
        for local, spec in mod.__dict__.get("param_specs", {}).items():
            if isinstance(getattr(mod, local, None), torch.Tensor):
                out[f"{prefix}.{local}" if prefix else local] = spec
    for fqn, p in module.named_parameters():
        out.setdefault(fqn, ParamSpec(tuple(p.shape)))
    return out


class ParamTable:
    """canonical name -> ``ParamSpec`` of one model chunk and FQN -> canonical name."""

    def __init__(self, specs: Dict[str, ParamSpec], names: Dict[str, str]):
        self.specs, self.names = specs, names

    @classmethod
    def from_module(cls, module: nn.Module, canonical: Optional[Mapping[str, str]] = None,
                    tied: Optional[Mapping[str, str]] = None) -> "ParamTable":
        """Collect the specs of ``module``; ``canonical`` renames FQNs, ``tied`` marks
        FQNs as the tied embedding's owner or copy."""
        canonical, tied = dict(canonical or {}), dict(tied or {})
        specs, names = {}, {}
        for fqn, spec in module_specs(module).items():
            name = canonical.get(fqn, fqn)
            if fqn in tied:
                spec = spec.replace(tied=tied[fqn])
            names[fqn], specs[name] = name, spec
        return cls(specs, names)

    def canonical(self, fqn: str) -> str:
        return self.names[fqn]

    def spec(self, fqn: str) -> ParamSpec:
        """The spec of the parameter the module calls ``fqn``."""
        return self.specs[self.names[fqn]]

    def named(self, module: nn.Module) -> Iterator[Tuple[str, nn.Parameter, ParamSpec]]:
        """``(canonical name, parameter, spec)`` of ``module``'s current parameters (looked
        up by FQN, so parameters replaced after construction are found)."""
        for fqn, p in module.named_parameters():
            yield self.names[fqn], p, self.spec(fqn)


def param_table(module: nn.Module) -> ParamTable:
    """The module's table (``module.param_table``), or one collected from its layers."""
    table = getattr(module, "param_table", None)
    return table if isinstance(table, ParamTable) else ParamTable.from_module(module)


def named_specs(modules) -> List[Tuple[str, nn.Parameter, ParamSpec]]:
    """``(FQN, param, spec)`` over one module or a list of model chunks."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    out = []
    for m in modules:
        table = param_table(m)
        out += [(fqn, p, table.spec(fqn)) for fqn, p in m.named_parameters()]
    return out
