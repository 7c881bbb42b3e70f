"""Real gloo runs: every group exists and reduces over exactly its members."""
import torch
import torch.distributed as torch_dist

from megalite import comm
from megalite.parallel_state import GROUP_TOKENS, ParallelState, RankGrid

LAYOUTS_8 = [dict(tp=2, pp=2, cp=1), dict(tp=2, cp=2, pp=2), dict(tp=1, cp=2, pp=2, ep=2, etp=1),
             dict(tp=4, pp=1, cp=1, ep=2, etp=1), dict(tp=2, pp=1, cp=1, ep=4, etp=1)]


def _check_all_groups(layouts):
    rank = torch_dist.get_rank()
    world = torch_dist.get_world_size()
    report = []
    for layout in layouts:
        grid = RankGrid(world, **layout)
        state = ParallelState.build(grid, rank)
        comm.counter.reset()
        for name in [*GROUP_TOKENS, "embedding"]:
            group = state[name]
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, group)
            assert t.item() == sum(group.ranks), (layout, name, t.item(), group.ranks)
            mx = torch.tensor([float(rank)])
            comm.all_reduce(mx, group, op="max")
            assert mx.item() == max(group.ranks)
        # byte counter: one fp32 element per all-reduce in every group of size > 1
        for name in [*GROUP_TOKENS, "embedding"]:
            row = comm.counter.get(name, "all_reduce")
            expected = 2 if state.size(name) > 1 else 0
            assert row["calls"] == expected and row["bytes"] == 4 * expected, (name, row)
        report.append(state.local_rank("tp"))
    return report


def test_every_group_all_reduces_8_ranks(dist):
    dist.run(8, _check_all_groups, LAYOUTS_8)


def _collectives(n):
    state = ParallelState.build(RankGrid(torch_dist.get_world_size(), tp=torch_dist.get_world_size()),
                                torch_dist.get_rank())
    tp = state.tp
    comm.counter.reset()
    x = torch.arange(n, dtype=torch.float32) + tp.rank
    full = torch.empty(n * tp.size)
    comm.all_gather_into_tensor(full, x, tp)
    assert torch.equal(full, torch.cat([torch.arange(n, dtype=torch.float32) + r
                                        for r in range(tp.size)]))
    out = torch.empty(n)
    comm.reduce_scatter_tensor(out, full, tp)
    assert torch.allclose(out, tp.size * full[tp.rank * n:(tp.rank + 1) * n])
    b = torch.ones(3, dtype=torch.bfloat16) * (tp.rank + 1)
    comm.all_reduce(b, tp)
    assert b.dtype == torch.bfloat16 and b[0].item() == sum(range(1, tp.size + 1))
    a = torch.full((tp.size,), float(tp.rank))
    o = torch.empty(tp.size)
    comm.all_to_all_single(o, a, tp)
    assert torch.equal(o, torch.arange(tp.size, dtype=torch.float32))
    nxt, prv = (tp.rank + 1) % tp.size, (tp.rank - 1) % tp.size
    recv = torch.empty(2)
    comm.batch_send_recv([(torch.full((2,), float(tp.rank)), tp.ranks[nxt])],
                         [(recv, tp.ranks[prv])], tp)
    assert recv[0].item() == prv
    return comm.counter.snapshot()


def test_collectives_and_counter(dist):
    snaps = dist.run(4, _collectives, 5)
    s = snaps[0]
    assert s["tp/all_gather"] == {"calls": 1, "elements": 20, "bytes": 80}
    assert s["tp/reduce_scatter"] == {"calls": 1, "elements": 20, "bytes": 80}
    assert s["tp/all_reduce"] == {"calls": 1, "elements": 3, "bytes": 6}
    assert s["tp/all_to_all"]["elements"] == 4
    assert s["tp/send"]["elements"] == 2 and s["tp/recv"]["elements"] == 2
