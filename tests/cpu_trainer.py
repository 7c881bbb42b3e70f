"""One way for the multi-process tests to build a CPU ``Trainer`` from command-line flags
(tests/ is on sys.path): a single process gets a state without process groups; inside a
``dist.run`` worker the state is built over the running world."""
from __future__ import annotations

import torch.distributed as torch_dist

from megalite.arguments import parse_args
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
