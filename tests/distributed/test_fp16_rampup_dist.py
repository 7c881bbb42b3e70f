"""--fp16 and --rampup-batch-size on real gloo processes (one 2-process launch).

* fp16 with a static loss scale under DP2 (plain and with --overlap-grad-reduce), the
  distributed optimizer (ZeRO-1, and ZeRO-2 with overlap), TP2, PP2 and FSDP2
  follows the fp32 run's losses to fp16 tolerance (stated: relative 1e-3 over 6 steps;
  measured 6e-6 on this tiny model);
* a huge initial loss scale overflows: those steps are skipped on every rank (parameters
  and Adam state unchanged, the lr schedule does not advance), the scale backs off as
  Megatron-Core's ``DynamicGradScaler`` does, and then the model trains;
* a checkpoint carries the scaler state and the skipped samples: the resumed run repeats
  the uninterrupted one's losses, scales and lrs;
* the batch-size ramp gives the same losses under DP1, DP2 and PP2, the batch of each step
  is the ramp's, and a resume mid-ramp continues it."""
import torch
import torch.distributed as torch_dist

from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)
from megalite.cli.arguments import parse_args
from megalite.optimizer import LRScheduler
from megalite.optimizer.grad_scaler import DynamicGradScaler

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--eval-iters", "0", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
        "--global-batch-size", "4", "--micro-batch-size", "2"]
STATIC = ["--fp16", "--loss-scale", "4096"]
FP16_TOL = 1e-3


def _trainer(world, argv):
    return build_cpu_trainer([*BASE, *argv], world)


def _run(world, argv, iters, watch=False):
    """Per-step records of a run on ``world`` ranks (rank 0 alone when world is 1);
    ``watch``: also whether each step changed this rank's parameters and Adam state."""
    if world == 1 and torch_dist.get_rank() != 0:
        return None
    trainer = _trainer(world, argv)
    it = trainer.data_iterator(trainer.train_ds, trainer.consumed_samples)
    out = []
    for _ in range(iters):
        before = [p.detach().clone() for c in trainer.model_chunks for p in c.parameters()]
        steps = _adam_steps(trainer)
        rec = trainer.train_step(it)
        if watch:
            after = [p.detach() for c in trainer.model_chunks for p in c.parameters()]
            rec["params_changed"] = any(not torch.equal(a, b) for a, b in zip(before, after))
            rec["adam_steps"] = (steps, _adam_steps(trainer))
        out.append(rec)
    return out


def _adam_steps(trainer):
    return sorted({float(s["step"]) for s in trainer.optimizer.inner.state.values()})


def _saved_and_resumed(root):
    """fp16 with overflows (dynamic scale) + distributed optimizer: 6 steps straight,
    saving after 3; then a resume from 3 for 3 more."""
    flags = ["--fp16", "--initial-loss-scale", str(2.0 ** 22), "--loss-scale-window", "2",
             "--use-distributed-optimizer", "--train-iters", "6"]
    trainer = _trainer(2, [*flags, "--save", root])
    it = trainer.data_iterator(trainer.train_ds, 0)
    straight = []
    for i in range(6):
        straight.append(trainer.train_step(it))
        if i == 2:
            trainer.save()
            saved_state = trainer.loop_state()
    resumed_trainer = _trainer(2, [*flags, "--load", root])
    assert resumed_trainer.iteration == 3 and resumed_trainer.loop_state() == saved_state
    it = resumed_trainer.data_iterator(resumed_trainer.train_ds, 12)
    resumed = [resumed_trainer.train_step(it) for _ in range(3)]
    return straight, resumed, saved_state


def _ramp_runs(root):
    ramp = ["--rampup-batch-size", "4", "4", "20", "--global-batch-size", "12",
            "--micro-batch-size", "2", "--train-samples", "60"]
    out = {"dp1": _run(1, ramp, 7), "dp2": _run(2, ramp, 7),
           "pp2": _run(2, [*ramp, "--pipeline-model-parallel-size", "2"], 7)}
    trainer = _trainer(2, [*ramp, "--save", root])
    assert trainer.train_iters == 7      # 4, 4, 4, 8, 12 (consumed 32 > 20), then 2 x 12
    it = trainer.data_iterator(trainer.train_ds, 0)
    for _ in range(3):
        trainer.train_step(it)
    trainer.save()
    resumed = _trainer(2, [*ramp, "--load", root])
    it = resumed.data_iterator(resumed.train_ds, resumed.consumed_samples)
    out["resumed"] = (resumed.consumed_samples, [resumed.train_step(it) for _ in range(4)])
    return out


