"""The extra-loss channel through the real loop on PP2: a dummy term registered by every
transformer layer (so by both pipeline stages) changes the gradients exactly as on one
process, and the logged value -- reduced over pp and dp-cp -- is the same on every rank and
equal to the single-process one, for 1F1B, zero bubble, full recompute and TP2."""
import dataclasses

import pytest
import torch.distributed as torch_dist

from megalite.cli.arguments import parse_args
from megalite.models.gpt_step import GPT_FAMILY
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training.loop import Trainer
from megalite.transformer.extra_losses import add_extra_loss

WORLD, STEPS = 4, 3
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
         "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-iters", "0",
         "--lr-warmup-iters", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CASES = {   # name: (world, flags, with the dummy extra loss)
    "ref": (1, [], True),
    "pp2-dp2": (WORLD, PP2, True),
    "pp2-dp2-zero-bubble": (WORLD, PP2 + ["--pipeline-schedule", "zero-bubble"], True),
    "pp2-dp2-full-recompute": (WORLD, PP2 + ["--recompute-granularity", "full",
                                             "--recompute-method", "uniform"], True),
    "pp2-tp2": (WORLD, PP2 + ["--tensor-model-parallel-size", "2"], True),
    "pp2-dp2-without": (WORLD, PP2, False),
}
DUMMY_FAMILY = dataclasses.replace(GPT_FAMILY, extra_loss_names=lambda cfg: ("dummy",))


def _dummy(_module, _args, out):
    add_extra_loss("dummy", 30.0 * out.float().pow(2).mean())


def _train(cases):
    rank = torch_dist.get_rank()
    out = {}
    for name, (world, argv, extra) in cases.items():
        cfg = parse_args(["--world-size", str(world), *MODEL, *argv])
        grid = RankGrid(world, tp=cfg.parallel.tp, pp=cfg.parallel.pp)
        state = ParallelState.build(grid, rank if world > 1 else 0, create_groups=world > 1)
        trainer = Trainer(cfg, state, "cpu", DUMMY_FAMILY if extra else GPT_FAMILY)
        trainer.setup()
        layers = 0
        if extra:
            for chunk in trainer.model_chunks:
                for layer in chunk.decoder.layers.values():
                    layer.register_forward_hook(_dummy)
                    layers += 1
        it = trainer.data_iterator(trainer.train_ds, 0)
        rows = [trainer.train_step(it) for _ in range(STEPS)]
        out[name] = dict(writer=trainer.is_writer or world == 1, layers=layers,
                         loss=[r["lm_loss"] for r in rows], norm=[r["grad_norm"] for r in rows],
                         dummy=[r.get("dummy") for r in rows])
    return out


@pytest.fixture(scope="module")
def runs(dist):
    return dist.run(WORLD, _train, CASES)


def _writer(results, name):
    return next(r[name] for r in results if r[name]["writer"])


def _close(a, b, tol):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", [n for n in CASES if n not in ("ref", "pp2-dp2-without")])
def test_extra_loss_from_both_stages_matches_one_process(runs, name):
    ref, got = _writer(runs, "ref"), _writer(runs, name)
    assert ref["layers"] == 4 and all(d > 0 for d in ref["dummy"])
    assert {r[name]["layers"] for r in runs} == {2}          # every stage registers terms
    for r in runs:                                            # reduced over pp and dp-cp
        assert r[name]["dummy"] == pytest.approx(got["dummy"], rel=1e-12)
    assert _close(got["dummy"][:1], ref["dummy"][:1], 1e-5), (got["dummy"], ref["dummy"])
    assert _close(got["dummy"], ref["dummy"], 1e-4), (got["dummy"], ref["dummy"])
    assert _close(got["norm"], ref["norm"], 1e-4), (got["norm"], ref["norm"])
    assert _close(got["loss"], ref["loss"], 1e-4), (got["loss"], ref["loss"])


def test_extra_loss_changes_the_gradients(runs):
    ref, without = _writer(runs, "ref"), _writer(runs, "pp2-dp2-without")
    assert without["dummy"] == [None] * STEPS
    assert abs(without["loss"][0] - ref["loss"][0]) <= 1e-5 * ref["loss"][0]  # same forward
    assert abs(without["norm"][0] - ref["norm"][0]) > 1e-3 * ref["norm"][0]   # other grads
    assert abs(without["loss"][-1] - ref["loss"][-1]) > 1e-5 * ref["loss"][-1]
