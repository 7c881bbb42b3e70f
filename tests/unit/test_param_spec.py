"""ParamSpec chunks (fused blocks, vocabulary padding, expert groups), the owner rule for
writers, flat optimizer ranges as rectangles, and ``assemble``."""
import itertools

import pytest
import torch

from megalite.state_format.sharded_state import ShardedTensor, assemble, flat_range_boxes
from megalite.param_spec import (ParamSpec, ParamTable, Split, is_first_replica, make_param,
                                 writes_chunk)
from megalite.parallel_state import GROUP_TOKENS, RankGrid


def coords_of(grid: RankGrid, rank: int) -> dict:
    return {name: (grid.group_of(name, rank).index(rank), grid.size(name))
            for name in GROUP_TOKENS}


def test_fused_blocks_give_one_chunk_per_block():
    spec = ParamSpec.split((16, 3), 0, "tp", blocks=2)
    chunks = spec.chunks({"tp": (1, 2)})
    assert [(c.offsets, c.sizes, c.local_offsets) for c in chunks] == [
        ((4, 0), (4, 3), (0, 0)), ((12, 0), (4, 3), (4, 0))]
    full = torch.arange(48.0).view(16, 3)
    local = spec.shard(full, {"tp": (1, 2)})
    assert torch.equal(local, torch.cat([full[4:8], full[12:16]]))


def test_vocab_padding_is_clipped_from_chunks():
    spec = ParamSpec.split((70, 4), 0, "tp", pad_multiple=16)
    assert spec.local_shape({"tp": 4}) == (32, 4)                  # 128 padded rows / 4
    got = {r: [(c.offsets, c.sizes) for c in spec.chunks({"tp": (r, 4)})] for r in range(4)}
    assert got == {0: [((0, 0), (32, 4))], 1: [((32, 0), (32, 4))],
                   2: [((64, 0), (6, 4))], 3: []}                  # rank 3: all padding
    full = torch.randn(70, 4)
    pieces = [({"tp": (r, 4)}, spec.shard(full, {"tp": (r, 4)})) for r in range(4)]
    assert torch.equal(spec.unshard(pieces), full)
    assert pieces[3][1].abs().sum() == 0 and pieces[2][1][6:].abs().sum() == 0


