"""The feature pairs no other equivalence test runs, run together: each configuration turns
on many features at once (every two of them are a covered pair of the feature table,
``megalite.cli.features.COVERAGE``) and its losses and gradient norms over 3 iterations equal
the single-process run's (fp32: rel 1e-5 at step 1, 1e-4 after).

* the features a configuration turns on are read from its parsed flags by the table itself
  and must be exactly the ones COVERAGE declares for it;
* ``--compile`` runs with torch.compile's ``aot_eager`` backend here: dynamo and
  AOTAutograd build the graph every backend receives (one joint forward/backward per layer,
  which is what could upset recompute, FSDP2 or zero bubble's B/W split), without
  inductor's C++ codegen (whose kernels tests/unit/test_te_backend_cuda_path.py checks);
* ``te`` configurations build Transformer Engine's layer spec through tests/te_fake.py (TE's
  constructor contract and parameter names, local math) -- the wiring of TE and FP8 into
  pipelines, experts and data-parallel strategies; TE's kernels are tests/gpu's.

One 4-rank launch per configuration (the ranks are reused); the references run once, in
the parent.
"""
import dataclasses

import pytest
import torch.distributed as torch_dist

import te_fake
from megalite.cli import features
from megalite.cli.arguments import parse_args
from megalite.backends import compile as compile_mod
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training.loop import Trainer

WORLD, ITERS = 4, 2
DENSE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--seq-length", "8",
         "--ffn-hidden-size", "32", "--vocab-size", "64", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--mock-data", "--lr", "3e-3",
         "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
         "--global-batch-size", "4", "--micro-batch-size", "1", "--eval-iters", "0",
         "--lr-warmup-iters", "1", "--clip-grad", "1.0"]
MOE = DENSE + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
               "--moe-aux-loss-coeff", "1e-2"]
TP2, PP2, CP2 = ["--tp", "2", "--sequence-parallel"], ["--pp", "2"], ["--cp", "2"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
ACCOUNT = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "1"]
ZB, A2A = ["--pipeline-schedule", "zero-bubble"], ["--cp-comm-type", "a2a"]
DO = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
      "--ddp-bucket-size", "1000"]
