"""The data-parallel strategy seam on one process: one interface for both strategies, a
shared optimizer base, imports that point one way, and bad input refused."""
import ast
import pathlib

import pytest
import torch

import megalite
from megalite.optimizer.lr_schedule import StepSettings
from megalite.cli.arguments import parse_args
from megalite.distributed.data_parallel import (DataParallelStrategy, DDPStrategy,
                                                DistributedOptimizerStrategy,
                                                build_data_parallel)
from megalite.distributed.distributed_optimizer import DistributedOptimizer
from megalite.models.parallelize import attach_data_parallel
from megalite.optimizer import MasterWeightOptimizer, MixedPrecisionOptimizer
from megalite.param_spec import ParamSpec
from megalite.parallel_state import ParallelState, RankGrid

ROOT = pathlib.Path(megalite.__file__).parent


def _cfg(extra=()):
    return parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                       "--seq-length", "8", "--mock-data", "--vocab-size", "10", "--lr", "0.1",
                       "--train-iters", "1", *extra])


def _state():
    return ParallelState.build(RankGrid(1), 0, create_groups=False)


def _named():
    lin, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    return [("lin.weight", lin.weight), ("lin.bias", lin.bias), ("norm.weight", norm.weight)]


@pytest.mark.parametrize("flags,strategy,optimizer", [
    ((), DDPStrategy, MixedPrecisionOptimizer),
    (("--use-distributed-optimizer",), DistributedOptimizerStrategy, DistributedOptimizer)])
def test_both_strategies_share_the_interface_and_norm(flags, strategy, optimizer):
    cfg = _cfg(["--clip-grad", "0", *flags])
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    s = attach_data_parallel([chunk], build_data_parallel([chunk], cfg, _state()))
    assert type(s) is strategy and isinstance(s, DataParallelStrategy)
    assert type(s.optimizer) is optimizer and isinstance(s.optimizer, MasterWeightOptimizer)
    for _ in range(2):                  # zero_grad really clears the strategy's buffers
        s.zero_grad()
        chunk(torch.ones(2, 4)).pow(2).sum().backward()
        s.finish_grad_sync()
        ref = torch.cat([p.grad.reshape(-1) for p in chunk.parameters()]).norm().item()
        assert s.grad_norm() == pytest.approx(ref, rel=1e-6)
        assert s.step(StepSettings(1e-2)) == pytest.approx(ref, rel=1e-6)


def test_expert_params_need_num_experts():
    named = _named()
    specs = {"lin.weight": ParamSpec((4, 4), expert=True)}     # the table marks it
    with pytest.raises(ValueError, match="marked as experts.*--num-experts"):
        DDPStrategy(named, _cfg(), _state(), specs)


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_optimizer_does_not_import_distributed_and_no_private_names():
    """optimizer/ is below distributed/ (no cycle); neither imports another module's
    private names."""
    for path in (ROOT / "optimizer").glob("*.py"):
        for module, _ in _imports(path):
            assert not module.startswith(("megalite.distributed", "megalite.training")), \
                (path.name, module)
    for folder in ("optimizer", "distributed"):
        for path in (ROOT / folder).glob("*.py"):
            for module, names in _imports(path):
                if module.startswith("megalite"):
                    assert not [n for n in names if n.startswith("_")], (path.name, module)
