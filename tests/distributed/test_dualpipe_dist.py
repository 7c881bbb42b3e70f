"""DualPipeV (``--pipeline-schedule dualpipev``) equals the single-process run: the real
``Trainer`` over 2 iterations, losses and gradient norms within fp32 tolerances (rel 1e-5
at step 1, 1e-4 after), one 4-rank launch per configuration on the pool's ranks.

The configurations turn on many features at once (PP 2 and PP 4, dense and MoE with EP 2,
tied embeddings (both ends on pp rank 0, one parameter) with FSDP2 and with CP,
full and selective recompute, FSDP2 and HSDP, the distributed optimizer, CP, TP + SP, the
embedding and loss counted in the split, the fused loss, compile), so that every feature
the table lets DualPipeV combine with is run with it (``megalite.cli.features.COVERAGE``
names these ids).  DualPipeV needs at least 2 x PP micro-batches per step, hence a global
batch of 8; the references run once per model in the parent.
"""
import pytest
import torch.distributed as torch_dist

import test_feature_pairs_dist as pairs
from megalite.cli import features

DV, GBS = ["--pipeline-schedule", "dualpipev"], ["--global-batch-size", "8"]
PP4 = ["--pp", "4"]
DENSE, MOE = pairs.DENSE + GBS, pairs.MOE + GBS
TIED = [a for a in DENSE if a != "--untie-embeddings-and-output-weights"]
DENSE8 = DENSE + ["--num-layers", "8"]          # 2 x PP4 chunks of one layer
DENSE6 = DENSE + ["--num-layers", "6"]          # + embedding + loss = 2 x PP2 chunks of 2
P = pairs
CONFIGS = {
    "pp4-full-distopt": (DENSE8, PP4 + DV + P.FULL + P.DO),
    "tp2-pp2-account-fused-selective": (DENSE6, P.TP2 + P.PP2 + DV + P.ACCOUNT + P.FUSED +
                                        P.SEL),
    "moe-ep2-pp2-ddp-overlap-attn": (MOE, P.EP2 + P.PP2 + DV + P.OGR + P.SEL_ATTN),
    "moe-cp2-a2a-pp2-etp2-allgather-fsdp2": (MOE, P.CP2 + P.A2A + P.PP2 + DV + P.ETP2 +
                                             P.ALLGATHER + P.FSDP2),
    "fsdp2-hsdp-pp2-full-compile-tied": (TIED, P.FSDP2 + P.HSDP + P.PP2 + DV + P.FULL +
                                         P.COMPILE),
    # and a --pipeline-model-parallel-layout: chunks of 2, 1, 1, 0 layers along the V
    "cp2-pp2-full-tied": (TIED, P.CP2 + P.PP2 + DV + P.FULL +
                          ["--pipeline-model-parallel-layout", "Ett|t|t|L"]),
}
# PP 4 x EP 2 needs 8 ranks (long tier: it repeats PP 4 and EP 2 of the launches above)
MOE8 = pairs.MOE + ["--num-layers", "8", "--global-batch-size", "16"]
CONFIGS8 = {"moe-pp4-ep2-attn": (MOE8, PP4 + DV + P.EP2 + P.SEL_ATTN)}
_MODELS = {"dense": DENSE, "dense8": DENSE8, "dense6": DENSE6, "moe": MOE, "tied": TIED}


def _run_one(name, world=pairs.WORLD):
    model, flags = {**CONFIGS, **CONFIGS8}[name]
    backend, pairs.compile_mod.BACKEND = pairs.compile_mod.BACKEND, "aot_eager"
    try:
        cfg = pairs._config(model, flags, False, False, world)
        return pairs._train(cfg, world, torch_dist.get_rank())
    finally:
        pairs.compile_mod.BACKEND = backend