def _all(root):
    out = {"fp32": _run(1, ["--train-iters", "6"], 6)}
    for name, flags in {"dp2": [], "distopt": ["--use-distributed-optimizer"],
                        "tp2": ["--tensor-model-parallel-size", "2"],
                        "pp2": ["--pipeline-model-parallel-size", "2"],
                        "fsdp2": ["--use-torch-fsdp2"],
                        "overlap": ["--overlap-grad-reduce"],
                        "zero2": ["--use-distributed-optimizer", "--overlap-grad-reduce"]
                        }.items():
        out[name] = _run(2, [*STATIC, "--train-iters", "6", *flags], 6)
    out["overflow"] = _run(2, ["--fp16", "--initial-loss-scale", str(2.0 ** 24),
                               "--loss-scale-window", "3", "--train-iters", "12"], 12,
                           watch=True)
    out["resume"] = _saved_and_resumed(f"{root}/fp16")
    out["ramp"] = _ramp_runs(f"{root}/ramp")
    return out


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _losses(records):
    return [r["lm_loss"] for r in records]


def test_fp16_and_rampup(dist, tmp_path):
    results = dist.run(2, _all, str(tmp_path))
    r0, last = results[0], results[-1]          # PP2: the last stage holds the loss
    ref = _losses(r0["fp32"])
    for name in ("dp2", "distopt", "tp2", "fsdp2", "overlap", "zero2"):
        for r in results:
            assert _rel(_losses(r[name]), ref) < FP16_TOL, (name, _losses(r[name]), ref)
            assert all(rec["loss_scale"] == 4096 and rec["skipped_iter"] == 0
                       for rec in r[name])
    assert _rel(_losses(last["pp2"]), ref) < FP16_TOL, (_losses(last["pp2"]), ref)

    # overflow: skipped on both ranks alike; scale sequence as DynamicGradScaler's
    for r in results:
        recs = r["overflow"]
        skipped = [rec["skipped_iter"] for rec in recs]
        assert skipped == [rec["skipped_iter"] for rec in r0["overflow"]]
        assert skipped[:3] == [1, 1, 1] and sum(skipped[-5:]) < 5, skipped
        oracle = DynamicGradScaler(2.0 ** 24, 1.0, 3, 2)
        for rec, s in zip(recs, skipped):
            oracle.update(bool(s))
            assert rec["loss_scale"] == oracle.scale
            if s:     # untouched: parameters, Adam steps; no grad norm
                assert not rec["params_changed"] and rec["grad_norm"] is None
                assert rec["adam_steps"][0] == rec["adam_steps"][1]
            else:     # (the first update runs at the warm-up's lr 0)
                assert rec["params_changed"] == (rec["lr"] > 0) and rec["grad_norm"] > 0
        assert sum(1 for rec in recs if rec["params_changed"]) >= 3     # then it trains
        first_update = skipped.index(0)        # the lr schedule did not advance meanwhile
        assert recs[first_update]["lr"] == recs[0]["lr"]
        assert all(0 < rec["lm_loss"] < 10 for rec in recs)   # (mock tokens: no trend)

    # checkpoint: scaler state and skipped samples carried over
    for r in results:
        straight, resumed, saved = r["resume"]
        assert saved["grad_scaler"]["scale"] == straight[2]["loss_scale"]
        assert saved["skipped_samples"] == 4 * sum(x["skipped_iter"] for x in straight[:3])
        for a, b in zip(straight[3:], resumed):
            assert (a["loss_scale"], a["skipped_iter"], a["lr"]) == \
                (b["loss_scale"], b["skipped_iter"], b["lr"])
            assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-6 * abs(a["lm_loss"])
    assert any(x["skipped_iter"] for x in r0["resume"][0]), "the resume row saw no overflow"

    # batch-size ramp (PP2: 2, 2, 2, 4, 6, ... micro-batches through the 1F1B schedule)
    ramp = r0["ramp"]
    assert _rel(_losses(last["ramp"]["pp2"]), _losses(ramp["dp1"])) < 1e-5
    sizes = [rec["global_batch_size"] for rec in ramp["dp1"]]
    assert sizes == [4, 4, 4, 8, 12, 12, 12]     # START + int(consumed / 10) x 4
    cfg = parse_args(["--world-size", "1", *BASE, "--rampup-batch-size", "4", "4", "20",
                      "--global-batch-size", "12", "--train-samples", "60"])
    sched = LRScheduler.from_config(cfg, 7)      # the lr of step i: at the samples before it
    consumed = [sum(sizes[:i]) for i in range(7)]
    assert [rec["lr"] for rec in ramp["dp1"]] == [sched.lr_at(c) for c in consumed]
    for r in results:
        assert [rec["global_batch_size"] for rec in r["ramp"]["dp2"]] == sizes
        assert _rel(_losses(r["ramp"]["dp2"]), _losses(ramp["dp1"])) < 1e-5
        assert [rec["global_batch_size"] for rec in r["ramp"]["pp2"]] == sizes
        consumed, recs = r["ramp"]["resumed"]
        assert consumed == 12 and [rec["global_batch_size"] for rec in recs] == sizes[3:]
        assert _rel(_losses(recs), _losses(ramp["dp1"])[3:]) < 1e-5
