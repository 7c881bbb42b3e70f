"""megalite/pipeline_parallel/fsdp_sync.py against a closed form, not only across layouts:
on 2 gloo ranks a fully sharded two-layer MLP runs three micro-batches' backwards under
``defer_gradient_sync``.  Until ``reduce_gradients`` no reduce-scatter runs and nothing is
re-gathered (the parameters stay gathered); after it, each unit has reduce-scattered once
and its sharded gradient is the mean over ranks of the sum over micro-batches of a plain
copy's gradients (computed on the gathered batches).  A forward-only run under
``reshard_after_forward=False`` keeps the parameters gathered until ``reshard`` frees
them: the next forward gathers again."""
import torch
import torch.distributed as torch_dist

WORLD, MICRO, DIN, DH = 2, 3, 6, 10


def _plain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIN, DH), torch.nn.Tanh(),
                               torch.nn.Linear(DH, 4))


def _batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(5, DIN, generator=g) for _ in range(MICRO)]


# FSDP2 calls its collectives through ``torch.distributed`` (torch 2.13: the *_single
# names; older: *_into_tensor / *_tensor)
NAMES = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
         "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


class _Count:
    """Counts FSDP2's all-gathers and reduce-scatters."""

    def __init__(self):
        self.n = {kind: 0 for kind in NAMES}
        self.saved = {}

    def __enter__(self):
        for kind, names in NAMES.items():
            for name in names:
                if not hasattr(torch_dist, name):
                    continue
                fn = self.saved[name] = getattr(torch_dist, name)

                def counted(*a, _fn=fn, _kind=kind, **kw):
                    self.n[_kind] += 1
                    return _fn(*a, **kw)
                setattr(torch_dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch_dist, name, fn)


def _fsdp_sync_rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megalite.pipeline_parallel import fsdp_sync

    rank = torch_dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _plain()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    assert fsdp_sync.fsdp_chunks([model, _plain()]) == [model]

    # the oracle: a plain copy on every rank's micro-batches, gradients summed over
    # micro-batches, averaged over ranks (FSDP's reduce-scatter averages)
    ref = _plain()
    every = [_batches(r) for r in range(WORLD)]
    for r in range(WORLD):
        for x in every[r]:
            (ref(x).square().sum() / WORLD).backward()

    with _Count() as c:
        fsdp_sync.defer_gradient_sync(model)
        for x in _batches(rank):
            model(x).square().sum().backward()
        deferred = dict(c.n)
        fsdp_sync.reduce_gradients(model)
        reduced = dict(c.n)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}

    with _Count() as c:                 # forward-only under PP: gathered until reshard
        with torch.no_grad():
            model(every[rank][0])
            model(every[rank][0])
        kept = dict(c.n)
        fsdp_sync.reshard(model)
        with torch.no_grad():
            model(every[rank][0])
        again = dict(c.n)
    return deferred, reduced, grads, want, kept, again


def test_fsdp_chunk_reduces_once_per_step_to_the_closed_form(dist):
    for deferred, reduced, grads, want, kept, again in dist.run(WORLD, _fsdp_sync_rank):
        # one gather per unit for the first forward, none again; no reduction until asked
        assert deferred == {"all_gather": 2, "reduce_scatter": 0}
        assert reduced["reduce_scatter"] == 2            # one per unit with params
        assert reduced["all_gather"] == 2
        assert sorted(grads) == sorted(want)
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)
        assert kept == {"all_gather": 2, "reduce_scatter": 0}
        assert again == {"all_gather": 4, "reduce_scatter": 0}
