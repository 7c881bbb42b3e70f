"""One way for the tests to build a CPU ``Trainer`` from command-line flags and step it
(tests/ is on sys.path): a single process gets a state without process groups; inside a
``dist.run`` worker the state is built over the running world."""
from __future__ import annotations

import torch.distributed as torch_dist

from megalite.cli.arguments import parse_args
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training.loop import Trainer


def build_cpu_trainer(argv, world: int) -> Trainer:
    cfg = parse_args(["--world-size", str(world), *argv])
    grid = RankGrid.from_config(cfg)
    state = ParallelState.build(grid, 0, create_groups=False) if world == 1 else \
        ParallelState.build(grid, torch_dist.get_rank())
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    return trainer


def train_steps(trainer: Trainer, n: int, save_every=None, after_save=None) -> list:
    """``n`` training steps from the trainer's data position; their losses.  Every
    ``save_every`` iterations it saves (then calls ``after_save(trainer)``)."""
    it = trainer.data_iterator(trainer.train_ds, trainer.consumed_samples)
    losses = []
    for _ in range(n):
        losses.append(trainer.train_step(it)["lm_loss"])
        if save_every and trainer.iteration % save_every == 0:
            trainer.save()
            if after_save:
                after_save(trainer)
    return losses


def train_cases(run, cases: dict, iters: int) -> dict:
    """Each case ``name: (world, argv)`` trained ``iters`` steps on this rank (argv after
    ``run``): its losses, grad norms and whether this rank writes (equivalence tests compare
    a layout's writer with the one-process case) and the CP group's sent bytes per step,
    measured (``comm.counter``) and as the planner counts them for this rank."""
    from megalite import comm
    from megalite.planner.comm_model import predict_comm_volume

    out = {}
    for name, (world, argv) in cases.items():
        trainer = build_cpu_trainer([*run, *argv], world)
        it = trainer.data_iterator(trainer.train_ds, 0)
        comm.counter.reset()
        rows = [trainer.train_step(it) for _ in range(iters)]
        rank = torch_dist.get_rank() if world > 1 else 0
        out[name] = dict(writer=trainer.is_writer or world == 1,
                         loss=[r["lm_loss"] for r in rows], norm=[r["grad_norm"] for r in rows],
                         cp_sent=comm.counter.get("cp", "send")["bytes"] / iters,
                         cp_planned=predict_comm_volume(trainer.cfg, rank).get(
                             "cp/send", {}).get("bytes", 0))
    return out
