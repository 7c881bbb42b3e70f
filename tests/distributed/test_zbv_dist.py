"""ZB-V (``--pipeline-schedule zbv``) equals the single-process run: the real ``Trainer``
over 2 iterations, losses and gradient norms within fp32 tolerances (rel 1e-5 at step 1,
1e-4 after), one 4-rank launch per configuration on the pool's ranks.

ZB-V runs in the same V as DualPipeV (2 chunks per rank, both ends on pp rank 0) with the
same B / W split, so it takes DualPipeV's configurations (test_dualpipe_dist.py) with the
schedule swapped: every feature the table lets ZB-V combine with is run with it
(``megalite.cli.features.COVERAGE`` names these ids): PP 4 with full recompute, PP 2 with
TP 2 and selective recompute, MoE at EP 2, FSDP2, CP with tied embeddings.  The
``--compile`` case is the long tier (tests/conftest.py; DualPipeV's twin runs by default).
"""
import pytest
import torch.distributed as torch_dist

import test_dualpipe_dist as dv
import test_feature_pairs_dist as pairs
from megalite.cli import features

ZBV = ["--pipeline-schedule", "zbv"]
CASES = ("pp4-full-distopt", "tp2-pp2-account-fused-selective", "moe-ep2-pp2-ddp-overlap-attn",
         "moe-cp2-a2a-pp2-etp2-allgather-fsdp2", "fsdp2-hsdp-pp2-full-compile-tied",
         "cp2-pp2-full-tied")
CONFIGS = {name: (dv.CONFIGS[name][0], [a for a in dv.CONFIGS[name][1] if a not in dv.DV] + ZBV)
           for name in CASES}


def _run_one(name):
    model, flags = CONFIGS[name]
    backend, pairs.compile_mod.BACKEND = pairs.compile_mod.BACKEND, "aot_eager"
    try:
        cfg = pairs._config(model, flags, False, False, pairs.WORLD)
        return pairs._train(cfg, pairs.WORLD, torch_dist.get_rank())
    finally:
        pairs.compile_mod.BACKEND = backend


@pytest.fixture(scope="module")
def references():
    return {}      # filled per model on first use (a run of one case needs one)


def _reference(references, model):
    key = next(k for k, m in dv._MODELS.items() if m is model)
    if key not in references:
        references[key] = pairs._train(pairs._config(model, [], False, False, 1), 1, 0)
    return references[key]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zbv_matches_single_process(dist, references, name):
    ref = _reference(references, CONFIGS[name][0])
    got = next(r for r in dist.run(pairs.WORLD, _run_one, name) if r["writer"])
    declared = features.COVERAGE[f"tests/distributed/test_zbv_dist.py::"
                                 f"test_zbv_matches_single_process[{name}]"]
    assert "pp-zbv" in got["features"]
    assert sorted(got["features"]) == sorted(declared), (got["features"], declared)
    for key in ("loss", "norm"):
        assert pairs._close(got[key][:1], ref[key][:1], 1e-5), (key, got[key], ref[key])
        assert pairs._close(got[key], ref[key], 1e-4), (key, got[key], ref[key])