@pytest.fixture(scope="module")
def references():
    return {key: pairs._train(pairs._config(model, [], False, False, 1), 1, 0)
            for key, model in _MODELS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dualpipev_matches_single_process(dist, references, name):
    model = CONFIGS[name][0]
    ref = references[next(k for k, m in _MODELS.items() if m is model)]
    got = next(r for r in dist.run(pairs.WORLD, _run_one, name) if r["writer"])
    declared = features.COVERAGE[f"tests/distributed/test_dualpipe_dist.py::"
                                 f"test_dualpipev_matches_single_process[{name}]"]
    assert "pp-dualpipev" in got["features"]
    assert sorted(got["features"]) == sorted(declared), (got["features"], declared)
    for key in ("loss", "norm"):
        assert pairs._close(got[key][:1], ref[key][:1], 1e-5), (key, got[key], ref[key])
        assert pairs._close(got[key], ref[key], 1e-4), (key, got[key], ref[key])


def test_dualpipev_pp4_moe_ep2_on_8_ranks(dist):
    ref = pairs._train(pairs._config(MOE8, [], False, False, 1), 1, 0)
    got = next(r for r in dist.run(8, _run_one, "moe-pp4-ep2-attn", 8) if r["writer"])
    assert {"pp-dualpipev", "ep", "moe"} <= set(got["features"])
    for key in ("loss", "norm"):
        assert pairs._close(got[key][:1], ref[key][:1], 1e-5), (key, got[key], ref[key])
        assert pairs._close(got[key], ref[key], 1e-4), (key, got[key], ref[key])


# --overlap-moe-expert-parallel-comm: the overlapped F&B execution (comm/overlap.py) of
# DualPipeV's pairs and of combined 1F1B, against the same single-process references; each
# rank must have handed over between paired halves (the overlap really ran)
OVERLAP, DELAY = ["--overlap-moe-expert-parallel-comm"], ["--delay-wgrad-compute"]
OVERLAP_CONFIGS = {
    "moe-ep2-pp2-dualpipev-overlap-delay-attn": (MOE, P.EP2 + P.PP2 + DV + OVERLAP + DELAY +
                                                 P.SEL_ATTN),
    "moe-ep2-pp2-1f1b-overlap-full": (MOE, P.EP2 + P.PP2 + OVERLAP + P.FULL),
    "dense-pp4-1f1b-overlap-delay": (DENSE8, PP4 + OVERLAP + DELAY),
    "dense-pp4-dualpipev-overlap-full": (DENSE8, PP4 + DV + OVERLAP + P.FULL),
    "moe-ep2-pp2-1f1b-overlap-fsdp2": (MOE, P.EP2 + P.PP2 + OVERLAP + P.FSDP2),
    "moe-ep2-pp2-dualpipev-overlap-fsdp2": (MOE, P.EP2 + P.PP2 + DV + OVERLAP + P.FSDP2),
    # PP 1: F(i) beside BW(i-1), with the distributed optimizer's overlapped reduce
    "moe-ep2-overlap-distopt": (MOE, P.EP2 + OVERLAP + P.DO),
}


def _run_overlap(name):
    from megalite.comm import overlap
    model, flags = OVERLAP_CONFIGS[name]
    overlap.stats["switches"] = 0
    got = pairs._train(pairs._config(model, flags, False, False, pairs.WORLD), pairs.WORLD,
                       torch_dist.get_rank())
    return dict(got, switches=overlap.stats["switches"])


@pytest.mark.parametrize("name", list(OVERLAP_CONFIGS))
def test_overlapped_f_and_b_matches_single_process(dist, references, name):
    model = OVERLAP_CONFIGS[name][0]
    ref = references[next(k for k, m in _MODELS.items() if m is model)]
    results = dist.run(pairs.WORLD, _run_overlap, name)
    got = next(r for r in results if r["writer"])
    if model is MOE:        # dense has no all-to-all: its pairs overlap the p2p only
        assert all(r["switches"] > 0 for r in results), [r["switches"] for r in results]
    for key in ("loss", "norm"):
        assert pairs._close(got[key][:1], ref[key][:1], 1e-5), (key, got[key], ref[key])
        assert pairs._close(got[key], ref[key], 1e-4), (key, got[key], ref[key])


OVERLAP_CONFIGS8 = {"moe-pp4-ep2-1f1b-overlap": (MOE8, PP4 + P.EP2 + OVERLAP),
                    "moe-pp4-ep2-dualpipev-overlap-delay": (MOE8, PP4 + DV + P.EP2 + OVERLAP +
                                                            DELAY)}


def _run_overlap8(name):
    from megalite.comm import overlap
    model, flags = OVERLAP_CONFIGS8[name]
    overlap.stats["switches"] = 0
    got = pairs._train(pairs._config(model, flags, False, False, 8), 8, torch_dist.get_rank())
    return dict(got, switches=overlap.stats["switches"])


@pytest.mark.parametrize("name", list(OVERLAP_CONFIGS8))
def test_overlapped_f_and_b_pp4_moe_ep2_on_8_ranks(dist, name):
    """Long tier: PP 4 x EP 2 on 8 ranks; the default tier shows the same at EP 2 x PP 2
    (MoE) and PP 4 (dense), test_overlapped_f_and_b_matches_single_process."""
    ref = pairs._train(pairs._config(MOE8, [], False, False, 1), 1, 0)
    results = dist.run(8, _run_overlap8, name)
    got = next(r for r in results if r["writer"])
    assert all(r["switches"] > 0 for r in results), [r["switches"] for r in results]
    for key in ("loss", "norm"):
        assert pairs._close(got[key][:1], ref[key][:1], 1e-5), (key, got[key], ref[key])
        assert pairs._close(got[key], ref[key], 1e-4), (key, got[key], ref[key])
