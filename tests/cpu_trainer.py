"""One way for the tests to build a CPU ``Trainer`` from command-line flags and step it
(tests/ is on sys.path): a single process gets a state without process groups; inside a
``dist.run`` worker the state is built over the running world."""
from __future__ import annotations

import json

import torch.distributed as torch_dist

from megalite.cli.arguments import parse_args
from megalite.parallel_state import ParallelState, RankGrid
from megalite.planner.step_peak import predict_step_peak
from megalite.training.loop import Trainer
from megalite.training.metrics import TrainingLogger


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


def metered_step_peak(argv, metrics_file) -> tuple:
    """Train one process under the CPU tensor meter (started before the model is built, as
    ``pretrain`` does) with ``argv`` (it gets ``--metrics-file``); (the run's measured peak
    bytes, the planner's ``predict_step_peak`` of the same config)."""
    cfg = parse_args(["--world-size", "1", *argv, "--metrics-file", str(metrics_file)])
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.memory_reporter.start()
    trainer.setup()
    logger = TrainingLogger(trainer.cfg, True, trainer.train_iters)
    trainer.train(logger)
    logger.close()
    rows = [json.loads(line) for line in open(metrics_file).read().splitlines()]
    measured = [r for r in rows if r.get("split") == "memory"][0]["measured_peak_bytes"]
    return measured, predict_step_peak(trainer.cfg, 0)
