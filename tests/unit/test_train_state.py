"""The training state's Stateful parts (megalite/checkpointing/train_state.py), single process:

* every part is a DCP ``Stateful`` and round-trips: a fresh trainer that loads each part's
  ``state_dict()`` gives back the same state dict, and the next step's loss is the trained
  trainer's own (plain optimizer + MoE expert biases + dropout RNG; distributed optimizer
  + fp16 masters and loss scaler);
* the composition is what a save writes and what a load reads (a probe part added to it
  lands in the DCP files and comes back), and the per-split data position (valid samples
  evaluated) survives a save and a resume; a checkpoint without it reads 0."""
import dataclasses
import json

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)
from megalite.state_format.dcp_format import ChunkedTensor, saved_tensors
from megalite.checkpointing import checkpoint as ckpt
from megalite.checkpointing import train_state as ts

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--lr", "3e-3",
        "--train-iters", "4", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--eval-iters", "1", "--eval-interval", "2", "--lr-warmup-iters", "1",
        "--attention-dropout", "0", "--hidden-dropout", "0.1", "--swiglu"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "1e-2"]
CASES = {"plain_moe": MOE,
         "distributed_fp16": ["--use-distributed-optimizer", "--fp16",
                              "--initial-loss-scale", "1024", "--loss-scale-window", "1"]}


def _trained(flags, steps=2):
    trainer = build_cpu_trainer([*TINY, *flags], 1)
    it = trainer.data_iterator(trainer.train_ds, 0)
    for _ in range(steps):
        trainer.train_step(it)
    trainer.evaluate(trainer.valid_ds, 1)
    return trainer


def _plain(value):
    """A state dict's value with tensors as (offsets, values) lists, comparable with ==."""
    if isinstance(value, ChunkedTensor):
        return (tuple(value.global_shape), [(tuple(o), t.detach().clone()) for o, t in value.chunks])
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_part_is_stateful_and_round_trips(case):
    flags = CASES[case]
    source, target = _trained(flags), build_cpu_trainer([*TINY, *flags], 1)
    parts, fresh = ts.training_state(source), ts.training_state(target)
    expected = {"model", "data", "schedule", "optimizer", "rng"} | (
        {"moe_expert_bias"} if "--moe-router-enable-expert-bias" in flags else set()) | (
        {"grad_scaler"} if "--fp16" in flags else set())
    assert set(parts.names()) == expected
    saved = {}
    for (name, part), (_, other) in zip(parts.parts, fresh.parts):
        assert isinstance(part, Stateful), name
        saved[name] = _plain(part.state_dict())
        other.load_state_dict(part.state_dict())
    for name, part in fresh.parts:                 # the loaded trainer says the same
        _equal(_plain(part.state_dict()), saved[name], name)
    assert saved["data"]["consumed_valid_samples"] == 4          # one evaluation of 4
    assert target.iteration == 2 and target.consumed_samples == 8
    assert saved["optimizer"]["step"] == 2.0
    if "moe_expert_bias" in saved:
        assert saved["moe_expert_bias"] and any(any(v) for v in saved["moe_expert_bias"].values())
    # the whole state moved: the next two steps are the source's own, to the bit (the
    # second one after an update: optimizer state and masters).  Both trainers draw dropout
    # from this process's one CPU generator: each starts from the saved state.
    cpu_rng = saved["rng"]["rank0.cpu"][1][0][1]
    steps = []
    for t in (source, target):
        torch.set_rng_state(cpu_rng)
        it = t.data_iterator(t.train_ds, t.consumed_samples)
        steps.append([t.train_step(it)["lm_loss"] for _ in range(2)])
    assert steps[0] == steps[1]


def test_a_save_writes_the_composition_and_a_load_reads_it(tmp_path):
    flags = ["--save", str(tmp_path / "ckpt")]
    source = _trained(flags)
    composed = ts.training_state(source).state_dict()
    loaded = {}

    class Probe:
        """A part of its own: a tensor the checkpointer knows nothing about."""
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"x": ChunkedTensor((3,), [((0,), self.value)])}

        def load_targets(self, saved, values):
            return {"x": ChunkedTensor((3,), [((0,), torch.zeros(3))])}

        def load_state_dict(self, sd):
            loaded["x"] = sd["x"].chunks[0][1].clone()

    def with_probe(trainer):
        state = ts.training_state(trainer)
        return ts.TrainState([*state.parts, ("probe", Probe(torch.tensor([1.0, 2.0, 3.0])))],
                             state.parallel, state.description, state.before_save)

    it_dir, pending = ckpt.save(with_probe(source), source.cfg.checkpoint, source.iteration)
    assert pending is None                         # no --async-save
    on_disk = saved_tensors(it_dir)
    assert set(on_disk) == set(ts.tensors_of(composed)) | {"probe.x"}
    meta = json.load(open(f"{it_dir}/metadata.json"))
    assert meta["extra"]["consumed_valid_samples"] == 4
    assert meta["extra"]["loop_state"] == {"skipped_samples": 0, "skipped_iterations": 0,
                                           "grad_scaler": None}
    assert meta["iteration"] == 2 and meta["optimizer_step"] == 2.0 and meta["rng_ranks"]
    assert meta["layout"] == {**source.cfg.parallel_dims.to_metadata(), "bf16": False}

    resumed = build_cpu_trainer(TINY, 1)
    ckpt.load(with_probe(resumed), dataclasses.replace(resumed.cfg.checkpoint,
                                                       load=str(tmp_path / "ckpt")))
    assert torch.equal(loaded["x"], torch.tensor([1.0, 2.0, 3.0]))
    assert resumed.iteration == 2 and resumed.position.consumed == {"train": 8, "valid": 4,
                                                                    "test": 0}


def test_metadata_places_keep_the_format_and_read_older_checkpoints():
    sd = {"data": {"iteration": 7, "consumed_train_samples": 28, "consumed_valid_samples": 8,
                   "consumed_test_samples": 0},
          "schedule": {"skipped_samples": 4, "skipped_iterations": 1},
          "grad_scaler": {"scale": 512.0, "growth_tracker": 0, "hysteresis_tracker": 2},
          "optimizer": {"step": 6.0}, "rng": {"ranks": [{"tp": [0, 1]}]}}
    meta = ts.to_metadata(sd)
    assert meta["iteration"] == 7 and meta["consumed_samples"] == 28
    assert meta["extra"]["consumed_samples"] == 28 and meta["optimizer_step"] == 6.0
    assert meta["extra"]["loop_state"]["grad_scaler"]["scale"] == 512.0
    assert meta["rng_ranks"] == [{"tp": [0, 1]}]
    assert ts.from_metadata(meta) == sd
    # what tools/checkpoint/convert.py writes: no loop state, no RNG, no optimizer step
    older = {"iteration": 0, "consumed_samples": 0, "optimizer_step": None, "rng_ranks": [],
             "extra": {"consumed_samples": 0, "loop_state": None}}
    values = ts.from_metadata(older)
    assert values == {"data": {"iteration": 0, "consumed_train_samples": 0},
                      "rng": {"ranks": []}}
    from megalite.data.position import DataPosition

    position = DataPosition()
    position.load_state_dict(values["data"])
    assert position.consumed == {"train": 0, "valid": 0, "test": 0}
