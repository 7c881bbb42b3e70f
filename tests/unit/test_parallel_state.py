"""Group tables equal Megatron-Core's RankGenerator layout for order tp-cp-ep-dp-pp.

The reference here is written independently of megalite's enumeration: ranks form a
C-ordered array of shape (pp, dp, ep, cp, tp); a group over a set of dimensions is read
off by moving those dimensions last (reversed so the first order-string dimension
varies fastest) -- Megatron-Core's masked-orthogonal enumeration.
"""
import subprocess
import sys

import numpy as np
import pytest

from megalite.parallel_state import GROUP_TOKENS, ORDER, RankGrid

ORDER_DIMS = ORDER.split("-")  # stride-1 dimension first


def reference_groups(world, sizes: dict, token: str):
    shape = [sizes[d] for d in reversed(ORDER_DIMS)]  # C order: last axis = tp = stride 1
    ranks = np.arange(world).reshape(shape)
    axes = list(reversed(ORDER_DIMS))
    wanted = token.split("-")
    masked = [a for a in ORDER_DIMS if a in wanted]
    unmasked = [a for a in ORDER_DIMS if a not in wanted]
    perm = [axes.index(a) for a in reversed(unmasked)] + [axes.index(a) for a in reversed(masked)]
    group_size = int(np.prod([sizes[a] for a in masked]))
    return ranks.transpose(perm).reshape(-1, group_size).tolist()


