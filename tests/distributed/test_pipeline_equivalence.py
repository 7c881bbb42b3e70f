"""Pipelined training steps equal the single-process model (fp32, rel <= 1e-5).

Every layout runs in ONE 4-rank launch; the parent builds the reference (same name-seeded
init, whole global batch) and compares the loss on the last stage and every parameter's
gradient after TP unsharding, including both copies of a tied embedding.
"""
import pytest
import torch
import torch.distributed as torch_dist

from pipeline_cases import compare, run_case_on_rank

WORLD = 4
CASES = {
    "pp4-m4-gpt2": dict(pp=4, m=4),
    "pp4-m6-llama": dict(pp=4, m=6, arch="llama"),
    "pp4-m2-fewer-mb-than-stages": dict(pp=4, m=2),
    "pp2-dp2-m3": dict(pp=2, m=3),
    "pp2-uneven-1+3": dict(pp=2, m=2, first=1, layers=4),
    "pp4-uneven-first1-last1": dict(pp=4, m=4, first=1, last=1, layers=6),
    "vpp2-pp2-dp2-m4": dict(pp=2, vpp=2, m=4),
    "vpp2-pp4-m8-llama": dict(pp=4, vpp=2, m=8, layers=8, arch="llama"),
    "vpp2-pp4-m4": dict(pp=4, vpp=2, m=4, layers=8),
    "zb-pp2-dp2-m4": dict(pp=2, m=4, schedule="zero-bubble"),
    "zb-pp4-m8-gpt2": dict(pp=4, m=8, schedule="zero-bubble"),
    "zb-pp4-m3-llama": dict(pp=4, m=3, schedule="zero-bubble", arch="llama"),
    "tp2-pp2-m4": dict(tp=2, pp=2, m=4),
    "tp2-pp2-sp-m3-llama": dict(tp=2, pp=2, sp=True, m=3, arch="llama"),
    "tp2-pp2-vpp2-sp-m4": dict(tp=2, pp=2, vpp=2, sp=True, m=4),
    "tp2-pp2-zb-sp-m4": dict(tp=2, pp=2, sp=True, m=4, schedule="zero-bubble"),
    "pp2-full-uniform2-m3": dict(pp=2, m=3, recompute=("full", "uniform", 2, None)),
    "pp4-full-block1-llama": dict(pp=4, m=4, arch="llama", recompute=("full", "block", 1, None)),
    "pp2-selective-all": dict(pp=2, m=2, recompute=("selective", None, 1,
                                                    ("core_attn", "mlp", "layernorm"))),
    "vpp2-pp2-selective-mlp": dict(pp=2, vpp=2, m=2, recompute=("selective", None, 1, ("mlp",))),
    "tp2-pp2-sp-selective-attn": dict(tp=2, pp=2, sp=True, m=2, arch="llama",
                                      recompute=("selective", None, 1, ("core_attn",))),
    "tp2-pp2-sp-full-uniform1": dict(tp=2, pp=2, sp=True, m=2,
                                     recompute=("full", "uniform", 1, None)),
    "zb-pp2-full-block1": dict(pp=2, m=4, schedule="zero-bubble",
                               recompute=("full", "block", 1, None)),
    # ZB's W re-gathers SP's saved sequence shards (and re-runs the checkpointed layers)
    "tp2-pp2-zb-sp-full-uniform1-llama": dict(tp=2, pp=2, sp=True, m=3, arch="llama",
                                              schedule="zero-bubble",
                                              recompute=("full", "uniform", 1, None)),
    # --account-for-embedding/loss-in-pipeline-split: 6 + 2 = 8 slots as [0] [1,2] [3,4] [5].
    "account-both-vpp2-pp2-dp2": dict(pp=2, vpp=2, m=4, layers=6, emb=True, loss=True),
    "account-loss-pp4-m4": dict(pp=4, m=4, layers=7, loss=True),
    "account-emb-tp2-pp2-vpp2-sp-llama": dict(tp=2, pp=2, vpp=2, sp=True, m=4, layers=7,
                                              emb=True, arch="llama"),
    # One slot per (virtual) stage: chunks of only the embedding / only the loss (Llama 3).
    "account-both-vpp4-pp2-dp2-1-per-chunk": dict(pp=2, vpp=4, m=4, layers=6, emb=True,
                                                  loss=True),
    "account-both-zb-pp4-empty-ends": dict(pp=4, m=4, layers=2, emb=True, loss=True,
                                           schedule="zero-bubble"),
    "account-loss-tp2-pp2-vpp2-sp-full-llama": dict(tp=2, pp=2, vpp=2, sp=True, m=2, layers=3,
                                                    loss=True, arch="llama",
                                                    recompute=("full", "uniform", 1, None)),
    # --pipeline-model-parallel-layout: unequal chunks, an end stage with no transformer layer
    "layout-vpp2-pp2-1-2-2-0": dict(pp=2, m=4, layers=5, layout="Et|tt|tt|L"),
}
for c in CASES.values():
    c["world"] = WORLD


def _run_all(cases):
    rank = torch_dist.get_rank()
    return {name: run_case_on_rank(case, rank, WORLD) for name, case in cases.items()}


@pytest.fixture(scope="module")
def results(dist):
    return dist.run(WORLD, _run_all, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_single_process(results, name):
    compare([r[name] for r in results], CASES[name])


# ---------------------------------------------------------------------------------------------
DROPOUT_LAYOUT = dict(tp=2, pp=2, sp=True, m=2, arch="llama", world=WORLD)
RECOMPUTES = {"full-uniform": ("full", "uniform", 1, None),
              "full-block": ("full", "block", 1, None),
              "selective-all": ("selective", None, 1, ("core_attn", "mlp", "layernorm"))}


def _dropout_runs(layout, recomputes):
    """Same layout and seeds with dropout on: grads with and without recompute."""
    import pipeline_cases as pc

    rank = torch_dist.get_rank()
    saved = pc.model_kwargs

    def with_dropout(*a, **k):
        kw = saved(*a, **k)
        kw.update(hidden_dropout=0.2, attention_dropout=0.2)
        return kw
    pc.model_kwargs = with_dropout
    try:
        out = {"none": pc.run_case_on_rank(layout, rank, WORLD)["grads"]}
        for name, rc in recomputes.items():
            out[name] = pc.run_case_on_rank(dict(layout, recompute=rc), rank, WORLD)["grads"]
    finally:
        pc.model_kwargs = saved
    return out


def test_recompute_reproduces_dropout_masks_tp_sp_pp(dist):
    """Recomputed dropout (default generator and TP tracker, inside the SP fork) must draw
    the masks of the original forward: grads equal the no-recompute run."""
    per_rank = dist.run(WORLD, _dropout_runs, DROPOUT_LAYOUT, RECOMPUTES)
    for grads in per_rank:
        for name in RECOMPUTES:
            for key, (_, g, _) in grads["none"].items():
                other = grads[name][key][1]
                assert torch.allclose(g, other, rtol=1e-6, atol=1e-9), (name, key)