@pytest.mark.parametrize("ep,etp", [(2, 1), (2, 3), (1, 3), (4, 3)])
def test_expert_spec_split_over_ep_and_expert_tp(ep, etp):
    # 4 experts stacked on dim 0 (split over EP), fused [gate; up] rows on dim 1 (expert-TP)
    spec = ParamSpec((4, 12, 5), (Split(0, "ep"), Split(1, "expert-tp", blocks=2)),
                     init=("normal", 0.02), expert=True)
    assert spec.replica_groups() == ("expert-dp",)
    assert spec.local_shape({"ep": ep, "expert-tp": etp}) == (4 // ep, 12 // etp, 5)
    full = torch.randn(4, 12, 5)
    pieces = []
    for e, t in itertools.product(range(ep), range(etp)):
        coords = {"ep": (e, ep), "expert-tp": (t, etp)}
        local = spec.shard(full, coords)
        chunks = spec.chunks(coords)
        assert len(chunks) == 2                                     # one per fused block
        assert all(c.offsets[0] == e * (4 // ep) for c in chunks)
        half = 6 // etp   # this rank's rows of gate, then of up
        assert torch.equal(local[:, :half], full[e * (4 // ep):(e + 1) * (4 // ep),
                                                 t * half:(t + 1) * half])
        pieces.append((coords, local))
    assert torch.equal(spec.unshard(pieces), full)


def _writer_dicts(specs, grid, sharded_over=()):
    """What ``model_sharded_state_dict`` gives on every rank of ``grid`` for ``specs``
    (tensors filled with the full tensor's values), as a list of rank dicts."""
    fulls = {k: torch.arange(float(torch.Size(s.full_shape).numel())).view(s.full_shape)
             for k, s in specs.items()}
    out = []
    for r in range(grid.world_size):
        coords = coords_of(grid, r)
        out.append({k: ShardedTensor(s.full_shape,
                                     [(c.offsets, fulls[k][c.global_slices()])
                                      for c in s.chunks(coords)],
                                     writes_chunk(s, coords, sharded_over))
                    for k, s in specs.items()})
    return out, fulls


def test_owner_rule_writes_every_chunk_once_including_experts_off_dp_rank_0():
    # world 4, dense TP1 x DP4; expert grid EP2 x expert-DP2: expert 1 lives on ranks 1, 3
    grid = RankGrid(4, tp=1, ep=2)
    specs = {"dense": ParamSpec.split((8, 2), 0, "tp"), "norm": ParamSpec((3,)),
             "expert": ParamSpec((2, 4), (Split(0, "ep"),), expert=True)}
    dicts, fulls = _writer_dicts(specs, grid)
    writers = {k: [r for r, d in enumerate(dicts) if d[k].writer] for k in specs}
    assert writers == {"dense": [0], "norm": [0], "expert": [0, 1]}
    assert coords_of(grid, 1)["dp"] == (1, 4)       # expert 1's writer is not a DP-rank-0
    full = assemble(dicts)
    assert all(torch.equal(full[k], fulls[k]) for k in specs)
    # today's rule (only DP rank 0 writes) would lose expert 1
    old = [{k: ShardedTensor(v.global_shape, v.chunks, coords_of(grid, r)["dp"][0] == 0)
            for k, v in d.items()} for r, d in enumerate(dicts)]
    with pytest.raises(ValueError, match="written by no rank"):
        assemble(old)


def test_owner_rule_with_tp_expert_tp_and_a_sharded_optimizer():
    grid = RankGrid(8, tp=2, ep=2, etp=2)        # expert grid: ETP2 x EP2 x EDP2
    specs = {"col": ParamSpec.split((8, 4), 0, "tp", blocks=2),
             "bias": ParamSpec((4,), sequence_parallel="tp"),
             "expert": ParamSpec((4, 6), (Split(0, "ep"), Split(1, "expert-tp")), expert=True),
             "tied_copy": ParamSpec.split((10, 4), 0, "tp", pad_multiple=4, tied="copy")}
    dicts, fulls = _writer_dicts({k: v for k, v in specs.items() if k != "tied_copy"}, grid)
    full = assemble(dicts)
    assert all(torch.equal(full[k], fulls[k]) for k in full)
    copy = specs["tied_copy"]
    assert not any(writes_chunk(copy, coords_of(grid, r)) for r in range(8))
    assert not is_first_replica(copy, coords_of(grid, 0), ("tp",))
    # distributed optimizer: DP ranks hold different flat pieces, so each DP rank writes its
    # own (TP-replicated state still once, on TP rank 0)
    w = [writes_chunk(specs["bias"], coords_of(grid, r), sharded_over=("dp-cp",))
         for r in range(8)]
    assert w == [coords_of(grid, r)["tp"][0] == 0 for r in range(8)] and sum(w) == 4
    # the grad norm over model parallel counts a TP-replicated param on TP rank 0 only
    assert [is_first_replica(specs["bias"], coords_of(grid, r), ("tp",)) for r in (0, 1)] == \
        [True, False]
    assert all(is_first_replica(specs["col"], coords_of(grid, r), ("tp",)) for r in (0, 1))


def test_flat_ranges_become_contiguous_rectangles():
    shape = (3, 4, 5)
    numel = 60
    index = torch.arange(numel).view(shape)
    for lo, hi in [(0, 60), (7, 8), (3, 41), (20, 40), (19, 21), (0, 5), (59, 60), (12, 12)]:
        boxes = flat_range_boxes(shape, lo, hi)
        covered = []
        for off, size in boxes:
            idx = index[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
            assert torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel()))
            covered += idx.tolist()
        assert covered == list(range(lo, hi)), (lo, hi)
        assert len(boxes) <= 2 * len(shape) - 1


def test_table_is_kept_off_the_parameters_and_found_by_name():
    mod = torch.nn.Module()
    mod.inner = torch.nn.Module()
    spec = ParamSpec.split((6, 2), 1, "expert-tp", init=("zeros",), expert=True)
    p = make_param(mod.inner, "w", spec, {"expert-tp": 2})
    assert p.shape == (6, 1) and mod.inner.w is p and not hasattr(p, "spec")
    mod.plain = torch.nn.Linear(2, 2, bias=False)
    table = ParamTable.from_module(mod, canonical={"inner.w": "experts.w"})
    assert table.spec("inner.w") is spec and table.canonical("inner.w") == "experts.w"
    assert table.spec("plain.weight") == ParamSpec((2, 2))      # unknown: replicated
    mod.inner.w = torch.nn.Parameter(torch.zeros(6, 1))        # replaced (as FSDP2 does)
    assert [(n, s) for n, _, s in table.named(mod)][0] == ("experts.w", spec)