LAYOUTS = [  # (world, tp, cp, pp, ep, etp)
    (8, 2, 1, 2, 1, None),
    (16, 2, 2, 2, 1, None),      # tp2 cp2 dp2 pp2
    (16, 2, 1, 4, 1, None),      # Megatron's documented 16-GPU example
    (64, 8, 1, 2, 1, None),      # tp8 with pp and dp
    (64, 8, 1, 4, 1, None),
    (64, 8, 2, 2, 1, None),
    (32, 4, 1, 2, 4, 1),         # ep with expert-TP != TP
    (64, 4, 2, 2, 8, 2),
    (64, 2, 1, 4, 4, 4),         # expert-TP larger than TP
    (24, 2, 3, 2, 1, None),
    (48, 4, 1, 3, 2, 2),
    (64, 1, 8, 1, 4, 2),
    (8, 1, 1, 8, 1, None),
]


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", LAYOUTS)
def test_groups_match_megatron_core_layout(world, tp, cp, pp, ep, etp):
    grid = RankGrid(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    etp = etp or tp
    dense = dict(tp=tp, cp=cp, ep=1, dp=world // (tp * cp * pp), pp=pp)
    expert = dict(tp=etp, cp=1, ep=ep, dp=world // (etp * ep * pp), pp=pp)
    for name, (which, token) in GROUP_TOKENS.items():
        sizes = dense if which == "dense" else expert
        assert grid.groups(name) == reference_groups(world, sizes, token), name
    # Both grids give identical pipeline groups, and every group partitions the world.
    assert reference_groups(world, expert, "pp") == grid.groups("pp")
    for name in [*GROUP_TOKENS, "embedding"]:
        flat = sorted(r for g in grid.groups(name) for r in g)
        if name != "embedding":
            assert flat == list(range(world)), name
    assert grid.groups("embedding") == [sorted({g[0], g[-1]}) for g in grid.groups("pp")]


def test_documented_16_gpu_example():
    # Megatron-LM's parallel_state docstring: 16 GPUs, TP=2, PP=4 -> DP=2.
    grid = RankGrid(16, tp=2, pp=4)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                 [14, 15]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                 [13, 15]]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups("mp")[0] == [0, 1, 4, 5, 8, 9, 12, 13]


def test_tp_stays_inside_a_node():
    grid = RankGrid(64, tp=8, pp=4, cp=1)
    for g in grid.groups("tp"):
        assert len({r // 8 for r in g}) == 1


def test_coords_and_bad_sizes():
    grid = RankGrid(16, tp=2, cp=2, pp=2)
    c = grid.coords(13)
    assert grid.groups("tp")[13 // 2][c["tp"]] == 13
    with pytest.raises(ValueError):
        RankGrid(12, tp=8)


def test_module_cli_prints_groups():
    out = subprocess.run([sys.executable, "-m", "megalite.parallel_state", "--world-size", "16",
                          "--tp", "2", "--cp", "2", "--pp", "2"], capture_output=True, text=True,
                         check=True).stdout
    assert "TP=2 CP=2 DP=2 PP=2" in out
    assert "[0,1] [2,3]" in out and "pp" in out and "embedding" in out
    bad = subprocess.run([sys.executable, "-m", "megalite.parallel_state", "--world-size", "6",
                          "--tp", "4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "error" in bad.stderr


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", LAYOUTS)
def test_device_mesh_layout_matches_groups(world, tp, cp, pp, ep, etp):
    """The DeviceMesh rank array: varying one dimension gives exactly the groups of the
    same name (the Megatron-Core reference above), for the dense and the expert grid."""
    grid = RankGrid(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    for which in ("dense", "expert"):
        names, ranks = grid.mesh_ranks(which)
        array = np.array(ranks)
        assert array.shape == tuple(grid.size(n) for n in names)
        assert sorted(array.reshape(-1).tolist()) == list(range(world))
        for axis, name in enumerate(names):
            along = np.moveaxis(array, axis, -1).reshape(-1, array.shape[axis]).tolist()
            assert sorted(along) == sorted(grid.groups(name)), (which, name)


def test_parallel_dims_is_the_one_layout():
    """RankGrid, the planner's Layout, a config and a checkpoint's metadata all read one
    ParallelDims; the derived sizes are its own."""
    from megalite.config import MegaliteConfig, ParallelDims
    from megalite.planner.layout import Layout

    dims = ParallelDims(world=16, tp=2, cp=2, pp=2, ep=4, etp=1, dp_instances=2)
    assert (dims.dp, dims.edp, dims.dense_shards, dims.expert_shards) == (2, 2, 2, 1)
    assert dims.world_step == 8 and [dims.pp_rank_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert ParallelDims(world=8, tp=2).etp == 2                  # expert-TP defaults to TP
    grid = RankGrid(dims)
    assert grid.parallel_dims is dims and grid.dp_instances == 2
    assert grid.dims == {"dense": dims.grid_sizes("dense"), "expert": dims.grid_sizes("expert")}
    same = RankGrid(16, tp=2, cp=2, pp=2, ep=4, etp=1, dp_instances=2)
    assert all(grid.groups(n) == same.groups(n) for n in GROUP_TOKENS)
    with pytest.raises(ValueError, match="world size 12 does not fit tp=2 cp=2 pp=2"):
        RankGrid(dims.with_world(12))

    cfg = MegaliteConfig(world_size=16)
    cfg.model.num_layers = 4
    cfg.parallel.apply_dims(dims)            # the planner's way from a layout to flags
    assert cfg.parallel_dims == dims and cfg.data_parallel_size == 2
    layout = Layout(dims=dims, micro_batch=2, global_batch=16)
    assert (layout.tp, layout.etp, layout.dp, layout.instances) == (2, 1, 2, 2)
    assert layout.num_micro_batches == 4 and layout.to_dict()["instances"] == 2
    assert Layout(world=8, tp=2).etp == 1    # a planner candidate names its expert-TP

    meta = dims.to_metadata()
    assert meta == {"tp": 2, "pp": 2, "cp": 2, "ep": 4, "expert_tp": 1, "world_size": 16,
                    "vpp": 1}
    older = {k: v for k, v in ParallelDims(world=16, tp=2).to_metadata().items()
             if k != "expert_tp"}            # written before expert-TP was recorded
    assert ParallelDims.normalize_metadata(older) == ParallelDims(world=16, tp=2).to_metadata()
