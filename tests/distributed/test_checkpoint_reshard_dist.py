"""Resharding on resume: a run saved at one layout continues at another with optimizer
state (Adam moments, step, fp32 masters) intact, so its losses match the uninterrupted
run to fp32 tolerance.  Without the optimizer state (``--no-load-optim``) they do not,
which shows the check can tell.  All rows share one 4-process launch."""
import torch.distributed as torch_dist

from megalite.arguments import parse_args
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training.loop import Trainer

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
        "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--eval-iters", "0", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
        "--global-batch-size", "8", "--micro-batch-size", "1"]

LAYOUTS = {   # name: (world size, flags)
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp1pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "tp4pp1": (4, ["--tensor-model-parallel-size", "4"]),
    "vpp2": (4, ["--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1"]),
    "vpp1": (4, ["--pipeline-model-parallel-size", "2"]),
    "pp2dp2_distopt": (4, ["--pipeline-model-parallel-size", "2",
                           "--use-distributed-optimizer"]),
    "tp2dp2_distopt": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "dp1": (1, []),
    "tp2dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "dp4": (4, []),
}
ROWS = [("tp2pp2", "tp1pp4"), ("tp2pp2", "tp4pp1"), ("vpp2", "vpp1"),
        ("pp2dp2_distopt", "dp1"), ("dp1", "tp2dp2_distopt"), ("tp2dp2", "dp4")]


def _trainer(name, extra):
    world, flags = LAYOUTS[name]
    cfg = parse_args(["--world-size", str(world), *BASE, *flags, *extra])
    p = cfg.parallel
    grid = RankGrid(world, tp=p.tp, pp=p.pp, vpp=p.virtual_stages(cfg.model.num_layers))
    rank = torch_dist.get_rank()
    state = ParallelState.build(grid, 0, create_groups=False) if world == 1 else \
        ParallelState.build(grid, rank)
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    return trainer


def _on_my_ranks(name) -> bool:
    return LAYOUTS[name][0] == 4 or torch_dist.get_rank() == 0


def _straight_saving(name, path):
    """Four iterations, saving after the second: (losses, checkpoint dir)."""
    losses = None
    if _on_my_ranks(name):
        trainer = _trainer(name, ["--save", path])
        it = trainer.data_iterator(trainer.train_ds, 0)
        losses = []
        for i in range(4):
            losses.append(trainer.train_step(it)["lm_loss"])
            if i == 1:
                trainer.save()
    torch_dist.barrier()
    return losses


def _continued(name, path, extra=()):
    losses = None
    if _on_my_ranks(name):
        trainer = _trainer(name, ["--load", path, *extra])
        assert trainer.iteration == 2 and trainer.consumed_samples == 16
        it = trainer.data_iterator(trainer.train_ds, trainer.consumed_samples)
        losses = [trainer.train_step(it)["lm_loss"] for _ in range(2)]
    torch_dist.barrier()
    return losses


def _matrix(root):
    out, straight = {}, {}
    for src, dst in ROWS:
        if src not in straight:
            straight[src] = _straight_saving(src, f"{root}/{src}")
        out[f"{src}->{dst}"] = (straight[src], _continued(dst, f"{root}/{src}"))
    out["no_optim"] = (straight["tp2pp2"],
                       _continued("tp1pp4", f"{root}/tp2pp2", ["--no-load-optim"]))
    return out


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _loss_rank(out, row, i):
    """The losses as a last pipeline stage saw them (others hold zeros)."""
    return next(r[row][i] for r in reversed(out) if r[row][i] and all(r[row][i]))


def test_reshard_matrix_continues_with_optimizer_state(dist, tmp_path):
    out = dist.run(4, _matrix, str(tmp_path))
    for row in out[0]:
        straight, resumed = _loss_rank(out, row, 0), _loss_rank(out, row, 1)
        if row == "no_optim":
            assert _rel(resumed, straight[2:]) > 1e-5, (straight, resumed)
        else:
            assert _rel(resumed, straight[2:]) <= 1e-5, (row, straight, resumed)