OGR = ["--overlap-grad-reduce", "--ddp-bucket-size", "1000"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
SEL = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"]
FUSED = ["--cross-entropy-loss-fusion", "--cross-entropy-chunk-tokens", "5"]
COMPILE = ["--compile"]
ETP2, EP2 = ["--expert-tensor-parallel-size", "2"], ["--ep", "2"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
FSDP2 = ["--use-torch-fsdp2"]
HSDP = ["--num-distributed-optimizer-instances", "2"]
SEL_ATTN = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]

# name: (model, flags, through the TE spec (te_fake), with FP8) -- a greedy cover of the
# pairs no other equivalence test runs
CONFIGS = {
    "moe-te-fp8-tp2-cp2-ep2-distopt-fused": (MOE, TP2 + CP2 + DO + FUSED + EP2, True, True),
    "moe-te-cp2-a2a-pp2-account-etp2-allgather-distopt-selective-fused": (
        MOE, CP2 + PP2 + ACCOUNT + A2A + DO + SEL + FUSED + ETP2 + ALLGATHER, True, False),
    "moe-cp2-a2a-zb-uneven-ep2-distopt-attn-fused": (   # zero bubble: no MoE recompute
        MOE, CP2 + PP2 + ZB + UNEVEN + A2A + DO + SEL_ATTN + FUSED + EP2, False, False),
    "moe-te-fp8-tp2-pp2-uneven-etp2-allgather-distopt": (
        MOE, TP2 + PP2 + UNEVEN + DO + ETP2 + ALLGATHER, True, True),
    "moe-cp2-vpp2-etp2-allgather-distopt-full-fused": (
        MOE, CP2 + PP2 + VPP2 + DO + FULL + FUSED + ETP2 + ALLGATHER, False, False),
    "moe-cp2-zb-account-etp2-ddp-overlap-attn-fused": (
        MOE, CP2 + PP2 + ZB + ACCOUNT + OGR + SEL_ATTN + FUSED + ETP2, False, False),
    "moe-te-cp2-a2a-vpp2-ep2-ddp-overlap-full": (
        MOE, CP2 + PP2 + VPP2 + A2A + OGR + FULL + EP2, True, False),
    "moe-zb-account-ep2-allgather-distopt": (
        MOE, PP2 + ZB + ACCOUNT + DO + EP2 + ALLGATHER, False, False),
    "moe-cp2-pp2-uneven-selective-fused": (MOE, CP2 + PP2 + UNEVEN + SEL + FUSED, False, False),
    "fsdp2-tp2-overlap-full-fused": (DENSE, TP2 + FSDP2 + OGR + FULL + FUSED, False, False),
    # FSDP2 (composes with PP, CP, EP: issue 26) and hybrid sharding (2 instances)
    "moe-fsdp2-cp2-a2a-pp2-uneven-etp2-allgather": (
        MOE, FSDP2 + CP2 + A2A + PP2 + UNEVEN + ETP2 + ALLGATHER, False, False),
    "moe-fsdp2-hsdp-zb-account-attn": (MOE, FSDP2 + HSDP + PP2 + ZB + ACCOUNT + SEL_ATTN, False,
                                       False),
    "hsdp-te-fp8-tp2-distopt-fused": (DENSE, TP2 + DO + HSDP + FUSED, True, True),
    "moe-hsdp-cp2-a2a-ep2-allgather-distopt-full": (
        MOE, CP2 + A2A + EP2 + ALLGATHER + DO + HSDP + FULL, False, False),
    "moe-hsdp-cp2-etp2-distopt": (MOE, CP2 + ETP2 + DO + HSDP, False, False),
    "hsdp-fsdp2-vpp2": (DENSE, FSDP2 + HSDP + PP2 + VPP2, False, False),
    "hsdp-pp2-uneven-distopt-full": (DENSE, DO + HSDP + PP2 + UNEVEN + FULL, False, False),
    "te-fp8-cp2-a2a-pp2-fused": (DENSE, CP2 + A2A + PP2 + FUSED, True, True),
    # --compile (dense: the table refuses it with MoE and with CP a2a) with every other feature
    "te-fp8-tp2-pp2-account-distopt-fused-compile": (
        DENSE, TP2 + PP2 + ACCOUNT + DO + FUSED + COMPILE, True, True),
    "fsdp2-hsdp-overlap-selective-fused-compile": (
        DENSE, FSDP2 + HSDP + OGR + SEL + FUSED + COMPILE, False, False),
    "cp2-zb-uneven-full-compile": (DENSE, CP2 + PP2 + ZB + UNEVEN + FULL + COMPILE, False, False),
    "te-fp8-vpp2-compile": (DENSE, PP2 + VPP2 + COMPILE, True, True),
}


def _config(model, flags, te, fp8, world):
    cfg = parse_args(["--world-size", str(world), *model, *flags])
    if te:   # a CPU run refuses TE and FP8 (no GPU): set them after parsing, ask the table
        m = dataclasses.replace(cfg.model, transformer_impl="transformer_engine",
                                fp8_format="hybrid" if fp8 else None)
        cfg = dataclasses.replace(cfg, model=m)
        assert features.refusal(cfg) is None, features.refusal(cfg)
    return cfg


def _train(cfg, world: int, rank: int) -> dict:
    state = ParallelState.build(RankGrid.from_config(cfg), rank, create_groups=world > 1)
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    it = trainer.data_iterator(trainer.train_ds, 0)
    rows = [trainer.train_step(it) for _ in range(ITERS)]
    return dict(writer=trainer.is_writer or world == 1, loss=[r["lm_loss"] for r in rows],
                norm=[r["grad_norm"] for r in rows], features=features.active(cfg))


def _run_one(name):
    """One configuration on the pool's ranks (one launch per configuration keeps each
    well inside the pool's deadline on a loaded machine)."""
    model, flags, te, fp8 = CONFIGS[name]
    rank = torch_dist.get_rank()
    backend, compile_mod.BACKEND = compile_mod.BACKEND, "aot_eager"
    try:
        cfg = _config(model, flags, te, fp8, WORLD)
        if te:
            with te_fake.installed():
                return _train(cfg, WORLD, rank)
        return _train(cfg, WORLD, rank)
    finally:
        compile_mod.BACKEND = backend


@pytest.fixture(scope="module")
def references():
    return {"dense": _train(_config(DENSE, [], False, False, 1), 1, 0),
            "moe": _train(_config(MOE, [], False, False, 1), 1, 0)}


def _close(a, b, tol):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_combination_matches_single_process(dist, references, name):
    model = CONFIGS[name][0]
    ref = references["moe" if model is MOE else "dense"]
    got = next(r for r in dist.run(WORLD, _run_one, name) if r["writer"])
    declared = features.COVERAGE[f"{features.PAIRS_TEST}[{name}]"]
    assert sorted(got["features"]) == sorted(declared), (got["features"], declared)
    for key in ("loss", "norm"):
        assert _close(got[key][:1], ref[key][:1], 1e-5), (key, got[key], ref[key])
        assert _close(got[key], ref[key], 1e-4), (key, got[key], ref[key])
