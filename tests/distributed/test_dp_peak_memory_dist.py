"""Issue 12's measured peak memory at DP = 2 on gloo ranks: the peak of live CPU tensor bytes
of a training step (tensor meter, started before the model is built; the third step, after
ZeRO-2 has learnt when each bucket is complete), per rank, for DDP, ZeRO-1, ZeRO-2 and FSDP2.

Each peak is within 10% of ``planner.step_peak`` for the exact layout; the peaks fall
DDP > ZeRO-1 > ZeRO-2 > FSDP2, and each saving is within 25% of the predicted saving
(ZeRO-1 drops half the optimizer states, ZeRO-2 keeps half the gradient and reduces bucket
by bucket, FSDP2 shards the weights).  One ``dist.run``."""
import torch.distributed as torch_dist

from megalite.cli.arguments import parse_args
from megalite.parallel_state import ParallelState, RankGrid
from megalite.planner.step_peak import predict_step_peak
from megalite.training.loop import Trainer
from megalite.training.tensor_memory_meter import TensorMemoryMeter

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "256", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--mock-data", "--lr", "1e-3",
         "--train-iters", "10", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--eval-iters", "0", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--ddp-bucket-size", "20000"]
STRATEGIES = {"DDP": [], "ZeRO-1": ["--use-distributed-optimizer"],
              "ZeRO-2": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
              "FSDP2": ["--use-torch-fsdp2"]}
ORDER = list(STRATEGIES)


def _peaks(world):
    out = {}
    for name, flags in STRATEGIES.items():
        meter = TensorMemoryMeter().start()
        try:
            cfg = parse_args(["--world-size", str(world), *MODEL, *flags])
            state = ParallelState.build(RankGrid(world), torch_dist.get_rank())
            trainer = Trainer(cfg, state, "cpu")
            trainer.setup()
            it = trainer.data_iterator(trainer.train_ds, 0)
            for i in range(3):
                with meter.window(str(i + 1)):
                    trainer.train_step(it)
        finally:
            result = meter.stop()
        out[name] = (result.windows["3"].peak_bytes,
                     predict_step_peak(trainer.cfg, state.rank)["total"])
    return out


def test_peak_memory_per_strategy_at_dp2(dist):
    for rank, peaks in enumerate(dist.run(2, _peaks, 2)):
        for name, (measured, predicted) in peaks.items():
            assert 0.9 <= measured / predicted <= 1.1, (rank, name, measured, predicted)
        meas = [peaks[n][0] for n in ORDER]
        pred = [peaks[n][1] for n in ORDER]
        assert meas == sorted(meas, reverse=True) and len(set(meas)) == 4, (rank, meas)
        for a, b in zip(range(3), range(1, 4)):
            saved, want = meas[a] - meas[b], pred[a] - pred[b]
            assert abs(saved - want) <= 0.25 * want, (rank, ORDER[a], ORDER[b], saved, want)
